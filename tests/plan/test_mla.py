"""DeepSeek-style models (MLA attention, a grouped top-k router, shared experts, dense first
layers) without a GPU: vLLM's trees of DeepSeek-V2 (q straight from the hidden state) and
DeepSeek-V3 (q through a low-rank projection; sigmoid scores with a correction bias) on meta,
built with tapc's stand-in MLA backend (vLLM's CPU platform has none); the widths of MLA's
points against the configs' own sizes; what is refused and why; plans and `tapc explain`."""
import json

import pytest
from places import CONFIGS, SUPPORT

from tapc.errors import ResolveError
from tapc.plan.planner import build_plan

PREFILL = SUPPORT / "mla_prefill"   # the GPU test's MLA prefill stand-in (torch_mla_prefill.py)

ARCHS = ["deepseek_v2", "deepseek_v3"]


def config(arch: str) -> dict:
    return json.loads((CONFIGS / arch / "config.json").read_text())


def plan(arch: str, taps):
    return build_plan(str(CONFIGS / arch), taps)


@pytest.mark.parametrize("arch", ARCHS)
def test_mla_attention_points_have_the_configs_widths(trees, arch):
    c = config(arch)
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    nodes = trees(arch).by_path
    attn = "model.layers.1.self_attn"
    inner = nodes[f"{attn}.mla_attn.mla_attn"]
    # called with (q per head, the kv latent, the rope key): no one input; returns heads x v_head_dim
    assert (inner.cls, inner.output, inner.in_width, inner.out_width) == ("MLAAttention", "tensor", None, heads * v)
    assert nodes[f"{attn}.o_proj"].in_width == heads * v
    assert nodes[f"{attn}.kv_a_layernorm"].out_width == c["kv_lora_rank"]
    if c["q_lora_rank"] is None:
        assert nodes[f"{attn}.kv_a_proj_with_mqa"].out_width == c["kv_lora_rank"] + rope
        assert nodes[f"{attn}.q_proj"].out_width == heads * (nope + rope)
    else:
        assert nodes[f"{attn}.fused_qkv_a_proj"].out_width == c["q_lora_rank"] + c["kv_lora_rank"] + rope
        assert nodes[f"{attn}.q_a_layernorm"].out_width == c["q_lora_rank"]
        assert nodes[f"{attn}.q_b_proj"].out_width == heads * (nope + rope)
    # the same kv_b_proj under three names, each not tappable, each saying why
    for path in (f"{attn}.kv_b_proj", f"{attn}.mla_attn.kv_b_proj", f"{attn}.mla_attn.mla_attn.kv_b_proj"):
        assert nodes[path].output == "none" and "prefill rows only" in nodes[path].why
    assert all(n.output == "none" and "fp8" in n.why for p, n in nodes.items() if p.startswith(f"{inner.path}._"))


@pytest.mark.parametrize("arch", ARCHS)
def test_deepseek_moe_layers_have_a_grouped_router_shared_experts_and_a_dense_first_layer(trees, arch):
    c = config(arch)
    nodes = trees(arch).by_path
    router = nodes["model.layers.1.mlp.experts.router"]
    assert (router.cls, router.output, router.out_width, router.in_moe_op) == \
        ("GroupedTopKRouter", "routing", c["num_experts_per_tok"], True)
    assert nodes["model.layers.1.mlp.gate"].out_width == c["n_routed_experts"]
    shared = nodes["model.layers.1.mlp.shared_experts"]
    assert shared.in_moe_op and shared.output == "tensor" and shared.out_width == c["hidden_size"]
    # the first `first_k_dense_replace` layers have a dense MLP
    assert "model.layers.0.mlp.gate" not in nodes and nodes["model.layers.0.mlp.gate_up_proj"].output == "linear"


