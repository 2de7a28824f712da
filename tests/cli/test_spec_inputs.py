"""Every input answered (issue 63): what a new user on a CPU gives `tapc` (a spec's values, keys
given twice, files that are not what they claim, shard numbers, harvest flags) ends in one line
naming what is wrong and where, or in the right result."""
import sys
import textwrap

import pytest

from tapc.cli import main
from tapc.errors import TapcError

from places import CONFIGS, ROOT

LLAMA = str(CONFIGS / "llama")


def explain(capsys, *args):
    rc = main(["explain", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def spec(tmp_path, body: str, model: str = LLAMA):
    path = tmp_path / "spec.yaml"
    path.write_text(f"model: {model}\n" + textwrap.dedent(body))
    return path


def refused(capsys, path, line: str):
    rc, out, err = explain(capsys, path)
    # before it, a cold cache's progress line ("tapc: reading vLLM's engine arguments ...")
    assert (rc, out, err.splitlines()[-1]) == (2, "", f"tapc: {line}") and "Traceback" not in err, err


TAP = "taps: [model.layers.1.resid]\n"
ENGINE_VALUES = [   # vLLM's EngineArgs field types, on any machine
    ("{gpu_memory_utilization: lots}", "engine.gpu_memory_utilization must be a number, not 'lots'"),
    ("{enforce_eager: 7}", "engine.enforce_eager must be true or false, not 7"),
    ("{max_model_len: 4k}", "engine.max_model_len must be an integer, not '4k'"),
    ("{tokenizer: [a]}", "engine.tokenizer must be null or a string, not ['a']"),
    ("{dtype: bf16}", "engine.dtype must be one of 'auto', 'half', 'float16', 'bfloat16', 'float', 'float32', not 'bf16'"),
]


@pytest.mark.parametrize("engine,words", ENGINE_VALUES, ids=[e for e, _ in ENGINE_VALUES])
def test_engine_values_of_the_wrong_type_are_refused(capsys, tmp_path, engine, words):
    path = spec(tmp_path, f"engine: {engine}\n" + TAP)
    refused(capsys, path, f"SpecError: {path}: {words}")


def test_engine_values_of_the_right_type_pass(capsys, tmp_path):
    # an integer where vLLM takes a float; null where it takes None; a config vLLM converts itself
    engine = "{gpu_memory_utilization: 1, enforce_eager: true, kv_cache_memory_bytes: null, dtype: bfloat16, " \
             "compilation_config: {mode: 0}}"
    rc, _, err = explain(capsys, spec(tmp_path, f"engine: {engine}\n" + TAP))
    assert rc == 0, err


def test_a_block_of_a_module_that_is_not_there_names_the_module_and_the_key(capsys, tmp_path):
    path = spec(tmp_path, "taps: ['model.layers.1.resid -> probe']\nblocks: {probe: no_such_module:record}\n")
    refused(capsys, path, f"TapcError: {path}: blocks: block 'probe' (no_such_module:record): cannot import "
                          "'no_such_module': No module named 'no_such_module'")


def test_a_tap_whose_block_blocks_does_not_name_is_refused(capsys, tmp_path):
    path = spec(tmp_path, "taps: [model.layers.0.resid, 'model.layers.1.resid -> probe']\n")
    refused(capsys, path, f"SpecError: {path}: taps[1] `model.layers.1.resid -> probe` runs block `probe`, which "
                          "`blocks:` does not name (give it as probe: 'package.module:function')")


@pytest.mark.parametrize("body,words", [
    (TAP + "taps: [model.layers.2.resid]\n", "key `taps` given twice (lines 2 and 3)"),
    ("engine:\n  max_num_seqs: 4\n  max_num_seqs: 8\n" + TAP, "key `engine.max_num_seqs` given twice (lines 3 and 4)"),
], ids=["taps", "engine.max_num_seqs"])
def test_a_key_given_twice_is_refused_with_both_lines(capsys, tmp_path, body, words):
    path = spec(tmp_path, body)
    refused(capsys, path, f"SpecError: {path}: {words}")


def test_a_key_that_is_not_a_string_is_said_plainly(capsys, tmp_path):
    path = spec(tmp_path, TAP + "1: x\n")
    refused(capsys, path, f"SpecError: {path}: the key 1 is not a string; keys are names")
    path = spec(tmp_path, TAP + "engine: {2: 3}\n")
    refused(capsys, path, f"SpecError: {path}: engine: the key 2 is not a string; keys are names")


def test_a_misspelt_required_key_is_named_before_its_absence(capsys, tmp_path):
    path = spec(tmp_path, "tapz: [model.layers.1.resid]\n")
    refused(capsys, path, f"SpecError: {path}: unknown key `tapz`; did you mean `taps`?")


def test_a_parameter_file_that_is_not_a_torch_file_is_said_plainly(capsys, tmp_path):
    import pickle

    (tmp_path / "v.pt").write_bytes(pickle.dumps({"v": object}))   # a pickle torch's safe loader refuses
    path = spec(tmp_path, "taps: ['model.layers.2.resid | add(steer)']\nparams: {steer: {file: v.pt, key: v}}\n")
    refused(capsys, path, f"SpecError: {path}: params.steer.file: {tmp_path / 'v.pt'} cannot be loaded: not a "
                          "torch.save file of tensors")


def test_model_errors_name_the_spec_file(capsys, tmp_path):
    path = spec(tmp_path, TAP, model=".")
    refused(capsys, path, f"SpecError: {path}: model: {tmp_path}: a directory without config.json")
    path = spec(tmp_path, TAP, model="x" * 300)
    rc, _, err = explain(capsys, path)
    assert rc == 2 and err.startswith(f"tapc: SpecError: {path}: model ") and err.endswith("File name too long\n"), err


# ----------------------------------------------------------------------------- shards, harvests

def test_a_shard_number_out_of_range_is_refused_naming_the_count(tmp_path):
    from toy_harvests import harvested

    from tapc.data import Shards

    m, _, _ = harvested(tmp_path)
    shards = Shards(tmp_path / "acts")
    count = len(m.shards)
    assert count > 1 and shards.load("request", count - 1).numel()
    for bad in (-1, count, 999):
        with pytest.raises(TapcError, match=rf"^shard {bad}: {tmp_path / 'acts'} has {count} shard\(s\), "
                                            rf"numbered 0 to {count - 1}$"):
            shards.load("request", bad)


def test_harvest_on_no_gpus_is_refused(capsys):
    rc = main(["harvest", str(ROOT / "examples" / "harvest.yaml"), str(ROOT / "examples" / "prompts.jsonl"),
               "--gpus", "0"])
    assert (rc, capsys.readouterr().err) == \
        (2, "tapc: TapcError: tapc harvest: --gpus 0: give 1 or more (this host's GPUs the harvest uses)\n")


# ----------------------------------------------------------------------------- tapc explain's text

def test_a_stars_skip_note_is_said_once(capsys, caplog):
    rc, out, err = explain(capsys, LLAMA, "model.*.output")
    assert rc == 0 and out.count("skips 1 match(es)") == 1, out
    assert not caplog.records, "the note under the table says it: no warning too"
    rc, out, err = explain(capsys, LLAMA, "model.*.output", "--json")   # no notes there: the warning says it
    assert rc == 0 and [r.getMessage().count("skips 1 match(es)") for r in caplog.records] == [1]


@pytest.mark.parametrize("width", [60, 80, 100, 400])
def test_the_tap_points_keep_every_path_whole(width):
    from tapc.plan.explain import render_points
    from tapc.plan.tree import load_tree

    tree = load_tree(LLAMA)
    text = render_points(tree, width=width)
    assert max(map(len, text.splitlines())) <= width
    words = set(text.split())
    for node in tree.nodes:
        path = node.path if node.layer is None else node.path.replace(f".{node.layer}", ".*", 1)
        assert path in words, f"{path} broken at width {width}"


def test_a_compiled_functions_call_is_its_own_kind_in_table_and_footer(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_functions.py").write_text(textwrap.dedent('''\
        import tapc

        @tapc.function(results={"score": 1})
        def probe(x, batch):
            return {"score": x[:, :1]}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COLUMNS", "300")
    rc, out, err = explain(capsys, LLAMA, "model.layers.1.resid | call(probe)", "--function", "probe=my_functions:probe")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("│ model.layers.1.resid "))
    assert row.split("│")[2].strip() == "call"
    assert "taps: 2 (1 call, 1 read)" in out and "compiled functions in the graphs: 1 call" in out
    assert "tap kernels in the graphs: 1 capture, 0 edits" in out
    sys.modules.pop("my_functions", None)
