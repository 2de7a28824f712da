"""`tapc.AsyncVLLM` on the GPU: many concurrent streamed requests with their own taps, against
HF transformers on the tokens each request went through; and requests aborted or cancelled
mid-stream by the dozen, after which the workers hold nothing (records, parameter slots,
capture chunks: `TapWorker.tapc_held`) and the engine serves on.

One AsyncVLLM on the session's Llama checkpoint (tests/support/gpu_engines.py), 32 sequences at once,
driven by one event loop for the module (vLLM's output handler lives on the loop that started
it), stopped when the module is done.
"""
import asyncio

import numpy as np
import pytest
import torch
from gpu_engines import CAPTURES, SMALL, STEER, engine_args
from hf_checks import assert_matches, hf_reference, rows_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IDLE = {"running": 0, "uncollected": 0, "chunks": 0, "slots": 0}
KEY = "model.layers.3.resid"


@pytest.fixture(scope="module")
def served(checkpoints):
    """(checkpoint path, the engine, its event loop)."""
    from tapc.api.async_llm import AsyncVLLM

    path = checkpoints("llama")
    loop = asyncio.new_event_loop()

    async def start():
        return AsyncVLLM(path, taps=CAPTURES + [STEER], **{**engine_args(), "max_num_seqs": 32,
                                                          "max_num_batched_tokens": 512})

    engine = loop.run_until_complete(start())
    yield path, engine, loop
    loop.run_until_complete(engine.aclose())
    loop.close()


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(i: int) -> dict:
    rng = np.random.default_rng(500 + i)
    return {"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], int(rng.integers(3, 200))).tolist()}


VECTORS = [np.random.default_rng(70 + k).standard_normal(SMALL["hidden_size"]).tolist() for k in range(3)]


def ask_of(i: int):
    """Untapped, every capture at each kind of positions, steered by one of three vectors
    (alone or with a capture after the edit)."""
    from tapc import TapRequest

    return [None, TapRequest(capture="*"), TapRequest(capture="*", positions="generated"),
            TapRequest(params={"steer": VECTORS[i % 3]}), TapRequest(capture=KEY, params={"steer": VECTORS[i % 3]}),
            TapRequest(capture="*", positions="prompt"), TapRequest(capture="*", positions="last")][i % 7]


def test_concurrent_streamed_requests_equal_hf(served):
    path, engine, loop = served

    async def one(i: int):
        outs = []
        async for out in engine.generate(prompt(i), greedy(4 + i % 9), f"c{i}", taps=ask_of(i)):
            outs.append((len(out.outputs[0].token_ids), out.finished))
            last = out
        return outs, last

    async def main():   # not asyncio.gather: its future would keep the outputs (and their captures) alive
        tasks = [asyncio.ensure_future(one(i)) for i in range(56)]
        await asyncio.wait(tasks)
        return [t.result() for t in tasks]

    check_streams(path, loop.run_until_complete(main()))
    # every capture view was dropped with check_streams' frame
    assert loop.run_until_complete(engine.held()) == [IDLE]


def check_streams(path, results) -> None:
    for i, (stream, out) in enumerate(results):
        n = 4 + i % 9
        assert [k for k, _ in stream] == sorted({k for k, _ in stream}) and stream[-1] == (n, True), f"c{i}: {stream}"
        assert len(out.outputs[0].token_ids) == n and out.error is None, f"c{i}: {out.error}"
        ask = ask_of(i)
        if ask is None or not ask.capture:
            assert out.taps == {}
            continue
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        steer = (2, ask.params["steer"], 8.0) if ask.params else None
        ref = hf_reference(path, tokens[:-1], steer=steer)
        rows = rows_for(ask.positions, len(out.prompt_token_ids), n)
        for key, value in out.taps.items():
            assert_matches(value, ref[key][rows], f"c{i} ({ask.positions}, steered {steer is not None}) {key}")


def test_aborting_many_mid_stream_gives_everything_back(served):
    """96 requests capturing every point at every row and steered, 64 tokens each; a third
    aborted through the engine, a third cancelled (the client went away), after a few tokens
    each. The rest finish whole; then the workers hold nothing, and the engine serves on."""
    from tapc import TapRequest

    path, engine, loop = served

    async def one(i: int):
        ask = TapRequest(capture="*", params={"steer": VECTORS[i % 3]})
        stopped = False
        async for out in engine.generate(prompt(i), greedy(64), f"a{i}", taps=ask):
            # `>=`: a client that reads slower than the engine steps gets several tokens in one
            # output (vLLM merges what it has not read), so an exact count can be skipped
            if i % 3 and not stopped and len(out.outputs[0].token_ids) >= 2 + i % 7:
                stopped = True
                if i % 3 == 1:
                    await engine.abort(f"a{i}")
                else:   # as a server's request task when its client disconnects
                    asyncio.current_task().cancel()
        return out

    async def main():
        tasks = [asyncio.ensure_future(one(i)) for i in range(96)]
        await asyncio.wait(tasks)
        return [None if t.cancelled() else t.result() for t in tasks]

    check_stopped(path, loop.run_until_complete(main()))
    # every capture view was dropped with check_stopped's frame
    assert loop.run_until_complete(engine.held()) == [IDLE], "aborted requests left something behind"

    async def after():
        async for out in engine.generate(prompt(1), greedy(5), "after", taps=TapRequest(capture=KEY)):
            pass
        return out

    out = loop.run_until_complete(after())
    assert out.error is None and out.taps[KEY].shape[0] == len(out.prompt_token_ids) + 4


def check_stopped(path, outs) -> None:
    for i, out in enumerate(outs):
        if i % 3 == 2:
            assert out is None, f"a{i} was not cancelled"
        elif i % 3 == 1:
            assert out.outputs[0].finish_reason == "abort" and "aborted" in str(out.error) and out.taps == {}
        else:
            n = len(out.outputs[0].token_ids)
            assert n == 64 and out.error is None
            assert {t.shape[0] for t in out.taps.values()} == {len(out.prompt_token_ids) + 63}
    survivor = outs[0]
    tokens = list(survivor.prompt_token_ids) + list(survivor.outputs[0].token_ids)
    ref = hf_reference(path, tokens[:-1], steer=(2, VECTORS[0], 8.0))
    assert_matches(survivor.taps[KEY], ref[KEY], "a finished request among aborted ones")
