"""The spec's schema: each section's keys, types and bounds as pydantic models (a field's
docstring is its documentation, quoted when the key is missing), and `checked`, which turns
what pydantic refuses into one line naming the key.

Values are strict: an integer is an int (not 2.5, not "2", not true), a number is finite, a
flag is true or false. `EngineArgs` holds the vLLM engine arguments tapc reads itself; the
planner checks its sizes with it too, so a spec, a flag and `build_plan` meet one set of bounds.
"""
from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tapc.errors import SpecError
from tapc.lang.edits import POSITIONS
from tapc.lang.quoted import shown

DTYPES = ("bfloat16", "float16", "float32")

# Upper bounds: far above any engine's values, low enough that a typo cannot plan terabytes.
MAX_GPUS = 1024                 # tensor or pipeline parallel size
MAX_BATCHED_TOKENS = 1 << 24    # rows a step's buffers hold (vLLM's own defaults are 2k-16k)
MAX_NUM_SEQS = 1 << 16          # requests a step holds
MAX_MEMORY_GIB = 1 << 12        # host memory a GPU pins for captures
MAX_SHARD_TOKENS = 1 << 31      # rows of one shard file


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class TensorFile(Section):
    """A tensor on disk: a .safetensors or .pt file and the key of the tensor in it."""

    file: str = Field(min_length=1)
    "Path to a .safetensors or .pt file, relative to the spec file."
    key: str
    "Name of the tensor in the file."


class CaptureOptions(Section):
    positions: Literal[POSITIONS] = "all"
    "Which positions of each request come back: all, prompt, generated, or last."
    dtype: Literal[DTYPES] | None = None
    "dtype captures are stored in (bfloat16, float16, float32); default: the model's."
    memory_gib: float | None = Field(None, ge=0, le=MAX_MEMORY_GIB)
    "Host memory for captures each GPU makes and pins at the engine's start (GiB); default: as requests need it."
    memory_keep_gib: float | None = Field(None, ge=0, le=MAX_MEMORY_GIB)
    "Host memory for captures each GPU keeps once idle (GiB): what a burst grew past it goes back; default: all."


class OutputSink(Section):
    dir: str = Field(min_length=1)
    "Folder the harvest writes shards to (created if missing)."
    format: Literal["safetensors", "arrow"] = "safetensors"
    "Shard format: safetensors (rows of tokens) or arrow (HF datasets windows, what SAELens loads)."
    shard_tokens: int = Field(1_000_000, ge=1, le=MAX_SHARD_TOKENS)
    "Rows per safetensors shard file (arrow files are cut under 2 GB)."
    dtype: Literal[DTYPES] | None = None
    "Stored dtype (default: the capture dtype; float32 for arrow, which has no bfloat16)."
    context_size: int | None = Field(None, ge=1, le=MAX_BATCHED_TOKENS)
    "arrow: tokens per window (every prompt must have this many; --context-size packs text so)."


class EngineArgs(Section):
    """The vLLM engine arguments tapc reads (the plan is sized and split by them, the module tree
    built with them); vLLM takes any others as they are."""

    model_config = ConfigDict(extra="allow")
    # None as a default only: given, each is an integer
    max_num_batched_tokens: int = Field(None, ge=1, le=MAX_BATCHED_TOKENS)
    "Tokens a step holds: the rows of every in-graph buffer."
    max_num_seqs: int = Field(None, ge=1, le=MAX_NUM_SEQS)
    "Requests a step holds (parameter tables hold 2 slots per request)."
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)
    "GPUs per pipeline stage."
    pipeline_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)
    "Pipeline stages."
    enable_lora: bool = False
    "Whether the engine serves LoRA adapters (the module tree has their wrappers)."
    lora_target_modules: list[str] | None = None
    "The modules LoRA wraps (default: every one vLLM can)."


