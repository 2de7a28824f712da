"""Edits: change an activation in place, each row as the request that owns it asked.

A per-row slot table `slot` (int32, at least one entry per row of the padded batch) names the
slot of the request that owns row i; -1 leaves the row untouched (padding, requests without
this edit, or rows the request's edit does not cover, e.g. prompt rows of a "generated only"
edit), and so does a slot past the tables (a host bug must not read outside them). Parameters
live in per-slot device tables indexed by that slot. The host fills all of
them before each step; nothing the ops read on the host changes between steps.

Residual-stream points: when `b` (the residual) is given, the edited quantity is s = x + b and
only x is written, so that x_new + b equals the edited s. All arithmetic is in fp32; the
result is rounded once, to x's dtype.
"""
import torch
import triton
import triton.language as tl

from .common import (
    MAX_LOOP_BLOCK,
    MAX_ROW_BLOCK,
    check_activation,
    check_partner,
    check_row_table,
    check_slot_table,
    col_block,
    warps_for,
)


@triton.jit
def _add_kernel(
    x_ptr, slot_ptr, vec_ptr, alpha_ptr, width, num_slots,
    stride_x, stride_xc, stride_vec,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.load(slot_ptr + row)
    if (s < 0) | (s >= num_slots):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    ptrs = x_ptr + row.to(tl.int64) * stride_x + cols * stride_xc
    x = tl.load(ptrs, mask=mask).to(tl.float32)
    v = tl.load(vec_ptr + s.to(tl.int64) * stride_vec + cols, mask=mask).to(tl.float32)
    a = tl.load(alpha_ptr + s)
    tl.store(ptrs, (x + a * v).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(
    x_ptr, b_ptr, slot_ptr, factor_ptr, width, num_slots,
    stride_x, stride_xc, stride_b, stride_bc,
    HAS_B: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.load(slot_ptr + row)
    if (s < 0) | (s >= num_slots):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    r = row.to(tl.int64)
    ptrs = x_ptr + r * stride_x + cols * stride_xc
    x = tl.load(ptrs, mask=mask).to(tl.float32)
    f = tl.load(factor_ptr + s)
    if HAS_B:
        b = tl.load(b_ptr + r * stride_b + cols * stride_bc, mask=mask).to(tl.float32)
        x = f * (x + b) - b
    else:
        x = f * x
    tl.store(ptrs, x.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _set_cols_kernel(
    x_ptr, b_ptr, slot_ptr, cols_ptr, vals_ptr, width, num_slots, num_cols,
    stride_x, stride_xc, stride_b, stride_bc, stride_cols, stride_vals,
    HAS_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.load(slot_ptr + row)
    if (s < 0) | (s >= num_slots):
        return
    j = tl.arange(0, BLOCK_C)
    s64 = s.to(tl.int64)
    c = tl.load(cols_ptr + s64 * stride_cols + j, mask=j < num_cols, other=-1)
    # c < width as well: a bad column from the host must not write past the row.
    mask = (c >= 0) & (c < width)
    v = tl.load(vals_ptr + s64 * stride_vals + j, mask=mask)
    r = row.to(tl.int64)
    if HAS_B:
        v = v - tl.load(b_ptr + r * stride_b + c * stride_bc, mask=mask).to(tl.float32)
    tl.store(x_ptr + r * stride_x + c * stride_xc, v.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _project_out_kernel(
    x_ptr, b_ptr, slot_ptr, dirs_ptr, width, num_slots,
    stride_x, stride_xc, stride_b, stride_bc, stride_dirs,
    HAS_B: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    # One program per row: the dot product needs the whole row before any column is written.
    row = tl.program_id(0)
    s = tl.load(slot_ptr + row)
    if (s < 0) | (s >= num_slots):
        return
    r = row.to(tl.int64)
    x_row = x_ptr + r * stride_x
    b_row = b_ptr + r * stride_b
    d_row = dirs_ptr + s.to(tl.int64) * stride_dirs
    if ONE_PASS:
        # The row fits in registers (BLOCK >= width): x is read once, then written.
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        total = x
        if HAS_B:
            total += tl.load(b_row + cols * stride_bc, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(total * d, axis=0)
        tl.store(x_row + cols * stride_xc, (x - dot * d).to(x_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            v = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                v += tl.load(b_row + cols * stride_bc, mask=mask, other=0.0).to(tl.float32)
            acc += v * tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(acc, axis=0)
        # Second pass re-reads x and d, mostly from L1/L2 (a row is at most tens of KiB).
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            ptrs = x_row + cols * stride_xc
            v = tl.load(ptrs, mask=mask).to(tl.float32)
            d = tl.load(d_row + cols, mask=mask).to(tl.float32)
            tl.store(ptrs, (v - dot * d).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _patch_kernel(
    x_ptr, b_ptr, slot_ptr, pos_ptr, rows_ptr, at_ptr, width, num_slots, num_at,
    stride_x, stride_xc, stride_b, stride_bc, stride_rows, stride_rows_k, stride_at,
    HAS_B: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    s = tl.load(slot_ptr + row)
    if (s < 0) | (s >= num_slots):
        return
    s64 = s.to(tl.int64)
    # which of the slot's rows is for this row's position (-1 entries hold none)
    k = tl.arange(0, BLOCK_K)
    at = tl.load(at_ptr + s64 * stride_at + k, mask=k < num_at, other=-1)
    p = tl.load(pos_ptr + row).to(tl.int32)
    j = tl.max(tl.where((at == p) & (at >= 0), k, -1), axis=0)
    if j < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    r = row.to(tl.int64)
    v = tl.load(rows_ptr + s64 * stride_rows + j.to(tl.int64) * stride_rows_k + cols, mask=mask)
    if HAS_B:
        v -= tl.load(b_ptr + r * stride_b + cols * stride_bc, mask=mask).to(tl.float32)
    tl.store(x_ptr + r * stride_x + cols * stride_xc, v.to(x_ptr.dtype.element_ty), mask=mask)


def _check_common(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor) -> None:
    check_activation(x)
    if b is not None:
        check_partner(x, b)
    check_row_table(slot, x, "slot")


def _b_args(x: torch.Tensor, b: torch.Tensor | None) -> tuple:
    """b and its strides; x stands in when b is absent (HAS_B=False: never read)."""
    other = x if b is None else b
    return other, other.stride(0), other.stride(1)


def add_(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor, vec: torch.Tensor,
         alpha: torch.Tensor) -> None:
    """x[i] += alpha[s] * vec[s] with s = slot[i], for rows with s >= 0 (Triton).

    b plays no part: adding to x adds the same to x + b.
    """
    _check_common(x, b, slot)
    slots = vec.shape[0]
    check_slot_table(vec, x, (slots, x.shape[1]), None, "vec")
    check_slot_table(alpha, x, (slots,), torch.float32, "alpha")
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block = col_block(width)
    _add_kernel[(num_tokens, triton.cdiv(width, block))](
        x, slot, vec, alpha, width, slots, x.stride(0), x.stride(1), vec.stride(0),
        BLOCK=block, num_warps=warps_for(block),
    )


def scale_(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor,
           factor: torch.Tensor) -> None:
    """s = x (+ b) becomes factor[slot[i]] * s; only x is written (Triton)."""
    _check_common(x, b, slot)
    slots = factor.shape[0]
    check_slot_table(factor, x, (slots,), torch.float32, "factor")
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block = col_block(width)
    other, stride_b, stride_bc = _b_args(x, b)
    _scale_kernel[(num_tokens, triton.cdiv(width, block))](
        x, other, slot, factor, width, slots, x.stride(0), x.stride(1), stride_b, stride_bc,
        HAS_B=b is not None, BLOCK=block, num_warps=warps_for(block),
    )


def set_cols_(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor, cols: torch.Tensor,
              vals: torch.Tensor) -> None:
    """s[cols[k, j]] = vals[k, j] with k = slot[i], for entries cols >= 0 (Triton).

    Zeroing is vals = 0. Columns within one slot must be distinct (which duplicate wins is
    unspecified); columns >= width are ignored.
    """
    _check_common(x, b, slot)
    if cols.dim() != 2:
        raise ValueError(f"cols must be [slots, C], got shape {tuple(cols.shape)}")
    check_slot_table(cols, x, cols.shape, torch.int32, "cols")
    check_slot_table(vals, x, cols.shape, torch.float32, "vals")
    num_tokens, width = x.shape
    slots, num_cols = cols.shape
    if num_tokens == 0 or num_cols == 0:
        return
    other, stride_b, stride_bc = _b_args(x, b)
    _set_cols_kernel[(num_tokens,)](
        x, other, slot, cols, vals, width, slots, num_cols,
        x.stride(0), x.stride(1), stride_b, stride_bc, cols.stride(0), vals.stride(0),
        HAS_B=b is not None, BLOCK_C=triton.next_power_of_2(num_cols), num_warps=1,
    )


def project_out_(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor,
                 dirs: torch.Tensor) -> None:
    """s -= (s . d) d with d = dirs[slot[i]] (a unit vector), dot in fp32; x written (Triton)."""
    _check_common(x, b, slot)
    slots = dirs.shape[0]
    check_slot_table(dirs, x, (slots, x.shape[1]), None, "dirs")
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block, one_pass, warps = project_out_config(num_tokens, width)
    other, stride_b, stride_bc = _b_args(x, b)
    _project_out_kernel[(num_tokens,)](
        x, other, slot, dirs, width, slots, x.stride(0), x.stride(1), stride_b, stride_bc,
        dirs.stride(0),
        HAS_B=b is not None, BLOCK=block, ONE_PASS=one_pass, num_warps=warps,
    )


def patch_(x: torch.Tensor, b: torch.Tensor | None, slot: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
           at: torch.Tensor) -> None:
    """s = x (+ b) becomes rows[s, j] where at[s, j] == pos[i], s = slot[i] (activation
    patching: the request's own rows at their positions); rows with no match stay (Triton)."""
    _check_common(x, b, slot)
    if pos.dtype not in (torch.int32, torch.int64) or pos.dim() != 1 or pos.shape[0] < x.shape[0]:
        raise ValueError(f"pos must be 1-D int32 or int64 with an entry per row ({x.shape[0]}), got "
                         f"{pos.dtype} of shape {tuple(pos.shape)}")
    if at.dim() != 2:
        raise ValueError(f"at must be [slots, k], got shape {tuple(at.shape)}")
    slots, k = at.shape
    check_slot_table(at, x, (slots, k), torch.int32, "at")
    check_slot_table(rows, x, (slots, k, x.shape[1]), torch.float32, "rows")
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    block = col_block(width)
    other, stride_b, stride_bc = _b_args(x, b)
    _patch_kernel[(num_tokens, triton.cdiv(width, block))](
        x, other, slot, pos, rows, at, width, slots, k,
        x.stride(0), x.stride(1), stride_b, stride_bc, rows.stride(0), rows.stride(1), at.stride(0),
        # at least two entries a block: rows=1 then reduces a masked pair, not a one-element block
        HAS_B=b is not None, BLOCK=block, BLOCK_K=max(2, triton.next_power_of_2(k)), num_warps=warps_for(block),
    )


# Below this many rows project_out_ is bound by latency and by what one multiprocessor can
# move for its row, not by the whole chip's bandwidth (measured on an H200: docs/kernels.md).
FEW_ROWS = 512


def project_out_config(num_tokens: int, width: int) -> tuple[int, bool, int]:
    """(column block, whole row in registers, warps) for `project_out_`, as timed on an H200.

    Few rows: twice the warps (more loads in flight for each row), rows up to 16384 wide in
    registers. Many rows: rows up to 8192 wide in registers. Wider rows loop twice over blocks
    of 4096 columns (dot, then write).
    """
    few = num_tokens < FEW_ROWS
    if width > (MAX_ROW_BLOCK if few else MAX_ROW_BLOCK // 2):
        return MAX_LOOP_BLOCK, False, 8
    block = triton.next_power_of_2(width)
    return block, True, max(4, min(16, block // (512 if few else 1024)))


def _edited_rows(x: torch.Tensor, slot: torch.Tensor, slots: int) -> tuple:
    """Indices of the rows with a slot in [0, slots), and their slots (long), for the refs."""
    s = slot[: x.shape[0]].long()
    rows = ((s >= 0) & (s < slots)).nonzero().squeeze(1)
    return rows, s[rows]


def add_ref(x, b, slot, vec, alpha) -> None:
    """Plain-torch reference of `add_`."""
    rows, s = _edited_rows(x, slot, vec.shape[0])
    x[rows] = (x[rows].float() + alpha[s, None] * vec[s].float()).to(x.dtype)


def scale_ref(x, b, slot, factor) -> None:
    """Plain-torch reference of `scale_`."""
    rows, s = _edited_rows(x, slot, factor.shape[0])
    xs = x[rows].float()
    f = factor[s, None]
    if b is None:
        x[rows] = (f * xs).to(x.dtype)
    else:
        bs = b[rows].float()
        x[rows] = (f * (xs + bs) - bs).to(x.dtype)


def set_cols_ref(x, b, slot, cols, vals) -> None:
    """Plain-torch reference of `set_cols_`."""
    rows, s = _edited_rows(x, slot, cols.shape[0])
    c = cols[s].long()
    r = rows[:, None].expand_as(c)
    keep = (c >= 0) & (c < x.shape[1])
    r, c, v = r[keep], c[keep], vals[s][keep]
    if b is not None:
        v = v - b[r, c].float()
    x[r, c] = v.to(x.dtype)


def project_out_ref(x, b, slot, dirs) -> None:
    """Plain-torch reference of `project_out_`."""
    rows, s = _edited_rows(x, slot, dirs.shape[0])
    xs = x[rows].float()
    d = dirs[s].float()
    total = xs if b is None else xs + b[rows].float()
    dot = (total * d).sum(dim=1, keepdim=True)
    x[rows] = (xs - dot * d).to(x.dtype)


def patch_ref(x, b, slot, pos, rows, at) -> None:
    """Plain-torch reference of `patch_`."""
    edited, s = _edited_rows(x, slot, at.shape[0])
    hit = (at[s].long() == pos[edited].long()[:, None]) & (at[s] >= 0)
    found = hit.any(dim=1)
    edited, s, j = edited[found], s[found], hit[found].int().argmax(dim=1)
    v = rows[s, j]
    if b is not None:
        v = v - b[edited].float()
    x[edited] = v.to(x.dtype)
