"""LoRA adapters on a GPU: captures under an adapter equal HF transformers + peft on the same
weights (bf16 tolerance), and requests with and without the adapter in one batch each get
their own activations.

Needs peft on the GPU machine (`TAPC_GPU_EXTRA="peft accelerate" bash ../shared/gpu/make-bundle
.gpu` if the image lacks it). The session's random Llama checkpoint (tests/support/gpu_engines.py); a
rank-8 adapter on every linear layer, made with peft and given random B matrices (peft starts
them at zero, which would change nothing). vLLM wraps those layers for LoRA at load; the plan
is built on the tree with its wrappers (tapc/plan/metamodel.py), so `mlp.down_proj.output` is the
adapted output. Both model runners.
"""
import pytest
import torch
from gpu_engines import engine_args, model_runner, shutdown
from hf_checks import assert_matches, prompts, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAPS = ["model.layers.*.resid", "model.layers.1.mlp.down_proj.output", "model.layers.2.self_attn.qkv_proj.output"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory):
    """(base checkpoint, adapter folder) of a peft LoRA on the Llama checkpoint."""
    peft = pytest.importorskip("peft", reason="peft is not on this machine: add TAPC_GPU_EXTRA=\"peft accelerate\" "
                                              "to the GPU bundle")
    import transformers

    base = checkpoints("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                       lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp("lora")
    model.save_pretrained(path)
    return base, str(path)


@pytest.fixture(scope="module", params=["v2", "v1"])
def engine(adapter, request):
    from tapc import VLLM

    with model_runner(request.param):
        llm = VLLM(adapter[0], taps=TAPS, enable_lora=True, max_lora_rank=RANK, max_loras=2, **engine_args())
    yield request.param, llm
    shutdown(llm)


def reference(model, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The points of TAPS on `model` (an HF Llama, with peft's LoRA layers in it or not)."""
    seen = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(f"model.layers.{i}.resid", (o[0] if isinstance(o, tuple) else o)[0])))
    mlp, attn = model.model.layers[1].mlp, model.model.layers[2].self_attn
    handles.append(mlp.down_proj.register_forward_hook(
        lambda m, a, o: seen.__setitem__("model.layers.1.mlp.down_proj.output", o[0])))
    qkv = {}
    for name in ("q_proj", "k_proj", "v_proj"):   # vLLM fuses them: [q | k | v]
        handles.append(getattr(attn, name).register_forward_hook(lambda m, a, o, name=name: qkv.__setitem__(name, o[0])))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens], device="cuda"))
    finally:
        for h in handles:
            h.remove()
    seen["model.layers.2.self_attn.qkv_proj.output"] = torch.cat([qkv["q_proj"], qkv["k_proj"], qkv["v_proj"]], dim=-1)
    return {k: v.float().cpu() for k, v in seen.items()}


@pytest.fixture(scope="module")
def hf_models(adapter):
    import peft
    import transformers

    base, path = adapter
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda().eval()
    tuned = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda().eval()
    tuned = peft.PeftModel.from_pretrained(tuned, path).get_base_model().eval()
    return plain, tuned


def test_captures_under_an_adapter_equal_hf_peft_and_plain_requests_stay_plain(engine, adapter, hf_models):
    """Six requests under continuous batching, every other one with the adapter: each request's
    captures equal HF's on its own tokens, with peft's adapter where it asked for it; the
    adapter changed the activations (so a request that got the other's would be caught)."""
    from vllm.lora.request import LoRARequest

    from tapc import TapRequest

    runner, llm = engine
    lora = LoRARequest("tapc-test", 1, adapter[1])
    with_adapter = [i % 2 == 0 for i in range(6)]
    outs = llm.generate(prompts(3), sampling(), taps=TapRequest(capture="*"),
                        lora_request=[lora if a else None for a in with_adapter])
    plain, tuned = hf_models
    for i, (out, adapted) in enumerate(zip(outs, with_adapter)):
        tokens = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1]
        ref = reference(tuned if adapted else plain, tokens)
        other = reference(plain if adapted else tuned, tokens)
        assert set(out.taps) == set(llm.plan.capture_keys) == set(ref)
        for key, value in out.taps.items():
            assert_matches(value, ref[key], f"{runner} request {i} ({'adapter' if adapted else 'base'}) {key}")
        key = "model.layers.1.mlp.down_proj.output"
        rel = ((ref[key] - other[key]).norm() / ref[key].norm()).item()
        assert rel > 0.1, f"request {i}: the adapter moves {key} by only {rel:.3f}; the test could not tell them apart"
