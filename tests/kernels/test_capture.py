"""Capture kernels against their torch references (tapc/kernels/capture.py)."""
import pytest
import torch
from kernel_cases import (
    DEVICE, DTYPES, EXTRA, GPU_WIDTHS, ON_GPU, assert_close, assert_rows_untouched, dst_table,
    poisoned, randn, seed, skipped_rows,
)

from tapc.kernels.capture import (
    PHASES, capture, capture_pair, capture_pair_ref, capture_ref, capture_sum,
    capture_sum_ref, capture_trio, capture_trio_ref,
)

# Odd widths, one past a column block (2560 = 2048 + 512), one and many rows.
SHAPES = [(1, 5), (7, 123), (37, 896), (5, 2560)]


def run_capture(x, dst, out_dtype, out_rows):
    out = poisoned(out_rows, x.shape[1], out_dtype)
    expected = out.clone()
    capture(x, dst, out)
    capture_ref(x, dst, expected)
    return out, expected


def check_untouched(out, dst, num_tokens, what):
    """Buffer rows no kept row points at still hold the poison (skipped rows, table extras)."""
    written = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    kept = dst[:num_tokens][~skipped_rows(num_tokens)].long()
    written[kept] = True
    assert_rows_untouched(out, torch.full_like(out, float("nan")), ~written, what)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_copies_kept_rows_exactly(shape, dtype):
    seed("capture", shape, dtype)
    num_tokens, width = shape
    x = randn(num_tokens, width, dtype)
    dst = dst_table(num_tokens, num_tokens + 2 * EXTRA)
    out, expected = run_capture(x, dst, dtype, num_tokens + 2 * EXTRA)
    assert torch.equal(out.isnan(), expected.isnan()), "written rows differ from the reference"
    assert_close(out, expected, torch.float32, "capture, same dtype, must be exact")
    check_untouched(out, dst, num_tokens, "capture")


@pytest.mark.parametrize(
    "src,dst_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=str,
)
def test_capture_converts_on_store(src, dst_dtype):
    seed("convert", src, dst_dtype)
    x = randn(37, 123, src)
    dst = dst_table(37, 45)
    out, expected = run_capture(x, dst, dst_dtype, 45)
    assert_close(out, expected, dst_dtype, f"capture {src} -> {dst_dtype}")
    check_untouched(out, dst, 37, "capture with conversion")


@pytest.mark.parametrize("src,dst_dtype", [(torch.int32, torch.int32), (torch.int64, torch.int32),
                                           (torch.int32, torch.float32)], ids=str)
def test_capture_stores_integer_ids_exactly(src, dst_dtype):
    """An MoE router's expert ids go straight to the capture kernel (no cast kernel before it)
    and land exactly in their int32 pool, or a float32 one (ids below 2**24)."""
    seed("ids", src, dst_dtype)
    x = torch.randint(0, 1 << 24, (37, 8), dtype=src, device=DEVICE)
    dst = dst_table(37, 45)
    out = torch.full((45, 8), -7, dtype=dst_dtype, device=DEVICE)
    expected = out.clone()
    capture(x, dst, out)
    capture_ref(x, dst, expected)
    assert torch.equal(out, expected), "the kernel and the reference"
    kept = ~skipped_rows(37)
    assert torch.equal(out[dst[:37][kept].long()].long(), x[kept].long()), "each kept row's ids, exactly"
    untouched = torch.ones(45, dtype=torch.bool, device=DEVICE)
    untouched[dst[:37][kept].long()] = False
    assert (out[untouched] == -7).all(), "rows no kept row points at are not written"
    with pytest.raises(ValueError, match="must be floating point"):
        capture_sum(x, x, dst, out)


@pytest.mark.parametrize("widths", [(8, 8), (5, 2560), (1100, 3)], ids=str)
def test_capture_pair_is_two_captures_in_one_launch(widths):
    """An MoE router's weights (float32) and expert ids (int32), each by its own row table into
    its own pool, as two `capture` calls would; widths of more than one column block too."""
    seed("pair", widths)
    w0, w1 = widths
    x0 = randn(37, w0, torch.float32)
    x1 = torch.randint(0, 128, (37, w1), dtype=torch.int32, device=DEVICE)
    dst0, dst1 = dst_table(37, 45), dst_table(37, 40).flip(0)
    out0, out1 = poisoned(45, w0, torch.float32), torch.full((40, w1), -7, dtype=torch.int32, device=DEVICE)
    ref0, ref1 = out0.clone(), out1.clone()
    capture_pair(x0, x1, dst0, dst1, out0, out1)
    capture_pair_ref(x0, x1, dst0, dst1, ref0, ref1)
    assert torch.equal(out0.isnan(), ref0.isnan()) and torch.equal(out0.nan_to_num(), ref0.nan_to_num())
    assert torch.equal(out1, ref1)
    kept = dst1[:37] >= 0
    assert torch.equal(out1[dst1[:37][kept].long()], x1[kept]), "the ids, exactly, where their own table says"
    with pytest.raises(ValueError, match="x1 must have x0's 37 rows, got 36"):
        capture_pair(x0, x1[:36], dst0, dst1, out0, out1)
    with pytest.raises(ValueError, match="out0 and out1 are one buffer"):
        capture_pair(x0, x0, dst0, dst1, out0, out0[5:])


