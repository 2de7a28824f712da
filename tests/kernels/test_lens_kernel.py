"""The logit lens kernel (tapc/kernels/lens.py) against HF's RMSNorm and a plain matmul's top k."""
import pytest
import torch
from kernel_cases import DEVICE, ON_GPU, seed
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tapc.kernels.capture import PHASES
from tapc.kernels.lens import candidates, lens, lens_ref

EPS = 1e-5
POISON = -7


def hf_lens(s: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, vocab: int, k: int):
    """The lens as one writes it on HF: its RMSNorm module, then the unembedding, in fp32."""
    norm = LlamaRMSNorm(s.shape[1], eps=EPS).to(device=s.device, dtype=norm_weight.dtype)
    norm.weight.data.copy_(norm_weight)
    h = norm(s)
    return (h.float() @ weight[:vocab].float().T).topk(k, dim=-1)


def tables(n: int, asked_ids: torch.Tensor, asked_logits: torch.Tensor, rows: int):
    """Row tables: asked rows get distinct pool rows in shuffled order, others -1."""
    perm = torch.randperm(rows, device=DEVICE).to(torch.int32)
    ids = torch.full((n + 3,), -1, dtype=torch.int32, device=DEVICE)
    logits = ids.clone()
    ids[:n][asked_ids] = perm[: int(asked_ids.sum())]
    logits[:n][asked_logits] = torch.randperm(rows, device=DEVICE).to(torch.int32)[: int(asked_logits.sum())]
    return ids, logits


def run(n, hidden, vocab, padded, k, block_v, dtype, resid, asked_ids, asked_logits, ring=None, pos=None,
        strides=(0, 0)):
    x = torch.randn(n, hidden, device=DEVICE).to(dtype)
    b = torch.randn(n, hidden, device=DEVICE).to(dtype) if resid else None
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    weight = (0.05 * torch.randn(padded, hidden, device=DEVICE)).to(dtype)
    pool_rows = n * PHASES + 4
    dst_ids, dst_logits = tables(n, asked_ids, asked_logits, pool_rows)
    ids = torch.full((pool_rows, k), POISON, dtype=torch.int32, device=DEVICE)
    logits = torch.full((pool_rows, k), float(POISON), device=DEVICE)
    cand = (n + 3, candidates(vocab, k, block_v))
    cand_ids = torch.zeros(cand, dtype=torch.int32, device=DEVICE)
    cand_vals = torch.zeros(cand, device=DEVICE)
    ref_ids, ref_logits = ids.clone(), logits.clone()
    args = (norm_weight, weight, cand_ids, cand_vals, EPS, vocab, block_v, ring, pos, *strides)
    lens(x, b, dst_ids, dst_logits, ids, logits, *args)
    lens_ref(x, b, dst_ids, dst_logits, ref_ids, ref_logits, *args)
    return dict(x=x, b=b, norm_weight=norm_weight, weight=weight, dst_ids=dst_ids, dst_logits=dst_logits,
                ids=ids, logits=logits, ref_ids=ref_ids, ref_logits=ref_logits)


def mask(n, every, offset=0):
    return (torch.arange(n, device=DEVICE) + offset) % every == 0


