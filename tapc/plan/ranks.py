"""One GPU's part of a plan under tensor and pipeline parallelism, as plain data.

Every worker gets the same plan (the single-GPU taps, widths and keys, plus `plan.shards`,
tapc/plan/sharding.py's map of each point). `rank_taps(taps, shards, tp_rank, stage)` is what the
worker at (tensor-parallel rank, pipeline stage) installs, and what tapc/plan/sizing.py sizes per
GPU:
- only the taps of the layers its stage holds (vLLM puts `PPMissingLayer` elsewhere);
- captures only where it writes columns (`RankShard.writes`): a replicated point is captured
  by one tensor-parallel rank of its stage (layer % N inside the decoder layers, else rank 0),
  a sharded point by every rank that writes some of it,
  at the rank's local width (the API places the columns, session.py);
- edits on every rank that holds columns of the point, at its local width, literal vectors
  and columns mapped to its own (`local_args`); a `set`/`zero` whose literal columns are all
  on other ranks is left out there;
- Python blocks on every rank of the stage, with the same input: at a sharded point the
  runtime all-gathers the ranks' columns into whole rows first (tapc/worker/runtime.py `Sharded`).
Named parameters bound per request are mapped the same way when a request's values are
written (`local_args`, tapc/worker/buffers.py `ParamTables`).

numpy only (no torch), so the plan and `tapc explain` can size ranks without a GPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tapc.lang.edits import EDITS, patch_rows, patch_wire
from tapc.plan.sharding import local_columns, local_vector
from tapc.plan.shards import PointShard
from tapc.plan.tapplan import BLOCK, Arg, PlannedTap


def rank_taps(taps, shards: dict[str, PointShard], tp_rank: int, stage: int) -> tuple[PlannedTap, ...]:
    """The taps of `taps` (plan order) the GPU at (tp_rank, stage) installs, at its local widths."""
    return tuple(t for _, t in indexed_rank_taps(taps, shards, tp_rank, stage))


def indexed_rank_taps(taps, shards: dict[str, PointShard], tp_rank: int, stage: int) -> list[tuple[int, PlannedTap]]:
    """`rank_taps`, each with its index in `taps`."""
    out = []
    for i, tap in enumerate(taps):
        shard = shards[tap.key]
        if shard.stage != stage:
            continue
        part = shard.ranks[tp_rank]
        if tap.action == "capture":
            if part.writes:
                out.append((i, dataclasses.replace(tap, width=part.local_width) if shard.sharded else tap))
            continue
        if tap.kind == BLOCK or not shard.sharded:
            out.append((i, tap))
            continue
        local = _local_literals(tap, shard, tp_rank)
        if local is not None:
            out.append((i, local))
    return out


def local_args(shard: PointShard, tp_rank: int, action: str, values: dict) -> dict:
    """An edit's argument values (name -> literal or request wire value) at a sharded point,
    mapped to the rank's local columns: vectors sliced (`local_vector`), columns to local ones
    with their per-column values picked alike (`local_columns`; none left: the rank edits
    nothing). A single value for every column stays as it is."""
    kinds = EDITS[action].kinds()
    out = dict(values)
    for name, v in values.items():
        if kinds.get(name) == "vector":
            as_bytes = isinstance(v, bytes)
            whole = np.frombuffer(v, dtype=np.float32) if as_bytes else np.asarray(v, dtype=np.float64)
            part = local_vector(shard, tp_rank, whole)
            out[name] = part.astype(np.float32).tobytes() if as_bytes else tuple(float(x) for x in part)
        elif kinds.get(name) == "rows":   # patch(): each row's columns, as a vector's
            positions, rows = patch_rows(v)
            out[name] = patch_wire(positions, local_vector(shard, tp_rank, rows))
    cols = values.get("cols")
    if cols is not None:
        local, picked = local_columns(shard, tp_rank, list(cols))
        out["cols"] = tuple(local) if isinstance(cols, tuple) else local
        value = values.get("value")
        if isinstance(value, (list, tuple)) and len(value) == len(cols) and len(value) > 1:
            out["value"] = type(value)(value[i] for i in picked)
    return out


def _local_literals(tap: PlannedTap, shard: PointShard, tp_rank: int) -> PlannedTap | None:
    """An edit at a sharded point with its literal arguments mapped to the rank (None: literal
    columns all on other ranks). A literal `value` list stays global while its columns are a
    request's parameter: it is mapped with them when the request's values are written."""
    by_name = {a.name: a for a in tap.args}
    cols = by_name.get("cols")
    literal = {a.name: a.value for a in tap.args if a.param is None and a.name != "at"
               and not (a.name == "value" and cols is not None and cols.param is not None)}
    local = local_args(shard, tp_rank, tap.action, literal)
    if cols is not None and cols.param is None and not local["cols"]:
        return None
    args = tuple(Arg(a.name, a.kind, a.param, local[a.name]) if a.name in local else a for a in tap.args)
    return dataclasses.replace(tap, args=args, width=shard.ranks[tp_rank].local_width)

