"""One TapSpec + a ModuleTree -> PlannedTaps: globs expanded, points checked, kinds assigned.

Every way a tap can miss the model has its own message: the nearest real module paths for a
typo, the `.source` ops that do exist, the elements a tuple output has (per layer where they
differ), why an edit cannot run in-graph at a point and what would. A `*` skips the children
its point does not apply to (`self_attn.*.output` and the rotary embedding) and says so.
"""
from __future__ import annotations

import difflib
import logging
import re

from tapc.errors import ResolveError
from tapc.lang.edits import EDITS, LENS, PATTERN, check_at_point
from tapc.lang.syntax import Param, Slice, Star, TapSpec, parse_tap
from tapc.plan.pattern import pattern_point
from tapc.plan.tapplan import BLOCK, EDIT, ENGINE, READ, Arg, PlannedTap, Point, TapPlan
from tapc.plan.tree import ModuleTree, Node

log = logging.getLogger(__name__)   # "tapc.plan.resolve": `tapc explain` says its skips as notes instead


def resolve_tap(spec: TapSpec, tree: ModuleTree) -> list[PlannedTap]:
    """All the taps one spec line stands for, in model order."""
    if spec.is_engine_point:
        return [_engine_tap(spec, tree)]
    taps, skipped = resolve_glob(spec, tree)
    if skipped:
        log.warning("%s", _skip_note(spec, skipped))
    return taps


def resolve_glob(spec: TapSpec, tree: ModuleTree) -> tuple[list[PlannedTap], list[tuple[str, str]]]:
    """A module tap's planned taps, and the (path, why) its `*` matched where the point does not
    apply. A path the user named, or a `*` whose every match misses, is an error."""
    globbed = any(isinstance(seg, Star) for seg in spec.path)
    taps: list[PlannedTap] = []
    skipped: list[tuple[str, str]] = []
    first: ResolveError | None = None
    for path in expand(spec, tree):
        node = tree.by_path[path]
        where = f"{_where(spec)} at `{node.path}` ({node.cls})"
        try:
            points = _point(spec, where, node, tree)
        except ResolveError as e:
            if not globbed:
                raise
            first = first or e
            skipped.append((path, str(e).removeprefix(f"{where}: ")))
            continue
        taps.extend(_planned(spec, point, width, _dtype(node, point, tree), node.layer) for point, width in points)
    if not taps:
        assert first is not None  # expand matched something, so each match raised
        raise first
    return taps, skipped


def notes(plan: TapPlan, tree: ModuleTree) -> list[str]:
    """What `tapc explain` adds under the table: children a `*` skipped, and decoder-layer
    `.output`s taken in nnsight's sense (both tensors of the tuple)."""
    out = []
    for source in dict.fromkeys(t.source for t in plan.taps):
        spec = parse_tap(source)
        if spec.is_engine_point:
            continue
        taps, skipped = resolve_glob(spec, tree)
        if skipped:
            out.append(_skip_note(spec, skipped))
        both = {tree.by_path[t.point.module].output for t in taps if spec.site == "output" and spec.element is None
                and t.point.element == 1}
        if "pair" in both:
            out.append(f"`{source}`: a decoder layer returns (hidden_states, residual), so its `.output` is "
                       "both tensors, captured as `.output[0]` and `.output[1]` (as nnsight reads it); "
                       "`.resid` is their sum, the residual stream")
        patterns = [t for t in taps if t.point.site == PATTERN]
        if patterns:
            out.append(f"`{source}`: a pattern row is every asked head's weights over keys 0..keys-1 (zeros past its "
                       f"position), float32, and each pool holds max_num_batched_tokens rows, so its buffer grows with "
                       f"heads x keys; bound it with `| capture(heads=[...], keys=N)` or a smaller max_model_len. A "
                       f"request's positions must lie below keys")
        if "routing" in both:
            out.append(f"`{source}`: an MoE router returns (topk_weights, topk_ids), so its `.output` is both, "
                       "captured as `.output[0]` (the weights, float32) and `.output[1]` (the expert ids, int32)")
    return out


