"""Where each tap point lives under vLLM's tensor and pipeline parallelism, as plain data.

`shard_points(tree, points, dims, tp=N, pp=M)` says for every point:
- which pipeline stage runs it (decoder layers split as vLLM's `get_pp_indices` splits them);
- whether it is replicated on the N tensor-parallel ranks or sharded over them, and for a
  sharded point, per rank, the column runs `(dst, src, n)` that put the rank's local columns
  `src:src+n` at columns `dst:dst+n` of the single-GPU layout;
- which edits each rank can apply to its own shard, and what to say for those it cannot.

The layouts follow vLLM 0.26 (`model_executor/layers/linear.py`, `models/llama.py`,
`models/qwen3.py`): a column-parallel linear keeps rank r's slice of each of its merged parts
(`[q_r | k_r | v_r]`, `[gate_r | up_r]`), so a rank's shard is not one contiguous block of the
whole tensor; with fewer kv heads than ranks, kv head h lives on ranks h*R .. h*R+R-1
(R = N / kv heads). A row-parallel linear's output is all-reduced: replicated again.

Python and numpy only at import (no torch, no vLLM), so the plan and `tapc explain` can use it
without a GPU. The planner records the map in the plan (`TapPlan.shards`); tapc/plan/ranks.py
derives each GPU's taps from it, and the API places sharded captures with its `writes`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np

from tapc.errors import PlanError
from tapc.plan.shards import (
    COLUMNS,
    GATE_UP,
    KV_HEADS,
    Q_HEADS,
    QKV,
    REFUSED,
    REPLICATED,
    PointShard,
    RankShard,
    Run,
    replicated_neighbour,
)
from tapc.plan.tapplan import Point
from tapc.plan.tree import ModuleTree, Node


@dataclass(frozen=True)
class ModelDims:
    """The config numbers the layouts need (config.json names in the comments)."""

    num_heads: int        # num_attention_heads
    num_kv_heads: int     # num_key_value_heads (defaults to num_attention_heads)
    head_dim: int         # head_dim (defaults to hidden_size // num_attention_heads)

    @classmethod
    def from_config(cls, config: dict) -> "ModelDims":
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(num_heads=heads, num_kv_heads=kv, head_dim=int(head_dim))

    @classmethod
    def of_model(cls, model: str) -> "ModelDims":
        """From the model's config.json (a local directory or the local HF cache)."""
        from tapc.plan.modeldir import config_path

        return cls.from_config(json.loads(config_path(model).read_text()))


def shard_points(tree: ModuleTree, points, dims: ModelDims, *, tp: int = 1, pp: int = 1,
                 pp_partition: str | None = None) -> dict[str, PointShard]:
    """Each point's (a `Point` or its key, as resolved by the plan) layout and stage.
    `pp_partition` is vLLM's VLLM_PP_LAYER_PARTITION (read from the environment when None;
    "" for vLLM's even split)."""
    _check_sizes(tree, dims, tp, pp)
    stages = pp_stages(tree.num_layers, pp, pp_partition)
    out = {}
    for p in points:
        point = p if isinstance(p, Point) else parse_key(p)
        layout, width, why = _layout(tree, dims, point, tp)
        writer = _writer(tree, point, tp) if layout == REPLICATED else 0
        ranks = () if why else tuple(_rank_shard(layout, width, dims, tp, r, writer) for r in range(tp))
        out[point.key] = PointShard(key=point.key, layout=REFUSED if why else layout, width=width,
                                    stage=_stage(tree, point, stages), tp=tp, ranks=ranks, refused=why)
    return out


# ----------------------------------------------------------------------------- edits on one rank


def local_vector(shard: PointShard, rank: int, vector):
    """The rank's part of a whole-row vector (add's vector), in local column order."""
    v = np.asarray(vector)
    if v.shape[-1] != shard.width:
        raise PlanError(f"{shard.key}: a vector of {v.shape[-1]} numbers for a point {shard.width} wide")
    return v[..., global_columns(shard, rank)]


def local_columns(shard: PointShard, rank: int, cols) -> tuple[list[int], list[int]]:
    """set/zero columns on one rank: (local columns, index into `cols` of each). Columns the
    rank does not hold are dropped; a column held by several ranks is edited on each."""
    where = {int(g): i for i, g in enumerate(global_columns(shard, rank))}
    local, picked = [], []
    for k, c in enumerate(cols):
        if not 0 <= c < shard.width:
            raise PlanError(f"{shard.key}: column {c} is past the point's width {shard.width}")
        if c in where:
            local.append(where[c])
            picked.append(k)
    return local, picked


