"""YAML tap specs: full validation with messages that name the key."""
import dataclasses
import re
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tapc.errors import RequestError, SpecError, TapcError, TapSyntaxError
from tapc.api.specs import spec_plan
from tapc.lang.specfile import TensorFile, load_spec, load_tensor, spec_from_dict

from places import CONFIGS


def write(tmp_path, text: str):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_full_spec(tmp_path):
    vec = torch.randn(256)
    save_file({"layer2": vec}, str(tmp_path / "vectors.safetensors"))
    torch.save({"dir": torch.randn(256)}, tmp_path / "dirs.pt")
    spec = load_spec(write(tmp_path, f"""
        model: {CONFIGS / 'llama'}
        engine: {{max_num_batched_tokens: 1024, max_num_seqs: 8}}
        taps:
          - model.layers.*.resid
          - model.layers.2.resid | add(steer, alpha=alpha)
        params:
          steer: {{file: vectors.safetensors, key: layer2}}
          refusal: {{file: dirs.pt, key: dir}}
          alpha: 4
          cols: [1, 2]
        capture: {{positions: generated, dtype: float32}}
        output: {{dir: acts, shard_tokens: 5000}}
    """))
    assert [t.text for t in spec.taps] == ["model.layers.*.resid", "model.layers.2.resid | add(steer, alpha=alpha)"]
    assert spec.engine == {"max_num_batched_tokens": 1024, "max_num_seqs": 8}
    assert spec.capture.positions == "generated" and spec.capture.dtype == "float32"
    assert spec.output.dir == str(tmp_path / "acts") and spec.output.shard_tokens == 5000
    assert spec.params["alpha"] == 4 and spec.params["cols"] == (1, 2)
    assert torch.equal(load_tensor(spec.params["steer"]), vec)
    assert isinstance(spec.params["refusal"], TensorFile)
    # planning checks the values as the engine will: it refuses parameters no tap names
    with pytest.raises(RequestError, match=r"params: parameter 'refusal' is not named by any tap"):
        spec_plan(spec)
    plan = spec_plan(dataclasses.replace(spec, params={k: spec.params[k] for k in ("steer", "alpha")}))
    assert plan.max_num_batched_tokens == 1024 and plan.max_num_seqs == 8
    assert plan.taps[0].dtype == "float32"


