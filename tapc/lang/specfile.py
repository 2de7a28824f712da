"""YAML tap specs: model, engine arguments, taps, parameters, capture options, an output sink.

The keys, their types and bounds are tapc/lang/schema.py's (docs/spec.md shows a full file);
here the values become a `Spec`: paths relative to the spec file, taps parsed, parameter files
opened. Every error is one line naming the key path (`params.steer.file`) and what was expected.

    model: ./tiny-llama
    engine: {max_num_batched_tokens: 4096, max_num_seqs: 64}
    taps:
      - model.layers.*.resid
      - model.layers.10.resid | add(steer, alpha=4.0)
    params:
      steer: {file: vectors.safetensors, key: layer10}
    blocks: {probe: my_probes:record}     # for taps `point -> probe`
    functions: {clamp: my_probes:clamp}   # for taps `point | call(clamp)`
    capture: {positions: all, dtype: bfloat16}
    output: {dir: ./acts, shard_tokens: 1000000}
"""
from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tapc import paths
from tapc.errors import SpecError
from tapc.installed import YAML_KINDS, vllm_names
from tapc.lang.blockpaths import FORM as BLOCK_FORM
from tapc.lang.blockpaths import split_path
from tapc.lang.quoted import shown
from tapc.lang.schema import CaptureOptions, OutputSink, SpecFile, TensorFile, checked, dotted
from tapc.lang.syntax import TapSpec, parse_taps
from tapc.lang.yamltext import load_yaml

__all__ = ["CaptureOptions", "OutputSink", "Spec", "TensorFile", "is_spec_path", "load_spec", "load_tensor",
           "spec_from_dict"]

MAX_SPEC_BYTES = 1 << 20        # a spec is a page of YAML; tensors live in parameter files
SPEC_SUFFIXES = (".yaml", ".yml")  # compared case-insensitively (`steer.YAML` is a spec)
SECTIONS = ("engine", "params", "blocks", "functions", "capture", "output")   # `key:` with nothing under it: as if absent


def is_spec_path(target: str) -> bool:
    return target.lower().endswith(SPEC_SUFFIXES)


@dataclass(frozen=True)
class Spec:
    """A loaded spec (the keys are tapc.lang.schema.SpecFile's)."""

    model: str
    taps: tuple[TapSpec, ...]
    engine: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)
    capture: CaptureOptions = CaptureOptions()
    output: OutputSink | None = None
    path: str = ""
    "The spec file this came from (not a YAML key)."

    def param_values(self) -> dict:
        """`params:` with tensor files loaded (on the CPU)."""
        return {k: load_tensor(v) if isinstance(v, TensorFile) else v for k, v in self.params.items()}


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if paths.kind(path, "spec file", SpecError) != "file":
        raise SpecError(f"{paths.shown(path)}: no such spec file")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {path.stat().st_size} bytes; a spec is at most {MAX_SPEC_BYTES} (put tensors in "
                        "parameter files)")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    return spec_from_dict(load_yaml(text, str(path)), base=path.parent, name=str(path))


def spec_from_dict(data, base: Path = Path("."), name: str = "spec") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{name}: a spec is a mapping with keys model, taps, ...; got {type(data).__name__}")
    raw = checked(SpecFile, {k: v for k, v in data.items() if not (k in SECTIONS and v is None)}, name)
    engine = raw.engine.model_dump(exclude_unset=True)
    _check_engine_args(engine, name)
    model = raw.model
    if not Path(model).is_absolute() and paths.kind(base / model, f"{name}: model", SpecError) == "dir":
        model = str(base / model)
    output = raw.output
    if output is not None:
        # a folder relative to the spec; a URL (s3://..., a Ray harvest's object storage) as it is
        output = output.model_copy(update={"dir": output.dir if "://" in output.dir else str(base / output.dir)})
    params = {k: _param(v, base, name, ("params", k)) for k, v in raw.params.items()}
    for section, named in (("blocks", raw.blocks), ("functions", raw.functions)):
        for k, v in named.items():
            if split_path(v) is None:
                raise SpecError(f"{name}: {dotted((section, k))} is {shown(v)}; name the function as {BLOCK_FORM}")
    return Spec(model=model, taps=parse_taps(raw.taps), engine=engine, params=params, blocks=raw.blocks,
                functions=raw.functions, capture=raw.capture, output=output, path=name)


