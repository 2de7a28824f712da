"""The host's work before each forward: the step's row tables from the batch layout.

vLLM runs one flat `[num_tokens, width]` slab per step, requests back to back, padded up to a
CUDA-graph size; a runner adapter (runner_v2.py) describes it as a `StepBatch`. `fill_step` writes one row of `table` per in-graph tap (layout.py says what
the entries mean) for the tapped requests of the step, and returns the capture segments to
copy out after the forward (memcpy.copy_segments). It works on host arrays only; buffers.py
uploads the table and runs the copies.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from tapc.errors import EngineError
from tapc.kernels.capture import PHASES
from tapc.wire.positions import NO_END, interval, select
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.step import Segment, StepBatch

FILL = "TAPC_FILL"   # "numpy": this module's fill for every step (read as the worker's hooks are made)


def compiled_fill(layout: Layout):
    """fill_jit.py's `CompiledFill` (the default: 0.18 ms less of the engine's thread a served
    step on the H200 host, docs/serving.md), or None where `TAPC_FILL=numpy` asks for this
    module's fill on every step (numba is then not imported)."""
    value = os.environ.get(FILL) or "compiled"
    if value not in ("numpy", "compiled"):
        raise EngineError(f"{FILL}={value!r}: it is 'compiled' (the default) or 'numpy'")
    if value == "numpy":
        return None
    from tapc.worker.fill_jit import CompiledFill
    return CompiledFill(layout)


def tapped_of(records: dict[str, Record], batch: StepBatch) -> list[tuple[int, Record]]:
    """The step's tapped requests as (place in the batch, record), in batch order; `records` maps
    vLLM request ids to tapped requests. Found once a step (the hooks, the fill and `Repeat` read it)."""
    get = records.get
    return [(i, rec) for i, rid in enumerate(batch.req_ids) if (rec := get(rid)) is not None]


def fill_step(layout: Layout, table: np.ndarray, tapped: list[tuple[int, Record]],
              batch: StepBatch, phases: int = 1) -> tuple[list[Segment], list[int]]:
    """Write `table[:, :batch.padded]` for one step; return the capture segments to copy out
    after the forward and the rows used in each group's pool. `tapped`: the step's tapped
    requests (`tapped_of`; the others are left alone). `phases` > 1: the step starts a ring of
    that many steps (`Repeat`): each block gets room for that many, each captured row's position
    goes into the ring row.

    This runs on the host every step, beside vLLM's own step preparation. For many tapped
    requests it works on arrays over all their rows at once (one fancy assignment per group and
    per edit, a fixed number of numpy calls); for a few (`FEW`), request by request, a few
    numpy calls each: decode at small batch sizes, where vLLM's step is shortest.
    """
    table[:, :batch.padded] = -1
    used = [0] * len(layout.groups)
    segments: list[Segment] = []
    if 0 < len(tapped) <= FEW:
        segments = _fill_each(layout, table, tapped, batch, used, phases)
    elif tapped:
        reqs = _Requests(tapped, batch.query_start_loc, batch.num_computed)
        if any(rec.stores for rec in reqs.recs):
            segments = _fill_captures(layout, table, reqs, used, phases)
        if any(rec.slot >= 0 and rec.edits for rec in reqs.recs):
            _fill_edits(layout, table[:, :batch.padded], reqs)
    if layout.always:
        _fill_always(layout, table, batch)
    return segments, used


# Up to this many tapped requests in a step the fill goes request by request: about 5 numpy
# calls a request and group, against about 40 for the whole-batch arrays whatever the batch
# (a numpy call costs microseconds on these sizes). On the toy engine (2 capture groups and an
# edit, a 2-core CPU) a decode step's fill took 89 against 241 us at 1 request, 194 against
# 279 at 4, and as long either way at 8. tests/test_engine_tables.py runs both paths.
FEW = 6


def _fill_each(layout: Layout, table: np.ndarray, tapped: list[tuple[int, Record]], batch: StepBatch,
               used: list[int], phases: int = 1) -> list[Segment]:
    """`fill_step` for a few requests, one at a time: the same tables and segments as the
    whole-batch path (pool rows of a group in request order). A ring's step (`phases` > 1)
    leaves each block room for that many steps and marks its rows with their position."""
    qsl, computed = batch.query_start_loc, batch.num_computed
    segments: list[Segment] = []
    for i, rec in tapped:
        start, first = int(qsl[i]), int(computed[i])
        pos = np.arange(first, first + int(qsl[i + 1]) - start)
        if rec.stores:
            keep = np.flatnonzero(select(rec.positions, pos, rec.prompt_len) & (pos >= rec.next_pos))
            if keep.size:
                rec.next_pos = first + int(keep[-1]) + 1
                rows, n = start + keep, keep.size
                for st in rec.stores:
                    nc = st.caps.size
                    # pool row of (row r, capture j): the group's next free row + r * nc + j
                    table[st.caps[:, None], rows[None, :]] = used[st.group] + np.arange(0, n * nc, nc) + \
                        np.arange(nc)[:, None]
                    segments.append(Segment(st, used[st.group], n))
                    used[st.group] += n * nc * phases
                if phases > 1:
                    table[layout.ring_row, rows] = pos[keep]
        if rec.slot >= 0:
            for e in rec.edits:
                table[layout.edit_row(e), start + np.flatnonzero(select(layout.edit_at[e], pos, rec.prompt_len))] = rec.slot
    return segments


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


