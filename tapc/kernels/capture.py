"""Capture: copy the rows of an activation that some request asked for into a buffer.

A per-row destination table `dst` (int32, at least one entry per row of the padded batch) says
where row i goes: out[dst[i]] = x[i]. -1 marks padding rows and rows of requests that did not
ask; those are neither read nor written. The host fills `dst` before each step, so one captured
CUDA graph serves every batch the engine forms. Entries >= out.shape[0] are skipped like -1: a
host bug must not write past the buffer, and the op cannot report it without synchronizing.

Variants: `capture_pair` does two captures in one launch (an MoE router's weights and expert
ids, captured together at every layer: one graph node where there were two), `capture_trio`
three (the router's logits too); `capture_sum` stores a + b (hidden_states + residual: the
residual stream) in one pass, adding in fp32; a column slice is a strided view of x (strides are respected); the store
converts to out's dtype. `capture` takes integer rows too (an MoE router's expert ids, into
their int32 pool): no cast kernel before it.

A *ring* (`ring`, `pos`, `stride`; tapc/worker/rings.py) lets a steady decode write
`PHASES` steps' rows before the host copies them out, with no table upload between: where
`ring[i] >= 0`, row i goes `((pos[i] - ring[i]) % PHASES) * stride` pool rows past `dst[i]`,
`pos` being the model's positions (one more each decode step, on the device) and `ring[i]` the
position the ring started at. The host then issues one copy and one event every `PHASES`
steps, not one a step.
"""
import itertools

import torch
import triton
import triton.language as tl

from .common import (
    check_activation,
    check_buffer,
    check_partner,
    check_ring,
    check_row_table,
    col_block,
    warps_for,
)

# Steps a ring holds. A power of two: the kernel takes the phase with a mask. A ring's copy-out
# is one copy a request and capture group whatever its length; 32 steps cut the host's copy-out
# time at batch 64 on the MoE shape to a third and moved no ratio (the step there waits for the
# GPU: benchmarks/results/bench_moe-h200.md), so rings stay short, as their pools need room for
# every step (rings.py `Repeat.ring_fits`).
PHASES = 8


