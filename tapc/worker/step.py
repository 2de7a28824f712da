"""The batch of one step, as a plain value: what the table fill and the engine points need
from whichever model runner made it (runner_v2.py turns vLLM's V2 `InputBatch` into one; a V1
runner needs its own adapter, not another fill), and the blocks of it a capture copies out."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from tapc.worker.storage import Store


@dataclass(frozen=True)
class StepBatch:
    """Requests back to back in one flat `[padded, width]` slab, in batch order."""

    req_ids: Sequence[str]        # vLLM request ids
    query_start_loc: np.ndarray   # [R + 1]: request i's rows are query_start_loc[i] .. [i + 1] - 1
    num_computed: np.ndarray      # [R]: tokens of request i before this step = position of its first row
    prompt_lens: np.ndarray       # [R]
    padded: int                   # rows the forward runs (a CUDA-graph size); rows past the last request are padding


class Segment(NamedTuple):
    """One request's block of one step in one group: pool rows [start, start + rows * C).
    (A tuple: a step at batch 64 makes 64 a group, and a frozen dataclass costs 4x to build.)"""

    store: Store
    start: int
    rows: int
