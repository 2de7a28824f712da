"""What runs in the runner, outside the graphs: `logits`, `samples`, and Python blocks' steps.

vLLM computes logits for each request's last token of the step and samples eagerly, so these
points are tapped around its sampler (patches.py `sampler_patch`): row i of the logits (and of
the sampled ids) belongs to the i-th request of the batch. A request's row is a real prediction only once
its prompt is done; a step that ran a partial prefill chunk is skipped.

- `logits` capture: one float32 row per sampled token; edits (set/zero to mask tokens, add a
  bias, scale) act in place before sampling, on the rows their `at=` covers (`LogitEdits`);
  `logits -> name` runs a block on the row.
- `samples` capture: the sampled id; `samples -> name` may overwrite it (force a token): the
  runner feeds back and returns what the block left.
- Blocks at module points run from `tapc::boundary` inside the forward; `begin_step` gives the
  runtime each request's rows of the step's slab.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

from tapc.errors import EngineError
from tapc.kernels import ops
from tapc.lang.edits import EDITS
from tapc.plan.sharding import gather_index
from tapc.wire.positions import select
from tapc.wire.protocol import BlockFailure, TensorData
from tapc.worker.component import Step, StepComponent
from tapc.worker.graphs import SegmentedGraph, breaking
from tapc.worker.layout import Layout
from tapc.worker.patches import Patch, capture_patch, sampler_patch
from tapc.worker.runtime import BlockPoint, BlockRuntime, Sharded, Span


class EnginePoints(StepComponent):
    rpcs = {"tapc_set_blocks": "set_blocks"}

    def __init__(self, layout: Layout, buffers, all_gather=None):
        """`all_gather`: the tensor-parallel group's all-gather on the last dim (worker.py),
        which blocks at sharded points need to see whole rows."""
        engine_blocks = [t for t in layout.engine if t.action == "block"]
        self.block_taps = layout.blocks + tuple(engine_blocks)
        self.runtime = BlockRuntime([BlockPoint(t.key, t.block, _sharded(layout, t.key, buffers.table.device, all_gather))
                                     for t in self.block_taps])
        self.breaks = bool(layout.blocks)   # blocks in the forward: FULL graphs break at them (graphs.py)
        self.block_at = {t.key: len(layout.blocks) + i for i, t in enumerate(engine_blocks)}
        self.captures = {t.key for t in layout.engine if t.action == "capture"}
        self.logit_edits = LogitEdits(layout, buffers)
        self.kept: dict[str, dict[str, list[torch.Tensor]]] = {}   # tapc id -> point -> rows
        self.wants: dict[str, tuple[str, ...]] = {}                 # tapc id -> engine captures
        self.rows: list[tuple] = []   # this step: (record, batch index, position) of real predictions

    def patches(self, runner) -> list[Patch]:
        """The sampler runs `logits` and `samples` around sampling; the process's `tapc::boundary`
        handler (tapc/kernels/ops.py) runs blocks; with blocks in the forward, the runner's FULL
        graphs are captured broken at them."""
        made = [sampler_patch(runner.sampler, self)] if runner.sampler is not None else []
        made.append(Patch(ops, "_boundary_handler", breaking(self.runtime)))
        if self.breaks:
            made.append(capture_patch(runner, SegmentedGraph))
        return made

    def set_blocks(self, blocks: bytes) -> None:
        """Engine-wide Python blocks, by name, cloudpickled by the API (`tapc_set_blocks`)."""
        self.runtime.register(pickle.loads(blocks))

    def admit(self, rec, computed: int) -> None:
        if rec.id in self.wants:   # resumed after a preemption: its blocks and rows go on
            return
        # Functions the offline API cloudpickled in the caller's process (protocol.Ask.blocks).
        blocks = pickle.loads(rec.ask.blocks) if rec.ask.blocks else None
        self.runtime.admit(rec.id, rec.prompt_len, blocks, request_id=rec.rid)
        # logits / samples are kept by the GPU whose plan part captures them (tapc/plan/ranks.py)
        self.wants[rec.id] = tuple(k for k in rec.ask.engine if k in self.captures)
        self.kept[rec.id] = {k: [] for k in self.wants[rec.id]}

    def begin_step(self, step: Step) -> None:
        """Each tapped request's rows of the step for the blocks, and the rows that predict a
        real token for `logits` and `samples`. `step.unadmitted`: vLLM ids of tapped requests
        this GPU could not admit (runner.py), whose blocks run elsewhere."""
        records, batch, unadmitted = step.records, step.batch, step.unadmitted
        spans, self.rows = [], []
        qsl, computed = batch.query_start_loc, batch.num_computed
        for i, rid in enumerate(batch.req_ids):
            rec = records.get(rid)
            if rec is None:
                continue
            start, end = int(qsl[i]), int(qsl[i + 1])
            first = int(computed[i])
            spans.append(Span(rec.id, start, end, first))
            last = first + end - start - 1
            if last >= rec.prompt_len - 1:   # the prompt is done: this row predicts a real token
                self.rows.append((rec, i, last))
        self.runtime.begin_step(spans, elsewhere=bool(unadmitted) and any(rid in unadmitted for rid in batch.req_ids))

    def end_step(self, step: Step | None) -> None:
        self.runtime.begin_step([])   # boundary ops in later (dummy) forwards must see no rows

    def collect(self, rec) -> dict:
        engine, saved, block_error = self.take(rec.id)
        return {"engine": engine, "saved": saved, "block_error": block_error}

    def on_logits(self, logits: torch.Tensor) -> None:
        self.logit_edits.apply(logits, self.rows)
        self._block("logits", logits)
        self._keep("logits", logits, torch.float32)

    def on_samples(self, sampled: torch.Tensor) -> None:
        self._block("samples", sampled)
        self._keep("samples", sampled, None)

    def _block(self, key: str, x: torch.Tensor) -> None:
        point = self.block_at.get(key)
        if point is not None and self.rows:
            self.runtime.run(point, x, None, [Span(rec.id, i, i + 1, pos) for rec, i, pos in self.rows])

    def _keep(self, key: str, x: torch.Tensor, dtype) -> None:
        for rec, i, _ in self.rows:
            if key in self.wants.get(rec.id, ()):
                # a device copy: stays in stream order, no sync; moved to the host at collect
                self.kept[rec.id][key].append(x[i:i + 1].to(dtype or x.dtype, copy=True))

    def take(self, tid: str) -> tuple[dict[str, TensorData], dict, BlockFailure | None]:
        """The request's engine captures (rows moved to the host now), saved values and block error."""
        kept = self.kept.pop(tid, {})
        self.wants.pop(tid, None)
        saved, error = self.runtime.take(tid)
        engine = {k: TensorData.of(torch.cat(v) if v else torch.empty(0)) for k, v in kept.items()}
        return engine, saved, error