@triton.jit
def _capture_block(
    x_ptr, y_ptr, dst_ptr, out_ptr, row, block, width, out_rows,
    stride_x, stride_xc, stride_y, stride_yc, stride_out, stride_outc,
    ring_ptr, pos_ptr, ring_stride,
    HAS_Y: tl.constexpr, RING: tl.constexpr, PHASES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Columns [block * BLOCK, +BLOCK) of row `row` (of x, or x + y) to out[dst[row]] (plus the
    ring's phase, where the row is in one)."""
    d = tl.load(dst_ptr + row).to(tl.int64)
    if RING:
        # loaded beside dst, not after it: one round trip to memory, not two
        start = tl.load(ring_ptr + row).to(tl.int64)
        p = tl.load(pos_ptr + row).to(tl.int64)
        d = tl.where((d >= 0) & (start >= 0), d + ((p - start) & (PHASES - 1)) * ring_stride, d)
    if (d >= 0) & (d < out_rows):
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        # int64 row offsets: capture buffers can pass 2**31 elements.
        src = row.to(tl.int64)
        v = tl.load(x_ptr + src * stride_x + cols * stride_xc, mask=mask)
        if HAS_Y:
            y = tl.load(y_ptr + src * stride_y + cols * stride_yc, mask=mask)
            v = v.to(tl.float32) + y.to(tl.float32)
        tl.store(out_ptr + d * stride_out + cols * stride_outc, v.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _capture_kernel(
    x_ptr, y_ptr, dst_ptr, out_ptr, width, out_rows,
    stride_x, stride_xc, stride_y, stride_yc, stride_out, stride_outc,
    ring_ptr, pos_ptr, ring_stride,
    HAS_Y: tl.constexpr, RING: tl.constexpr, PHASES: tl.constexpr, BLOCK: tl.constexpr,
):
    _capture_block(x_ptr, y_ptr, dst_ptr, out_ptr, tl.program_id(0), tl.program_id(1), width, out_rows,
                   stride_x, stride_xc, stride_y, stride_yc, stride_out, stride_outc,
                   ring_ptr, pos_ptr, ring_stride, HAS_Y, RING, PHASES, BLOCK)


@triton.jit
def _capture_joint_kernel(
    x0_ptr, dst0_ptr, out0_ptr, width0, rows0, stride_x0, stride_xc0, stride_out0, stride_outc0, ring_stride0,
    x1_ptr, dst1_ptr, out1_ptr, width1, rows1, stride_x1, stride_xc1, stride_out1, stride_outc1, ring_stride1,
    x2_ptr, dst2_ptr, out2_ptr, width2, rows2, stride_x2, stride_xc2, stride_out2, stride_outc2, ring_stride2,
    ring_ptr, pos_ptr, RING: tl.constexpr, PHASES: tl.constexpr, END0: tl.constexpr, END1: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The grid's second axis: column blocks [0, END0) are the first capture's, [END0, END1) the
    # second's, the rest the third's (a pair's grid ends at END1).
    row = tl.program_id(0)
    j = tl.program_id(1)
    if j < END0:
        _capture_block(x0_ptr, x0_ptr, dst0_ptr, out0_ptr, row, j, width0, rows0, stride_x0, stride_xc0,
                       stride_x0, stride_xc0, stride_out0, stride_outc0, ring_ptr, pos_ptr, ring_stride0,
                       False, RING, PHASES, BLOCK)
    elif j < END1:
        _capture_block(x1_ptr, x1_ptr, dst1_ptr, out1_ptr, row, j - END0, width1, rows1, stride_x1, stride_xc1,
                       stride_x1, stride_xc1, stride_out1, stride_outc1, ring_ptr, pos_ptr, ring_stride1,
                       False, RING, PHASES, BLOCK)
    else:
        _capture_block(x2_ptr, x2_ptr, dst2_ptr, out2_ptr, row, j - END1, width2, rows2, stride_x2, stride_xc2,
                       stride_x2, stride_xc2, stride_out2, stride_outc2, ring_ptr, pos_ptr, ring_stride2,
                       False, RING, PHASES, BLOCK)


def _joint(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], ring: torch.Tensor | None,
           pos: torch.Tensor | None) -> None:
    """Two or three captures, each (x, dst, out, ring stride), of rows of one batch in one launch."""
    for x, dst, out, _ in parts:
        check_activation(x, integers=True)
        check_row_table(dst, x, "dst")
        check_buffer(out, x)
    x0 = parts[0][0]
    for k, (x, _, out, _) in enumerate(parts[1:], 1):
        if x.shape[0] != x0.shape[0]:
            raise ValueError(f"x{k} must have x0's {x0.shape[0]} rows, got {x.shape[0]}")
        for i in range(k):
            if out.untyped_storage().data_ptr() == parts[i][2].untyped_storage().data_ptr():
                # a compiled graph writes each mutated argument back whole: one buffer twice loses a capture
                raise ValueError(f"out{i} and out{k} are one buffer: a joint capture needs one each "
                                 "(call capture for each)")
    check_ring(ring, pos, x0)
    num_tokens = x0.shape[0]
    if num_tokens == 0:
        return
    block = col_block(max(x.shape[1] for x, *_ in parts))
    ends = list(itertools.accumulate(triton.cdiv(x.shape[1], block) for x, *_ in parts))
    third = parts[2] if len(parts) == 3 else parts[1]   # a pair's grid never reaches the third's blocks
    args = []
    for x, dst, out, stride in (*parts[:2], third):
        args += [x, dst, out, x.shape[1], out.shape[0], x.stride(0), x.stride(1), out.stride(0), out.stride(1), stride]
    _capture_joint_kernel[(num_tokens, ends[-1])](
        *args, parts[0][1] if ring is None else ring, parts[0][1] if pos is None else pos,
        RING=ring is not None, PHASES=PHASES, END0=ends[0], END1=ends[1], BLOCK=block, num_warps=warps_for(block),
    )


def capture_pair(x0: torch.Tensor, x1: torch.Tensor, dst0: torch.Tensor, dst1: torch.Tensor,
                 out0: torch.Tensor, out1: torch.Tensor, ring: torch.Tensor | None = None,
                 pos: torch.Tensor | None = None, stride0: int = 0, stride1: int = 0) -> None:
    """`capture(x0, dst0, out0)` and `capture(x1, dst1, out1)` in one launch (Triton); x0 and x1
    have the same rows. With a ring, each capture steps by its own stride."""
    _joint([(x0, dst0, out0, stride0), (x1, dst1, out1, stride1)], ring, pos)


def capture_trio(x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, dst0: torch.Tensor, dst1: torch.Tensor,
                 dst2: torch.Tensor, out0: torch.Tensor, out1: torch.Tensor, out2: torch.Tensor,
                 ring: torch.Tensor | None = None, pos: torch.Tensor | None = None, stride0: int = 0,
                 stride1: int = 0, stride2: int = 0) -> None:
    """Three captures of rows of one batch in one launch, as `capture_pair` two (an MoE router's
    logits, weights and expert ids)."""
    _joint([(x0, dst0, out0, stride0), (x1, dst1, out1, stride1), (x2, dst2, out2, stride2)], ring, pos)


def _launch(x: torch.Tensor, y: torch.Tensor | None, dst: torch.Tensor, out: torch.Tensor,
            ring: torch.Tensor | None, pos: torch.Tensor | None, stride: int) -> None:
    check_activation(x, integers=y is None)
    if y is not None:
        check_partner(x, y)
    check_row_table(dst, x, "dst")
    check_buffer(out, x)
    check_ring(ring, pos, x)
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block = col_block(width)
    other = x if y is None else y
    _capture_kernel[(num_tokens, triton.cdiv(width, block))](
        x, other, dst, out, width, out.shape[0],
        x.stride(0), x.stride(1), other.stride(0), other.stride(1), out.stride(0), out.stride(1),
        dst if ring is None else ring, dst if pos is None else pos, stride,   # (unread without a ring)
        HAS_Y=y is not None, RING=ring is not None, PHASES=PHASES, BLOCK=block, num_warps=warps_for(block),
    )


def capture(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, ring: torch.Tensor | None = None,
            pos: torch.Tensor | None = None, stride: int = 0) -> None:
    """out[dst[i]] = x[i].to(out.dtype) for every row i < x.shape[0] with dst[i] >= 0 (Triton);
    with a ring, dst[i] plus the row's phase times `stride`."""
    _launch(x, None, dst, out, ring, pos, stride)


def capture_sum(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor,
                ring: torch.Tensor | None = None, pos: torch.Tensor | None = None, stride: int = 0) -> None:
    """out[dst[i]] = (a[i] + b[i]) added in fp32, stored in out.dtype (Triton)."""
    _launch(a, b, dst, out, ring, pos, stride)


def _places(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, ring: torch.Tensor | None,
            pos: torch.Tensor | None, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of x the kernel writes and the pool rows it writes them to."""
    d = dst[: x.shape[0]].long()
    if ring is not None:
        start, p = ring[: x.shape[0]].long(), pos[: x.shape[0]].long()
        d = torch.where((d >= 0) & (start >= 0), d + ((p - start) & (PHASES - 1)) * stride, d)
    rows = ((d >= 0) & (d < out.shape[0])).nonzero().squeeze(1)
    return rows, d[rows]


def capture_ref(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor, ring: torch.Tensor | None = None,
                pos: torch.Tensor | None = None, stride: int = 0) -> None:
    """Plain-torch reference of `capture`."""
    rows, to = _places(x, dst, out, ring, pos, stride)
    out[to] = x[rows].to(out.dtype)


def capture_pair_ref(x0, x1, dst0, dst1, out0, out1, ring=None, pos=None, stride0=0, stride1=0) -> None:
    """Plain-torch reference of `capture_pair`."""
    capture_ref(x0, dst0, out0, ring, pos, stride0)
    capture_ref(x1, dst1, out1, ring, pos, stride1)


def capture_trio_ref(x0, x1, x2, dst0, dst1, dst2, out0, out1, out2, ring=None, pos=None,
                     stride0=0, stride1=0, stride2=0) -> None:
    """Plain-torch reference of `capture_trio`."""
    capture_pair_ref(x0, x1, dst0, dst1, out0, out1, ring, pos, stride0, stride1)
    capture_ref(x2, dst2, out2, ring, pos, stride2)


def capture_sum_ref(a: torch.Tensor, b: torch.Tensor, dst: torch.Tensor, out: torch.Tensor,
                    ring: torch.Tensor | None = None, pos: torch.Tensor | None = None, stride: int = 0) -> None:
    """Plain-torch reference of `capture_sum`."""
    rows, to = _places(a, dst, out, ring, pos, stride)
    out[to] = (a[rows].float() + b[rows].float()).to(out.dtype)
