"""Every process-wide patch the worker makes is applied in one place and undone exactly."""
import torch
import pytest
from engine_toy import ToyCopyOut, ToyModel, ToyRunner, ToyRunnerV1, toy_buffers, toy_plan

from tapc.worker import patches
from tapc.wire.arena import Arena
from tapc.worker.points import EnginePoints
from tapc.worker.runner import RunnerHooks
from tapc.worker.runner_v1 import V1Adapter
from tapc.worker.runner_v2 import V2Adapter
from tapc.worker.slots import EditSlots
from tapc.worker.tables import StepTables
from tapc.worker.layout import Layout
from tapc.kernels import ops


class Sampler:
    """V2 calls it as sampler(logits, input_batch), V1 as sampler(logits=..., sampling_metadata=...)."""

    def __call__(self, logits, input_batch=None, sampling_metadata=None):
        return type("Out", (), {"sampled_token_ids": logits.argmax(dim=-1, keepdim=True)})()


class Runner(ToyRunner):
    def capture_model(self):
        return torch.cuda.CUDAGraph


class RunnerV1(ToyRunnerV1):
    def capture_model(self):
        return torch.cuda.CUDAGraph


@pytest.mark.parametrize("runner_cls,adapter_cls", [(Runner, V2Adapter), (RunnerV1, V1Adapter)], ids=["v2", "v1"])
def test_undo_restores_every_original(runner_cls, adapter_cls):
    plan = toy_plan(["model.layers.0.resid -> look", "logits | add(bias)", "samples"])
    layout = Layout(plan)
    buffers = toy_buffers(layout)
    arena = Arena(segment_bytes=4096)
    runner = runner_cls(ToyModel())
    runner.sampler = sampler = Sampler()
    points = EnginePoints(layout, buffers)
    tables = StepTables(layout, buffers, ToyCopyOut(buffers.pools), arena)
    components = [tables, EditSlots(buffers), points]
    adapter = adapter_cls(runner, RunnerHooks(layout, arena, components))
    before = (dict(vars(runner)), type(sampler), ops._boundary_handler, torch.cuda.CUDAGraph)
    assert runner.capture_model() is torch.cuda.CUDAGraph

    applied = patches.apply(runner, adapter, components)
    assert all(getattr(runner, name) == getattr(adapter, name) for name in adapter_cls.METHODS)
    assert type(sampler) is not Sampler and isinstance(sampler, Sampler)
    logits = torch.randn(3, 7)
    for call in (lambda: sampler(logits, None), lambda: sampler(logits=logits, sampling_metadata=None)):
        assert torch.equal(call().sampled_token_ids, logits.argmax(dim=-1, keepdim=True)), "either runner's call"
    assert ops._boundary_handler is not None
    from tapc.worker.graphs import SegmentedGraph

    assert runner.capture_model() is SegmentedGraph, "FULL graphs captured breakable"
    assert torch.cuda.CUDAGraph is before[3], "the class swap lasts only as long as the capture"
    assert len(applied.applied) == len(adapter_cls.METHODS) + 3

    applied.undo()
    assert dict(vars(runner)) == before[0], "the runner's methods are its class's again"
    assert type(sampler) is before[1] and ops._boundary_handler is before[2]
    assert torch.cuda.CUDAGraph is before[3] and runner.capture_model() is before[3]
    assert applied.applied == []


def test_a_patch_of_an_attribute_the_owner_had_puts_that_one_back():
    class Owner:
        pass

    owner = Owner()
    owner.x = 1
    with patches.Patch(owner, "x", 2):
        assert owner.x == 2
    assert vars(owner) == {"x": 1}
    with patches.Patch(owner, "y", 3):
        assert owner.y == 3
    assert vars(owner) == {"x": 1}
