"""tapc's engine on several GPUs (vLLM's multiprocessing executor, one worker per GPU, V2 runner)
and on vLLM's Ray executors: captures of replicated and sharded points at tensor_parallel_size=2
and at pipeline_parallel_size=2 equal the same engine's at size 1 on the same weights; steering (a
replicated and a sharded edit) gives TP=1's greedy tokens; a request that fails on one GPU fails
as a whole, the others in its batch return, and every GPU's chunks go back; a GPU answering as
one on another node does (its rows in the reply, not places in its files) gives the same captures.
The Ray engines (`distributed_executor_backend="ray"`: vLLM 0.26's default Ray executor,
RayExecutorV2, its workers Ray actors placed by Ray behind the multiprocessing executor's message
queues) pass the same tests on one GPU and, where two are at hand, at TP=2 and PP=2.

Engines (each TP=2 start is about 85 s), started as the tests first ask for them: the TP=1
reference, TP=2 and PP=2 on the small Llama checkpoint of tests/support/gpu_engines.py, the Ray ones,
and the same TP=2 / PP=2 on its Qwen3 checkpoint. Each Ray engine starts a Ray of its own on this
host, inside its engine-core process. The whole module is about 10 minutes on the 2-GPU machine:
split it with `-k qwen3` / `-k "not qwen3"` / `-k ray` under a shorter limit. TP=1 against HF
transformers is tests/api/test_engine_gpu.py's."""
import gc
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from gpu_engines import SMALL, Engines, engine_args
from hf_checks import assert_matches

pytestmark = pytest.mark.gpu

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")                   # NVLink multicast off on the lent machines
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the failure test sends a function to workers

L1, L2 = "model.layers.1", "model.layers.2"
SHARDED = [f"{L1}.self_attn.qkv_proj.output", f"{L1}.self_attn.attn.output", f"{L1}.self_attn.o_proj.input",
           f"{L1}.mlp.gate_up_proj.output", f"{L1}.mlp.act_fn.output", f"{L1}.mlp.down_proj.input",
           f"{L1}.self_attn.source.qkv_split_0.output[1]", f"{L1}.mlp.source.self_down_proj_0.input"]
REPLICATED = ["model.layers.*.resid", f"{L1}.self_attn.o_proj.output", f"{L1}.mlp.down_proj.output", "logits"]
EDITS = [f"{L2}.resid | add(steer, alpha=6.0)", f"{L2}.mlp.act_fn.output | add(inner)"]
BLOCKS = [f"{L2}.mlp.act_fn.output -> inner_block"]   # sharded at TP=2: the runtime all-gathers it
TAPS = REPLICATED + SHARDED + EDITS + BLOCKS
MAX_TOKENS = 8


def _prompts():
    rng = np.random.default_rng(3)
    return [{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], n).tolist()} for n in (5, 17, 40)]


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _steer():
    rng = np.random.default_rng(11)
    return {"steer": rng.standard_normal(SMALL["hidden_size"]).tolist(),
            "inner": (0.5 * rng.standard_normal(SMALL["intermediate_size"])).tolist()}


RAY = {"distributed_executor_backend": "ray"}
SIZES = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
         "ray": RAY, "ray-tp2": {**RAY, "tensor_parallel_size": 2}, "ray-pp2": {**RAY, "pipeline_parallel_size": 2}}
_TWO = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="vLLM's Ray executor needs ray (tapc[ray])")


def sizes(*names: str) -> list:
    """`names` as parameters, each skipped where its GPUs or Ray are not at hand."""
    def marks(name):
        return [m for m, needed in ((_TWO, "2" in name), (_RAY, name.startswith("ray"))) if needed]

    return [pytest.param(name, marks=marks(name)) for name in names]


SHARDED_SIZES = sizes("tp2", "pp2", "ray-tp2", "ray-pp2")
EVERY_SIZE = sizes("tp2", "pp2", "ray", "ray-tp2", "ray-pp2")
# Qwen3 at TP=2: its attention's per-head q/k norms are refused under TP (a norm over each head's
# columns, which a rank holds only some of), so its taps are Llama's without `.source` points.
QWEN3_TAPS = REPLICATED + SHARDED[:6] + EDITS


class _Lazy:
    """size name -> an engine on `path` with `taps`, started when a test first asks for it (so
    `-k` runs start only the engines their tests use); `close` stops them."""

    def __init__(self, path: str, taps: list[str], **kwargs):
        self.path, self.taps, self.kwargs, self.engines = path, taps, kwargs, Engines()

    def __getitem__(self, name):
        from tapc import VLLM

        return self.engines.get(name, lambda: VLLM(self.path, taps=self.taps, **self.kwargs, **engine_args(),
                                                   **SIZES[name]))

    def close(self) -> None:
        self.engines.close()


