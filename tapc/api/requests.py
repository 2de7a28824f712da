"""What one request asks of a tapped engine, checked against the plan before it is submitted.

A `TapRequest` names the captures it wants (point keys, tap lines of the plan, or "*"), which
positions to capture, and values for the plan's named parameters. `check` checks it and
turns it into an `Ask` (protocol.py: plain data, lists, numbers, strings, bytes), which travels
to the engine-core process in `SamplingParams.extra_args["tapc"]` under the id the session
gives each submitted request; anything wrong is a `RequestError` for that request, raised
before the engine sees it.

Which rows `positions` covers is tapc/wire/positions.py.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from tapc.errors import RequestError
from tapc.lang.edits import CALL, EDITS, POSITIONS, check_param, listed, patch_rows, set_lengths
from tapc.lang.quoted import shown
from tapc.plan.tapplan import TapPlan
from tapc.wire.protocol import Ask

ENGINE_POINTS = ("logits", "samples")
# Without the engine's max_model_len, the most positions a request may list.
MAX_LISTED = 1 << 20


@dataclass(frozen=True)
class TapRequest:
    """One request's taps: what to capture, where, and the values of named edit parameters.

    capture:   point keys (`model.layers.3.resid`), tap lines of the plan (a glob line means all
               its points), or "*" for every capture the request can have: every capture of
               the plan but the results of compiled functions it does not apply.
    positions: "all" | "prompt" | "generated" | "last", or a list of absolute positions.
    params:    parameter name -> value: a vector (list, numpy array or tensor) for `vector`
               parameters, a number for `scalar`, column indices for `columns`, a number or a
               list (one per column) for `values`, `{"positions": [p, ...], "rows": [n, width]}` for
               a `patch`'s rows. An edit tap applies to a request that binds
               all of its parameters; edits without parameters apply to every request.
    blocks:    block name -> a function `f(ctx, x)` run for this request instead of the engine's
               block of that name (see tapc.worker.runtime); it is pickled to the worker.
    """

    capture: str | Sequence[str] = ()
    positions: str | Sequence[int] = "all"
    params: Mapping[str, Any] = field(default_factory=dict)
    blocks: Mapping[str, Any] = field(default_factory=dict)


def check(plan: TapPlan, req: TapRequest, where: str, max_model_len: int | None = None) -> Ask:
    """Check `req` against `plan`; what the engine's workers read. `where` names the request in
    error messages (e.g. "request 3"); `max_model_len`, the engine's, where known, bounds how
    many positions it may list."""
    check_fields(req, where)
    positions = _positions(req.positions, where, max_model_len)
    params = _params(plan, req.params, where)
    unapplied = _unapplied(plan, params)
    keys = _capture_keys(plan, req.capture, where, unapplied)
    asked = [k for k in keys if k in unapplied]
    if asked:
        raise RequestError(f"{where}: {unapplied[asked[0]]}")
    return Ask(capture=tuple(k for k in keys if k not in ENGINE_POINTS),
               engine=tuple(k for k in keys if k in ENGINE_POINTS),
               positions=positions if isinstance(positions, str) else tuple(positions),
               params=params, blocks=_blocks(plan, req.blocks, where))


def _unapplied(plan: TapPlan, params: dict) -> dict[str, str]:
    """The compiled functions' results that are not the request's own, key -> why: a result is
    the request's only where it applies the function (binds its parameters); other rows run it
    with another request's values."""
    if not plan.functions:
        return {}
    calls = {(dataclasses.replace(t.point, result=None), t.function): t for t in plan.taps if t.action == CALL}
    out = {}
    for tap in (t for t in plan.taps if t.action == "capture" and t.function is not None):
        call = calls[(dataclasses.replace(tap.point, result=None), tap.function)]
        missing = [a.param for a in call.args if a.param is not None and a.param not in params]
        if missing:
            out[tap.key] = (f"{tap.key} is a result of `{call.source}`, which runs with the request's "
                            f"{', '.join(map(repr, missing))}: bind them to capture it")
    return out


def check_fields(req, where: str) -> None:
    """`req` is a TapRequest whose fields have types they take; `check` checks their values
    against the plan."""
    if not isinstance(req, TapRequest):
        raise RequestError(f"{where}: taps must be a tapc.TapRequest, got {shown(req)}")
    capture = req.capture
    if not isinstance(capture, (str, Iterable)) or isinstance(capture, (bytes, bytearray, Mapping)):
        raise RequestError(f'{where}: capture must be a capture\'s name, "*" or a list of them, got {shown(capture)}')
    for name in ("params", "blocks"):
        if not isinstance(getattr(req, name), Mapping):
            raise RequestError(f"{where}: {name} must be a mapping of name -> value, got {shown(getattr(req, name))}")


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


