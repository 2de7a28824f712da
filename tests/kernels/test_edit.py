"""Edit kernels against their torch references (tapc/kernels/edit.py)."""
import pytest
import torch
import torch.nn.functional as F
import triton
from kernel_cases import (
    DEVICE, DTYPES, GPU_WIDTHS, ON_GPU, SLOTS, assert_close, assert_rows_untouched, randn, seed,
    skipped_rows, slot_table,
)

from tapc.kernels import edit
from tapc.kernels.edit import (
    add_, add_ref, patch_, patch_ref, project_out_, project_out_ref, scale_, scale_ref, set_cols_, set_cols_ref,
)

# Odd widths; 2560 spans two column blocks; 4100 and 8200 fill most of a register block of
# project_out (8192, 16384). Its two-pass path: test_project_out_both_kernel_paths.
SHAPES = [(1, 5), (7, 123), (37, 896), (5, 2560), (2, 4100), (3, 8200)]
NUM_COLS = 5  # set_cols entries per slot: not a power of two

# Triton's interpreter warns on its own `range` over a runtime bound (numpy 1.25+).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def params(edit: str, width: int) -> tuple:
    """Random per-slot tables for an edit, as the engine would hold them."""
    if edit == "add":
        return randn(SLOTS, width, torch.float32), torch.randn(SLOTS, device=DEVICE)
    if edit == "scale":
        return (torch.rand(SLOTS, device=DEVICE) * 3 - 1,)
    if edit == "set_cols":
        cols = torch.stack([torch.randperm(width, device=DEVICE)[:NUM_COLS] for _ in range(SLOTS)])
        cols[0, 1] = -1  # an unused entry
        cols[1, 2] = width - 1
        vals = torch.randn(SLOTS, NUM_COLS, device=DEVICE)
        vals[2, 0] = 0.0  # zeroing
        return cols.to(torch.int32), vals
    return (F.normalize(randn(SLOTS, width, torch.float32), dim=1),)


KERNELS = {
    "add": (add_, add_ref),
    "scale": (scale_, scale_ref),
    "set_cols": (set_cols_, set_cols_ref),
    "project_out": (project_out_, project_out_ref),
}


def check_edit(edit, num_tokens, width, dtype, with_b):
    seed(edit, num_tokens, width, dtype, with_b)
    kernel, ref = KERNELS[edit]
    x = randn(num_tokens, width, dtype)
    b = randn(num_tokens, width, dtype) if with_b else None
    slot = slot_table(num_tokens)
    args = params(edit, width)
    actual, expected = x.clone(), x.clone()
    b_before = None if b is None else b.clone()
    kernel(actual, b, slot, *args)
    ref(expected, b, slot, *args)
    what = f"{edit} {'with' if with_b else 'without'} b"
    assert_close(actual, expected, dtype, what)
    assert_rows_untouched(actual, x, skipped_rows(num_tokens), what)
    if b is not None:
        assert torch.equal(b, b_before), f"{what}: b was written"
    return actual, b, slot, args


