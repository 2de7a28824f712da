"""What runs in the runner, outside the graphs: `logits`, `samples`, and Python blocks' steps.

vLLM computes logits for each request's last token of the step and samples eagerly, so these
points are tapped around its sampler (`wrap_sampler`): row i of the logits (and of the sampled
ids) belongs to the i-th request of the batch. A request's row is a real prediction only once
its prompt is done; a step that ran a partial prefill chunk is skipped.

- `logits` capture: one float32 row per sampled token; edits (set/zero to mask tokens, add a
  bias, scale) act in place before sampling; `logits -> name` runs a block on the row.
- `samples` capture: the sampled id; `samples -> name` may overwrite it (force a token): the
  runner feeds back and returns what the block left.
- Blocks at module points run from `tapc::boundary` inside the forward; `begin_step` gives the
  runtime each request's rows of the step's slab.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

from tapc.engine.layout import Layout
from tapc.engine.protocol import BlockFailure, TensorData, WireRequest
from tapc.engine.step import StepBatch
from tapc.runtime import BlockPoint, BlockRuntime, Span


class EnginePoints:
    def __init__(self, layout: Layout):
        engine_blocks = [t for t in layout.engine if t.action == "block"]
        self.block_taps = layout.blocks + tuple(engine_blocks)
        self.runtime = BlockRuntime([BlockPoint(t.key, t.block) for t in self.block_taps])
        self.block_at = {t.key: len(layout.blocks) + i for i, t in enumerate(engine_blocks)}
        self.logit_edits = [t for t in layout.engine if t.key == "logits" and t.action not in ("capture", "block")]
        self.kept: dict[str, dict[str, list[torch.Tensor]]] = {}   # tapc id -> point -> rows
        self.wants: dict[str, tuple[str, ...]] = {}                 # tapc id -> engine captures
        self.rows: list[tuple] = []   # this step: (record, batch index, position) of real predictions

    def admit(self, rec, wire: WireRequest) -> None:
        # Functions the offline API cloudpickled in the caller's process (protocol.Ask.blocks).
        blocks = pickle.loads(wire.ask.blocks) if wire.ask.blocks else None
        self.runtime.admit(rec.id, rec.prompt_len, blocks, request_id=rec.rid)
        self.wants[rec.id] = wire.ask.engine
        self.kept[rec.id] = {k: [] for k in self.wants[rec.id]}

    def begin_step(self, records: dict, batch: StepBatch) -> None:
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
        self.runtime.begin_step(spans)

    def on_logits(self, logits: torch.Tensor) -> None:
        for rec, i, pos in self.rows:
            for tap in self.logit_edits:
                _edit_row(logits[i], tap, rec.params)
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


def _edit_row(row: torch.Tensor, tap, params: dict) -> None:
    """An edit of one request's logits row, from the tap's literals and the request's values.
    An edit with parameters applies only to requests that bind them (as in-graph edits do)."""
    values = {}
    for a in tap.args:
        if a.param is None:
            values[a.name] = a.value
        elif a.param in params:
            values[a.name] = params[a.param]
        else:
            return
    op = tap.action
    if op == "add":
        vec = values["vector"]
        vec = np.frombuffer(vec, dtype=np.float32) if isinstance(vec, bytes) else np.asarray(vec, dtype=np.float32)
        row.add_(torch.from_numpy(vec.copy()).to(row.device, row.dtype), alpha=float(values["alpha"]))
    elif op == "scale":
        row.mul_(float(values["factor"]))
    elif op in ("set", "zero"):
        cols = torch.as_tensor(list(values["cols"]), device=row.device)
        value = values.get("value", 0.0)
        row[cols] = torch.as_tensor(value, dtype=row.dtype, device=row.device) if isinstance(value, (int, float)) \
            else torch.as_tensor(list(value), dtype=row.dtype, device=row.device)


def wrap_sampler(sampler, points: EnginePoints) -> None:
    """Run `points` around vLLM's sampler: logits before sampling, sampled ids after."""
    base = type(sampler)

    class TappedSampler(base):
        def __call__(self, logits, input_batch):
            points.on_logits(logits)
            out = base.__call__(self, logits, input_batch)
            points.on_samples(out.sampled_token_ids)
            return out

    TappedSampler.__name__ = f"Tapped{base.__name__}"
    sampler.__class__ = TappedSampler
