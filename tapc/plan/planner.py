"""Tap specs + vLLM's module tree -> a TapPlan (tapc/plan/tapplan.py): resolve, check, size, digest.

Under tensor / pipeline parallelism (`engine_args` sizes above 1) the tree stays the single-GPU
one; the plan records the sizes, the stages' layers and tapc/plan/sharding.py's map of every point,
refuses what cannot run (the map's messages), and sizes each GPU's buffers at its local widths
(tapc/plan/ranks.py)."""
from __future__ import annotations

import dataclasses

from tapc.errors import PlanError
from tapc.lang.schema import EngineArgs, checked
from tapc.lang.syntax import TapSpec, parse_taps
from tapc.plan.calls import check_function, complete_calls, function_specs
from tapc.plan.lens import complete_lens
from tapc.plan.pattern import complete_patterns, is_pattern
from tapc.plan.resolve import resolve_tap
from tapc.plan.sharding import ModelDims, pp_stages, shard_points
from tapc.plan.shards import PointShard
from tapc.plan.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, gpu_bytes
from tapc.plan.tapplan import BLOCK, READ, ParamSpec, PlannedTap, TapPlan, plan_digest
from tapc.plan.tree import load_tree

BOUNDARY_OP = "tapc::boundary"
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")


def build_plan(model: str, taps, *, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
               max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, capture_dtype: str | None = None, tree=None,
               engine_args: dict | None = None, dims: ModelDims | None = None, functions: dict | None = None) -> TapPlan:
    """Resolve taps (a text, or tap strings or parsed `TapSpec`s in any iterable) against `model`'s vLLM module tree, as
    an engine with `engine_args` builds it (tree.py TREE_ENGINE_ARGS: LoRA), for its
    `tensor_parallel_size` and `pipeline_parallel_size`; the sizes and the engine arguments tapc
    reads are checked against tapc.lang.schema.EngineArgs. `dims`: the attention shape the
    parallel layouts need (default: from the model's config.json). `functions`: the compiled
    functions `call` taps run, by name (tapc/plan/calls.py traces each on the CPU)."""
    specs = _specs(taps)
    if not specs:
        raise PlanError("no taps: give at least one tap")
    sizes = checked(EngineArgs, {**(engine_args or {}), "max_num_batched_tokens": max_num_batched_tokens,
                                 "max_num_seqs": max_num_seqs}, "", error=PlanError)
    tree = tree or load_tree(model, engine_args)
    if capture_dtype is not None and capture_dtype not in CAPTURE_DTYPES:
        raise PlanError(f"capture dtype {capture_dtype!r}: use one of {', '.join(CAPTURE_DTYPES)}")
    planned: list[PlannedTap] = []
    seen: dict[tuple, PlannedTap] = {}
    for spec in specs:
        for tap in resolve_tap(spec, tree):
            if tap.kind == READ and capture_dtype:
                tap = dataclasses.replace(tap, dtype=capture_dtype)
            sig = (tap.key, tap.action, tap.args, tap.block, tap.function)
            if sig in seen:
                raise PlanError(f"{tap.key} is tapped twice the same way: by `{seen[sig].source}` and `{tap.source}`")
            seen[sig] = tap
            planned.append(tap)
    tp, pp = sizes.tensor_parallel_size, sizes.pipeline_parallel_size
    specs = function_specs(functions)
    planned = complete_lens(complete_calls(planned, specs), tree, tp, pp)
    if any(is_pattern(t) for t in planned):
        dims = dims or ModelDims.of_model(model)
        planned = complete_patterns(planned, dims.num_heads, (engine_args or {}).get("max_model_len"), tp, pp)
    params = _collect_params(planned)
    calls = [t for t in planned if t.action == "call"]
    if calls and tp * pp > 1:
        raise PlanError(f"`{calls[0].source}`: compiled functions run on one GPU for now (this plan is for "
                        f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}); use a Python block there")
    checked_once = set()
    for tap in calls:   # once per function and point shape
        if (tap.function, tap.width, tap.dtype) not in checked_once:
            check_function(functions[tap.function], specs[tap.function], tap)
            checked_once.add((tap.function, tap.width, tap.dtype))
    shards = _parallel(model, tree, planned, dims, tp, pp) if tp * pp > 1 else {}
    planned = [dataclasses.replace(t, layout=shards[t.key].layout, stage=shards[t.key].stage) if shards else t
               for t in planned]
    sizes, total = gpu_bytes(planned, shards, tp, pp, max_num_batched_tokens, max_num_seqs)
    planned = [dataclasses.replace(t, buffer_bytes=n) for t, n in zip(planned, sizes)]
    block_points = {t.key for t in planned if t.kind == BLOCK}
    pieces = tree.num_layers + 1  # vLLM splits at each attention op: one compiled piece per gap
    plan = TapPlan(
        model=model, architecture=tree.architecture, num_layers=tree.num_layers, hidden_size=tree.hidden_size,
        dtype=tree.dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        taps=tuple(planned), params=params, splitting_ops=(BOUNDARY_OP,) if block_points else (),
        pieces_before=pieces, pieces_after=pieces + len(block_points), total_buffer_bytes=total,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pp_layers=pp_stages(tree.num_layers, pp) if shards else (), shards=tuple(shards.values()),
        functions=tuple(specs[name] for name in dict.fromkeys(t.function for t in calls)),
    )
    return dataclasses.replace(plan, digest=plan_digest(plan))