def _param(value, base: Path, name: str, at: tuple):
    where = f"{name}: {dotted(at)}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value   # finite and in range: the engine's checker says so, by the parameter's kind
    if isinstance(value, list):
        if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise SpecError(f"{where} must be a non-empty list of numbers, not {shown(value)}")
        return tuple(value)
    if not isinstance(value, dict):
        raise SpecError(f"{where} must be a number, a list of numbers or {{file, key}}, not {shown(value)}")
    ref = checked(TensorFile, value, name, at)
    path = base / ref.file
    if paths.kind(path, f"{where}.file", SpecError) != "file":
        raise SpecError(f"{where}.file: no such file {paths.shown(path)}")
    if path.suffix not in (".safetensors", ".pt", ".pth"):
        raise SpecError(f"{where}.file: {path.name} is neither .safetensors nor .pt")
    keys = _tensor_keys(path, where)
    if ref.key not in keys:
        raise SpecError(f"{where}.key: {path.name} has no tensor {ref.key!r}; it has {', '.join(sorted(keys)) or 'none'}")
    return TensorFile(file=str(path), key=ref.key)


def _tensor_keys(path: Path, where: str) -> list[str]:
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="numpy") as f:
                return list(f.keys())
        import torch

        with warnings.catch_warnings():   # torch's about a foreign pickle's protocol: the error below says it
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged or foreign file: its reader's words (torch's advice to load it unsafely) help no one
        kind = "safetensors" if path.suffix == ".safetensors" else "torch.save"
        raise SpecError(f"{where}.file: {paths.shown(path)} cannot be loaded: not a {kind} file of tensors") from None
    if not isinstance(obj, dict):
        raise SpecError(f"{where}.file: {paths.shown(path)} holds a {type(obj).__name__}; a .pt parameter file must "
                        "hold a dict of tensors")
    return list(obj)


def load_tensor(ref: TensorFile):
    """The tensor a TensorFile names, on CPU."""
    if ref.file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(ref.file)[ref.key]
    import torch

    return torch.load(ref.file, map_location="cpu", weights_only=True)[ref.key]


def _check_engine_args(engine: dict, name: str) -> None:
    """Engine keys must be vLLM EngineArgs fields, their values of the field's type: both read from
    the installed vLLM once and cached (tapc.installed), as vLLM may not be imported here (`tapc
    explain` of a spec stays off it), so any machine refuses what only the engine would."""
    names = vllm_names() if engine else {}
    known, types = names.get("engine_args", []), names.get("engine_types", {})
    for key, value in engine.items() if known else ():   # no names: no vLLM here, the engine checks when it starts
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean `engine.{near[0]}`?" if near else ""
            raise SpecError(f"{name}: unknown key `{dotted(('engine', key))}`{hint}")
        if key in types and not _of_kinds(value, **types[key]):
            raise SpecError(f"{name}: {dotted(('engine', key))} must be {_kinds_said(**types[key])}, not {shown(value)}")


_KIND_SAID = {"bool": "true or false", "int": "an integer", "float": "a number", "string": "a string", "list": "a list",
              "dict": "a mapping", "null": "null"}


def _of_kinds(value, kinds: list, choices: list) -> bool:
    kind = YAML_KINDS.get(type(value))
    return (kind in kinds or (kind == "int" and "float" in kinds)
            or any(type(c) is type(value) and c == value for c in choices))   # True is not the choice 1


def _kinds_said(kinds: list, choices: list) -> str:
    said = [_KIND_SAID[k] for k in kinds]
    if choices:
        said.append("one of " + ", ".join(map(shown, choices)))
    return " or ".join(said)
