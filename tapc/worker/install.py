"""Patch module forwards so that the tap ops land in vLLM's compiled graphs.

vLLM's `@support_torch_compile` traces the inner model once, on the first forward (memory
profiling), and Dynamo inlines an instance-level `forward` of a submodule. So, after the model
is loaded and before that first forward, each tapped module gets a forward that calls the
original one and the `torch.ops.tapc.*` ops around it. The ops read device tables that are
registered on the module as non-persistent buffers: Dynamo lifts them as graph inputs with
fixed addresses (no per-layer Python constants, so Inductor still reuses one compiled piece
for all layers), and the host refills their contents every step.

Python blocks (`-> name`) become `tapc::boundary(x, b, k)`, an opaque op vLLM's piecewise
backend splits the graph at (api/engine_args.py lists it in the splitting ops).

`.source` points rewrite the module's forward (tapc/worker/source.py) so the ops run at the call.

An MoE router (`<runner>.router`, metamodel.py) is not a module: its `select_experts` is wrapped
instead of a forward, and its tables are registered on the runner that holds it. It runs inside
vLLM's fused-MoE op, eagerly while graphs are captured, so its ops are captured with the op's
kernels. The expert ids (int32) go as they are to their int32 pool (the capture kernel takes
integer rows: no cast kernel per layer and step). Where the runner calls its own gate right
before the router, the gate's logits are captured in the router's launch too
(`_logits_at_routers`).

Sites: `input` (the module's activation argument, edited before the call), `output` (the
tensor, or element k of a tuple; a vLLM linear returns (out, bias), `.output` is out) and
`resid` (a decoder layer's hidden_states + residual; an edit writes hidden_states so that the
sum is the edited value). Taps at one module run in plan order.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from collections import defaultdict
from typing import Callable

import torch

from tapc.errors import EngineError
from tapc.kernels.ops import pattern as pattern_op   # importing the ops registers torch.ops.tapc.*
from tapc.lang.edits import EDITS
from tapc.plan.lens import HEAD, IDS, LOGITS, NORM, VOCAB_BLOCK, is_lens, scratch_columns, vocab_of
from tapc.plan.pattern import CHILD, heads_of, is_pattern, keys_of
from tapc.worker.calls import Call
from tapc.worker.layout import Layout
from tapc.worker.source import rewrite_forward

# An op bound to its tables: f(x, b), b the residual for `resid` points (else None).
TapOp = Callable[[torch.Tensor, "torch.Tensor | None"], None]


def install(model: torch.nn.Module, layout: Layout, buffers, functions: dict | None = None,
            positions: torch.Tensor | None = None) -> None:
    """Patch every tapped module of `model`. `buffers` has `table` (row tables), `pools`
    (capture pools) and `params.tables` (per-edit parameter tables); see `buffers.Buffers`.
    `functions`: the compiled functions of the plan's `call` taps, by name; `positions`: the
    runner's positions, one a row, which they see (None: they see none)."""
    calls = _Functions(model, functions or {}, positions)
    lens = _Lens.of(model, layout, buffers)
    by_path: dict[str, list] = defaultdict(list)
    for c, tap in enumerate(layout.captures):
        if is_pattern(tap):   # inside vLLM's attention op, not around a forward
            by_path[f"{tap.point.module}.{CHILD}"].append((tap, ("pattern", c)))
        elif tap.point.result is None:   # a function's results are captured by its call
            by_path[tap.point.module].append((tap, ("capture", c)))
        elif is_lens(tap) and tap.point.result == IDS:   # the pair's one op, at the ids' place
            by_path[tap.point.module].append((tap, ("lens", c)))
    for e, tap in enumerate(layout.edits):
        by_path[tap.point.module].append((tap, ("edit", e)))
    for k, tap in enumerate(layout.blocks):
        by_path[tap.point.module].append((tap, ("block", k)))
    # One patch per object: a module the model holds under two paths (Qwen3-MoE's `mlp.gate`,
    # also `mlp.experts.gate`) gets the taps of both, in plan order.
    by_target: dict[int, tuple] = {}
    for path, taps in by_path.items():
        owner, target, method = _target(model, path)
        by_target.setdefault(id(target), (path, owner, target, method, []))[4].extend(taps)
    bound: dict[int, tuple] = {}
    for key, (path, owner, target, method, taps) in by_target.items():
        taps.sort(key=lambda te: layout.plan_order[id(te[0])])
        prefix = "" if target is owner else f"{path.rpartition('.')[2]}_"
        bound[key] = (target, method, path, owner,
                      [(tap, _bind(owner, f"{prefix}{i}", tap, what, layout, buffers, calls, lens))
                       for i, (tap, what) in enumerate(taps)])
    leads = _logits_at_routers(bound)
    for key, (target, method, path, _, ops) in bound.items():
        _patch(target, method, path, ops, leads.get(key))