def _specs(taps) -> tuple[TapSpec, ...]:
    """Parsed taps from a text, parsed `TapSpec`s, or tap strings in any iterable."""
    if isinstance(taps, str):
        return parse_taps(taps)
    try:
        items = list(taps)
    except TypeError:
        raise PlanError(f"taps: give tap strings (a list or any iterable of them) or one text of taps, "
                        f"not {type(taps).__name__}") from None
    return tuple(items) if items and all(isinstance(t, TapSpec) for t in items) else parse_taps(items)


# parameter kinds as wide as their point: a vector, patch() rows
WIDE = ("vector", "rows")


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
                if a.kind in WIDE and where.width != tap.width:
                    raise PlanError(f"parameter {a.param!r} is {where.width} wide at {where.key} "
                                    f"but {tap.width} at {tap.key}: use two names")
                continue
            found[a.param] = (ParamSpec(a.param, a.kind, tap.width if a.kind in WIDE else None), tap)
    return tuple(a for a, _ in found.values())


def _parallel(model: str, tree, taps: list[PlannedTap], dims: ModelDims | None, tp: int,
              pp: int) -> dict[str, PointShard]:
    """The map of every tapped point; what cannot run at these sizes is refused, naming the tap."""
    shards = shard_points(tree, [t.point for t in taps], dims or ModelDims.of_model(model), tp=tp, pp=pp)
    layouts: dict[str, tuple[str, PlannedTap]] = {}
    for tap in taps:
        shard = shards[tap.key]
        # Per-head points (the only ones the map sizes unlike the tap) never get here: resolve
        # refuses them at any size (resolve.py `_point`, tree.py "heads").
        assert not shard.sharded or shard.width == tap.width, (tap.key, shard.width, tap.width)
        why = shard.refusal(tap.action)
        if why is not None:
            raise PlanError(f"`{tap.source}`: {why}")
        for a in tap.args:   # a named vector is one table per GPU: one slicing for all its points
            if a.param is None or a.kind != "vector":
                continue
            first = layouts.setdefault(a.param, (shard.layout, tap))
            if first[0] != shard.layout:
                raise PlanError(f"parameter {a.param!r} is a vector at {first[1].key} ({first[0]}) and at {tap.key} "
                                f"({shard.layout}), which split differently across {tp} GPUs: use two names")
    return {t.key: shards[t.key] for t in taps}

