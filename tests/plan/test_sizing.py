"""The engine allocates what the plan (and `tapc explain`) says: `Buffers` built on the CPU."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, VOCAB, toy_plan, toy_tree

from tapc.lang.edits import EDITS
from tapc.worker.buffers import Buffers
from tapc.worker.copyout import CopyOut
from tapc.worker.layout import Layout
from tapc.plan.planner import build_plan
from tapc.plan.sizing import param_slots

TAPS = [
    "model.layers.*.resid",                                   # one pool, three captures
    "model.layers.1.mlp.up_proj.output",                      # a second width
    "model.layers.0.mlp.output",
    "model.layers.*.resid | add(steer, alpha=a)",             # one shared steer and a table
    "model.layers.1.resid | project_out(steer)",              # steer again, normalised: its own table
    "model.layers.0.resid | set([1, 2], 1.5)",                # literals
    "model.layers.2.mlp.up_proj.output | zero(cols)",          # per-request columns
    "model.layers.2.resid | scale(0.5, at=prompt)",
    "logits", "samples",
    "logits | add(bias)", "logits | set(banned, value=-1000.0)",
    "model.layers.1.resid -> look",
]


class CpuUva:
    """vLLM's UvaBuffer without a GPU: the host side only."""

    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.uva = self.cpu


@pytest.fixture
def cpu_uva(monkeypatch):
    import vllm.v1.worker.gpu.buffer_utils as bu

    monkeypatch.setattr(bu, "UvaBuffer", CpuUva)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_buffers_hold_exactly_what_the_plan_says(cpu_uva, dtype):
    rows, seqs = 37, 5
    plan = build_plan("toy", TAPS, max_num_batched_tokens=rows, max_num_seqs=seqs, tree=toy_tree(),
                      capture_dtype=dtype)
    layout = Layout(plan)
    buffers = Buffers(layout, rows, seqs, 2, torch.device("cpu"))
    tensors = buffers.tensors() + CopyOut(layout, buffers.pools, rows, seqs, torch.device("cpu")).tensors()
    assert sum(t.nbytes for t in tensors) == plan.total_buffer_bytes == sum(t.buffer_bytes for t in plan.taps)
    assert len({t.data_ptr() for t in tensors}) == len(tensors), "a tensor counted twice"


def test_parameter_tables_are_shared_by_name_and_hold_the_literals(cpu_uva):
    plan = toy_plan(TAPS, rows=16, slots=3)
    layout = Layout(plan)
    buffers = Buffers(layout, 16, 3, 2, torch.device("cpu"))
    slots = param_slots(3)
    adds = [e for e, t in enumerate(layout.edits) if t.action == "add"]
    steer = {buffers.params.tables[e]["vector"].data_ptr() for e in adds}
    assert len(adds) == 3 and len(steer) == 1
    proj = next(e for e, t in enumerate(layout.edits) if t.action == "project_out")
    assert buffers.params.tables[proj]["direction"].data_ptr() not in steer
    set_ = next(e for e, t in enumerate(layout.edits) if t.action == "set")
    assert buffers.params.tables[set_]["cols"].tolist() == [[1, 2]] * slots
    assert buffers.params.tables[set_]["value"].tolist() == [[1.5, 1.5]] * slots
    scale = next(e for e, t in enumerate(layout.edits) if t.action == "scale")
    assert buffers.params.tables[scale]["factor"].tolist() == [0.5] * slots
    assert [t.action for t in layout.logit_edits] == ["add", "set"]
    assert buffers.logit_params.tables[0]["vector"].shape == (slots, VOCAB)
    assert list(buffers.params.tables[adds[0]]) == list(EDITS["add"].tables)


def test_a_request_value_goes_into_its_slot_as_the_op_reads_it(cpu_uva):
    from tapc.api.requests import TapRequest, check

    plan = toy_plan(TAPS, rows=16, slots=3)
    layout = Layout(plan)
    buffers = Buffers(layout, 16, 3, 2, torch.device("cpu"))
    rng = np.random.default_rng(0)
    steer = rng.normal(size=HIDDEN)
    ask = check(plan, TapRequest(params={"steer": steer, "a": 2.5, "cols": [3, 0, 7]}), "r")
    edits = [e for e, names in enumerate(layout.edit_params) if names and all(n in ask.params for n in names)]
    buffers.params.write(4, edits, ask.params)
    t = {layout.edits[e].action: buffers.params.tables[e] for e in edits}
    np.testing.assert_allclose(t["add"]["vector"][4].numpy(), steer.astype(np.float32))
    assert t["add"]["alpha"][4].item() == 2.5
    np.testing.assert_allclose(t["project_out"]["direction"][4].numpy(), steer / np.linalg.norm(steer), rtol=1e-6)
    cols = t["zero"]["cols"][4].tolist()
    assert cols[:3] == [3, 0, 7] and set(cols[3:]) == {-1} and t["zero"]["value"][4].abs().sum() == 0
    assert t["add"]["vector"][3].abs().sum() == 0, "other slots untouched"
