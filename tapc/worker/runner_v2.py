"""The adapter between vLLM 0.26's V2 model runner (`vllm/v1/worker/gpu/model_runner.py`) and
the runner-independent hooks (runner.py): the only code that knows that runner's methods and
its `InputBatch`.

`execute_model(scheduler_output)` is one step; `prepare_inputs` (called inside it, before the
forward) returns the batch's final row layout, which becomes a `StepBatch`. Dummy runs
(`dummy_run=True`: profiling, warmup) reset the tables instead. A V1 runner (MoE models) gets
its own adapter with the same three calls; the fill does not change.
"""
from __future__ import annotations

from tapc.worker.runner import RunnerHooks, row_positions
from tapc.worker.step import StepBatch


class V2Adapter:
    RUNNER = "V2 (vllm/v1/worker/gpu/)"   # as the worker's refusal names it
    METHODS = ("execute_model", "prepare_inputs")   # the runner's methods it replaces

    @staticmethod
    def matches(runner) -> bool:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

        return isinstance(runner, V2Runner)

    def __init__(self, runner, hooks: RunnerHooks):
        self.runner = runner
        self.hooks = hooks
        self._execute = runner.execute_model
        self._prepare = runner.prepare_inputs

    def execute_model(self, scheduler_output, *args, dummy_run: bool = False, **kwargs):
        if dummy_run:
            self.hooks.reset()
            return self._execute(scheduler_output, *args, dummy_run=True, **kwargs)
        self.hooks.schedule(scheduler_output)
        out = self._execute(scheduler_output, *args, **kwargs)
        self.hooks.end_step()
        return out

    @staticmethod
    def positions(runner):
        """The model's positions, on the device, one a row of the slab (or None: runner.py)."""
        return row_positions(runner.model_config, runner.input_buffers.positions)

    def prepare_inputs(self, scheduler_output, batch_desc):
        batch = self._prepare(scheduler_output, batch_desc)
        self.hooks.begin_step(step_batch(batch, self.runner.req_states.prompt_len.np))
        return batch

    def graphs(self) -> dict:
        """The FULL graphs the runner captured, by batch descriptor (none under enforce_eager)."""
        manager = self.runner.cudagraph_manager
        return dict(manager.graphs) if manager is not None else {}


def step_batch(batch, prompt_len_by_state) -> StepBatch:
    """A V2 `InputBatch` as the plain value; `prompt_len_by_state` is indexed by the runner's
    request-state index (`idx_mapping_np` maps batch order to it)."""
    return StepBatch(req_ids=batch.req_ids, query_start_loc=batch.query_start_loc_np,
                     num_computed=batch.num_computed_tokens_np,
                     prompt_lens=prompt_len_by_state[batch.idx_mapping_np],
                     padded=batch.num_tokens_after_padding)
