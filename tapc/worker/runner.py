"""The worker's per-request and per-step bookkeeping, whichever model runner drives it.

A runner adapter (runner_v2.py for vLLM's V2 runner, runner_v1.py for V1) calls, for each step:
- `schedule(scheduler_output)` before the step: requests that finished or were preempted give
  back their parameter slot; new requests carrying `extra_args["tapc"]` get a `Record` (and a
  slot, with their parameter values written to the device tables) -- a preempted request that
  comes back keeps its record and takes a slot again. For the V2 runner vLLM sends a resumed
  request among the new ones, for V1 among the cached ones (`resumed_req_ids`); both are met;
- `begin_step(batch)` before the forward, with the batch's final row layout (a `StepBatch`):
  the host fills the row tables and uploads them;
- `end_step()` after the forward is enqueued: the captured rows start their way to host memory;
- `reset()` for dummy runs (profiling, warmup without requests): tables that own no rows.

`collect(ids)` hands finished requests' captures back, by the ids the API put in extra_args.
"""
from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch

from tapc.errors import ProtocolError, RequestError
from tapc.kernels.capture import PHASES
from tapc.wire.arena import Arena
from tapc.wire.protocol import Chunk, CollectReply, Result, StoreResult, WireRequest
from tapc.worker.buffers import Buffers
from tapc.worker.fill import Repeat, compiled_fill, fill_step, tapped_of
from tapc.worker.layout import Layout
from tapc.worker.points import EnginePoints
from tapc.worker.prefixrows import PrefixRows
from tapc.worker.records import Record
from tapc.worker.slots import Slots
from tapc.worker.step import StepBatch
from tapc.worker.storage import Store
from tapc.worker.switch import Switch

log = logging.getLogger("tapc")

TIMED = ("schedule", "begin_step", "end_step", "collect")   # the hooks whose host time `host_time` sums


def _timed(hook):
    """A hook whose wall time on the engine's thread adds up in `RunnerHooks.host_s` (two clock
    reads a call): what tapc costs a served step, without a sampler's distortion."""
    name = hook.__name__

    @functools.wraps(hook)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.host_s[name] += time.perf_counter() - start
    return timed


