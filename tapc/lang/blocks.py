"""How a Python block (`point -> name`) is called: once per request that runs it (the default),
or once per step for all of them (`batched`). No torch here: the API side marks blocks too."""
from __future__ import annotations

from collections.abc import Callable

BATCHED = "tapc_batched"   # the attribute that marks a batched block


def batched(fn: Callable) -> Callable:
    """Mark a block to be called once per point and step with the rows of every request that
    runs it, `fn(batch, x)`, instead of once per request (`fn(ctx, x)`); docs/blocks.md says
    what `batch` holds. Returns `fn` itself, so it pickles and imports as before."""
    if not callable(fn):
        raise TypeError(f"batched() takes a function, got {type(fn).__name__}")
    setattr(fn, BATCHED, True)
    return fn


def is_batched(fn: Callable) -> bool:
    return bool(getattr(fn, BATCHED, False))