def global_columns(shard: PointShard, rank: int):
    """numpy int array: the single-GPU column of each of the rank's local columns."""
    if shard.refused:
        raise PlanError(shard.refused)
    part = shard.ranks[rank]
    index = np.empty(part.local_width, dtype=np.int64)
    for dst, src, n in part.holds:
        index[src:src + n] = np.arange(dst, dst + n)
    return index


def gather_index(shard: PointShard):
    """numpy int array over the single-GPU columns: where each one is in the ranks' local
    tensors concatenated rank after rank (what an all-gather on the last dim returns), taken
    from its writer. `gathered[:, gather_index(shard)]` is the whole tensor (a block's view)."""
    if shard.refused:
        raise PlanError(shard.refused)
    index = np.empty(shard.width, dtype=np.int64)
    offset = 0
    for part in shard.ranks:
        for dst, src, n in part.writes:
            index[dst:dst + n] = np.arange(offset + src, offset + src + n)
        offset += part.local_width
    return index


# ----------------------------------------------------------------------------- pipeline stages


def pp_stages(num_layers: int, pp: int, partition: str | None = None) -> tuple[tuple[int, int], ...]:
    """(start, end) decoder layers of each stage, as vLLM's `get_pp_indices` computes them:
    even split, the remainder going to the stages before the last; VLLM_PP_LAYER_PARTITION
    ("8,8,7,9") overrides it."""
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION") if partition is None else partition
    if partition:
        try:
            sizes = [int(x) for x in partition.split(",")]
        except ValueError:
            raise PlanError(f"VLLM_PP_LAYER_PARTITION={partition!r}: give comma-separated layer counts") from None
        if len(sizes) != pp or sum(sizes) != num_layers:
            raise PlanError(f"VLLM_PP_LAYER_PARTITION={partition!r}: needs {pp} counts (one per pipeline stage) "
                            f"summing to the model's {num_layers} layers")
    else:
        sizes = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return tuple((s, s + n) for s, n in zip(starts, sizes))


def _stage(tree: ModuleTree, point: Point, stages) -> int:
    """Layers by their index; the embedding (and the model's token-id input) on the first stage;
    the final norm, logits and samples on the last."""
    if point.site in ("logits", "samples"):
        return len(stages) - 1
    node = tree.by_path.get(point.module)
    if node is not None and node.layer is not None:
        return next(i for i, (s, e) in enumerate(stages) if s <= node.layer < e)
    embedding = node is not None and node.cls == "VocabParallelEmbedding"
    if embedding or (point.module == _model_root(tree) and point.site == "input"):
        return 0
    return len(stages) - 1


# ----------------------------------------------------------------------------- layouts


def parse_key(key: str) -> Point:
    """A point's canonical key (`Point.key`) back to the Point."""
    m = re.fullmatch(r"(.*?)(?:\[(\d+)\])?", key)
    text, element = m.group(1), None if m.group(2) is None else int(m.group(2))
    if text in ("logits", "samples"):
        return Point(site=text)
    if ".source." in text:
        module, rest = text.split(".source.", 1)
        op, _, io = rest.rpartition(".")
        if not op or io not in ("input", "output"):
            raise PlanError(f"{key!r}: a `.source` key reads <module>.source.<op>.input|output")
        return Point(module, "source", op=op, io=io, element=element)
    module, _, site = text.rpartition(".")
    if not module or site not in ("output", "input", "resid"):
        raise PlanError(f"{key!r}: not a point key (<module>.output, .input, .resid, or .source.<op>.<io>)")
    return Point(module, site, element=element)


def _check_sizes(tree: ModuleTree, dims: ModelDims, tp: int, pp: int) -> None:
    """The divisibility vLLM asserts, said before an engine starts."""
    if tp < 1 or pp < 1:
        raise PlanError(f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}: both must be at least 1")
    if pp > tree.num_layers:
        raise PlanError(f"pipeline_parallel_size={pp} is more than the model's {tree.num_layers} decoder layers")
    if dims.num_heads % tp:
        raise PlanError(f"tensor_parallel_size={tp} does not divide the {dims.num_heads} attention heads")
    kv = dims.num_kv_heads
    if kv % tp and tp % kv:
        raise PlanError(f"tensor_parallel_size={tp} and the {kv} kv heads: vLLM needs one to divide the other")
    for n in tree.nodes:
        if n.cls == "QKVParallelLinear" and n.out_width != (dims.num_heads + 2 * kv) * dims.head_dim:
            raise PlanError(f"{n.path}: {n.out_width} columns, but the config says ({dims.num_heads} heads + "
                            f"2 x {kv} kv heads) x {dims.head_dim}: dims from another model?")
        if n.cls == "MergedColumnParallelLinear" and n.out_width % (2 * tp):
            raise PlanError(f"{n.path}: gate/up of {n.out_width // 2} columns each do not split over "
                            f"tensor_parallel_size={tp}")


