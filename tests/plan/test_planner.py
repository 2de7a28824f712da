"""Tap plans against real vLLM 0.26 module trees (built on meta, no GPU)."""
import dataclasses

import pytest

from tapc.errors import PlanError, ResolveError, TapcError
from tapc.plan.tapplan import BLOCK, EDIT, ENGINE, READ, TapPlan
from tapc.plan.planner import build_plan


def plan(trees, arch, taps, **kw):
    tree = trees(arch)
    return build_plan(tree.model, taps, tree=tree, **kw)


@pytest.mark.parametrize("arch,layers,arch_name", [
    ("llama", 4, "LlamaForCausalLM"), ("qwen2", 3, "Qwen2ForCausalLM"),
    ("qwen3", 6, "Qwen3ForCausalLM"), ("qwen2_moe", 2, "Qwen2MoeForCausalLM"),
])
def test_real_trees(trees, arch, layers, arch_name):
    tree = trees(arch)
    assert tree.architecture == arch_name and tree.num_layers == layers and tree.layers_path == "model.layers"
    paths = set(tree.by_path)
    for i in range(layers):
        assert {f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.self_attn.o_proj",
                f"model.layers.{i}.input_layernorm"} <= paths
    p = plan(trees, arch, ["model.layers.*.resid"])
    assert [t.key for t in p.taps] == [f"model.layers.{i}.resid" for i in range(layers)]
    assert all(t.width == tree.hidden_size and t.kind == READ for t in p.taps)


def test_llama_widths_and_dense_points(trees):
    p = plan(trees, "llama", [
        "model.layers.0.self_attn.qkv_proj.output", "model.layers.0.mlp.gate_up_proj.output",
        "model.layers.0.mlp.act_fn.output", "model.layers.0.mlp.down_proj.input", "model.layers.0.output[1]",
        "model.layers.0.self_attn.attn.output", "model.embed_tokens.output", "model.norm.output",
    ])
    # hidden 256, 8 heads x 32, 4 kv heads: qkv = 256 + 2*128; intermediate 704
    assert [t.width for t in p.taps] == [512, 1408, 704, 704, 256, 256, 256, 256]


def test_moe_points(trees):
    p = plan(trees, "qwen2_moe", ["model.layers.*.mlp.gate.output", "model.layers.1.mlp.output"])
    assert [(t.key, t.width) for t in p.taps] == [
        ("model.layers.0.mlp.gate.output", 8), ("model.layers.1.mlp.gate.output", 8), ("model.layers.1.mlp.output", 128)]


@pytest.mark.parametrize("tap,layers", [
    ("model.layers[0:6:2].resid", [0, 2, 4]),
    ("model.layers[::-1].resid", [5, 4, 3, 2, 1, 0]),
    ("model.layers[4:].resid", [4, 5]),
    ("model.layers[:2].resid", [0, 1]),
    ("model.layers[5,1,3].resid", [5, 1, 3]),
    ("model.layers[-1,0].resid", [5, 0]),
    ("model.layers.*.resid", [0, 1, 2, 3, 4, 5]),
])
def test_globs_and_ranges(trees, tap, layers):
    p = plan(trees, "qwen3", [tap])
    assert [t.layer for t in p.taps] == layers
    assert [t.key for t in p.taps] == [f"model.layers.{i}.resid" for i in layers]


def test_star_in_the_middle_expands_in_model_order(trees):
    p = plan(trees, "llama", ["model.layers.1.mlp.*.output"])
    assert [t.key for t in p.taps] == [f"model.layers.1.mlp.{m}.output" for m in ("gate_up_proj", "down_proj", "act_fn")]


