"""`call` taps against the compiled functions they name: argument kinds, results, refusals.

The resolver leaves a `call` tap's argument kinds open (the tap names a function, not an op with
a fixed signature). Here each one meets its function's declaration (tapc/lang/functions.py):
parameters the tap leaves out bind to request parameters of the same name, literals are checked
against the point, and every declared result becomes a capture at the point (`key:fn.result`),
kept per request like any capture. A function that cannot live in a graph is refused here, with
torch.compile's reason and the user's line, before any engine starts.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import inspect
import logging
from collections.abc import Callable, Mapping

from tapc.errors import PlanError
from tapc.lang.functions import Batch, signature_of
from tapc.plan.tapplan import READ, Arg, FunctionSpec, PlannedTap

ROWS = 4   # rows of the CPU tensors a function is traced on


def function_specs(functions: Mapping[str, Callable] | None) -> dict[str, FunctionSpec]:
    """Each function's declaration and code hash, by name."""
    out = {}
    for name, fn in (functions or {}).items():
        if not isinstance(name, str) or not name.isidentifier():
            raise PlanError(f"functions: {name!r} is not a name a tap can call (an identifier)")
        if not callable(fn):
            raise PlanError(f"functions: {name!r} is a {type(fn).__name__}, not a function or a module")
        sig = signature_of(fn)
        out[name] = FunctionSpec(name, sig.params, sig.results, code_hash(fn))
    return out


# While set (`pickled_once`): id(function) -> (the function, its pickle), so that the plan's hash
# and the file the workers load are made from one pickle (an SAE's weights are hundreds of MB).
_PICKLES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tapc_pickles", default=None)


@contextlib.contextmanager
def pickled_once():
    """Within it, `pickled` pickles each function once: around a plan and the file shipped
    with it. Outside, every call pickles afresh (a module's weights may have changed since)."""
    token = _PICKLES.set({})
    try:
        yield
    finally:
        _PICKLES.reset(token)


def pickled(fn) -> bytes:
    """`fn` pickled by value: its code, closure and a module's weights."""
    import cloudpickle

    kept = _PICKLES.get()
    if kept is not None and id(fn) in kept:
        return kept[id(fn)][1]
    data = cloudpickle.dumps(fn)
    if kept is not None:
        kept[id(fn)] = (fn, data)   # the function held with it: its id is no other's meanwhile
    return data


def code_hash(fn) -> str:
    """sha256 of the function's pickle (`pickled`) and of the file it was defined in (cloudpickle
    pickles an importable function by reference)."""
    h = hashlib.sha256(pickled(fn))
    try:
        source = inspect.getsourcefile(fn if inspect.isfunction(fn) or inspect.isclass(fn) else type(fn))
        if source:
            with open(source, "rb") as f:
                h.update(f.read())
    except (OSError, TypeError):   # a function made in a notebook or by exec: its pickle holds its code
        pass
    return h.hexdigest()[:16]


def complete_calls(taps: list[PlannedTap], specs: Mapping[str, FunctionSpec]) -> list[PlannedTap]:
    """`taps` with each `call` tap's arguments checked and typed, each followed by a capture tap
    per result of its function."""
    out: list[PlannedTap] = []
    results: dict[str, PlannedTap] = {}
    for tap in taps:
        if tap.action != "call":
            out.append(tap)
            continue
        spec = specs.get(tap.function)
        if spec is None:
            given = ", ".join(sorted(specs)) or "none"
            raise PlanError(f"`{tap.source}`: no compiled function {tap.function!r} was given (functions: {given}); "
                            "pass functions={name: fn} to the engine, or name it in a spec's `functions:`")
        out.append(dataclasses.replace(tap, args=_typed_args(tap, spec)))
        for name, width, dtype in spec.results:
            point = dataclasses.replace(tap.point, result=f"{spec.name}.{name}")
            res = PlannedTap(source=tap.source, point=point, action="capture", kind=READ, function=spec.name,
                             width=width or tap.width, dtype=dtype, layer=tap.layer)
            if res.key in results:
                raise PlanError(f"{res.key} is a result of both `{results[res.key].source}` and `{tap.source}`: "
                                "one function runs once at a point")
            results[res.key] = res
            out.append(res)
    return out


def _typed_args(tap: PlannedTap, spec: FunctionSpec) -> tuple[Arg, ...]:
    given = {a.name: a for a in tap.args}
    kinds = dict(spec.params)
    unknown = [n for n in given if n != "at" and n not in kinds]
    if unknown:
        takes = ", ".join(kinds) or "no parameters"
        raise PlanError(f"`{tap.source}`: function {spec.name!r} has no parameter {unknown[0]!r} (it takes {takes})")
    args = []
    for name, kind in spec.params:
        # left out of the tap: bound per request under its own name
        arg = given.get(name) or Arg(name=name, kind=kind, param=name)
        if arg.param is None:
            _check_literal(tap, name, kind, arg.value)
        args.append(dataclasses.replace(arg, kind=kind))
    return (*args, given["at"])


