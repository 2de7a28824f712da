"""Harvests to shards for SAE training: the run (`run`), the engine kept fed (`feed`), shards
written through (`writer`, `shardfiles`), text read and packed (`corpus`), hook names for the
trainers (`hooknames`), several GPUs (`fleet`) and progress (`progress`). `tapc.data` reads them
back."""
