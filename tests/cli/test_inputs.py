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

from places import CONFIGS, ROOT

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
     "params.steer.file: {dir}/v.safetensors cannot be loaded: not a safetensors file of tensors"),
    ("params: {steer: {file: v.pt, key: v}}", {"v.pt": b"not a pickle at all"},
     "params.steer.file: {dir}/v.pt cannot be loaded: not a torch.save file of tensors"),
    ("params: {alpha: hello}", {}, "params.alpha must be a number, a list of numbers or {file, key}, not 'hello'"),
    ("params: {alpha: " + "9" * 400 + "}", {}, "parameter 'alpha' (scalar) must be a finite number"),
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
    words = words.replace("{dir}", str(tmp_path))
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


# ----------------------------------------------------------------------------- flags

def test_parallel_flags_apply_to_a_spec_and_a_size_the_model_cannot_run_is_refused(capsys, tmp_path):
    path = spec(tmp_path, "engine: {tensor_parallel_size: 2}\ntaps: [model.layers.1.resid]\n")
    rc, out, err = explain(capsys, path, "--json")
    assert rc == 0 and TapPlan.from_json(out).tensor_parallel_size == 2, err
    rc, out, err = explain(capsys, path, "--json", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2")
    plan = TapPlan.from_json(out)
    assert rc == 0 and (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 2), err
    for target in (path, LLAMA):   # 8 heads do not split 3 ways
        rc, out, err = explain(capsys, target, *([] if target == path else ["model.layers.1.resid"]),
                               "--tensor-parallel-size", "3")
        assert rc == 2 and out == "" and "tensor_parallel_size=3 does not divide the 8 attention heads" in err, err


BAD_FLAGS = [
    (["--tensor-parallel-size", "0"], "tapc: TapcError: tapc explain: --tensor-parallel-size must be >= 1, not 0"),
    (["--pipeline-parallel-size", "-2"], "tapc: TapcError: tapc explain: --pipeline-parallel-size must be >= 1, not -2"),
    (["--max-num-batched-tokens", "99999999999999999999"],
     "tapc: TapcError: tapc explain: --max-num-batched-tokens must be <= 16777216, not 99999999999999999999"),
    (["--max-num-seqs", "0"], "tapc: TapcError: tapc explain: --max-num-seqs must be >= 1, not 0"),
]


@pytest.mark.parametrize("flags,line", BAD_FLAGS, ids=[f[0] for f, _ in BAD_FLAGS])
def test_flags_out_of_bounds_are_refused_in_one_line(capsys, tmp_path, flags, line):
    for target in ([LLAMA, "model.layers.1.resid"], [spec(tmp_path, "taps: [model.layers.1.resid]\n")]):
        rc, out, err = explain(capsys, *target, *flags)
        assert rc == 2 and out == "" and err == line + "\n", err


def test_size_flags_that_a_list_of_tap_points_ignores_are_refused(capsys):
    rc, out, err = explain(capsys, LLAMA, "--max-num-seqs", "4")
    assert rc == 2 and out == "" and "lists the model's tap points, which no engine size changes; --max-num-seqs " \
        "size a plan: give taps too" in err, err


def test_build_plan_takes_sizes_that_are_integers_in_bounds_and_taps_from_any_iterable():
    from tapc.errors import PlanError
    from tapc.plan.planner import build_plan

    with pytest.raises(PlanError, match="^max_num_batched_tokens must be an integer, not nan$"):
        build_plan(LLAMA, ["model.layers.1.resid"], max_num_batched_tokens=float("nan"))
    with pytest.raises(PlanError, match="^tensor_parallel_size must be an integer, not 2.5$"):
        build_plan(LLAMA, ["model.layers.1.resid"], engine_args={"tensor_parallel_size": 2.5})
    with pytest.raises(PlanError, match="^taps: give tap strings .* not int$"):
        build_plan(LLAMA, 3)
    plan = build_plan(LLAMA, (f"model.layers.{i}.resid" for i in range(2)))
    assert [t.key for t in plan.taps] == ["model.layers.0.resid", "model.layers.1.resid"]


# ----------------------------------------------------------------------------- paths and models

LONG = "x" * 300   # a name over the 255 bytes a file system takes


def test_paths_over_255_bytes_are_one_line(capsys, tmp_path):
    (tmp_path / "s.yaml").write_text(f"model: {LONG}\ntaps: [model.layers.1.resid]\n")
    cases = [([tmp_path / LONG, "model.layers.1.resid"], "ResolveError: model "),
             ([tmp_path / (LONG + ".yaml")], "SpecError: spec file "),
             ([tmp_path / "s.yaml"], f"SpecError: {tmp_path / 's.yaml'}: model ")]
    for args, words in cases:
        rc, out, err = explain(capsys, *args)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
        assert words in err and err.rstrip().endswith(" bytes): File name too long") and len(err) < 300, err


def test_a_model_given_empty_or_as_its_config_file_is_said_so(capsys, tmp_path):
    rc, _, err = explain(capsys, "", "model.layers.1.resid")
    assert rc == 2 and "ResolveError: the model is empty: give a directory with config.json, or a hub id" in err, err
    rc, _, err = explain(capsys, "~no-such-user/model", "model.layers.1.resid")   # found by the spec fuzzer
    assert rc == 2 and "~no-such-user/model: its `~` names no home directory on this machine" in err, err
    rc, _, err = explain(capsys, CONFIGS / "llama" / "config.json", "model.layers.1.resid")
    assert rc == 2 and "config.json: a file, not a model directory; give the folder that holds it" in err, err
    (tmp_path / "s.yaml").write_text("model: ''\ntaps: [model.layers.1.resid]\n")
    rc, _, err = explain(capsys, tmp_path / "s.yaml")
    assert rc == 2 and "s.yaml: model must be a non-empty string, not ''" in err, err


def test_damaged_cache_files_are_named_and_built_again(tmp_path, monkeypatch, capsys):
    """A tree or vLLM's names cut short in the cache (a full disk, a killed write): the next run
    says which file and builds it again, and the runs after it read the new one."""
    import tapc.installed
    from tapc.plan.planner import build_plan
    from tapc.plan.tree import load_tree

    plain = json.loads(load_tree(LLAMA).to_json())   # in the session's cache
    cache = tapc.installed.cache_dir()
    names = next(cache.glob("vllm-names-*.json"))
    # the plain tree's file: the session may also hold LLAMA's trees for other engine arguments (LoRA)
    tree = next(p for p in cache.glob("*.json") if json.loads(p.read_text()) == plain)
    monkeypatch.setattr(tapc.installed.settings, "TAPC_CACHE", tmp_path)
    (tmp_path / "trees").mkdir()
    for good in (names, tree):
        (tmp_path / "trees" / good.name).write_text(good.read_text()[:100])
    capsys.readouterr()
    assert build_plan(LLAMA, ["model.layers.1.resid"]).taps[0].key == "model.layers.1.resid"
    err = capsys.readouterr().err
    assert f"the cached vLLM names {tmp_path / 'trees' / names.name} are damaged; reading them again" in err, err
    assert f"the cached module tree {tmp_path / 'trees' / tree.name} is damaged (JSONDecodeError); building it " \
        "again" in err, err
    for good in (names, tree):
        assert json.loads((tmp_path / "trees" / good.name).read_text()) == json.loads(good.read_text())


# ----------------------------------------------------------------------------- model configs

def test_a_config_without_architectures_is_refused(capsys, tmp_path):
    cfg = json.loads((CONFIGS / "llama" / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = explain(capsys, tmp_path, "model.layers.1.resid")
    assert rc == 2 and f"{tmp_path / 'config.json'}: field `architectures` is missing" in err, err


# ----------------------------------------------------------------------------- discoverability

def test_explain_a_model_without_taps_lists_its_tap_points(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")   # a wide terminal: each row on one line
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


def test_explain_notes_what_a_glob_skipped_and_what_output_means(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    rc, out, err = explain(capsys, LLAMA, "model.layers.0.self_attn.*.output", "model.layers[2:4].output")
    assert rc == 0, err
    assert "note: `model.layers.0.self_attn.*.output` skips 1 match(es) its point does not apply to: " \
           "`model.layers.0.self_attn.rotary_emb`" in out
    assert "note: `model.layers[2:4].output`: a decoder layer returns (hidden_states, residual), so its " \
           "`.output` is both tensors, captured as `.output[0]` and `.output[1]`" in out
    for key in ["model.layers.2.output[0]", "model.layers.2.output[1]", "model.layers.3.output[1]"]:
        assert key in out


TABLE_TAPS = ["model.layers[0:2].self_attn.source.qkv_split_0.output[0]",
              "model.layers.3.mlp.act_fn.output | zero([1, 2], at=generated)"]


@pytest.mark.parametrize("width", [50, 80, 100, 120, 160])
def test_the_table_fits_the_width_and_says_what_it_leaves_out(width):
    """Each table line ends in the table's right edge (nothing cut off); columns left out to fit
    are named under the table; a point's name stays whole where the width has room for it."""
    from tapc.plan.explain import render, taps_table
    from tapc.plan.planner import build_plan

    plan = build_plan(LLAMA, TABLE_TAPS)
    text = render(plan, width=width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width
    table = [line for line in lines if line and line[0] in "┏┃┡│└"]
    assert table and all(line.rstrip()[-1] in "┓┃┩│┘" for line in table), text
    _, dropped = taps_table(plan, width)
    said = " ".join(text.split())
    assert (f"(left out to fit {width} columns: {', '.join(dropped)}; a wider terminal or --json shows them)" in said) \
        == bool(dropped)
    if width in (50, 160):   # too narrow for every column; wide enough
        assert bool(dropped) == (width == 50)
    if width >= 100:
        for tap in plan.taps:
            assert any(tap.key in line for line in table), f"{tap.key} broken at width {width}"


def test_explain_into_a_pipe_is_120_wide_or_as_columns_says(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for columns, width in ((None, 120), ("90", 90)):
        proc = subprocess.run([sys.executable, "-m", "tapc.cli", "explain", LLAMA, *TABLE_TAPS], capture_output=True,
                              text=True, cwd=ROOT, env={**env, **({"COLUMNS": columns} if columns else {})})
        assert proc.returncode == 0, proc.stderr
        assert max(map(len, proc.stdout.splitlines())) == width


def test_json_into_a_pipe_its_reader_closed_ends_quietly():
    """`tapc explain ... --json | head -1`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "tapc.cli", "explain", LLAMA, "model.layers.*.resid", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()   # before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == "", err


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
    # a prompts file that is there (it is not read); one that is not is said first, on any machine
    rc = main(["harvest", str(ROOT / "examples" / "harvest.yaml"), str(ROOT / "examples" / "prompts.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == ("tapc: EngineError: the engine needs a CUDA GPU, and torch sees none here; "
                                    "`tapc explain` shows the plan on any machine")
    assert main(["harvest", str(ROOT / "examples" / "harvest.yaml"), str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err == f"tapc: TapcError: {tmp_path / 'none.jsonl'}: no such prompts file\n"


@no_gpu
def test_serve_without_a_gpu_says_so_in_one_line_and_exits_2(capsys):
    for argv in ([str(ROOT / "examples" / "steer.yaml")], [LLAMA, "--tap", "model.layers.1.resid"]):
        rc = main(["serve", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err == ("tapc: EngineError: the engine needs a CUDA GPU, and torch sees none here; "
                                   "`tapc explain` shows the plan on any machine\n"), err
    assert main(["serve", LLAMA, "--tap", "model.layers.1.resid", "--print"]) == 0, "--print starts nothing"
    assert capsys.readouterr().out.startswith("vllm serve ")


@no_gpu
def test_vllm_without_a_gpu_refuses_before_starting_anything():
    from tapc import VLLM
    from tapc.errors import EngineError

    # before anything else: the model, which does not exist, is not even looked at
    with pytest.raises(EngineError, match="the engine needs a CUDA GPU"):
        VLLM("/nonexistent/model", taps=["model.layers.1.resid"])


def test_an_engine_under_tritons_interpreter_on_a_gpu_is_refused_naming_the_variable(monkeypatch, capsys):
    from tapc import VLLM
    from tapc.errors import EngineError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    line = ("TRITON_INTERPRET='1' switches on Triton's interpreter, under which vLLM's compiled graphs cannot "
            "run on a GPU: unset it to start an engine")
    with pytest.raises(EngineError) as e:
        VLLM("/nonexistent/model", taps=["model.layers.1.resid"])
    assert str(e.value) == line
    assert main(["serve", LLAMA, "--tap", "model.layers.1.resid"]) == 2
    assert capsys.readouterr().err == f"tapc: EngineError: {line}\n"
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # switched off: the engine goes on to the model
    with pytest.raises(Exception) as e:
        VLLM("/nonexistent/model", taps=["model.layers.1.resid"])
    assert "TRITON_INTERPRET" not in str(e.value) and "/nonexistent/model" in str(e.value)