def _logits_at_routers(bound: dict[int, tuple]) -> dict[int, "_Capture"]:
    """{router: the capture of its gate's logits}, each taken out of `bound` (the gate's forward
    is not patched): an MoE runner that calls its own gate right before its router, with the
    same logits (vLLM 0.26's `_forward_impl`: no dispatch between them, no gate fused with a
    shared expert's), hands them to `select_experts` as `router_logits`, so the router's call
    captures them with its weights and ids in one launch (`capture_trio`): a graph node a layer
    fewer. Only where the gate's one tap is a capture of its output (an edit there, or a
    second tap, keeps the order of the gate's own forward) and the router's two captures run
    as one launch already."""
    leads = {}
    for key, (router, method, _, runner, ops) in list(bound.items()):
        gate = getattr(runner, "gate", None)
        if (method != "select_experts" or id(gate) not in bound or not _calls_gate_then_router(runner)
                or "router_logits" not in inspect.signature(router.select_experts).parameters):
            continue
        gate_ops = bound[id(gate)][4]
        if len(gate_ops) != 1:
            continue
        tap, lead = gate_ops[0]
        after = _paired([(t.point, op) for t, op in ops])
        if (tap.point.site == "output" and tap.point.element in (None, 0) and isinstance(lead, _Capture)
                and len(ops) == 2 and len(after) == 1 and isinstance(after[0][1], _Pair)
                and not any(lead.shares_pool(op) for _, op in ops)):
            leads[key] = lead
            del bound[id(gate)]
    return leads


def _calls_gate_then_router(runner) -> bool:
    """Whether an MoE runner's router gets its gate's output as it is: the runner holds the gate
    (and runs it inside the op), does not fuse it with the shared expert's gate, and dispatches
    no rows between them (data or context parallel would gather other ranks' rows)."""
    if not isinstance(getattr(runner, "gate", None), torch.nn.Module) or getattr(runner, "_fse_fuse_gate", True):
        return False
    try:
        return not runner.do_naive_dispatch_combine and runner.moe_config.pcp_size == 1
    except AttributeError:   # another vLLM's runner: leave the gate's capture where it is
        return False


def _target(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, object, str]:
    """(the module the tap tables are registered on, the object patched, its method) for a path:
    a module's forward, or an MoE router's `select_experts` (tables on the runner holding it)."""
    try:
        module = model.get_submodule(path)
        return module, module, "forward"
    except AttributeError:
        parent, _, name = path.rpartition(".")
        try:
            owner = model.get_submodule(parent)
        except AttributeError:
            owner = None
        router = getattr(owner, name, None) if owner is not None else None
        if name == "router" and hasattr(router, "select_experts"):
            kernel = getattr(getattr(owner, "routed_experts", None), "quant_method", None)
            if getattr(kernel, "is_monolithic", False):
                # such kernels take the router logits and route inside themselves
                raise EngineError(f"`{path}`: this MoE layer's expert kernel ({type(kernel).__name__}) is "
                                  "monolithic: it routes inside itself and never calls the router, so there is "
                                  "no choice to capture; tap the gate's logits (`.gate.output`) instead")
            return owner, router, "select_experts"
    raise EngineError(f"the plan taps `{path}`, which this engine's model does not have: "
                      "was the plan built for another model?")


