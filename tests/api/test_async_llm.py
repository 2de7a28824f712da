"""`tapc.AsyncVLLM` over a toy AsyncLLM (tests/support/async_toy.py) on the CPU: streaming, concurrent
requests with their own taps, batched collection, and what an aborted or cancelled request
gives back (worker records, parameter slots, capture chunks). Correctness of the values on a
real engine: tests/api/test_async_llm_gpu.py."""
import asyncio
import contextlib

import numpy as np
import pytest
from async_toy import ToyAsyncLLM
from engine_toy import HIDDEN, LAYERS, ToyModel, hooks_for, toy_plan
from toy_checks import as_req, check as check_rows

from tapc.api.async_llm import AsyncVLLM
from tapc.api.requests import TapRequest
from tapc.errors import RequestError
from tapc.api.session import TapSession

TAPS = ["model.layers.*.resid", "model.layers.2.resid | add(steer, alpha=2.0)"]
IDLE = {"running": 0, "uncollected": 0, "chunks": 0, "slots": 0}


def toy_async(taps=TAPS, budget: int = 16):
    plan = toy_plan(taps)
    runner, hooks = hooks_for(plan, ToyModel())
    return AsyncVLLM.over(ToyAsyncLLM(runner, hooks, budget), TapSession(plan)), hooks


