"""A shared expert on a GPU (Qwen2-MoE: 8 routed experts, top 2, not renormalized, and a shared
expert behind a sigmoid gate, which vLLM runs inside its fused-MoE op), against HF
transformers on the same weights: the shared expert's output, the routing and the MoE block's
output, as tests/plan/test_moe_gpu.py compares them. Needs the TAPC_GPU_MOE=1 bundle."""
import pytest
import torch
from gpu_engines import engine_args, shutdown
from moe_checks import assert_matches_hf, hf_reference, prompts, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAPS = ["model.layers.*.resid", "model.layers.*.mlp.gate.output", "model.layers.*.mlp.experts.router.output",
        "model.layers.*.mlp.shared_expert.output", "model.layers.*.mlp.output"]


def test_shared_expert_routing_and_moe_output_equal_hf(checkpoints):
    from tapc import VLLM
    from tapc import TapRequest

    path = checkpoints("qwen2_moe")
    llm = VLLM(path, taps=TAPS, **engine_args())
    try:
        outs = llm.generate(prompts(3), sampling(), taps=TapRequest(capture="*"))
    finally:
        shutdown(llm)   # this test's engine alone
    for n, out in enumerate(outs):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _ = hf_reference(path, "mlp", tokens[:-1])
        assert set(out.taps) == set(ref), f"request {n}: keys {sorted(set(out.taps) ^ set(ref))}"
        assert_matches_hf(out.taps, ref, "mlp", f"qwen2_moe request {n}", before=("gate.output", "shared_expert.output"))
