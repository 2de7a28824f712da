"""`<attention>.pattern` in the language, the plan, `explain` and the request checks."""
import pytest
from engine_toy import LAYERS, attention_nodes, toy_tree

from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.errors import PlanError, RequestError, ResolveError, TapSyntaxError
from tapc.plan.explain import render
from tapc.plan.planner import build_plan
from tapc.plan.sharding import ModelDims
from tapc.plan.sizing import ITEMSIZE, small_snapshot_rows
from tapc.wire.positions import beyond_pattern

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4
DIMS = ModelDims(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def plan(taps, inner="Attention", rows=64, seqs=8, **engine_args):
    tree = toy_tree(mlp=lambda p, i: attention_nodes(p, i, inner))
    return build_plan("toy", taps, max_num_batched_tokens=rows, max_num_seqs=seqs, tree=tree, dims=DIMS,
                      engine_args=engine_args or None)


def test_a_pattern_is_a_float32_capture_of_every_head_over_max_model_len_keys():
    got = plan(["model.layers.*.self_attn.pattern"], max_model_len=40)
    taps = {t.key: t for t in got.taps}
    assert sorted(taps) == [f"model.layers.{i}.self_attn.pattern" for i in range(LAYERS)]
    tap = taps["model.layers.1.self_attn.pattern"]
    assert (tap.kind, tap.action, tap.width, tap.dtype) == ("read", "capture", HEADS * 40, "float32")
    # the pool, its snapshots and its row tables, as for any capture of that width
    rows = 64
    pool = (2 * rows + small_snapshot_rows(rows, 8)) * HEADS * 40 * ITEMSIZE["float32"]
    assert pool < tap.buffer_bytes <= pool + 2 * rows * 4


def test_heads_and_keys_bound_a_row():
    tap = plan(["model.layers.0.self_attn.pattern | capture(heads=[3, 0], keys=12)"], max_model_len=4096).taps[0]
    assert tap.width == 2 * 12
    assert {a.name: a.value for a in tap.args} == {"heads": (3, 0), "keys": 12}


@pytest.mark.parametrize("taps, inner, args, error, says", [
    (["model.layers.0.self_attn.pattern"], "Attention", {}, PlanError,
     "give the engine's max_model_len, or the keys a row holds"),
    (["model.layers.0.self_attn.pattern | capture(heads=[4])"], "Attention", {"max_model_len": 8}, PlanError,
     "the model has heads 0..3; there is no head 4"),
    (["model.layers.0.self_attn.pattern | add(v)"], "Attention", {"max_model_len": 8}, ResolveError,
     "attention weights are read, not edited"),
    (["model.layers.0.mlp.pattern"], "Attention", {"max_model_len": 8}, ResolveError,
     "it has no `attn`"),
    (["model.layers.0.self_attn.pattern"], "MLAAttention", {"max_model_len": 8}, ResolveError,
     "MLA attention caches latents"),
    (["model.layers.0.self_attn.pattern", "model.layers.0.self_attn.pattern | capture(keys=4)"], "Attention",
     {"max_model_len": 8}, PlanError, "an attention's pattern is captured once"),
    (["model.layers.0.self_attn.pattern"], "Attention", {"max_model_len": 8, "tensor_parallel_size": 2}, PlanError,
     "one GPU for now"),
])
def test_a_pattern_that_cannot_be_read_is_refused_in_one_line(taps, inner, args, error, says):
    with pytest.raises(error) as e:
        plan(taps, inner, **args)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tap, says", [
    ("model.layers.0.self_attn.pattern | capture(heads=[1, 1])", "heads must be a list of distinct head numbers"),
    ("model.layers.0.self_attn.pattern | capture(keys=0)", "keys must be a whole number in 1..1048576"),
    ("model.layers.0.self_attn.pattern | capture(4)", "takes heads and keys, by name"),
    ("model.layers.0.self_attn.output | capture(keys=4)", "capture takes no arguments (but at an attention's"),
])
def test_pattern_arguments_are_checked_where_the_tap_is_written(tap, says):
    with pytest.raises(TapSyntaxError) as e:
        plan([tap], max_model_len=8)
    assert says in str(e.value)


def test_explain_says_heads_keys_and_why_the_buffer_is_large():
    got = plan(["model.layers.0.self_attn.pattern | capture(keys=16)"], max_model_len=4096)
    text = render(got, [], width=200)
    assert "pattern" in text and "capture(heads=0..3, keys=16)" in text and "4 x 16 x float32" in text


@pytest.mark.parametrize("positions, prompt, max_tokens, fits", [
    ("last", 16, 10, True), ("last", 17, 10, False), ("prompt", 16, 1, True), ("generated", 10, 7, True),
    ("generated", 10, 8, False), ([3, 15], 4, 13, True), ([3, 16], 4, 14, False),
    ("all", 16, 1, True), ("all", 16, 2, False),
])
def test_a_request_whose_positions_pass_the_keys_is_refused(positions, prompt, max_tokens, fits):
    """Keys 0..15: a row at position 16 would not fit. A request reaches position
    prompt + max_tokens - 2; a listed position past that never runs."""
    got = plan(["model.layers.0.self_attn.pattern | capture(keys=16)"])
    key = "model.layers.0.self_attn.pattern"
    why = beyond_pattern({key: 16}, (key,), positions, prompt, max_tokens)
    assert (why is None) == fits
    session = TapSession(got)
    checked = session.check(TapRequest(capture="*", positions=positions), "request 0")
    if fits:
        session.check_reach(checked, prompt, max_tokens, "request 0")
    else:
        with pytest.raises(RequestError, match=rf"request 0: {key} holds 16 keys a row \(positions 0..15\)"):
            session.check_reach(checked, prompt, max_tokens, "request 0")
