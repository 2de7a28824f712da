"""The adapter between vLLM 0.26's V1 model runner (`vllm/v1/worker/gpu_model_runner.py`,
`GPUModelRunner`) and the runner-independent hooks (runner.py): the only code that knows that
runner's methods and its persistent `InputBatch`.

vLLM 0.26 runs MoE, hybrid and pooling models on V1, and dense models there too when
`VLLM_USE_V2_MODEL_RUNNER=0`; 0.34 has no V1 runner, and the worker imports this module only
where vLLM has one (worker.py `ADAPTERS`).

Where V2 hands back a per-step batch from `prepare_inputs`, V1 keeps one persistent batch
(`runner.input_batch`: requests in slot order, condensed when some leave, reordered for the
attention backend) and prepares the step in place; the forward is `_model_forward`, called
inside the forward context once the step's layout is final (`query_start_loc`, positions,
padding to a graph size). So:
- `execute_model(scheduler_output)` is one step: the hooks hear of new, finished, preempted and
  resumed requests before it, and start the captures' copies out after it;
- `_model_forward(...)` reads the batch as a `StepBatch` (`step_batch`) and fills the tables
  just before the model (or its FULL graph) runs;
- `_dummy_run(...)` (profiling, warmup, graph capture) runs with tables that own no rows.
Sampling (`sample_tokens`, after `execute_model` returns) goes through the same sampler patch
as V2's (patches.py): its logits rows are the batch's requests in the same order.
"""
from __future__ import annotations

import numpy as np

from tapc.errors import EngineError
from tapc.worker.runner import RunnerHooks, row_positions
from tapc.worker.step import StepBatch


class V1Adapter:
    RUNNER = "V1 (vllm/v1/worker/gpu_model_runner.py)"   # as the worker's refusal names it
    METHODS = ("execute_model", "_model_forward", "_dummy_run")   # the runner's methods it replaces

    @staticmethod
    def matches(runner) -> bool:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        return isinstance(runner, V1Runner)

    def __init__(self, runner, hooks: RunnerHooks):
        self.runner = runner
        self.hooks = hooks
        self._execute = runner.execute_model
        self._forward = runner._model_forward
        self._dummy = runner._dummy_run

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.hooks.schedule(scheduler_output)
        out = self._execute(scheduler_output, *args, **kwargs)
        self.hooks.end_step()
        return out

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        rows = _rows(input_ids, positions, inputs_embeds)
        self.hooks.begin_step(step_batch(self.runner.input_batch, self.runner.query_start_loc.np, rows))
        return self._forward(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                             inputs_embeds=inputs_embeds, **model_kwargs)

    @staticmethod
    def positions(runner):
        """The model's positions, on the device, one a row of the slab (or None: runner.py)."""
        return row_positions(runner.model_config, runner.positions)

    def _dummy_run(self, *args, **kwargs):
        self.hooks.reset()
        return self._dummy(*args, **kwargs)

    def graphs(self) -> dict:
        """The FULL graphs the runner captured, by batch descriptor (V1 wraps the whole model in
        one `CUDAGraphWrapper(FULL)` when FULL graphs are on; none otherwise)."""
        entries = getattr(self.runner.model, "concrete_cudagraph_entries", {})
        return {d: e.cudagraph for d, e in entries.items() if e.cudagraph is not None}


def step_batch(input_batch, query_start_loc: np.ndarray, padded: int) -> StepBatch:
    """V1's persistent batch at the forward, as the plain value: its first `num_reqs` entries
    in batch order; `query_start_loc` is the runner's host copy (`runner.query_start_loc.np`),
    `padded` the rows the forward runs."""
    n = input_batch.num_reqs
    req_ids = list(input_batch.req_ids[:n])
    if any(r is None for r in req_ids):   # vLLM condenses the batch before the forward; a hole is a bug
        raise EngineError(f"vLLM's V1 input batch has an empty slot among its first {n} requests at the forward")
    return StepBatch(req_ids=req_ids, query_start_loc=query_start_loc[: n + 1],
                     num_computed=input_batch.num_computed_tokens_cpu[:n],
                     prompt_lens=input_batch.num_prompt_tokens[:n], padded=padded)


def _rows(input_ids, positions, inputs_embeds) -> int:
    """Rows of the step's slab (padded): positions are [rows] (or [3, rows] under M-RoPE)."""
    if positions is not None:
        return int(positions.shape[-1])
    return int((input_ids if input_ids is not None else inputs_embeds).shape[0])