@pytest.fixture(scope="module")
def llama_engines(checkpoints):
    import cloudpickle

    # the workers do not import this test module: its blocks travel by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engines = _Lazy(checkpoints("llama"), TAPS, blocks={"inner_block": _pass})
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture(scope="module")
def qwen3_engines(checkpoints):
    engines = _Lazy(checkpoints("qwen3"), QWEN3_TAPS)
    try:
        yield engines
    finally:
        engines.close()


def _pass(ctx, x):
    return None


def _record_and_steer(ctx, x):
    """At L2's act_fn output (whole rows on every GPU): keep what it sees, then add `inner`."""
    ctx.save("x", x)
    x.add_(torch.tensor(_steer()["inner"], dtype=x.dtype, device=x.device))


def _run(llm, params):
    from tapc import TapRequest

    keys = list(llm.plan.capture_keys)
    return llm.generate(_prompts(), _sampling(), taps=TapRequest(capture=keys, params=params))


def _same_rows(r, g) -> tuple[int, int]:
    """(capture rows, logits rows) both engines computed from the same tokens: up to the first
    generated token where they differ (test_steering_gives_one_gpus_greedy_tokens checks that
    such a divergence is a tie)."""
    a, b = list(r.outputs[0].token_ids), list(g.outputs[0].token_ids)
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return len(r.prompt_token_ids) + min(k, len(a) - 1), min(k + 1, len(a))


@pytest.mark.parametrize("name", EVERY_SIZE)
@pytest.mark.parametrize("steered", [False, True])
def test_captures_equal_one_gpus(llama_engines, name, steered):
    params = _steer() if steered else {}
    ref, got = _run(llama_engines["tp1"], params), _run(llama_engines[name], params)
    plan = llama_engines[name].plan
    layouts = {t.key: t.layout for t in plan.taps}
    want = {"qkv", "q_heads", "kv_heads", "gate_up", "columns"} if "tp2" in name else {"replicated"}
    assert {layouts[k] for k in SHARDED} == want
    _assert_same_captures(ref, got, plan, f"{name}{' steered' if steered else ''}")


def _assert_same_captures(ref, got, plan, what: str) -> None:
    for r, g in zip(ref, got):
        assert r.error is None and g.error is None, (r.error, g.error)
        rows, logit_rows = _same_rows(r, g)
        for key in plan.capture_keys:
            assert g.taps[key].shape[1:] == r.taps[key].shape[1:], key
            n = logit_rows if key == "logits" else rows
            assert_matches(g.taps[key][:n], r.taps[key][:n].float(), f"{what} {key}")


def _as_if_on_another_node(worker, on: bool) -> bool:
    """Rank 1 answers collects as a GPU on another node from the API's does (worker.py
    `_on_api_node`): the rows themselves in the reply, its arena blocks freed at once."""
    from vllm.distributed.parallel_state import get_world_group

    worker.tapc.inline = on and get_world_group().rank_in_group == 1
    return worker.tapc.inline


@pytest.mark.parametrize("name", SHARDED_SIZES)
def test_a_gpu_on_another_node_sends_its_rows_and_they_equal_one_gpus(llama_engines, name):
    """The several-node capture path on one host: rank 1's captures travel through vLLM's RPC
    return as bytes, not as places in its /dev/shm files, and the merged result is TP=1's."""
    engine = llama_engines[name]
    gc.collect()
    engine._give_back()   # what earlier tests' results held
    assert engine.llm.collective_rpc(_as_if_on_another_node, args=(True,)) == [False, True]
    try:
        ref, got = _run(llama_engines["tp1"], _steer()), _run(engine, _steer())
        _assert_same_captures(ref, got, engine.plan, f"{name}, rank 1 as on another node")
        held = engine.llm.collective_rpc(_held)
        assert held[1] == 0 and held[0] > 0, f"rank 1 keeps no block once its rows are sent, rank 0 its places: {held}"
    finally:
        engine.llm.collective_rpc(_as_if_on_another_node, args=(False,))


@pytest.mark.parametrize("name", EVERY_SIZE)
def test_steering_gives_one_gpus_greedy_tokens(llama_engines, name):
    """The same edits (a replicated residual add, a sharded act_fn add): TP=1's tokens, except
    where TP=1's top two logits are a bf16 tie at the first divergence; and the edits matter."""
    params = _steer()
    plain = _run(llama_engines["tp1"], {})
    ref, got = _run(llama_engines["tp1"], params), _run(llama_engines[name], params)
    assert any(list(p.outputs[0].token_ids) != list(r.outputs[0].token_ids) for p, r in zip(plain, ref)), \
        "the edits change no token: this test would prove nothing"
    for r, g in zip(ref, got):
        _tie_or_same(r, g, name)


def _tie_or_same(r, g, name: str) -> None:
    """g's tokens are r's (TP=1's), or part where r's top two logits were a bf16 tie."""
    a, b = list(r.outputs[0].token_ids), list(g.outputs[0].token_ids)
    if a == b:
        return
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    logits = r.taps["logits"][k].float()
    margin = (logits[a[k]] - logits[b[k]]).item()
    assert 0 <= margin <= 2e-2 * logits.abs().max().item(), \
        f"{name} diverges from TP=1 at token {k} ({b[k]} vs {a[k]}) with a logit margin of {margin:.4f}"


