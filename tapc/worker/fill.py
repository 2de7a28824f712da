"""The host's work before each forward: the step's row tables from the batch layout.

vLLM runs one flat `[num_tokens, width]` slab per step, requests back to back, padded up to a
CUDA-graph size; a runner adapter (runner_v2.py) describes it as a `StepBatch`. `fill_step`
writes one row of `table` per in-graph tap (layout.py says what the entries mean) for the
tapped requests of the step, and returns the capture segments to copy out after the forward
(segmentcopy.copy_segments). It works on host arrays only; tables.py uploads the table and runs the
copies.
"""
from __future__ import annotations

import functools

import numpy as np

from tapc.wire.positions import NO_END, interval, select
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.step import Segment, StepBatch


def tapped_of(records: dict[str, Record], batch: StepBatch) -> list[tuple[int, Record]]:
    """The step's tapped requests as (place in the batch, record), in batch order; `records` maps
    vLLM request ids to tapped requests. Found once a step (the components and the fill read it)."""
    get = records.get
    return [(i, rec) for i, rid in enumerate(batch.req_ids) if (rec := get(rid)) is not None]


def fill_step(layout: Layout, table: np.ndarray, tapped: list[tuple[int, Record]],
              batch: StepBatch, phases: int = 1) -> tuple[list[Segment], list[int]]:
    """Write `table[:, :batch.padded]` for one step; return the capture segments to copy out
    after the forward and the rows used in each group's pool. `tapped`: the step's tapped
    requests (`tapped_of`; the others are left alone). `phases` > 1: the step starts a ring of
    that many steps (a ring, rings.py): each block gets room for that many, each captured row's position
    goes into the ring row (rings.py).

    It works on arrays over all the requests' rows at once (one fancy assignment per group and
    per edit, a fixed number of numpy calls). The engine fills most steps with the compiled
    fill (fill_jit.py), which writes the same tables in one call; this one is its reference and
    fills the steps it declines (lists of positions).
    """
    table[:, :batch.padded] = -1
    used = [0] * len(layout.groups)
    segments: list[Segment] = []
    if tapped:
        reqs = _Requests(tapped, batch.query_start_loc, batch.num_computed)
        if any(rec.stores for rec in reqs.recs):
            segments = _fill_captures(layout, table, reqs, used, phases)
        if any(rec.slot >= 0 and rec.edits for rec in reqs.recs):
            _fill_edits(layout, table[:, :batch.padded], reqs)
    if layout.always:
        _fill_always(layout, table, batch)
    return segments, used


