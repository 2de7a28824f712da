"""The tap ops as `torch.library` custom ops in the `tapc` namespace, registered on import.

Each op declares what it mutates and has a fake implementation that returns nothing, so that
Dynamo puts it in the graph as one node and Inductor calls it in place (no copy of the buffer
it writes). Nothing an op reads on the host changes between steps: shapes and strides are fixed
per captured graph, and the per-step tables are device tensors the host refills. So a CUDA
graph replays them correctly with whatever the tables hold at replay time.

`tapc::boundary` is different: the engine lists it in vLLM's splitting ops, so it runs eagerly
between graph pieces and calls back into tapc's runtime (see `set_boundary_handler`).

No `from __future__ import annotations` here: torch.library reads the schema from the
annotations and needs them as real types.
"""
from typing import Callable, Optional

import torch

from . import capture as _capture
from . import edit as _edit
from .common import runs_triton


@torch.library.custom_op("tapc::capture", mutates_args=("out",))
def capture(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """out[dst[i]] = x[i].to(out.dtype) for rows i < x.shape[0] with dst[i] >= 0."""
    (_capture.capture if runs_triton(x) else _capture.capture_ref)(x, dst, out)


@torch.library.custom_op("tapc::capture_sum", mutates_args=("out",))
def capture_sum(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """out[dst[i]] = a[i] + b[i] (fp32 add, stored in out.dtype) for rows with dst[i] >= 0."""
    (_capture.capture_sum if runs_triton(a) else _capture.capture_sum_ref)(a, b, dst, out)


@torch.library.custom_op("tapc::add_", mutates_args=("x",))
def add_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor, vec: torch.Tensor,
         alpha: torch.Tensor) -> None:
    """x[i] += alpha[slot[i]] * vec[slot[i]] for rows with slot[i] >= 0."""
    (_edit.add_ if runs_triton(x) else _edit.add_ref)(x, b, slot, vec, alpha)


@torch.library.custom_op("tapc::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor,
           factor: torch.Tensor) -> None:
    """s = x (+ b) becomes factor[slot[i]] * s, written through x."""
    (_edit.scale_ if runs_triton(x) else _edit.scale_ref)(x, b, slot, factor)


@torch.library.custom_op("tapc::set_cols_", mutates_args=("x",))
def set_cols_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor, cols: torch.Tensor,
              vals: torch.Tensor) -> None:
    """s[cols[k, j]] = vals[k, j] with k = slot[i], entries cols >= 0; written through x."""
    (_edit.set_cols_ if runs_triton(x) else _edit.set_cols_ref)(x, b, slot, cols, vals)


@torch.library.custom_op("tapc::project_out_", mutates_args=("x",))
def project_out_(x: torch.Tensor, b: Optional[torch.Tensor], slot: torch.Tensor,
                 dirs: torch.Tensor) -> None:
    """s -= (s . d) d with d = dirs[slot[i]], dot in fp32; written through x."""
    (_edit.project_out_ if runs_triton(x) else _edit.project_out_ref)(x, b, slot, dirs)


BoundaryHandler = Callable[[int, torch.Tensor, Optional[torch.Tensor]], None]
_boundary_handler: Optional[BoundaryHandler] = None


def set_boundary_handler(fn: Optional[BoundaryHandler]) -> None:
    """Make `tapc::boundary` call fn(point, x, b); None removes the handler.

    fn must edit x (and b) in place and keep their addresses: the graph piece after the
    boundary reads the tensors it recorded at capture.
    """
    global _boundary_handler
    _boundary_handler = fn


@torch.library.custom_op("tapc::boundary", mutates_args=("x", "b"))
def boundary(x: torch.Tensor, b: Optional[torch.Tensor], point: int) -> None:
    """Hand x (and b) to tapc's runtime at tap point `point`, a constant of the call site."""
    if _boundary_handler is None:
        raise RuntimeError(
            f"tapc::boundary reached tap point {point} but no boundary handler is set in this "
            "process; the engine must call tapc.kernels.ops.set_boundary_handler(fn) in every "
            "worker before the model runs"
        )
    _boundary_handler(point, x, b)


# Fake implementations: the ops return nothing and only write their declared arguments, so
# tracing needs no shape logic.
for _op in (capture, capture_sum, add_, scale_, set_cols_, project_out_, boundary):
    _op.register_fake(lambda *args, **kwargs: None)
