"""Parse + plan for an 80-layer model (Llama-3-70B shape): `pytest benchmarks/bench_plan.py`.

The module tree is built once (on meta, in a child process, then cached); what is timed is
what every engine start and `tapc explain` pays after that: parsing the taps and planning
them against the tree, globs over all 80 layers included.
"""
from pathlib import Path

import pytest

from tapc.plan.planner import build_plan
from tapc.plan.tree import load_tree

MODEL = str(Path(__file__).parent / "configs" / "llama-3-70b")
TAPS = [
    "model.layers.*.resid",
    "model.layers[0:80:8].mlp.act_fn.output",
    "model.layers.*.self_attn.source.qkv_split_0.output[0]",
    "model.layers[40,60].resid | add(steer, alpha=alpha, at=generated)",
    "model.layers.70.mlp.output -> probe",
    "logits",
]


@pytest.fixture(scope="module")
def tree():
    return load_tree(MODEL)


def test_parse_and_plan_80_layers(benchmark, tree):
    plan = benchmark(build_plan, MODEL, TAPS, tree=tree, max_num_batched_tokens=8192, max_num_seqs=256)
    assert plan.num_layers == 80 and len(plan.taps) == 80 + 10 + 80 + 2 + 1 + 1
    assert plan.splitting_ops == ("tapc::boundary",) and plan.pieces_after == 82