class _Requests:
    """The step's tapped requests (in batch order) as arrays: each one's first row in the batch,
    the position of that row and the position past its last row this step.
    A word of positions covers one interval of a request's positions, so the rows it selects in
    a step are one run, found without a row-by-row mask (`rows`)."""

    def __init__(self, tapped: list[tuple[int, Record]], query_start_loc: np.ndarray, num_computed: np.ndarray):
        idx = np.fromiter((i for i, _ in tapped), np.int64, len(tapped))
        self.recs = [rec for _, rec in tapped]
        self.row = query_start_loc[idx].astype(np.int64)
        self.first = num_computed[idx].astype(np.int64)
        self.end = self.first + (query_start_loc[idx + 1] - query_start_loc[idx])

    @functools.cached_property
    def plen(self) -> np.ndarray:
        """Each one's prompt length (the edits' words need it; a capture's interval is its record's)."""
        return np.fromiter((rec.prompt_len for rec in self.recs), np.int64, len(self.recs))

    def rows(self, lo, hi) -> tuple[np.ndarray, np.ndarray]:
        """Each request's rows whose positions are in [lo, hi) (per request, or one for all), in
        request order, and how many each has."""
        b = np.minimum(hi, self.end)
        a = np.minimum(np.maximum(lo, self.first), b)   # (a request with none: a == b, within its rows)
        counts = b - a
        total = int(counts.sum())
        runs = np.repeat(self.row + a - self.first - (np.cumsum(counts) - counts), counts)
        return runs + np.arange(total), counts

    def positions(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The positions of rows that `rows` gave with these counts."""
        return rows + np.repeat(self.first - self.row, counts)


def _fill_captures(layout: Layout, table: np.ndarray, reqs: _Requests, used: list[int],
                   phases: int = 1) -> list[Segment]:
    recs = reqs.recs
    # The positions each request captures this step: its word's (`Record.cap_lo`, `cap_hi`), from
    # the first it has not yet captured (a list's: every one from there, picked below).
    n = len(recs)
    lo = np.maximum(np.fromiter((rec.cap_lo for rec in recs), np.int64, n),
                    np.fromiter((rec.next_pos for rec in recs), np.int64, n))
    rows, counts = reqs.rows(lo, np.fromiter((rec.cap_hi for rec in recs), np.int64, n))
    lists = [k for k, rec in enumerate(recs) if rec.stores and rec.span is None]
    if lists:   # a list of positions takes some rows of its run: each such run cut down (rare: one call a request)
        cuts = np.cumsum(counts)[:-1]
        runs, pos = np.split(rows, cuts), np.split(reqs.positions(rows, counts), cuts)
        for k in lists:
            runs[k] = runs[k][select(recs[k].positions, pos[k], recs[k].prompt_len)]
            counts[k] = runs[k].size
        rows = np.concatenate(runs)
    if not rows.size:
        return []
    ends = np.cumsum(counts)
    hit = np.flatnonzero(counts)
    last = rows[ends[hit] - 1] + reqs.first[hit] - reqs.row[hit]   # each request's last position captured
    for k, p in zip(hit.tolist(), last.tolist()):
        recs[k].next_pos = p + 1
    offs = ends - counts
    rank = np.arange(rows.size) - np.repeat(offs, counts)   # a row's place in its request's run
    if phases > 1:   # a ring's first step: each row's position, the capture kernels' phase 0
        table[layout.ring_row, rows] = reqs.positions(rows, counts)
    segments: list[Segment] = []
    for g in range(len(layout.groups)):
        stores = [rec.store_of[g] for rec in recs]
        n_caps = np.fromiter((rec.n_caps[g] for rec in recs), np.int64, len(recs))
        if not n_caps.any():
            continue
        block = counts * n_caps                          # pool rows of each request in this step
        room = block * phases                            # and in its block (a ring's: `phases` steps)
        base = used[g] + np.cumsum(room) - room
        nc = np.repeat(n_caps, counts)
        keep = nc > 0
        row, nc = rows[keep], nc[keep]
        first = np.repeat(base, counts)[keep] + rank[keep] * nc   # pool row of each row's first capture
        mine = [st for st in stores if st is not None]
        if all(st.caps_key == mine[0].caps_key for st in mine[1:]):
            # The usual case, every request asking for the same captures: one broadcast.
            caps = mine[0].caps
            c, r = _span(caps), _span(row)
            if c is not None and r is not None:
                # and one block of the table (a prompt step capturing every row): slices, not a
                # scatter (8192 rows x 32 captures: 0.15 against 2 ms on a 2-core CPU)
                np.add(first[None, :], np.arange(caps.size)[:, None], out=table[c, r], casting="unsafe")
            else:
                table[caps[:, None], row[None, :]] = first[None, :] + np.arange(caps.size)[:, None]
        else:
            # One entry per (row, capture j): pool row first + j, table row = the capture.
            req = np.repeat(np.arange(len(recs)), counts)[keep]
            j = np.arange(int(nc.sum())) - np.repeat(np.cumsum(nc) - nc, nc)
            caps = np.concatenate([st.caps for st in mine])
            cap_start = np.cumsum(n_caps) - n_caps
            table[caps[np.repeat(cap_start[req], nc) + j], np.repeat(row, nc)] = np.repeat(first, nc) + j
        starts, sizes = base.tolist(), counts.tolist()   # Python ints: indexing numpy per request is slow
        segments += [Segment(stores[k], starts[k], sizes[k]) for k in np.flatnonzero(block).tolist()]
        used[g] += int(room.sum())
    return segments


def _span(a: np.ndarray) -> slice | None:
    """`a` (strictly increasing, as capture indices and a step's rows are) as a slice, where it is
    one run of consecutive integers."""
    return slice(int(a[0]), int(a[-1]) + 1) if a.size and int(a[-1]) - int(a[0]) == a.size - 1 else None


def _fill_edits(layout: Layout, table: np.ndarray, reqs: _Requests) -> None:
    """Each bound edit: the request's slot on the rows its tap's `at` (a word, edits.py) covers,
    one run of rows a request. Edits bound by the same requests with the same `at` (a glob over
    32 layers) take the same rows: one assignment, copied to the others (on a 2-core CPU a
    prompt step of 8192 rows and 32 edits took 2.8 ms one edit at a time, 0.3 ms so)."""
    slot = np.fromiter((rec.slot for rec in reqs.recs), np.int64, len(reqs.recs))
    # one concatenate, not np.stack (a quarter of the time for a batch's 1-D masks)
    bound = np.concatenate([rec.edit_mask for rec in reqs.recs]).reshape(len(reqs.recs), -1) & (slot >= 0)[:, None]
    alike: dict[tuple, list[int]] = {}
    for e in np.flatnonzero(bound.any(axis=0)).tolist():
        alike.setdefault((layout.edit_at[e], bound[:, e].tobytes()), []).append(e)
    for edits in alike.values():
        first, mine = layout.edit_row(edits[0]), bound[:, edits[0]]
        lo, hi = interval(layout.edit_at[edits[0]], reqs.plen)
        rows, counts = reqs.rows(np.where(mine, lo, NO_END), hi)
        table[first, rows] = np.repeat(slot, counts)
        if len(edits) > 1:   # the others' rows are all -1 until now: a copy of the first's
            table[[layout.edit_row(e) for e in edits[1:]]] = table[first]


def _fill_always(layout: Layout, table: np.ndarray, batch: StepBatch) -> None:
    """Parameterless edits: every row of every request, by the tap's `at`. Slot 0: their
    tables hold the same literals in every slot."""
    num_reqs = len(batch.req_ids)
    qsl = batch.query_start_loc
    counts = np.diff(qsl[: num_reqs + 1])
    num_tokens = int(qsl[num_reqs])
    starts = np.repeat(qsl[:num_reqs], counts)
    pos = np.repeat(batch.num_computed[:num_reqs], counts) + np.arange(num_tokens) - starts
    plen = np.repeat(batch.prompt_lens[:num_reqs], counts)
    for e in layout.always:
        rows = np.flatnonzero(select(layout.edit_at[e], pos, plen))
        table[layout.edit_row(e), rows] = 0
