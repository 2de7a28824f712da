"""Module forwards read from their source with `ast`: their calls, named as nnsight names them
(`forward_calls`), sized where they can be (`source_ops`, with `Widths`, the per-token widths of
a module by its role), and how a norm is called where its caller calls it (`norm_kind`).

The planner names and sizes `.source` points with this, and the worker rewrites the calls so
named (`tapc/worker/source.py`): both must name them with the same code. It lives in `plan`
because the import contracts (pyproject.toml) let the worker import `tapc.plan` and forbid the
reverse. Its code decides which call a `.source` tap wraps, so the compile-cache digest covers
it (GRAPH_MODULES, tapc/api/engine_args.py).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from tapc.plan.tree import SourceOp


def norm_kind(model, path: str, layer: int | None) -> str:
    """What a norm returns where its caller calls it: "norm" (normed, residual) when called with a
    residual, "tensor" without, "heads" on a per-head view. vLLM's decoder layers call their first
    norm under `if residual is None:` without one, and the stack starts with residual None: so
    that norm returns one tensor in layer 0 and a pair in the others."""
    parent_path, _, attr = path.rpartition(".")
    sites = _call_sites(type(model.get_submodule(parent_path)) if parent_path else type(model), attr)
    if not sites:
        return "tensor"  # not called where we can read it: refuse elements rather than guess
    if any(s.per_head for s in sites):
        return "heads"
    if all(s.args >= 2 for s in sites):
        return "norm"
    if all(s.args == 1 for s in sites):
        return "tensor"
    guarded = all(s.under_none_check for s in sites if s.args == 1)
    return ("tensor" if layer == 0 else "norm") if guarded and layer is not None else "tensor"


@dataclass(frozen=True)
class _CallSite:
    args: int                 # arguments passed (positional and keyword)
    under_none_check: bool    # inside the body of an `if X is None:`
    per_head: bool            # its first argument was made by `.view(...)`/`.reshape(...)` with more dims


def _none_branches(fn: ast.FunctionDef) -> tuple[set[int], set[int]]:
    """ids of the AST nodes in the bodies, and in the else branches, of `if X is None:` in `fn`."""
    body: set[int] = set()
    orelse: set[int] = set()
    for node in ast.walk(fn):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Compare) and len(test.ops) == 1 \
                and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Constant) \
                and test.comparators[0].value is None:
            body.update(id(n) for stmt in node.body for n in ast.walk(stmt))
            orelse.update(id(n) for stmt in node.orelse for n in ast.walk(stmt))
    return body, orelse


def _per_head_names(fn: ast.FunctionDef) -> set[str]:
    """Names a forward assigns from a `.view`/`.reshape`/`.unflatten` into 3+ dims (a per-head view,
    `q.view(*q.shape[:-1], heads, head_dim)`): not [tokens, width] rows."""
    return {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in ("view", "reshape", "unflatten")
            and (len(node.value.args) >= 3 or any(isinstance(a, ast.Starred) for a in node.value.args))
            for t in node.targets if isinstance(t, ast.Name)}


def _call_sites(cls, attr: str) -> list[_CallSite]:
    """Every `self.<attr>(...)` in `cls.forward`."""
    found = forward_calls(cls)
    if found is None:
        return []
    fn, _, _ = found
    guarded, _ = _none_branches(fn)
    reshaped = _per_head_names(fn)
    sites = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            first = node.args[0] if node.args else None
            sites.append(_CallSite(args=len(node.args) + len(node.keywords), under_none_check=id(node) in guarded,
                                   per_head=isinstance(first, ast.Name) and first.id in reshaped))
    return sites


class Widths:
    """Per-token widths by module role; containers (attention block, MLP, MoE block) map hidden -> hidden."""

    def __init__(self, hidden: int):
        self.hidden = hidden

    def of(self, mod, path: str, model, is_layer: bool) -> tuple[str, int | None, int | None]:
        import torch
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        name = type(mod).__name__
        if is_layer:
            return "pair", self.hidden, self.hidden
        if name.endswith("WithLoRA") and isinstance(getattr(mod, "base_layer", None), torch.nn.Module):
            return self.of(mod.base_layer, path, model, False)   # a LoRA wrapper returns what its base returns
        if isinstance(mod, LinearBase):
            # ReplicatedLinear (MoE gates) has no per-partition sizes: it is not sharded
            w_in = getattr(mod, "input_size_per_partition", mod.input_size)
            return "linear", int(w_in), int(getattr(mod, "output_size_per_partition", mod.output_size))
        if isinstance(mod, VocabParallelEmbedding):
            return ("none", None, None) if "LMHead" in name else ("tensor", None, int(mod.embedding_dim))
        if name.endswith("Norm"):
            w = getattr(mod, "weight", None)
            width = int(w.shape[0]) if w is not None and w.dim() == 1 else self.hidden
            return "norm", width, width
        if hasattr(mod, "kv_lora_rank") and hasattr(mod, "v_head_dim") and hasattr(mod, "impl"):
            # MLA attention: called with (q per head, the kv latent, the rope key), returns
            # [tokens, heads * v_head_dim]; its head_size is the latent's, not the output's
            return "tensor", None, int(mod.num_heads * mod.v_head_dim)
        if name in ("Attention", "EncoderOnlyAttention") or hasattr(mod, "num_kv_heads") and hasattr(mod, "head_size"):
            width = int(mod.num_heads * mod.head_size)
            return "tensor", width, width
        if name.endswith("AndMul"):
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else None
            up = getattr(parent, "gate_up_proj", None)
            if up is not None:
                out = int(getattr(up, "output_size_per_partition", up.output_size)) // 2
                return "tensor", 2 * out, out
            return "tensor", None, None
        if "Rotary" in name or name == "ApplyRotaryEmb":
            return "tuple", None, None
        if name in ("LogitsProcessor", "ModuleList") or name.endswith("Sampler"):
            return "none", None, None
        return "tensor", self.hidden, self.hidden

    def of_child(self, owner, attr: str, model, path: str):
        child = getattr(owner, attr, None)
        import torch

        if not isinstance(child, torch.nn.Module):
            return None
        return self.of(child, f"{path}.{attr}", model, False)


def _call_name(func: ast.expr) -> str:
    """`self.qkv_proj` -> "self_qkv_proj"; `qkv.split` -> "qkv_split"; `f(x).view` -> "view"."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return "_".join(reversed(parts))