def _bind(module: torch.nn.Module, i: str, tap, what: tuple[str, int], layout: Layout, buffers,
          calls: "_Functions", lens: "_Lens | None") -> TapOp:
    """Register the tap's tables on `module` (names `_tapc_<i>_*`) and return the op call that reads them."""
    kind, index = what
    if kind == "block":
        # vLLM splits the graph at this op; it runs eagerly and calls tapc.worker.runtime (point `index`)
        return lambda x, b: torch.ops.tapc.boundary(x, b, index)

    def reg(name: str, tensor: torch.Tensor) -> str:
        attr = f"_tapc_{i}_{name}"
        module.register_buffer(attr, tensor, persistent=False)
        return attr

    def capture(c: int, name: str = "") -> _Capture:
        group = int(layout.cap_group[c])
        ring = None
        if buffers.positions is not None:   # the runner's positions: rings (tapc/kernels/capture.py) can run
            ring = (reg(f"{name}ring", buffers.table[layout.ring_row]), reg(f"{name}pos", buffers.positions),
                    len(layout.groups[group].caps))
        return _Capture(module, reg(f"{name}dst", buffers.table[c]), reg(f"{name}pool", buffers.pools[group]), ring)

    if kind == "capture":
        return capture(index)
    if kind == "pattern":
        return _Pattern(tap, capture(index), reg)
    if kind == "lens":
        logits = next(c for c, t in enumerate(layout.captures)
                      if is_lens(t) and t.point == dataclasses.replace(tap.point, result=LOGITS))
        return lens.bind(tap, reg, capture(index, "lens_ids_"), capture(logits, "lens_logits_"))

    slot = reg("slot", buffers.table[layout.edit_row(index)])
    if tap.action == "call":
        # its results' captures: at its point, under "function.result"
        mine = [(c, t.point.result.partition(".")[2]) for c, t in enumerate(layout.captures)
                if t.function == tap.function and dataclasses.replace(t.point, result=None) == tap.point]
        results = {name: capture(c, f"{name}_") for c, name in mine}
        params = {a.name: reg(f"p_{a.name}", buffers.params.tables[index][a.name]) for a in tap.args if a.name != "at"}
        positions = reg("positions", calls.positions) if calls.positions is not None else None
        return Call(module, calls.get(tap.function, module, i), slot, params, positions, results)
    edit = EDITS[tap.action]
    op = getattr(torch.ops.tapc, edit.kernel)
    tables = [reg(name, buffers.params.tables[index][name]) for name in edit.tables]
    if tap.action == "patch":   # its rows are for positions: the op reads the row's
        if calls.positions is None:
            raise EngineError(f"`{tap.source}`: this runner's positions are unknown, and patch() rows are "
                              "for positions")
        pos = reg("positions", calls.positions)
        return lambda x, b: op(x, b, getattr(module, slot), getattr(module, pos), *[getattr(module, t) for t in tables])
    return lambda x, b: op(x, b, getattr(module, slot), *[getattr(module, t) for t in tables])


class _Functions:
    """The plan's compiled functions as the model's forward calls them: a module's weights move
    to the model's device and are registered under the tapped module, so that Dynamo lifts them
    as graph inputs (fixed addresses) rather than baking them in as constants."""

    def __init__(self, model: torch.nn.Module, functions: dict, positions: torch.Tensor | None):
        self.functions, self.positions = functions, positions
        self.device = next(iter(model.parameters()), torch.empty(0)).device

    def get(self, name: str, module: torch.nn.Module, i: str):
        fn = self.functions.get(name)
        if fn is None:
            raise EngineError(f"the plan calls the compiled function {name!r}, which this engine was not given")
        if not isinstance(fn, torch.nn.Module):
            return fn
        module.add_module(f"_tapc_{i}_fn", fn.to(self.device))
        return getattr(module, f"_tapc_{i}_fn")


