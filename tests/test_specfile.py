"""YAML tap specs: full validation with messages that name the key."""
import dataclasses
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from tapc.errors import RequestError, SpecError, TapSyntaxError
from tapc.api.specs import spec_plan
from tapc.lang.specfile import TensorFile, load_spec, load_tensor

from conftest import CONFIGS


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
    ("model: x\ntaps: [a.output]\nengine: {max_num_seqs: many}", "engine.max_num_seqs must be int"),
    ("model: x\ntaps: [a.output]\ncapture: {positions: middle}", "capture.positions is 'middle'; use one of all, prompt, generated, last"),
    ("model: x\ntaps: [a.output]\ncapture: {dtype: int8}", "capture.dtype is 'int8'"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: -2}", "capture.memory_gib is -2.0; give GiB, a number >= 0"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: lots}", "capture.memory_gib must be float, not str"),
    ("model: x\ntaps: [a.output]\ncapture: {memory_gib: true}", "capture.memory_gib must be float, not bool"),
    ("model: x\ntaps: [a.output]\ncapture: {where: disk}", "unknown key `capture.where`"),
    ("model: x\ntaps: [a.output]\ncapture: [all]", "capture must be a mapping"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: nope.safetensors, key: k}}", "params.v.file: no such file"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: vec.safetensors}}", "params.v: missing `key` (Name of the tensor in the file.)"),
    ("model: x\ntaps: [a.output]\nparams: {v: {file: vec.safetensors, key: other}}", "params.v.key: vec.safetensors has no tensor 'other'; it has steer"),
    ("model: x\ntaps: [a.output]\nparams: {v: true}", "params.v must be a number"),
    ("model: x\ntaps: [a.output]\nparams: {v: [1, b]}", "params.v must be a non-empty list of numbers"),
    ("model: x\ntaps: [a.output]\noutput: {shard_tokens: 3}", "output: missing `dir`"),
    ("model: x\ntaps: [a.output]\nblocks: {probe: probes.record}", "blocks.probe is 'probes.record'; name a block's function as 'package.module:function'"),
    ("model: x\ntaps: [a.output]\nblocks: [probes:record]", "blocks must be a mapping"),
    ("model: 3\ntaps: [a.output]", "model must be str"),
    ("- just a list", "a spec is a mapping"),
    ("model: x\ntaps: [a.output\n", "not valid YAML (line"),
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