def forward_calls(cls) -> tuple[ast.FunctionDef, int, list[tuple[str, ast.Call]]] | None:
    """The parsed `cls.forward`, its first line in its file, and its calls in source order, each
    named as nnsight names them (`<receiver>_<callee>_<k>`). None when there is no source.
    The engine rewrites forwards with the same names (tapc/worker/source.py)."""
    try:
        lines, start = inspect.getsourcelines(cls.forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    return tree.body[0], start, named_calls(tree)


def named_calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """The calls under `tree` in source order, each named as nnsight names them
    (`<receiver>_<callee>_<k>`)."""
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    counts: dict[str, int] = {}
    named = []
    for call in calls:
        base = _call_name(call.func)
        if not base:
            continue
        k = counts.get(base, 0)
        counts[base] = k + 1
        named.append((f"{base}_{k}", call))
    return named


def source_ops(mod, model, path: str, widths: Widths, stack_index: int | None) -> tuple[SourceOp, ...]:
    """The calls in `type(mod).forward`, in source order, with widths where they can be known. In
    a decoder layer (`stack_index` its place in the stack), the calls under `if residual is None:`
    run only in layer 0 and those of its `else:` only after: each layer lists the calls it runs."""
    found = forward_calls(type(mod))
    if found is None:
        return ()
    fn, start, named = found
    per_head = _per_head_names(fn)
    first_only, later_only = _none_branches(fn) if stack_index is not None else (set(), set())
    skip = later_only if stack_index == 0 else first_only
    ops = []
    for name, call in named:
        if id(call) in skip:
            continue
        out_widths, in_width, linear = _call_widths(mod, model, path, call, widths, per_head)
        text = ast.unparse(call)
        ops.append(SourceOp(name=name, call=text if len(text) <= 80 else text[:77] + "...",
                            line=start + call.lineno - 1, out_widths=out_widths, in_width=in_width, linear=linear))
    return tuple(ops)


def _call_widths(mod, model, path: str, call: ast.Call, widths: Widths, per_head: set[str]):
    """Widths of a call's output(s) and first input: submodule calls and `x.split([sizes])`. A
    norm's call is sized as it is made: on a per-head view, unsizable; with a residual, two tensors."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        role = widths.of_child(mod, func.attr, model, path)
        if role is not None:
            output, w_in, w_out = role
            if output in ("tuple", "none") or w_out is None:
                return None, w_in, False
            if output == "norm":
                if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in per_head:
                    return None, None, False
                n_args = len(call.args) + len(call.keywords)
                return ((w_out, w_out) if n_args >= 2 else (w_out,)), w_in, False
            return (w_out,), w_in, output == "linear"
    if isinstance(func, ast.Attribute) and func.attr == "split" and call.args:
        try:  # sizes are usually attributes of self: qkv.split([self.q_size, self.kv_size, self.kv_size])
            sizes = eval(compile(ast.Expression(call.args[0]), "<split>", "eval"), {"__builtins__": {}}, {"self": mod})
        except Exception:
            return None, None, False
        if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
            return tuple(int(s) for s in sizes), int(sum(sizes)), False
    return None, None, False