def _skip_note(spec: TapSpec, skipped: list[tuple[str, str]]) -> str:
    shown = "; ".join(f"`{path}` ({why})" for path, why in skipped[:4])
    more = f"; and {len(skipped) - 4} more" if len(skipped) > 4 else ""
    return f"`{spec.text}` skips {len(skipped)} match(es) its point does not apply to: {shown}{more}"


def expand(spec: TapSpec, tree: ModuleTree) -> list[str]:
    """Module paths the spec's path matches, in model order. Nothing matched is an error."""
    prefixes = [""]
    for depth, seg in enumerate(spec.path):
        nxt: list[str] = []
        for prefix in prefixes:
            children = tree.children(prefix)
            join = (lambda c: f"{prefix}.{c}") if prefix else (lambda c: c)
            if isinstance(seg, str):
                if seg in children:
                    nxt.append(join(seg))
            elif isinstance(seg, Star):
                nxt.extend(join(c) for c in children)
            else:
                numbered = [c for c in children if c.isdigit()]
                if not numbered:
                    raise ResolveError(f"{_where(spec)}: `{prefix}` has no numbered children to select with "
                                       f"{_show(seg)}; its children are {_listing(children)}")
                picked = _select(seg, numbered, spec, prefix)
                nxt.extend(join(c) for c in picked)
        if not nxt:
            raise ResolveError(_no_match(spec, tree, prefixes, seg, depth))
        prefixes = nxt
    return prefixes


def _select(seg, numbered: list[str], spec: TapSpec, prefix: str) -> list[str]:
    if isinstance(seg, Slice):
        if seg.step == 0:
            raise ResolveError(f"{_where(spec)}: a slice step cannot be 0")
        return numbered[slice(seg.start, seg.stop, seg.step)]
    n = len(numbered)
    missing = [i for i in seg.indices if not -n <= i < n]
    if missing:
        raise ResolveError(f"{_where(spec)}: `{prefix}` has no {', '.join(map(str, missing))}: "
                           f"it has {numbered[0]}..{numbered[-1]}")
    return [numbered[i] for i in seg.indices]


def _show(seg) -> str:
    if isinstance(seg, Slice):
        parts = ["" if v is None else str(v) for v in (seg.start, seg.stop, seg.step)]
        return f"[{':'.join(parts if seg.step is not None else parts[:2])}]"
    return f"[{','.join(map(str, seg.indices))}]"


def _no_match(spec: TapSpec, tree: ModuleTree, prefixes: list[str], seg, depth: int) -> str:
    shown = ""
    for s in spec.path[: depth + 1]:  # selectors attach to the name before them: layers[0:4]
        shown += (f".{s}" if isinstance(s, str) else ".*" if isinstance(s, Star) else _show(s)) if shown else str(s)
    if isinstance(seg, str):
        numbered = [c for c in tree.children(prefixes[0]) if c.isdigit()]
        if seg.isdigit() and numbered:
            return f"{_where(spec)}: no module `{shown}`: `{prefixes[0]}` has {numbered[0]}..{numbered[-1]}"
        wanted = [f"{p}.{seg}" if p else seg for p in prefixes]
        level = [n.path for n in tree.nodes if n.path.count(".") == wanted[0].count(".")]
        near = difflib.get_close_matches(wanted[0], level, n=3, cutoff=0.6)
        if near:
            return f"{_where(spec)}: no module `{shown}`; did you mean {_listing(near)}?"
        return f"{_where(spec)}: no module `{shown}`; `{prefixes[0] or '(root)'}` has {_listing(tree.children(prefixes[0]))}"
    if isinstance(seg, Slice):
        return f"{_where(spec)}: the selection `{shown}` matches no module"
    return f"{_where(spec)}: `{shown}` matches nothing: `{prefixes[0]}` has no children"


