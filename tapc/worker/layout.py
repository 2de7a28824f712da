"""The plan's in-graph taps as rows of the per-step tables, and captures grouped into pools.

Before each forward the host fills one int32 row table per tap (`table[k, row]`), and the
graphs read them on the device:

- capture c (a READ tap): the row of its group's pool the row goes to, -1 to skip it;
- edit e (an EDIT tap): the slot of the request's parameters in the per-slot tables, -1 to
  leave the row alone;
- and, where there are captures, one more (`ring_row`): the position a row's ring started at,
  -1 for a row in none (tapc/kernels/capture.py, rings.py).

Captures of one width and dtype share a pool (a *group*). A request's rows are laid out
position-major, `[rows, its captures in the group, width]`, so that one step's block of one
request is one contiguous run of the pool and lands with one copy in that request's host
storage, which has the same layout (storage.py). Padding rows and requests that ask for nothing
stay -1 (fill.py).

Under tensor / pipeline parallelism each worker's layout holds its own GPU's taps
(tapc/plan/ranks.py: its stage's layers, captures it writes, local widths); `localize[e]` maps a
request's values of edit e's parameters to the GPU's columns (None: the point is replicated).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tapc.plan.pattern import is_pattern, keys_of
from tapc.plan.ranks import local_args, rank_taps
from tapc.plan.sizing import is_logit_edit
from tapc.plan.tapplan import BLOCK, EDIT, ENGINE, READ, TapPlan


@dataclass(frozen=True)
class Group:
    """Captures that share one pool: same width, same dtype."""

    width: int
    dtype: str
    caps: tuple[int, ...]          # capture indices, in plan order


class Layout:
    """The plan's in-graph taps as table rows: capture c is row c, edit e is row C + e."""

    def __init__(self, plan: TapPlan, tp_rank: int = 0, stage: int = 0):
        shards = plan.shard_map
        taps = rank_taps(plan.taps, shards, tp_rank, stage) if shards else plan.taps
        self.tp_rank, self.stage, self.shards = tp_rank, stage, shards
        self.captures = tuple(t for t in taps if t.kind == READ)
        self.edits = tuple(t for t in taps if t.kind == EDIT)
        self.blocks = tuple(t for t in taps if t.kind == BLOCK)     # boundary op k is blocks[k]
        self.engine = tuple(t for t in taps if t.kind == ENGINE)    # logits / samples: in the runner
        # Capture keys of the whole plan: a request may ask for one this GPU does not write.
        self.plan_captures = frozenset(t.key for t in plan.taps if t.action == "capture")
        # attention patterns: the keys a row holds, which bound the positions a request may ask
        self.pattern_keys = {t.key: keys_of(t) for t in plan.taps if is_pattern(t)}
        self.plan_order = {id(t): i for i, t in enumerate(taps)}
        self.cap_index = {t.key: i for i, t in enumerate(self.captures)}
        groups: dict[tuple[int, str], list[int]] = {}
        for i, t in enumerate(self.captures):
            groups.setdefault((t.width, t.dtype), []).append(i)
        self.groups = tuple(Group(w, d, tuple(c)) for (w, d), c in groups.items())
        self.cap_group = np.zeros(len(self.captures), dtype=np.int64)
        for g, group in enumerate(self.groups):
            self.cap_group[list(group.caps)] = g
        self.ring_row = len(self.captures) + len(self.edits)       # after the captures' and edits' rows
        self.table_rows = self.ring_row + bool(self.captures)      # rows of the device table
        self.edit_at = _at(self.edits)
        self.edit_params = _param_names(self.edits)
        # Edits of the logits, in the runner (points.py): the same ops over the step's logits rows.
        self.logit_edits = tuple(t for t in self.engine if is_logit_edit(t))
        self.logit_edit_at = _at(self.logit_edits)
        self.logit_edit_params = _param_names(self.logit_edits)
        # Edits without parameters are part of the engine's model: they apply to every request.
        self.always = [e for e, names in enumerate(self.edit_params) if not names]
        self.localize = [_localizer(shards.get(t.key), tp_rank, t.action) for t in self.edits]

    def edit_row(self, e: int) -> int:
        return len(self.captures) + e

    @staticmethod
    def taps_mask(rows) -> int:
        """Table rows as a bitmask (bit k: row k), the form switch.py compares per step."""
        mask = 0
        for k in rows:
            mask |= 1 << k
        return mask


def _at(taps) -> list:
    """Each edit's `at=`: which rows of its request it edits (positions.py)."""
    return [next((a.value for a in t.args if a.name == "at"), "all") for t in taps]


def _param_names(taps) -> list[tuple[str, ...]]:
    """Each edit's parameter names: a request that binds all of them gets the edit (records.py)."""
    return [tuple(a.param for a in t.args if a.param is not None) for t in taps]


def _localizer(shard, tp_rank: int, action: str):
    """values -> the GPU's values, for an edit at a sharded point (else None)."""
    if shard is None or not shard.sharded:
        return None
    return lambda values: local_args(shard, tp_rank, action, values)
