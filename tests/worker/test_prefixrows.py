"""Captured rows of shared prompt blocks kept by the worker (tapc/worker/prefixrows.py): a
capture of prompt rows reads vLLM's prefix cache as far as they go, and still has every row.

The toy engine plays vLLM's prefix cache (engine_toy.ToyKVCache) behind the worker's own
wrapper of its lookup (patches.cache_lookup_patch); every capture is compared with the toy
model run alone on the request's tokens (toy_checks.check)."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, toy_plan, toy_vllm
from toy_checks import TAPS as ENGINE_TAPS, as_req, check as check_rows, params, prompt, run_and_check

from tapc.api.engine_args import engine_kwargs
from tapc.worker.prefixrows import PrefixRows
from tapc.api.requests import TapRequest
from tapc.errors import EngineError

STEER = "model.layers.1.resid | add(steer, alpha=2.0)"
TAPS = ["model.layers.*.resid", STEER]
BLOCK = 4   # a 14-token prompt: 3 full blocks, 12 tokens a cache hit can cover
EVERY = "model.layers.*.resid"


def shared(llm, p, ask):
    """Two requests that capture prompt rows of `p`: the second makes its blocks shared, and its
    rows are kept once its copies are done."""
    for _ in range(2):
        out = llm.generate([p], params(), taps=ask)[0]
        assert llm.llm.cached == [0] and out.error is None, "nothing kept yet: computed in full"


@pytest.mark.parametrize("positions", ["all", "prompt", [0, 3, 9, 12]])
def test_a_capture_behind_kept_rows_reads_the_cache_and_has_every_row(positions):
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(1)
    shared(llm, p, TapRequest(capture=EVERY))
    assert len(hooks.component(PrefixRows).rows) == 3, "the prompt's three full blocks"
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY, positions=positions))[0]
    assert llm.llm.cached == [12] and not llm.llm.submitted[0].skip_reading_prefix_cache
    assert out.error is None
    check_rows(as_req(out), dict(out.taps), positions)
    assert not hooks.held()["running"]


def test_blocks_an_untapped_request_had_are_kept_from_the_first_capture():
    """A system prompt the untapped traffic shares: the first request that captures it computes
    it, its rows are kept (another request had those blocks), and the second reads the cache.
    A capturing request's own blocks, which no other request had, are not kept."""
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p, own = prompt(10), prompt(11)
    llm.generate([p], params())
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [0] and out.error is None, "no rows kept yet: computed in full"
    check_rows(as_req(out), dict(out.taps), "all")
    assert len(hooks.component(PrefixRows).rows) == 3, "the three full blocks the untapped request had"
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY, positions="prompt"))[0]
    assert llm.llm.cached == [12] and out.error is None
    check_rows(as_req(out), dict(out.taps), "prompt")
    llm.generate([own], params(), taps=TapRequest(capture=EVERY))
    assert len(hooks.component(PrefixRows).rows) == 3, "a prompt no other request had: none of its rows kept"


def test_a_request_asking_for_a_capture_not_kept_computes_its_prompt():
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(2)
    shared(llm, p, TapRequest(capture="model.layers.0.resid"))
    out = llm.generate([p], params(), taps=TapRequest(capture=["model.layers.0.resid", "model.layers.2.resid"]))[0]
    assert llm.llm.cached == [0], "layer 2's rows are not kept: no hit"
    check_rows(as_req(out), dict(out.taps), "all")
    out = llm.generate([p], params(), taps=TapRequest(capture="model.layers.0.resid", positions="prompt"))[0]
    assert llm.llm.cached == [12]
    check_rows(as_req(out), dict(out.taps), "prompt")
    # the request that computed layer 2's rows had the shared blocks: they are kept for it too now
    out = llm.generate([p], params(), taps=TapRequest(capture=["model.layers.0.resid", "model.layers.2.resid"]))[0]
    assert llm.llm.cached == [12]
    check_rows(as_req(out), dict(out.taps), "all")