def test_source_op_names_on_llama_attention_and_mlp(trees):
    tree = trees("llama")
    attn = tree.by_path["model.layers.0.self_attn"]
    assert [o.name for o in attn.source_ops] == ["self_qkv_proj_0", "qkv_split_0", "self_rotary_emb_0",
                                                  "self_attn_0", "self_o_proj_0"]
    split = next(o for o in attn.source_ops if o.name == "qkv_split_0")
    assert split.out_widths == (256, 128, 128) and split.in_width == 512
    mlp = tree.by_path["model.layers.0.mlp"]
    assert [o.name for o in mlp.source_ops] == ["self_gate_up_proj_0", "self_act_fn_0", "self_down_proj_0"]
    p = plan(trees, "llama", ["model.layers.2.self_attn.source.qkv_split_0.output[1]",
                              "model.layers.2.self_attn.source.self_o_proj_0.input",
                              "model.layers.2.mlp.source.self_act_fn_0.output"])
    assert [(t.point.op, t.point.io, t.point.element, t.width) for t in p.taps] == [
        ("qkv_split_0", "output", 1, 128), ("self_o_proj_0", "input", None, 256), ("self_act_fn_0", "output", None, 704)]


def test_qwen3_source_has_qk_norm(trees):
    attn = trees("qwen3").by_path["model.layers.0.self_attn"]
    assert [o.name for o in attn.source_ops] == [
        "self_qkv_proj_0", "qkv_split_0", "q_view_0", "self_q_norm_0", "q_by_head_view_0", "k_view_0",
        "self_k_norm_0", "k_by_head_view_0", "self_rotary_emb_0", "self_attn_0", "self_o_proj_0"]


def test_kinds_and_graph_splits(trees):
    p = plan(trees, "llama", ["model.layers.1.resid", "model.layers.2.resid | add(v)",
                              "model.layers.3.mlp.output -> probe", "logits", "samples"])
    assert [t.kind for t in p.taps] == [READ, EDIT, BLOCK, ENGINE, ENGINE]
    assert p.splitting_ops == ("tapc::boundary",)
    assert (p.pieces_before, p.pieces_after) == (5, 6)
    q = plan(trees, "llama", ["model.layers.1.resid", "model.layers.2.resid | add(v)"])
    assert q.splitting_ops == () and q.pieces_after == 5


def test_buffer_arithmetic(trees):
    p = plan(trees, "llama", ["model.layers.0.resid", "model.layers.0.mlp.act_fn.output",
                              "model.layers.1.resid | add(v, alpha=a)", "logits"],
             max_num_batched_tokens=1000, max_num_seqs=10, capture_dtype="float32")
    resid, act, edit, logits = p.taps
    # captures: a pool and its snapshot of [rows, width], the decode steps' snapshot of
    # [max_num_seqs, width], and an int32 row table (the first capture one more: the rings' starts)
    assert resid.buffer_bytes == (2 * 1000 + 10) * 256 * 4 + 2 * 1000 * 4 and resid.dtype == "float32"
    assert act.buffer_bytes == (2 * 1000 + 10) * 704 * 4 + 1000 * 4
    same = plan(trees, "llama", ["model.layers.0.resid"], max_num_batched_tokens=1000, max_num_seqs=1000,
                capture_dtype="float32")
    assert same.taps[0].buffer_bytes == 2 * 1000 * 256 * 4 + 2 * 1000 * 4   # no decode snapshot: as many rows
    # edits: a row table, and a float32 vector and a scale in each of 2 slots per request
    assert edit.buffer_bytes == 1000 * 4 + 2 * 10 * (256 * 4 + 4)
    assert logits.buffer_bytes == 0                         # kept per step until collected, not preallocated
    assert p.total_buffer_bytes == resid.buffer_bytes + act.buffer_bytes + edit.buffer_bytes
    assert {(q.name, q.kind, q.width) for q in p.params} == {("v", "vector", 256), ("a", "scalar", None)}


def test_digest_is_stable_and_sensitive(trees):
    taps = ["model.layers.*.resid", "model.layers.2.resid | add(v, alpha=2)"]
    a, b = plan(trees, "llama", taps), plan(trees, "llama", list(taps))
    assert a == b and a.digest == b.digest and len(a.digest) == 16
    changes = [["model.layers.*.resid", "model.layers.2.resid | add(v, alpha=3)"],
               ["model.layers.*.resid", "model.layers.1.resid | add(v, alpha=2)"],
               ["model.layers[0:3].resid", "model.layers.2.resid | add(v, alpha=2)"]]
    digests = {plan(trees, "llama", c).digest for c in changes}
    assert a.digest not in digests and len(digests) == 3
    assert plan(trees, "llama", taps, max_num_batched_tokens=4096).digest != a.digest


