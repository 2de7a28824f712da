"""What an engine allocates on the device for a plan: one account for the engine and for `explain`.

The worker allocates, once, before vLLM's first forward (tapc/worker/buffers.py, tapc/worker/copyout.py):
- per capture tap: its rows of its group's pool, `[rows, width]` of the capture dtype, and as
  much again for the pool's snapshot (copy-out reads the snapshot while the next step writes
  the pool), and `max_num_seqs` rows more for decode steps' own snapshot where that is fewer
  than `rows` (`small_snapshot_rows`);
- per capture and per in-graph edit tap: an int32 row table of `rows` entries, and one more
  for a plan with captures (the rings' starts, tapc/worker/layout.py), counted with its first;
- per edit: its parameter tables, `[slots, ...]` each (tapc/lang/edits.py `tables`), with
  `slots = SLOTS_PER_SEQ * max_num_seqs`; a named vector or scalar table is one table for every
  edit that uses the name (counted at the first);
- for a plan with a logit lens: one scratch of `rows` candidate rows, int32 ids and float32
  values (tapc/plan/lens.py `scratch_columns`), counted with the first lens capture;
- per `logits` edit: its parameter tables, and an int32 row of `max_num_seqs` entries mapping
  the step's logits rows to slots.
`rows` is max_num_batched_tokens. Under tensor / pipeline parallelism every GPU allocates this
for its own part of the plan (tapc/plan/ranks.py: its stage, local widths), and `gpu_bytes` says
what the most loaded GPU allocates. Captures of `logits` / `samples` are kept per step on the
device until collected (a row per generated token): not preallocated, not counted here. Nor is
host memory: the pinned staging buffers of the row tables and of parameter rows
(tapc/worker/buffers.py `Staging`, 8 MiB), and the captures' arena in /dev/shm
(tapc/wire/arena.py), which grows with what requests ask for; `host_row_bytes` says how fast.
"""
from __future__ import annotations

from tapc.lang.edits import CALL, EDITS, Table, tables
from tapc.plan.lens import is_lens, scratch_columns
from tapc.plan.ranks import indexed_rank_taps
from tapc.plan.tapplan import EDIT, ENGINE, READ, PlannedTap

# The plan sizes buffers and tables for these unless the caller sets them; the engine gets the
# same values (vLLM's own defaults depend on the GPU).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256

# Parameter slots per scheduled request: a finished request's slot comes back with the next
# step, so a full batch of new requests can briefly need more than max_num_seqs.
SLOTS_PER_SEQ = 2

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}
ROW_ENTRY = 4   # int32 row tables


def param_slots(max_num_seqs: int) -> int:
    return SLOTS_PER_SEQ * max_num_seqs


def small_snapshot_rows(rows: int, max_num_seqs: int) -> int:
    """Rows a capture of the decode steps' snapshot (tapc/worker/copyout.py), which lets a decode
    step copy out while the prompt step before it still does; none when the pools are no larger."""
    return max_num_seqs if max_num_seqs < rows else 0


def is_logit_edit(tap: PlannedTap) -> bool:
    return tap.kind == ENGINE and tap.action in EDITS


def edit_tables(taps) -> list[tuple[tuple[Table, bool], ...]]:
    """Per edit tap, its tables in its op's order, each with whether this tap allocates it
    (False: a named table an earlier tap of `taps` allocated)."""
    seen: set[tuple] = set()
    out = []
    for tap in taps:
        mine = []
        for table in tables(tap.action, tap.args, tap.width):
            first = table.share is None or table.share not in seen
            if table.share is not None:
                seen.add(table.share)
            mine.append((table, first))
        out.append(tuple(mine))
    return out


def tap_bytes(taps, rows: int, max_num_seqs: int) -> list[int]:
    """Device bytes the engine allocates for each tap of a plan (`taps` in plan order)."""
    slots = param_slots(max_num_seqs)
    out = [0] * len(taps)
    first = next((i for i, tap in enumerate(taps) if tap.kind == READ), None)
    for i, tap in enumerate(taps):
        if tap.kind == READ:
            snapshots = rows + small_snapshot_rows(rows, max_num_seqs)
            tables = 2 if i == first else 1
            out[i] = (rows + snapshots) * tap.width * ITEMSIZE[tap.dtype] + tables * rows * ROW_ENTRY
    for kind, per_row in ((EDIT, rows), (ENGINE, max_num_seqs)):
        index = [i for i, t in enumerate(taps) if t.kind == kind and (t.action in EDITS or t.action == CALL)]
        for i, own in zip(index, edit_tables([taps[i] for i in index])):
            out[i] = per_row * ROW_ENTRY + sum(slots * t.nbytes_per_slot for t, first in own if first)
    lens = next((i for i, tap in enumerate(taps) if is_lens(tap)), None)
    if lens is not None:   # the candidates' scratch, int32 ids and float32 values: counted with the first
        out[lens] += rows * scratch_columns(taps) * 8
    return out


def gpu_bytes(taps, shards: dict, tp: int, pp: int, rows: int, seqs: int) -> tuple[list[int], int]:
    """Device bytes per tap on the GPU that allocates most for it, and the most any GPU allocates
    for the plan: every GPU sized as it allocates (tapc/plan/ranks.py, local widths). `shards`: the
    plan's map by key (empty on one GPU)."""
    if not shards:
        sizes = tap_bytes(taps, rows, seqs)
        return sizes, sum(sizes)
    per_tap = [0] * len(taps)
    total = 0
    for pairs in _gpu_parts(taps, shards, tp, pp):
        sizes = tap_bytes([t for _, t in pairs], rows, seqs)
        total = max(total, sum(sizes))
        for (i, _), n in zip(pairs, sizes):
            per_tap[i] = max(per_tap[i], n)
    return per_tap, total


def _gpu_parts(taps, shards: dict, tp: int, pp: int):
    """Each GPU's (index, tap) pairs of the plan (tapc/plan/ranks.py), stage by stage."""
    for stage in range(pp):
        for rank in range(tp):
            yield indexed_rank_taps(taps, shards, rank, stage)


def host_row_bytes(taps, shards: dict, tp: int, pp: int) -> int:
    """Host bytes one token's in-graph captures take in the arena (tapc/wire/arena.py) of the GPU
    that takes most, when a request captures every one of them: what `capture_memory_gib` is
    sized by (rows held times this)."""
    def row(part) -> int:
        return sum(t.width * ITEMSIZE[t.dtype] for t in part if t.kind == READ and t.action == "capture")

    if not shards:
        return row(taps)
    return max(row(t for _, t in pairs) for pairs in _gpu_parts(taps, shards, tp, pp))
