"""Python blocks through the engine's real install, tables and runner hooks, on the toy model.

The boundary op (`tapc::boundary`) calls the runtime with the step's slab; each request's block
sees only its rows. Compared with in-graph captures and edits of the same points, and with
the toy model run on each request's tokens alone.
"""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc.api.requests import TapRequest, check
from tapc.errors import RequestError
from tapc.api.session import TapSession
from tapc.worker.points import EnginePoints


def requests(plan, asks, seed=0):
    rng = np.random.default_rng(seed)
    return [Req(rid, rng.integers(0, 50, plen).tolist(), max_tokens, wire_for(plan, ask, rid), arrive)
            for rid, plen, max_tokens, arrive, ask in asks]


def results(plan, hooks, reqs):
    return collect(hooks, reqs, TapSession(plan))


def recorder(ctx, x):
    ctx.save("x", x)
    ctx.save("where", (ctx.step, ctx.positions.start, ctx.positions.stop, ctx.is_prompt))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_block_sees_what_the_in_graph_capture_sees(compiled):
    plan = toy_plan(["model.layers.1.resid", "model.layers.1.resid -> rec", "model.layers.2.mlp.down_proj.output",
                     "model.layers.2.mlp.down_proj.output -> rec2"])
    model = ToyModel()
    runner, hooks = hooks_for(plan, model)
    hooks.component(EnginePoints).runtime.register({"rec": recorder, "rec2": recorder})
    if compiled:  # the boundary op must survive Dynamo (fullgraph: no break at it)
        runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    reqs = requests(plan, [("a", 3, 4, 0, TapRequest(capture="*")), ("b", 21, 3, 1, TapRequest(capture="*")),
                           ("c", 6, 5, 2, TapRequest(capture="*"))])
    run(runner, reqs, budget=16)   # b's 21-token prompt is split over two steps
    outs = results(plan, hooks, reqs)
    for r in reqs:
        out = outs[r.rid]
        assert out.error is None
        seen = torch.cat(out.saved["x"])   # resid and down_proj alternate: both blocks save "x"
        steps = out.saved["where"]
        resid = torch.cat([x for x, w in zip(out.saved["x"], steps) if x.shape[1] == HIDDEN][::2])
        rows = len(r.tokens) - 1
        torch.testing.assert_close(resid, out.taps["model.layers.1.resid"])
        assert seen.shape[0] == 2 * rows
        # contexts: positions tile 0..rows-1 in order, steps count per point
        resid_steps = steps[::2]
        assert [s[0] for s in resid_steps] == list(range(len(resid_steps)))
        assert resid_steps[0][1] == 0 and resid_steps[-1][2] == rows
        assert all(a[2] == b[1] for a, b in zip(resid_steps, resid_steps[1:]))
        assert resid_steps[0][3] is (resid_steps[0][2] <= len(r.prompt))


def test_block_edit_equals_in_graph_edit():
    v = np.random.default_rng(3).standard_normal(HIDDEN)
    vt = torch.as_tensor(v, dtype=torch.float32)
    asks = [("a", 5, 4, 0, None), ("b", 9, 3, 0, None)]

    def outputs(taps, ask, blocks=None):
        plan = toy_plan(taps)
        runner, hooks = hooks_for(plan, ToyModel())
        if blocks:
            hooks.component(EnginePoints).runtime.register(blocks)
        reqs = requests(plan, [a[:4] + (ask(plan),) for a in asks])
        run(runner, reqs, budget=64)
        return results(plan, hooks, reqs)

    in_graph = outputs(["model.layers.1.resid | add(steer, alpha=2.0)", "model.layers.2.resid"],
                       lambda plan: TapRequest(capture="*", params={"steer": v}))
    block = outputs(["model.layers.1.resid -> steer", "model.layers.2.resid"],
                    lambda plan: TapRequest(capture="*"), {"steer": lambda ctx, x: x.add_(2.0 * vt)})
    for rid in ("a", "b"):
        torch.testing.assert_close(block[rid].taps["model.layers.2.resid"], in_graph[rid].taps["model.layers.2.resid"])


class Probe(Exception):
    pass