def test_param_users_are_the_taps_reading_each_parameter_in_plan_order(trees):
    p = plan(trees, "llama", ["model.layers.*.resid", "model.layers[1:3].resid | add(v, alpha=a)",
                              "model.layers.0.resid | scale(factor=a)", "model.layers.3.resid | patch(src)"])
    users = {name: [(t.key, t.action) for t in ts] for name, ts in p.param_users.items()}
    assert users == {"v": [("model.layers.1.resid", "add"), ("model.layers.2.resid", "add")],
                     "a": [("model.layers.1.resid", "add"), ("model.layers.2.resid", "add"),
                           ("model.layers.0.resid", "scale")],
                     "src": [("model.layers.3.resid", "patch")]}
    assert [t for ts in p.param_users.values() for t in ts if t not in p.taps] == []
    assert [(t.key, t.action) for t in p.taps_reading(["src", "v"])] == \
        [("model.layers.1.resid", "add"), ("model.layers.2.resid", "add"), ("model.layers.3.resid", "patch")]
    assert dataclasses.asdict(p) == dataclasses.asdict(TapPlan.from_json(p.to_json()))   # not part of the value


def test_json_round_trip_and_diff(trees):
    p = plan(trees, "llama", ["model.layers.*.resid", "model.layers.2.mlp.act_fn.output | set([1, 2], value=[0.5, 1])",
                              "model.layers.3.mlp.output -> probe", "samples"])
    again = TapPlan.from_json(p.to_json())
    assert again == p
    changed = dataclasses.replace(p, taps=p.taps[1:])
    assert changed != p


BAD = [
    (["model.layer.3.resid"], ResolveError, ["no module `model.layer`", "did you mean `model.layers`"]),
    (["model.layers.9.resid"], ResolveError, ["no module `model.layers.9`", "`model.layers` has 0..3"]),
    (["model.layers[1,7].resid"], ResolveError, ["`model.layers` has no 7", "0..3"]),
    (["model.layers[5:].resid"], ResolveError, ["`model.layers[5:]` matches no module"]),
    (["model.layers.3.output | add(v)"], ResolveError, ["(hidden_states, residual)", "edit `.resid`", "`.output[0]` or `.output[1]`"]),
    (["model.layers.3.output -> probe"], ResolveError, ["run a block at `.resid`", "`.output[1]`"]),
    (["model.layers.3.output[2]"], ResolveError, ["(hidden_states, residual)", "`.output` for both"]),
    # vLLM calls layer 0's input norm without a residual: one tensor there, (normed, residual) after
    (["model.layers.0.input_layernorm.output[1]"], ResolveError,
     ["at `model.layers.0.input_layernorm` (RMSNorm): its output is one tensor; drop `[1]`",
      "without a residual in layer 0; in layers 1..3 it returns (normed, residual)", "`model.layers.0.input`"]),
    (["model.layers.0.input_layernorm.output[0]"], ResolveError, ["one tensor; drop `[0]`"]),
    (["model.layers.2.input_layernorm.output[2]"], ResolveError, ["returns (normed, residual)", "not `[2]`"]),
    (["model.layers[0:2].input_layernorm.output[1]"], ResolveError, ["layer 0"]),
    (["model.layers.*.self_attn.rotary_emb.output"], ResolveError, ["several tensors"]),
    (["model.layers.3.self_attn.source.qkv_splt_0.output"], ResolveError,
     ["no `.source` op 'qkv_splt_0'", "did you mean `qkv_split_0`", "self_qkv_proj_0, qkv_split_0, self_rotary_emb_0"]),
    (["model.layers.3.self_attn.source.qkv_split_0.output"], ResolveError, ["returns 3 tensors", "256, 128, 128", "`.output[k]`"]),
    (["model.layers.3.mlp.resid"], ResolveError, ["`.resid` is the residual stream after a decoder layer"]),
    (["model.layers.3.resid", "model.layers.*.resid"], PlanError, ["tapped twice", "`model.layers.3.resid`", "`model.layers.*.resid`"]),
    (["model.layers.3.resid | add(v)", "model.layers.3.mlp.act_fn.output | add(v)"], PlanError, ["'v' is 256 wide", "704", "two names"]),
    (["model.layers.3.resid | add(v)", "model.layers.2.resid | scale(v)"], PlanError, ["'v' is a vector", "but a scalar"]),
    (["samples | add(v)"], ResolveError, ["samples are token ids", "`samples -> name`"]),
    (["logits | project_out(d)"], ResolveError, ["set/zero to mask tokens"]),
    (["model.layers.3.mlp.down_proj.output | zero([300])"], ResolveError, ["columns [300] are past the point's width 256"]),
    (["model.layers.3.mlp.down_proj.output | set([1, 2], value=[1, 2, 3])"], ResolveError, ["3 values for 2 columns"]),
    (["model.layers.3.mlp.down_proj.output | add([1, 2])"], ResolveError, ["has 2 numbers but the point is 256 wide"]),
    (["model.layers.3.self_attn.source.self_o_proj_0.input | add(v)"], ResolveError, ["cannot run in-graph", "Python block"]),
    (["model.embed_tokens.input"], ResolveError, ["token ids"]),
    (["model.layers.3.self_attn.rotary_emb.output"], ResolveError, ["several tensors"]),
    (["model.layers.3.self_attn.source.self_rotary_emb_0.output"], ResolveError, ["cannot size", "`qkv_split_0`"]),
    (["model.layers.3.mlp.down_proj.output[1]"], ResolveError, ["(output, bias)"]),
    (["model.layers.3.mlp.act_fn.output[0]"], ResolveError, ["one tensor; drop `[0]`"]),
    (["lm_head.output"], ResolveError, ["not tappable", "`logits`"]),
    ([], PlanError, ["no taps"]),
]