def _listing(names) -> str:
    names = list(names)
    shown = ", ".join(f"`{n}`" for n in names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "nothing"


def _where(spec: TapSpec) -> str:
    return f"tap `{spec.text}`" + (f" (line {spec.line})" if spec.line > 1 else "")


# ----------------------------------------------------------------------------- points


def _point(spec: TapSpec, where: str, node: Node, tree: ModuleTree) -> list[tuple[Point, int]]:
    """The point(s) a tap names at one module, with their widths (two only for a decoder layer's
    bare `.output` captured in nnsight's sense)."""
    el = spec.element
    if node.why:
        raise ResolveError(f"{where}: {node.why}")
    if spec.action.op == "block" and node.in_moe_op:
        raise ResolveError(f"{where}: it runs inside vLLM's fused-MoE op (vllm::moe_forward), which the compiled "
                           "graph calls as one opaque op: the graph cannot be split there for a Python block. "
                           "Capture or edit it in-graph, or run the block at the MoE block's `.output`")
    if spec.site == PATTERN:   # tapc/plan/pattern.py completes its width
        if spec.action.op != "capture":
            raise ResolveError(f"{where}: attention weights are read, not edited or handed to a block: capture "
                               "`.pattern` (edit or run a block at the attention's `.input` or `.output` instead)")
        return [(pattern_point(where, node, tree), 0)]
    if node.output == "routing" and spec.site == "output":
        return _routing_points(spec, where, node, el)
    if node.output == "heads" and spec.site in ("input", "output"):
        raise ResolveError(f"{where}: its caller applies it per head, to a [tokens, heads, head_dim] view, so "
                           "it has no [tokens, width] rows to tap; tap the tensor before the view instead (the "
                           "caller's `.source` ops, e.g. `self_attn.source.qkv_split_0.output[0]` for q)")
    if spec.site == "resid":
        if node.output != "pair":
            raise ResolveError(f"{where}: `.resid` is the residual stream after a decoder layer "
                               "(hidden_states + residual); use it on the decoder layers, e.g. `model.layers.3.resid`")
        return [(Point(node.path, "resid"), node.out_width)]
    if spec.site == "input":
        if el is not None:
            raise ResolveError(f"{where}: `.input` is the module's activation argument; it takes no element")
        if node.in_width is None:
            what = "token ids" if node.cls.endswith("Embedding") else \
                "no one [tokens, width] activation among its arguments" if node.output == "tensor" else "no known width"
            raise ResolveError(f"{where}: its input is not an activation tapc can read ({what}); tap the output instead")
        return [(Point(node.path, "input"), node.in_width)]
    if spec.site == "output":
        if node.output == "pair" and el is None:
            if spec.action.op != "capture":
                raise ResolveError(f"{where}: a decoder layer outputs (hidden_states, residual): "
                                   f"{'edit' if spec.action.op != 'block' else 'run a block at'} `.resid` (their "
                                   "sum, the residual stream) or one of them, `.output[0]` or `.output[1]`")
            return [(Point(node.path, "output", element=k), node.out_width) for k in (0, 1)]
        return [_output_point(where, node, el, tree)]
    return [_source_point(spec, where, node)]


def _routing_points(spec: TapSpec, where: str, node: Node, el: int | None) -> list[tuple[Point, int]]:
    """An MoE router's choice: `.output[0]` the top-k weights, `.output[1]` the expert ids,
    `.output` both (a capture)."""
    if spec.action.op != "capture":
        gate = node.path.rsplit(".", 2)[0] + ".gate"
        raise ResolveError(f"{where}: the router's choice is made inside vLLM's fused-MoE op from the router "
                           f"logits; edit those instead: `{gate}.output | set([e], -1e4)` bans expert e, "
                           f"`{gate}.output | set([e], 1e4)` forces it")
    if el is None:
        return [(Point(node.path, "output", element=k), node.out_width) for k in (0, 1)]
    if el not in (0, 1):
        raise ResolveError(f"{where}: an MoE router returns (topk_weights, topk_ids): `.output[0]` the weights, "
                           "`.output[1]` the expert ids, `.output` both")
    return [(Point(node.path, "output", element=el), node.out_width)]


def _dtype(node: Node, point: Point, tree: ModuleTree) -> str:
    """The dtype a capture at `point` is kept in: the model's, except an MoE router's weights
    (float32, as vLLM computes them) and expert ids (int32)."""
    if node.output == "routing":
        return ("float32", "int32")[point.element]
    return tree.dtype


def _output_point(where: str, node: Node, el: int | None, tree: ModuleTree) -> tuple[Point, int]:
    if node.output == "none" and node.path.endswith(".base_layer") and node.layer is not None:
        wrapper = node.path.removesuffix(".base_layer")
        raise ResolveError(f"{where}: it is the base of vLLM's LoRA wrapper `{wrapper}`, which runs its matmul "
                           f"itself and never calls its forward; tap `{wrapper}.output`, the output with the "
                           "adapter's delta")
    if node.output == "none" or node.out_width is None and node.output != "tuple":
        raise ResolveError(f"{where}: this module's output is not tappable (token ids, or a module vLLM does not "
                           "call in the forward); for logits use the engine point `logits`")
    if node.output == "tuple":
        raise ResolveError(f"{where}: this module returns several tensors of sizes tapc cannot know ahead; "
                           "tap its caller's `.source` op or the module that consumes them")
    if node.output == "pair":
        if el not in (0, 1):
            raise ResolveError(f"{where}: a decoder layer outputs (hidden_states, residual): `.output[0]`, "
                               "`.output[1]`, `.output` for both, or `.resid` for their sum, the residual stream")
        return Point(node.path, "output", element=el), node.out_width
    if node.output == "linear":
        if el not in (None, 0):
            raise ResolveError(f"{where}: a vLLM linear layer returns (output, bias) with bias None in the "
                               "forward: `.output` (or `.output[0]`) is the output")
        return Point(node.path, "output"), node.out_width
    if el is not None:
        if node.output == "norm" and el in (0, 1):
            return Point(node.path, "output", element=el), node.out_width
        if node.output == "norm":
            raise ResolveError(f"{where}: it returns (normed, residual): `.output[0]` or `.output[1]`, not `[{el}]`")
        raise ResolveError(f"{where}: its output is one tensor; drop `[{el}]`{_arity_elsewhere(node, tree)}")
    return Point(node.path, "output"), node.out_width


def _arity_elsewhere(node: Node, tree: ModuleTree) -> str:
    """For a module that returns one tensor in this layer and a pair in others (layer 0's input
    norm, which vLLM calls without a residual): where the pair exists, and this layer's residual."""
    if node.layer is None:
        return ""
    pattern = re.compile(re.escape(node.path).replace(rf"\.{node.layer}\.", r"\.(\d+)\.", 1) + "$")
    pairs = [int(m.group(1)) for n in tree.nodes if n.output == "norm" and (m := pattern.match(n.path))]
    if not pairs:
        return ""
    layers = f"{min(pairs)}..{max(pairs)}" if len(pairs) == max(pairs) - min(pairs) + 1 else ", ".join(map(str, pairs))
    layer_path = node.path[: node.path.index(f".{node.layer}.") + len(f".{node.layer}")]
    return (f" (vLLM calls it without a residual in layer {node.layer}; in layers {layers} it returns "
            f"(normed, residual)). Layer {node.layer}'s residual is its input: `{layer_path}.input`")


def _source_point(spec: TapSpec, where: str, node: Node) -> tuple[Point, int]:
    ops = {o.name: o for o in node.source_ops}
    if spec.op not in ops:
        near = difflib.get_close_matches(spec.op, list(ops), n=3, cutoff=0.5)
        hint = f" did you mean {_listing(near)}?" if near else ""
        if node.cls.endswith("WithLoRA"):
            hint += (f" With enable_lora this is vLLM's LoRA wrapper {node.cls}, whose forward replaces the layer's "
                     "own (the layer's ops are not called); `.output` is the output with the adapter's delta.")
        raise ResolveError(f"{where}: no `.source` op {spec.op!r} that runs in {node.cls}.forward here.{hint} "
                           f"Its ops are: {', '.join(ops) or 'none'}")
    op = ops[spec.op]
    point = Point(node.path, "source", op=op.name, io=spec.io, element=spec.element)
    if spec.io == "input":
        if op.in_width is None:
            raise ResolveError(f"{where}: tapc cannot size the input of `{op.call}` ahead of time; ops it can "
                               f"size: {_listing(o.name for o in node.source_ops if o.in_width)}")
        if spec.element is not None:
            raise ResolveError(f"{where}: `.input` is the op's first argument; it takes no element")
        return point, op.in_width
    if op.out_widths is None:
        raise ResolveError(f"{where}: tapc cannot size the output of `{op.call}` ahead of time; ops it can "
                           f"size: {_listing(o.name for o in node.source_ops if o.out_widths)}")
    if len(op.out_widths) > 1:
        if spec.element is None or not 0 <= spec.element < len(op.out_widths):
            raise ResolveError(f"{where}: `{op.call}` returns {len(op.out_widths)} tensors "
                               f"(widths {', '.join(map(str, op.out_widths))}): pick one with `.output[k]`, "
                               f"k in 0..{len(op.out_widths) - 1}")
        return point, op.out_widths[spec.element]
    if spec.element not in (None, 0) or (spec.element == 0 and not op.linear):
        raise ResolveError(f"{where}: `{op.call}` returns one tensor; drop `[{spec.element}]`")
    return Point(node.path, "source", op=op.name, io="output"), op.out_widths[0]


def _engine_tap(spec: TapSpec, tree: ModuleTree) -> PlannedTap:
    where = _where(spec)
    if spec.site == "samples":
        if spec.action.op not in ("capture", "block"):
            raise ResolveError(f"{where}: samples are token ids; capture them, or replace them in a Python block "
                               "(`samples -> name`)")
        return PlannedTap(source=spec.text, point=Point(site="samples"), action=spec.action.op,
                          kind=ENGINE, block=spec.action.block, width=1, dtype="int64")
    if spec.action.op == "call":
        raise ResolveError(f"{where}: compiled functions run inside the model's graphs, and the logits are made "
                           "outside them; edit the logits with set/zero/add/scale, or use a block (`logits -> name`)")
    if spec.action.op == "patch":
        raise ResolveError(f"{where}: patch() puts a request's own rows into the model's activations; the logits "
                           "are its output: edit them with set/zero/add/scale")
    if spec.action.op in ("project_out",):
        raise ResolveError(f"{where}: `{spec.action.op}` on logits has no meaning; use set/zero to mask tokens, "
                           "add for a logit bias, scale for a temperature")
    return _planned(spec, Point(site="logits"), tree.vocab_size, "float32", None, kind=ENGINE)


# ----------------------------------------------------------------------------- actions


def _planned(spec: TapSpec, point: Point, width: int, dtype: str, layer, kind: str | None = None) -> PlannedTap:
    action = spec.action
    if action.op == "block":
        return PlannedTap(source=spec.text, point=point, action="block", kind=kind or BLOCK,
                          block=action.block, width=width, dtype=dtype, layer=layer)
    if action.op == "capture":   # arguments only at a pattern (heads, keys)
        return PlannedTap(source=spec.text, point=point, action="capture", kind=kind or READ,
                          width=width, dtype=dtype, layer=layer,
                          args=tuple(Arg(name=name, kind=name, value=value) for name, value in action.args))
    if point.site == "source" and point.io == "input":
        raise ResolveError(f"{_where(spec)}: an edit at a `.source` op's input cannot run in-graph (the "
                           "argument is shared with other uses); edit the output of the op that produces it, "
                           "or use a Python block (`-> name`)")
    if action.op == "call":   # the argument kinds are the function's: tapc/plan/calls.py completes it
        return PlannedTap(source=spec.text, point=point, action="call", kind=kind or EDIT, function=action.function,
                          args=tuple(Arg(name=name, kind="positions" if name == "at" else "",
                                         param=value.name if isinstance(value, Param) else None,
                                         value=None if isinstance(value, Param) else value)
                                     for name, value in action.args),
                          width=width, dtype=dtype, layer=layer)
    if action.op == LENS:   # two captures of its results: tapc/plan/lens.py
        return PlannedTap(source=spec.text, point=point, action=LENS, kind=kind or READ, width=width, dtype=dtype,
                          layer=layer, args=tuple(Arg(name=name, kind="count", value=value) for name, value in action.args))
    kinds = EDITS[action.op].kinds()
    args = tuple(Arg(name=name, kind=kinds[name], param=value.name) if isinstance(value, Param) else
                 Arg(name=name, kind=kinds[name], value=value) for name, value in action.args)
    try:
        check_at_point(action.op, {a.name: a.value for a in args if a.param is None}, width)
    except ValueError as e:
        raise ResolveError(f"{_where(spec)}: {e}") from None
    return PlannedTap(source=spec.text, point=point, action=action.op, kind=kind or EDIT, args=args,
                      width=width, dtype=dtype, layer=layer)
