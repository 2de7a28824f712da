"""Batched Python blocks (`tapc.batched`): one call per point and step for every request that
runs the block, through the engine's real install, tables and runner hooks on the toy model.
Compared with the same block run per request, with in-graph captures, and with the toy model
run on each request's tokens alone."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc import batched
from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.worker.points import EnginePoints


def requests(plan, asks, seed=0):
    rng = np.random.default_rng(seed)
    return [Req(rid, rng.integers(0, 50, plen).tolist(), max_tokens, wire_for(plan, ask, rid) if ask else None,
                arrive) for rid, plen, max_tokens, arrive, ask in asks]


def unchanged(ctx, x):
    return None


# a, c and d run the block under test; "plain" its own no-op per-request block, so its rows sit
# between theirs, outside the batched call, in some steps
ASKS = [("a", 3, 4, 0, TapRequest(capture="*")),
        ("plain", 7, 5, 0, TapRequest(capture="*", blocks={"probe": unchanged})),
        ("c", 21, 3, 1, TapRequest(capture="*")), ("d", 6, 5, 2, TapRequest(capture="*"))]
TAPS = ["model.layers.1.resid -> probe", "model.layers.2.resid"]


def served(block, compiled=False, seed=0, asks=ASKS):
    """The requests and their results, `block` registered on the engine as `probe`."""
    plan = toy_plan(TAPS)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model)
    hooks.component(EnginePoints).runtime.register({"probe": block})
    if compiled:   # the boundary op survives Dynamo, and a batched block is called the same
        runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    reqs = requests(plan, asks, seed)
    run(runner, reqs, budget=16)   # c's 21-token prompt is split over two steps
    return reqs, collect(hooks, reqs, TapSession(plan))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_batched_block_edits_and_saves_as_the_same_block_per_request(compiled):
    """An edit that depends on the row's position and request (a scale by position, a shift by
    a per-request value) and saved values: the batched call gives every request the rows, the
    downstream residual and the saved rows the per-request block gives it; calls are one a step,
    and rows between theirs that the call does not hold (another block's request) stay."""
    shift = {"a": 0.5, "c": -1.0, "d": 2.0}
    calls, gaps = [], []

    def per_request(ctx, x):
        ctx.save("x", x)
        ctx.save("pos", torch.tensor(list(ctx.positions)))
        x.mul_(1.0 + 0.01 * torch.arange(ctx.positions.start, ctx.positions.stop, dtype=x.dtype)[:, None])
        x.add_(shift[ctx.request_id])

    @batched
    def whole(batch, x):
        calls.append(len(batch))
        gaps.append(bool((~batch.mask).any()))
        assert x.shape[0] == batch.request_index.shape[0] and batch.mask.sum() == sum(e - s for s, e in batch.spans)
        batch.save("x", x.clone())
        batch.save("pos", [torch.tensor(list(ctx.positions)) for ctx in batch.requests])
        torch.testing.assert_close(batch.positions[batch.mask],
                                   torch.cat([torch.tensor(list(ctx.positions)) for ctx in batch.requests]))
        x.mul_(1.0 + 0.01 * batch.positions.clamp(min=0).to(x.dtype)[:, None])
        # every row of x shifted, the rows no request of the call holds too (by the first's
        # shift): the runtime keeps those as they were
        by_request = torch.tensor([shift[rid] for rid in batch.request_ids], dtype=x.dtype)
        x.add_(by_request[batch.request_index.clamp(min=0)][:, None])

    reqs, want = served(per_request, compiled)
    _, got = served(whole, compiled)
    for r in reqs:
        if r.rid == "plain":
            torch.testing.assert_close(got[r.rid].taps["model.layers.2.resid"], want[r.rid].taps["model.layers.2.resid"])
            continue
        assert got[r.rid].error is None and want[r.rid].error is None
        torch.testing.assert_close(torch.cat(got[r.rid].saved["x"]), torch.cat(want[r.rid].saved["x"]))
        assert [p.tolist() for p in got[r.rid].saved["pos"]] == [p.tolist() for p in want[r.rid].saved["pos"]]
        torch.testing.assert_close(got[r.rid].taps["model.layers.2.resid"], want[r.rid].taps["model.layers.2.resid"])
    assert all(n <= 3 for n in calls) and any(gaps), (calls, gaps)


def test_a_raising_batched_block_fails_the_requests_of_its_call_and_leaves_their_rows():
    """The call that raises fails the requests whose rows it held; their rows (the in-place
    edit it made before raising included) stay as the model made them, and requests of later
    calls, and of earlier ones, are served."""
    @batched
    def probe(batch, x):
        x.mul_(100.0)   # made before the raise: must not reach the model
        if "d" in batch.request_ids and "c" in batch.request_ids:
            raise ValueError(f"bad rows in {batch.request_ids}")
        x.div_(100.0)

    asks = [("a", 3, 2, 0, TapRequest(capture="*")), ("c", 5, 6, 3, TapRequest(capture="*")),
            ("d", 4, 6, 4, TapRequest(capture="*"))]
    reqs, outs = served(probe, asks=asks)
    assert outs["a"].error is None
    for rid in ("c", "d"):
        assert isinstance(outs[rid].error, ValueError) and "bad rows in" in str(outs[rid].error)
    reference = ToyModel()
    r = next(q for q in reqs if q.rid == "a")
    toks = torch.tensor(r.tokens[:-1])
    seen = {}
    reference.model.layers[2].register_forward_hook(lambda m, a, o: seen.__setitem__("r", o[0] + o[1]))
    with torch.no_grad():
        reference(toks, torch.arange(len(toks)))
    torch.testing.assert_close(outs["a"].taps["model.layers.2.resid"], seen["r"], rtol=1e-5, atol=1e-5)


def test_the_runtime_writes_back_the_rows_of_the_calls_requests_only_and_none_of_a_call_that_raises():
    """On the runtime itself, at a `.resid` point: x and the residual b of a step whose rows 2..4
    belong to a request without the batched block. The batched call sees hidden + residual;
    what it leaves there reaches x (hidden = edited - residual) on its requests' rows only;
    a call that raises after editing in place leaves every row as it was."""
    from tapc.worker.runtime import BlockPoint, BlockRuntime, Span

    def step(block, other):
        runtime = BlockRuntime([BlockPoint("model.layers.1.resid", "probe")])
        runtime.register({"probe": block})
        runtime.admit("a", 9)
        runtime.admit("b", 9, {"probe": other})
        runtime.admit("c", 9)
        gen = torch.Generator().manual_seed(0)
        x, b = torch.randn(8, HIDDEN, generator=gen), torch.randn(8, HIDDEN, generator=gen)
        before = x.clone()
        runtime.begin_step([Span("a", 0, 2, 7), Span("b", 2, 5, 0), Span("c", 5, 7, 3)])   # row 7: padding
        runtime(0, x, b)
        return runtime, before, x, b

    @batched
    def double(batch, x):
        assert batch.request_ids == ["a", "c"] and batch.spans == [(0, 2), (5, 7)]
        assert batch.positions.tolist() == [7, 8, -1, -1, -1, 3, 4]
        x.mul_(2.0)

    runtime, before, x, b = step(double, unchanged)
    mine = [0, 1, 5, 6]
    torch.testing.assert_close(x[mine], 2.0 * (before[mine] + b[mine]) - b[mine])
    torch.testing.assert_close(x[2:5], before[2:5])   # another block's rows: written back by theirs
    assert torch.equal(x[7], before[7])

    @batched
    def raising(batch, x):
        x.mul_(100.0)
        raise ValueError("no")

    runtime, before, x, b = step(raising, unchanged)
    assert torch.equal(x[mine], before[mine]) and torch.equal(x[7], before[7])
    assert [runtime.take(r)[1] is not None for r in "abc"] == [True, False, True]


def test_a_batched_block_of_the_wrong_shape_or_save_fails_its_requests_with_what_is_wrong():
    @batched
    def short(batch, x):
        return x[:-1]

    _, outs = served(short)
    assert "returned" in str(outs["a"].error) and "return None (edit x in place)" in str(outs["a"].error)

    @batched
    def bad_save(batch, x):
        batch.save("n", torch.zeros(x.shape[0] + 1))

    _, outs = served(bad_save)
    assert isinstance(outs["c"].error, TypeError) and "batch.save('n', ...) takes a tensor of" in str(outs["c"].error)


def test_batched_marks_the_function_itself():
    def f(batch, x):
        return None

    assert batched(f) is f and f.tapc_batched
    with pytest.raises(TypeError, match="batched\\(\\) takes a function, got int"):
        batched(3)
