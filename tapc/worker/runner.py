"""The worker's step loop, whichever model runner drives it: a thin orchestrator over the step
components (component.py).

A runner adapter (runner_v2.py for vLLM's V2 runner, runner_v1.py for V1) calls, for each step:
- `schedule(scheduler_output)` before the step: requests that finished or were preempted
  retire; new requests carrying `extra_args["tapc"]` get a `Record` (storage for their
  captures, in the arena) and are admitted -- a preempted request that comes back keeps its
  record and is admitted again. For the V2 runner vLLM sends a resumed request among the new
  ones, for V1 among the cached ones (`resumed_req_ids`); both are met;
- `begin_step(batch)` before the forward, with the batch's final row layout (a `StepBatch`);
- `end_step()` after the forward is enqueued;
- `reset()` for dummy runs (profiling, warmup without requests).
Each of these goes to every component in turn (end_step in reverse order); `begin_step`'s
step goes from each to the next as the one before handed it on. `collect(ids)` hands requests'
results back, by the ids the API put in extra_args, each component giving its part. The
worker's other RPCs reach the component that declared them (`rpc`).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from tapc.errors import EngineError, ProtocolError, RequestError
from tapc.wire.arena import Arena
from tapc.wire.protocol import CollectReply, Result, WireRequest
from tapc.worker.component import Step, StepComponent
from tapc.worker.fill import tapped_of
from tapc.worker.layout import Layout
from tapc.worker.records import Record
from tapc.worker.step import StepBatch

log = logging.getLogger("tapc")

C = TypeVar("C", bound=StepComponent)
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
    """The step loop: a request's admission and its results, and each event handed to every
    component in order (end_step in reverse). `components`: the step components, as assemble.py
    picked them for this engine."""

    def __init__(self, layout: Layout, arena: Arena, components: Sequence[StepComponent]):
        self.layout = layout
        self.arena = arena                       # captures' host storage, shared with the API
        self.components = list(components)
        self._rpcs = _answers(self.components)   # worker RPC -> the component's method that answers it
        self.records: dict[str, Record] = {}     # vLLM request id -> record, while vLLM has it
        self.by_id: dict[str, Record] = {}       # tapc id -> record, until collected
        self.errors: dict[str, str] = {}         # tapc id -> why its taps were not served
        # vLLM ids of tapped requests this GPU could not admit (no room for their captures here),
        # while vLLM runs them: other GPUs of the group may have admitted them (points.py)
        self.unadmitted: set[str] = set()
        self._step: Step | None = None
        self.host_s = dict.fromkeys(TIMED, 0.0)   # seconds in each hook since the worker started
        self.steps = 0                            # forwards the hooks filled tables for (begin_step)

    # ---------------------------------------------------------------- per step (the adapter calls)

    @_timed
    def schedule(self, scheduler_output) -> None:
        finished = scheduler_output.finished_req_ids
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        untapped = [rid for rid in finished if rid not in self.records]
        self.unadmitted.difference_update(finished)
        for rid in (*finished, *(scheduler_output.preempted_req_ids or ())):
            rec = self.records.get(rid)
            if rec is not None:
                self._retire(rec, finished=rid in finished)
        for req in scheduler_output.scheduled_new_reqs:
            rec = self.records.get(req.req_id) or self._record(req)   # a preempted request that resumes has one
            if rec is not None:   # a start past 0: vLLM served the rest from its cache
                self._admit(rec, getattr(req, "num_computed_tokens", 0))
        # V1 resumes a preempted request among the cached ones, from where its cache hit ends
        # (vLLM 0.34, without V1, has no `resumed_req_ids`: none resume there)
        resumed = getattr(cached, "resumed_req_ids", ())
        if resumed:
            computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
            for rid in resumed:
                if rid in self.records:
                    self._admit(self.records[rid], computed.get(rid, 0))
        for c in self.components:
            c.scheduled(untapped)
        self._step = None

    @_timed
    def begin_step(self, batch: StepBatch) -> None:
        self.steps += 1
        tapped = tapped_of(self.records, batch) if self.records else []
        step = Step(batch, tapped, self.records, self.unadmitted)
        for c in self.components:
            step = c.begin_step(step) or step
        self._step = step

    @_timed
    def end_step(self) -> None:
        for c in reversed(self.components):
            c.end_step(self._step)
        self._step = None

    def reset(self) -> None:
        for c in self.components:
            c.reset()

    # ---------------------------------------------------------------- requests

    def _record(self, req) -> Record | None:
        """A record for a new request that carries `extra_args["tapc"]`, with storage for its
        captures; None where it has none or runs untapped (its tapc id, if any, hears why)."""
        raw = (req.sampling_params.extra_args or {}).get("tapc") if req.sampling_params else None
        if raw is None:
            return None
        try:
            wire = WireRequest.from_wire(raw)
        except ProtocolError as e:
            # Not from this tapc's API: it runs untapped; its id, if it has one, hears why.
            log.warning("tapc: request %s runs untapped: %s", req.req_id, str(e))
            tid = raw.get("id") if isinstance(raw, dict) else None
            if isinstance(tid, str):
                self.errors[tid] = str(e)
            return None
        if wire.id in self.errors:   # refused before and preempted since: it stays untapped
            self.unadmitted.add(req.req_id)
            return None
        taken: list = []   # chunks this admission got, to give back if it fails

        def alloc(*shape):
            taken.append(self.arena.tensor(*shape))
            return taken[-1]

        try:
            rec = Record(self.layout, req.req_id, wire, len(req.prompt_token_ids), req.sampling_params.max_tokens,
                         alloc)
        except RequestError as e:
            # The API checked the request; what is left to fail is room for its captures (or a
            # request that came another way). It runs untapped, with the chunks of its other
            # groups given back, and its caller gets the reason at collect. The reason as a
            # string: a log record holding the exception pins its frames.
            log.warning("tapc: request %s runs untapped: %s", req.req_id, str(e))
            for t in taken:
                self.arena.give_back_tensor(t)
            self.errors[wire.id] = str(e)
            self.unadmitted.add(req.req_id)
            return None
        self.records[req.req_id] = rec
        self.by_id[rec.id] = rec
        return rec

    def _admit(self, rec: Record, computed: int) -> None:
        for c in self.components:
            c.admit(rec, computed)

    def _retire(self, rec: Record, finished: bool) -> None:
        for c in self.components:
            c.retire(rec)
        if finished:
            rec.finished = True
            del self.records[rec.rid]

    # ---------------------------------------------------------------- to the API

    @_timed
    def collect(self, ids: list[str], release: list[tuple[str, int]] = ()) -> CollectReply:
        """The results of the given tapc ids: per group of captures of one width, where its rows
        are in the arena (protocol.StoreResult), and the engine points' rows, saved values and
        block error. The record is dropped; the chunks now belong to the API, which gives each
        back (`release`, or with a later collect) when the caller no longer uses it."""
        self.release(release)
        out: dict[str, Result] = {}
        for tid in ids:
            if tid in self.errors:
                out[tid] = Result(tid, error=self.errors.pop(tid))
                continue
            rec = self.by_id.pop(tid, None)
            if rec is None:
                out[tid] = Result(tid, error="the engine has no captures for this request (it never ran, or was "
                                             "collected already)", unknown=True)
                continue
            fields: dict = {}
            for c in self.components:
                fields.update(c.collect(rec))
            if not rec.finished:  # vLLM tells the worker only with its next step
                self._retire(rec, finished=False)
                self.records.pop(rec.rid, None)
            out[tid] = Result(tid, error=fields["error"]) if "error" in fields else Result(tid, **fields)
        reply: dict = {}
        for c in self.components:
            reply.update(c.reply())
        return CollectReply(tuple(out.values()), **reply)

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
        held = {"running": len(self.records), "uncollected": len(self.by_id) + len(self.errors),
                "chunks": len(self.arena.held)}
        for c in self.components:
            held.update(c.held())
        return held

    # ---------------------------------------------------------------- the components

    def rpc(self, name: str) -> Callable | None:
        """The method that answers the worker RPC `name`, of the component that declared it
        (`StepComponent.rpcs`); None where this engine has no such component."""
        return self._rpcs.get(name)

    def component(self, kind: type[C]) -> C | None:
        """This engine's component of class `kind`, None where it has none."""
        return next((c for c in self.components if isinstance(c, kind)), None)


def _answers(components: list[StepComponent]) -> dict[str, Callable]:
    """Each worker RPC the components declare, to the bound method that answers it."""
    answers: dict[str, Callable] = {}
    for c in components:
        for rpc, method in c.rpcs.items():
            if rpc in answers:
                raise EngineError(f"two step components answer the worker RPC {rpc}")
            answers[rpc] = getattr(c, method)
    return answers


def row_positions(model_config, positions):
    """`positions`, the runner's buffer of the model's positions, where it holds one a row (the
    rings' capture kernels read it, tapc/kernels/capture.py); None under M-RoPE or XD-RoPE, whose
    positions are elsewhere, several a row. vLLM 0.34's config has no `uses_xdrope_dim`: it reads
    XD-RoPE's sections as M-RoPE's, so `uses_mrope` covers those models."""
    if model_config.uses_mrope or getattr(model_config, "uses_xdrope_dim", 0) > 0:
        return None
    return positions