class SpecFile(Section):
    model: str = Field(min_length=1)
    "A directory with config.json (and weights, to serve), or a hub id already in the local cache."
    taps: list[str] = Field(min_length=1)
    "Tap strings, one per entry (docs/dsl.md)."
    engine: EngineArgs = EngineArgs()
    "vLLM engine arguments (EngineArgs fields), passed to the engine as they are."
    params: dict[str, Any] = {}
    "Engine-wide parameter values: a number, a list of numbers, or a TensorFile."
    blocks: dict[str, str] = {}
    "Python blocks of the taps (`point -> name`), by name: 'package.module:function', imported where the engine runs."
    functions: dict[str, str] = {}
    "Compiled functions of the taps (`point | call(name)`), by name: 'package.module:function' (or a module instance)."
    capture: CaptureOptions = CaptureOptions()
    "Capture options for every request (a request may override them)."
    output: OutputSink | None = None
    "Where a harvest writes captures; omit to keep them in memory."


def checked(cls: type[Section], data, where: str, at: tuple = (), error: type[Exception] = SpecError,
            label=None) -> Section:
    """`data` as a `cls`, or `error`: one line, `where` first, naming the first key at fault
    (`at` is the key path of `data` in the spec; `label(key)` names a top-level key otherwise,
    e.g. as the command-line flag that gave it)."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        # an unknown key before a missing one: `tapz:` is most likely `taps:` misspelt
        first = min(e.errors(), key=lambda err: err["type"] == "missing")
        raise error(message(cls, first, where, at, label)) from None


def message(cls: type[Section], err: dict, where: str, at: tuple = (), label=None) -> str:
    loc = err["loc"]
    head = f"{where}: " if where else ""

    def path(parts) -> str:
        if label is not None and parts and not at:
            parts = (label(parts[0]), *parts[1:])
        return dotted((*at, *parts))

    if err["type"] == "missing":
        doc = _field(cls, loc)
        parent = path(loc[:-1])
        return (f"{head}{parent + ': ' if parent else ''}missing `{loc[-1]}`"
                + (f" ({doc.description})" if doc is not None and doc.description else ""))
    if err["type"] == "extra_forbidden":
        owner = _owner(cls, loc[:-1])
        known = list(owner.model_fields) if owner is not None else []
        near = difflib.get_close_matches(str(loc[-1]), known, n=1)
        prefix = dotted((*at, *loc[:-1]))
        prefix += "." if prefix else ""
        hint = f"; did you mean `{prefix}{near[0]}`?" if near else f"; known keys: {', '.join(known)}"
        return f"{head}unknown key `{path(loc)}`{hint}"
    if err["type"] == "invalid_key":   # a key YAML read as a number, a list, ...
        parent = path(loc[:-1])
        return f"{head}{parent + ': ' if parent else ''}the key {shown(loc[-1])} is not a string; keys are names"
    return f"{head}{path(loc) or 'the value'} must be {_expected(err)}, not {shown(err.get('input'))}"


def dotted(parts) -> str:
    """A key path as docs and messages write it: `params.steer.file`, `taps[2]`."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":   # pydantic's mark of a dict's key (not its value) at fault
            out += " (a key)"
        else:   # a key of any length quoted in a line: its start
            part = str(part) if len(str(part)) <= 40 else f"{str(part)[:30]}...({len(str(part))} characters)"
            out += f".{part}" if out else part
    return out


# What strict validation reports, in the words of the messages (others: pydantic's own)
_EXPECTED = {
    "int_type": "an integer", "float_type": "a number", "finite_number": "a finite number", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "too_short": "a non-empty list", "string_too_short": "a non-empty string",
}
_BOUNDS = {"greater_than_equal": ">= {ge}", "less_than_equal": "<= {le}", "literal_error": "one of {expected}"}


def _expected(err: dict) -> str:
    if err["type"] in _EXPECTED:
        return _EXPECTED[err["type"]]
    if err["type"] in _BOUNDS:
        ctx = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in err.get("ctx", {}).items()}
        return _BOUNDS[err["type"]].format(**ctx)
    return err["msg"].removeprefix("Input should be ")


def _owner(cls, parts) -> type[Section] | None:
    """The section a key path leads into (None: into a mapping of free keys)."""
    for part in parts:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        cls = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(t, type) and issubclass(t, Section)), None)
        if cls is None:
            return None
    return cls


def _field(cls, loc):
    owner = _owner(cls, loc[:-1])
    return None if owner is None else owner.model_fields.get(loc[-1])
