"""Row tables, host storage, request checks and engine arguments: every error with its words."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, toy_plan

from tapc.engine.config import WORKER, engine_kwargs
from tapc.engine.positions import select
from tapc.engine.protocol import WireRequest
from tapc.engine.requests import TapRequest, check
from tapc.engine.fill import fill_step
from tapc.engine.layout import Layout
from tapc.engine.positions import expected_rows
from tapc.engine.records import Record
from tapc.engine.slots import Slots
from tapc.engine.step import StepBatch
from tapc.engine.storage import Store
from tapc.errors import EngineError, RequestError

PLAN_TAPS = ["model.layers.*.resid", "model.layers.1.mlp.up_proj.output",
             "model.layers.2.resid | add(steer, alpha=a)", "model.layers.0.resid | set([1, 2], 1.5)",
             "model.layers.1.resid | zero(cols)"]


def cpu_alloc(rows, caps, width, dtype):
    return torch.zeros(rows, caps, width, dtype=dtype)


def test_select_positions():
    pos = np.arange(2, 9)
    assert select("all", pos, 5).all()
    assert pos[select("prompt", pos, 5)].tolist() == [2, 3, 4]
    assert pos[select("generated", pos, 5)].tolist() == [5, 6, 7, 8]
    assert pos[select("last", pos, 5)].tolist() == [4]
    assert pos[select([0, 3, 8], pos, 5)].tolist() == [3, 8]


@pytest.mark.parametrize("positions,rows", [("all", 7), ("prompt", 5), ("generated", 2), ("last", 1), ([1, 6, 7], 2)])
def test_expected_rows(positions, rows):
    # 5 prompt tokens, 3 generated: positions 0..6 went through the model.
    assert expected_rows(positions, 5, 3) == rows


def test_fill_lays_each_request_block_out_position_major():
    plan = toy_plan(PLAN_TAPS)
    layout = Layout(plan)
    assert [len(g.caps) for g in layout.groups] == [3, 1], "resid (16 wide) and up_proj (24 wide)"
    wire = WireRequest("t", check(plan, TapRequest(capture=["model.layers.0.resid", "model.layers.2.resid",
                                                            "model.layers.1.mlp.up_proj.output"],
                                                   params={"steer": [0.0] * HIDDEN, "a": 1.0}), "r"))
    rec = Record(layout, "rid", wire, prompt_len=4, max_tokens=3, alloc=cpu_alloc)
    assert [st.first for st in rec.stores] == [7, 7], "4 + 3 - 1 rows, and one for a step past the end"
    rec.slot = 5
    table = np.zeros((layout.num_tables, 16), dtype=np.int32)
    # Batch: an untapped decode row, then rows 1..3 of our request (positions 2..4), padding to 8.
    segs, used = fill_step(layout, table, {"rid": rec}, StepBatch(["other", "rid"], np.array([0, 1, 4]),
                                                                  np.array([9, 2]), np.array([3, 4]), padded=8))
    assert used == [6, 3]
    resid = layout.groups[0].caps
    assert table[resid[0], :8].tolist() == [-1, 0, 2, 4, -1, -1, -1, -1]
    assert table[resid[2], :8].tolist() == [-1, 1, 3, 5, -1, -1, -1, -1]
    assert (table[resid[1], :8] == -1).all(), "layer 1's resid was not asked for"
    assert table[layout.edit_row(0), :8].tolist() == [-1, 5, 5, 5, -1, -1, -1, -1]
    assert table[layout.edit_row(1), :8].tolist() == [0, 0, 0, 0, -1, -1, -1, -1], "set() without parameters"
    assert (table[layout.edit_row(2), :8] == -1).all(), "zero(cols) is not bound by the request"
    assert [(s.store.group, s.start, s.rows) for s in segs] == [(0, 0, 3), (1, 0, 3)]
    assert (table[:, 8:] == 0).all(), "past the padded rows the table is not touched"


def test_store_grows_and_splits_a_block_over_chunks():
    st = Store(0, np.array([0, 1]), 3, torch.float32, cpu_alloc, first=10)
    rows = torch.arange(80 * 2 * 3, dtype=torch.float32).view(80, 2, 3)   # row r of the request
    done = 0
    # Views are flat, `[rows * 2 captures, width]`.
    for n, shapes in [(6, [12]), (6, [8, 4]), (3, [6]), (0, [0])]:
        views = st.reserve(n)
        assert [v.shape[0] for v in views] == shapes
        src = rows[done: done + n].reshape(-1, 3)
        for v in views:
            v.copy_(src[: v.shape[0]])
            src = src[v.shape[0]:]
        done += n
    assert [c.shape[0] for c in st.chunks] == [10, 64], "10 rows in the first chunk, the rest in a new one"
    assert [n for _, n in st.filled()] == [10, 5]
    assert torch.equal(torch.cat([c[:n] for c, n in st.filled()]), rows[:15]), "every row where it belongs, in order"


def test_slots_run_out_loudly():
    slots = Slots(1)
    slots.take()
    with pytest.raises(EngineError, match="parameter slots are taken"):
        slots.take()


@pytest.mark.parametrize("ask,words", [
    (TapRequest(capture="model.layers.1.resdi"), "did you mean 'model.layers.1.resid'"),
    (TapRequest(capture=["model.layers.7.resid"]), "not a capture of this engine's plan"),
    (TapRequest(capture="*", positions="middle"), "positions 'middle'"),
    (TapRequest(capture="*", positions=[3, 3]), "distinct non-negative"),
    (TapRequest(params={"stear": [0.0] * HIDDEN}), "parameter 'stear' is not named by any tap"),
    (TapRequest(params={"steer": [0.0] * 3, "a": 1.0}), "must be 16 numbers"),
    (TapRequest(params={"steer": [float("nan")] * HIDDEN, "a": 1.0}), "non-finite"),
    (TapRequest(params={"steer": [0.0] * HIDDEN}), "binds 'steer' but not 'a'"),
    (TapRequest(params={"steer": [0.0] * HIDDEN, "a": "big"}), "must be a finite number"),
    (TapRequest(params={"cols": [1, 99]}), "distinct column indices in 0..15"),
])
def test_request_errors(ask, words):
    with pytest.raises(RequestError, match="request 2: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        check(toy_plan(PLAN_TAPS), ask, "request 2")


def test_request_by_tap_line_expands_the_glob():
    ask = check(toy_plan(PLAN_TAPS), TapRequest(capture="model.layers.*.resid", params={"cols": 3}), "r")
    assert ask.capture == tuple(f"model.layers.{i}.resid" for i in range(3))
    assert ask.params == {"cols": [3]} and ask.positions == "all"


def test_engine_kwargs():
    plan = toy_plan(PLAN_TAPS, rows=64, slots=8)
    kw = engine_kwargs(plan, {"max_num_batched_tokens": 64, "additional_config": {"mine": 1}})
    assert kw["worker_cls"] == WORKER and kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == 8
    assert kw["additional_config"]["mine"] == 1 and plan.digest != kw["additional_config"]["tapc"]["digest"]


@pytest.mark.parametrize("kwargs,words", [
    ({"enable_prefix_caching": True}, "prefix cache skip the forward"),
    ({"tensor_parallel_size": 2}, "one GPU"),
    ({"worker_cls": "my.Worker"}, "runs tapc's worker"),
    ({"max_num_seqs": 9}, "plan was built for 8"),
])
def test_engine_kwargs_refuse(kwargs, words):
    with pytest.raises(EngineError, match=words):
        engine_kwargs(toy_plan(PLAN_TAPS, slots=8), kwargs)


def test_v1_runner_is_refused_before_starting(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(EngineError, match="V1 model runner"):
        engine_kwargs(toy_plan(PLAN_TAPS), {})


