"""A TapPlan for people: a table of taps, the graph as its pieces with the splits, totals; and,
before any taps, a model's tap points (`tapc explain MODEL`)."""
from __future__ import annotations

import re
import shutil
from io import StringIO

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tapc.plan.lens import is_lens
from tapc.plan.pattern import heads_of, is_pattern, keys_of
from tapc.plan.sizing import host_row_bytes, param_slots
from tapc.plan.tapplan import BLOCK, EDIT, READ, TapPlan
from tapc.plan.tree import ModuleTree, Node


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kind(tap) -> str:
    """A tap's kind as `tapc explain` says it: a compiled function's call is the plan's `edit` (it
    reads the edit row table) but runs as the function's own code, no tap kernel: `call`; a
    logit lens's two captures are `lens` (one kernel computes both, tapc/plan/lens.py)."""
    return "call" if tap.action == "call" else "lens" if is_lens(tap) else "pattern" if is_pattern(tap) else tap.kind


def _heads(heads: tuple[int, ...]) -> str:
    """A pattern's heads, short: `0..31` for a run, else the list."""
    run = len(heads) > 2 and heads == tuple(range(heads[0], heads[0] + len(heads)))
    return f"{heads[0]}..{heads[-1]}" if run else "[" + ", ".join(map(str, heads)) + "]"


def _args(tap) -> str:
    if tap.block:
        return f"-> {tap.block}"
    shown = []
    for a in tap.args:
        if a.name == "at" and a.value == "all":
            continue
        shown.append(f"{a.name}=${a.param}" if a.param else f"{a.name}={a.value}")
    return ", ".join(shown)


# Columns of the taps table left out, in this order, where the terminal is too narrow for them
# all; the point and what is done there stay.
DROPPED_FIRST = ("from tap", "kind", "per token", "GPUs")
NARROWEST = 12   # a column is not squeezed below this (or its header, or its widest cell)


def taps_table(plan: TapPlan, width: int | None = None) -> tuple[Table, list[str]]:
    """The table of taps, and the columns left out so that it fits `width` (None: any width)."""
    parallel = bool(plan.shards)   # several GPUs: each point's layout and stage, bytes on the most loaded GPU
    cols = [("point", "left"), ("kind", "left"), ("action", "left"), ("per token", "right")]
    cols += [("GPUs", "left"), ("per GPU", "right")] if parallel else [("buffer", "right")]
    cols.append(("from tap", "left"))
    rows = []
    for tap in plan.taps:
        if tap.action == "call":
            action = f"call({', '.join([tap.function, *filter(None, [_args(tap)])])})"
        elif is_lens(tap):
            action = f"lens(k={tap.width})"
        elif is_pattern(tap):
            action = f"capture(heads={_heads(heads_of(tap))}, keys={keys_of(tap)})"
        else:
            action = tap.action + (f"({_args(tap)})" if tap.args else f" {_args(tap)}" if tap.block else "")
        where = (f"{tap.layout}, stage {tap.stage}",) if parallel else ()
        per_token = f"{len(heads_of(tap))} x {keys_of(tap)} x {tap.dtype}" if is_pattern(tap) else f"{tap.width} x {tap.dtype}"
        rows.append((tap.key, _kind(tap), action, per_token, *where,
                     human_bytes(tap.buffer_bytes) if tap.buffer_bytes else "-", tap.source))
    widest = [max(len(name), *(len(r[i]) for r in rows)) for i, (name, _) in enumerate(cols)]
    # a point's name stays whole (its widest); the others may wrap down to NARROWEST
    floor = {name: w if i == 0 else min(w, max(len(name), NARROWEST)) for i, ((name, _), w) in enumerate(zip(cols, widest))}

    def needs(names) -> int:   # each column's padding and rule, and the table's left edge
        return sum(floor[n] for n in names) + 3 * len(names) + 1

    shown = [name for name, _ in cols]
    for name in DROPPED_FIRST:
        if width is None or needs(shown) <= width:
            break
        if name in shown:
            shown.remove(name)
    table = Table(title=f"tapc plan {plan.digest} for {plan.model} ({plan.architecture})", title_justify="left")
    whole = width is None or needs(shown) <= width   # else even the point's name folds onto more lines
    for name, just in cols:
        if name in shown:
            table.add_column(name, justify=just, overflow="fold",
                             width=widest[0] if name == "point" and whole else None)
    keep = [i for i, (name, _) in enumerate(cols) if name in shown]
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table, [name for name, _ in cols if name not in shown]


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
    lines.append(in_graph_line(plan))
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


