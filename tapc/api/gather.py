"""The `tapc_collect` replies of every GPU and engine, gathered into one result per request.

One reply per worker: under tensor and pipeline parallelism each GPU holds its part of a
request's rows, and under data parallelism only the engine that ran the request has any. A
request's parts become one `Result` here; a sharded point's columns become one tensor in the
single-GPU layout (`place`) when the session assembles its outputs. Chunks no one will see
(another engine's, a failed request's) are handed to `discard`, so that they go back.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from tapc.errors import EngineError, ProtocolError
from tapc.wire.protocol import CollectReply, Result

Discard = Callable[[Result], None]


def gathered(replies, tp: int, pp: int, discard: Discard) -> dict[str, Result]:
    """The replies (wire form) by tapc id: one reply, or a list of one per worker (in rank
    order; under data parallelism each engine's in turn), merged into one result per request
    from the engine that ran it."""
    if isinstance(replies, Mapping):
        replies = [replies]
    per_rank = [CollectReply.from_wire(r).by_id() for r in replies]
    gpus = tp * pp
    if not per_rank or len(per_rank) % gpus:
        raise ProtocolError(f"{len(per_rank)} tapc_collect replies for engines of {gpus} GPUs each: pass "
                            "one reply per worker of every engine")
    engines = [per_rank[i: i + gpus] for i in range(0, len(per_rank), gpus)]
    if len(engines) == 1 and gpus == 1:
        return per_rank[0]
    ids = dict.fromkeys(tid for got in per_rank for tid in got)
    return {tid: _from_engines(tid, engines, tp, discard) for tid in ids}


def _from_engines(tid: str, engines: list[list[dict[str, Result]]], tp: int, discard: Discard) -> Result:
    """One request's result from the engine whose workers ran it: an engine whose every
    worker never had it (data parallelism: another engine ran it) is passed over; with
    none left, the first engine's answer (that no engine has it)."""
    ran = [e for e in engines if not all(got.get(tid) is not None and got[tid].unknown for got in e)]
    for extra in ran[1:]:   # one engine runs a request; another's rows for it would be a bug: given back
        for got in extra:
            if got.get(tid) is not None:
                discard(got[tid])
    group = ran[0] if ran else engines[0]
    if len(group) == 1 and tid in group[0]:   # one GPU an engine: its result as it is
        return group[0][tid]
    return merge(tid, [got.get(tid) for got in group], tp, discard)


def merge(tid: str, results: Sequence[Result | None], tp: int, discard: Discard) -> Result:
    """One request's results from every worker (global rank order: stage-major, tensor-parallel
    rank inner, as vLLM numbers them) as one. A request that failed on any GPU fails as a
    whole, and the chunks the other GPUs hold for it go back. Engine points come from the
    one GPU that keeps them (the last stage's first rank); blocks' saved values from the
    first rank of each stage (every rank of a stage runs the block on the same input)."""
    failed = next(((r, res) for r, res in enumerate(results) if res is None or res.error is not None), None)
    if failed is not None:
        for res in results:
            if res is not None:
                discard(res)
        rank, res = failed
        why = "its reply has no result for this request" if res is None else res.error
        return Result(tid, error=f"on GPU {rank} (pipeline stage {rank // tp}, tensor-parallel rank {rank % tp}): "
                                 f"{why}")
    saved: dict = {}
    for rank, res in enumerate(results):
        if rank % tp == 0:
            saved.update(res.saved)
    engine = {k: t for res in results for k, t in res.engine.items()}
    block_error = next((res.block_error for res in results if res.block_error is not None), None)
    return Result(tid, stores=tuple(st for res in results for st in res.stores), engine=engine, saved=saved,
                  block_error=block_error)


def place(shard, parts: list[tuple[int, torch.Tensor]], request_id: str) -> torch.Tensor:
    """A sharded point's `[rows, width]` in the single-GPU layout from each writing rank's local
    `[rows, local width]` (tapc/plan/sharding.py `writes`: every column from exactly one rank). A host
    copy, so the ranks' arena chunks go back as soon as the views here are dropped."""
    got = dict(parts)
    writers = [r.rank for r in shard.ranks if r.writes]
    missing = [r for r in writers if r not in got]
    if missing or len(got) != len(parts):
        raise EngineError(f"request {request_id}: {shard.key} is sharded over {shard.tp} GPUs, but the engine's "
                          f"replies lack the columns of tensor-parallel rank(s) {missing or 'given twice'}")
    rows = {t.shape[0] for t in got.values()}
    if len(rows) != 1:
        raise EngineError(f"request {request_id}: {shard.key}: the GPUs captured {sorted(rows)} rows")
    first = got[writers[0]]
    whole = torch.empty((rows.pop(), shard.width), dtype=first.dtype)
    for r in writers:
        local = got[r]
        for dst, src, n in shard.ranks[r].writes:
            whole[:, dst:dst + n] = local[:, src:src + n]
    return whole