@pytest.mark.parametrize("taps,error,words", BAD, ids=[" ; ".join(b[0]) or "<none>" for b in BAD])
def test_plan_errors(trees, taps, error, words):
    with pytest.raises(error) as info:
        plan(trees, "llama", taps)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert isinstance(info.value, TapcError)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2_moe"])
def test_norm_arity_per_call_site(trees, arch):
    """vLLM's decoder layers: `if residual is None: h = input_layernorm(h)` (layer 0), else
    `h, residual = input_layernorm(h, residual)`; post_attention_layernorm and the final norm
    always get a residual."""
    tree = trees(arch)
    kinds = {n.path: n.output for n in tree.nodes}
    assert kinds["model.layers.0.input_layernorm"] == "tensor"
    assert all(kinds[f"model.layers.{i}.input_layernorm"] == "norm" for i in range(1, tree.num_layers))
    assert all(kinds[f"model.layers.{i}.post_attention_layernorm"] == "norm" for i in range(tree.num_layers))
    assert kinds["model.norm"] == "norm"
    p = plan(trees, arch, ["model.layers.*.input_layernorm.output[1]", "model.layers.1.input_layernorm.output[0]"])
    assert [t.key for t in p.taps] == [f"model.layers.{i}.input_layernorm.output[1]" for i in range(1, tree.num_layers)] \
        + ["model.layers.1.input_layernorm.output[0]"]


def test_qwen3_qk_norms_run_per_head_and_are_refused(trees):
    tree = trees("qwen3")
    assert {tree.by_path[f"model.layers.{i}.self_attn.{n}"].output for i in range(6) for n in ("q_norm", "k_norm")} == {"heads"}
    for site in ("output", "input"):
        with pytest.raises(ResolveError, match=r"per head, to a \[tokens, heads, head_dim\] view.*qkv_split_0"):
            plan(trees, "qwen3", [f"model.layers.2.self_attn.q_norm.{site}"])
    p = plan(trees, "qwen3", ["model.layers.2.self_attn.*.output"])  # a glob skips them (and the rotary)
    assert [t.key for t in p.taps] == [f"model.layers.2.self_attn.{m}.output" for m in ("qkv_proj", "o_proj", "attn")]