def _sharded(layout: Layout, key: str, device, all_gather) -> Sharded | None:
    shard = layout.shards.get(key)
    if shard is None or not shard.sharded:
        return None
    if all_gather is None:
        raise EngineError(f"{key} is sharded across {shard.tp} GPUs, and its block needs the group's all-gather")
    index = torch.as_tensor(gather_index(shard), device=device)
    return Sharded(index, tuple(tuple(r) for r in shard.ranks[layout.tp_rank].holds), all_gather)


class LogitEdits:
    """Edits of the logits, applied as vLLM's `LogitBiasState` applies logit biases: a request's
    values are staged once, when it is admitted, into its slot of per-slot device tables
    (`ParamTables.write`, the same tables and ops as in-graph edits); each step, one op per edit
    runs over the whole batch's logits, reading a row table that maps logits row i to its
    request's slot (-1: not edited); an edit that no row of the step uses is not launched."""

    def __init__(self, layout: Layout, buffers):
        self.taps = layout.logit_edits
        self.tables = buffers.logit_params.tables
        self.rows = buffers.logit_rows             # device [edits, max_num_seqs]
        self.staging = buffers.staging
        self.at = layout.logit_edit_at
        self.always = [not names for names in layout.logit_edit_params]
        if self.taps:
            import tapc.kernels  # noqa: F401  registers torch.ops.tapc.*
        self.ops = [getattr(torch.ops.tapc, EDITS[t.action].kernel) for t in self.taps]

    def apply(self, logits: torch.Tensor, rows: list[tuple]) -> None:
        """rows: (record, logits row, position) of the step's real predictions."""
        if not self.taps or not rows:
            return
        n = logits.shape[0]
        if n > self.rows.shape[1]:
            raise EngineError(f"{n} rows of logits in one step, more than the {self.rows.shape[1]} requests "
                              "(max_num_seqs) the plan sized its logits edits for")
        recs = [rec for rec, _, _ in rows]
        row = np.array([i for _, i, _ in rows], dtype=np.int64)
        pos = np.array([p for _, _, p in rows], dtype=np.int64)
        plen = np.array([rec.prompt_len for rec in recs], dtype=np.int64)
        slot = np.array([rec.slot for rec in recs], dtype=np.int32)
        table = np.full(self.rows.shape, -1, dtype=np.int32)   # whole: one contiguous copy up
        for e in range(len(self.taps)):
            mine = select(self.at[e], pos, plen)
            if self.always[e]:   # its literals fill every slot: slot 0 serves every request
                table[e, row[mine]] = 0
            else:
                mine &= np.array([e in rec.logit_edits for rec in recs]) & (slot >= 0)
                table[e, row[mine]] = slot[mine]
        used = np.flatnonzero((table >= 0).any(axis=1))
        if not used.size:
            return
        self.staging.put(self.rows, table)
        for e in used.tolist():
            self.ops[e](logits, None, self.rows[e], *self.tables[e].values())
