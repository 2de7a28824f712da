"""`tapc explain`: the plan for people and for machines, and its exit codes."""
import json
import subprocess
import sys

from tapc.cli import main
from tapc.plan.tapplan import TapPlan

from places import CONFIGS, ROOT

LLAMA = str(CONFIGS / "llama")


def test_explain_table_graph_and_totals(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")   # a wide terminal: each row and line whole
    rc = main(["explain", LLAMA, "model.layers.*.resid", "model.layers.2.mlp.output -> probe",
               "model.layers[1:3].resid | add(steer, alpha=4, at=generated)", "--max-num-batched-tokens", "1024"])
    out = capsys.readouterr().out
    assert rc == 0
    for words in ["model.layers.0.resid", "read", "256 x bfloat16", "1.1 MiB",  # pool + snapshots: (2 x 1024 + 256) rows x 256 x 2 bytes, + 4 KiB row table
                  "add(vector=$steer, alpha=4, at=generated)", "block -> probe",
                  "graph: 5 compiled pieces without the plan, 6 with it",
                  "splitting ops added: tapc::boundary", "a FULL graph replays as 2 segments around them", "✂ boundary block model.layers.2.mlp.output -> probe",
                  "tap kernels in the graphs: 4 captures, 2 edits; each runs at every step (graphs broken by "
                  "blocks are not switched)",
                  "taps: 7 (4 read, 1 block, 2 edit)", "parameters: steer (vector of 256)",
                  # four residual rows of 256 bfloat16 a token; the block's point is not kept there
                  "captures in host memory: up to 2.0 KiB a token on the GPU"]:
        assert words in out, words
    lines = out.splitlines()
    # the block is drawn inside the piece after layer 2's attention
    assert lines.index("  [piece 3] layer 2 after attention .. layer 3 attention") + 1 == \
        lines.index("     ✂ boundary block model.layers.2.mlp.output -> probe")


def test_explain_json_is_the_plan(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["explain", LLAMA, "model.layers[0:2].resid"]) == 0
    assert "tap kernels in the graphs: 2 captures, 0 edits; a step whose requests ask for none of them replays " \
        "its graph without them" in capsys.readouterr().out
    assert main(["explain", LLAMA, "model.layers[0:2].resid", "--json"]) == 0
    plan = TapPlan.from_json(capsys.readouterr().out)
    assert [t.key for t in plan.taps] == ["model.layers.0.resid", "model.layers.1.resid"]
    assert plan.splitting_ops == () and plan.pieces_after == plan.pieces_before


def test_explain_errors_exit_2(capsys):
    assert main(["explain", LLAMA, "model.layer.1.resid"]) == 2
    err = capsys.readouterr().err
    assert "ResolveError" in err and "did you mean `model.layers`" in err
    assert main(["explain", LLAMA, "model.layers.1.resid |"]) == 2
    assert "TapSyntaxError" in capsys.readouterr().err


def test_explain_shipped_example_spec_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "tapc.cli", "explain", str(ROOT / "examples" / "steer.yaml"), "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["architecture"] == "LlamaForCausalLM" and plan["max_num_batched_tokens"] == 2048
    assert [t["kind"] for t in plan["taps"]] == ["read"] * 5 + ["edit", "engine"]
    bad = subprocess.run([sys.executable, "-m", "tapc.cli", "explain", str(ROOT / "examples" / "missing.yaml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "no such spec file" in bad.stderr


def test_explain_a_harvest_spec_says_where_its_shards_go(capsys):
    assert main(["explain", str(ROOT / "examples" / "harvest.yaml")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.2.resid" in out
    assert "the captures at prompt positions go to " + str(ROOT / "examples" / "acts") + ", 100000 rows per shard" in out