def test_a_longer_prompt_hits_as_far_as_rows_are_kept():
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(3, 9)                                 # two full blocks kept
    shared(llm, p, TapRequest(capture=EVERY))
    longer = {"prompt_token_ids": p["prompt_token_ids"] + [5, 6, 7, 8, 9, 10, 11]}
    llm.generate([longer], params())                 # untapped: its third block is cached KV, no rows
    out = llm.generate([longer], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [8], "the cache holds 12 tokens of it, rows are kept for 8"
    check_rows(as_req(out), dict(out.taps), "all")


def test_rows_past_the_budget_are_dropped_and_a_later_request_computes_them():
    # 3 layers x 16 floats x 4 tokens = 768 bytes a block: room for one
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1000)
    a, b = prompt(4), prompt(5)
    shared(llm, a, TapRequest(capture=EVERY))
    kept = hooks.component(PrefixRows)
    assert len(kept.rows) == 1 and kept.size <= 1000
    out = llm.generate([a], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [4], "of its three blocks the first is kept (a chain is dropped from its tail)"
    check_rows(as_req(out), dict(out.taps), "all")
    shared(llm, b, TapRequest(capture=EVERY))
    out = llm.generate([a], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [0], "b's blocks pushed a's out"
    check_rows(as_req(out), dict(out.taps), "all")


def test_steered_captures_keep_rows_of_their_own_kv():
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    v = np.random.default_rng(6).standard_normal(HIDDEN)
    p = prompt(6)
    # layers 0 and 2: layer 1's capture comes before its edit in the plan's order (test_prefix)
    keys = ["model.layers.0.resid", "model.layers.2.resid"]
    steered = TapRequest(capture=keys, params={"steer": v})
    shared(llm, p, steered)
    out = llm.generate([p], params(), taps=TapRequest(capture=keys))[0]
    assert llm.llm.cached == [0], "unsteered: another salt, neither its KV nor its rows"
    out = llm.generate([p], params(), taps=steered)[0]
    assert llm.llm.cached == [12] and out.error is None
    check_rows(as_req(out), dict(out.taps), "all", [(1, v, 2.0, "all")])


def test_a_hit_whose_rows_are_gone_fails_its_captures_and_says_why(monkeypatch):
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(7)
    llm.generate([p], params())                      # cached KV, no rows kept
    monkeypatch.setattr(PrefixRows, "limit", lambda self, rid, hashes, extra: len(hashes))   # a lookup that lies
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [12]
    assert out.error is not None and "no longer kept (prefix_rows_gib)" in str(out.error)
    assert out.outputs[0].token_ids, "its tokens still come back"


def test_prefix_rows_gib_needs_one_gpu_and_the_single_process_executor():
    plan = toy_plan(TAPS)
    assert engine_kwargs(plan, {"prefix_rows_gib": 0.5})[1].prefix_rows == 1 << 29
    assert engine_kwargs(plan, {})[1].prefix_rows == 0
    with pytest.raises(EngineError, match="single-process executor"):
        engine_kwargs(plan, {"prefix_rows_gib": 1, "distributed_executor_backend": "mp"})
    with pytest.raises(EngineError, match="data_parallel_size=2"):
        engine_kwargs(plan, {"prefix_rows_gib": 1, "data_parallel_size": 2})
    with pytest.raises(EngineError, match="prefix_rows_gib=-1"):
        engine_kwargs(plan, {"prefix_rows_gib": -1})


@pytest.mark.parametrize("runner_kind", ["v2", "v1"])
def test_hooks_that_keep_rows_capture_whole_under_continuous_batching_and_a_preemption(runner_kind):
    """toy_checks' batch (chunked prefill, late arrivals, a preemption with recompute, which
    V1 resumes among the cached requests) on hooks that keep prefix rows: every capture equals
    the reference."""
    from engine_toy import ToyModel, hooks_for

    plan = toy_plan(ENGINE_TAPS)
    run_and_check(*hooks_for(plan, ToyModel(), runner=runner_kind, prefix_rows=(BLOCK, 1 << 20)), plan)


def test_rows_are_kept_from_a_request_collected_right_after_its_prompt():
    """One token each, one request a call: no step of theirs runs after their prompt's copies,
    so the rows are kept when they are collected."""
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(8)
    for _ in range(2):
        llm.generate([p], params(1), taps=TapRequest(capture=EVERY, positions="prompt"))
    assert len(hooks.component(PrefixRows).rows) == 3
    out = llm.generate([p], params(1), taps=TapRequest(capture=EVERY, positions="prompt"))[0]
    assert llm.llm.cached == [12]
    check_rows(as_req(out), dict(out.taps), "prompt")
    assert not hooks.component(PrefixRows).hashes, "collected: nothing of theirs is held but the kept rows"


def test_a_slow_write_of_kept_rows_is_waited_for_and_a_failed_one_fails_its_captures(monkeypatch):
    """The kept rows go into a hit request's storage on a thread of the worker's own: a collect
    that came first would hand over rows not yet written, and a write that fails must say so,
    not leave them so."""
    import time

    from tapc.worker import prefixrows

    fill = prefixrows._fill
    llm, hooks = toy_vllm(TAPS, block=BLOCK, prefix_rows=1 << 20)
    p = prompt(9)
    shared(llm, p, TapRequest(capture=EVERY))

    def slow(st, spans, *a):   # NaN at once (the arena may hand back a chunk with these very rows), then late
        with torch.inference_mode():
            for chunk, lo, n in spans:
                chunk[lo: lo + n] = float("nan")
        time.sleep(0.5)
        fill(st, spans, *a)

    monkeypatch.setattr(prefixrows, "_fill", slow)
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [12] and out.error is None
    check_rows(as_req(out), dict(out.taps), "all")
    monkeypatch.setattr(prefixrows, "_fill", lambda st, spans, kept, *a: fill(st, spans, [{}] * len(kept), *a))
    out = llm.generate([p], params(), taps=TapRequest(capture=EVERY))[0]
    assert llm.llm.cached == [12]
    assert out.error is not None and "copying its kept prefix rows failed: KeyError" in str(out.error)
    assert out.outputs[0].token_ids, "its tokens still come back"
