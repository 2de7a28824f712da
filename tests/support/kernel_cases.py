"""What the kernel tests share: device, per-dtype tolerances, random data and tables.

Not a test module. On a machine without CUDA the kernels run through Triton's interpreter,
which conftest.py switches on before anything imports tapc.kernels.
"""
import zlib

import torch

from tapc.kernels.common import INTERPRET

ON_GPU = torch.cuda.is_available()

if not ON_GPU and not INTERPRET:
    raise RuntimeError(
        "no CUDA and tapc.kernels was imported before TRITON_INTERPRET=1 was set: the kernel "
        "tests would compare the torch references with themselves. Run pytest with "
        "TRITON_INTERPRET=1 in the environment."
    )

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding apart at most: bf16/fp16 results one unit in the last place (the interpreter
# truncates to bf16 where GPUs round to nearest); fp32 results one rounding of an intermediate
# (GPU kernels fuse a*b+c into one FMA) of size up to ~10, hence atol 1e-5.
TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}
# Full-size GPU tests: the widths the models use, and one with no power of two in it.
GPU_WIDTHS = [896, 2560, 3584, 5120, 8192, 14336, 4099]
EXTRA = 3  # table entries past the last row: valid targets, which the kernels must not read
SLOTS = 3


def seed(*key) -> None:
    """Seed from the test's parameters: each case its own data, the same on every run."""
    torch.manual_seed(zlib.crc32(repr(key).encode()))


def randn(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, width, device=DEVICE, dtype=torch.float32).to(dtype)


def skipped_rows(num_tokens: int) -> torch.Tensor:
    """Rows marked -1: every third row from the second on, so row 0 is always kept."""
    return torch.arange(num_tokens, device=DEVICE) % 3 == 1


def dst_table(num_tokens: int, out_rows: int) -> torch.Tensor:
    """Distinct destinations in shuffled order, -1 on `skipped_rows`; entries past the rows
    point at real buffer rows nobody else writes, so reading them would show."""
    table = torch.randperm(out_rows, device=DEVICE)[: num_tokens + EXTRA].to(torch.int32)
    table[:num_tokens][skipped_rows(num_tokens)] = -1
    return table


def slot_table(num_tokens: int, slots: int = SLOTS) -> torch.Tensor:
    table = torch.randint(0, slots, (num_tokens + EXTRA,), device=DEVICE, dtype=torch.int32)
    table[:num_tokens][skipped_rows(num_tokens)] = -1
    return table


def poisoned(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, width), float("nan"), device=DEVICE, dtype=dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    torch.testing.assert_close(
        actual, expected, equal_nan=True, **TOL[dtype],
        msg=lambda m: f"{what}: {m}",
    )


def assert_rows_untouched(new: torch.Tensor, old: torch.Tensor, rows: torch.Tensor, what: str):
    """Rows `rows` (bool mask) of `new` are bit for bit those of `old` (NaN poison included)."""
    a, b = new[rows], old[rows]
    same = (a == b) | (a.isnan() & b.isnan())
    bad = rows.nonzero().squeeze(1)[~same.all(dim=1)]
    assert bad.numel() == 0, f"{what}: rows {bad.tolist()[:10]} were written but must not be"


def paged_keys(keys: list[torch.Tensor], block_size: int, extra_blocks: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys `[seq_len, kv_heads, head_dim]` paged through shuffled blocks into a
    KV cache of vLLM's FlashAttention layout, `[blocks, kv_heads, block_size, 2 x head_dim]` (a
    token's keys, then its values), with values and unused slots random: (the cache, the int32
    block table, a row a request)."""
    kv_heads, head_dim = keys[0].shape[1:]
    per = [-(-len(k) // block_size) for k in keys]
    n_blocks = sum(per) + extra_blocks
    cache = torch.randn(n_blocks, kv_heads, block_size, 2 * head_dim, device=DEVICE).to(keys[0].dtype)
    order = torch.randperm(n_blocks).tolist()
    table = torch.zeros(len(keys), max(per) + 2, dtype=torch.int32, device=DEVICE)
    for s, k in enumerate(keys):
        for b in range(per[s]):
            blk = order.pop()
            table[s, b] = blk
            rows = k[b * block_size: (b + 1) * block_size]
            cache[blk, :, : len(rows), :head_dim] = rows.transpose(0, 1)
    return cache, table
