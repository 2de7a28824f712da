"""Compiled functions (`| call(name)`) on a real vLLM engine against HF transformers (GPU machine).

The session's random Llama checkpoint (tests/support/gpu_engines.py), vLLM's defaults otherwise:
torch.compile traces the functions with the model and FULL_AND_PIECEWISE graphs replay them
(the plan adds no splitting op). A linear probe at every layer is compared with the same probe
on HF's hidden states; a conditional clamp of the MLP's largest activations with HF's greedy
tokens under the same clamp, applied by a forward pre-hook; requests that do not apply them
with the untapped run.
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args, hf_forward, shutdown
from hf_checks import assert_captures_equal_hf, assert_same_or_tie, hf_reference

import tapc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, INTER, LAYERS = SMALL["hidden_size"], SMALL["intermediate_size"], SMALL["num_hidden_layers"]
K = 16   # probe outputs
TOP = 32  # activations the clamp reverses


@tapc.function(results={"p": K})
class Probe(torch.nn.Module):
    """A learned linear probe, fp32: sigmoid(x W + b)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(HIDDEN, K, generator=g) * 3.0)
        self.b = torch.nn.Parameter(torch.randn(K, generator=g) * 0.1)

    def forward(self, x, batch):
        return {"p": torch.sigmoid(x.float() @ self.w + self.b)}


def clamp_rule(x: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """Where a row's norm passes `thr`, its TOP largest activations are negated and tripled."""
    xf = x.float()
    kth = xf.topk(TOP, dim=-1).values[:, -1:]
    hit = (xf.norm(dim=-1, keepdim=True) > thr) & (xf >= kth)
    return torch.where(hit, -3.0 * xf, xf).to(x.dtype)


@tapc.function(params={"thr": "scalar"})
def clamp(x, batch):
    return clamp_rule(x, batch.params["thr"][:, None])


TAPS = ["model.layers.*.resid | call(probe)", "model.layers.*.resid",
        "model.layers.1.mlp.down_proj.input | call(clamp, at=prompt)"]


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def engine(path):
    llm = tapc.VLLM(path, taps=TAPS, functions={"probe": Probe(), "clamp": clamp}, **engine_args())
    yield llm
    shutdown(llm)


def prompts(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], int(m)).tolist()}
            for m in rng.integers(4, 60, n)]


def greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_plan_splits_no_graph(engine):
    assert engine.plan.splitting_ops == () and engine.plan.pieces_after == engine.plan.pieces_before


def test_a_compiled_probe_at_every_layer_equals_the_probe_on_hf_hidden_states(engine, path):
    probe = Probe()
    outs = engine.generate(prompts(5, 1), greedy(6), taps=tapc.TapRequest(capture="*"))
    for i, out in enumerate(outs):
        assert out.error is None, out.error
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, tokens[:-1])
        for layer in range(LAYERS):
            got = out.taps[f"model.layers.{layer}.resid:probe.p"]
            with torch.no_grad():
                want = probe(ref[f"model.layers.{layer}.resid"], None)["p"]
            assert got.shape == want.shape, (got.shape, want.shape)
            err = (got - want).abs().max().item()
            assert err < 0.05, f"request {i} layer {layer}: probe scores differ from HF's by {err:.4f}"
        assert_captures_equal_hf([out], path, [f"model.layers.{k}.resid" for k in range(LAYERS)], hf_reference)


def clamped(plen: int, thr: float):
    """HF hooks: the clamp on layer 1's down_proj input, on the prompt's rows (`at=prompt`)."""
    def hooks(model):
        def pre(mod, args):
            x = args[0][0]
            head = clamp_rule(x[:plen], torch.tensor(thr, device=x.device))
            return (torch.cat([head, x[plen:]])[None],)
        return [model.model.layers[1].mlp.down_proj.register_forward_pre_hook(pre)]
    return hooks


def hf_greedy(path: str, prompt: list[int], n: int, thr: float) -> list[int]:
    """HF's greedy tokens under the clamp."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_forward(path, tokens, clamped(len(prompt), thr)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def hf_clamped_tie(path: str, prompt, got, ref, thr: float, what: str) -> None:
    """`got` is HF's clamped greedy `ref`, or splits from it at a near tie of HF's clamped logits."""
    if got == ref:
        return
    k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
    logits = hf_forward(path, prompt + ref[:k], clamped(len(prompt), thr)).logits[0, -1].float()
    margin = abs((logits[ref[k]] - logits[got[k]]).item())
    assert margin <= 2e-2 * logits.abs().max().item(), \
        f"{what}: token {k} is {got[k]} against HF's {ref[k]}, logit margin {margin:.4f} (not a near tie)"


def gap_threshold(path: str, prompt: list[int]) -> float:
    """The middle of the widest gap between the prompt rows' norms at the clamp (HF)."""
    seen = []

    def hooks(model):
        return [model.model.layers[1].mlp.down_proj.register_forward_pre_hook(
            lambda m, a: seen.append(a[0][0].float().norm(dim=-1)))]

    hf_forward(path, prompt, hooks)
    norms = seen[0].sort().values
    i = int((norms[1:] - norms[:-1]).argmax())
    return float(norms[i] + norms[i + 1]) / 2


def test_a_conditional_clamp_gives_hf_greedy_tokens_and_others_are_untouched(engine, path):
    """Per-request thresholds on the prompt's rows: low (every row clamped), in the widest gap
    of the rows' norms (some clamped, some not, none near the threshold, where bf16 noise
    would decide), above all (nothing clamped); and untapped requests in the same batches."""
    ps = prompts(6, 2)
    thrs = [0.0, gap_threshold(path, ps[1]["prompt_token_ids"]), 1e9, None, None,
            gap_threshold(path, ps[5]["prompt_token_ids"])]
    asks = [tapc.TapRequest(params={"thr": t}) if t is not None else None for t in thrs]
    n = 8
    outs = engine.generate(ps, greedy(n), taps=asks)
    plain = engine.generate(ps, greedy(n))   # nothing applied: the model as it is
    changed = 0
    for i, (out, ref_out, thr) in enumerate(zip(outs, plain, thrs)):
        assert out.error is None, out.error
        prompt, got = ps[i]["prompt_token_ids"], list(out.outputs[0].token_ids)
        base = list(ref_out.outputs[0].token_ids)
        if thr is None or thr >= 1e9:   # untouched: the untapped run's tokens
            assert_same_or_tie(path, prompt, got, base, f"request {i} (thr {thr})")
            continue
        hf = hf_greedy(path, prompt, n, thr)
        hf_clamped_tie(path, prompt, got, hf, thr, f"request {i} (thr {thr:.3f})")
        changed += got != base
    assert changed, "the clamp changed no request's tokens: the test would pass with no function at all"
