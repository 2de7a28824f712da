"""Mixture-of-experts models on a GPU, against HF transformers on the same weights (bf16).

Needs the GPU bundle with vLLM's MoE kernels (`TAPC_GPU_MOE=1 bash ../shared/gpu/make-bundle
.gpu`). Small random checkpoints with realistic init (std 0.02) written with HF transformers:
Qwen3-MoE (Qwen3-30B-A3B's routing: softmax top-2 of 8, renormalized; the gate runs inside
vLLM's fused-MoE op) and Mixtral (top-2 of 8; the gate runs in the compiled graph). vLLM runs
them on its V1 model runner with its defaults otherwise: compile, FULL_AND_PIECEWISE graphs,
chunked prefill, async scheduling; max_num_seqs=3 and a 128-token budget force continuous
batching.

Captured: the residual stream, the router logits (the gate's output), the router's choice
(top-k weights and expert ids) and the MoE block's output at every layer. Values are compared
with bf16 tolerance. Expert ids must be exactly HF's wherever HF's router is not near a tie
between its k-th and (k+1)-th expert; bf16 noise can swap those, and a swap changes that
token's MoE output and everything after it, so a token whose routing swapped at a near tie
leaves the comparison from that layer on (`assert_matches_hf`; most tokens must stay). Edits:
a steering vector on the residual stream and a per-request router edit that bans an expert;
the greedy tokens equal HF's under the same edit wherever HF's top token is not near a tie.
"""
import numpy as np
import pytest
import torch
from gpu_engines import MOE, engine_args, shutdown
from moe_checks import ALPHA, LAYERS, STEER_LAYER, assert_matches_hf, hf_reference, prompts, sampling, untied

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCHS = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}   # vLLM's name of the MoE block
EXPERTS, HIDDEN, BANNED = 8, MOE["hidden_size"], 3
# Greedy ties: HF's top two vocabulary logits closer than this (spread ~0.3 over 1024 tokens,
# HF's bf16 logits step by 0.0078 near 1: bf16 against fp32 swapped tops only at gaps of 0 or 1 step).
TOKEN_TIE = 0.02


def taps(moe: str) -> list[str]:
    # Edits first: taps at one module run in plan order, so the captures see the edited values.
    return [f"model.layers.{STEER_LAYER}.resid | add(steer, alpha={ALPHA})",
            f"model.layers.*.{moe}.gate.output | add(ban, alpha=1.0)",
            "model.layers.*.resid", f"model.layers.*.{moe}.gate.output",
            f"model.layers.*.{moe}.experts.router.output", f"model.layers.*.{moe}.output"]


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_engine(request, checkpoints):
    from tapc import VLLM

    arch = request.param
    path = checkpoints(arch)
    llm = VLLM(path, taps=taps(ARCHS[arch]), **engine_args())
    yield arch, path, llm
    shutdown(llm)


def ban_vector(expert: int) -> np.ndarray:
    v = np.zeros(EXPERTS, dtype=np.float32)
    v[expert] = -1e4
    return v


def test_moe_engine_runs_on_v1(moe_engine):
    arch, _, llm = moe_engine
    assert not llm.llm.llm_engine.vllm_config.use_v2_model_runner, f"{arch}: vLLM runs MoE models on V1"


def test_moe_captures_equal_hf_under_continuous_batching(moe_engine):
    from tapc import TapRequest

    arch, path, llm = moe_engine
    moe = ARCHS[arch]
    outs = llm.generate(prompts(1), sampling(), taps=TapRequest(capture="*"))
    for n, out in enumerate(outs):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = hf_reference(path, moe, tokens[:-1])
        assert set(out.taps) == set(ref), f"{arch} request {n}: keys {sorted(set(out.taps) ^ set(ref))}"
        for key, value in out.taps.items():
            assert value.shape[0] == len(tokens) - 1, f"{arch} request {n} {key}: {value.shape[0]} rows"
        assert_matches_hf(out.taps, ref, moe, f"{arch} request {n}")


def assert_greedy_matches_hf(tokens: list[int], prompt_len: int, hf_logits: torch.Tensor, clean: torch.Tensor,
                             what: str) -> None:
    """vLLM's generated tokens are HF's argmax on the same prefix (teacher forcing), wherever
    HF's top two logits are not near a tie and the predicting token kept HF's routing (`clean`);
    at least 40% of the steps are checked."""
    pred = hf_logits[prompt_len - 1: len(tokens) - 1]
    gen = torch.tensor(tokens[prompt_len:])
    rows = untied(pred, 1, TOKEN_TIE) & clean[prompt_len - 1: len(tokens) - 1]
    assert rows.float().mean() >= 0.4, f"{what}: only {rows.float().mean():.2f} of steps checked"
    bad = ((pred.argmax(-1) != gen) & rows).nonzero().flatten().tolist()
    assert not bad, f"{what}: generated tokens differ from HF's greedy choice at steps {bad}"


def test_steering_and_an_expert_ban_equal_hf_greedy(moe_engine):
    """One batch: a steered request, a request banning expert BANNED at every layer through its
    router logits, and the same prompts unedited. The banned expert is never chosen for its
    request (the unedited one does choose it); the edited tokens differ from the unedited ones
    and equal HF's greedy tokens under the same edit, and so do all their captures."""
    from tapc import TapRequest

    arch, path, llm = moe_engine
    moe = ARCHS[arch]
    steer = np.random.default_rng(5).standard_normal(HIDDEN).astype(np.float32)
    ps = prompts(2, [24, 31])
    outs = llm.generate(ps + ps, sampling([12, 12, 12, 12]),
                        taps=[TapRequest(capture="*", params={"steer": steer}),
                              TapRequest(capture="*", params={"ban": ban_vector(BANNED)}),
                              TapRequest(capture="*"), TapRequest(capture="*")])
    steered, banned, plain_s, plain_b = outs
    ids = lambda out: torch.cat([out.taps[f"model.layers.{i}.{moe}.experts.router.output[1]"] for i in range(LAYERS)])
    assert not (ids(banned) == BANNED).any(), f"{arch}: the banned expert was chosen"
    assert (ids(plain_b) == BANNED).any(), f"{arch}: the unedited request never uses expert {BANNED}"
    for edited, plain, edit in ((steered, plain_s, {"steer": steer}), (banned, plain_b, {"ban": ban_vector(BANNED)})):
        name = f"{arch} {next(iter(edit))}"
        tokens = list(edited.prompt_token_ids) + list(edited.outputs[0].token_ids)
        assert list(edited.outputs[0].token_ids) != list(plain.outputs[0].token_ids), f"{name}: the edit changed nothing"
        ref, hf_logits = hf_reference(path, moe, tokens[:-1], **edit)
        clean = assert_matches_hf(edited.taps, ref, moe, name)
        assert_greedy_matches_hf(tokens, len(edited.prompt_token_ids), hf_logits, clean, name)
