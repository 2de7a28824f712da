"""Tap specs + vLLM's module tree -> a TapPlan: what an engine will install, as plain data.

The plan is a value: print it, JSON round-trip it (`to_json` / `from_json`), diff two. Its
`digest` is the compile-cache key (see `plan_digest` for the fields it covers).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from tapc.errors import PlanError
from dataclasses import dataclass

# Kinds of tap (DESIGN.md: three kinds, plus the engine points outside the graphs).
READ = "read"      # in-graph capture into a preallocated buffer
EDIT = "edit"      # in-graph in-place edit from per-slot device tables
BLOCK = "block"    # boundary op: vLLM splits the graph there and a Python block runs
ENGINE = "engine"  # `logits` / `samples`, tapped in the runner, outside the graphs


@dataclass(frozen=True)
class Point:
    """A resolved place in the model.

    site: "output" | "input" | "resid" (a decoder layer's hidden_states + residual) |
          "source" (a call inside `module`'s forward) | "logits" | "samples".
    """

    module: str = ""
    site: str = "output"
    op: str | None = None        # `.source` op name, e.g. "qkv_split_0"
    io: str = "output"           # for `.source`: the op's "output" or "input"
    element: int | None = None   # tuple element, e.g. a decoder layer's output[0]

    @property
    def key(self) -> str:
        """Canonical text of the point; captures come back under this key."""
        if self.site in ("logits", "samples"):
            return self.site
        text = f"{self.module}.source.{self.op}.{self.io}" if self.site == "source" else f"{self.module}.{self.site}"
        return text if self.element is None else f"{text}[{self.element}]"


@dataclass(frozen=True)
class Arg:
    """An edit argument: a literal (number or list) or a named parameter bound later."""

    name: str                      # the op's argument name, e.g. "vector", "alpha"
    kind: str                      # "vector" | "scalar" | "columns" | "values" | "positions"
    param: str | None = None       # bound per request / per engine under this name
    value: float | str | tuple | None = None  # literal when `param` is None


@dataclass(frozen=True)
class ParamSpec:
    """A named parameter the plan's edits use; values come per request or per engine."""

    name: str
    kind: str                      # "vector" | "scalar" | "columns" | "values"
    width: int | None = None       # vectors: elements (the tapped point's width)


@dataclass(frozen=True)
class PlannedTap:
    """One resolved tap: a point, what to do there, and what it costs."""

    source: str                    # the tap line as the user wrote it
    point: Point
    action: str                    # "capture" | "add" | "scale" | "set" | "zero" | "project_out" | "block"
    kind: str                      # READ | EDIT | BLOCK | ENGINE
    args: tuple[Arg, ...] = ()
    block: str | None = None       # name of the Python block for `-> name`
    width: int = 0                 # elements per token (per rank under tensor parallelism)
    dtype: str = "bfloat16"        # dtype of the activation at that point (captures: of the buffer)
    buffer_bytes: int = 0          # preallocated at max_num_batched_tokens (captures only)
    layer: int | None = None       # decoder layer index, when the point is inside one

    @property
    def key(self) -> str:
        return self.point.key


@dataclass(frozen=True)
class TapPlan:
    """Everything an engine installs, and what `tapc explain` prints."""

    model: str                     # what the user named (path or hub id)
    architecture: str              # e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    dtype: str                     # model dtype, e.g. "bfloat16"
    max_num_batched_tokens: int    # rows every in-graph buffer and row table is sized for
    max_num_seqs: int              # slots in the per-request parameter tables
    taps: tuple[PlannedTap, ...]
    params: tuple[ParamSpec, ...]  # named parameters the taps use (one entry per name)
    splitting_ops: tuple[str, ...] # vLLM splitting ops the plan adds ("" when none)
    pieces_before: int             # piecewise graph pieces without the plan
    pieces_after: int
    total_buffer_bytes: int
    digest: str = ""

    def by_kind(self, kind: str) -> tuple[PlannedTap, ...]:
        return tuple(t for t in self.taps if t.kind == kind)

    @property
    def capture_keys(self) -> tuple[str, ...]:
        """Keys a request may capture (in-graph reads and engine points)."""
        seen: dict[str, None] = {}
        for t in self.taps:
            if t.action == "capture":
                seen.setdefault(t.key)
        return tuple(seen)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "TapPlan":
        def arg(a):
            v = a["value"]
            return Arg(**{**a, "value": tuple(v) if isinstance(v, list) else v})

        taps = tuple(
            PlannedTap(**{**t, "point": Point(**t["point"]), "args": tuple(arg(a) for a in t["args"])})
            for t in d["taps"]
        )
        return cls(**{**d, "taps": taps, "params": tuple(ParamSpec(**p) for p in d["params"]),
                      "splitting_ops": tuple(d["splitting_ops"])})

    @classmethod
    def from_json(cls, text: str) -> "TapPlan":
        return cls.from_dict(json.loads(text))


def plan_digest(plan: TapPlan) -> str:
    """sha256 over every field but `model` (a path that may move) and `digest` itself."""
    d = plan.to_dict()
    d.pop("digest")
    d.pop("model")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- building a plan

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}
_SLOT_KIND_BYTES = {"vector": 4, "scalar": 4, "columns": 8, "values": 4, "positions": 0}
BOUNDARY_OP = "tapc::boundary"


def build_plan(model: str, taps, *, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
               capture_dtype: str | None = None, tree=None) -> TapPlan:
    """Resolve taps (strings, a text, or parsed `TapSpec`s) against `model`'s vLLM module tree."""
    from tapc.resolve import resolve_tap
    from tapc.spec import TapSpec, parse_taps
    from tapc.tree import load_tree

    specs = tuple(taps) if taps and all(isinstance(t, TapSpec) for t in taps) else parse_taps(taps)
    if not specs:
        raise PlanError("no taps: give at least one tap")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise PlanError("max_num_batched_tokens and max_num_seqs must be positive")
    tree = tree or load_tree(model)
    if capture_dtype is not None and capture_dtype not in _ITEMSIZE:
        raise PlanError(f"capture dtype {capture_dtype!r}: use one of float32, bfloat16, float16")
    planned: list[PlannedTap] = []
    seen: dict[tuple, PlannedTap] = {}
    for spec in specs:
        for tap in resolve_tap(spec, tree):
            if tap.kind == READ and capture_dtype:
                tap = dataclasses.replace(tap, dtype=capture_dtype)
            sig = (tap.key, tap.action, tap.args, tap.block)
            if sig in seen:
                raise PlanError(f"{tap.key} is tapped twice the same way: by `{seen[sig].source}` and `{tap.source}`")
            seen[sig] = tap
            planned.append(_with_cost(tap, max_num_batched_tokens, max_num_seqs))
    params = _collect_params(planned)
    block_points = {t.key for t in planned if t.kind == BLOCK}
    pieces = tree.num_layers + 1  # vLLM splits at each attention op: one compiled piece per gap
    row_tables = len({t.key for t in planned if t.kind in (READ, EDIT)}) * max_num_batched_tokens * 4
    plan = TapPlan(
        model=model, architecture=tree.architecture, num_layers=tree.num_layers, hidden_size=tree.hidden_size,
        dtype=tree.dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        taps=tuple(planned), params=params, splitting_ops=(BOUNDARY_OP,) if block_points else (),
        pieces_before=pieces, pieces_after=pieces + len(block_points),
        total_buffer_bytes=sum(t.buffer_bytes for t in planned) + row_tables,
    )
    return dataclasses.replace(plan, digest=plan_digest(plan))


def _with_cost(tap: PlannedTap, rows: int, slots: int) -> PlannedTap:
    """Captures: a [rows, width] buffer (engine points: one row per request). Edits: per-slot tables."""
    if tap.kind == READ:
        return dataclasses.replace(tap, buffer_bytes=rows * tap.width * _ITEMSIZE[tap.dtype])
    if tap.kind == ENGINE and tap.action == "capture":
        return dataclasses.replace(tap, buffer_bytes=slots * tap.width * _ITEMSIZE[tap.dtype])
    per_slot = 0
    for a in tap.args:
        per_slot += _SLOT_KIND_BYTES[a.kind] * (tap.width if a.kind == "vector" else 1)
        if a.kind in ("columns", "values"):
            per_slot += _SLOT_KIND_BYTES[a.kind] * (len(a.value) - 1 if isinstance(a.value, tuple) else 0)
    return dataclasses.replace(tap, buffer_bytes=slots * per_slot)


def _collect_params(taps: list[PlannedTap]) -> tuple[ParamSpec, ...]:
    """One entry per parameter name; a name must mean one kind (and one width for vectors)."""
    found: dict[str, tuple[ParamSpec, PlannedTap]] = {}
    for tap in taps:
        for a in tap.args:
            if a.param is None:
                continue
            if a.param in found:
                first, where = found[a.param]
                if first.kind != a.kind:
                    raise PlanError(f"parameter {a.param!r} is a {first.kind} in `{where.source}` "
                                    f"but a {a.kind} in `{tap.source}`")
                if a.kind == "vector" and where.width != tap.width:
                    raise PlanError(f"parameter {a.param!r} is a vector of {where.width} at {where.key} "
                                    f"but of {tap.width} at {tap.key}: use two names")
                continue
            found[a.param] = (ParamSpec(a.param, a.kind, tap.width if a.kind == "vector" else None), tap)
    return tuple(a for a, _ in found.values())