def _fail_next_admission_on_rank_1(worker):
    """In a worker: the next request admitted on tensor-parallel rank 1 finds no room for its
    captures (the arena's real refusal, once)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from tapc.errors import RequestError

    if get_tensor_model_parallel_rank() != 1:
        return
    arena = worker.tapc.arena
    original = arena.tensor

    def once(*shape):
        arena.tensor = original
        raise RequestError("no room for its captures (injected by the test)")

    arena.tensor = once


def _held(worker) -> int:
    return sum(worker.tapc.arena.held.values())


@pytest.mark.parametrize("name", sizes("tp2", "ray-tp2"))
def test_a_request_failing_on_one_gpu_fails_whole_and_the_others_return(llama_engines, name):
    from tapc import TapRequest

    llm, ref_llm = llama_engines[name], llama_engines["tp1"]
    ask = TapRequest(capture=[f"{L1}.mlp.act_fn.output", "model.layers.3.resid"])
    prompts = _prompts()
    import cloudpickle

    # the workers do not import this test module: send its functions by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    llm.llm.collective_rpc(_fail_next_admission_on_rank_1)
    outs = llm.generate(prompts, _sampling(), taps=ask)
    ref = ref_llm.generate(prompts, _sampling(), taps=ask)
    failed = [o for o in outs if o.error is not None]
    assert len(failed) == 1 and "tensor-parallel rank 1" in str(failed[0].error) \
        and "injected by the test" in str(failed[0].error)
    assert not failed[0].taps and list(failed[0].outputs[0].token_ids), "its tokens still come back, untapped"
    for o, r in zip(outs, ref):
        if o.error is None:
            for key in ask.capture:
                assert_matches(o.taps[key], r.taps[key].float(), f"after a failure elsewhere: {key}")
    del outs, failed, o
    gc.collect()
    llm._give_back()
    assert llm.llm.collective_rpc(_held) == [0, 0], "every GPU's chunks went back, the failed request's too"


@pytest.mark.parametrize("name", EVERY_SIZE)
def test_a_block_at_a_sharded_point_sees_whole_rows_and_its_edit_is_tp1s(llama_engines, name):
    """A block at L2's act_fn output (sharded by columns at TP=2): what it saw equals TP=1's
    block input, once per request (not once per GPU), and its in-place add gives the tokens of
    TP=1's in-graph `add(inner)` at the same point (near-ties aside)."""
    from tapc import TapRequest

    ask = TapRequest(capture=["logits"], blocks={"inner_block": _record_and_steer})
    ref_block = llama_engines["tp1"].generate(_prompts(), _sampling(), taps=ask)
    got = llama_engines[name].generate(_prompts(), _sampling(), taps=ask)
    in_graph = _run(llama_engines["tp1"], {"inner": _steer()["inner"]})
    for r, g, e in zip(ref_block, got, in_graph):
        assert g.error is None and r.error is None, (g.error, r.error)
        assert list(r.outputs[0].token_ids) == list(e.outputs[0].token_ids), "TP=1: block add != in-graph add"
        rows, _ = _same_rows(r, g)
        seen, ref = torch.cat(g.saved["x"]), torch.cat(r.saved["x"])
        assert seen.shape[1] == SMALL["intermediate_size"] and seen.shape[0] == ref.shape[0], (seen.shape, ref.shape)
        assert_matches(seen[:rows], ref[:rows].float(), f"{name}: the block's whole rows")
        _tie_or_same(r, g, name)


@pytest.mark.parametrize("name", sizes("tp2", "pp2"))
def test_qwen3_on_two_gpus_captures_and_steers_as_on_one_gpu(qwen3_engines, name):
    """Qwen3 (per-head q/k norms, head_dim apart from hidden/heads): the replicated and sharded
    points at TP=2, and every point at PP=2 (each stage its own layers), equal TP=1's, plain and
    steered, and greedy tokens under the edits are TP=1's but at a bf16 tie."""
    params = _steer()
    plain = _run(qwen3_engines["tp1"], {})
    for steered in ({}, params):
        ref, got = _run(qwen3_engines["tp1"], steered), _run(qwen3_engines[name], steered)
        for r, g in zip(ref, got):
            assert r.error is None and g.error is None, (r.error, g.error)
            rows, logit_rows = _same_rows(r, g)
            for key in qwen3_engines[name].plan.capture_keys:
                n = logit_rows if key == "logits" else rows
                assert_matches(g.taps[key][:n], r.taps[key][:n].float(), f"qwen3 {name} {key}{' steered' if steered else ''}")
            _tie_or_same(r, g, f"qwen3 {name}")
    assert any(list(p.outputs[0].token_ids) != list(r.outputs[0].token_ids) for p, r in zip(plain, ref)), \
        "the edits change no token: this test would prove nothing"