class RunnerHooks:
    def __init__(self, layout: Layout, buffers: Buffers, arena: Arena, points: EnginePoints | None = None,
                 inline: bool = False, switch: Switch | None = None, prefix_rows: PrefixRows | None = None):
        self.points = points                     # logits, samples and Python blocks (points.py)
        self.prefix_rows = prefix_rows           # captured rows of shared prompt blocks (prefixrows.py)
        self.switch = switch                     # which tap kernels the step's graphs run (switch.py)
        self._taps = 0                           # what the last filled step's requests ask for, as a mask
        self.inline = inline                     # the API is on another node: send rows, not arena places
        self.layout = layout
        self.buffers = buffers
        self.arena = arena                       # captures' host storage, shared with the API
        self.slots = Slots(buffers.slots)         # one per slot of the parameter tables
        self.records: dict[str, Record] = {}     # vLLM request id -> record, while vLLM has it
        self.by_id: dict[str, Record] = {}       # tapc id -> record, until collected
        self.errors: dict[str, str] = {}         # tapc id -> why its taps were not served
        # vLLM ids of tapped requests this GPU could not admit (no room for their captures here),
        # while vLLM runs them: other GPUs of the group may have admitted them (points.py)
        self.unadmitted: set[str] = set()
        self._step = None
        self._repeat = Repeat()                   # a decode step like the last one needs no fill
        self._compiled = compiled_fill(layout)    # the fill as one compiled call (TAPC_FILL=numpy: None)
        self.host_s = dict.fromkeys(TIMED, 0.0)   # seconds in each hook since the worker started
        self.steps = 0                            # forwards the hooks filled tables for (begin_step)

    # ---------------------------------------------------------------- per step (the adapter calls)

    @_timed
    def schedule(self, scheduler_output) -> None:
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", ())
        if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids or \
                scheduler_output.scheduled_new_reqs or resumed:
            self._forget()   # records or slots may change below
        self._retire(scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids or ())
        self._admit(scheduler_output.scheduled_new_reqs)
        for rid in resumed:
            rec = self.records.get(rid)
            if rec is not None:
                self._bind_slot(rec)
        if self.prefix_rows is not None:
            if resumed:   # V1 resumes a preempted request among the cached ones, from where its cache hit ends
                computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
                for rid in resumed:
                    if rid in self.records:
                        self.prefix_rows.admitted(self.records[rid], computed.get(rid, 0))
            # after admissions, so what the scheduler allowed them is still kept
            self.prefix_rows.keep()
            self.prefix_rows.trim()
        self._step = None

    @_timed
    def begin_step(self, batch: StepBatch) -> None:
        self.steps += 1
        tapped = tapped_of(self.records, batch) if self.records else []
        owns = bool(self.layout.always) or bool(tapped)
        if owns or not self.buffers.clean(batch.padded):
            repeat = self._repeat
            # the device's tables are this step's already when it repeats the last decode step,
            # unless this step starts a ring (the first repeat, filled again), which it can where
            # the capture kernels read the runner's positions (the worker sets them: install.py)
            computed = repeat.repeats(batch)
            ring = computed is not None and self.buffers.positions is not None and \
                repeat.ring_fits(self.layout, self.buffers.rows)
            self._step = repeat.advance(computed) if computed is not None and not ring else None
            if self._step is None:
                self._end_ring()   # its rows, before the tables and pools change
                table = self.buffers.host_table(batch.padded)
                phases = PHASES if ring else 1
                self._step = (self._compiled is not None and self._compiled(table, tapped, batch, phases)) or \
                    fill_step(self.layout, table, tapped, batch, phases)
                self.buffers.upload(batch.padded, owns_rows=owns)
                repeat.keep(batch, tapped, self._step, phases)
                self._taps = self._asked(table, self._step[0]) if owns else 0
        else:
            self._step = None
            self._taps = 0
        if self.switch is not None:
            self.switch.want = self._taps
            self.switch.stepping = True
        if self.points is not None:
            self.points.begin_step(self.records, batch, self.unadmitted)

    @_timed
    def end_step(self) -> None:
        if self.points is not None:  # boundary ops in later (dummy) forwards must see no rows
            self.points.runtime.begin_step([])
        if self._step is not None and self._step[0]:
            repeat = self._repeat
            if repeat.phases > 1:   # a ring's step: copied out with the ring's last
                repeat.written += 1
                if repeat.written == PHASES:
                    self._copy_ring()
            else:
                self._copy_out(*self._step)
        self._step = None

    def reset(self) -> None:
        self._forget()
        self.buffers.reset()
        self._taps = 0
        if self.switch is not None:
            self.switch.want = 0
            self.switch.stepping = False

    def _forget(self) -> None:
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
        self._copy_out(*self._repeat.written_rows(), PHASES)
        self._repeat.written = 0

    def _copy_out(self, segments: list, used: list[int], steps: int = 1) -> None:
        """Start the copies of `steps` steps' segments; their stores hear of the event a collect
        waits on."""
        copied = self.buffers.copy_out(segments, used, steps)
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

    # ---------------------------------------------------------------- requests

    def _retire(self, finished, preempted) -> None:
        self.unadmitted.difference_update(finished)
        if self.prefix_rows is not None:   # a tapped request's rows may still be kept: forgotten at collect
            for rid in finished:
                if rid not in self.records:
                    self.prefix_rows.forget(rid)
        for rid in (*finished, *preempted):
            rec = self.records.get(rid)
            if rec is None:
                continue
            self._release(rec)
            if rid in finished:
                rec.finished = True
                del self.records[rid]

    def _admit(self, new_reqs) -> None:
        for req in new_reqs:
            raw = (req.sampling_params.extra_args or {}).get("tapc") if req.sampling_params else None
            if raw is None:
                continue
            rec = self.records.get(req.req_id)   # a preempted request that resumes has one
            if rec is None:
                try:
                    wire = WireRequest.from_wire(raw)
                except ProtocolError as e:
                    # Not from this tapc's API: it runs untapped; its id, if it has one, hears why.
                    log.warning("tapc: request %s runs untapped: %s", req.req_id, str(e))
                    tid = raw.get("id") if isinstance(raw, dict) else None
                    if isinstance(tid, str):
                        self.errors[tid] = str(e)
                    continue
                if wire.id in self.errors:   # refused before and preempted since: it stays untapped
                    self.unadmitted.add(req.req_id)
                    continue
                taken: list = []   # chunks this admission got, to give back if it fails

                def alloc(*shape):
                    taken.append(self.arena.tensor(*shape))
                    return taken[-1]

                try:
                    rec = Record(self.layout, req.req_id, wire, len(req.prompt_token_ids),
                                 req.sampling_params.max_tokens, alloc)
                except RequestError as e:
                    # The API checked the request; what is left to fail is room for its captures
                    # (or a request that came another way). It runs untapped, with the chunks of
                    # its other groups given back, and its caller gets the reason at collect.
                    # The reason as a string: a log record holding the exception pins its frames.
                    log.warning("tapc: request %s runs untapped: %s", req.req_id, str(e))
                    for t in taken:
                        self.arena.give_back_tensor(t)
                    self.errors[wire.id] = str(e)
                    self.unadmitted.add(req.req_id)
                    continue
                self.records[req.req_id] = rec
                self.by_id[rec.id] = rec
                if self.points is not None:
                    self.points.admit(rec, wire)
            self._bind_slot(rec)
            if self.prefix_rows is not None:   # a start past 0: vLLM served the rest from its cache
                self.prefix_rows.admitted(rec, getattr(req, "num_computed_tokens", 0))

    def _bind_slot(self, rec: Record) -> None:
        """A parameter slot for a request with edits that has none, its values written there."""
        if (rec.edits or rec.logit_edits) and rec.slot < 0:
            rec.slot, fresh = self.slots.take(rec.values)
            if fresh:
                self.buffers.params.write(rec.slot, rec.edits, rec.params)
                self.buffers.logit_params.write(rec.slot, rec.logit_edits, rec.params)

    def _release(self, rec: Record) -> None:
        if rec.slot >= 0:
            self.slots.give(rec.slot)
            rec.slot = -1

    # ---------------------------------------------------------------- to the API

    @_timed
    def collect(self, ids: list[str], release: list[tuple[str, int]] = ()) -> CollectReply:
        """The results of the given tapc ids: per group of captures of one width, where its rows
        are in the arena (protocol.StoreResult), and the engine points' rows, saved values and
        block error. The record is dropped; the chunks now belong to the API, which gives each
        back (`release`, or with a later collect) when the caller no longer uses it."""
        self.release(release)
        # A ring's rows go out with its last step's, or when it ends: here, for a request vLLM has
        # not yet said is finished (one it has said so of ended its ring then).
        if any((rec := self.by_id.get(tid)) is not None and not rec.finished for tid in ids):
            self._end_ring()
        out: dict[str, Result] = {}
        for tid in ids:
            if tid in self.errors:
                out[tid] = Result(tid, error=self.errors.pop(tid))
                continue
            rec = self.by_id.pop(tid, None)
            if rec is None:
                out[tid] = Result(tid, error="the engine has no captures for this request (it never ran, or was "
                                             "collected already)")
                continue
            for st in rec.stores:   # kept prefix rows written into it: read (and freed) only once they are
                if st.filling is not None:
                    st.filling.result()
            # Its own last copies, not every step's: a collect while others run (a server, a
            # harvest) would otherwise hold the host until the newest forward is done.
            for copied in {id(st.copied): st.copied for st in rec.stores if st.copied is not None}.values():
                copied.synchronize()
            if self.prefix_rows is not None:   # its copies are done: the last chance to keep its rows
                self.prefix_rows.keep([rec])
                self.prefix_rows.forget(rec.rid)
            if not rec.finished:  # vLLM tells the worker only with its next step
                self._forget()
                self._release(rec)
                self.records.pop(rec.rid, None)
            failed = next((st.failed for st in rec.stores if st.failed is not None), None)
            if failed is not None:  # a capture cut short: nobody will view its chunks
                for st in rec.stores:
                    for chunk in st.chunks:
                        self.arena.give_back_tensor(chunk)
                if self.points is not None:
                    self.points.take(tid)
                out[tid] = Result(tid, error=failed)
                continue
            stores = tuple(_store_result(self.layout, self.arena, st, self.inline) for st in rec.stores)
            if self.points is None:
                out[tid] = Result(tid, stores=stores)
            else:
                engine, saved, block_error = self.points.take(tid)
                out[tid] = Result(tid, stores=stores, engine=engine, saved=saved, block_error=block_error)
        return CollectReply(tuple(out.values()), nonfinite=self.buffers.nonfinite())

    def release(self, chunks: list[tuple[str, int]]) -> None:
        """The API no longer uses these chunks (file, byte offset): their space is free again.
        The API sends every worker the same list; each gives back the chunks of its own files."""
        for path, offset in chunks:
            if self.arena.owns(path):
                self.arena.give_back(path, offset)

    def host_time(self) -> dict[str, float]:
        """Seconds of the engine's thread spent in each per-step hook (`schedule_s`, ...) and in
        `collect_s` since the worker started, and `steps`, the forwards among them: a load's
        difference of two readings over its steps is tapc's host cost a step."""
        return {"steps": self.steps, **{f"{name}_s": s for name, s in self.host_s.items()}}

    def held(self) -> dict[str, int]:
        """What requests hold here now: `running`, records of requests vLLM still runs;
        `uncollected`, results (or errors) waiting for `collect`; `chunks`, capture blocks of the
        arena not given back; `slots`, parameter slots taken."""
        return {"running": len(self.records), "uncollected": len(self.by_id) + len(self.errors),
                "chunks": len(self.arena.held), "slots": self.slots.held}


def row_positions(model_config, positions):
    """`positions`, the runner's buffer of the model's positions, where it holds one a row (the
    rings' capture kernels read it, tapc/kernels/capture.py); None under M-RoPE or XD-RoPE, whose
    positions are elsewhere, several a row."""
    if model_config.uses_mrope or model_config.uses_xdrope_dim > 0:
        return None
    return positions


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
