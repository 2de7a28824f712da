"""The step fill as one compiled call (numba, which vLLM 0.26 requires), for steps whose tapped
requests all take a word of positions (`TAPC_FILL=compiled`; lists of positions keep fill.py's).

fill.py's numpy fill makes about 40 numpy calls a step on arrays of tens to hundreds of entries,
each mostly call overhead: 0.16 ms for bench_host's served batch on a 2-core Xeon, 0.30 ms on the
H200 machine's host (third session of 2026-12-02), on the engine's one thread every step. Here the
records' values are gathered with a few calls and one compiled loop writes the same tables,
pool rows and segments (tests/test_engine_tables.py compares the two).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from tapc.engine.fill import Segment
from tapc.engine.layout import Layout
from tapc.engine.positions import NO_END
from tapc.engine.records import Record
from tapc.engine.step import StepBatch

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
def _fill(table, padded, qsl, computed, plens, idx, lo, hi, slot, cap_j, cap_group, n_caps, bound,
          at_codes, always, used, first, counts, base):
    """table[:, :padded] for one step; per tapped request i: its first captured position
    (`first`), its rows captured (`counts`) and its first pool row in each group (`base`);
    `used` (rows of each group's pool) moves on."""
    table[:, :padded] = -1
    num_caps = cap_j.shape[1]
    for i in range(idx.shape[0]):
        b = idx[i]
        start, step_first = qsl[b], np.int64(computed[b])
        end = step_first + qsl[b + 1] - start
        top = min(hi[i], end)
        first[i] = min(max(lo[i], step_first), top)
        counts[i] = top - first[i]
    for g in range(used.shape[0]):
        u = used[g]
        for i in range(idx.shape[0]):
            base[i, g] = u
            u += counts[i] * n_caps[i, g]
        used[g] = u
    for i in range(idx.shape[0]):
        n = counts[i]
        if n == 0:
            continue
        b = idx[i]
        row = qsl[b] + first[i] - computed[b]
        for c in range(num_caps):
            j = cap_j[i, c]
            if j < 0:
                continue
            g = cap_group[c]
            nc = n_caps[i, g]
            for t in range(n):   # position-major: row t's captures are nc pool rows apart
                table[c, row + t] = base[i, g] + t * nc + j
    for i in range(idx.shape[0]):
        if slot[i] < 0:
            continue
        b = idx[i]
        _edit_rows(table, num_caps, qsl[b], computed[b], qsl[b + 1] - qsl[b], plens[b], bound[i], at_codes, slot[i])
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
        self.layout = layout
        self.cap_group = layout.cap_group.astype(np.int64)
        self.at_codes = np.array([AT_CODES[a] for a in layout.edit_at], dtype=np.int64)
        self.always = np.zeros(len(layout.edits), dtype=np.bool_)
        self.always[layout.always] = True
        # compiled now, for the argument types every step passes (the batch's arrays as int64),
        # not on the first tapped step (about a second; numba's cache makes it once a machine)
        none, groups = np.zeros(0, dtype=np.int64), len(layout.groups)
        _fill(np.zeros((layout.num_tables, 1), dtype=np.int32), 1, np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64),
              np.zeros(1, dtype=np.int64), none, none, none, none, np.zeros((0, len(layout.captures)), dtype=np.int64),
              self.cap_group, np.zeros((0, groups), dtype=np.int64), np.zeros((0, len(layout.edits)), dtype=np.bool_),
              self.at_codes, self.always, np.zeros(groups, dtype=np.int64), none, none,
              np.zeros((0, groups), dtype=np.int64))

    def __call__(self, table: np.ndarray, tapped: list[tuple[int, Record]], batch: StepBatch):
        layout, n = self.layout, len(tapped)
        recs = [rec for _, rec in tapped]
        if not n or any(rec.stores and rec.span is None for rec in recs):
            return None
        groups = len(layout.groups)
        idx = np.fromiter((i for i, _ in tapped), np.int64, n)
        lo = np.maximum(np.fromiter((rec.cap_lo for rec in recs), np.int64, n),
                        np.fromiter((rec.next_pos for rec in recs), np.int64, n))
        hi = np.fromiter((rec.cap_hi for rec in recs), np.int64, n)
        slot = np.fromiter((rec.slot for rec in recs), np.int64, n)
        n_caps = np.fromiter((k for rec in recs for k in rec.n_caps), np.int64, n * groups).reshape(n, groups)
        cap_j = np.concatenate([rec.cap_j for rec in recs]).reshape(n, len(layout.captures))
        bound = np.concatenate([rec.edit_mask for rec in recs]).reshape(n, len(layout.edits))
        used = np.zeros(groups, dtype=np.int64)
        first, counts = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        base = np.empty((n, groups), dtype=np.int64)
        as64 = np.int64
        _fill(table, batch.padded, batch.query_start_loc.astype(as64), batch.num_computed.astype(as64),
              batch.prompt_lens.astype(as64), idx, lo, hi,
              slot, cap_j, self.cap_group, n_caps, bound, self.at_codes, self.always, used, first, counts, base)
        hit = np.flatnonzero(counts)
        for k, p in zip(hit.tolist(), (first[hit] + counts[hit]).tolist()):
            recs[k].next_pos = p
        segments: list[Segment] = []
        for g in range(groups):
            block = counts * n_caps[:, g]
            starts, sizes = base[:, g].tolist(), counts.tolist()
            segments += [Segment(recs[k].store_of[g], starts[k], sizes[k]) for k in np.flatnonzero(block).tolist()]
        return segments, used.tolist()