def _check_literal(tap: PlannedTap, name: str, kind: str, value) -> None:
    if kind == "scalar" and not isinstance(value, (int, float)):
        raise PlanError(f"`{tap.source}`: parameter {name!r} is a scalar; give a number or a parameter name")
    if kind == "vector" and not (isinstance(value, tuple) and len(value) == tap.width):
        raise PlanError(f"`{tap.source}`: parameter {name!r} is a vector of the point's {tap.width} columns; give "
                        f"{tap.width} numbers or a parameter name")


# ----------------------------------------------------------------------------- in a graph, or refused


def check_function(fn: Callable, spec: FunctionSpec, tap: PlannedTap) -> None:
    """Trace `fn` as the engine will run it at `tap`'s point, on small CPU tensors, with
    torch.compile's Dynamo: a graph break (a data-dependent Python branch, `.item()`, a host
    sync, an op that does not compile) or an error is a PlanError with Dynamo's reason and the
    user's file and line; so is a return value unlike the declaration."""
    import torch
    import torch._dynamo

    dtype = getattr(torch, tap.dtype)
    x = torch.randn(ROWS, tap.width).to(dtype)
    mask = torch.tensor([True, False] * (ROWS // 2))
    slot = torch.where(mask, 0, -1).to(torch.int32)
    position = torch.arange(ROWS)
    params = {name: torch.zeros(ROWS) if kind == "scalar" else torch.zeros(ROWS, tap.width) for name, kind in spec.params}
    where = f"`{tap.source}`: function {spec.name!r}"

    def run(x, mask, slot, position, *values):
        return fn(x, Batch(mask, slot, position, dict(zip(params, values))))

    args = (x, mask, slot, position, *params.values())
    try:
        with _quiet("torch._subclasses.fake_tensor", "torch._dynamo"):   # they log what they raise, with tracebacks
            explained = torch._dynamo.explain(run)(*args)
    except Exception as e:
        try:   # eagerly, the user's own error from the user's own line
            run(*args)
        except Exception as eager:
            raise PlanError(f"{where} fails on a [{ROWS}, {tap.width}] {tap.dtype} tensor: "
                            f"{type(eager).__name__}: {_first_line(eager)}{_user_line(eager)}") from None
        raise PlanError(f"{where} cannot be traced by torch.compile: {_first_line(e)}") from None
    if explained.break_reasons:   # (graph_break_count misses a break after which no op is left)
        reason = explained.break_reasons[0]
        frame = reason.user_stack[-1] if reason.user_stack else None
        at = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
        raise PlanError(f"{where} cannot run inside a compiled graph{at}: {_first_line(reason.reason)}. Make it "
                        "branch-free tensor code (torch.where instead of `if`, no .item() or .tolist()), or run "
                        "it as a Python block (`-> name`)")
    _check_returned(run(*args), spec, tap, where)


def _check_returned(out, spec: FunctionSpec, tap: PlannedTap, where: str) -> None:
    import torch

    edited, results = (out, None) if isinstance(out, torch.Tensor) or out is None else \
        (None, out) if isinstance(out, dict) else out if isinstance(out, tuple) and len(out) == 2 else (False, None)
    if edited is False:
        raise PlanError(f"{where} returned a {type(out).__name__}; return the edited activation, a dict of its "
                        "results, or (activation, results)")
    if edited is not None and (not isinstance(edited, torch.Tensor) or tuple(edited.shape) != (ROWS, tap.width)):
        shape = tuple(edited.shape) if isinstance(edited, torch.Tensor) else type(edited).__name__
        raise PlanError(f"{where} returned an activation of {shape}; it must keep the point's shape "
                        f"[rows, {tap.width}]")
    declared = {name: width or tap.width for name, width, _ in spec.results}
    got = results or {}
    if set(got) != set(declared):
        raise PlanError(f"{where} returned results {sorted(got)} but declares {sorted(declared)} "
                        "(tapc.function(results=...))")
    for name, value in got.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (ROWS, declared[name]):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PlanError(f"{where} result {name!r} is {shape}; it is declared [rows, {declared[name]}]")


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _first_line(e) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _user_line(e: BaseException) -> str:
    """` (file:line)` of the innermost frame of the traceback outside torch and tapc."""
    tb, found = e.__traceback__, ""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "/torch/" not in name and "/tapc/" not in name:
            found = f" ({name}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found
