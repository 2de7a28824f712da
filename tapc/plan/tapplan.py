"""A TapPlan: what an engine will install, as plain data (tapc/plan/planner.py builds it).

The plan is a value: print it, JSON round-trip it (`to_json` / `from_json`), diff two. Its
`digest` is the compile-cache key (see `plan_digest` for the fields it covers).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass

from tapc.plan.shards import PointShard

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
    result: str | None = None    # a compiled function's named result there, "function.result"

    @property
    def key(self) -> str:
        """Canonical text of the point; captures come back under this key (a function's
        result under the point's key, `:` and "function.result")."""
        if self.site in ("logits", "samples"):
            return self.site
        text = f"{self.module}.source.{self.op}.{self.io}" if self.site == "source" else f"{self.module}.{self.site}"
        text = text if self.element is None else f"{text}[{self.element}]"
        return text if self.result is None else f"{text}:{self.result}"


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
    kind: str                      # "vector" | "scalar" | "columns" | "values" | "rows" (patch)
    width: int | None = None       # vectors and rows: elements (the tapped point's width)


@dataclass(frozen=True)
class FunctionSpec:
    """A compiled function the plan's `call` taps run (tapc/lang/functions.py `Signature`), and
    a hash of its code and state, which the digest covers: a changed function never reuses a
    stale compiled graph."""

    name: str
    params: tuple[tuple[str, str], ...] = ()                 # (name, kind)
    results: tuple[tuple[str, int | None, str], ...] = ()    # (name, width or None, dtype)
    code: str = ""


@dataclass(frozen=True)
class PlannedTap:
    """One resolved tap: a point, what to do there, and what it costs."""

    source: str                    # the tap line as the user wrote it
    point: Point
    action: str                    # "capture" | "add" | "scale" | "set" | "zero" | "project_out" | "patch" | "call" | "block"
    kind: str                      # READ | EDIT | BLOCK | ENGINE
    args: tuple[Arg, ...] = ()
    block: str | None = None       # name of the Python block for `-> name`
    function: str | None = None    # the compiled function a `call` runs, and whose result a capture keeps
    width: int = 0                 # elements per token in the single-GPU layout
    dtype: str = "bfloat16"        # dtype of the activation at that point (captures: of the buffer)
    buffer_bytes: int = 0          # device memory the engine allocates for it (tapc/plan/sizing.py), on
                                   # the most loaded GPU under tensor / pipeline parallelism
    layer: int | None = None       # decoder layer index, when the point is inside one
    layout: str = "replicated"     # under tensor parallelism (tapc/plan/sharding.py): replicated or a sharded kind
    stage: int = 0                 # the pipeline stage that runs it

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
    total_buffer_bytes: int        # device memory the engine allocates for the plan (tapc/plan/sizing.py),
                                   # on the most loaded GPU
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layers: tuple[tuple[int, int], ...] = ()  # decoder layers (start, end) of each pipeline stage
    # tapc/plan/sharding.py's PointShard of each tapped point (one per key), when either size is
    # above 1: which GPU runs, captures and edits which columns (tapc/plan/ranks.py).
    shards: tuple = ()
    functions: tuple[FunctionSpec, ...] = ()   # the compiled functions its `call` taps run
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

    @functools.cached_property
    def param_users(self) -> dict[str, tuple[PlannedTap, ...]]:
        """Parameter name -> the taps that read it, in plan order: a request's check looks up the
        taps of the parameters it binds rather than scanning every tap (a 32-layer sweep binds
        one parameter of 32)."""
        users: dict[str, list[PlannedTap]] = {p.name: [] for p in self.params}
        for t in self.taps:
            for name in dict.fromkeys(a.param for a in t.args if a.param is not None):
                users.setdefault(name, []).append(t)
        return {name: tuple(ts) for name, ts in users.items()}

    def taps_reading(self, names) -> list[PlannedTap]:
        """The taps that read any of the parameters `names`, in plan order."""
        names = list(names)
        if len(names) == 1:
            return list(self.param_users.get(names[0], ()))
        near = {id(t) for name in names for t in self.param_users.get(name, ())}
        return [t for t in self.taps if id(t) in near]

    @property
    def shard_map(self) -> dict:
        """key -> PointShard (empty on one GPU)."""
        return {s.key: s for s in self.shards}

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
                      "splitting_ops": tuple(d["splitting_ops"]),
                      "pp_layers": tuple(tuple(r) for r in d.get("pp_layers", ())),
                      "shards": tuple(PointShard.from_dict(s) for s in d.get("shards", ())),
                      "functions": tuple(_function(f) for f in d.get("functions", ()))})

    @classmethod
    def from_json(cls, text: str) -> "TapPlan":
        return cls.from_dict(json.loads(text))


def _function(d: dict) -> FunctionSpec:
    return FunctionSpec(d["name"], tuple(tuple(p) for p in d["params"]), tuple(tuple(r) for r in d["results"]),
                        d["code"])


def plan_digest(plan: TapPlan) -> str:
    """sha256 over every field but `model` (a path that may move) and `digest` itself."""
    d = plan.to_dict()
    d.pop("digest")
    d.pop("model")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
