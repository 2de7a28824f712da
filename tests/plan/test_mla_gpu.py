"""DeepSeek-style MLA attention on a GPU, against HF transformers on the same weights (bf16).

Small random checkpoints with realistic init written with HF transformers (tests/support/gpu_engines.py,
`MLA`): DeepSeek-V2's attention (q straight from the hidden state) and DeepSeek-V3's (q through
a low-rank projection and its norm), with DeepSeek's head sizes (a 512-wide kv latent, 64 rope
dims, 128-wide values) on 4 heads; every layer dense, so that nothing but the attention is new
here (the routers are tests/plan/test_moe_gpu.py's). Decode attention is vLLM's `TRITON_MLA`; prefill,
which vLLM computes with FlashAttention on Hopper and the GPU bundle cannot carry, is a plain
torch backend that vLLM's engine core loads as a general plugin (tests/support/mla_prefill). Compile and CUDA graphs
on, continuous batching (gpu_engines.ENGINE).

Captured at every layer: the residual stream and the attention's output (`o_proj.input`,
heads x v_head_dim), and inside layer 1 the kv latent after its norm (and, for V3, q's latent
after its norm), each equal to HF's within bf16 tolerance on the tokens that went through the
model. A capture at `kv_b_proj`, which vLLM runs on prefill rows only, is refused by the plan
(tests/plan/test_mla.py).
"""
import numpy as np
import pytest
import torch
from gpu_engines import MLA, SMALL, engine_args, hf_forward, importable, shutdown
from places import SUPPORT
from hf_checks import assert_matches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS = SMALL["num_hidden_layers"]
PROMPT_LENS = [5, 37, 150, 12]
MAX_TOKENS = [6, 9, 4, 8]


def taps(arch: str) -> list[str]:
    inner = ["model.layers.1.self_attn.kv_a_layernorm.output"]
    if arch == "deepseek_v3":
        inner.append("model.layers.1.self_attn.q_a_layernorm.output")
    return ["model.layers.*.resid", "model.layers.*.self_attn.o_proj.input", *inner]


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def mla_engine(request, checkpoints):
    import transformers
    from tapc import VLLM

    arch = request.param
    if not hasattr(transformers, "DeepseekV3Config" if arch == "deepseek_v3" else "DeepseekV2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {arch} model to compare with")
    path = checkpoints(arch)
    with importable(str(SUPPORT / "mla_prefill")):   # a vLLM plugin, loaded by the engine core
        llm = VLLM(path, taps=taps(arch), **dict(engine_args(), attention_backend="TRITON_MLA"))
    yield arch, path, llm
    shutdown(llm)


def hf_reference(path: str, tokens: list[int]) -> dict[str, torch.Tensor]:
    """HF's activations on `tokens`, keyed like tapc's points."""
    seen: dict[str, torch.Tensor] = {}

    def keep(key):
        return lambda mod, args, out: seen.__setitem__(key, (out[0] if isinstance(out, tuple) else out)[0].float())

    def hooks(model):
        handles = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            handles.append(layer.register_forward_hook(keep(f"model.layers.{i}.resid")))
            handles.append(attn.o_proj.register_forward_pre_hook(
                lambda mod, args, i=i: seen.__setitem__(f"model.layers.{i}.self_attn.o_proj.input", args[0][0].float())))
            if i == 1:
                handles.append(attn.kv_a_layernorm.register_forward_hook(keep("model.layers.1.self_attn.kv_a_layernorm.output")))
                if getattr(attn, "q_a_layernorm", None) is not None:
                    handles.append(attn.q_a_layernorm.register_forward_hook(
                        keep("model.layers.1.self_attn.q_a_layernorm.output")))
        return handles

    hf_forward(path, tokens, hooks)
    return {k: v.cpu() for k, v in seen.items()}


def test_mla_captures_equal_hf_under_continuous_batching(mla_engine):
    from vllm import SamplingParams

    from tapc import TapRequest

    arch, path, llm = mla_engine
    rng = np.random.default_rng(7)
    prompts = [{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], n).tolist()} for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params, taps=TapRequest(capture="*"))   # every row each request ran
    keys = llm.plan.capture_keys
    assert len(keys) == 2 * LAYERS + (2 if arch == "deepseek_v3" else 1)
    width = MLA["num_attention_heads"] * MLA["v_head_dim"]
    for i, out in enumerate(outs):
        assert out.error is None, f"{arch} request {i}: {out.error}"
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, tokens[:-1])
        assert out.taps["model.layers.0.self_attn.o_proj.input"].shape == (len(tokens) - 1, width)
        for key in keys:
            assert_matches(out.taps[key], ref[key], f"{arch} request {i} {key}")
