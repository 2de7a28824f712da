"""What one request asks of a tapped engine, checked against the plan before it is submitted.

A `TapRequest` names the captures it wants (point keys, tap lines of the plan, or "*"), which
positions to capture, and values for the plan's named parameters. `to_wire` checks it and
turns it into plain data (lists, numbers, strings) that travels to the engine-core process in
`SamplingParams.extra_args["tapc"]`; anything wrong is a `RequestError` for that request,
raised before the engine sees it.

Positions are absolute token positions of the request: the prompt is 0..P-1, and the k-th
generated token (k from 0) is fed back at position P+k. A capture row at position p is the
activation while token p is the input. The last generated token is never fed back, so a
request with G generated tokens has P + G - 1 rows under "all".
    "all":       0 .. P+G-2        every token that went through the model
    "prompt":    0 .. P-1
    "generated": P .. P+G-2        rows whose input is a generated token
    "last":      P-1               the last prompt token (its output predicts generated token 0)
    [p, ...]:    exactly these positions (those that exist)
Edits take the same words in the tap (`at=`), e.g. `add(steer, at=generated)`.
"""
from __future__ import annotations

import difflib
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tapc.errors import RequestError
from tapc.plan import EDIT, TapPlan
from tapc.spec import POSITIONS

ENGINE_POINTS = ("logits", "samples")

# Per-request column lists (set/zero with a `columns` parameter) fill a fixed-width slot table.
MAX_COLUMNS = 64


@dataclass(frozen=True)
class TapRequest:
    """One request's taps: what to capture, where, and the values of named edit parameters.

    capture:   point keys (`model.layers.3.resid`), tap lines of the plan (a glob line means all
               its points), or "*" for every capture point of the plan.
    positions: "all" | "prompt" | "generated" | "last", or a list of absolute positions.
    params:    parameter name -> value: a vector (list, numpy array or tensor) for `vector`
               parameters, a number for `scalar`, column indices for `columns`, a number or a
               list (one per column) for `values`. An edit tap applies to a request that binds
               all of its parameters; edits without parameters apply to every request.
    blocks:    block name -> a function `f(ctx, x)` run for this request instead of the engine's
               block of that name (see tapc.runtime); it is pickled to the worker.
    """

    capture: str | Sequence[str] = ()
    positions: str | Sequence[int] = "all"
    params: Mapping[str, Any] = field(default_factory=dict)
    blocks: Mapping[str, Any] = field(default_factory=dict)


def select(positions: str | Sequence[int], pos: np.ndarray, prompt_len: int) -> np.ndarray:
    """Mask over `pos` (absolute positions of one request) of the rows `positions` covers."""
    if positions == "all":
        return np.ones(pos.shape, dtype=bool)
    if positions == "prompt":
        return pos < prompt_len
    if positions == "generated":
        return pos >= prompt_len
    if positions == "last":
        return pos == prompt_len - 1
    return np.isin(pos, np.asarray(positions, dtype=np.int64))


def to_wire(plan: TapPlan, req: TapRequest, where: str) -> dict:
    """Check `req` against `plan`; the plain dict the engine's workers read. `where` names the
    request in error messages (e.g. "request 3")."""
    keys = _capture_keys(plan, req.capture, where)
    return {
        "id": uuid.uuid4().hex,
        "capture": [k for k in keys if k not in ENGINE_POINTS],
        "engine": [k for k in keys if k in ENGINE_POINTS],
        "positions": _positions(req.positions, where),
        "params": _params(plan, req.params, where),
        "blocks": _blocks(plan, req.blocks, where),
    }


def _blocks(plan: TapPlan, blocks: Mapping[str, Any], where: str) -> bytes | None:
    """Per-request blocks, cloudpickled (they travel in extra_args to the worker process)."""
    if not blocks:
        return None
    names = {t.block for t in plan.taps if t.action == "block"}
    for name, fn in blocks.items():
        if name not in names:
            raise RequestError(f"{where}: block {name!r} is not named by any tap of this engine's plan "
                               f"(its blocks: {', '.join(sorted(names)) or 'none'})")
        if not callable(fn):
            raise RequestError(f"{where}: block {name!r} must be a function f(ctx, x), got {type(fn).__name__}")
    import cloudpickle

    return cloudpickle.dumps(dict(blocks))


