"""What a step component declares reaches the worker through the hooks alone: the RPCs it
answers, the patches it needs (after the runner adapter's), the step it hands on to the
components after it, and its part of a collect (tapc/worker/component.py, runner.py)."""
import numpy as np
import pytest
from engine_toy import Req, ToyModel, ToyRunner, hooks_for, run, toy_plan, wire_for

from tapc.api.requests import TapRequest
from tapc.errors import EngineError
from tapc.wire.arena import Arena
from tapc.worker import patches
from tapc.worker.component import StepComponent
from tapc.worker.layout import Layout
from tapc.worker.runner import RunnerHooks
from tapc.worker.runner_v2 import V2Adapter
from tapc.worker.step import StepBatch
from tapc.worker.tables import StepTables


class Counter(StepComponent):
    """Answers `tapc_count`; needs the runner's `mark` set; hands on the step's taps plus one."""

    rpcs = {"tapc_count": "count"}

    def __init__(self):
        self.counted, self.seen = [], []

    def count(self, n):
        self.counted.append(n)
        return len(self.counted)

    def patches(self, runner):
        return [patches.Patch(runner, "mark", "counted")]

    def begin_step(self, step):
        self.seen.append(step.taps)
        return step._replace(taps=step.taps + 1)

    def end_step(self, step):
        self.seen.append(step.taps)


class Later(Counter):
    rpcs = {}   # one component an RPC


def hooks_of(*components):
    return RunnerHooks(Layout(toy_plan(["model.layers.0.resid"])), Arena(segment_bytes=4096), components)


def test_an_rpc_reaches_the_component_that_declared_it():
    counter = Counter()
    hooks = hooks_of(StepComponent(), counter)
    assert hooks.rpc("tapc_count")(7) == 1 and counter.counted == [7]
    assert hooks.rpc("tapc_unknown") is None, "no component here answers it"
    assert hooks.component(Counter) is counter and hooks.component(StepTables) is None
    with pytest.raises(EngineError, match="tapc_count"):
        hooks_of(Counter(), Counter())


def test_a_components_patches_follow_the_adapters_and_are_undone():
    runner, counter = ToyRunner(ToyModel()), Counter()
    adapter = V2Adapter(runner, hooks_of(counter))
    applied = patches.apply(runner, adapter, [counter])
    assert runner.mark == "counted" and runner.execute_model == adapter.execute_model
    assert [p.name for p in applied.applied] == [*V2Adapter.METHODS, "mark"]
    applied.undo()
    assert not hasattr(runner, "mark") and "execute_model" not in vars(runner)


def test_each_component_gets_the_step_the_one_before_handed_on():
    first, second = Counter(), Later()
    hooks = hooks_of(first, second)
    hooks.begin_step(StepBatch([], np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                               np.zeros(0, dtype=np.int32), 8))
    hooks.end_step()
    assert first.seen == [-1, 1] and second.seen == [0, 1], "end_step: the step as the last one handed it on"


def test_a_failed_part_of_a_collect_is_all_its_result_carries():
    plan = toy_plan(["model.layers.0.resid", "logits"])
    runner, hooks = hooks_for(plan, ToyModel())
    tables = hooks.component(StepTables)
    tables.collect = lambda rec: {"error": "lost"}
    req = Req("r", [1, 2, 3], 2, wire_for(plan, TapRequest(capture="*"), "r"))
    run(runner, [req], budget=16)
    (result,) = hooks.collect(["r"]).results
    assert result.error == "lost" and result.engine == {} and result.stores == (), "the engine points' part dropped"
