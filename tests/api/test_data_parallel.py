"""Data parallelism (`data_parallel_size=N`, `tapc serve --data-parallel-size N`): each request
runs on one of N engines, and its results come from that engine's workers.

Two toy engines (tests/support/engine_toy.py: tapc's own worker components over a toy model) stand in
for two data-parallel ranks: every collect goes to the workers of both, and the session takes
each request's result from the engine that ran it.
"""
import asyncio
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from engine_toy import Req, ToyModel, collect, hooks_for, over_the_wire, run, toy_plan, wire_for

from tapc.api.async_llm import every_worker
from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.errors import ProtocolError

TAPS = ["model.layers.*.resid", "model.layers.1.resid | add(v)"]


def engines(n: int):
    plan = toy_plan(TAPS)
    out = []
    for _ in range(n):
        model = ToyModel()
        runner, hooks = hooks_for(plan, model)
        out.append((runner, hooks))
    return plan, out


def test_each_request_comes_from_the_engine_that_ran_it():
    plan, (e0, e1) = engines(2)
    rng = np.random.default_rng(0)
    v = rng.standard_normal(16).astype(np.float32)
    asks = {"a": TapRequest(capture="*"), "b": TapRequest(capture="*", params={"v": v}), "c": TapRequest(capture="*")}
    reqs = {rid: Req(rid, rng.integers(0, 50, 6 + i).tolist(), 3, wire_for(plan, ask, rid))
            for i, (rid, ask) in enumerate(asks.items())}
    run(e0[0], [reqs["a"], reqs["c"]], budget=16)     # the load balancer's choice
    run(e1[0], [reqs["b"]], budget=16)
    session = TapSession(plan)
    ids = [r.wire.id for r in reqs.values()]
    replies = [over_the_wire(hooks.collect(ids).to_wire()) for _, hooks in (e0, e1)]
    got = session.results(replies)
    # the same requests, each alone on an engine of its own: the reference
    for rid, r in reqs.items():
        assert got[r.wire.id].error is None, got[r.wire.id].error
        ref_plan, ((runner, hooks),) = engines(1)
        alone = Req(rid, list(r.prompt), 3, wire_for(ref_plan, asks[rid], rid))
        run(runner, [alone], budget=16)
        want = collect(hooks, [alone], TapSession(ref_plan))[rid].taps
        out = NS(request_id=rid, prompt_token_ids=r.prompt, finished=True,
                 outputs=[NS(token_ids=r.tokens[len(r.prompt):])])
        session.finish(out, r.wire, got[r.wire.id])
        assert out.error is None
        for key, value in want.items():
            torch.testing.assert_close(out.taps[key], value)


def test_a_request_no_engine_has_is_an_error():
    plan, (e0, e1) = engines(2)
    replies = [over_the_wire(hooks.collect(["nobody"]).to_wire()) for _, hooks in (e0, e1)]
    assert "has no captures for this request" in TapSession(plan).results(replies)["nobody"].error
    with pytest.raises(ProtocolError, match="0 tapc_collect replies"):
        TapSession(plan).results([])


class Core:
    """vLLM's data-parallel engine client as `every_worker` uses it: its engines, and a utility
    call addressed to one of them (each engine answers with one reply per worker)."""

    def __init__(self, workers: list[list[str]]):
        self.core_engines = [f"engine{i}".encode() for i in range(len(workers))]
        self.workers = dict(zip(self.core_engines, workers))
        self.calls = []

    async def _call_utility_async(self, method, *args, engine):
        self.calls.append((engine, method, args))
        await asyncio.sleep(0.01 if engine == self.core_engines[0] else 0)   # answers out of order
        return [f"{w}:{args[2]}" for w in self.workers[engine]]


def test_every_worker_asks_each_engine_and_keeps_their_order():
    core = Core([["w0", "w1"], ["w2", "w3"]])
    engine = NS(engine_core=core)
    got = asyncio.run(every_worker(engine, "tapc_collect", (["t1"], [])))
    assert got == ["w0:(['t1'], [])", "w1:(['t1'], [])", "w2:(['t1'], [])", "w3:(['t1'], [])"]
    assert [(e, m, a[0]) for e, m, a in core.calls] == [(b"engine0", "collective_rpc", "tapc_collect"),
                                                         (b"engine1", "collective_rpc", "tapc_collect")]


def test_one_engine_uses_vllms_own_collective_rpc():
    seen = []

    async def collective_rpc(method, args=()):
        seen.append((method, args))
        return ["reply"]

    engine = NS(engine_core=NS(core_engines=[b"engine0"]), collective_rpc=collective_rpc)
    assert asyncio.run(every_worker(engine, "tapc_held")) == ["reply"] and seen == [("tapc_held", ())]