def _layout(tree: ModuleTree, dims: ModelDims, point: Point, tp: int) -> tuple[str, int, str | None]:
    """(layout, single-GPU width, refusal) of a point."""
    if point.site in ("logits", "samples"):  # logits are all-gathered on every rank (notes G)
        return REPLICATED, tree.vocab_size if point.site == "logits" else 1, None
    node = tree.by_path.get(point.module)
    if node is None:
        raise PlanError(f"{point.key}: no module {point.module!r} in {tree.architecture}'s tree")
    if point.site == "source":
        layout, width = _source_layout(tree, dims, node, point)
    elif point.site == "resid" or node.output == "pair":
        layout, width = REPLICATED, node.out_width
    else:
        layout, width = _module_layout(tree, dims, node, point.site)
    if width is None:
        raise PlanError(f"{point.key}: not a tappable point (tapc knows no width for it)")
    if tp == 1:  # one rank holds everything: nothing to refuse
        return REPLICATED, width, None
    moe = _moe_block(tree, node)
    if moe is not None and node.path != moe and node.cls != "ReplicatedLinear":
        return REFUSED, width, (f"{point.key} is inside the mixture-of-experts block {moe}, whose experts hold "
                                     f"partial sums under tensor parallelism; tap {moe}.output instead")
    if layout is None:
        return REFUSED, width, (f"{point.key}: tapc has no tensor-parallel layout for this point "
                                     f"({node.cls}); tap {replicated_neighbour(point.key)} instead")
    return layout, width, None


def _module_layout(tree: ModuleTree, dims: ModelDims, node: Node, site: str) -> tuple[str | None, int | None]:
    width = node.out_width if site == "output" else node.in_width
    cls = node.cls
    if cls == "QKVParallelLinear":
        return (QKV if site == "output" else REPLICATED), width
    if cls == "MergedColumnParallelLinear":
        return (GATE_UP if site == "output" else REPLICATED), width
    if cls == "ColumnParallelLinear":
        return (COLUMNS if site == "output" else REPLICATED), width
    if cls == "RowParallelLinear":  # input split by columns of the sharded producer; output all-reduced
        return (_row_input_layout(tree, node) if site == "input" else REPLICATED), width
    if cls in ("ReplicatedLinear", "VocabParallelEmbedding"):
        return REPLICATED, width
    if cls.endswith("AndMul"):  # its input is gate_up's output; its output one part of it
        return (GATE_UP if site == "input" else COLUMNS), width
    if _is_attention(node):  # input is the query (first argument); output the per-head result
        return Q_HEADS, width
    if node.output == "norm" or cls.endswith("Norm"):   # a norm called without a residual returns one tensor
        name = node.path.rpartition(".")[2]
        if width == tree.hidden_size:
            return REPLICATED, width
        if name in ("q_norm", "k_norm") and width == dims.head_dim:  # per-head norm on local heads
            return (Q_HEADS, dims.num_heads * dims.head_dim) if name == "q_norm" else \
                (KV_HEADS, dims.num_kv_heads * dims.head_dim)
        return None, width
    if _is_block(tree, node) or node.path == _model_root(tree):
        return REPLICATED, width
    return None, width


def _source_layout(tree: ModuleTree, dims: ModelDims, node: Node, point: Point) -> tuple[str | None, int | None]:
    op = next((o for o in node.source_ops if o.name == point.op), None)
    if op is None:
        raise PlanError(f"{point.key}: no `.source` op {point.op!r} in {node.cls}.forward")
    q = dims.num_heads * dims.head_dim
    kv = dims.num_kv_heads * dims.head_dim
    if op.name.startswith("qkv_split_") and _is_attention_block(tree, node):
        if point.io == "input":
            return QKV, op.in_width
        return ((Q_HEADS, q), (KV_HEADS, kv), (KV_HEADS, kv))[point.element or 0]
    m = re.fullmatch(r"self_(\w+)_\d+", op.name)
    child = tree.by_path.get(f"{node.path}.{m.group(1)}") if m else None
    if child is None:  # not a call of a submodule: its layout is not known
        return None, op.in_width if point.io == "input" else (op.out_widths or (None,))[point.element or 0]
    return _module_layout(tree, dims, child, point.io)


