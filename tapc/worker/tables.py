"""The step tables: which rows of a step each capture and edit takes, filled on the host before
the forward and uploaded (buffers.py), and the captured rows' way out to host memory after it.

Before the forward the host fills the tables for the step's tapped requests (the compiled fill,
fill_jit.py, or its numpy reference, fill.py, for the steps the compiled one declines), unless
the step repeats the last decode step, whose tables the device still holds (rings.py). After
the forward the step's capture blocks start their way to the requests' host storage
(`CopyOut`, copyout.py; a ring's only every `PHASES` steps), and a collect waits for a
request's last copies before it says where its rows are.
"""
from __future__ import annotations

import numpy as np
import torch

from tapc.kernels.capture import PHASES
from tapc.wire.arena import Arena
from tapc.wire.protocol import Chunk, StoreResult
from tapc.worker.buffers import Buffers
from tapc.worker.component import Step, StepComponent
from tapc.worker.fill import fill_step
from tapc.worker.fill_jit import CompiledFill
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.rings import Repeat
from tapc.worker.storage import Store


class StepTables(StepComponent):
    """`copy_out`: a `CopyOut` (copyout.py) over `buffers.pools`, or an object of its methods
    (tests/support/engine_toy.py copies on the CPU). `compiled`: fill with fill_jit.py where it can
    (False: every step by fill.py's reference). `inline`: the API is on another node, so a
    collect sends the rows themselves rather than their places in the arena."""

    rpcs = {"tapc_count_nonfinite": "count_nonfinite"}

    def __init__(self, layout: Layout, buffers: Buffers, copy_out, arena: Arena, compiled: bool = True,
                 inline: bool = False):
        self.layout = layout
        self.buffers = buffers
        self.copy_out = copy_out
        self.arena = arena
        self.inline = inline
        self._compiled = CompiledFill(layout) if compiled else None
        self._repeat = Repeat()
        self._taps = 0     # the taps with rows in the step begun last, as a mask (Layout.taps_mask)
        # that step's capture blocks to copy out after it, and the rows of each group's pool it takes
        self._segments: list = []
        self._used: list[int] = []

    # ---------------------------------------------------------------- the step

    def admit(self, rec: Record, computed: int) -> None:
        self.forget()

    def retire(self, rec: Record) -> None:
        self.forget()

    def begin_step(self, step: Step) -> Step:
        """The step's tables filled and uploaded (or the last step's kept, where it repeats it);
        the step handed on with the taps that have rows in it (`Step.taps`, the switch's want)."""
        batch, tapped = step.batch, step.tapped
        owns = bool(self.layout.always) or bool(tapped)
        self._segments, self._used = [], []
        if not owns and self.buffers.clean(batch.padded):
            self._taps = 0
            return step._replace(taps=0)
        repeat = self._repeat
        # the device's tables are this step's already when it repeats the last decode step,
        # unless this step starts a ring (the first repeat, filled again), which it can where
        # the capture kernels read the runner's positions (the worker sets them: install.py)
        computed = repeat.repeats(batch)
        ring = computed is not None and self.buffers.positions is not None and \
            repeat.ring_fits(self.layout, self.buffers.rows)
        if computed is not None and not ring:   # the taps too are the last step's
            self._segments, self._used = repeat.advance(computed)
            return step._replace(taps=self._taps)
        self._end_ring()   # its rows, before the tables and pools change
        table = self.buffers.host_table(batch.padded)
        phases = PHASES if ring else 1
        filled = self._compiled is not None and self._compiled(table, tapped, batch, phases)
        self._segments, self._used = filled or fill_step(self.layout, table, tapped, batch, phases)
        self.buffers.upload(batch.padded, owns_rows=owns)
        repeat.keep(batch, tapped, (self._segments, self._used), phases)
        self._taps = self._asked(table, self._segments) if owns else 0
        return step._replace(taps=self._taps)

    def end_step(self, step: Step | None) -> None:
        # held no longer than the step (the records' stores), as the runner holds the step
        segments, used, self._segments, self._used = self._segments, self._used, [], []
        if step is None or not segments:
            return
        if self._repeat.phases > 1:   # a ring's step: copied out with the ring's last
            self._repeat.written += 1
            if self._repeat.written == PHASES:
                self._copy_ring()
        else:
            self._copy(segments, used)

    def reset(self) -> None:
        self.forget()
        self.buffers.reset()
        self._taps = 0

    def forget(self) -> None:
        """No step repeats the last one from here on (records, slots or tables change)."""
        self._end_ring()
        self._repeat.forget()

    def _end_ring(self) -> None:
        """A ring's steps written and not yet copied out, copied now: the next forward writes
        its pools afresh (and its phases would go on where these stopped)."""
        if self._repeat.written:
            # as in a step (a collect or a dummy run may not be): the requests' storage is made in one
            with torch.inference_mode():
                self._copy_ring()
            self._repeat.forget()

    def _copy_ring(self) -> None:
        self._copy(*self._repeat.written_rows(), PHASES)
        self._repeat.written = 0

    def _copy(self, segments: list, used: list[int], steps: int = 1) -> None:
        """Start the copies of `steps` steps' segments; their stores hear of the event a collect
        waits on."""
        copied = self.copy_out.copy_out(segments, used, steps)
        for seg in segments:
            seg.store.copied = copied

    def _asked(self, table: np.ndarray, segments: list) -> int:
        """The taps whose kernels the step runs: those with rows in it, as its host table just
        filled says. A capture's rows are its copy-out segments' (their stores' captures); an
        edit's, the entries of its table row (the slot of each row it edits). So a request that
        captures or edits at prompt positions only asks nothing of its decode steps, which
        replay the graphs without tap kernels where no other request asks."""
        taps = 0
        for seg in segments:
            taps |= seg.store.taps
        first = self.layout.edit_row(0)
        edits = table[first: first + len(self.layout.edits)]
        if edits.size:
            taps |= self.layout.taps_mask(first + e for e in np.flatnonzero(edits.max(axis=1) >= 0).tolist())
        return taps

    # ---------------------------------------------------------------- to the API

    def count_nonfinite(self, on: bool) -> None:
        """Count the NaN / inf values of the captures as they are copied out, from 0, or stop
        (a harvest's check, `tapc_count_nonfinite`); collect replies carry the count."""
        self.copy_out.count_nonfinite(on)

    def reply(self) -> dict:
        return {"nonfinite": self.copy_out.nonfinite()}

    def collect(self, rec: Record) -> dict:
        """Once its copies (and kept prefix rows written into it) are done: where its rows are
        in the arena, or why its captures failed (its chunks then go back: nobody will view them)."""
        # A ring's rows go out with its last step's, or when it ends: here, for a request vLLM has
        # not yet said is finished (one it has said so of ended its ring then).
        if not rec.finished:
            self._end_ring()
        for st in rec.stores:   # kept prefix rows written into it: read (and freed) only once they are
            if st.filling is not None:
                st.filling.result()
        # Its own last copies, not every step's: a collect while others run (a server, a
        # harvest) would otherwise hold the host until the newest forward is done.
        for copied in {id(st.copied): st.copied for st in rec.stores if st.copied is not None}.values():
            copied.synchronize()
        failed = next((st.failed for st in rec.stores if st.failed is not None), None)
        if failed is not None:
            for st in rec.stores:
                for chunk in st.chunks:
                    self.arena.give_back_tensor(chunk)
            return {"error": failed}
        return {"stores": tuple(_store_result(self.layout, self.arena, st, self.inline) for st in rec.stores)}


def _store_result(layout: Layout, arena: Arena, store: Store, inline: bool) -> StoreResult:
    return StoreResult(keys=tuple(layout.captures[c].key for c in store.caps),
                       dtype=str(store.dtype).removeprefix("torch."), width=store.width, rows=store.rows,
                       chunks=tuple(_chunk(arena, c, n, inline) for c, n in store.filled()),
                       rank=layout.tp_rank)


def _chunk(arena: Arena, rows: torch.Tensor, written: int, inline: bool) -> Chunk:
    """Where a chunk's rows are in the arena, or (`inline`) the rows themselves, its block freed."""
    if not inline:
        return Chunk(*arena.locate(rows), rows.shape[0], written)
    data = rows[:written].reshape(-1).view(torch.uint8).numpy().tobytes()
    arena.give_back_tensor(rows)
    return Chunk("", 0, written, written, data)
