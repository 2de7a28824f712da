"""The logit lens on a real vLLM engine against HF transformers (GPU machine).

The session's random Llama checkpoint (tests/support/gpu_engines.py) with vLLM's defaults: compile,
FULL_AND_PIECEWISE graphs, chunked prefill (128 tokens a step for three requests), prefix
caching. Each layer's `:lens.ids` / `:lens.logits` is compared with HF's final norm and lm_head
applied by hand to HF's hidden states on the request's tokens; the last layer's lens is the
model's own next-token distribution, so at generated positions its best token is the greedy one.
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, greedy, hf_model, llama_engine, random_prompts
from hf_checks import hf_reference

import tapc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS, K = SMALL["num_hidden_layers"], 8
TAPS = ["model.layers.*.resid | lens(k=8)"]


path, engine = llama_engine(TAPS)


def hf_lens(path: str, resid: torch.Tensor) -> torch.Tensor:
    """HF's logits of each row of a layer's residual stream: the final norm, then lm_head."""
    model = hf_model(path)
    with torch.no_grad():
        return model.lm_head(model.model.norm(resid.to(torch.bfloat16).cuda())).float().cpu()


def check_rows(ids: torch.Tensor, logits: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """tapc's k best against HF's logits: the values within bf16 noise, and each id one of HF's
    k best but for a near tie (HF's logit at it within the noise of HF's k-th)."""
    assert ids.shape == logits.shape == (want.shape[0], K), what
    scale = want.abs().amax(dim=-1, keepdim=True)
    top = want.topk(K, dim=-1).values
    assert ((logits - top).abs() <= 0.03 * scale).all(), f"{what}: lens logits differ from HF's"
    at = want.gather(1, ids.long())
    assert (at >= top[:, -1:] - 0.03 * scale).all(), f"{what}: a lens id is not among HF's {K} best"
    assert (ids[:, 0] == want.argmax(-1)).float().mean() >= 0.9, f"{what}: top-1 agrees on under 90% of rows"


def test_the_lens_of_every_layer_equals_hf_at_prompt_and_generated_positions(engine, path):
    asks = [tapc.TapRequest(capture="*"), tapc.TapRequest(capture="*", positions="last"),
            tapc.TapRequest(capture="*", positions="generated"), None, tapc.TapRequest(capture="*")]
    outs = engine.generate(random_prompts(5, 1), greedy(6), taps=asks)
    for i, (out, ask) in enumerate(zip(outs, asks)):
        if ask is None:
            assert out.taps.keys() == set()
            continue
        assert out.error is None, out.error
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, tokens[:-1])
        pos = np.arange(len(tokens) - 1)
        rows = {"all": pos, "last": pos[len(out.prompt_token_ids) - 1:len(out.prompt_token_ids)],
                "generated": pos[len(out.prompt_token_ids):]}[ask.positions]
        for layer in range(LAYERS):
            key = f"model.layers.{layer}.resid"
            want = hf_lens(path, ref[key][rows])
            check_rows(out.taps[f"{key}:lens.ids"], out.taps[f"{key}:lens.logits"], want, f"request {i} layer {layer}")
        if ask.positions == "all":   # the last layer's best token is the greedy one vLLM chose next
            plen = len(out.prompt_token_ids)
            best = out.taps[f"model.layers.{LAYERS - 1}.resid:lens.ids"][plen - 1:, 0]
            chosen = torch.tensor(tokens[plen:], dtype=best.dtype)
            assert (best == chosen).float().mean() >= 0.8, f"request {i}: {best.tolist()} vs greedy {chosen.tolist()}"


def test_a_request_behind_a_cached_prefix_gets_its_own_rows(engine, path):
    """The second request's first 64 tokens are served from the prefix cache; its lens rows of
    the positions it computes equal HF's on its whole token list."""
    shared = np.random.default_rng(7).integers(0, SMALL["vocab_size"], 64).tolist()
    engine.generate(random_prompts(1, 8, shared), greedy(2))
    out = engine.generate(random_prompts(1, 9, shared), greedy(3), taps=tapc.TapRequest(capture="*", positions="generated"))[0]
    assert out.error is None, out.error
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref = hf_reference(path, tokens[:-1])
    rows = np.arange(len(out.prompt_token_ids), len(tokens) - 1)
    for layer in range(LAYERS):
        key = f"model.layers.{layer}.resid"
        check_rows(out.taps[f"{key}:lens.ids"], out.taps[f"{key}:lens.logits"], hf_lens(path, ref[key][rows]),
                   f"layer {layer}")
