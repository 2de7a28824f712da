"""The attention-pattern kernel (tapc/kernels/pattern.py) against softmax(q k^T) over each
request's contiguous keys, written out before the keys were paged."""
import pytest
import torch
from kernel_cases import DEVICE, paged_keys, seed

from tapc.kernels.capture import PHASES
from tapc.kernels.pattern import pattern, pattern_ref

POISON = -7.0


def case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, asked_every=2):
    """A step of requests each with `query_lens[s]` new rows at the end of `seq_lens[s]` keys."""
    keys = [torch.randn(n, kv_heads, head_dim, device=DEVICE).to(dtype) for n in seq_lens]
    kv_cache, table = paged_keys(keys, block_size, extra_blocks=3)
    cache = kv_cache.transpose(1, 2)[..., :head_dim]   # the keys, as vLLM's FlashAttention views them
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    n = int(qsl[-1])
    q = torch.randn(n + 2, heads, head_dim, device=DEVICE).to(dtype)   # 2 padded rows past the batch
    asked = torch.zeros(n + 2, dtype=torch.bool, device=DEVICE)
    asked[:n:asked_every] = True
    asked[n - 1] = True
    return keys, cache, table, qsl, q, asked


def expected(keys, qsl, seq_lens, q, asked, pick, width, scale, group):
    """[rows, heads asked, width]: each asked row's weights over its request's keys 0..p, zeros after."""
    out = {}
    for s in range(len(seq_lens)):
        for t in range(int(qsl[s]), int(qsl[s + 1])):
            if not asked[t]:
                continue
            p = seq_lens[s] - (int(qsl[s + 1]) - t)
            row = torch.zeros(len(pick), width, device=DEVICE)
            for i, h in enumerate(pick):
                k = keys[s][: p + 1, h // group].float()
                row[i, : p + 1] = torch.softmax(k @ q[t, h].float() * scale, dim=0)
            out[t] = row
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,pick", [(4, 4, [0, 1, 2, 3]), (8, 2, [7, 0, 5]), (6, 1, [2])])
def test_pattern_equals_softmax_over_the_requests_keys(dtype, heads, kv_heads, pick):
    seed(dtype, heads, kv_heads)
    head_dim, block_size, width = 40, 16, 96
    # a prompt chunk after a cached prefix, a whole prompt, two decode rows (one far past a block)
    seq_lens, query_lens = [50, 9, 71, 17], [20, 9, 1, 1]
    keys, cache, table, qsl, q, asked = case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype)
    n_rows = int(asked.sum())
    dst = torch.full((q.shape[0],), -1, dtype=torch.int32, device=DEVICE)
    dst[asked] = torch.randperm(n_rows + 4, device=DEVICE)[:n_rows].to(torch.int32)
    heads_t = torch.tensor(pick, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    seq_t = torch.tensor(seq_lens + [0, 0], dtype=torch.int32, device=DEVICE)
    want = expected(keys, qsl, seq_lens, q, asked, pick, width, scale, heads // kv_heads)
    for fn in (pattern, pattern_ref):
        out = torch.full((n_rows + 4, len(pick) * width + 5), POISON, device=DEVICE)
        fn(q, cache, dst, out, heads_t, qsl, seq_t, table, scale, width)
        for t, row in want.items():
            got = out[int(dst[t]), : len(pick) * width].view(len(pick), width)
            torch.testing.assert_close(got, row, rtol=1e-5, atol=1e-6)
        # rows no request asks for, and the columns past the heads', are untouched
        untouched = torch.ones(out.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[dst[asked].long()] = False
        assert (out[untouched] == POISON).all() and (out[:, len(pick) * width:] == POISON).all()


def test_pattern_rows_of_a_ring_go_to_their_phase():
    """With rings (decode steps copied out every PHASES steps), a row's pool row is its block's
    plus its phase times the stride, as for every capture."""
    seed("ring")
    heads, head_dim, block_size, width = 2, 16, 16, 40
    seq_lens, query_lens = [30, 21], [1, 1]
    keys, cache, table, qsl, q, asked = case(seq_lens, query_lens, heads, heads, head_dim, block_size,
                                             torch.float32, asked_every=1)
    stride = 2
    dst = torch.tensor([0, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    ring = torch.tensor([26, -1, -1, -1], dtype=torch.int32, device=DEVICE)   # row 0 is ring-kept from position 26
    pos = torch.tensor([29, 20, 0, 0], dtype=torch.int32, device=DEVICE)
    heads_t = torch.arange(heads, dtype=torch.int32, device=DEVICE)
    seq_t = torch.tensor(seq_lens + [0, 0], dtype=torch.int32, device=DEVICE)
    want = expected(keys, qsl, seq_lens, q, asked, [0, 1], width, 1.0, 1)
    for fn in (pattern, pattern_ref):
        out = torch.full((PHASES * stride + 2, heads * width), POISON, device=DEVICE)
        fn(q, cache, dst, out, heads_t, qsl, seq_t, table, 1.0, width, ring, pos, stride)
        torch.testing.assert_close(out[0 + 3 * stride].view(heads, width), want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[1].view(heads, width), want[1], rtol=1e-5, atol=1e-6)


def test_pattern_refuses_a_cache_of_another_head_dim():
    q = torch.zeros(2, 4, 8, device=DEVICE)
    cache = torch.zeros(3, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="key_cache must be"):
        pattern(q, cache, torch.full((2,), -1, dtype=torch.int32, device=DEVICE), torch.zeros(2, 32, device=DEVICE),
                torch.arange(4, dtype=torch.int32, device=DEVICE), torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
                torch.tensor([2], dtype=torch.int32, device=DEVICE), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                1.0, 8)
