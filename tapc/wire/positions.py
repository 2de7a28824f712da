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


def _ran(prompt_len: int, num_generated: int) -> int:
    """Positions that went through the model: 0 .. prompt_len + num_generated - 2."""
    return prompt_len + max(num_generated, 1) - 1


def expected_rows(positions, prompt_len: int, num_generated: int) -> int:
    """How many rows a finished request's capture has: positions that went through the model
    (0 .. prompt_len + num_generated - 2) and that `positions` covers (what `select` over them
    counts, in closed form: this runs for every request, at admission and at assembly)."""
    ran = _ran(prompt_len, num_generated)
    if positions == "all":
        return ran
    if positions == "prompt":
        return min(prompt_len, ran)
    if positions == "generated":
        return max(ran - prompt_len, 0)
    if positions == "last":
        return int(0 <= prompt_len - 1 < ran)
    return len({int(p) for p in positions if 0 <= p < ran})


def unreached(positions, prompt_len: int, num_generated: int) -> tuple[int, ...]:
    """The listed positions a finished request never reached (it stopped before them): they
    have no row. The words always name positions that ran."""
    if isinstance(positions, str):
        return ()
    ran = _ran(prompt_len, num_generated)
    return tuple(int(p) for p in positions if p >= ran)


def beyond_pattern(pattern_keys: dict[str, int], capture, positions, prompt_len: int, max_tokens: int) -> str | None:
    """Why a request would ask an attention pattern for a row past the keys its rows hold
    (`pattern_keys`: key -> keys a row, tapc/plan/pattern.py), which its weights would not fit;
    None where none would."""
    asked = [(pattern_keys[k], k) for k in capture if k in pattern_keys]
    if not asked:
        return None
    reach = prompt_len + max_tokens - 2
    if isinstance(positions, str):
        lo, hi = interval(positions, prompt_len)
        last = min(hi - 1, reach) if lo <= min(hi - 1, reach) else None
    else:
        last = max((int(p) for p in positions if p <= reach), default=None)
    fits, key = min(asked)
    if last is None or last < fits:
        return None
    return (f"{key} holds {fits} keys a row (positions 0..{fits - 1}); this request (a prompt of {prompt_len} "
            f"tokens, max_tokens={max_tokens}) can ask for position {last}")


def last_reachable(prompt_len: int | None, max_tokens: int | None, max_model_len: int | None):
    """(the last position a request can have a row at, why) from what is known before it runs:
    its prompt's length and max_tokens (P + max_tokens - 2), the engine's max_model_len (a
    request's tokens fit it: max_model_len - 2); None where neither is known."""
    bounds = []
    if prompt_len is not None and max_tokens is not None:
        bounds.append((prompt_len + max_tokens - 2, f"a prompt of {prompt_len} tokens and max_tokens={max_tokens}"))
    if max_model_len is not None:
        bounds.append((max_model_len - 2, f"the engine's max_model_len={max_model_len}"))
    return min(bounds) if bounds else None
