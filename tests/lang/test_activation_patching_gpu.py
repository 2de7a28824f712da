"""Activation patching (`| patch(src)`) on a real vLLM engine against HF transformers (GPU machine).

Causal tracing on the session's random Llama checkpoint (tests/support/gpu_engines.py): the clean
prompt's residual rows, captured by the engine, are put back into the corrupted prompt's run
at two positions of one layer per request, all layers in one `generate`; every layer's
residual stream equals HF's on the corrupted prompt with the same rows put back by a forward
hook. An unpatched request in the same batch equals HF's plain run.
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, hf_forward, llama_engine
from hf_checks import assert_matches, hf_reference

import tapc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS = SMALL["num_hidden_layers"]
RESID = [f"model.layers.{i}.resid" for i in range(LAYERS)]
# the patches first: taps at one point run in plan order, so the captures see the patched rows
TAPS = [*(f"model.layers.{i}.resid | patch(clean{i}, rows=2)" for i in range(LAYERS)), "model.layers.*.resid"]


path, engine = llama_engine(TAPS)


def hf_patched(path: str, tokens: list[int], layer: int, rows: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's residual stream on `tokens` with `rows` ({position: row}) put into layer `layer`'s
    output before the next layer reads it; each layer's as the plan captures it (after)."""
    seen = {}

    def hook(i):
        def put(mod, args, out):
            h = out[0] if isinstance(out, tuple) else out
            if i == layer:
                h = h.clone()
                for p, row in rows.items():
                    h[0, p] = row.to(h.device, h.dtype)
            seen[f"model.layers.{i}.resid"] = h.float().clone()
            return (h, *out[1:]) if isinstance(out, tuple) else h
        return put

    hf_forward(path, tokens, lambda model: [m.register_forward_hook(hook(i)) for i, m in enumerate(model.model.layers)])
    return {k: v[0].cpu() for k, v in seen.items()}


def test_the_plan_splits_no_graph(engine):
    assert engine.plan.splitting_ops == () and engine.plan.pieces_after == engine.plan.pieces_before


def test_causal_tracing_equals_hf_with_the_rows_put_back_by_hand(engine, path):
    from vllm import SamplingParams

    rng = np.random.default_rng(11)
    clean = rng.integers(0, SMALL["vocab_size"], 24).tolist()
    subject = [6, 7]
    corrupted = list(clean)
    for p in subject:
        corrupted[p] = (corrupted[p] + 101) % SMALL["vocab_size"]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    (run,) = engine.generate([{"prompt_token_ids": clean}], one, taps=tapc.TapRequest(capture="*", positions="prompt"))
    assert run.error is None, run.error
    rows = {key: run.taps[key][subject].clone() for key in RESID}
    asks = [tapc.TapRequest(capture="*", positions="prompt",
                            params={f"clean{i}": {"positions": subject, "rows": rows[RESID[i]]}}) for i in range(LAYERS)]
    outs = engine.generate([{"prompt_token_ids": corrupted}] * (LAYERS + 1), one,
                           taps=asks + [tapc.TapRequest(capture="*", positions="prompt")])
    for i, out in enumerate(outs[:LAYERS]):
        assert out.error is None, out.error
        ref = hf_patched(path, corrupted, i, dict(zip(subject, rows[RESID[i]])))
        for key in RESID:
            assert_matches(out.taps[key], ref[key], f"patched at layer {i}: {key}")
        torch.testing.assert_close(out.taps[RESID[i]][subject], rows[RESID[i]].to(out.taps[RESID[i]].dtype),
                                   rtol=0, atol=0.05 * rows[RESID[i]].abs().max().item())
    # the unpatched request of the same batch: HF's plain run (its captures stop at the prompt)
    plain = outs[LAYERS]
    ref = hf_reference(path, corrupted)
    for key in RESID:
        assert_matches(plain.taps[key], ref[key][:len(corrupted)], f"unpatched: {key}")
    assert not torch.allclose(outs[0].taps[RESID[-1]].float(), plain.taps[RESID[-1]].float()), \
        "patching layer 0 changed nothing downstream: the test would pass with no patch at all"