CASES = [
    # n, hidden, vocab, padded rows of the weight, k, block_v, resid
    (9, 96, 300, 320, 5, 128, True),     # a block past the vocabulary, hidden not a multiple of 64
    (40, 64, 256, 256, 3, 64, False),
    (100, 32, 200, 256, 4, 128, True),   # more than 64 rows asked: a group's second pass
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_lens_equals_hf_norm_and_unembedding_on_asked_rows(case):
    n, hidden, vocab, padded, k, block_v, resid = case
    seed("lens", case)
    asked = mask(n, 1) if n == 100 else mask(n, 2)
    got = run(n, hidden, vocab, padded, k, block_v, torch.float32, resid, asked, asked)
    s = got["x"] if got["b"] is None else got["x"] + got["b"]
    top = hf_lens(s, got["norm_weight"], got["weight"], vocab, k)
    rows = asked.nonzero().squeeze(1)
    at_ids, at_logits = got["dst_ids"][rows].long(), got["dst_logits"][rows].long()
    assert torch.equal(got["ids"][at_ids], top.indices[rows].to(torch.int32))
    torch.testing.assert_close(got["logits"][at_logits], top.values[rows], rtol=1e-5, atol=1e-5)
    # every pool row no asked row points at is untouched
    for pool, at in ((got["ids"], at_ids), (got["logits"], at_logits)):
        untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[at] = False
        assert (pool[untouched] == POISON).all()


def test_rows_asked_for_one_of_the_two_write_only_that_one():
    seed("lens one")
    n = 12
    asked_ids, asked_logits = mask(n, 3), mask(n, 3, 1)
    got = run(n, 64, 130, 130, 2, 64, torch.float32, False, asked_ids, asked_logits)
    assert torch.equal(got["ids"], got["ref_ids"])
    torch.testing.assert_close(got["logits"], got["ref_logits"], rtol=1e-5, atol=1e-5)
    assert (got["ids"] != POISON).any(dim=1).sum() == asked_ids.sum()
    assert (got["logits"] != POISON).any(dim=1).sum() == asked_logits.sum()


def test_ring_rows_go_a_phase_past_their_block():
    seed("lens ring")
    n = 6
    ring = torch.tensor([0, -1, 2, 5, 0, 3, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([3, 4, 9, 5, 1, 12, 0, 0, 0], dtype=torch.int32, device=DEVICE)
    asked = mask(n, 1)
    got = run(n, 64, 100, 100, 3, 64, torch.float32, True, asked, asked, ring, pos, (1, 1))
    assert torch.equal(got["ids"], got["ref_ids"])
    torch.testing.assert_close(got["logits"], got["ref_logits"], rtol=1e-5, atol=1e-5)


def test_bfloat16_model_equals_the_reference_within_rounding():
    seed("lens bf16")
    n = 16
    asked = mask(n, 2)
    got = run(n, 128, 500, 512, 8, 128, torch.bfloat16, True, asked, asked)
    rows = got["dst_logits"][:n][asked].long()
    torch.testing.assert_close(got["logits"][rows], got["ref_logits"][rows], rtol=2e-2, atol=2e-2)
    # ids equal where the reference's neighbours are apart by more than the rounding
    gaps = (got["ref_logits"][rows][:, :-1] - got["ref_logits"][rows][:, 1:]).abs() > 5e-2
    same = got["ids"][got["dst_ids"][:n][asked].long()] == got["ref_ids"][got["dst_ids"][:n][asked].long()]
    assert same[:, :-1][gaps].all()


def test_no_row_asked_writes_nothing():
    seed("lens none")
    n = 8
    none = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    got = run(n, 64, 100, 100, 2, 64, torch.float32, False, none, none)
    assert (got["ids"] == POISON).all() and (got["logits"] == POISON).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_the_8b_shape_equals_hf_at_full_size():
    """Llama-3.1-8B's width and vocabulary, 64 rows asked among 2048 (the last position of each
    of 64 prompts), bf16 as the model runs."""
    seed("lens 8b")
    n, hidden, vocab, k = 2048, 4096, 128256, 10
    asked = mask(n, 32, 31)
    got = run(n, hidden, vocab, vocab, k, 512, torch.bfloat16, True, asked, asked)
    rows = asked.nonzero().squeeze(1)
    s = (got["x"].float() + got["b"].float()).to(torch.bfloat16)[rows]   # the model's residual stream
    top = hf_lens(s, got["norm_weight"], got["weight"], vocab, k)
    torch.testing.assert_close(got["logits"][got["dst_logits"][rows].long()], top.values, rtol=2e-2, atol=2e-2)
    assert (got["ids"][got["dst_ids"][rows].long()][:, 0] == top.indices[:, 0]).float().mean() > 0.95