class _Lens:
    """The logit lens's share of the model: its final norm's weight and epsilon, `lm_head`'s
    weight (the model's own tensors, not copies) and the candidates' scratch every lens op of
    this GPU writes in turn (tapc/kernels/lens.py)."""

    def __init__(self, norm: torch.nn.Module, head: torch.nn.Module, columns: int, rows: int):
        device = head.weight.device
        self.tensors = {"norm": norm.weight.data, "head": head.weight.data,
                        "cand_ids": torch.empty((rows, columns), dtype=torch.int32, device=device),
                        "cand_vals": torch.empty((rows, columns), dtype=torch.float32, device=device)}
        self.eps = float(norm.variance_epsilon)

    @classmethod
    def of(cls, model: torch.nn.Module, layout: Layout, buffers) -> "_Lens | None":
        columns = scratch_columns(layout.captures)
        if not columns:
            return None
        try:
            norm, head = model.get_submodule(NORM), model.get_submodule(HEAD)
        except AttributeError:
            raise EngineError(f"the plan has a logit lens, and this engine's model has no `{NORM}` or `{HEAD}`: "
                              "was the plan built for another model?") from None
        return cls(norm, head, columns, buffers.table.shape[1])

    def bind(self, tap, reg: Callable[[str, torch.Tensor], str], ids: "_Capture", logits: "_Capture") -> TapOp:
        """The op at `tap`'s point: the shared tensors registered on the tapped module (`reg`), as
        its tables are, so that each layer's compiled piece reads them as graph inputs."""
        vocab = vocab_of(tap)
        module, eps = ids.module, self.eps
        names = {name: reg(f"lens_{name}", t) for name, t in self.tensors.items()}

        def op(x: torch.Tensor, b: torch.Tensor | None) -> None:
            got = {name: getattr(module, attr) for name, attr in names.items()}
            ring, pos, stride_ids = ids._ring()
            torch.ops.tapc.lens(x, b, getattr(module, ids.dst), getattr(module, logits.dst),
                                getattr(module, ids.pool), getattr(module, logits.pool), got["norm"], got["head"],
                                got["cand_ids"], got["cand_vals"], eps, vocab, VOCAB_BLOCK, ring, pos, stride_ids,
                                logits._ring()[2])
        return op


class _Capture:
    """A capture op: `x` (plus `b`, a `resid` point's residual) to its pool by its row table, both
    registered on `module` (read at each call: graph capture records the tensors, not the names).
    `ring`: the names of the rings' start row and the runner's positions, and the pool rows a
    ring phase takes of a request's block (its group's captures), or None where the runner's
    positions are unknown (no rings)."""

    def __init__(self, module: torch.nn.Module, dst: str, pool: str, ring: tuple[str, str, int] | None = None):
        self.module, self.dst, self.pool, self.ring = module, dst, pool, ring

    def _ring(self) -> tuple:
        if self.ring is None:
            return None, None, 0
        start, pos, stride = self.ring
        return getattr(self.module, start), getattr(self.module, pos), stride

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> None:
        dst, pool = getattr(self.module, self.dst), getattr(self.module, self.pool)
        if b is None:
            torch.ops.tapc.capture(x, dst, pool, *self._ring())
        else:
            torch.ops.tapc.capture_sum(x, b, dst, pool, *self._ring())

    def shares_pool(self, other: "_Capture") -> bool:
        a, b = getattr(self.module, self.pool), getattr(other.module, other.pool)
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def joint(self, others: list["_Capture"], xs: list[torch.Tensor]) -> None:
        """This capture of xs[0] and each of `others`' of the next tensor, in one launch (two or
        three captures in all)."""
        caps = [self, *others]
        ring, pos, _ = self._ring()
        op = torch.ops.tapc.capture_pair if len(caps) == 2 else torch.ops.tapc.capture_trio
        op(*xs, *(getattr(c.module, c.dst) for c in caps), *(getattr(c.module, c.pool) for c in caps),
           ring, pos, *(c._ring()[2] for c in caps))