def in_graph_line(plan: TapPlan) -> str:
    """Which of the plan's in-graph tap kernels a replayed CUDA graph runs (tapc/worker/switch.py)."""
    reads = len(plan.by_kind(READ))
    calls = sum(t.action == "call" for t in plan.taps)
    edits = len(plan.by_kind(EDIT)) - calls
    # a compiled function's code is the graph's own (Inductor's kernels): it runs at every replay
    called = (f"\ncompiled functions in the graphs: {calls} call{'s' * (calls != 1)}, traced with the model (no split); "
              "they run at every step, on every row, and keep their edits to the rows that apply them") if calls else ""
    if not reads + edits:
        return "tap kernels in the graphs: none" + called
    head = f"tap kernels in the graphs: {reads} capture{'s' * (reads != 1)}, {edits} edit{'s' * (edits != 1)}; "
    if plan.by_kind(BLOCK):
        return head + "each runs at every step (graphs broken by blocks are not switched)" + called
    return head + ("a step whose requests ask for none of them replays its graph without them, and one that "
                   "asks for some runs the others' disabled") + called


def totals(plan: TapPlan) -> list[str]:
    row = host_row_bytes(plan.taps, plan.shard_map, plan.tensor_parallel_size, plan.pipeline_parallel_size)
    where = "most loaded GPU" if plan.shards else "GPU"
    kinds: dict[str, int] = {}
    for tap in plan.taps:
        kinds[_kind(tap)] = kinds.get(_kind(tap), 0) + 1
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
        *([f"captures in host memory: up to {human_bytes(row)} a token on the {where} (every capture asked; "
           "capture_memory_gib pins room for them at start, capture_memory_keep_gib bounds what an idle engine "
           "keeps)"] if row else []),
        f"digest: {plan.digest}",
    ]


def host_memory(reserve_gib: float | None, keep_gib: float | None) -> str:
    """What an engine does with its host memory for captures, as a spec's `capture:` says."""
    pinned = f"{reserve_gib:g} GiB a GPU pinned at start" if reserve_gib else "none pinned at start"
    if keep_gib is None:
        kept = "all it grows to kept for the engine's life (memory_keep_gib bounds it)"
    else:
        kept = (f"what it grows past {max(keep_gib, reserve_gib or 0):g} GiB goes back once no capture is held "
                "there (memory_keep_gib)")
    return f"host memory for captures: {pinned} (memory_gib); {kept}\n"


PIPE_WIDTH = 120   # output to a pipe or a file: a plan's usual columns fit, and a pager or an issue shows it


def _console(out: StringIO, width: int | None) -> Console:
    """`width`, else the terminal's (or $COLUMNS); PIPE_WIDTH where the output is no terminal."""
    width = width or shutil.get_terminal_size((PIPE_WIDTH, 24)).columns
    return Console(file=out, width=width, no_color=True, highlight=False, soft_wrap=False)


def render(plan: TapPlan, notes: list[str] = (), width: int | None = None) -> str:
    """The plan as `tapc explain` prints it; `notes` (tapc.plan.resolve.notes) go under the table."""
    out = StringIO()
    console = _console(out, width)
    table, dropped = taps_table(plan, console.width)
    console.print(table)
    if dropped:
        console.print(f"(left out to fit {console.width} columns: {', '.join(dropped)}; a wider terminal or --json "
                      "shows them)", markup=False)
    for line in [f"note: {n}" for n in notes] + graph_lines(plan) + [""] + totals(plan):
        console.print(line, markup=False)
    return out.getvalue()


# ----------------------------------------------------------------------------- a model's tap points

_OUTPUTS = {
    "tensor": "`.output`",
    "linear": "`.output` (the out of (out, bias))",
    "pair": "`.resid`, `.output[0]` hidden, `.output[1]` residual",
    "norm": "`.output[0]` normed, `.output[1]` residual",
    "heads": "per head: not tappable (tap the caller's `.source`)",
    "tuple": "several tensors: tap the caller's `.source`",
    "routing": "MoE router: `.output[0]` top-k weights (float32), `.output[1]` expert ids (int32)",
    "none": "-",
}
# Added to a module's output column where it runs inside vLLM's fused-MoE op (tree.Node.in_moe_op).
_IN_MOE_OP = " (inside the fused-MoE op: no Python blocks)"