BAD = [
    ("taps: [model.layers.0.resid]", "missing `model`"),
    ("model: x", "missing `taps`"),
    ("model: x\ntaps: []", "taps must be a non-empty list"),
    ("model: x\ntaps: [a.output]\nengin: {}", "unknown key `engin`; did you mean `engine`?"),
    ("model: x\ntaps: [a.output]\nengine: {max_num_seq: 3}", "unknown key `engine.max_num_seq`; did you mean `engine.max_num_seqs`?"),
    ("model: x\ntaps: [a.output]\nengine: {max_num_seqs: many}", "engine.max_num_seqs must be an integer, not 'many'"),
    ("model: x\ntaps: [a.output]\ncapture: {positions: middle}", "capture.positions must be one of 'all', 'prompt', 'generated' or 'last', not 'middle'"),
    ("model: x\ntaps: [a.output]\ncapture: {dtype: int8}", "capture.dtype must be one of 'bfloat16', 'float16' or 'float32', not 'int8'"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: -2}", "capture.memory_gib must be >= 0, not -2"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: lots}", "capture.memory_gib must be a number, not 'lots'"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: true}", "capture.memory_gib must be a number, not True"),
    ("model: x\ntaps: [a.output]\ncapture: {where: disk}", "unknown key `capture.where`"),
    ("model: x\ntaps: [a.output]\ncapture: [all]", "capture must be a mapping"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: nope.safetensors, key: k}}", "params.v.file: no such file"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: vec.safetensors}}", "params.v: missing `key` (Name of the tensor in the file.)"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: vec.safetensors, key: other}}", "params.v.key: vec.safetensors has no tensor 'other'; it has steer"),
    ("model: x\ntaps: [a.output]\nparams: {v: true}", "params.v must be a number"),
    ("model: x\ntaps: [a.output]\nparams: {v: [1, b]}", "params.v must be a non-empty list of numbers"),
    ("model: x\ntaps: [a.output]\noutput: {shard_tokens: 3}", "output: missing `dir`"),
    ("model: x\ntaps: [a.output]\nblocks: {probe: probes.record}", "blocks.probe is 'probes.record'; name the function as 'package.module:function'"),
    ("model: x\ntaps: [a.output]\nfunctions: {clamp: clamps}", "functions.clamp is 'clamps'; name the function as 'package.module:function'"),
    ("model: x\ntaps: [a.output]\nblocks: [probes:record]", "blocks must be a mapping"),
    ("model: 3\ntaps: [a.output]", "model must be a string, not 3"),
    ("- just a list", "a spec is a mapping"),
    ("model: x\ntaps: [a.output\n", "not valid YAML (line"),
    ("model: ''\ntaps: [a.output]", "model must be a non-empty string, not ''"),
    ("model: x\ntaps: [3]", "taps[0] must be a string, not 3"),
    ("model: x\ntaps: [a.output]\nparams: {alpha: hello}",
     "params.alpha must be a number, a list of numbers or {file, key}, not 'hello'"),
    # the engine arguments tapc reads: integers that are integers, in bounds; flags that are flags
    ("model: x\ntaps: [a.output]\nengine: {tensor_parallel_size: two}", "engine.tensor_parallel_size must be an integer, not 'two'"),
    ("model: x\ntaps: [a.output]\nengine: {tensor_parallel_size: [2]}", "engine.tensor_parallel_size must be an integer, not [2]"),
    ("model: x\ntaps: [a.output]\nengine: {tensor_parallel_size: .nan}", "engine.tensor_parallel_size must be an integer, not nan"),
    ("model: x\ntaps: [a.output]\nengine: {tensor_parallel_size: 2.5}", "engine.tensor_parallel_size must be an integer, not 2.5"),
    ("model: x\ntaps: [a.output]\nengine: {tensor_parallel_size: 0}", "engine.tensor_parallel_size must be >= 1, not 0"),
    ("model: x\ntaps: [a.output]\nengine: {pipeline_parallel_size: -2}", "engine.pipeline_parallel_size must be >= 1, not -2"),
    ("model: x\ntaps: [a.output]\nengine: {max_num_batched_tokens: 99999999999999999999}",
     "engine.max_num_batched_tokens must be <= 16777216, not 99999999999999999999"),
    ("model: x\ntaps: [a.output]\nengine: {max_num_seqs: true}", "engine.max_num_seqs must be an integer, not True"),
    ("model: x\ntaps: [a.output]\nengine: {enable_lora: maybe}", "engine.enable_lora must be true or false, not 'maybe'"),
    ("model: x\ntaps: [a.output]\nengine: {lora_target_modules: [q_proj, 3]}",
     "engine.lora_target_modules[1] must be a string, not 3"),
    ("model: x\ntaps: [a.output]\nengine: {lora_target_modules: {1: q_proj}}", "engine.lora_target_modules must be a list"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: .inf}", "capture.memory_gib must be a finite number, not inf"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: 5000}", "capture.memory_gib must be <= 4096, not 5000"),
    ("model: x\ntaps: [a.output]\noutput: {dir: acts, shard_tokens: 0}", "output.shard_tokens must be >= 1, not 0"),
    ("model: x\ntaps: [a.output]\noutput: {dir: acts, format: parquet}", "output.format must be one of 'safetensors' or 'arrow'"),
    # values PyYAML builds before tapc sees them: said with their key, line and column
    ("model: 2024-13-45\ntaps: [a.output]", "model: '2024-13-45' is not a valid YAML timestamp: month must be in 1..12 (line 1, column 8"),
    ("model: x\ntaps: [a.output]\nengine: {max_num_seqs: " + "9" * 5000 + "}",
     "engine.max_num_seqs: '9999999999999999999... (5002 characters) is not a valid YAML int: Exceeds the limit (4300 "
     "digits) for integer string conversion: value has 5000 digits (line 3, column 24"),
    ("model: x\ntaps: [a.output]\nparams: {alpha: !!int abc}", "params.alpha: 'abc' is not a valid YAML int: invalid literal"),
    ("model: x\ntaps: [a.output]\nparams: {alpha: !!float abc}", "params.alpha: 'abc' is not a valid YAML float: could not convert"),
    ("model: x\ntaps: [a.output]\nparams: {alpha: !!int 0xZZ}", "params.alpha: '0xZZ' is not a valid YAML int"),
    ("model: x\ntaps: [a.output]\nparams: {alpha: !!timestamp hello}", "params.alpha: 'hello' is not a valid YAML timestamp (line 3"),
    ("model: x\ntaps: [a.output, !!bool maybe]", "taps[1]: 'maybe' is not a valid YAML bool"),
    ("model: x\ntaps: [a.output]\nblocks: {2024-02-30: x}", "blocks.2024-02-30 (a key): '2024-02-30' is not a valid YAML timestamp: day is out of range"),
]


@pytest.mark.parametrize("text,words", BAD, ids=[b[1][:40] for b in BAD])
def test_rejects(tmp_path, text, words):
    save_file({"steer": torch.randn(4)}, str(tmp_path / "vec.safetensors"))
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    assert words in str(info.value)
    assert str(tmp_path / "spec.yaml") in str(info.value)


def test_bad_tap_in_spec_names_its_line(tmp_path):
    with pytest.raises(TapSyntaxError, match=r"entry 2, column 14"):
        load_spec(write(tmp_path, "model: x\ntaps:\n  - model.layers.0.resid\n  - model.layers..resid\n"))


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "none.yaml")


