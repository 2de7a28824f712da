"""LoRA engines without a GPU: the module tree an `enable_lora` engine builds (vLLM's LoRA
wrappers around the linear layers, as its runner wraps them at load), the plan on it, and the
refusals that say why a point of the plain tree is gone."""
import pytest
from places import CONFIGS

from tapc.errors import ResolveError
from tapc.plan.planner import build_plan
from tapc.plan.tree import load_tree

LLAMA = str(CONFIGS / "llama")
LORA = {"enable_lora": True}


@pytest.fixture(scope="module")
def lora_tree():
    return load_tree(LLAMA, LORA)


def test_lora_tree_has_vllms_wrappers_with_the_plain_layers_widths(trees, lora_tree):
    plain, lora = trees("llama").by_path, lora_tree.by_path
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        path = f"model.layers.1.{name}"
        wrapper = lora[path]
        assert wrapper.cls.endswith("WithLoRA"), wrapper.cls
        assert (wrapper.output, wrapper.in_width, wrapper.out_width) == \
            (plain[path].output, plain[path].in_width, plain[path].out_width)
        base = lora[f"{path}.base_layer"]
        assert base.cls == plain[path].cls and base.output == "none" and base.source_ops == ()


def test_points_outside_the_wrapped_layers_plan_the_same(trees, lora_tree):
    taps = ["model.layers.*.resid", "model.layers.1.self_attn.source.qkv_split_0.output[0]",
            "model.layers.*.mlp.down_proj.output", "model.layers.2.mlp.gate_up_proj.output | add(v)"]
    plain = build_plan(LLAMA, taps, tree=trees("llama"))
    lora = build_plan(LLAMA, taps, engine_args=LORA)
    assert [(t.key, t.width, t.kind) for t in lora.taps] == [(t.key, t.width, t.kind) for t in plain.taps]


@pytest.mark.parametrize("tap,words", [
    ("model.layers.0.mlp.down_proj.base_layer.output",
     r"base of vLLM's LoRA wrapper `model.layers.0.mlp.down_proj`.*tap `model.layers.0.mlp.down_proj.output`"),
    ("model.layers.0.self_attn.qkv_proj.source.self_quant_method_apply_0.output",
     "LoRA wrapper MergedQKVParallelLinearWithLoRA, whose forward replaces the layer's own"),
])
def test_points_inside_a_wrapped_layer_say_why_they_are_gone(tap, words, trees):
    plain = trees("llama").by_path["model.layers.0.self_attn.qkv_proj"]
    assert "self_quant_method_apply_0" in {o.name for o in plain.source_ops}   # the plain layer's op
    with pytest.raises(ResolveError, match=words):
        build_plan(LLAMA, [tap], engine_args=LORA)


def test_lora_on_an_moe_model_is_refused_with_the_reason():
    with pytest.raises(ResolveError, match="LoRA on MoE models is not supported yet"):
        load_tree(str(CONFIGS / "qwen3_moe"), LORA)


def test_lora_target_modules_choose_the_wrapped_layers(lora_tree):
    """vLLM wraps only the layers `lora_target_modules` names; the plan's tree is the same."""
    only = load_tree(LLAMA, {**LORA, "lora_target_modules": ["o_proj"]}).by_path
    assert only["model.layers.0.self_attn.o_proj"].cls.endswith("WithLoRA")
    assert not only["model.layers.0.mlp.down_proj"].cls.endswith("WithLoRA")
    assert lora_tree.by_path["model.layers.0.mlp.down_proj"].cls.endswith("WithLoRA")
