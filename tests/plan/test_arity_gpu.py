"""Output arity per call site on a real vLLM engine (GPU machine), against HF transformers.

vLLM's decoder layers call `input_layernorm(h)` in layer 0 (one tensor back) and
`input_layernorm(h, residual)` after it, which returns (norm(h + residual), h + residual): so
`model.layers.1.input_layernorm.output[1]` is the residual stream entering layer 1 (HF's layer-1
input), `[0]` the normed states (HF's input_layernorm output), and layer 0's `[1]` is refused.
A decoder layer's bare `.output` captures both tensors (nnsight's reading): `[0]` the MLP output,
`[1]` the residual stream after attention (HF's post_attention_layernorm input).
"""
import pytest
import torch
from gpu_engines import engine_args, hf_forward, shutdown
from hf_checks import assert_captures_equal_hf, prompts, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAPS = ["model.layers.1.input_layernorm.output[0]", "model.layers.1.input_layernorm.output[1]",
        "model.layers.1.source.self_input_layernorm_1.output[1]", "model.layers[2:4].output", "model.norm.output[1]"]
KEYS = ["model.layers.1.input_layernorm.output[0]", "model.layers.1.input_layernorm.output[1]",
        "model.layers.1.source.self_input_layernorm_1.output[1]", "model.layers.2.output[0]", "model.layers.2.output[1]",
        "model.layers.3.output[0]", "model.layers.3.output[1]", "model.norm.output[1]"]


def hf_points(path, tokens) -> dict[str, torch.Tensor]:
    seen = {}

    def put(key, t):
        seen[key] = t[0].float().cpu()

    def hooks(model):
        layers = model.model.layers
        handles = [layers[1].input_layernorm.register_forward_hook(lambda m, a, o: put(KEYS[0], o)),
                   layers[1].register_forward_pre_hook(lambda m, a, kw: put(KEYS[1], (a[0] if a else kw["hidden_states"])),
                                                       with_kwargs=True),
                   model.model.norm.register_forward_pre_hook(lambda m, a: put(KEYS[-1], a[0]))]
        for i in (2, 3):
            handles += [layers[i].mlp.register_forward_hook(lambda m, a, o, i=i: put(f"model.layers.{i}.output[0]", o)),
                        layers[i].post_attention_layernorm.register_forward_pre_hook(
                            lambda m, a, i=i: put(f"model.layers.{i}.output[1]", a[0]))]
        return handles

    hf_forward(path, tokens, hooks)   # the session's HF model, loaded once
    seen[KEYS[2]] = seen[KEYS[1]]  # the same call, tapped from the decoder layer's forward
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_norm_elements_and_layer_outputs_equal_hf(checkpoints, arch):
    from tapc import VLLM
    from tapc import TapRequest
    from tapc.errors import ResolveError

    path = checkpoints(arch)
    with pytest.raises(ResolveError, match=r"its output is one tensor; drop `\[1\]` \(vLLM calls it without a residual in layer 0"):
        VLLM(path, taps=["model.layers.0.input_layernorm.output[1]"], **engine_args())
    llm = VLLM(path, taps=TAPS, **engine_args())
    try:
        assert list(llm.plan.capture_keys) == KEYS
        outs = llm.generate(prompts(), sampling(), taps=TapRequest(capture="*"))
        assert_captures_equal_hf(outs, path, KEYS, hf_points, f"{arch} ")
        for out in outs:   # [1] is the residual stream, not the normed states the old plan would have taken
            assert not torch.allclose(out.taps[KEYS[0]].float(), out.taps[KEYS[1]].float(), atol=1e-2)
    finally:
        shutdown(llm)   # this test's engine alone