class Repeat:
    """The last decode step's fill, for the next step when it is the same decode batch.

    At steady decode (the same requests in the same order, one row each, every row past its
    prompt) each word of `positions` and `at=` covers each row as it did the step before ("all",
    "generated": yes; "prompt", "last": no). So the tables the device holds are this step's too,
    and so are the segments (pool rows per request): only each capturing request's `next_pos`
    moves. At batch 64 with three capture groups the fill is a few hundred microseconds of numpy
    on the host's critical path, against a few here. A list of positions may take one step's row
    and not the next: a step where one is in use is filled afresh. The runner hooks `forget` it
    whenever the records, their slots or the device tables change.

    A *ring* goes further (`ring_fits`): the first repeat is filled again with
    room for `PHASES` steps in each request's block, and the capture kernels put each step's
    rows one phase on by the model's positions (tapc/kernels/capture.py), so the host copies out
    once every `PHASES` steps, or when the ring ends (the runner's `_forget`), with one event,
    where a step made a copy call and an event each (in a running engine at batch 1 on the
    Qwen3-30B-A3B shape, 45-60 us of the engine thread's 2 ms step; at batch 64, a copy a
    request and capture group, 0.3-0.6 ms of a 10 ms step: docs/engine.md)."""

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        self._key: tuple | None = None
        self._step: tuple[list[Segment], list[int]] = ([], [])
        self._moving: list[tuple[Record, int]] = []   # (record, batch index) of requests capturing each row
        self._next: list[int] = []   # the positions a step that repeats the kept one computes from
        self.phases = 1    # steps the kept step's pool blocks hold (PHASES: a ring)
        self.written = 0   # of those, the steps written since the ring's last copy-out

    def repeats(self, batch: StepBatch) -> list[int] | None:
        """`batch`'s computed positions (a list) if it repeats the kept step (its next rows),
        else None."""
        # The kept step was a decode step past every prompt (`keep`). This one repeats it when it
        # has the same requests, each one position on, and one row each: the rows are as many as
        # the requests (every request of a step has one at least). Cheaper than `_decode`,
        # which this runs instead of on every step of a steady decode; a list compare, not numpy's
        # (a decode step at bs1 is a few ms of which this is on the engine thread's path).
        n = len(batch.req_ids)
        if self._key is None or self._key != (tuple(batch.req_ids), batch.padded) \
                or int(batch.query_start_loc[n]) != n:
            return None
        computed = batch.num_computed.tolist()
        return computed if computed == self._next else None

    def advance(self, computed: list[int]) -> tuple[list[Segment], list[int]]:
        """The kept step's segments and used rows for the step that repeats it (`computed`, as
        `repeats` gave it), with the capturing requests' `next_pos` moved on."""
        self._next = [c + 1 for c in computed]
        for rec, i in self._moving:
            rec.next_pos = computed[i] + 1
        return self._step

    def same(self, batch: StepBatch) -> tuple[list[Segment], list[int]] | None:
        """`advance` if `batch` repeats the kept step; None when it must be filled."""
        computed = self.repeats(batch)
        return None if computed is None else self.advance(computed)

    def keep(self, batch: StepBatch, tapped: list[tuple[int, Record]], step: tuple[list[Segment], list[int]],
             phases: int = 1) -> None:
        """Remember a step just filled (its tapped requests, `tapped_of`), if it is one the next
        step can repeat; `phases`: as it was filled (`fill_step`)."""
        self.forget()
        if not _decode(batch):
            return
        if any(not isinstance(rec.positions, str) for _, rec in tapped):
            return
        moving = [(rec, i) for i, rec in tapped if rec.stores and rec.positions in ("all", "generated")]
        copied = {id(seg.store) for seg in step[0]}
        if any(id(st) not in copied for rec, _ in moving for st in rec.stores):
            return   # its row was one it had captured before (recomputed after preemption): not a step to repeat
        self._key, self._step, self._moving = (tuple(batch.req_ids), batch.padded), step, moving
        self._next = (batch.num_computed + 1).tolist()
        self.phases = phases

    def ring_fits(self, layout: Layout, rows: int) -> bool:
        """Whether the kept step's repeat can start a ring in pools of `rows` rows a capture:
        rows captured, each capturing request asking for every capture of each group
        it captures from (a phase is one stride for every request, its group's captures), and
        room for `PHASES` steps."""
        segments, used = self._step
        return self.phases == 1 and bool(segments) \
            and all(seg.store.caps.size == len(layout.groups[seg.store.group].caps) for seg in segments) \
            and all(PHASES * u <= len(g.caps) * rows for u, g in zip(used, layout.groups))

    def written_rows(self) -> tuple[list[Segment], list[int]]:
        """The ring's rows written since its last copy-out (each request's block, from phase 0)
        and the pool rows the ring takes."""
        segments, used = self._step
        return [Segment(seg.store, seg.start, self.written) for seg in segments], used


def _decode(batch: StepBatch) -> bool:
    """One row a request, each past its prompt."""
    n = len(batch.req_ids)
    return bool((np.diff(batch.query_start_loc[: n + 1]) == 1).all() and (batch.num_computed >= batch.prompt_lens).all())


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