def test_blocks_by_import_path(tmp_path):
    """`blocks:` names each block's function by import path; VLLM.from_spec imports them (in
    this process) and a path that does not lead to a function is an error naming the block."""
    from tapc.api.llm import spec_arguments
    from tapc.errors import TapcError

    spec = load_spec(write(tmp_path, f"""
        model: {CONFIGS / 'llama'}
        taps: ["model.layers.0.resid -> probe"]
        blocks: {{probe: 'textwrap:dedent'}}
    """))
    assert spec.blocks == {"probe": "textwrap:dedent"}
    assert spec_arguments(spec, {})[2]["blocks"] == {"probe": textwrap.dedent}
    bad = dataclasses.replace(spec, blocks={"probe": "textwrap:_whitespace_only_re"})
    with pytest.raises(TapcError, match=r"spec.yaml: blocks: block 'probe' \(textwrap:_whitespace_only_re\) is a Pattern, not a function"):
        spec_arguments(bad, {})


# ----------------------------------------------------------------------------- the spec fuzzer
# Beside the tap parser's (tests/lang/test_syntax.py): mutated spec texts and random mappings go through
# load_spec / spec_from_dict and, where they load, the plan; only tapc's own errors may come out.

SEED = f"""model: {CONFIGS / 'llama'}
engine: {{max_num_batched_tokens: 1024, max_num_seqs: 8, tensor_parallel_size: 2, enable_lora: false}}
taps:
  - model.layers.*.resid
  - model.layers.2.resid | add(steer, alpha=alpha, at=generated)
params:
  steer: {{file: v.safetensors, key: v}}
  alpha: 4.0
blocks: {{probe: my_probes:record}}
capture: {{positions: all, dtype: bfloat16, memory_gib: 2}}
output: {{dir: acts, format: safetensors, shard_tokens: 1000}}
"""
PIECES = ["\n", " ", ":", "- ", "[", "]", "{", "}", ",", "#", "'", '"', "&a ", "*a", "!!int ", "!!float ", "!!timestamp ",
          "!!bool ", "!!str ", "!!binary ", "!!set ", "<<: ", "? ", "|", ">", "%", "@", "\t", "~", "null", "true", "maybe",
          ".nan", ".inf", "-.inf", "1e999", "2.5", "0", "-2", "0x1F", "0o17", "2024-13-45", "9" * 30, "9" * 5000,
          "engine", "tensor_parallel_size", "max_num_seqs", "lora_target_modules", "params", "taps", "capture", "output",
          "model.layers.*.resid", "x" * 300, "\x00", "é"]


VALUE_SPANS = [m.span() for m in re.finditer(r"(?<=: )[^,{}\n]+|(?<=- )[^\n]+", SEED)]


@st.composite
def mutated(draw) -> str:
    """The seed with a few values replaced (most mutations keep it YAML) or text spliced anywhere."""
    text, spans = SEED, sorted(draw(st.sets(st.sampled_from(VALUE_SPANS), max_size=2)), reverse=True)
    for lo, hi in spans:   # from the end: the spans before stay where they were
        text = text[:lo] + draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join)) + text[hi:]
    for _ in range(draw(st.integers(0 if spans else 1, 1))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 12))
        text = text[:at] + draw(st.sampled_from(PIECES) | st.text(max_size=6)) + text[at + cut:]
    return text


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.sampled_from(
    ["", "x" * 300, "model.layers.1.resid", "a:b", str(CONFIGS / "llama"), "v.safetensors", "bfloat16", "all"])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["file", "key", "dir", "positions", "dtype", "memory_gib", "tensor_parallel_size", "max_num_seqs",
                     "enable_lora", "steer", "alpha", "x"]) | st.text(max_size=4), inner, max_size=4), max_leaves=12)
SPECS = st.fixed_dictionaries(
    {"model": st.just(str(CONFIGS / "llama")) | SCALARS,
     "taps": st.lists(st.sampled_from(["model.layers.*.resid", "model.layers.2.resid | add(steer, alpha=alpha)",
                                       "model.layers.0.output -> probe"]) | SCALARS, max_size=3) | VALUES},
    optional={k: VALUES for k in ("engine", "params", "blocks", "capture", "output", "extra")})


def plan_of(spec_or_text, folder: Path):
    """The spec, loaded from text or a mapping, and its plan: a plan or a TapcError."""
    save_file({"v": torch.zeros(256)}, str(folder / "v.safetensors"))
    try:
        if isinstance(spec_or_text, str):
            (folder / "spec.yaml").write_text(spec_or_text)
            spec = load_spec(folder / "spec.yaml")
        else:
            spec = spec_from_dict(spec_or_text, base=folder)
        spec_plan(spec)
    except TapcError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_spec_texts_fail_only_with_tapc_errors(text):
    with tempfile.TemporaryDirectory() as folder:
        plan_of(text, Path(folder))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPECS)
def test_random_spec_mappings_fail_only_with_tapc_errors(data):
    with tempfile.TemporaryDirectory() as folder:
        plan_of(data, Path(folder))