def _row_input_layout(tree: ModuleTree, node: Node) -> str:
    """o_proj's input is the attention output (query heads); down_proj's the activation (columns)."""
    parent = tree.by_path.get(node.path.rpartition(".")[0])
    return Q_HEADS if parent is not None and _is_attention_block(tree, parent) else COLUMNS


def _is_attention(node: Node) -> bool:
    return node.cls in ("Attention", "EncoderOnlyAttention")


def _is_attention_block(tree: ModuleTree, node: Node) -> bool:
    return tree.by_path.get(f"{node.path}.qkv_proj", None) is not None


def _is_block(tree: ModuleTree, node: Node) -> bool:
    """Containers whose output is all-reduced: attention blocks, MLPs, MoE blocks."""
    kids = set(tree.children(node.path))
    return "qkv_proj" in kids or {"gate_up_proj", "down_proj"} <= kids or "experts" in kids


def _moe_block(tree: ModuleTree, node: Node) -> str | None:
    """The mixture-of-experts block `node` is in (or is), if any."""
    parts = node.path.split(".")
    for i in range(len(parts), 0, -1):
        path = ".".join(parts[:i])
        if "experts" in tree.children(path):
            return path
    return None


def _model_root(tree: ModuleTree) -> str:
    return tree.layers_path.rpartition(".")[0]


# ----------------------------------------------------------------------------- runs per rank


def _writer(tree: ModuleTree, point: Point, tp: int) -> int:
    """The tensor-parallel rank that captures a replicated point: a decoder layer's on rank
    layer % tp, so that an every-layer capture's device-to-host copies and pools are spread over
    the GPUs (each copies over its own link) instead of all landing on rank 0; points outside
    the layers (embeddings, final norm, logits, samples) on rank 0."""
    node = tree.by_path.get(point.module)
    return node.layer % tp if node is not None and node.layer is not None else 0


def _rank_shard(layout: str, width: int, dims: ModelDims, tp: int, rank: int, writer: int = 0) -> RankShard:
    """Column runs of one rank, following vLLM 0.26's weight loaders; `writer`: the rank that
    captures a replicated point."""
    if layout == REPLICATED:
        whole = (Run(0, 0, width),)
        return RankShard(rank, width, whole if rank == writer else (), whole)
    q = dims.num_heads * dims.head_dim
    if layout in (COLUMNS, Q_HEADS):  # Q_HEADS: nh % tp == 0, so heads split like columns
        part = width // tp
        run = (Run(rank * part, 0, part),)
        return RankShard(rank, part, run, run)
    if layout == KV_HEADS:
        return _kv_shard(dims, tp, rank, dst0=0, src0=0)
    if layout == GATE_UP:
        half = width // 2
        part = half // tp
        runs = (Run(rank * part, 0, part), Run(half + rank * part, part, part))
        return RankShard(rank, 2 * part, runs, runs)
    if layout == QKV:  # local [q_r | k_r | v_r] into global [Q | K | V]
        q_part = q // tp
        kv_total = dims.num_kv_heads * dims.head_dim
        k = _kv_shard(dims, tp, rank, dst0=q, src0=q_part)
        v = _kv_shard(dims, tp, rank, dst0=q + kv_total, src0=q_part + k.local_width)
        head = Run(rank * q_part, 0, q_part)
        return RankShard(rank, q_part + k.local_width + v.local_width, (head, *k.writes, *v.writes),
                         (head, *k.holds, *v.holds))
    raise ValueError(layout)


def _kv_shard(dims: ModelDims, tp: int, rank: int, *, dst0: int, src0: int) -> RankShard:
    """kv heads: split evenly when kv >= tp; else head rank // R on each of R = tp / kv ranks
    (vLLM's `shard_rank = tp_rank // num_kv_head_replicas`), written by the first of them."""
    kv, hd = dims.num_kv_heads, dims.head_dim
    local_heads = max(1, kv // tp)
    replicas = max(1, tp // kv)
    first_head = (rank // replicas) * local_heads
    run = Run(dst0 + first_head * hd, src0, local_heads * hd)
    return RankShard(rank, local_heads * hd, (run,) if rank % replicas == 0 else (), (run,))