@pytest.mark.parametrize("arch", ARCHS)
def test_a_deepseek_plan_of_the_residual_the_router_and_the_attention_output(arch):
    c = config(arch)
    heads, v, hidden = c["num_attention_heads"], c["v_head_dim"], c["hidden_size"]
    p = plan(arch, ["model.layers.*.resid", "model.layers.*.mlp.gate.output", "model.layers.*.mlp.experts.router.output",
                    "model.layers.*.self_attn.o_proj.input", "model.layers.2.mlp.shared_experts.output",
                    "model.layers.1.self_attn.mla_attn.mla_attn.output",
                    "model.layers.2.mlp.gate.output | set(ban, -10000.0)"])
    got = {t.key: (t.width, t.dtype) for t in p.taps if t.kind == "read"}
    layers = range(c["num_hidden_layers"])
    assert all(got[f"model.layers.{i}.resid"] == (hidden, "bfloat16") for i in layers)
    assert all(got[f"model.layers.{i}.self_attn.o_proj.input"] == (heads * v, "bfloat16") for i in layers)
    # layer 0 is dense: the globs over the MoE points take layers 1 and 2
    for i in (1, 2):
        assert got[f"model.layers.{i}.mlp.gate.output"] == (c["n_routed_experts"], "bfloat16")
        assert got[f"model.layers.{i}.mlp.experts.router.output[0]"] == (c["num_experts_per_tok"], "float32")
        assert got[f"model.layers.{i}.mlp.experts.router.output[1]"] == (c["num_experts_per_tok"], "int32")
    assert not any(k.startswith("model.layers.0.mlp.gate") for k in got)
    assert got["model.layers.1.self_attn.mla_attn.mla_attn.output"] == (heads * v, "bfloat16")
    assert got["model.layers.2.mlp.shared_experts.output"] == (hidden, "bfloat16")
    assert [(t.key, t.action) for t in p.taps if t.kind == "edit"] == [("model.layers.2.mlp.gate.output", "set")]


@pytest.mark.parametrize("tap,words", [
    ("model.layers.1.self_attn.kv_b_proj.output", r"prefill rows only .* miss every decode row; the attention's "
                                                   r"output is `self_attn.o_proj.input`"),
    ("model.layers.1.self_attn.mla_attn.mla_attn.kv_b_proj.input", "prefill rows only"),
    ("model.layers.1.self_attn.mla_attn.mla_attn._quant_fp8_op.output", "run only with an fp8 KV cache"),
    ("model.layers.1.self_attn.mla_attn.mla_attn.input", r"no one \[tokens, width\] activation among its arguments"),
    ("model.layers.1.self_attn.rotary_emb.output", "several tensors"),
])
def test_mla_refusals_say_why_and_what_to_tap(tap, words):
    with pytest.raises(ResolveError, match=words):
        plan("deepseek_v2", [tap])


def test_explain_lists_mla_points_and_the_grouped_router(trees):
    from tapc.plan.explain import render_points

    text = render_points(trees("deepseek_v3"), width=400)
    row = next(line for line in text.splitlines() if "mla_attn.mla_attn " in line)
    assert "MLAAttention" in row and " 128 " in row
    kv_b = next(line for line in text.splitlines() if "self_attn.kv_b_proj " in line)
    assert "not tappable: vLLM's MLA attention runs `kv_b_proj` on prefill rows only" in kv_b
    assert any("GroupedTopKRouter" in line for line in text.splitlines())


def test_explain_sizes_mla_source_ops_and_names_each_layer_once(trees):
    from tapc.plan.explain import source_lines

    c = config("deepseek_v3")
    lines = source_lines(trees("deepseek_v3"))
    wrapper = next(line for line in lines if line.lstrip().startswith("MultiHeadLatentAttentionWrapper"))
    latent, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    assert f"kv_lora_split_0 -> {latent} + {rope}" in wrapper
    assert f"self_mla_attn_0 -> {c['num_attention_heads'] * c['v_head_dim']}" in wrapper
    # the shared expert is one module under two names: its layers are 1 and 2, once each
    assert any("(at `model.layers[1:3].mlp.shared_experts`)" in line for line in lines)


# ----------------------------------------------------------------------------- the GPU test's MLA prefill


