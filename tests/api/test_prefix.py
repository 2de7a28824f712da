"""Prefix caching on a tapped engine (tapc/api/prefix.py): which requests read cached KV, and which
share what they leave. The toy engine plays vLLM's prefix cache (engine_toy.ToyLLM, `block=`):
a cached prefix is never run, so a capture behind it would come back short."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, toy_plan, toy_vllm
from toy_checks import as_req, check as check_rows, params, prompt

from tapc.wire.protocol import Ask
from tapc.api.requests import TapRequest, check
from tapc.api.prefix import CacheUse, PrefixPolicy, salted

STEER = "model.layers.1.resid | add(steer, alpha=2.0)"
TAPS = ["model.layers.*.resid", STEER]
BLOCK = 4


@pytest.mark.parametrize("positions", ["all", "prompt", [0, 3, 12]])
def test_a_capture_of_prompt_rows_behind_a_cached_prefix_has_every_row(positions):
    llm, _ = toy_vllm(TAPS, block=BLOCK)
    p = prompt(1)
    llm.generate([p], params())                        # untapped: fills the cache
    llm.generate([p], params())
    assert llm.llm.cached == [12], "the toy cache serves the prefix to untapped traffic"
    out = llm.generate([p], params(), taps=TapRequest(capture="model.layers.*.resid", positions=positions))[0]
    assert llm.llm.cached == [0] and llm.llm.submitted[0].skip_reading_prefix_cache
    assert out.error is None
    check_rows(as_req(out), dict(out.taps), positions)
    llm.generate([p], params())
    assert llm.llm.cached == [12], "what the capturing request computed is vanilla KV, shared again"


@pytest.mark.parametrize("positions", ["generated", "last"])
def test_captures_of_rows_always_computed_read_the_cache(positions):
    llm, _ = toy_vllm(TAPS, block=BLOCK)
    p = prompt(2)
    llm.generate([p], params())
    out = llm.generate([p], params(), taps=TapRequest(capture="model.layers.0.resid", positions=positions))[0]
    assert llm.llm.cached == [12] and out.error is None
    check_rows(as_req(out), dict(out.taps), positions)


def test_steered_and_unsteered_kv_never_mix_and_identical_steering_shares():
    llm, _ = toy_vllm(TAPS, block=BLOCK)
    v, w = np.ones(HIDDEN), np.linspace(-1, 1, HIDDEN)
    steer_v, steer_w = TapRequest(params={"steer": v}), TapRequest(params={"steer": w.copy()})
    a, b = prompt(3), prompt(4)
    llm.generate([a], params())
    out = llm.generate([a], params(), taps=steer_v)[0]
    assert llm.llm.cached == [0], "a steered request reads no unsteered KV"
    assert out.error is None
    llm.generate([a], params(), taps=TapRequest(params={"steer": v.copy()}))
    assert llm.llm.cached == [12], "the same vector (another array) shares the steered KV"
    llm.generate([a], params(), taps=steer_w)
    assert llm.llm.cached == [0], "another vector does not"
    llm.generate([b], params(), taps=steer_v)                      # only steered KV of b is cached
    llm.generate([b], params())
    assert llm.llm.cached == [0], "unsteered traffic reads no steered KV"
    # layer 2, after the edit (layer 1's capture comes before the edit in the plan's order)
    got = llm.generate([b], params(), taps=TapRequest(capture="model.layers.2.resid", params={"steer": v}))[0]
    assert llm.llm.cached == [0] and got.error is None
    check_rows(as_req(got), dict(got.taps), "all", [(1, v, 2.0, "all")])


def test_salts_say_what_changes_the_kv():
    plan = toy_plan(["model.layers.*.resid", STEER, "model.layers.2.resid | scale(f, at=generated)",
                     "model.layers.0.resid | zero([3])"])
    policy = PrefixPolicy(plan, key=b"k" * 32)

    def use(**kw):
        return policy.use(check(plan, TapRequest(**kw), "r"), "id")

    v = np.ones(HIDDEN)
    assert use() == use(capture="model.layers.0.resid", positions="last") and use().salt is None, \
        "a literal edit applies to all traffic alike: no salt"
    assert use(capture="*").skip_read and use(capture="*").salt is None
    assert use(params={"steer": v}).salt == use(params={"steer": v.astype(np.float32)}).salt
    assert use(params={"steer": v}).salt != use(params={"steer": 2 * v}).salt
    assert use(params={"f": 0.5}).salt not in (None, use(params={"steer": v}).salt), \
        "an edit at generated rows leaves KV of its own too"
    assert use(params={"f": 0.5}).salt != use(params={"f": 0.25}).salt
    assert use(params={"steer": v, "f": 0.5}).salt not in (use(params={"steer": v}).salt, use(params={"f": 0.5}).salt)
    assert PrefixPolicy(plan).use(check(plan, TapRequest(params={"steer": v}), "r"), "id").salt != \
        use(params={"steer": v}).salt, "salts are keyed per engine: not forgeable from outside"
    assert policy.use(None, None).salt is None and not policy.use(None, None).skip_read


def test_an_engine_without_prefix_caching_salts_and_skips_nothing():
    plan = toy_plan(["model.layers.*.resid", STEER, "model.layers.0.resid -> probe"])
    off = PrefixPolicy(plan, caching=False)
    for ask in (TapRequest(params={"steer": np.ones(HIDDEN)}), TapRequest(capture="*")):
        assert off.use(check(plan, ask, "r"), "id") == CacheUse()
    assert PrefixPolicy(plan).use(check(plan, TapRequest(capture="*"), "r"), "id").salt, "with caching on, blocks salt"


def test_a_batchs_requests_each_get_their_own_asks_salt():
    """generate's requests: a TapRequest shared by prompts is checked (and salted) once; each
    request still gets the salt of its own ask, alternating or not."""
    from tapc.api.session import TapSession

    plan = toy_plan(TAPS)
    session = TapSession(plan)
    v = np.random.default_rng(0).standard_normal(HIDDEN)
    a, b = TapRequest(params={"steer": v}), TapRequest(params={"steer": 2 * v})
    prompts, _ = session.prepare_batch([prompt(i) for i in range(5)], params(), [a, b, a, None, a])
    salts = [p.get("cache_salt") for p in prompts]
    assert salts[0] == salts[2] == salts[4] and salts[1] not in (None, salts[0]) and salts[3] is None
    alone = [p.get("cache_salt") for p in session.prepare_batch([prompt(9)] * 2, params(), b)[0]]
    assert alone == [salts[1]] * 2, "the same values in another batch: the same salt"


def test_logit_edits_need_no_salt_and_blocks_share_nothing():
    plan = toy_plan(["logits | add(bias)"])
    bias = np.ones(50)
    assert PrefixPolicy(plan).use(check(plan, TapRequest(params={"bias": bias}), "r"), "id").salt is None
    blocks = PrefixPolicy(toy_plan(["model.layers.0.resid -> probe"]))
    one, two = blocks.use(Ask(), "a"), blocks.use(Ask(), "b")
    assert one.skip_read and one.salt and two.salt and one.salt != two.salt


def test_salted_keeps_the_callers_salt_and_prompt():
    assert salted("hi", None) == "hi"
    assert salted("hi", "s") == {"prompt": "hi", "cache_salt": "s"}
    mine = {"prompt_token_ids": [1, 2], "cache_salt": "user7"}
    assert salted(mine, "s") == {"prompt_token_ids": [1, 2], "cache_salt": "user7|s"}
    assert mine["cache_salt"] == "user7", "the caller's dict is not changed"


def test_a_steered_capture_equals_its_reference_whatever_was_cached_before():
    """Cold and warm runs of one steered capture agree (rows and values): sharing is safe."""
    llm, _ = toy_vllm(TAPS, block=BLOCK)
    v = np.full(HIDDEN, 0.5)
    ask = TapRequest(capture="*", params={"steer": v})
    p = prompt(5, n=17)
    cold = llm.generate([p], params(), taps=ask)[0]
    warm = llm.generate([p], params(), taps=ask)[0]
    assert llm.llm.cached == [0], "a capture of prompt rows reads no cache even from identical steering"
    for key in cold.taps:
        torch.testing.assert_close(cold.taps[key], warm.taps[key])
    assert len(cold.taps) == LAYERS
