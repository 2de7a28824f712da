"""Which tap kernels a step runs (tapc/worker/switch.py), on the CPU stand-in.

On a GPU a kernel whose taps the step's requests do not ask for is a disabled graph node, and
outside graphs (batches larger than vLLM's largest graph) its op launches nothing. Here the toy
engine runs every forward as the latter: an op asks the switch (`Switch.idle`, installed by
patches.apply as the worker does) and skips when the step asks nothing of its tap; at every skip
its row table must own none of the step's rows (what the kernel would have done is nothing).
The captures are then compared with the model run alone, as in test_engine.py, under
continuous batching, steering and a parameterless edit.
"""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for
from toy_checks import TAPS, check, make_requests, run_and_check

from tapc.api.requests import TapRequest
from tapc import settings
from tapc.worker.switch import ALL, Switch, SwitchedGraph
from tapc.kernels import capture as kcapture
from tapc.kernels import edit as kedit
from tapc.kernels import ops
from tapc.api.session import TapSession

# What the ops call (the Triton kernels, in the interpreter here, or the torch references).
CALLS = [(kcapture, "capture"), (kcapture, "capture_pair"), (kcapture, "capture_trio"), (kcapture, "capture_sum"),
         (kedit, "add_"),
         (kedit, "scale_"), (kedit, "set_cols_"), (kedit, "project_out_")]


@pytest.fixture
def switched(monkeypatch):
    """Counts the kernels run and the launches skipped, {"on": n, "off": n}; `start(plan, **kw)`
    is the toy engine (`hooks_for`) with a switch, whose `idle` the ops ask."""
    seen = {"on": 0, "off": 0}
    monkeypatch.setattr(ops, "_idle", None)   # put back after the test: the worker's patch is process-wide

    def counted(fn):
        def kernel(*args):
            seen["on"] += 1
            return fn(*args)
        return kernel

    for module, name in CALLS:
        for fn in (name, f"{name.rstrip('_')}_ref"):
            monkeypatch.setattr(module, fn, counted(getattr(module, fn)))

    def start(plan, **kwargs):
        runner, hooks = hooks_for(plan, ToyModel(), switch=True, **kwargs)
        asked = ops._idle
        assert asked == hooks.component(Switch).idle, "the hooks' patches make the ops ask the switch"
        begin, step = hooks.begin_step, {}

        def begin_step(batch):
            step["rows"] = batch.padded
            begin(batch)

        def idle(table):
            if not asked(table):
                return False
            seen["off"] += 1
            owned = int((table[: step["rows"]] >= 0).sum())
            assert not owned, f"a skipped launch's row table owns {owned} rows of this step"
            return True

        monkeypatch.setattr(ops, "_idle", idle)
        monkeypatch.setattr(hooks, "begin_step", begin_step)
        return runner, hooks

    return seen, start


@pytest.mark.parametrize("runner_kind", ["v2", "v1"])
def test_captures_equal_reference_with_unasked_taps_switched_off(switched, runner_kind):
    seen, start = switched
    plan = toy_plan(TAPS)
    run_and_check(*start(plan, runner=runner_kind), plan)
    # requests ask for different keys and one for none, so some steps leave some taps off
    assert seen["on"] and seen["off"], seen


def test_steered_and_plain_requests_with_unasked_taps_switched_off(switched):
    seen, start = switched
    plan = toy_plan(["model.layers.1.resid | add(steer, alpha=2.0)", "model.layers.*.resid"])
    runner, hooks = start(plan)
    rng = np.random.default_rng(3)
    vec = rng.standard_normal(HIDDEN)
    asks = {"steered": TapRequest(capture="model.layers.2.resid", params={"steer": vec}),
            "plain": TapRequest(capture="model.layers.0.resid"), "untapped": None}
    reqs = [Req(rid, rng.integers(0, 50, 4 + 5 * i).tolist(), 3 + 4 * i, wire_for(plan, ask, rid))
            for i, (rid, ask) in enumerate(asks.items())]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    check(reqs[0], dict(outs["steered"].taps), "all", [(1, vec, 2.0, "all")])
    check(reqs[1], dict(outs["plain"].taps), "all")
    assert seen["off"], "the untapped request's last steps ask for nothing"


def wants_of(hooks) -> list[tuple[int, int]]:
    """(the least computed tokens of its requests, `Switch.want`) of each step from here on."""
    wants = []
    begin, switch = hooks.begin_step, hooks.component(Switch)

    def begin_step(batch):
        begin(batch)
        wants.append((int(batch.num_computed[: len(batch.req_ids)].min()), switch.want))

    hooks.begin_step = begin_step
    return wants