def _capture_keys(plan: TapPlan, capture, where: str) -> list[str]:
    items = [capture] if isinstance(capture, str) else list(capture)
    reads = [t for t in plan.taps if t.action == "capture"]
    keys: dict[str, None] = {}
    for item in items:
        if item == "*":
            keys.update(dict.fromkeys(t.key for t in reads))
            continue
        matched = [t.key for t in reads if item in (t.key, t.source)]
        if not matched:
            known = list(dict.fromkeys([t.key for t in reads] + [t.source for t in reads]))
            near = difflib.get_close_matches(item, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            listing = ", ".join(dict.fromkeys(t.source for t in reads)) or "none"
            raise RequestError(f"{where}: {item!r} is not a capture of this engine's plan{hint} "
                               f"The plan captures: {listing}")
        keys.update(dict.fromkeys(matched))
    return list(keys)


def _positions(positions, where: str):
    if isinstance(positions, str):
        if positions not in POSITIONS:
            raise RequestError(f"{where}: positions {positions!r}: use one of {', '.join(POSITIONS)} "
                               "or a list of token positions")
        return positions
    out = [int(p) for p in positions]
    if any(p < 0 for p in out) or len(set(out)) != len(out):
        raise RequestError(f"{where}: positions must be distinct non-negative token positions, got {out}")
    return sorted(out)


def check_engine_params(plan: TapPlan, params: Mapping[str, Any], where: str) -> None:
    """Engine-wide parameter values (`VLLM(params=...)`, a spec's `params:`), each checked as a
    request's would be; a tap may take its other parameters from each request."""
    _params(plan, params, where, partial=True)


def _params(plan: TapPlan, params: Mapping[str, Any], where: str, partial: bool = False) -> dict:
    specs = {p.name: p for p in plan.params}
    out = {}
    for name, value in params.items():
        if name not in specs:
            known = ", ".join(specs) or "none"
            raise RequestError(f"{where}: parameter {name!r} is not named by any tap of this engine's plan "
                               f"(its parameters: {known})")
        out[name] = _value(plan, specs[name], value, where)
    for tap in plan.by_kind(EDIT):
        names = [a.param for a in tap.args if a.param is not None]
        given = [n for n in names if n in out]
        if given and len(given) != len(names) and not partial:
            missing = [n for n in names if n not in out]
            raise RequestError(f"{where}: `{tap.source}` needs {', '.join(map(repr, names))}; the request "
                               f"binds {', '.join(map(repr, given))} but not {', '.join(map(repr, missing))}")
        _check_set_lengths(tap, out, where)
    return out


def _value(plan: TapPlan, spec, value, where: str):
    what = f"{where}: parameter {spec.name!r} ({spec.kind})"
    if spec.kind == "vector":
        arr = np.asarray(value.detach().float().cpu() if hasattr(value, "detach") else value, dtype=np.float64)
        if arr.ndim != 1 or arr.shape[0] != spec.width:
            raise RequestError(f"{what} must be {spec.width} numbers, got shape {tuple(arr.shape)}")
        if not np.isfinite(arr).all():
            raise RequestError(f"{what} has non-finite entries")
        # float32 bytes: msgpack sends them as one binary field, not thousands of Python floats.
        return arr.astype(np.float32).tobytes()
    if spec.kind == "scalar":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"{what} must be a finite number, got {value!r}")
        return float(value)
    if spec.kind == "columns":
        cols = [value] if isinstance(value, int) else list(value)
        width = min(t.width for t in plan.taps if any(a.param == spec.name for a in t.args))
        if not cols or len(cols) > MAX_COLUMNS or len(set(cols)) != len(cols) or \
                not all(isinstance(c, (int, np.integer)) and 0 <= c < width for c in cols):
            raise RequestError(f"{what} must be 1..{MAX_COLUMNS} distinct column indices in 0..{width - 1}, "
                               f"got {value!r}")
        return [int(c) for c in cols]
    vals = [value] if isinstance(value, (int, float)) else list(value)
    if not vals or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
        raise RequestError(f"{what} must be a number or a list of numbers, got {value!r}")
    return [float(v) for v in vals]


def _check_set_lengths(tap, bound: dict, where: str) -> None:
    """set(cols, value): a list of values needs one value per column."""
    if tap.action != "set":
        return
    args = {a.name: a for a in tap.args}
    cols = bound.get(args["cols"].param) if args["cols"].param else args["cols"].value
    vals = bound.get(args["value"].param) if args["value"].param else args["value"].value
    if cols is None or vals is None:
        return
    n_vals = 1 if isinstance(vals, (int, float)) else len(vals)
    if n_vals not in (1, len(cols)):
        raise RequestError(f"{where}: `{tap.source}` gets {n_vals} values for {len(cols)} columns")