def _layer_pattern(node: Node) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp`: one row stands for every layer."""
    return node.path if node.layer is None else re.sub(rf"\.{node.layer}(?=\.|$)", ".*", node.path, count=1)


POINT_COLUMNS = ("module", "class", "output", "width", "input")


def point_rows(tree: ModuleTree) -> list[tuple[str, ...]]:
    """Every module once (decoder layers folded into `*`), what can be tapped there and how wide."""
    rows: dict[str, list[Node]] = {}
    for node in tree.nodes:
        rows.setdefault(_layer_pattern(node), []).append(node)
    out = []
    for path, nodes in rows.items():
        kinds: dict[str, list[int]] = {}
        for n in nodes:
            kinds.setdefault(n.output, []).append(n.layer)
        if len(kinds) == 1:
            output = _OUTPUTS[nodes[0].output]
        else:  # e.g. layer 0's input norm returns one tensor, the others (normed, residual)
            output = "; ".join(f"layer{'s' if len(ls) > 1 else ''} {_span(ls)}: {_OUTPUTS[k]}" for k, ls in kinds.items())
        n = nodes[0]
        if n.why:   # called, but not on every row: why not, in short (the tap's error says it all)
            output = f"not tappable: {n.why.split(', so ')[0].split('; ')[0]}"
        if n.in_moe_op and n.output != "none":
            output += _IN_MOE_OP
        width = "-" if n.out_width is None or n.output in ("none", "tuple", "heads") else str(n.out_width)
        out.append((path, n.cls, output, width, "-" if n.in_width is None else str(n.in_width)))
    out.append(("logits", "(engine point)", "logits of each request's last token", f"{tree.vocab_size}", "-"))
    out.append(("samples", "(engine point)", "the sampled token id", "1", "-"))
    return out


def points_table(title: str, rows: list[tuple[str, ...]]) -> Table:
    """The tap points as a table; a module's path is never folded (a path copied from it must be whole)."""
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(POINT_COLUMNS):
        table.add_column(col, overflow="fold", no_wrap=i == 0, min_width=max(len(r[0]) for r in rows) if i == 0 else None)
    for row in rows:
        table.add_row(*row)
    return table


def _points_fit(rows: list[tuple[str, ...]], width: int) -> bool:
    """Whether the table fits `width` with each path whole and the other columns at NARROWEST."""
    widest = [max(len(name), *(len(r[i]) for r in rows)) for i, name in enumerate(POINT_COLUMNS)]
    return widest[0] + sum(min(w, NARROWEST) for w in widest[1:]) + 3 * len(widest) + 1 <= width


def _span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if len(layers) > 2 and layers[-1] - layers[0] == len(layers) - 1 \
        else ", ".join(map(str, layers))


def source_lines(tree: ModuleTree) -> list[str]:
    """`.source` ops per module class (the same class has the same forward), with output widths."""
    lines = ["`.source` ops tapc can size (`<module>.source.<op>.output`, `[k]` for one of several "
             "tensors), per module class:"]
    # one line per class and set of ops: a decoder layer's calls under `if residual is None:` run in layer 0 only
    groups: dict[tuple, list[Node]] = {}
    for node in tree.nodes:
        if any(o.out_widths for o in node.source_ops):
            groups.setdefault((node.cls, node.source_ops), []).append(node)
    by_cls: dict[str, int] = {}
    for cls, _ in groups:
        by_cls[cls] = by_cls.get(cls, 0) + 1
    for (cls, ops), nodes in groups.items():
        sized = [o for o in ops if o.out_widths]
        shown = ", ".join(f"{o.name} -> {' + '.join(map(str, o.out_widths))}" for o in sized)
        at = _layer_pattern(nodes[0])
        if by_cls[cls] > 1 and nodes[0].layer is not None:  # the layers this line is about, in tap syntax
            layers = sorted({n.layer for n in nodes})   # a module under two names is one per layer
            contiguous = layers[-1] - layers[0] == len(layers) - 1
            at = at.replace(".*", f".{layers[0]}" if len(layers) == 1 else f"[{layers[0]}:{layers[-1] + 1}]"
                            if contiguous else f"[{','.join(map(str, layers))}]", 1)
        rest = len(ops) - len(sized)
        lines.append(f"  {cls} (at `{at}`): {shown}" + (f" ({rest} more ops, unsized)" if rest else ""))
    return lines


def render_points(tree: ModuleTree, width: int | None = None) -> str:
    out = StringIO()
    console = _console(out, width)
    title, rows = (f"tap points of {tree.model} ({tree.architecture}: {tree.num_layers} layers under "
                   f"`{tree.layers_path}`, hidden {tree.hidden_size}, {tree.dtype})"), point_rows(tree)
    if _points_fit(rows, console.width):
        console.print(points_table(title, rows))
    else:   # too narrow for whole paths beside the other columns: each path on a line of its own
        console.print(title, markup=False)
        for path, cls, output, out_width, in_width in rows:
            console.print(Text(path), overflow="ignore", crop=False)
            console.print(Padding(Text(f"{cls}; output: {output}; width {out_width}; input {in_width}"), (0, 0, 0, 4)))
    for line in source_lines(tree):
        console.print(line, markup=False)
    return out.getvalue()