class _Pattern:
    """An attention pattern capture: its op runs inside vLLM's attention op, after the attention
    (tapc/kernels/pattern.py), on the query, the layer's key cache and its metadata, which exist
    only there. The op is wrapped around the layer's backend `impl.forward`, which vLLM calls
    eagerly between the compiled pieces and inside its FULL decode graphs, so its launch is
    captured where the attention's kernels are. Only FlashAttention's cache layout is read."""

    def __init__(self, tap, capture: _Capture, reg: Callable[[str, torch.Tensor], str]):
        self.tap, self.capture = tap, capture
        device = getattr(capture.module, capture.pool).device
        self.heads = reg("pattern_heads", torch.tensor(heads_of(tap), dtype=torch.int32, device=device))
        self.keys = keys_of(tap)

    def wrap(self, attn: torch.nn.Module) -> None:
        impl = getattr(attn, "impl", None)
        why = _unreadable(impl)
        if why is not None:
            raise EngineError(f"`{self.tap.key}`: {why}")
        if max(heads_of(self.tap)) >= impl.num_heads:
            raise EngineError(f"`{self.tap.key}`: this engine's attention has {impl.num_heads} heads; the plan asks "
                              f"for head {max(heads_of(self.tap))}")
        original = impl.forward
        module, cap, heads, keys, head_size, scale = attn, self.capture, self.heads, self.keys, impl.head_size, \
            float(impl.scale)

        def forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            out = original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if attn_metadata is not None:   # None: vLLM's profiling run, no cache yet
                # FlashAttention's cache is [blocks, kv_heads, block_size, 2 x head_size]: keys first
                key_cache = kv_cache.transpose(1, 2)[..., :head_size]
                ring, pos, stride = cap._ring()
                pattern_op(query.view(query.shape[0], -1, head_size), key_cache, getattr(module, cap.dst),
                           getattr(module, cap.pool), getattr(module, heads), attn_metadata.query_start_loc,
                           attn_metadata.seq_lens, attn_metadata.block_table, scale, keys, ring, pos, stride)
            return out

        impl.forward = forward


def _unreadable(impl) -> str | None:
    """Why a layer's attention weights cannot be read as HF's eager attention computes them
    from its cache (None: they can)."""
    name = type(impl).__name__
    if name != "FlashAttentionImpl":
        return (f"attention patterns read the KV cache of vLLM's FlashAttention backend; this layer runs "
                f"{name} (start the engine with attention_backend=\"FLASH_ATTN\")")
    if getattr(impl, "kv_cache_dtype", "auto") != "auto":
        return f"attention patterns read an unquantized KV cache; this engine's is {impl.kv_cache_dtype}"
    for attr, what in (("sliding_window", "a sliding window"), ("logits_soft_cap", "a logit soft cap"),
                       ("alibi_slopes", "ALiBi slopes"), ("sinks", "attention sinks")):
        if getattr(impl, attr, None) not in (None, 0, 0.0, (-1, -1)):
            return f"this layer's attention has {what}, which the pattern kernel does not apply"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "attention patterns are not read under decode context parallelism"
    return None


def _patch(target, method: str, path: str, taps: list, lead: "_Capture | None" = None) -> None:
    patterns = [op for _, op in taps if isinstance(op, _Pattern)]
    if patterns:   # an attention layer's patterns: around its backend's forward, not its own
        for op in patterns:
            op.wrap(target)
        return
    if method in target.__dict__:
        raise EngineError(f"`{path}` already has a patched {method}: taps were installed twice on this model")
    source = [(tap, op) for tap, op in taps if tap.point.site == "source"]
    rest = [(tap, op) for tap, op in taps if tap.point.site != "source"]
    original = rewrite_forward(target, path, source) if source else getattr(target, method)
    setattr(target, method, _around(target, original, rest, lead) if rest else original)


