"""What the worker keeps about one tapped request, from its first step until it is collected."""
from __future__ import annotations

import functools

import numpy as np
import torch

from tapc.errors import RequestError
from tapc.wire.positions import NO_END, beyond_pattern, expected_rows, interval
from tapc.wire.protocol import WireRequest
from tapc.worker.layout import Layout
from tapc.worker.storage import Alloc, Store


class Record:
    def __init__(self, layout: Layout, rid: str, wire: WireRequest, prompt_len: int, max_tokens: int, alloc: Alloc):
        self.rid = rid                 # vLLM's request id
        self.id = wire.id              # tapc's id for it
        self.prompt_len = prompt_len
        # hashable (a word or a tuple): the step fill groups requests by it
        self.positions = wire.ask.positions if isinstance(wire.ask.positions, str) else tuple(wire.ask.positions)
        self.span = interval(self.positions, prompt_len)   # [lo, hi) of a word's positions, None for a list
        self.ask = wire.ask            # what it asked for (blocks, engine points: points.py)
        self.params = wire.ask.params
        wrong = [k for k in wire.ask.capture if k not in layout.plan_captures]
        if wrong:
            raise RequestError(f"capture {wrong[0]!r} is not in this engine's plan")
        beyond = beyond_pattern(layout.pattern_keys, wire.ask.capture, self.positions, prompt_len, max_tokens)
        if beyond is not None:
            raise RequestError(beyond)
        # Under tensor / pipeline parallelism another GPU may write a key (layout.py).
        caps = np.array(sorted(layout.cap_index[k] for k in wire.ask.capture if k in layout.cap_index),
                        dtype=np.int64)
        # Every row it can have, plus one: with async scheduling vLLM may run one more step for a
        # request that has just finished (the API drops that row).
        first = expected_rows(self.positions, prompt_len, max_tokens) + 1
        self.stores = []
        for g, group in enumerate(layout.groups):
            mine = caps[layout.cap_group[caps] == g]
            if mine.size:
                self.stores.append(Store(g, mine, group.width, getattr(torch, group.dtype), alloc, first))
        self.edits = _bound(layout.edit_params, self.params)
        self.logit_edits = _bound(layout.logit_edit_params, self.params)
        # The same, as a mask over the plan's edits: the step fill stacks these for a whole batch.
        self.edit_mask = np.zeros(len(layout.edits), dtype=bool)
        self.edit_mask[self.edits] = True
        # The positions its captures may take, as the step fill reads them: its word's interval;
        # every position for a list (the fill picks its own from them); none without captures.
        self.cap_lo, self.cap_hi = (NO_END, 0) if not self.stores else (0, NO_END) if self.span is None else self.span
        self.store_of: list[Store | None] = [None] * len(layout.groups)
        for st in self.stores:
            self.store_of[st.group] = st
        self.n_caps = [0 if st is None else st.caps.size for st in self.store_of]   # captures in each group
        self.num_caps = len(layout.captures)
        self.slot = -1
        # Positions below this were captured already: a request preempted and resumed recomputes
        # its tokens from 0, and each position is kept once, the first time it went through.
        self.next_pos = 0
        self.finished = False

    @functools.cached_property
    def fill_row(self) -> np.ndarray:
        """What the compiled fill (fill_jit.py) reads of it, as one row, made at its first step
        there: cap_lo, cap_hi, n_caps, each capture's place among its group's captures here (-1:
        not asked), edit_mask."""
        cap_j = np.full(self.num_caps, -1, dtype=np.int64)
        for st in self.stores:
            cap_j[st.caps] = np.arange(st.caps.size)
        return np.concatenate([[self.cap_lo, self.cap_hi, *self.n_caps], cap_j, self.edit_mask]).astype(np.int64)

    @property
    def values(self) -> tuple:
        """What its parameter slot holds, as a key: requests with equal keys share one (slots.py).
        Made when it takes a slot, not at every admission: a request that edits nothing takes none."""
        return (tuple(self.edits), tuple(self.logit_edits),
                tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(self.params.items())))


def _bound(edit_params: list[tuple[str, ...]], params: dict) -> list[int]:
    """The edits (indices) with parameters that `params` binds all of; the parameterless ones
    apply to every request by another way (layout.py `always`)."""
    return [e for e, names in enumerate(edit_params) if names and all(n in params for n in names)]
