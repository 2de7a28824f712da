"""Harvests to shards for SAE training: the run (`run`), the engine kept fed (`feed`), shards
written through (`writer`, `shardfiles`), text read and packed (`corpus`), hook names for the
trainers (`hooknames`) and progress (`progress`). Over many engines, on Ray (`cluster`): the
input in parts (`parts`), read as a Ray dataset (`dataset`), the engines' factories (`engines`)
and where the parts go (`store`). `tapc.data` reads them back."""