def assert_decode_asks_nothing(wants, seen, past: int) -> None:
    """Every step whose requests are all past `past` tokens (past every prompt: decode) ran no
    tap kernel, and some launch was skipped."""
    decode = [want for computed, want in wants if computed >= past]
    assert decode and all(want == 0 for want in decode), wants
    assert seen["off"], "the decode steps' launches are skipped"


@pytest.mark.parametrize("positions", ["prompt", "last"])
def test_captures_at_prompt_positions_ask_nothing_of_decode_steps(switched, positions):
    """Their decode steps replay the graphs without tap kernels (want 0) and the captures are
    whole: the prompt's rows, equal to the reference."""
    seen, start = switched
    plan = toy_plan(TAPS)
    runner, hooks = start(plan)
    wants = wants_of(hooks)
    rng = np.random.default_rng(5)
    reqs = [Req(rid, rng.integers(0, 50, plen).tolist(), 6,
                wire_for(plan, TapRequest(capture="*", positions=positions), rid)) for rid, plen in (("p", 9), ("q", 13))]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        check(r, dict(outs[r.rid].taps), positions)
    assert wants[0][1] != 0, "the prompt step runs the capture kernels"
    assert_decode_asks_nothing(wants, seen, past=13)


def test_edits_at_prompt_positions_ask_nothing_of_decode_steps(switched):
    """A steering edit `at=prompt` (one request with prompt captures, one steered only): the
    decode steps run no tap kernel, and the captures hold the edit on the prompt's rows."""
    seen, start = switched
    plan = toy_plan(["model.layers.1.resid | add(steer, alpha=2.0, at=prompt)", "model.layers.*.resid"])
    runner, hooks = start(plan)
    wants = wants_of(hooks)
    rng = np.random.default_rng(6)
    vec = rng.standard_normal(HIDDEN)
    asks = {"p": TapRequest(capture="*", positions="prompt", params={"steer": vec}),
            "q": TapRequest(params={"steer": vec})}
    reqs = [Req(rid, rng.integers(0, 50, plen).tolist(), 6, wire_for(plan, ask, rid))
            for (rid, ask), plen in zip(asks.items(), (9, 13))]
    run(runner, reqs, budget=64)
    outs = collect(hooks, reqs, TapSession(plan))
    check(reqs[0], dict(outs["p"].taps), "prompt", [(1, vec, 2.0, "prompt")])
    assert wants[0][1] != 0, "the prompt step runs the edit's and the captures' kernels"
    assert_decode_asks_nothing(wants, seen, past=13)


def test_a_parameterless_edit_keeps_its_kernel_on_for_untapped_requests(switched):
    seen, start = switched
    plan = toy_plan(["model.layers.0.resid | scale(0.5)", "model.layers.2.resid"])
    runner, hooks = start(plan)
    rng = np.random.default_rng(4)
    reqs = [Req("x", rng.integers(0, 50, 5).tolist(), 2, wire_for(plan, TapRequest(capture="*"), "x")),
            Req("y", rng.integers(0, 50, 8).tolist(), 9, None)]
    run(runner, reqs, budget=64)
    layout = hooks.layout
    assert hooks.component(Switch).want == layout.taps_mask(map(layout.edit_row, layout.always)) != 0, \
        "y alone at the end: only the scale's kernel"
    assert seen["off"], "the capture's kernel is off once x is done"


def test_hooks_want_nothing_in_dummy_runs_and_what_records_ask_otherwise(monkeypatch):
    monkeypatch.setattr(ops, "_idle", None)
    plan = toy_plan(TAPS)
    runner, hooks = hooks_for(plan, ToyModel(), switch=True)
    layout = hooks.layout
    reqs = make_requests(plan)
    run(runner, reqs[:2], budget=64)   # "a" captures every key, "b" the residual at prompt rows
    switch = hooks.component(Switch)
    assert switch.want == layout.taps_mask([layout.cap_index[k] for k in plan.capture_keys])
    assert switch.stepping
    hooks.reset()
    assert switch.want == 0 and not switch.stepping


