"""The engine on a GPU, against HF transformers on the same weights (bf16 tolerance).

Small random checkpoints with realistic init (std 0.02), Llama and Qwen3 architectures,
written as safetensors; Llama also on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, the
runner vLLM gives MoE models), so both runners are checked on the same model. vLLM runs its defaults: multi-process engine core, torch.compile,
FULL_AND_PIECEWISE CUDA graphs, async scheduling, chunked prefill. max_num_seqs=3 and a
128-token budget force continuous batching (requests start while others decode, a 300-token
prompt is split over steps, decode batches are padded up to graph sizes).
The checkpoints and engines are the session's (tests/support/gpu_engines.py).
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, shares
from hf_checks import MAX_TOKENS, PROMPT_LENS, assert_matches, assert_same_or_tie, hf_reference, prompts, rows_for, sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=[pytest.param((arch, runner), id=f"{arch}-{runner}",
                                                     marks=shares(f"tapped {arch} {runner}"))
                                        for arch, runner in [("llama", "v2"), ("qwen3", "v2"), ("llama", "v1")]])
def tapped(request, checkpoints, tapped_engine):
    arch, runner = request.param
    return f"{arch} {runner}", checkpoints(arch), tapped_engine(arch, runner)


def test_captures_equal_hf_under_continuous_batching(tapped):
    from tapc import TapRequest

    arch, path, llm = tapped
    positions = ["all", "prompt", "all", "generated", "last", "all"]
    asks = [TapRequest(capture="*", positions=p) for p in positions]
    asks[3] = None  # one request captures nothing in the middle of the others
    outs = llm.generate(prompts(), sampling(), taps=asks)
    for i, (out, ask) in enumerate(zip(outs, asks)):
        n_gen = len(out.outputs[0].token_ids)
        assert n_gen == MAX_TOKENS[i]
        if ask is None:
            assert out.taps == {}
            continue
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, tokens[:-1])
        rows = rows_for(ask.positions, PROMPT_LENS[i], n_gen)
        assert set(out.taps) == set(llm.plan.capture_keys)
        for key, value in out.taps.items():
            assert_matches(value, ref[key][rows], f"{arch} request {i} ({ask.positions}) {key}")
        gen = out.taps["model.layers.3.resid"][PROMPT_LENS[i]:] if ask.positions == "all" else None
        if gen is not None and len(gen) > 1:
            assert not torch.equal(gen[0], gen[1]), "decode rows repeat: stale graph memory"


@pytest.mark.parametrize("many", [0, 8], ids=["few", "many"])
def test_captures_equal_hf_through_rings(tapped, many):
    """Two requests decoding 40 and 29 tokens side by side: steady decode runs in rings
    (docs/engine.md, "Rings": 8 steps' rows held in the pools, a phase apart by the model's
    positions, then one copy-out), whole rings and the one a finishing request ends. With
    `many` more, the batch is past `fill.FEW` (its fill by whole-batch arrays or compiled).
    Every row equals HF's, so none landed in another step's phase."""
    from vllm import SamplingParams

    from tapc import TapRequest

    arch, path, llm = tapped
    rng = np.random.default_rng(5)
    lens, max_tokens = (7, 20) + tuple(range(3, 3 + many)), (40, 29) + (33,) * many
    asks = [TapRequest(capture="*"), TapRequest(capture="*", positions="generated")] + \
        [TapRequest(capture="*", positions="all" if k % 2 else "generated") for k in range(many)]
    outs = llm.generate([{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], n).tolist()} for n in lens],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens], taps=asks)
    for i, (out, ask) in enumerate(zip(outs, asks)):
        n_gen = len(out.outputs[0].token_ids)
        assert n_gen == max_tokens[i]
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, tokens[:-1])
        rows = rows_for(ask.positions, lens[i], n_gen)
        for key, value in out.taps.items():
            assert_matches(value, ref[key][rows], f"{arch} request {i} ({ask.positions}) {key}")


def test_steering_per_request(tapped, request):
    """Two steered requests with different vectors and two plain ones in one batch: the plain
    ones generate exactly what an untapped engine does; the steered ones change; the steered
    residual stream equals HF's with the same vector added."""
    from tapc import TapRequest

    arch, path, llm = tapped
    if arch == "qwen3 v2":
        pytest.skip("steering is checked on Llama (one engine start less)")
    rng = np.random.default_rng(7)
    v1, v2 = (rng.standard_normal(SMALL["hidden_size"]).tolist() for _ in range(2))
    asks = [TapRequest(capture="model.layers.3.resid", params={"steer": v1}), None,
            TapRequest(params={"steer": v2}), TapRequest(capture="model.layers.3.resid"), None, None]
    outs = llm.generate(prompts(2), sampling(), taps=asks)
    tapped_tokens = [list(o.outputs[0].token_ids) for o in outs]

    if arch == "llama v2":
        plain = request.getfixturevalue("vanilla_llama").generate(prompts(2), sampling())
    else:  # V1: the same batch on this engine with no request tapped (no second V1 engine to start)
        plain = llm.generate(prompts(2), sampling())
    plain_tokens = [list(o.outputs[0].token_ids) for o in plain]
    for i in (1, 3, 4, 5):
        assert_same_or_tie(path, list(outs[i].prompt_token_ids), tapped_tokens[i], plain_tokens[i],
                           f"{arch}: unsteered request {i} against an untapped engine")
    for i in (0, 2):
        assert tapped_tokens[i] != plain_tokens[i], f"{arch}: steering request {i} did not change its tokens"
    tokens = list(outs[0].prompt_token_ids) + tapped_tokens[0]
    ref = hf_reference(path, tokens[:-1], steer=(2, v1, 8.0))
    assert_matches(outs[0].taps["model.layers.3.resid"], ref["model.layers.3.resid"], f"{arch} steered capture")


