"""A TapPlan for people: a table of taps, the graph as its pieces with the splits, totals."""
from __future__ import annotations

from io import StringIO

from rich.console import Console
from rich.table import Table

from tapc.plan import BLOCK, TapPlan
from tapc.sizing import param_slots


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _args(tap) -> str:
    if tap.block:
        return f"-> {tap.block}"
    shown = []
    for a in tap.args:
        if a.name == "at" and a.value == "all":
            continue
        shown.append(f"{a.name}=${a.param}" if a.param else f"{a.name}={a.value}")
    return ", ".join(shown)


def taps_table(plan: TapPlan) -> Table:
    table = Table(title=f"tapc plan {plan.digest} for {plan.model} ({plan.architecture})", title_justify="left")
    parallel = bool(plan.shards)   # several GPUs: each point's layout and stage, bytes on the most loaded GPU
    cols = (("point", "left"), ("kind", "left"), ("action", "left"), ("per token", "right"))
    cols += (("GPUs", "left"), ("per GPU", "right")) if parallel else (("buffer", "right"),)
    for col, just in cols + (("from tap", "left"),):
        table.add_column(col, justify=just, overflow="fold")
    for tap in plan.taps:
        action = tap.action + (f"({_args(tap)})" if tap.args else f" {_args(tap)}" if tap.block else "")
        where = (f"{tap.layout}, stage {tap.stage}",) if parallel else ()
        table.add_row(tap.key, tap.kind, action, f"{tap.width} x {tap.dtype}", *where,
                      human_bytes(tap.buffer_bytes) if tap.buffer_bytes else "-", tap.source)
    return table


def graph_lines(plan: TapPlan) -> list[str]:
    """The compiled forward as vLLM splits it: pieces between attention ops, blocks marked (✂)."""
    blocks: dict[int | None, list[str]] = {}
    for tap in plan.by_kind(BLOCK):
        blocks.setdefault(tap.layer, []).append(f"{tap.key} -> {tap.block}")
    lines = [f"graph: {plan.pieces_before} compiled pieces without the plan, {plan.pieces_after} with it"]
    if plan.splitting_ops:
        lines.append(f"splitting ops added: {', '.join(plan.splitting_ops)} (blocks run eagerly at every replay: "
                     f"PIECEWISE graphs split there, and a FULL graph replays as "
                     f"{plan.pieces_after - plan.pieces_before + 1} segments around them)")
    body = ["  [piece 0] embeddings .. layer 0 attention"]
    for layer in range(plan.num_layers):
        last = layer == plan.num_layers - 1
        body.append(f"   | attention, layer {layer} (vLLM split)")
        body.append(f"  [piece {layer + 1}] layer {layer} after attention .. "
                    + ("final norm" if last else f"layer {layer + 1} attention"))
        body.extend(f"     ✂ boundary block {m}" for m in blocks.get(layer, []))
    if plan.num_layers > 6 and not blocks:  # nothing to mark: keep the ends, fold the middle
        body = body[:5] + [f"  ... {plan.num_layers - 4} more layers, same shape ..."] + body[-4:]
    return lines + body


def totals(plan: TapPlan) -> list[str]:
    kinds: dict[str, int] = {}
    for tap in plan.taps:
        kinds[tap.kind] = kinds.get(tap.kind, 0) + 1
    params = ", ".join(f"{p.name} ({p.kind}{f' of {p.width}' if p.width else ''})" for p in plan.params)
    return [
        f"taps: {len(plan.taps)} ({', '.join(f'{n} {k}' for k, n in kinds.items())})",
        f"parameters: {params or 'none'}",
        *([f"GPUs: tensor_parallel_size={plan.tensor_parallel_size} x pipeline_parallel_size="
           f"{plan.pipeline_parallel_size}; stages hold decoder layers "
           + ", ".join(f"{a}..{b - 1}" for a, b in plan.pp_layers)] if plan.shards else []),
        f"preallocated: {human_bytes(plan.total_buffer_bytes)} on the {'most loaded GPU' if plan.shards else 'device'}"
        f" for {plan.max_num_batched_tokens} "
        f"tokens per step and {plan.max_num_seqs} requests ({param_slots(plan.max_num_seqs)} parameter slots)",
        f"digest: {plan.digest}",
    ]


def render(plan: TapPlan, width: int = 160) -> str:
    out = StringIO()
    console = Console(file=out, width=width, no_color=True, highlight=False)
    console.print(taps_table(plan))
    for line in graph_lines(plan) + [""] + totals(plan):
        console.print(line, markup=False)
    return out.getvalue()
