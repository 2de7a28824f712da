"""YAML tap specs: model, engine arguments, taps, parameters, capture options, an output sink.

Each section maps onto a dataclass that forbids unknown keys; the docstring of each field is
its documentation (docs/spec.md shows a full file). Every error names the key path
(`params.steer.file`) and what was expected.

    model: ./tiny-llama
    engine: {max_num_batched_tokens: 4096, max_num_seqs: 64}
    taps:
      - model.layers.*.resid
      - model.layers.10.resid | add(steer, alpha=4.0)
    params:
      steer: {file: vectors.safetensors, key: layer10}
    blocks: {probe: my_probes:record}     # for taps `point -> probe`
    capture: {positions: all, dtype: bfloat16}
    output: {dir: ./acts, shard_tokens: 1000000}
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tapc.errors import SpecError
from tapc.lang.blockpaths import FORM as BLOCK_FORM
from tapc.lang.blockpaths import split_path
from tapc.lang.edits import POSITIONS
from tapc.lang.syntax import TapSpec, parse_taps

DTYPES = ("bfloat16", "float16", "float32")
MAX_SPEC_BYTES = 1 << 20        # a spec is a page of YAML; tensors live in parameter files
SPEC_SUFFIXES = (".yaml", ".yml")  # compared case-insensitively (`steer.YAML` is a spec)


def is_spec_path(target: str) -> bool:
    return target.lower().endswith(SPEC_SUFFIXES)


@dataclass(frozen=True)
class TensorFile:
    """A tensor on disk: a .safetensors or .pt file and the key of the tensor in it."""

    file: str
    "Path to a .safetensors or .pt file, relative to the spec file."
    key: str
    "Name of the tensor in the file."


@dataclass(frozen=True)
class CaptureOptions:
    positions: str = "all"
    "Which positions of each request come back: all, prompt, generated, or last."
    dtype: str | None = None
    "dtype captures are stored in (bfloat16, float16, float32); default: the model's."
    memory_gib: float | None = None
    "Host memory for captures each GPU makes and pins at the engine's start (GiB); default: as requests need it."


@dataclass(frozen=True)
class OutputSink:
    dir: str
    "Folder the harvest writes shards to (created if missing)."
    format: str = "safetensors"
    "Shard format: safetensors (rows of tokens) or arrow (HF datasets windows, what SAELens loads)."
    shard_tokens: int = 1_000_000
    "Rows per safetensors shard file (arrow files are cut under 2 GB)."
    dtype: str | None = None
    "Stored dtype (default: the capture dtype; float32 for arrow, which has no bfloat16)."
    context_size: int | None = None
    "arrow: tokens per window (every prompt must have this many; --context-size packs text so)."


@dataclass(frozen=True)
class Spec:
    model: str
    "A directory with config.json (and weights, to serve), or a hub id already in the local cache."
    taps: tuple[TapSpec, ...]
    "Tap strings, one per entry (docs/dsl.md)."
    engine: dict = field(default_factory=dict)
    "vLLM engine arguments (EngineArgs fields), passed to the engine as they are."
    params: dict = field(default_factory=dict)
    "Engine-wide parameter values: a number, a list of numbers, or a TensorFile."
    blocks: dict = field(default_factory=dict)
    "Python blocks of the taps (`point -> name`), by name: 'package.module:function', imported where the engine runs."
    capture: CaptureOptions = CaptureOptions()
    "Capture options for every request (a request may override them)."
    output: OutputSink | None = None
    "Where a harvest writes captures; omit to keep them in memory."
    path: str = ""
    "The spec file this came from (not a YAML key)."

    def param_values(self) -> dict:
        """`params:` with tensor files loaded (on the CPU)."""
        return {k: load_tensor(v) if isinstance(v, TensorFile) else v for k, v in self.params.items()}


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {path.stat().st_size} bytes; a spec is at most {MAX_SPEC_BYTES} (put tensors in "
                        "parameter files)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise SpecError(f"{path}: YAML nested too deep") from None
    return spec_from_dict(data, base=path.parent, name=str(path))


def spec_from_dict(data, base: Path = Path("."), name: str = "spec") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{name}: a spec is a mapping with keys model, taps, ...; got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(Spec) if f.name != "path"]
    _no_unknown(data, known, name, "")
    for key in ("model", "taps"):
        if key not in data:
            raise SpecError(f"{name}: missing `{key}` ({_doc(Spec, key)})")
    model = _typed(data["model"], str, f"{name}: model")
    if not Path(model).is_absolute() and (base / model).is_dir():
        model = str(base / model)
    taps = data["taps"]
    if not isinstance(taps, list) or not taps:
        raise SpecError(f"{name}: taps must be a non-empty list of tap strings")
    engine = _typed(data.get("engine") or {}, dict, f"{name}: engine")
    _check_engine_args(engine, name)
    capture = _section(CaptureOptions, data.get("capture") or {}, f"{name}: capture")
    if capture.positions not in POSITIONS:
        raise SpecError(f"{name}: capture.positions is {capture.positions!r}; use one of {', '.join(POSITIONS)}")
    if capture.dtype is not None and capture.dtype not in DTYPES:
        raise SpecError(f"{name}: capture.dtype is {capture.dtype!r}; use one of {', '.join(DTYPES)}")
    if capture.memory_gib is not None and not capture.memory_gib >= 0:
        raise SpecError(f"{name}: capture.memory_gib is {capture.memory_gib!r}; give GiB, a number >= 0")
    output = None
    if data.get("output") is not None:
        output = _section(OutputSink, data["output"], f"{name}: output")
        if output.format not in ("safetensors", "arrow") or output.shard_tokens < 1:
            raise SpecError(f"{name}: output needs format safetensors or arrow, and shard_tokens >= 1")
        output = dataclasses.replace(output, dir=str(base / output.dir))
    params = {k: _param(v, base, f"{name}: params.{k}") for k, v in _typed(data.get("params") or {}, dict,
                                                                           f"{name}: params").items()}
    blocks = _typed(data.get("blocks") or {}, dict, f"{name}: blocks")
    for k, v in blocks.items():
        if not isinstance(k, str) or split_path(v) is None:
            raise SpecError(f"{name}: blocks.{k} is {v!r}; name a block's function as {BLOCK_FORM}")
    return Spec(model=model, taps=parse_taps(taps), engine=engine, params=params, blocks=blocks, capture=capture,
                output=output, path=name)


def _doc(cls, name: str) -> str:
    import ast
    import inspect

    # field docstrings sit right after the field: read them from the class source
    src = ast.parse(inspect.getsource(cls))
    body = src.body[0].body
    for i, node in enumerate(body[:-1]):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            nxt = body[i + 1]
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                return nxt.value.value
    return ""


def _no_unknown(data: dict, known: list[str], name: str, prefix: str) -> None:
    for key in data:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean `{prefix}{near[0]}`?" if near else f"; known keys: {', '.join(known)}"
            raise SpecError(f"{name}: unknown key `{prefix}{key}`{hint}")


def _typed(value, typ, where: str):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)   # YAML reads `4` as an int
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise SpecError(f"{where} must be {typ.__name__ if typ is not dict else 'a mapping'}, "
                        f"not {type(value).__name__} ({value!r})")
    return value


def _section(cls, data, where: str):
    data = _typed(data, dict, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _no_unknown(data, list(fields), where, where.split(": ", 1)[1] + ".")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, f in fields.items():
        if key not in data:
            if f.default is dataclasses.MISSING:
                raise SpecError(f"{where}: missing `{key}` ({_doc(cls, key)})")
            continue
        typ = hints[key]
        optional = type(None) in typing.get_args(typ)
        base_type = next((t for t in typing.get_args(typ) if t is not type(None)), typ)
        values[key] = None if optional and data[key] is None else _typed(data[key], base_type, f"{where}.{key}")
    return cls(**values)


def _param(value, base: Path, where: str):
    if isinstance(value, bool):
        raise SpecError(f"{where} must be a number, a list of numbers or {{file, key}}, not a boolean")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, list):
        if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise SpecError(f"{where} must be a non-empty list of numbers")
        return tuple(value)
    ref = _section(TensorFile, value, where)
    path = base / ref.file
    if not path.is_file():
        raise SpecError(f"{where}.file: no such file {path}")
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

        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file raises whatever its reader hits first
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SpecError(f"{where}.file: {path.name} is not a readable {path.suffix} tensor file ({why})") from None
    if not isinstance(obj, dict):
        raise SpecError(f"{path}: a .pt parameter file must hold a dict of tensors, not {type(obj).__name__}")
    return list(obj)


def load_tensor(ref: TensorFile):
    """The tensor a TensorFile names, on CPU."""
    if ref.file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(ref.file)[ref.key]
    import torch

    return torch.load(ref.file, map_location="cpu", weights_only=True)[ref.key]


def _check_engine_args(engine: dict, name: str) -> None:
    """Engine keys must be vLLM EngineArgs fields (the installed vLLM's, cached: no vLLM import)."""
    from tapc.installed import vllm_names

    known = vllm_names().get("engine_args", []) if engine else []
    if known:  # none: no vLLM here, the engine checks when it starts
        _no_unknown(engine, known, name, "engine.")
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if key in engine:
            _typed(engine[key], int, f"{name}: engine.{key}")