def test_a_raising_block_fails_its_request_and_the_others_go_on():
    def probe(ctx, x):
        if ctx.step == 1:
            raise Probe(f"bad rows in {ctx.request_id}")
        x.mul_(1.0)

    plan = toy_plan(["model.layers.0.resid -> probe", "model.layers.2.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    hooks.component(EnginePoints).runtime.register({"probe": lambda ctx, x: None})
    asks = [(rid, 4 + i, 3, 0, TapRequest(capture="*", blocks={"probe": probe} if rid == "bad" else {}))
            for i, rid in enumerate(("a", "bad", "c", "d"))]
    reqs = requests(plan, asks)
    run(runner, reqs, budget=64)
    outs = results(plan, hooks, reqs)
    assert isinstance(outs["bad"].error, Probe) and "bad rows in bad" in str(outs["bad"].error)
    assert "in tapc block `probe` at model.layers.0.resid" in outs["bad"].error.__notes__[0]
    reference = ToyModel()
    for rid in ("a", "c", "d"):
        assert outs[rid].error is None
        r = next(q for q in reqs if q.rid == rid)
        toks = torch.tensor(r.tokens[:-1])
        seen = {}
        reference.model.layers[2].register_forward_hook(lambda m, a, o: seen.__setitem__("r", o[0] + o[1]))
        with torch.no_grad():
            reference(toks, torch.arange(len(toks)))
        torch.testing.assert_close(outs[rid].taps["model.layers.2.resid"], seen["r"])


def test_requests_must_have_every_block():
    plan = toy_plan(["model.layers.0.resid -> probe"])
    session = TapSession(plan)   # the engine registers no block
    with pytest.raises(RequestError, match="request 0: the plan runs block\\(s\\) probe, but neither"):
        session.check(TapRequest(), "request 0")
    assert session.check(TapRequest(blocks={"probe": print}), "request 0").blocks is not None
    # Blocks run for every request: one without taps still travels with an (empty) ask.
    assert TapSession(plan, blocks={"probe"}).check(None, "request 0").empty
    with pytest.raises(RequestError, match="block 'prob' is not named by any tap"):
        check(plan, TapRequest(blocks={"prob": print}), "request 0")
    with pytest.raises(RequestError, match="must be a function"):
        check(plan, TapRequest(blocks={"probe": 3}), "request 0")


def test_a_request_this_gpu_could_not_admit_keeps_the_groups_collectives_in_step():
    """Under tensor parallelism a block at a sharded point all-gathers, and every GPU of the
    group must make that collective. A request whose captures found no room on one GPU runs
    untapped there while the others run its blocks: the runtime is told so (`elsewhere`) at
    every step that schedules it, a preempted and resumed one included, and never after it
    finished; the request fails at collect with the arena's reason."""
    from tapc.errors import RequestError as Refused

    plan = toy_plan(["model.layers.1.resid", "model.layers.0.resid -> probe"])
    runner, hooks = hooks_for(plan, ToyModel())
    points = hooks.component(EnginePoints)
    points.runtime.register({"probe": lambda ctx, x: None})
    arena_tensor = hooks.arena.tensor

    def refuse_b(*shape):
        if refusing:
            raise Refused("no room for its captures (refused by the test)")
        return arena_tensor(*shape)

    refusing = False
    hooks.arena.tensor = refuse_b
    steps = []
    begin = points.begin_step

    def watch(step):
        begin(step)
        steps.append((tuple(step.batch.req_ids), points.runtime.elsewhere))

    points.begin_step = watch
    schedule = hooks.schedule

    def admit_b_refused(out):
        nonlocal refusing
        refusing = any(r.req_id == "b" for r in out.scheduled_new_reqs)
        schedule(out)
        refusing = False

    hooks.schedule = admit_b_refused
    reqs = requests(plan, [("a", 5, 2, 0, TapRequest(capture="*")), ("b", 6, 7, 1, TapRequest(capture="*")),
                           ("c", 4, 16, 2, TapRequest(capture="*"))])   # c outlives b
    reqs[1].preempt_at = 4
    run(runner, reqs, budget=64)
    with_b = [elsewhere for ids, elsewhere in steps if "b" in ids]
    without_b = [elsewhere for ids, elsewhere in steps if "b" not in ids]
    assert len(with_b) >= 7 and all(with_b), steps
    assert not any(without_b), steps
    assert steps[-1][0] == ("c",) and not hooks.unadmitted and "b" not in hooks.records
    outs = results(plan, hooks, reqs)
    assert outs["a"].error is None and outs["c"].error is None and "refused by the test" in str(outs["b"].error)
