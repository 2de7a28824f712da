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
# project_out keeps a whole row block in registers while it accumulates the dot product.
MAX_ROW_BLOCK = 4096


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the ops run the Triton kernel (CUDA, or the interpreter) or the torch reference."""
    return t.is_cuda or INTERPRET


def col_block(width: int, cap: int = MAX_COL_BLOCK) -> int:
    return min(triton.next_power_of_2(width), cap)


def warps_for(block: int) -> int:
    return 8 if block >= 4096 else 4


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_activation(x: torch.Tensor, name: str = "x") -> None:
    check(x.dim() == 2, f"{name} must be [num_tokens, width], got shape {tuple(x.shape)}")
    check(x.is_floating_point(), f"{name} must be floating point, got {x.dtype}")


def check_partner(x: torch.Tensor, b: torch.Tensor, name: str = "b") -> None:
    check(b.shape == x.shape, f"{name} must have x's shape {tuple(x.shape)}, got {tuple(b.shape)}")
    check(b.device == x.device, f"{name} is on {b.device}, x on {x.device}")


def check_row_table(table: torch.Tensor, x: torch.Tensor, name: str) -> None:
    check(table.dtype == torch.int32, f"{name} must be int32, got {table.dtype}")
    check(table.dim() == 1, f"{name} must be 1-D, got shape {tuple(table.shape)}")
    check(
        table.shape[0] >= x.shape[0],
        f"{name} has {table.shape[0]} entries for {x.shape[0]} rows; it needs one per row",
    )
    check(table.device == x.device, f"{name} is on {table.device}, x on {x.device}")


def check_slot_table(table: torch.Tensor, x: torch.Tensor, slots: int, width: int | None,
                     dtype: torch.dtype | None, name: str) -> None:
    """A per-slot parameter table: `slots` rows (of `width` entries, if given) on x's device."""
    shape = (slots,) if width is None else (slots, width)
    check(tuple(table.shape) == shape, f"{name} must have shape {shape}, got {tuple(table.shape)}")
    if dtype is not None:
        check(table.dtype == dtype, f"{name} must be {dtype}, got {table.dtype}")
    check(table.device == x.device, f"{name} is on {table.device}, x on {x.device}")
