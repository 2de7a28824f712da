"""A compiled function's call at its point (`point | call(name, ...)`), traced with the model.

The call is plain torch code in the patched forward, so Dynamo inlines the user's function into
vLLM's graph: no split, and FULL CUDA graphs replay it with the rest. Everything it reads per
step lives in tables registered on the tapped module, at fixed addresses, that the host refills
before each forward (install.py): the edit row table (the row's parameter slot, -1 where its
request does not apply the function), the per-slot parameter tables, the runner's positions.

Shapes never depend on data: the function sees every row of the (padded) step, and the gate
is a `torch.where` on the full mask, so rows outside it keep their activation bit for bit.
Results go to their capture pools by the capture ops, kept per request like any capture.
"""
from __future__ import annotations

import torch

from tapc.lang.functions import Batch


class Call:
    """`fn(s, batch)` at a point, s = x (+ b, the residual, at `resid` points). `slot`, `params`
    (parameter name -> attribute) and `positions` (or None) name the attributes of `module`
    holding the row table, each parameter's table and the runner's positions; `results`:
    result name -> its capture op."""

    def __init__(self, module: torch.nn.Module, fn, slot: str, params: dict[str, str], positions: str | None,
                 results: dict):
        self.module, self.fn, self.slot, self.params, self.positions = module, fn, slot, params, positions
        self.results = results

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> None:
        n = x.shape[0]
        slot = getattr(self.module, self.slot)[:n]
        mask = slot >= 0
        row = slot.clamp(min=0).long()   # rows outside the mask read slot 0; the gate drops them
        params = {name: getattr(self.module, attr)[row] for name, attr in self.params.items()}
        position = getattr(self.module, self.positions)[:n] if self.positions is not None else None
        s = x if b is None else (x.float() + b.float()).to(x.dtype)
        edited, results = _split(self.fn(s, Batch(mask, slot, position, params)))
        if edited is not None:
            new = edited if b is None else edited.float() - b.float()
            x.copy_(torch.where(mask[:, None], new.to(x.dtype), x))
        for name, capture in self.results.items():
            capture(results[name], None)


def _split(out) -> tuple[torch.Tensor | None, dict]:
    """(edited activation or None, results) of what a function returned; the plan checked the
    form (tapc/plan/calls.py)."""
    if isinstance(out, dict):
        return None, out
    if isinstance(out, tuple):
        return out
    return out, {}
