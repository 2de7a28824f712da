"""What the tap kernel launchers share: when Triton runs, block sizes, argument checks.

Checks here look only at static facts (dtype, rank, shape, device), never at tensor values:
reading a value would synchronize with the device and break CUDA-graph capture.
"""
import torch
import triton

# Triton picks compiled or interpreted kernels when `@triton.jit` runs, from TRITON_INTERPRET.
# Read the same switch once, at the same import, so CPU tensors go to Triton exactly when the
# kernels were built for the interpreter (the CPU tests) and to the torch references otherwise.
INTERPRET = bool(triton.knobs.runtime.interpret)

# Columns one program handles in the row-parallel kernels: 2048 x 2 bytes is 4 KiB read and
# 4 KiB written per program, enough to keep the H200's memory pipes full at 4 warps.
MAX_COL_BLOCK = 2048
# project_out keeps a whole row in registers up to this width (one read of x); wider rows
# loop over blocks of MAX_LOOP_BLOCK columns twice (dot, then write).
MAX_ROW_BLOCK = 16384
MAX_LOOP_BLOCK = 4096


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the ops run the Triton kernel (CUDA, or the interpreter) or the torch reference."""
    return t.is_cuda or INTERPRET


def col_block(width: int, cap: int = MAX_COL_BLOCK) -> int:
    return min(triton.next_power_of_2(width), cap)


def warps_for(block: int) -> int:
    return 8 if block >= 4096 else 4


# The checks below build their messages only on failure: an eager op call runs them every step.


def check_activation(x: torch.Tensor, name: str = "x", integers: bool = False) -> None:
    """`integers`: integer values are fine too (a capture of an MoE router's expert ids)."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be [num_tokens, width], got shape {tuple(x.shape)}")
    if not (x.is_floating_point() or integers and not x.is_complex() and x.dtype != torch.bool):
        raise ValueError(f"{name} must be floating point, got {x.dtype}")


def check_partner(x: torch.Tensor, b: torch.Tensor, name: str = "b") -> None:
    if b.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(b.shape)}")
    if b.device != x.device:
        raise ValueError(f"{name} is on {b.device}, x on {x.device}")


def check_row_table(table: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if table.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {table.dtype}")
    if table.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(table.shape)}")
    if table.shape[0] < x.shape[0]:
        raise ValueError(
            f"{name} has {table.shape[0]} entries for {x.shape[0]} rows; it needs one per row"
        )
    if table.device != x.device:
        raise ValueError(f"{name} is on {table.device}, x on {x.device}")
    check_unit_stride(table, name)


def check_ring(ring: torch.Tensor | None, pos: torch.Tensor | None, x: torch.Tensor) -> None:
    """A capture's ring (capture.py): its int32 start positions and the model's positions, one
    entry per row of x at least, or neither."""
    if ring is None and pos is None:
        return
    if ring is None or pos is None:
        raise ValueError("a ring needs both its start positions (ring) and the model's positions (pos)")
    check_row_table(ring, x, "ring")
    if pos.dtype not in (torch.int32, torch.int64) or pos.dim() != 1 or pos.shape[0] < x.shape[0]:
        raise ValueError(f"pos must be 1-D int32 or int64 with an entry per row ({x.shape[0]}), got "
                         f"{pos.dtype} of shape {tuple(pos.shape)}")
    if pos.device != x.device:
        raise ValueError(f"pos is on {pos.device}, x on {x.device}")
    check_unit_stride(pos, "pos")


def check_unit_stride(table: torch.Tensor, name: str) -> None:
    # The kernels index tables by position along their last dimension.
    if table.numel() > 1 and table.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension (make it "
                         f"contiguous), got strides {table.stride()}")


def check_buffer(out: torch.Tensor, x: torch.Tensor) -> None:
    if out.dim() != 2 or out.shape[1] != x.shape[1]:
        raise ValueError(
            f"out must be [rows, {x.shape[1]}] like x's width, got {tuple(out.shape)}"
        )
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")


def check_slot_table(table: torch.Tensor, x: torch.Tensor, shape: tuple,
                     dtype: torch.dtype | None, name: str) -> None:
    """A per-slot parameter table of the given shape (and dtype, if given) on x's device."""
    if table.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(table.shape)}")
    if dtype is not None and table.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {table.dtype}")
    if table.device != x.device:
        raise ValueError(f"{name} is on {table.device}, x on {x.device}")
    check_unit_stride(table, name)
