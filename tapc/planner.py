"""Tap specs + vLLM's module tree -> a TapPlan (tapc/plan.py): resolve, check, size, digest."""
from __future__ import annotations

import dataclasses

from tapc.errors import PlanError
from tapc.plan import BLOCK, READ, ParamSpec, PlannedTap, TapPlan, plan_digest
from tapc.resolve import resolve_tap
from tapc.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, tap_bytes
from tapc.spec import TapSpec, parse_taps
from tapc.tree import load_tree

BOUNDARY_OP = "tapc::boundary"
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")


def build_plan(model: str, taps, *, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
               max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, capture_dtype: str | None = None, tree=None,
               engine_args: dict | None = None) -> TapPlan:
    """Resolve taps (strings, a text, or parsed `TapSpec`s) against `model`'s vLLM module tree, as
    an engine with `engine_args` builds it (tree.py TREE_ENGINE_ARGS: parallel sizes, LoRA)."""
    specs = tuple(taps) if taps and all(isinstance(t, TapSpec) for t in taps) else parse_taps(taps)
    if not specs:
        raise PlanError("no taps: give at least one tap")
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise PlanError("max_num_batched_tokens and max_num_seqs must be positive")
    tree = tree or load_tree(model, engine_args)
    if capture_dtype is not None and capture_dtype not in CAPTURE_DTYPES:
        raise PlanError(f"capture dtype {capture_dtype!r}: use one of {', '.join(CAPTURE_DTYPES)}")
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
            planned.append(tap)
    params = _collect_params(planned)
    sizes = tap_bytes(planned, max_num_batched_tokens, max_num_seqs)
    planned = [dataclasses.replace(t, buffer_bytes=n) for t, n in zip(planned, sizes)]
    block_points = {t.key for t in planned if t.kind == BLOCK}
    pieces = tree.num_layers + 1  # vLLM splits at each attention op: one compiled piece per gap
    plan = TapPlan(
        model=model, architecture=tree.architecture, num_layers=tree.num_layers, hidden_size=tree.hidden_size,
        dtype=tree.dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        taps=tuple(planned), params=params, splitting_ops=(BOUNDARY_OP,) if block_points else (),
        pieces_before=pieces, pieces_after=pieces + len(block_points), total_buffer_bytes=sum(sizes),
    )
    return dataclasses.replace(plan, digest=plan_digest(plan))


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
