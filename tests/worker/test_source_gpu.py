"""`.source` taps on a real vLLM engine (GPU machine): q and k out of Llama attention's
`qkv.split(...)`, against HF transformers' q_proj / k_proj outputs on the same weights; on
vLLM's V2 runner and on V1."""
import pytest
import torch
from gpu_engines import engine_args, hf_forward, model_runner, shutdown
from hf_checks import assert_captures_equal_hf, prompts, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAPS = ["model.layers.1.self_attn.source.qkv_split_0.output[0]",
        "model.layers.1.self_attn.source.qkv_split_0.output[1]",
        "model.layers.2.mlp.source.self_down_proj_0.input"]


def hf_points(path, tokens):
    seen = {}

    def hooks(model):
        attn = model.model.layers[1].self_attn
        return [attn.q_proj.register_forward_hook(lambda m, a, o: seen.__setitem__(TAPS[0], o[0].float().cpu())),
                attn.k_proj.register_forward_hook(lambda m, a, o: seen.__setitem__(TAPS[1], o[0].float().cpu())),
                model.model.layers[2].mlp.down_proj.register_forward_pre_hook(
                    lambda m, a: seen.__setitem__(TAPS[2], a[0][0].float().cpu()))]

    hf_forward(path, tokens, hooks)
    return seen


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_qkv_split_and_down_proj_input_equal_hf(checkpoints, runner):
    from tapc import VLLM
    from tapc import TapRequest

    path = checkpoints("llama")
    with model_runner(runner):
        llm = VLLM(path, taps=TAPS, **engine_args())
    try:
        outs = llm.generate(prompts(), sampling(), taps=TapRequest(capture="*"))
        assert_captures_equal_hf(outs, path, TAPS, hf_points)
    finally:
        shutdown(llm)   # this test's engine alone