def _around(module, original, taps: list, lead: "_Capture | None" = None):
    """`original` with the module-level taps: `input` ops before it, the others after. `lead`:
    an MoE router's gate-logits capture, of the `router_logits` it is called with, joined to
    its weight and id captures (`_logits_at_routers`)."""
    before = [op for tap, op in taps if tap.point.site == "input"]
    after = _paired([(tap.point, op) for tap, op in taps if tap.point.site != "input"], lead)
    width = {tap.point.site: tap.width for tap, _ in taps}.get("input")
    pick_input = _input_picker(original, width) if before else None
    pick_logits = _argument_picker(original, "router_logits") if lead is not None else None

    def forward(self, *args, **kwargs):
        if before:
            x = pick_input(args, kwargs)
            for op in before:
                op(x, None)
        out = original(*args, **kwargs)
        for point, op in after:
            if point.site == "resid":
                op(out[0], out[1])
            elif isinstance(out, tuple):
                if isinstance(op, _Pair):
                    op.run(out, pick_logits(args, kwargs) if op.lead is not None else None)
                else:
                    op(out[point.element or 0], None)
            elif point.element is not None:
                # the plan thought this call returns a tuple: never capture the tensor under `[k]`
                raise EngineError(f"`{point.key}`: `{point.module}` returned one tensor here, not a tuple; "
                                  "the plan was built for a model that calls it differently")
            else:
                op(out, None)
        return out

    return types.MethodType(forward, module)


class _Pair:
    """Two captures of elements of one call's tuple, run as one launch; with `lead`, a capture of
    a tensor the call was given (an MoE router's logits) makes three in that launch."""

    def __init__(self, first: _Capture, second: _Capture, e0: int, e1: int, lead: _Capture | None = None):
        self.first, self.second, self.e0, self.e1, self.lead = first, second, e0, e1, lead

    def run(self, out: tuple, given: torch.Tensor | None = None) -> None:
        x0, x1 = out[self.e0], out[self.e1]
        if self.lead is not None and given.shape[0] == x0.shape[0] == x1.shape[0]:
            self.lead.joint([self.first, self.second], [given, x0, x1])
            return
        if self.lead is not None:
            self.lead(given, None)
        if x0.shape[0] == x1.shape[0]:
            self.first.joint([self.second], [x0, x1])
        else:   # a tuple whose elements have rows of their own: one launch each
            self.first(x0, None)
            self.second(x1, None)


def _paired(after: list, lead: _Capture | None = None) -> list:
    """`after` with each two neighbouring captures of elements of a call's tuple (an MoE
    router's weights and expert ids) as one `_Pair`, under the first one's point: one launch,
    one graph node, where there were two; `lead` joins the first pair. Captures only read, so
    running them together changes nothing they see. Two captures into one pool stay apart: the
    compiled graph functionalizes `capture_pair`, and two of its written arguments that are one
    buffer are written back one over the other, which lost the first capture's rows (a norm's
    `output[0]` and `output[1]`)."""
    out = []
    for point, op in after:
        if out and _tuple_capture(point, op) and _tuple_capture(*out[-1]) and not op.shares_pool(out[-1][1]):
            first_point, first = out[-1]
            out[-1] = (first_point, _Pair(first, op, first_point.element, point.element, lead))
            lead = None
            continue
        out.append((point, op))
    return out


def _tuple_capture(point, op) -> bool:
    return isinstance(op, _Capture) and point.site == "output" and point.element is not None


def _argument_picker(forward, name: str):
    """The argument `name` of a call of `forward`, given by keyword or by position."""
    index = list(inspect.signature(forward).parameters).index(name)
    return lambda args, kwargs: kwargs[name] if name in kwargs else args[index]


def _input_picker(forward, width: int):
    """The module's activation argument: the first float [tokens, width] tensor it is called with
    (a decoder layer's `hidden_states`, not `positions`; a linear's `x`)."""
    params = list(inspect.signature(forward).parameters)

    def pick(args, kwargs):
        bound = list(args) + [kwargs[p] for p in params[len(args):] if p in kwargs]
        for a in bound:
            if isinstance(a, torch.Tensor) and a.dim() == 2 and a.is_floating_point() and a.shape[-1] == width:
                return a
        raise EngineError(f"no [tokens, {width}] activation among the arguments of {forward.__qualname__}")
    return pick

