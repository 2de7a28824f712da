"""Compiled functions (`point | call(name, ...)`): what a function declares, and what it is given.

A compiled function is torch code that torch.compile traces together with the model, inside
vLLM's graphs (docs/blocks.md). It is vectorized over the step, as FlexAttention's `score_mod`
is: it gets the point's activation for every row of the step, padding included, and a `Batch`
saying which rows asked for it, and returns the edited activation, named results, or both.

The plan needs its parameters (to size per-request tables) and its results (to size their
pools) before any engine runs, so a function declares them with `function(...)`; a function
without the decorator takes no parameters and returns only the edited activation. No torch
here: specs name functions by import path and `tapc explain` reads their declarations.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SIGNATURE = "tapc_function"     # the attribute `function` sets
PARAM_KINDS = ("scalar", "vector")
RESULT_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")


@dataclass(frozen=True)
class Signature:
    """What a compiled function takes and gives: parameters (name, kind), in the order the tap
    may bind them, and results (name, width or None for the point's own width, dtype)."""

    params: tuple[tuple[str, str], ...] = ()
    results: tuple[tuple[str, int | None, str], ...] = ()


def function(params: Mapping[str, str] | None = None,
             results: Mapping[str, int | None | tuple[int | None, str]] | None = None) -> Callable:
    """Declare a compiled function's per-request parameters and its named results.

        @tapc.function(params={"threshold": "scalar"}, results={"score": 16})
        def probe(x, batch):
            ...

    params: name -> "scalar" (one number per request) or "vector" (one number per column of
    the point). A tap binds each to a literal or to a parameter name requests give values for.
    results: name -> width (None: the point's width), or (width, dtype); float32 unless said.
    Works on functions and on `torch.nn.Module` classes (their weights move to the GPU and
    are graph inputs, not constants)."""
    sig = Signature(tuple(_params(params or {})), tuple(_results(results or {})))

    def mark(fn):
        if not callable(fn):
            raise TypeError(f"function() marks a function or a module class, got {type(fn).__name__}")
        setattr(fn, SIGNATURE, sig)
        return fn

    return mark


def signature_of(fn) -> Signature:
    """The declared signature of a function or module (undeclared: no parameters, no results)."""
    return getattr(fn, SIGNATURE, None) or Signature()


def _params(params: Mapping[str, str]):
    for name, kind in params.items():
        if not isinstance(name, str) or not name.isidentifier() or name == "at":
            raise ValueError(f"function(): parameter name {name!r} must be an identifier other than `at`")
        if kind not in PARAM_KINDS:
            raise ValueError(f"function(): parameter {name!r} is {kind!r}; a parameter is one of {', '.join(PARAM_KINDS)}")
        yield name, kind


def _results(results: Mapping):
    for name, spec in results.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"function(): result name {name!r} must be an identifier")
        width, dtype = spec if isinstance(spec, tuple) else (spec, "float32")
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 1 << 20):
            raise ValueError(f"function(): result {name!r} has width {width!r}; give 1..{1 << 20} or None (the point's)")
        if dtype not in RESULT_DTYPES:
            raise ValueError(f"function(): result {name!r} has dtype {dtype!r}; use one of {', '.join(RESULT_DTYPES)}")
        yield name, width, dtype


@dataclass
class Batch:
    """What a compiled function gets beside the activation, every field a device tensor with
    one entry per row of the step (padding rows included, so that shapes do not depend on data):

    mask:     bool; True where the row's request applies the function at this row's position
              (it binds the function's parameters, and the tap's `at=` covers the position).
              The edit is kept only on these rows; others keep their activation bit for bit.
    slot:     int32; the row's parameter slot (-1 where mask is False).
    position: int64; the row's token position in its sequence (None where vLLM's runner does not
              expose one a row).
    params:   name -> the row's value of each declared parameter: [rows] for a scalar,
              [rows, width] for a vector (rows outside the mask hold another request's values).
    """

    mask: Any
    slot: Any
    position: Any
    params: dict[str, Any] = field(default_factory=dict)
