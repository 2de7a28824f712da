"""Steady decode: a step that repeats the last one needs no fill, and a ring of such steps
needs one copy-out.

At steady decode the same requests run in the same order, one row each, every row past its
prompt. `Repeat` keeps the last such step's fill, and the next step that repeats it reuses the
device's tables and the segments as they are (StepTables, tables.py). A ring goes further: the
first repeat is filled again with room for `PHASES` steps in each request's block, the capture
kernels put each step's rows one phase on by the model's positions (tapc/kernels/capture.py),
and the host copies them out once every `PHASES` steps, or when the ring ends. `TAPC_RINGS=0`
(tapc/settings.py) keeps every step to its own copy-out.
"""
from __future__ import annotations

import numpy as np

from tapc.kernels.capture import PHASES
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.step import Segment, StepBatch


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
    request and capture group, 0.3-0.6 ms of a 10 ms step: benchmarks/results/findings-engine.md)."""

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