def sp(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def prompt(i: int):
    return {"prompt_token_ids": np.random.default_rng(i).integers(0, 50, 3 + 5 * (i % 4)).tolist()}


def ask_of(i: int):
    """A mix: untapped, captures at each kind of positions, steered, steered and capturing."""
    v = np.full(HIDDEN, 0.1 * (i % 3 + 1))
    return [None, TapRequest(capture="*"), TapRequest(capture="model.layers.1.resid", positions="generated"),
            TapRequest(params={"steer": v}), TapRequest(capture="model.layers.2.resid", params={"steer": v}),
            TapRequest(capture="*", positions="prompt")][i % 6]


async def consume(engine, i: int, max_tokens: int):
    outs = [out async for out in engine.generate(prompt(i), sp(max_tokens), f"r{i}", taps=ask_of(i))]
    return outs


async def all_of(coros) -> list:
    """Each coroutine's result or exception, run concurrently. Not asyncio.gather: its future
    keeps the results (and the captures they view) alive after the test drops them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    await asyncio.wait(tasks)
    return [asyncio.CancelledError() if t.cancelled() else t.exception() or t.result() for t in tasks]


def test_concurrent_requests_stream_and_finish_with_their_own_taps():
    async def main():
        engine, hooks = toy_async()
        results = await all_of([consume(engine, i, 2 + i % 5) for i in range(24)])
        for i, outs in enumerate(results):
            ask = ask_of(i)
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 3 + i % 5)), f"r{i} streamed"
            final = outs[-1]
            assert final.finished and final.error is None and not any(o.finished for o in outs[:-1])
            if ask is None or not ask.capture:
                assert final.taps == {}
                continue
            edits = [(2, ask.params["steer"], 2.0, "all")] if ask.params else []
            got = dict(final.taps)
            if edits:   # layer 2's capture comes before its edit in the plan's order: check the layers after
                got = {k: t for k, t in got.items() if not k.startswith("model.layers.2.")}
            check_rows(as_req(final), got, ask.positions, edits)
        collects = engine.engine.rpcs.count("tapc_collect")
        assert collects < 16, f"{collects} collect round trips for 16 tapped requests: not batched"
        del results, outs, final, got
        assert await engine.held() == [IDLE]

    asyncio.run(main())


def test_chunks_dropped_while_others_run_go_back_with_the_next_collect():
    """Consumers that drop their captures as they finish, while others still run: the chunks go
    back inside the next collect's round trip (each is a call the engine makes between steps),
    not in a release of their own; after settling, nothing is held."""
    async def main():
        engine, hooks = toy_async()

        async def run(i: int) -> int:
            outs = await consume(engine, 6 * i + 1, 2 + 3 * i)   # capture="*", finishing one after another
            assert outs[-1].error is None and outs[-1].taps
            return len(outs)

        assert await all_of([run(i) for i in range(8)]) == [2 + 3 * i for i in range(8)]
        rpcs = engine.engine.rpcs
        assert rpcs.count("tapc_collect") >= 2, rpcs
        assert rpcs.count("tapc_release") == 0, f"releases of their own while collects ran: {rpcs}"
        assert await engine.held() == [IDLE]

    asyncio.run(main())


def test_aborted_and_cancelled_requests_give_back_everything():
    """40 tapped requests, each stopped mid-stream one of three ways: its task cancelled, its
    consumer closing the stream, or `engine.abort`. The survivors' captures are whole."""
    async def main():
        engine, hooks = toy_async(budget=24)
        stopped = []

        async def run(i: int):
            gen = engine.generate(prompt(i), sp(12), f"r{i}", taps=TapRequest(capture="*", params={"steer": np.ones(HIDDEN)}))
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.finished and out.outputs[0].finish_reason == "abort":
                        assert out.taps == {} and "aborted before it finished" in str(out.error)
                        return None
                    if out.finished:
                        return out
                    if i % 4 and len(out.outputs[0].token_ids) == 1 + i % 5:
                        stopped.append(i)
                        if i % 4 == 1:
                            return None                             # the consumer stops reading
                        if i % 4 == 2:
                            await engine.abort(f"r{i}")             # vLLM ends the stream
                        else:
                            asyncio.current_task().cancel()         # the request's task is cancelled
                            await asyncio.sleep(0)

        done = await all_of([run(i) for i in range(40)])
        assert all(isinstance(d, asyncio.CancelledError) for i, d in enumerate(done) if i % 4 == 3)
        assert sorted(stopped) == [i for i in range(40) if i % 4]
        for i in range(0, 40, 4):
            final = done[i]
            assert final.error is None
            rows = {k: t for k, t in final.taps.items() if int(k.split(".")[2]) > 2}
            check_rows(as_req(final), rows, "all", [(2, np.ones(HIDDEN), 2.0, "all")])
        assert hooks.held()["chunks"] > 0, "the survivors' captures are still held by the caller"
        del done, final, rows
        assert await engine.held() == [IDLE]

    asyncio.run(main())


def test_a_bad_request_raises_before_anything_is_submitted():
    async def main():
        engine, _ = toy_async()
        with pytest.raises(RequestError, match="request bad: 'model.layers.9.resid' is not a capture"):
            async for _ in engine.generate(prompt(0), sp(3), "bad", taps=TapRequest(capture="model.layers.9.resid")):
                pass
        assert engine.engine.submitted == {}
        with pytest.raises(RequestError, match="request n2: taps with n=2"):
            from vllm import SamplingParams

            async for _ in engine.generate(prompt(0), SamplingParams(n=2), "n2", taps=TapRequest(capture="*")):
                pass
        outs = await consume(engine, 1, 3)
        assert outs[-1].taps[f"model.layers.{LAYERS - 1}.resid"].shape[0] == len(prompt(1)["prompt_token_ids"]) + 2

    asyncio.run(main())


def test_a_steered_request_is_salted_and_a_capture_skips_the_cache():
    async def main():
        engine, _ = toy_async()
        await consume(engine, 3, 2)      # steered
        await consume(engine, 1, 2)      # capture "*"
        await consume(engine, 0, 2)      # untapped
        sent = engine.engine.submitted
        assert sent["r3"].prompt["cache_salt"].startswith("tapc-") and not sent["r3"].params.skip_reading_prefix_cache
        assert "cache_salt" not in sent["r1"].prompt and sent["r1"].params.skip_reading_prefix_cache
        assert "cache_salt" not in sent["r0"].prompt and not sent["r0"].params.skip_reading_prefix_cache

    asyncio.run(main())


def test_aclose_leaves_no_task_pending_on_the_loop():
    async def main():
        engine, _ = toy_async()
        await all_of([consume(engine, i, 3) for i in range(6)])
        assert engine.collector.task is not None, "the collector never ran: nothing was checked"
        await engine.aclose()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