def _capture_keys(plan: TapPlan, capture, where: str, unapplied: Mapping) -> list[str]:
    """The keys `capture` names; "*": every capture the request can have (not the `unapplied`
    results of functions it does not apply)."""
    items = [capture] if isinstance(capture, str) else capture
    reads = [t for t in plan.taps if t.action == "capture"]
    keys: dict[str, None] = {}
    for item in items:
        if not isinstance(item, str):
            raise RequestError(f"{where}: capture names captures by strings, got {shown(item)} in {shown(capture)}")
        if item == "*":
            keys.update(dict.fromkeys(t.key for t in reads if t.key not in unapplied))
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


def _positions(positions, where: str, max_model_len: int | None):
    if isinstance(positions, str):
        if positions not in POSITIONS:
            raise RequestError(f"{where}: positions {positions!r}: use one of {', '.join(POSITIONS)} "
                               "or a list of token positions")
        return positions
    # no more are read than a request can have rows: a range(10**9) is refused, not made a list
    most, of = (max_model_len - 1, f"a request of max_model_len={max_model_len} has") if max_model_len \
        else (MAX_LISTED, "a list may hold")
    out = listed(positions, most + 1)
    if out is not None and len(out) > most:
        raise RequestError(f"{where}: positions lists more than {most} positions, the most {of}, "
                           f"got {shown(positions)}")
    if out == []:   # an empty selection would capture nothing, and say so nowhere
        raise RequestError(f"{where}: positions [] lists no position; list one or more, or use one of "
                           f"{', '.join(POSITIONS)}")
    # numpy's integers count (Integral); 2.5 or True is not a position
    if out is None or not all(isinstance(p, Integral) and not isinstance(p, bool) and p >= 0 for p in out) \
            or len(set(out)) != len(out):
        raise RequestError(f"{where}: positions must be one of {', '.join(POSITIONS)} or a list of distinct "
                           f"non-negative token positions (integers), got {shown(positions)}")
    return sorted(int(p) for p in out)


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
    # the edits and calls (in the graphs and on the logits) that read a bound parameter
    for tap in (t for t in plan.taps_reading(out) if t.action in EDITS or t.action == CALL):
        names = [a.param for a in tap.args if a.param is not None]
        given = [n for n in names if n in out]
        if len(given) != len(names) and not partial:
            missing = [n for n in names if n not in out]
            raise RequestError(f"{where}: `{tap.source}` needs {', '.join(map(repr, names))}; the request "
                               f"binds {', '.join(map(repr, given))} but not {', '.join(map(repr, missing))}")
        _check_set_lengths(tap, out, where)
    return out


def _value(plan: TapPlan, spec, value, where: str):
    users = plan.param_users[spec.name]
    width = spec.width if spec.width is not None else min(t.width for t in users)
    try:
        out = check_param(spec.kind, value, width)
    except ValueError as e:
        raise RequestError(f"{where}: parameter {spec.name!r} ({spec.kind}) {e}") from None
    if spec.kind == "rows":   # no more than its tables hold
        room, tap = min(((next(a.value for a in t.args if a.name == "rows"), t) for t in users), key=lambda rt: rt[0])
        n = len(patch_rows(out)[0])
        if n > room:
            raise RequestError(f"{where}: parameter {spec.name!r} has {n} rows, but `{tap.source}` holds {room} "
                               f"a request (set `rows=` in the tap: `patch({spec.name}, rows={n})`)")
    return out


def patch_positions(plan: TapPlan, params: Mapping) -> list[int]:
    """The positions a request's patch() rows are for, all of its parameters together."""
    names = {p.name for p in plan.params if p.kind == "rows"}
    return sorted({int(p) for name, v in params.items() if name in names for p in patch_rows(v)[0]})


def _check_set_lengths(tap, bound: dict, where: str) -> None:
    """set(cols, value): a list of values needs one value per column."""
    if tap.action != "set":
        return
    args = {a.name: a for a in tap.args}
    cols = bound.get(args["cols"].param) if args["cols"].param else args["cols"].value
    vals = bound.get(args["value"].param) if args["value"].param else args["value"].value
    why = set_lengths(cols, vals)
    if why:
        raise RequestError(f"{where}: `{tap.source}` {why}")