def test_bad_request_fails_alone(tapped):
    from tapc import TapRequest
    from tapc.errors import RequestError

    arch, path, llm = tapped
    with pytest.raises(RequestError, match="request 1: 'model.layers.9.resid' is not a capture"):
        llm.generate(prompts()[:2], sampling()[:2], taps=[TapRequest(capture="*"), TapRequest(capture="model.layers.9.resid")])
    with pytest.raises(RequestError, match="parameter 'stear'"):
        llm.generate(prompts()[:1], sampling()[:1], taps=TapRequest(params={"stear": [0.0] * 256}))
    out = llm.generate(prompts()[:1], sampling()[:1], taps=TapRequest(capture="model.layers.0.resid"))[0]
    assert out.taps["model.layers.0.resid"].shape == (PROMPT_LENS[0] + MAX_TOKENS[0] - 1, 256)


def test_tap_kernels_switch_with_what_the_steps_ask(tapped):
    """Every FULL graph knows its tap kernels (tapc/worker/switch.py); batches that ask for
    nothing, for one key, then for every key, on one engine: each capture still equals HF's,
    so a kernel switched off for one batch is on again when a later one asks for its tap."""
    from tapc import TapRequest

    arch, path, llm = tapped
    switched = llm.llm.collective_rpc("tapc_switched")[0]
    # 3 capture keys over 4 layers and the steering edit: 4 + 1 + 1 captures and 1 edit a graph
    assert switched and all(n == 7 and bare for _, n, bare in switched), \
        f"{arch}: (tokens, tap nodes, a copy without them) per FULL graph {switched}"
    plain = llm.generate(prompts(3), sampling())
    assert all(o.taps == {} for o in plain)
    one = "model.layers.1.output[0]"
    for keys in ([one], "*"):
        asks = [TapRequest(capture=keys), None, None, TapRequest(capture=keys), None, TapRequest(capture=keys)]
        outs = llm.generate(prompts(3), sampling(), taps=asks)
        for i, (out, ask) in enumerate(zip(outs, asks)):
            if ask is None:
                assert_same_or_tie(path, list(out.prompt_token_ids), list(out.outputs[0].token_ids),
                                   list(plain[i].outputs[0].token_ids), f"{arch} untapped request {i}")
                continue
            tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            ref = hf_reference(path, tokens[:-1])
            assert set(out.taps) == ({one} if keys != "*" else set(llm.plan.capture_keys))
            for key, value in out.taps.items():
                assert_matches(value, ref[key], f"{arch} request {i} ({keys}) {key}")