def test_a_star_skips_children_its_point_does_not_apply_to_and_says_so(trees):
    from tapc.plan.resolve import notes

    tree = trees("llama")
    p = plan(trees, "llama", ["model.layers.0.self_attn.*.output", "model.layers.*.input_layernorm.output[1]"])
    assert [t.key for t in p.taps] == ["model.layers.0.self_attn.qkv_proj.output", "model.layers.0.self_attn.o_proj.output",
                                       "model.layers.0.self_attn.attn.output"] + \
        [f"model.layers.{i}.input_layernorm.output[1]" for i in (1, 2, 3)]
    said = notes(p, tree)
    assert len(said) == 2
    assert "`model.layers.0.self_attn.*.output` skips 1 match(es)" in said[0]
    assert "`model.layers.0.self_attn.rotary_emb` (this module returns several tensors" in said[0]
    assert "`model.layers.*.input_layernorm.output[1]` skips 1" in said[1] and "`model.layers.0.input_layernorm`" in said[1]


def test_decoder_layer_output_means_both_tensors_for_captures(trees):
    from tapc.plan.resolve import notes

    p = plan(trees, "llama", ["model.layers[1:3].output"])
    assert [(t.key, t.width) for t in p.taps] == [(f"model.layers.{i}.output[{k}]", 256) for i in (1, 2) for k in (0, 1)]
    assert [t.source for t in p.taps] == ["model.layers[1:3].output"] * 4
    (said,) = notes(p, trees("llama"))
    assert "captured as `.output[0]` and `.output[1]` (as nnsight reads it)" in said


def test_unknown_model_is_a_clear_error(tmp_path):
    from tapc.plan.tree import load_tree

    with pytest.raises(ResolveError, match="no such directory"):
        load_tree(str(tmp_path / "nope"))
    with pytest.raises(ResolveError, match="without config.json"):
        load_tree(str(tmp_path))


BAD_CONFIGS = [
    ('{"architectures": ["LlamaForCausalLM"], "hidden_size": 256,', "not valid JSON (line 1, column 60)"),
    ('{"model_type": "llama", "hidden_size": 256}', "field `architectures` is missing; it names the model class"),
    ('{"architectures": "LlamaForCausalLM"}', "field `architectures` is 'LlamaForCausalLM'"),
    ('["LlamaForCausalLM"]', "a model config is a JSON object, not list"),
    (b"\xff\xfe{}", "not valid JSON"),
]


@pytest.mark.parametrize("text,words", BAD_CONFIGS, ids=[w[:30] for _, w in BAD_CONFIGS])
def test_bad_model_config_fails_fast_naming_file_and_field(tmp_path, text, words):
    import time

    from tapc.plan.tree import load_tree

    cfg = tmp_path / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.monotonic()
    with pytest.raises(ResolveError) as info:
        load_tree(str(tmp_path))
    assert time.monotonic() - start < 1, "checked before anything imports vLLM"
    message = str(info.value)
    assert message.startswith(f"{cfg}: ") and words in message and message.count("\n") == 0, message


def test_an_architecture_vllm_lacks_is_one_line(tmp_path):
    from tapc.plan.tree import load_tree

    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLN"], "model_type": "llama"}')
    with pytest.raises(ResolveError) as info:
        load_tree(str(tmp_path))
    message = str(info.value)
    assert message.count("\n") == 0 and len(message) < 400, message
    assert f"{tmp_path / 'config.json'}: field `architectures` is ['LlamaForCausalLN']: vLLM" in message
    assert "did you mean LlamaForCausalLM" in message
    import time

    start = time.monotonic()  # vLLM's model classes are cached by version: the next one is fast
    with pytest.raises(ResolveError, match="has no model class"):
        load_tree(str(tmp_path))
    assert time.monotonic() - start < 1