@pytest.mark.parametrize("widths", [(128, 8, 8), (5, 2560, 3), (1100, 3, 700)], ids=str)
def test_capture_trio_is_three_captures_in_one_launch(widths):
    """An MoE router's logits (bf16), weights (float32) and expert ids (int32), each by its own
    row table into its own pool, as three `capture` calls would, in one launch; column blocks of
    each capture land in their own pool whatever the widths."""
    seed("trio", widths)
    w0, w1, w2 = widths
    x0, x1 = randn(37, w0, torch.bfloat16), randn(37, w1, torch.float32)
    x2 = torch.randint(0, 128, (37, w2), dtype=torch.int32, device=DEVICE)
    dsts = dst_table(37, 41), dst_table(37, 45).flip(0), dst_table(37, 40)
    outs = (poisoned(41, w0, torch.bfloat16), poisoned(45, w1, torch.float32),
            torch.full((40, w2), -7, dtype=torch.int32, device=DEVICE))
    refs = tuple(o.clone() for o in outs)
    capture_trio(x0, x1, x2, *dsts, *outs)
    capture_trio_ref(x0, x1, x2, *dsts, *refs)
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num()), f"capture {k}"
    kept = dsts[2][:37] >= 0
    assert torch.equal(outs[2][dsts[2][:37][kept].long()], x2[kept]), "the ids, exactly, where their own table says"
    with pytest.raises(ValueError, match="x2 must have x0's 37 rows, got 36"):
        capture_trio(x0, x1, x2[:36], *dsts, *outs)
    with pytest.raises(ValueError, match="out0 and out2 are one buffer"):
        capture_trio(x0, x1, x0, *dsts, outs[0], outs[1], outs[0][3:])


@pytest.mark.parametrize("columns", [slice(3, 3 + 123), slice(1, None, 2)], ids=["slice", "step2"])
def test_capture_reads_strided_views(columns):
    seed("strided", columns)
    full = randn(7, 250, torch.bfloat16)
    x = full[:, columns]
    dst = dst_table(7, 12)
    out, expected = run_capture(x, dst, torch.bfloat16, 12)
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])
    assert torch.equal(out[~out.isnan()].sort().values, x[dst[:7] >= 0].flatten().sort().values)
    check_untouched(out, dst, 7, "capture of a column view")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_sum_adds_in_fp32(shape, dtype):
    seed("capture_sum", shape, dtype)
    num_tokens, width = shape
    a, b = randn(num_tokens, width, dtype), randn(num_tokens, width, dtype)
    dst = dst_table(num_tokens, num_tokens + 2 * EXTRA)
    out = poisoned(num_tokens + 2 * EXTRA, width, dtype)
    expected = out.clone()
    capture_sum(a, b, dst, out)
    capture_sum_ref(a, b, dst, expected)
    assert_close(out, expected, dtype, "capture_sum")
    check_untouched(out, dst, num_tokens, "capture_sum")


def test_capture_sum_stores_fp32_sum_of_bf16():
    seed("sum_fp32")
    a, b = randn(5, 123, torch.bfloat16), randn(5, 123, torch.bfloat16)
    dst = torch.arange(5 + EXTRA, dtype=torch.int32, device=DEVICE)
    out = poisoned(5 + EXTRA, 123, torch.float32)
    capture_sum(a, b, dst, out)
    # The sum of two bf16 values is exact in fp32: no rounding to bf16 in between.
    assert torch.equal(out[:5], a.float() + b.float())


def test_capture_of_padding_only_writes_nothing():
    x = randn(5, 123, torch.float32)
    out = poisoned(8, 123, torch.float32)
    capture(x, torch.full((8,), -1, dtype=torch.int32, device=DEVICE), out)
    assert out.isnan().all()


def test_capture_skips_destinations_past_the_buffer():
    # A host bug must not write outside the buffer: such entries act like -1.
    x = randn(6, 123, torch.float32)
    out = poisoned(8, 123, torch.float32)
    capture(x, torch.tensor([8, 2, 1000, -1, 7, 0], dtype=torch.int32, device=DEVICE), out)
    assert torch.equal(out[[2, 7, 0]], x[[1, 4, 5]])
    assert out[[1, 3, 4, 5, 6]].isnan().all()


