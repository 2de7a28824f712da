"""A point's part of each GPU under tensor and pipeline parallelism, as the plan holds it
(`TapPlan.shards`): its column layout, its stage, and per tensor-parallel rank the column runs it
writes and holds. tapc/plan/sharding.py computes them from vLLM's module tree."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import NamedTuple

# Layouts of a point's columns under tensor parallelism.
REPLICATED = "replicated"  # every rank holds the whole row (after an all-reduce, or never split)
COLUMNS = "columns"        # one column-parallel part split evenly: rank r holds slice r
Q_HEADS = "q_heads"        # query heads (nh / N per rank): q, attention output, o_proj input
KV_HEADS = "kv_heads"      # key or value heads; replicated over R = N / kv ranks when kv < N
QKV = "qkv"                # QKVParallelLinear output: per rank [q_r | k_r | v_r]
GATE_UP = "gate_up"        # MergedColumnParallelLinear output: per rank [gate_r | up_r]
REFUSED = "refused"        # no layout tapc can name (see PointShard.refused)

# add, scale, set and zero act column by column: each rank edits its own (local_vector,
# local_columns). These need the whole row, so every rank's columns:
WHOLE_ROW_EDITS = ("project_out",)


class Run(NamedTuple):
    """Local columns `src:src+n` of a rank are columns `dst:dst+n` of the single-GPU layout."""

    dst: int
    src: int
    n: int


@dataclass(frozen=True)
class RankShard:
    """One tensor-parallel rank's part of a point.

    writes: runs this rank copies into the host block; over all ranks every column of the
            single-GPU layout is written exactly once (a kv head held by several ranks is
            written by the first of them; a replicated point by one rank: layer % tp for a
            decoder layer's points, else rank 0).
    holds:  runs naming every local column (replicas included): what an edit touches and
            what a gathered block result is scattered back into.
    """

    rank: int
    local_width: int
    writes: tuple[Run, ...]
    holds: tuple[Run, ...]


@dataclass(frozen=True)
class PointShard:
    """A point under tensor parallel size `tp` and pipeline parallel size `pp`.

    `width` is per token. For a per-head norm (Qwen3's q_norm / k_norm, which see [tokens,
    heads, head_dim]) it is heads x head_dim: the runs address the token's heads laid side by
    side, while the plan sizes those points one head per row.
    """

    key: str
    layout: str                     # one of the layouts above
    width: int                      # columns per token in the single-GPU layout
    stage: int                      # pipeline stage (0 .. pp-1) that runs the point
    tp: int
    ranks: tuple[RankShard, ...]    # one per tensor-parallel rank (empty when refused)
    refused: str | None = None      # why the point cannot be tapped at this tp (None: it can)

    @property
    def sharded(self) -> bool:
        return self.layout not in (REPLICATED, REFUSED)

    def refusal(self, action: str) -> str | None:
        """The message for an action this point cannot take under tensor parallelism, else None."""
        if self.refused:
            return self.refused
        if self.sharded and action in WHOLE_ROW_EDITS:
            return (f"{self.key} is sharded across {self.tp} GPUs under tensor parallelism; {action} needs "
                    f"the whole row: tap {replicated_neighbour(self.key)} instead, or run tensor_parallel_size=1")
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PointShard":
        def runs(rs):
            return tuple(Run(*r) for r in rs)

        ranks = tuple(RankShard(r["rank"], r["local_width"], runs(r["writes"]), runs(r["holds"])) for r in d["ranks"])
        return cls(**{**d, "ranks": ranks})


def replicated_neighbour(key: str) -> str:
    """A replicated point near a sharded one: the attention or MLP block's output."""
    m = re.match(r"(.*?\.(?:self_attn|attention|attn_block|mlp|feed_forward))(?:\.|$)", key)
    return f"`{m.group(1)}.output`" if m else "the decoder layer's `.resid`"
