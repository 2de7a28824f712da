"""`point | lens(k)` in the language and the plan: two captures a point, refusals in one line."""
import dataclasses

import pytest
from engine_toy import HIDDEN, INTER, VOCAB, toy_plan, toy_tree

from tapc.api.requests import TapRequest, check
from tapc.errors import PlanError, TapSyntaxError
from tapc.plan.lens import VOCAB_BLOCK, candidates
from tapc.plan.planner import build_plan


def test_a_lens_is_two_captures_of_k_columns_at_its_point():
    plan = toy_plan(["model.layers.*.resid | lens(k=3)", "model.layers.0.resid"])
    got = {t.key: (t.kind, t.action, t.width, t.dtype) for t in plan.taps}
    for i in range(3):
        assert got[f"model.layers.{i}.resid:lens.ids"] == ("read", "capture", 3, "int32")
        assert got[f"model.layers.{i}.resid:lens.logits"] == ("read", "capture", 3, "float32")
    assert "model.layers.1.resid:lens.ids" in plan.capture_keys
    # a request captures them by key, or with "*"
    check(plan, TapRequest(capture=["model.layers.1.resid:lens.logits"]), "r")
    assert set(check(plan, TapRequest(capture="*"), "r").capture) == set(plan.capture_keys)


def test_the_scratch_is_counted_once_with_the_first_lens():
    rows = 64
    one = toy_plan(["model.layers.0.resid | lens(k=3)"], rows=rows)
    three = toy_plan(["model.layers.*.resid | lens(k=3)"], rows=rows)
    scratch = rows * candidates(VOCAB, 3) * 8
    per_layer = one.total_buffer_bytes - scratch
    assert candidates(VOCAB, 3) == -(-VOCAB // VOCAB_BLOCK) * 3
    assert three.total_buffer_bytes - scratch == pytest.approx(3 * per_layer, rel=0.05)


@pytest.mark.parametrize("tap, says", [
    ("model.layers.0.mlp.up_proj.output | lens", f"rows of the model's hidden width ({HIDDEN}); "
                                                  f"model.layers.0.mlp.up_proj.output is {INTER} wide"),
    (f"model.layers.0.resid | lens(k={VOCAB + 1})", f"k={VOCAB + 1} is more than the vocabulary ({VOCAB})"),
])
def test_a_lens_the_model_cannot_have_is_refused_in_one_line(tap, says):
    with pytest.raises(PlanError, match=None) as e:
        toy_plan([tap])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_model_whose_final_norm_is_not_an_rmsnorm_is_refused():
    tree = toy_tree()
    tree = dataclasses.replace(tree, nodes=tuple(dataclasses.replace(n, cls="GemmaRMSNorm") if n.path == "model.norm"
                                                 else n for n in tree.nodes))
    with pytest.raises(PlanError, match=r"final RMSNorm \(`model.norm`\).*`model.norm` is GemmaRMSNorm"):
        build_plan("toy", ["model.layers.0.resid | lens"], tree=tree)


def test_a_lens_under_tensor_parallelism_is_refused():
    with pytest.raises(PlanError, match="one GPU for now"):
        build_plan("toy", ["model.layers.0.resid | lens"], tree=toy_tree(),
                   engine_args={"tensor_parallel_size": 2})


@pytest.mark.parametrize("tap, says", [
    ("model.layers.0.resid | lens(k=0)", "k must be a whole number in 1..64, not 0"),
    ("model.layers.0.resid | lens(k=65)", "k must be a whole number in 1..64, not 65"),
    ("model.layers.0.resid | lens(top=3)", "lens() takes one argument, k"),
    ("model.layers.0.resid | lens(k=n)", "k must be a whole number in 1..64, not 'n'"),
    ("model.layers.0.resid | lense", "did you mean `lens`?"),
])
def test_lens_arguments_are_checked_where_the_tap_is_written(tap, says):
    with pytest.raises(TapSyntaxError) as e:
        toy_plan([tap])
    assert says in str(e.value)