def test_an_op_launches_nothing_only_in_a_step_that_asks_nothing_of_its_tap():
    table = torch.full((3, 4), -1, dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1], dtype=torch.int32)
    x, pool = torch.randn(4, 8), torch.zeros(2, 8)
    switch = Switch(None, table, ops.KERNELS)
    switch.want = 1 << 0
    assert not switch.idle(table[1]), "a dummy run (no step yet) launches every op"
    switch.stepping = True
    assert switch.idle(table[1]) and switch.idle(table[2]) and not switch.idle(table[0])
    assert not switch.idle(torch.full((4,), -1, dtype=torch.int32)), "not a row table: it launches"
    switch.want = ALL
    assert not switch.idle(table[1])
    # through the op, as the compiled forward calls it
    switch.want = 1 << 1
    ops._idle = switch.idle
    try:
        ops.capture(x, table[0], pool)
        assert not pool.any(), "its tap is not asked for: nothing launched"
        switch.want = 1 << 0
        ops.capture(x, table[0], pool)
        assert torch.equal(pool, x[:2])
        # a paired capture launches while either of its taps is asked for (one launch writes both)
        table[1, 2:] = torch.tensor([0, 1], dtype=torch.int32)
        pool0, pool1 = torch.zeros(2, 8), torch.zeros(2, 8)
        switch.want = 1 << 1
        ops.capture_pair(x, 2 * x, table[0], table[1], pool0, pool1)
        assert torch.equal(pool1, 2 * x[2:]) and torch.equal(pool0, x[:2])
        switch.want = 1 << 2
        ops.capture_pair(x, 2 * x, table[0], table[1], pool0.zero_(), pool1.zero_())
        assert not pool0.any() and not pool1.any(), "neither tap asked for: nothing launched"
    finally:
        ops._idle = None


def test_taps_of_maps_table_views_to_their_rows():
    table = torch.full((70, 16), -1, dtype=torch.int32)
    switch = Switch(None, table, ops.KERNELS)
    assert switch.want == ALL, "until the hooks say, every kernel runs"
    assert switch.taps_of([table[3], table[65][:4]]) == (1 << 3) | (1 << 65)
    assert switch.taps_of([torch.zeros(16, dtype=torch.int32)]) == 0, "not a row table"


def test_the_capture_patch_swaps_in_switched_graphs_and_the_observer_only_while_capturing():
    from tapc.worker.patches import Patch, capture_patch

    switch = Switch(None, torch.zeros(2, 4, dtype=torch.int32), ops.KERNELS)
    seen = []

    class Runner:
        def capture_model(self):
            seen.append((torch.cuda.CUDAGraph, ops._launch_observer))

    before = torch.cuda.CUDAGraph
    runner = Runner()
    capture_patch(runner, SwitchedGraph.bound(switch), Patch(ops, "_launch_observer", switch.observe)).apply()
    runner.capture_model()
    (cls, observer), = seen
    assert issubclass(cls, SwitchedGraph) and cls.switch is switch and observer == switch.observe
    assert torch.cuda.CUDAGraph is before and ops._launch_observer is None
    assert ops.KERNELS >= {"_capture_kernel", "_capture_joint_kernel", "_add_kernel", "_project_out_kernel"}


def test_the_environment_can_keep_every_tap_kernel_in_every_replay(monkeypatch):
    monkeypatch.delenv("TAPC_SWITCH_GRAPHS", raising=False)
    assert settings.TAPC_SWITCH_GRAPHS
    monkeypatch.setenv("TAPC_SWITCH_GRAPHS", "0")
    assert not settings.TAPC_SWITCH_GRAPHS


def test_each_op_hands_the_launch_observer_the_row_tables_it_read():
    x, width = torch.randn(4, 8), 8
    table = torch.tensor([[0, -1, 1, -1], [-1, 2, -1, -1], [0, 0, -1, 0]], dtype=torch.int32)
    pool, ipool = torch.zeros(4, width), torch.zeros(4, width, dtype=torch.int32)
    seen = []
    ops.set_launch_observer(lambda tables: seen.append([t.data_ptr() for t in tables]))
    try:
        ops.capture(x, table[0], pool)
        ops.capture_sum(x, x, table[1], pool)
        ops.capture_pair(x.to(torch.int32), x, table[0], table[1], ipool, pool)
        ops.capture_trio(x, x.to(torch.int32), x, table[2], table[0], table[1], pool, ipool, torch.zeros(4, width))
        ops.add_(x, None, table[2], torch.randn(2, width), torch.ones(2))
    finally:
        ops.set_launch_observer(None)
    rows = [[(p - table.data_ptr()) // table.stride(0) // 4 for p in ptrs] for ptrs in seen]
    assert rows == [[0], [1], [0, 1], [2, 0, 1], [2]]
    ops.capture(x, table[0], pool)
    assert len(seen) == 5, "removed: nothing called"
