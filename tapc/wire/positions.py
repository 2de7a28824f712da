"""Which token positions a request's `positions` (or an edit's `at=`) covers: the one place
that says it, for the worker's step fill, the sizing of host storage and the API's assembly.

Positions are absolute token positions of the request: the prompt is 0..P-1, and the k-th
generated token (k from 0) is fed back at position P+k. A capture row at position p is the
activation while token p is the input. The last generated token is never fed back, so a
request with G generated tokens has P + G - 1 rows under "all".
    "all":       0 .. P+G-2        every token that went through the model
    "prompt":    0 .. P-1
    "generated": P .. P+G-2        rows whose input is a generated token
    "last":      P-1               the last prompt token (its output predicts generated token 0)
    [p, ...]:    exactly these positions (those that exist)
Edits take the same words in the tap (`at=`), e.g. `add(steer, at=generated)`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def select(positions: str | Sequence[int], pos: np.ndarray, prompt_len) -> np.ndarray:
    """Mask over `pos` (absolute positions of one request, or of several with `prompt_len` per
    row) of the rows `positions` covers."""
    if positions == "all":
        return np.ones(pos.shape, dtype=bool)
    if positions == "prompt":
        return pos < prompt_len
    if positions == "generated":
        return pos >= prompt_len
    if positions == "last":
        return pos == prompt_len - 1
    return np.isin(pos, np.asarray(positions, dtype=np.int64))


def interval(positions: str | Sequence[int], prompt_len):
    """The positions a word covers, as [lo, hi) (`select`'s words in closed form: the step fill
    takes a request's rows of a word as one run); None for a list of positions. `prompt_len` may
    be an array (one per request): the bounds are then arrays or numbers that broadcast."""
    if positions == "all":
        return 0, NO_END
    if positions == "prompt":
        return 0, prompt_len
    if positions == "generated":
        return prompt_len, NO_END
    if positions == "last":
        return prompt_len - 1, prompt_len
    return None


NO_END = np.iinfo(np.int64).max   # past every position

# Captures at these positions never read a row from vLLM's prefix cache: the last prompt
# position and generated ones are always computed (tapc.api.prefix).
ALWAYS_COMPUTED = ("generated", "last")


def expected_rows(positions, prompt_len: int, num_generated: int) -> int:
    """How many rows a finished request's capture has: positions that went through the model
    (0 .. prompt_len + num_generated - 2) and that `positions` covers (what `select` over them
    counts, in closed form: this runs for every request, at admission and at assembly)."""
    ran = prompt_len + max(num_generated, 1) - 1
    if positions == "all":
        return ran
    if positions == "prompt":
        return min(prompt_len, ran)
    if positions == "generated":
        return max(ran - prompt_len, 0)
    if positions == "last":
        return int(0 <= prompt_len - 1 < ran)
    return len({int(p) for p in positions if 0 <= p < ran})
