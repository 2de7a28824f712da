"""Every input answered (issue 10): `tapc` on bad or unusual input exits 2 with one clear message
naming what is wrong and where, never a traceback; `tapc explain` checks what the engine checks."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tapc.cli import main
from tapc.plan.tapplan import TapPlan

from conftest import CONFIGS

ROOT = Path(__file__).parent.parent
LLAMA = str(CONFIGS / "llama")


def explain(capsys, *args):
    rc = main(["explain", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- taps on the command line

BAD_TAPS = [
    ("model." + "a." * 600 + "output", "a point of 602 parts; a point has at most 64"),
    ("model.layers.0.output | add(" + "[" * 600 + "1" + "]" * 600 + ")", "brackets nested more than 8 deep"),
    ("model.layers.0.output[" + "9" * 5000 + "]", "a tap of 5023 characters; taps are at most 2000"),
    ("model.layers.0.output[" + "9" * 300 + "]", "a number of 300 digits; numbers have at most 18"),
    ("model.layers.0.resid | scale(1e999)", "'1e999' is not a finite number"),
    ("model.layers.*.outptu", "did you mean `model.layers.*.output`?"),
    ("model.layers.0.input_layernorm.output[1]", "its output is one tensor; drop `[1]` (vLLM calls it without a residual in layer 0"),
    ("model.layers.1.output | add(v)", "edit `.resid` (their sum, the residual stream) or one of them, `.output[0]` or `.output[1]`"),
]


@pytest.mark.parametrize("tap,words", BAD_TAPS, ids=[t[:40] for t, _ in BAD_TAPS])
def test_bad_taps_exit_2_with_one_message(capsys, tap, words):
    rc, out, err = explain(capsys, LLAMA, tap)
    assert rc == 2 and out == ""
    assert words in err and "Traceback" not in err and len(err) < 1500, err


def test_a_tap_given_twice_is_a_plan_error(capsys):
    rc, _, err = explain(capsys, LLAMA, "model.layers.1.resid", "model.layers.1.resid")
    assert rc == 2 and err.startswith("tapc: PlanError: the same tap twice (entries 1 and 2)"), err


# ----------------------------------------------------------------------------- specs

def spec(tmp_path, body: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"model: {CONFIGS / 'llama'}\n" + textwrap.dedent(body))
    return path


STEER = "taps: ['model.layers.2.resid | add(steer, alpha=alpha)']\n"
BAD_PARAMS = [  # (params section, files to write, the words of the message)
    ("params: {steer: [0.5, 1.5, 2.5], alpha: 4.0}", {}, "parameter 'steer' (vector) must be 256 numbers, got shape (3,)"),
    ("params: {alpah: 4.0}", {}, "parameter 'alpah' is not named by any tap of this engine's plan (its parameters: steer, alpha)"),
    ("params: {alpha: .inf}", {}, "parameter 'alpha' (scalar) must be a finite number"),
    ("params: {steer: {file: v.safetensors, key: v}}", {"v.safetensors": (100,)}, "must be 256 numbers, got shape (100,)"),
    ("params: {steer: {file: v.safetensors, key: v}}", {"v.safetensors": (3, 256)}, "must be 256 numbers, got shape (3, 256)"),
    ("params: {steer: {file: v.pt, key: v}}", {"v.pt": (255,)}, "must be 256 numbers, got shape (255,)"),
    ("params: {steer: {file: v.safetensors, key: v}}", {"v.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{\"v\": junk"},
     "params.steer.file: v.safetensors is not a readable .safetensors tensor file"),
    ("params: {steer: {file: v.pt, key: v}}", {"v.pt": b"not a pickle at all"}, "params.steer.file: v.pt is not a readable .pt tensor file"),
]


@pytest.mark.parametrize("params,files,words", BAD_PARAMS, ids=[w[:40] for _, _, w in BAD_PARAMS])
def test_explain_checks_parameter_values_as_the_engine_does(capsys, tmp_path, params, files, words):
    for name, content in files.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif name.endswith(".pt"):
            torch.save({"v": torch.randn(*content)}, tmp_path / name)
        else:
            save_file({"v": torch.randn(*content)}, str(tmp_path / name))
    path = spec(tmp_path, STEER + params + "\n")
    rc, out, err = explain(capsys, path)
    assert rc == 2 and out == "" and words in err and str(path) in err and "Traceback" not in err, err


def test_good_parameter_values_pass(capsys, tmp_path):
    save_file({"v": torch.randn(256)}, str(tmp_path / "v.safetensors"))
    rc, out, err = explain(capsys, spec(tmp_path, STEER + "params: {steer: {file: v.safetensors, key: v}, alpha: 2}\n"))
    assert rc == 0, err
    assert "parameters: steer (vector of 256), alpha (scalar)" in out
    # engine-wide values may bind part of a tap's parameters: the rest come with each request
    rc, _, err = explain(capsys, spec(tmp_path, STEER + "params: {alpha: 2}\n"))
    assert rc == 0, err


BAD_SPECS = [
    ("a: " + "[" * 5000 + "]" * 5000, "YAML nested too deep"),
    ("taps: [x.output]\n# " + "x" * (1 << 20), "bytes; a spec is at most 1048576"),
]


@pytest.mark.parametrize("body,words", BAD_SPECS, ids=[w for _, w in BAD_SPECS])
def test_bad_spec_files_exit_2(capsys, tmp_path, body, words):
    rc, _, err = explain(capsys, spec(tmp_path, body))
    assert rc == 2 and words in err and "Traceback" not in err, err


def test_a_spec_suffix_in_capitals_is_a_spec(capsys, tmp_path):
    path = spec(tmp_path, "taps: [model.layers.1.resid]\n", name="steer.YAML")
    rc, out, err = explain(capsys, path, "--json")
    assert rc == 0, err
    assert [t.key for t in TapPlan.from_json(out).taps] == ["model.layers.1.resid"]


def test_size_flags_apply_to_a_spec(capsys, tmp_path):
    path = spec(tmp_path, "engine: {max_num_batched_tokens: 2048, max_num_seqs: 32}\ntaps: [model.layers.1.resid]\n")
    rc, out, _ = explain(capsys, path, "--json", "--max-num-batched-tokens", "100")
    plan = TapPlan.from_json(out)
    assert rc == 0 and (plan.max_num_batched_tokens, plan.max_num_seqs) == (100, 32)
    from tapc.plan.sizing import tap_bytes

    assert plan.taps[0].buffer_bytes == tap_bytes(plan.taps, 100, 32)[0], "buffers sized for the flag's rows"
    assert tap_bytes(plan.taps, 100, 32) != tap_bytes(plan.taps, 2048, 32)
    rc, out, _ = explain(capsys, path, "--json")
    assert TapPlan.from_json(out).max_num_batched_tokens == 2048


# ----------------------------------------------------------------------------- model configs

def test_a_config_without_architectures_is_refused(capsys, tmp_path):
    cfg = json.loads((CONFIGS / "llama" / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = explain(capsys, tmp_path, "model.layers.1.resid")
    assert rc == 2 and f"{tmp_path / 'config.json'}: field `architectures` is missing" in err, err


# ----------------------------------------------------------------------------- discoverability

def test_explain_a_model_without_taps_lists_its_tap_points(capsys):
    rc, out, err = explain(capsys, LLAMA)
    assert rc == 0, err
    lines = out.splitlines()
    for words in ["tap points of", "(LlamaForCausalLM: 4 layers under `model.layers`, hidden 256, bfloat16)",
                  "model.layers.*.self_attn.qkv_proj", "QKVParallelLinear", "512",
                  "layer 0: `.output`; layers 1..3: `.output[0]` normed, `.output[1]` residual",
                  "`.resid`, `.output[0]` hidden, `.output[1]` residual",
                  "LlamaAttention (at `model.layers.*.self_attn`): self_qkv_proj_0 -> 512, qkv_split_0 -> 256 + 128 + 128",
                  "LlamaDecoderLayer (at `model.layers[1:4]`): self_input_layernorm_1 -> 256 + 256"]:
        assert words in out, words
    assert any(line.startswith("│ logits ") and "1024" in line for line in lines)


def test_explain_notes_what_a_glob_skipped_and_what_output_means(capsys):
    rc, out, err = explain(capsys, LLAMA, "model.layers.0.self_attn.*.output", "model.layers[2:4].output")
    assert rc == 0, err
    assert "note: `model.layers.0.self_attn.*.output` skips 1 match(es) its point does not apply to: " \
           "`model.layers.0.self_attn.rotary_emb`" in out
    assert "note: `model.layers[2:4].output`: a decoder layer returns (hidden_states, residual), so its " \
           "`.output` is both tensors, captured as `.output[0]` and `.output[1]`" in out
    for key in ["model.layers.2.output[0]", "model.layers.2.output[1]", "model.layers.3.output[1]"]:
        assert key in out


def test_the_table_fits_the_width_without_breaking_names():
    from tapc.plan.explain import render
    from tapc.plan.planner import build_plan

    plan = build_plan(LLAMA, ["model.layers[0:2].self_attn.source.qkv_split_0.output[0]",
                              "model.layers.3.mlp.act_fn.output | zero([1, 2], at=generated)"])
    for width in (100, 140):
        text = render(plan, width=width)
        assert max(map(len, text.splitlines())) <= width
        for tap in plan.taps:
            assert tap.key in text, f"{tap.key} broken at width {width}"
    wide = render(plan)  # not a terminal: as wide as the content, one row per tap
    assert sum(tap.key in line for tap in plan.taps for line in wide.splitlines()) == len(plan.taps)


def test_help_links_the_docs(capsys):
    for argv in (["--help"], ["explain", "--help"], ["harvest", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "docs/dsl.md" in out and "docs/spec.md" in out, argv


# ----------------------------------------------------------------------------- speed

def test_a_warm_explain_of_a_spec_imports_neither_vllm_nor_torch():
    """Checking `engine:` keys reads vLLM's EngineArgs field names from the cache: after one run,
    `tapc explain SPEC` stays off vLLM and torch (seconds of imports)."""
    code = ("import sys; from tapc.cli import main; rc = main(['explain', 'examples/steer.yaml']); "
            "print(rc, 'vllm' in sys.modules, 'torch' in sys.modules)")
    env = dict(os.environ)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stderr
    start = time.monotonic()
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    took = time.monotonic() - start
    assert warm.stdout.splitlines()[-1] == "0 False False", warm.stdout + warm.stderr
    assert warm.stderr == "", "a warm run has nothing to say on stderr"
    assert took < 10, f"a warm explain took {took:.1f} s"


def test_a_cold_explain_says_what_it_is_doing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(CONFIGS / "llama" / "config.json", model)
    env = {**os.environ, "TAPC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tapc.cli", "explain", str(model), "model.layers.1.resid", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"tapc: building vLLM's module tree for {model} on the meta device" in proc.stderr
    assert TapPlan.from_json(proc.stdout).taps[0].key == "model.layers.1.resid"


# ----------------------------------------------------------------------------- no GPU

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA GPU")


@no_gpu
def test_harvest_without_a_gpu_says_so_in_one_line_and_exits_2(capsys, tmp_path):
    # the prompts, which do not exist, are never read
    rc = main(["harvest", str(ROOT / "examples" / "harvest.yaml"), str(tmp_path / "none.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == ("tapc: EngineError: the engine needs a CUDA GPU, and torch sees none here; "
                                    "`tapc explain` shows the plan on any machine")


@no_gpu
def test_vllm_without_a_gpu_refuses_before_starting_anything():
    from tapc import VLLM
    from tapc.errors import EngineError

    # before anything else: the model, which does not exist, is not even looked at
    with pytest.raises(EngineError, match="the engine needs a CUDA GPU"):
        VLLM("/nonexistent/model", taps=["model.layers.1.resid"])
