"""Capture: copy the rows of an activation that some request asked for into a buffer.

A per-row destination table `dst` (int32, at least one entry per row of the padded batch) says
where row i goes: out[dst[i]] = x[i]. -1 marks padding rows and rows of requests that did not
ask; those are neither read nor written. The host fills `dst` before each step, so one captured
CUDA graph serves every batch the engine forms. Entries >= out.shape[0] are skipped like -1: a
host bug must not write past the buffer, and the op cannot report it without synchronizing.

Variants: `capture_sum` stores a + b (hidden_states + residual: the residual stream) in one
pass, adding in fp32; a column slice is a strided view of x (strides are respected); the store
converts to out's dtype. `capture` takes integer rows too (an MoE router's expert ids, into
their int32 pool): no cast kernel before it.
"""
import torch
import triton
import triton.language as tl

from .common import (
    check_activation, check_buffer, check_partner, check_row_table, col_block, warps_for,
)


@triton.jit
def _capture_kernel(
    x_ptr, y_ptr, dst_ptr, out_ptr, width, out_rows,
    stride_x, stride_xc, stride_y, stride_yc, stride_out, stride_outc,
    HAS_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    d = tl.load(dst_ptr + row)
    if (d < 0) | (d >= out_rows):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    # int64 row offsets: capture buffers can pass 2**31 elements.
    src = row.to(tl.int64)
    v = tl.load(x_ptr + src * stride_x + cols * stride_xc, mask=mask)
    if HAS_Y:
        y = tl.load(y_ptr + src * stride_y + cols * stride_yc, mask=mask)
        v = v.to(tl.float32) + y.to(tl.float32)
    tl.store(
        out_ptr + d.to(tl.int64) * stride_out + cols * stride_outc,
        v.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _launch(x: torch.Tensor, y: torch.Tensor | None, dst: torch.Tensor, out: torch.Tensor) -> None:
    check_activation(x, integers=y is None)
    if y is not None:
        check_partner(x, y)
    check_row_table(dst, x, "dst")
    check_buffer(out, x)
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block = col_block(width)
    other = x if y is None else y
    _capture_kernel[(num_tokens, triton.cdiv(width, block))](
        x, other, dst, out, width, out.shape[0],
        x.stride(0), x.stride(1), other.stride(0), other.stride(1), out.stride(0), out.stride(1),
        HAS_Y=y is not None, BLOCK=block, num_warps=warps_for(block),
    )


def capture(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """out[dst[i]] = x[i].to(out.dtype) for every row i < x.shape[0] with dst[i] >= 0 (Triton)."""
    _launch(x, None, dst, out)


def capture_sum(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """out[dst[i]] = (a[i] + b[i]) added in fp32, stored in out.dtype (Triton)."""
    _launch(a, b, dst, out)


def _kept_rows(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    d = dst[: x.shape[0]]
    return ((d >= 0) & (d < out.shape[0])).nonzero().squeeze(1)


def capture_ref(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """Plain-torch reference of `capture`."""
    rows = _kept_rows(x, dst, out)
    out[dst[rows].long()] = x[rows].to(out.dtype)


def capture_sum_ref(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> None:
    """Plain-torch reference of `capture_sum`."""
    rows = _kept_rows(a, dst, out)
    out[dst[rows].long()] = (a[rows].float() + b[rows].float()).to(out.dtype)
