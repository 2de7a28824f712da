"""Slots of the per-request parameter tables; a request holds one while it is scheduled."""
from __future__ import annotations

from tapc.errors import EngineError


class Slots:
    def __init__(self, n: int):
        self.free = list(range(n - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            raise EngineError("all parameter slots are taken: more edited requests are running than "
                              "max_num_seqs allows")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)
