"""`.source` points: a module's forward, rewritten so that tap ops run at a call inside it.

The forward's source is parsed and its calls named exactly as the plan named them
(`tapc.plan.forwards.forward_calls`: `self_qkv_proj_0`, `qkv_split_0`, ...). A tapped call `f(a, ...)`
becomes `__tapc_out("name", f(__tapc_in("name", a), ...))`; the two helpers run the ops bound to
that call on its result (element k of a tuple result; a vLLM linear's `out`) or on its first
argument, and return the value unchanged (edits are in place). The rewritten function is
compiled with the original's globals (the helpers are closure cells) and bound to this module instance, so Dynamo inlines it
like any patched forward and the ops land in the compiled graph.
"""
from __future__ import annotations

import ast
import types
from collections import defaultdict

import torch

from tapc.errors import EngineError
from tapc.plan.forwards import forward_calls


def rewrite_forward(module: torch.nn.Module, path: str, taps: list) -> types.MethodType:
    """`module`'s forward with `taps` ((PlannedTap, op) at `.source` points) in place."""
    cls = type(module)
    found = forward_calls(cls)
    original = cls.forward
    if found is None or original.__closure__:
        raise EngineError(f"`{path}`: tapc cannot rewrite {cls.__qualname__}.forward for `.source` taps "
                          f"({'no source' if found is None else 'it closes over variables'})")
    fn_def, _, named = found
    calls = dict(named)
    outs, ins = defaultdict(list), defaultdict(list)
    for tap, op in taps:
        point = tap.point
        if point.op not in calls:
            raise EngineError(f"`{tap.source}`: {cls.__qualname__}.forward has no call {point.op!r} in this "
                              f"engine (its calls: {', '.join(calls)}): was the plan built for another vLLM?")
        if point.io == "input":
            if not calls[point.op].args:
                raise EngineError(f"`{tap.source}`: `{ast.unparse(calls[point.op])}` has no positional argument")
            ins[point.op].append(op)
        else:
            outs[point.op].append((point.element, op))

    wrap = {id(calls[name]): name for name in outs}
    for name in ins:
        call = calls[name]
        call.args[0] = ast.Call(ast.Name("__tapc_in", ast.Load()), [ast.Constant(name), call.args[0]], [])

    class Wrap(ast.NodeTransformer):
        def visit_Call(self, node):
            self.generic_visit(node)
            name = wrap.get(id(node))
            return node if name is None else ast.Call(ast.Name("__tapc_out", ast.Load()), [ast.Constant(name), node], [])

    fn_def = Wrap().visit(fn_def)
    # The helpers reach the new forward as closure cells, and its globals stay the module's own
    # (Dynamo resolves globals through the module they belong to).
    make = ast.FunctionDef(
        name="__tapc_make", args=ast.arguments(posonlyargs=[], args=[ast.arg("__tapc_out"), ast.arg("__tapc_in")],
                                               kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[fn_def, ast.Return(ast.Name(fn_def.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
    code = compile(ast.fix_missing_locations(ast.Module([make], [])),
                   f"<tapc .source rewrite of {cls.__qualname__}.forward>", "exec")

    def tapc_out(name, value):
        for element, op in outs[name]:
            if element is not None and not isinstance(value, tuple):  # never the tensor under the label `[k]`
                raise EngineError(f"`{path}.source.{name}.output[{element}]`: the call returned one tensor here, "
                                  "not a tuple; the plan was built for a model that calls it differently")
            op(value[element or 0] if isinstance(value, tuple) else value, None)
        return value

    def tapc_in(name, value):
        for op in ins[name]:
            op(value, None)
        return value

    local: dict = {}
    exec(code, original.__globals__, local)
    return types.MethodType(local["__tapc_make"](tapc_out, tapc_in), module)