@pytest.mark.parametrize(
    "dst,out_shape,words",
    [
        (torch.zeros(5, dtype=torch.int64), (8, 123), "dst must be int32"),
        (torch.zeros(4, dtype=torch.int32), (8, 123), "dst has 4 entries for 5 rows"),
        (torch.zeros(5, dtype=torch.int32), (8, 122), "out must be [rows, 123]"),
    ],
    ids=["dtype", "short", "width"],
)
def test_capture_rejects_bad_arguments(dst, out_shape, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        capture(randn(5, 123, torch.float32), dst.to(DEVICE), poisoned(*out_shape, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 16384])
@pytest.mark.parametrize("width", GPU_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_full_size(num_tokens, width, dtype):
    seed("capture_full", num_tokens, width, dtype)
    a, b = randn(num_tokens, width, dtype), randn(num_tokens, width, dtype)
    dst = dst_table(num_tokens, num_tokens + 2 * EXTRA)
    out, expected = run_capture(a, dst, dtype, num_tokens + 2 * EXTRA)
    assert torch.equal(out.isnan(), expected.isnan())
    assert_close(out, expected, torch.float32, "capture, same dtype, must be exact")
    check_untouched(out, dst, num_tokens, "capture")
    out = poisoned(num_tokens + 2 * EXTRA, width, torch.float32)
    expected = out.clone()
    capture_sum(a, b, dst, out)
    capture_sum_ref(a, b, dst, expected)
    assert_close(out, expected, torch.float32, "capture_sum into fp32")
    check_untouched(out, dst, num_tokens, "capture_sum")


def ring_case(rows: int, width: int, stride: int):
    """Rows in a ring (start >= 0) and not (-1), each a block of a ring's pool rows (its phase
    0 at dst; some -1), the model's positions up to two rings past the start."""
    x = randn(rows, width, torch.bfloat16)
    dst = torch.arange(rows, dtype=torch.int32, device=DEVICE) * (PHASES * stride + 1)
    dst[::5] = -1
    ring = torch.randint(0, 50, (rows,), dtype=torch.int32, device=DEVICE)
    ring[1::3] = -1
    pos = ring.long().clamp(min=0) + torch.randint(0, 2 * PHASES, (rows,), device=DEVICE)
    return x, dst, ring, pos


@pytest.mark.parametrize("kind", ["capture", "capture_sum", "capture_pair", "capture_trio"])
def test_a_ring_writes_each_row_its_phase_on(kind):
    """A row in a ring lands `stride` pool rows further for each step past its ring's start (mod
    PHASES); a row in none, and a skipped row, as without a ring. Checked row by row against
    the rule itself, and the rest of the pool untouched."""
    seed("ring", kind)
    rows, width, stride = 23, 40, 3
    x, dst, ring, pos = ring_case(rows, width, stride + 1)
    y = randn(rows, width, torch.bfloat16)
    out_rows = rows * (PHASES * (stride + 1) + 1)
    out, other = poisoned(out_rows, width, torch.bfloat16), poisoned(out_rows, width, torch.bfloat16)
    if kind == "capture":
        capture(x, dst, out, ring, pos, stride)
    elif kind == "capture_sum":
        capture_sum(x, y, dst, out, ring, pos, stride)
    elif kind == "capture_pair":
        capture_pair(x, y, dst, dst, out, other, ring, pos, stride, stride + 1)
    else:
        third = poisoned(out_rows, 3, torch.float32)
        z = randn(rows, 3, torch.float32)
        capture_trio(x, y, z, dst, dst, dst, out, other, third, ring, pos, stride, stride + 1, stride)
    written = torch.zeros(out_rows, dtype=torch.bool)
    for i in range(rows):
        if dst[i] < 0:
            continue
        to = int(dst[i]) + (int(pos[i] - ring[i]) % PHASES * stride if ring[i] >= 0 else 0)
        what = f"row {i} (start {int(ring[i])}, position {int(pos[i])}) at pool row {to}"
        if kind == "capture_sum":   # added in fp32: rounded once to bf16, as the reference's tolerance allows
            assert_close(out[to], (x[i].float() + y[i].float()).to(torch.bfloat16), torch.bfloat16, what)
        else:
            assert torch.equal(out[to], x[i]), what
        if kind == "capture_trio":
            assert torch.equal(third[to], z[i]), f"trio's third capture, row {i}"
        if kind in ("capture_pair", "capture_trio"):
            to1 = int(dst[i]) + (int(pos[i] - ring[i]) % PHASES * (stride + 1) if ring[i] >= 0 else 0)
            assert torch.equal(other[to1], y[i]), f"pair's second capture, row {i}"
        written[to] = True
    assert written.sum() == int((dst[:rows] >= 0).sum()), "two rows landed on one pool row"
    assert out[~written.to(out.device)].isnan().all(), "a pool row no row goes to was written"


def test_a_ring_needs_both_tables():
    x, dst, ring, pos = ring_case(4, 8, 2)
    out = poisoned(64, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="a ring needs both"):
        capture(x, dst, out, ring, None, 2)
    with pytest.raises(ValueError, match="pos must be 1-D int32 or int64 with an entry per row"):
        capture(x, dst, out, ring, pos[:2], 2)
