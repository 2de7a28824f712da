"""Slots of the per-request parameter tables; a request holds one while it is scheduled.

Requests that bind the same values share a slot: the tables would hold the same thing for each,
and a steering vector served to hundreds of requests is written once rather than once a request
(each write is a host-to-device copy on the engine's step path: under bench_serve's load the
writes were the largest part of tapc's host time in the engine). A slot nobody holds keeps its
values until another set of values needs it (least recently used first), so the next request
with those values writes nothing either.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tapc.errors import EngineError
from tapc.worker.component import StepComponent
from tapc.worker.records import Record


class Slots:
    def __init__(self, n: int):
        self.free = list(range(n - 1, -1, -1))          # slots with no values worth keeping
        self.idle: OrderedDict[int, Hashable] = OrderedDict()   # held by none, values kept: slot -> key
        self.slot_of: dict[Hashable, int] = {}         # key -> the slot holding those values
        self.key_of: dict[int, Hashable] = {}
        self.holders: dict[int, int] = {}              # slot -> requests holding it

    def take(self, key: Hashable | None = None) -> tuple[int, bool]:
        """A slot for the values `key` names (None: values shared with no one), and whether they
        must be written into it (False: it holds them already)."""
        slot = self.slot_of.get(key) if key is not None else None
        if slot is not None:
            self.idle.pop(slot, None)
            self.holders[slot] = self.holders.get(slot, 0) + 1
            return slot, False
        if self.free:
            slot = self.free.pop()
        elif self.idle:
            slot, old = self.idle.popitem(last=False)
            del self.slot_of[old], self.key_of[slot]
        else:
            raise EngineError("all parameter slots are taken: more edited requests are running than "
                              "max_num_seqs allows")
        if key is not None:
            self.slot_of[key], self.key_of[slot] = slot, key
        self.holders[slot] = 1
        return slot, True

    def give(self, slot: int) -> None:
        self.holders[slot] -= 1
        if self.holders[slot]:
            return
        del self.holders[slot]
        key = self.key_of.get(slot)
        if key is None:
            self.free.append(slot)
        else:
            self.idle[slot] = key

    @property
    def held(self) -> int:
        """Slots some request holds."""
        return len(self.holders)


class EditSlots(StepComponent):
    """The step loop's part of the edits: a request with edits holds a slot while vLLM runs it,
    its values written into the device tables (Buffers.params, .logit_params) when the slot
    does not hold them already; the step tables point its rows at that slot."""

    def __init__(self, buffers):
        self.buffers = buffers
        self.slots = Slots(buffers.slots)

    def admit(self, rec: Record, computed: int) -> None:
        if (rec.edits or rec.logit_edits) and rec.slot < 0:
            rec.slot, fresh = self.slots.take(rec.values)
            if fresh:
                self.buffers.params.write(rec.slot, rec.edits, rec.params)
                self.buffers.logit_params.write(rec.slot, rec.logit_edits, rec.params)

    def retire(self, rec: Record) -> None:
        if rec.slot >= 0:
            self.slots.give(rec.slot)
            rec.slot = -1

    def held(self) -> dict[str, int]:
        return {"slots": self.slots.held}
