"""Attention patterns: `<attention>.pattern` made a capture of `[heads, keys]` float32 a row.

`model.layers.3.self_attn.pattern` names the softmax weights of the attention block's vLLM
`Attention` (its `attn` child) for each query row a request asks for: every head's (or those of
`capture(heads=[...])`) over the request's keys 0..keys-1, zeros past the row's own position.
The worker computes them from the query and the paged KV cache (tapc/kernels/pattern.py), so a
row's width grows with `keys`: the engine's `max_model_len` unless the tap bounds it, and every
capture pool holds max_num_batched_tokens such rows (tapc/plan/sizing.py); `tapc explain` says the
bytes. A request's positions must lie below `keys` (tapc/api/requests.py checks it).
"""
from __future__ import annotations

import dataclasses

from tapc.errors import PlanError, ResolveError
from tapc.lang.edits import PATTERN
from tapc.plan.tapplan import Arg, PlannedTap, Point

ATTENTIONS = ("Attention",)   # vLLM's paged attention layer (not MLA's, whose cache holds latents)
CHILD = "attn"                # where the attention blocks of vLLM's models hold it
DTYPE = "float32"


def pattern_point(where: str, node, tree) -> Point:
    """The pattern point of the attention block `node` (its vLLM attention is its `attn`)."""
    inner = tree.by_path.get(f"{node.path}.{CHILD}")
    if inner is None or inner.cls not in ATTENTIONS:
        has = f"its `{CHILD}` is {inner.cls}" if inner is not None else f"it has no `{CHILD}`"
        hint = "; MLA attention caches latents, not keys" if inner is not None and "MLA" in inner.cls else ""
        raise ResolveError(f"{where}: `.pattern` is the attention weights of an attention block holding vLLM's "
                           f"paged `Attention` as `{CHILD}` (e.g. `model.layers.3.self_attn.pattern`); {has}{hint}")
    return Point(node.path, PATTERN)


def is_pattern(tap: PlannedTap) -> bool:
    return tap.point.site == PATTERN


def heads_of(tap: PlannedTap) -> tuple[int, ...]:
    return next(a.value for a in tap.args if a.name == "heads")


def keys_of(tap: PlannedTap) -> int:
    return next(a.value for a in tap.args if a.name == "keys")


def complete_patterns(taps: list[PlannedTap], num_heads: int, max_model_len: int | None, tp: int,
                      pp: int) -> list[PlannedTap]:
    """`taps` with each pattern capture's heads and keys filled in (all heads; the engine's
    `max_model_len`) and its width theirs: `len(heads) * keys` float32."""
    out = []
    seen: dict[str, PlannedTap] = {}
    for tap in taps:
        if not is_pattern(tap):
            out.append(tap)
            continue
        where = f"`{tap.source}`"
        if tap.key in seen:
            raise PlanError(f"{where}: {tap.key} is also captured by `{seen[tap.key].source}`; an attention's "
                            "pattern is captured once (one tap, with every head it needs)")
        seen[tap.key] = tap
        if tp * pp > 1:
            raise PlanError(f"{where}: attention patterns run on one GPU for now (this plan is for "
                            f"tensor_parallel_size={tp}, pipeline_parallel_size={pp})")
        given = {a.name: a.value for a in tap.args}
        heads = tuple(given.get("heads", range(num_heads)))
        beyond = [h for h in heads if h >= num_heads]
        if beyond:
            raise PlanError(f"{where}: the model has heads 0..{num_heads - 1}; there is no head {beyond[0]}")
        keys = given.get("keys", max_model_len)
        if keys is None:
            raise PlanError(f"{where}: a pattern row holds every key a position can attend to, so its size needs a "
                            "bound: give the engine's max_model_len, or the keys a row holds "
                            "(`| capture(keys=512)`)")
        out.append(dataclasses.replace(tap, width=len(heads) * keys, dtype=DTYPE,
                                       args=(Arg("heads", "heads", value=heads), Arg("keys", "count", value=keys))))
    return out


def shape_of(tap: PlannedTap) -> tuple[int, int]:
    """(heads, keys) of a pattern row."""
    return len(heads_of(tap)), keys_of(tap)
