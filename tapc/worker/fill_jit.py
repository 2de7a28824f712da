"""The step fill as one compiled call (numba, which vLLM 0.26 requires), for steps whose tapped
requests all take a word of positions (the engine's fill; lists of positions keep fill.py's).

fill.py's numpy fill makes about 40 numpy calls a step on arrays of tens to hundreds of entries,
each mostly call overhead: about 0.1 ms for bench_host's served batch on a 2-core Xeon, 0.30 ms
on the H200 machine's host (bench_host, 2026-12-02), on the engine's one thread every step.
Here each record's values are one row, made once (`Record.fill_row`), a step gathers them
with a few calls, and one compiled loop writes the same tables, pool rows and segments (the
fill's reference tests run both: tests/worker/test_tables.py, tests/api/test_engine.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from tapc.wire.positions import NO_END
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.step import Segment, StepBatch

# an edit's `at` word as the compiled loop reads it (positions.interval's words)
AT_CODES = {"all": 0, "prompt": 1, "generated": 2, "last": 3}


@njit(cache=True)
def _interval(code, plen):
    if code == 0:
        return np.int64(0), NO_END
    if code == 1:
        return np.int64(0), plen
    if code == 2:
        return plen, NO_END
    return plen - 1, plen


@njit(cache=True)
def _fill(table, padded, qsl, computed, plens, idx, next_pos, slot, rows, cap_group, at_codes, always,
          used, first, counts, base, phases, ring_row):
    """table[:, :padded] for one step; per tapped request i (its `Record.fill_row` in `rows`, its
    next position and slot): its first captured position (`first`), its rows captured
    (`counts`) and its first pool row in each group (`base`); `used` (rows of each group's pool)
    moves on. `phases` > 1: a ring's first step (rings.py), each block room for that
    many steps and each captured row's position in table row `ring_row`."""
    table[:, :padded] = -1
    num_caps, groups = cap_group.shape[0], used.shape[0]
    caps_at = 2 + groups                 # a fill_row: cap_lo, cap_hi, n_caps[G], cap_j[C], bound[E]
    for i in range(idx.shape[0]):
        b = idx[i]
        step_first = np.int64(computed[b])
        top = min(rows[i, 1], step_first + qsl[b + 1] - qsl[b])
        first[i] = min(max(rows[i, 0], next_pos[i], step_first), top)
        counts[i] = top - first[i]
    for g in range(groups):
        u = used[g]
        for i in range(idx.shape[0]):
            base[i, g] = u
            u += counts[i] * rows[i, 2 + g] * phases
        used[g] = u
    for i in range(idx.shape[0]):
        n = counts[i]
        if n == 0:
            continue
        b = idx[i]
        row = qsl[b] + first[i] - computed[b]
        for c in range(num_caps):
            j = rows[i, caps_at + c]
            if j < 0:
                continue
            g = cap_group[c]
            nc = rows[i, 2 + g]
            for t in range(n):   # position-major: row t's captures are nc pool rows apart
                table[c, row + t] = base[i, g] + t * nc + j
        if phases > 1:
            for t in range(n):
                table[ring_row, row + t] = first[i] + t
    for i in range(idx.shape[0]):
        if slot[i] < 0:
            continue
        b = idx[i]
        _edit_rows(table, num_caps, qsl[b], computed[b], qsl[b + 1] - qsl[b], plens[b],
                   rows[i, caps_at + num_caps:], at_codes, slot[i])
    for e in range(always.shape[0]):   # parameterless edits: every request's rows, slot 0
        if always[e]:
            for b in range(qsl.shape[0] - 1):
                _edit_one(table, num_caps + e, qsl[b], computed[b], qsl[b + 1] - qsl[b], plens[b], at_codes[e], 0)


@njit(cache=True)
def _edit_rows(table, num_caps, start, step_first, rows, plen, bound, at_codes, slot):
    for e in range(bound.shape[0]):
        if bound[e]:
            _edit_one(table, num_caps + e, start, step_first, rows, plen, at_codes[e], slot)


@njit(cache=True)
def _edit_one(table, k, start, step_first, rows, plen, code, value):
    lo, hi = _interval(code, np.int64(plen))
    for t in range(rows):
        p = np.int64(step_first) + t
        if lo <= p < hi:
            table[k, start + t] = value


class CompiledFill:
    """`fill.fill_step` for one layout, by `_fill`, for a step whose tapped requests all capture
    a word of positions (None for another: fill.py's fill takes it)."""

    def __init__(self, layout: Layout):
        self.groups = len(layout.groups)
        self.width = 2 + self.groups + len(layout.captures) + len(layout.edits)   # of a Record.fill_row
        self.cap_group = layout.cap_group.astype(np.int64)
        self.at_codes = np.array([AT_CODES[a] for a in layout.edit_at], dtype=np.int64)
        self.always = np.zeros(len(layout.edits), dtype=np.bool_)
        self.always[layout.always] = True
        self.ring_row = layout.ring_row
        # compiled now, for the argument types every step passes (the batch's arrays as int64),
        # not on the first tapped step (about a second; numba's cache makes it once a machine)
        one, none = np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
        _fill(np.zeros((layout.table_rows, 1), dtype=np.int32), 1, np.zeros(2, dtype=np.int64), one, one, none,
              none, none, np.zeros((0, self.width), dtype=np.int64), self.cap_group, self.at_codes,
              self.always, np.zeros(self.groups, dtype=np.int64), none, none, np.zeros((0, self.groups), dtype=np.int64),
              1, self.ring_row)

    def __call__(self, table: np.ndarray, tapped: list[tuple[int, Record]], batch: StepBatch, phases: int = 1):
        n = len(tapped)
        recs = [rec for _, rec in tapped]
        if not n or any(rec.stores and rec.span is None for rec in recs):
            return None
        idx = np.fromiter((i for i, _ in tapped), np.int64, n)
        next_pos = np.fromiter((rec.next_pos for rec in recs), np.int64, n)
        slot = np.fromiter((rec.slot for rec in recs), np.int64, n)
        rows = np.concatenate([rec.fill_row for rec in recs]).reshape(n, self.width)
        used = np.zeros(self.groups, dtype=np.int64)
        first, counts = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        base = np.empty((n, self.groups), dtype=np.int64)
        _fill(table, batch.padded, batch.query_start_loc.astype(np.int64), batch.num_computed.astype(np.int64),
              batch.prompt_lens.astype(np.int64), idx, next_pos, slot, rows, self.cap_group, self.at_codes,
              self.always, used, first, counts, base, phases, self.ring_row)
        hit = np.flatnonzero(counts)
        for k, p in zip(hit.tolist(), (first[hit] + counts[hit]).tolist()):
            recs[k].next_pos = p
        segments: list[Segment] = []
        sizes = counts.tolist()
        for g in range(self.groups):
            starts = base[:, g].tolist()
            segments += [Segment(recs[k].store_of[g], starts[k], sizes[k])
                         for k in np.flatnonzero(counts * rows[:, 2 + g]).tolist()]
        return segments, used.tolist()
