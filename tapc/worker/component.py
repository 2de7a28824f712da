"""The parts of the worker's step loop. Each feature is a `StepComponent`: the runner hooks
(runner.py) call every component, in order, at the same few events, and a feature adds
nothing to the loop but its component. What a feature changes outside the loop it declares on
its component too: the patches it needs (`patches`, applied at load by patches.py `apply`) and
the worker RPCs it answers (`rpcs`, which the worker's methods reach through `RunnerHooks.rpc`).

The components, in the order the hooks call them (end_step in reverse):
- `StepTables` (tables.py): the row tables that say which rows each capture and edit takes, a
  repeated or ringed decode step (rings.py), and the captured rows' way out to host memory;
  its `begin_step` hands on the step with the taps it asks for (`Step.taps`);
- `EditSlots` (slots.py): each editing request's parameter slot in the device tables;
- `PrefixRows` (prefixrows.py): captured rows of shared prompt blocks kept for later requests;
- `Switch` (switch.py): which tap kernels the step's graphs run, the step's `taps` as the step
  tables handed it on: after `StepTables` in the list;
- `EnginePoints` (points.py): `logits`, `samples` and Python blocks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from tapc.worker.patches import Patch
from tapc.worker.records import Record
from tapc.worker.step import StepBatch


class Step(NamedTuple):
    """One forward as the runner hooks hand it to the components. Nobody writes it: a component
    that hands the later ones a value returns the step with it from `begin_step` (`_replace`:
    a tuple's, which costs the step's path less than a dataclass's `replace`)."""

    batch: StepBatch
    tapped: list[tuple[int, Record]]     # its tapped requests: (place in the batch, record), batch order
    records: dict[str, Record]           # vLLM id -> record, every tapped request vLLM runs
    unadmitted: set[str]                 # vLLM ids of tapped requests this GPU could not admit
    taps: int = -1                       # the taps whose kernels it runs, a mask (Layout.taps_mask); -1: all


class StepComponent:
    """One feature of the step loop. Every event is a no-op unless the feature needs it."""

    # The worker RPCs it answers (TapWorker's methods, by vLLM's collective_rpc name) -> its method
    # that answers each; one component an RPC (RunnerHooks.rpc).
    rpcs: Mapping[str, str] = MappingProxyType({})

    def patches(self, runner) -> list[Patch]:
        """The changes to objects tapc does not own (patches.py) that the feature needs in the
        process of `runner` (vLLM's model runner), made at load after the runner adapter's, in
        this order, and undone in reverse."""
        return []

    def admit(self, rec: Record, computed: int) -> None:
        """`rec` enters vLLM's batch, new or resumed after a preemption, with its first
        `computed` tokens already in vLLM's cache."""

    def retire(self, rec: Record) -> None:
        """`rec` leaves vLLM's batch: finished, preempted, or collected before vLLM said it finished."""

    def scheduled(self, finished_untapped: Sequence[str]) -> None:
        """The scheduler's output is taken in (after the admissions); `finished_untapped`: vLLM
        ids of requests without taps that finished."""

    def begin_step(self, step: Step) -> Step | None:
        """Before the forward, with the batch's final row layout: `step` as the components before
        this one handed it on. What it returns, the later ones get (None: `step` as it is)."""

    def end_step(self, step: Step | None) -> None:
        """After the forward is enqueued, with the step as the last component handed it on
        (`step` None: the runner ran no forward this time)."""

    def collect(self, rec: Record) -> dict:
        """`rec`'s results are taken: its part, as `protocol.Result` fields (an `error` among them
        means the request failed: its result carries nothing else)."""
        return {}

    def reply(self) -> dict:
        """A collect's reply is made: its part, as `protocol.CollectReply` fields besides the results."""
        return {}

    def held(self) -> dict[str, int]:
        """What requests hold of the feature now, by name (`RunnerHooks.held`)."""
        return {}

    def reset(self) -> None:
        """A dummy forward (profiling, warmup) comes: no request owns a row."""