def test_the_gpu_tests_torch_mla_prefill_equals_sdpa_and_its_lse_merges_chunks():
    """tests/support/mla_prefill stands in for FlashAttention's MLA prefill on the GPU machine: each
    sequence's causal attention equals torch's SDPA, and attention over a context and over the
    new tokens, merged by their log-sum-exps as vLLM merges them, equals attention over both."""
    import sys

    import torch

    sys.path.insert(0, str(PREFILL))
    try:
        from torch_mla_prefill import varlen_attention
    finally:   # its .dist-info is a vLLM plugin: no later test's vLLM should load it
        sys.path.remove(str(PREFILL))

    g = torch.Generator().manual_seed(0)
    heads, dim, v_dim, scale = 3, 24, 16, 24 ** -0.5
    lens, ctx = [5, 1, 9], [4, 0, 7]          # new tokens and cached context per sequence
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu_ctx = [0, *torch.tensor(ctx).cumsum(0).tolist()]
    q, k, v = (torch.randn(cu[-1], heads, d, generator=g) for d in (dim, dim, v_dim))
    kc, vc = (torch.randn(cu_ctx[-1], heads, d, generator=g) for d in (dim, v_dim))
    new, new_lse = varlen_attention(q, k, v, cu, cu, scale, causal=True)
    old, old_lse = varlen_attention(q, kc, vc, cu, cu_ctx, scale, causal=False)
    assert torch.isinf(old_lse[:, cu[1]:cu[2]]).all() and not old[cu[1]:cu[2]].any(), "no context: -inf, zeros"
    merged_lse = torch.logaddexp(new_lse, old_lse)
    merged = (new * (new_lse - merged_lse).exp().T[..., None] + old * (old_lse - merged_lse).exp().T[..., None])
    for i in range(len(lens)):
        qi = q[cu[i]:cu[i + 1]].transpose(0, 1)
        ki = torch.cat([kc[cu_ctx[i]:cu_ctx[i + 1]], k[cu[i]:cu[i + 1]]]).transpose(0, 1)
        vi = torch.cat([vc[cu_ctx[i]:cu_ctx[i + 1]], v[cu[i]:cu[i + 1]]]).transpose(0, 1)
        mask = torch.ones(lens[i], ctx[i] + lens[i], dtype=torch.bool).tril(ctx[i])   # context, then causal
        want = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        assert torch.allclose(merged[cu[i]:cu[i + 1]], want.transpose(0, 1), atol=1e-5), f"sequence {i}"
        alone = torch.nn.functional.scaled_dot_product_attention(
            qi, k[cu[i]:cu[i + 1]].transpose(0, 1), v[cu[i]:cu[i + 1]].transpose(0, 1), is_causal=True, scale=scale)
        assert torch.allclose(new[cu[i]:cu[i + 1]], alone.transpose(0, 1), atol=1e-5), f"sequence {i}, new tokens"


def _prefill_backend_after_plugins(out) -> None:
    """In a spawned process, as vLLM's engine core does before it builds the model: load the
    general plugins, then say which class FlashAttention's MLA prefill resolves to."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum

    before = MLAPrefillBackendEnum.FLASH_ATTN.get_path()
    load_general_plugins()
    cls = MLAPrefillBackendEnum.FLASH_ATTN.get_class()
    out.put((before, cls.__module__, cls.__name__))


def test_the_gpu_tests_mla_prefill_is_a_vllm_plugin_that_takes_flash_attentions_place(monkeypatch):
    """An engine core started under `gpu_engines.importable(tests/support/mla_prefill)` (as
    test_mla_gpu.py starts its engines: a process of multiprocessing's spawn, which takes its
    parent's sys.path) finds the folder among vLLM's general plugins, and once vLLM loads them
    FlashAttention's MLA prefill is the stand-in."""
    import multiprocessing

    from gpu_engines import importable

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with importable(str(PREFILL)):
        proc = ctx.Process(target=_prefill_backend_after_plugins, args=(out,))
        proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the spawned process failed (exit code {proc.exitcode}); its traceback is above"
    before, module, name = out.get(timeout=10)
    assert before.endswith("FlashAttnPrefillBackend"), "registered before vLLM loaded its plugins"
    assert (module, name) == ("torch_mla_prefill", "TorchMLAPrefill")