@pytest.mark.parametrize("with_b", [False, True], ids=["x", "x+b"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("edit", list(KERNELS))
def test_edit_matches_reference(edit, dtype, shape, with_b):
    check_edit(edit, *shape, dtype, with_b)


def test_project_out_leaves_no_component_along_the_direction():
    # Independent of the reference: afterwards (x + b) . d is zero up to fp32 rounding.
    x, b, slot, (dirs,) = check_edit("project_out", 37, 896, torch.float32, True)
    kept = slot[:37] >= 0
    dots = ((x + b)[kept] * dirs[slot[:37][kept].long()]).sum(dim=1)
    assert dots.abs().max() < 1e-4, dots


@pytest.mark.parametrize("with_b", [False, True], ids=["x", "x+b"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["in registers", "two passes"])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_project_out_both_kernel_paths(num_tokens, one_pass, with_b, monkeypatch):
    # Whatever project_out_config picks for a size: the whole row in registers, or two passes
    # over blocks narrower than the row (123 columns: four blocks of 32, the last partial).
    asked = []

    def config(num_tokens, width):
        asked.append(width)
        return (triton.next_power_of_2(width), True, 4) if one_pass else (32, False, 4)

    monkeypatch.setattr(edit, "project_out_config", config)
    check_edit("project_out", num_tokens, 123, torch.float32, with_b)
    assert asked == [123], "project_out_ did not take its configuration from project_out_config"


def test_set_cols_sets_the_residual_stream_through_x():
    # Independent of the reference: x + b holds exactly the values asked for, in fp32.
    x, b, slot, (cols, vals) = check_edit("set_cols", 7, 123, torch.float32, True)
    for row in (slot[:7] >= 0).nonzero().squeeze(1).tolist():
        s = slot[row].item()
        used = cols[s] >= 0
        got = (x + b)[row, cols[s][used].long()]
        torch.testing.assert_close(got, vals[s][used], rtol=0, atol=1e-6)


@pytest.mark.parametrize("edit", list(KERNELS))
def test_edit_skips_slots_past_the_tables(edit):
    # A host bug must not read outside the per-slot tables: such rows are left alone.
    seed("past", edit)
    kernel, _ = KERNELS[edit]
    x = randn(4, 123, torch.float32)
    actual = x.clone()
    kernel(actual, None, torch.tensor([SLOTS, 0, SLOTS + 100, -1], dtype=torch.int32,
                                      device=DEVICE), *params(edit, 123))
    assert_rows_untouched(actual, x, torch.tensor([True, False, True, True], device=DEVICE), edit)
    assert not torch.equal(actual[1], x[1]), f"{edit}: the row with a valid slot was not edited"


def test_edit_rejects_a_bad_slot_table():
    x = randn(5, 123, torch.float32)
    with pytest.raises(ValueError, match="slot must be int32"):
        add_(x, None, torch.zeros(5, device=DEVICE), *params("add", 123))
    with pytest.raises(ValueError, match=r"vec must have shape \(3, 123\)"):
        add_(x, None, slot_table(5), randn(SLOTS, 124, torch.float32),
             torch.ones(SLOTS, device=DEVICE))
    with pytest.raises(ValueError, match="dirs must have unit stride"):
        project_out_(x, None, slot_table(5), randn(123, SLOTS, torch.float32).t())
    with pytest.raises(ValueError, match="b must have x's shape"):
        scale_(x, randn(5, 122, torch.float32), slot_table(5), *params("scale", 123))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 16384])
@pytest.mark.parametrize("width", GPU_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("edit", list(KERNELS))
def test_edit_full_size(edit, dtype, width, num_tokens):
    check_edit(edit, num_tokens, width, dtype, with_b=True)


# ----------------------------------------------------------------------------- patch_


def patch_by_hand(x, b, slot, pos, rows, at):
    """patch_ row by row in Python: a row whose position its slot lists takes that row's value."""
    out = x.clone()
    for i in range(x.shape[0]):
        s = int(slot[i])
        if not 0 <= s < at.shape[0]:
            continue
        hits = [j for j in range(at.shape[1]) if int(at[s, j]) == int(pos[i])]
        if hits:
            v = rows[s, hits[0]].float()
            out[i] = (v if b is None else v - b[i].float()).to(x.dtype)
    return out


@pytest.mark.parametrize("with_b", [False, True], ids=["x", "x+b"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_patch_puts_each_requests_rows_at_their_positions(dtype, shape, with_b):
    num_tokens, width = shape
    seed("patch", dtype, shape, with_b)
    k = 3
    x = randn(num_tokens, width, dtype)
    b = randn(num_tokens, width, dtype) if with_b else None
    slot = slot_table(num_tokens)
    pos = torch.randint(0, 5, (num_tokens + 4,), device=DEVICE)      # int64, as vLLM's positions
    at = torch.stack([torch.randperm(5, device=DEVICE)[:k] for _ in range(SLOTS)]).to(torch.int32)
    at[0, 1] = -1                                                    # an unused entry
    rows = randn(SLOTS * k, width, torch.float32).view(SLOTS, k, width)
    actual, expected = x.clone(), x.clone()
    patch_(actual, b, slot, pos, rows, at)
    patch_ref(expected, b, slot, pos, rows, at)
    by_hand = patch_by_hand(x, b, slot, pos, rows, at)
    what = f"patch {'with' if with_b else 'without'} b"
    assert_close(actual, by_hand, dtype, what)
    assert_close(expected, by_hand, dtype, what)
    matched = torch.tensor([int(s) >= 0 and bool((at[int(s)] == pos[i]).any())
                            for i, s in enumerate(slot[:num_tokens].tolist())], device=DEVICE)
    assert_rows_untouched(actual, x, ~matched, what)
    if num_tokens > 5:
        assert matched.any(), "no row was patched: the case tests nothing"


def test_patch_rejects_tables_of_the_wrong_shape():
    x = randn(5, 123, torch.float32)
    slot, pos = slot_table(5), torch.arange(5, device=DEVICE)
    at = torch.zeros(SLOTS, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"rows must have shape \(3, 2, 123\)"):
        patch_(x, None, slot, pos, torch.zeros(SLOTS, 2, 100, device=DEVICE), at)
    with pytest.raises(ValueError, match="pos must be 1-D int32 or int64"):
        patch_(x, None, slot, pos[:3], torch.zeros(SLOTS, 2, 123, device=DEVICE), at)
