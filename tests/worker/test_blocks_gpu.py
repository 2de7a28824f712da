"""Python blocks, `logits` and `samples` on a real vLLM engine (GPU machine).

The session's random Llama checkpoint (tests/support/gpu_engines.py), vLLM's defaults otherwise:
multi-process engine core, torch.compile, async scheduling, FULL_AND_PIECEWISE graphs: decode
steps replay FULL graphs broken at each `tapc::boundary`, mixed steps PIECEWISE graphs split
there. Blocks are compared with the in-graph taps of the same
points, logits with HF transformers on the same weights, samples with the generated tokens.
Every test runs on vLLM's V2 runner and on its V1 runner (VLLM_USE_V2_MODEL_RUNNER=0: FULL
graphs there are one `CUDAGraphWrapper` around the model, broken the same way).
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args, hf_forward, model_runner, shutdown
from hf_checks import assert_matches, prompts, sampling

from tapc import batched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORCED = 17
STEER = np.random.default_rng(11).standard_normal(SMALL["hidden_size"]).astype(np.float32)


class Unlucky(Exception):
    pass


def recorder(ctx, x):
    ctx.save("x", x)


def steer_block(ctx, x):
    x.add_(torch.from_numpy(STEER).to(x.device) * 8.0)


def failing(ctx, x):
    if ctx.step == 2:
        raise Unlucky(f"request {ctx.request_id} at step 2")


@batched
def steer_batched(batch, x):
    x.add_(torch.from_numpy(STEER).to(x.device) * 8.0)


@batched
def failing_batched(batch, x):
    if any(ctx.step == 2 for ctx in batch.requests):
        x.mul_(100.0)   # made before the raise: must not reach the model
        raise Unlucky(f"requests {batch.request_ids} at step 2")


def force(ctx, ids):
    if ctx.step == 0:
        ids.fill_(FORCED)


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module", params=["v2", "v1"])
def engine(path, request):
    """This module's alone, one per model runner: stopped when its tests are done."""
    from tapc import VLLM

    with model_runner(request.param):
        llm = VLLM(path, taps=["model.layers.1.resid", "model.layers.1.resid -> rec",
                               "model.layers.2.output[0] | add(steer, alpha=8.0)", "model.layers.2.output[0] -> edit",
                               "model.layers.3.resid", "logits", "samples", "samples -> pick"],
                   blocks={"rec": recorder, "edit": lambda ctx, x: None, "pick": lambda ctx, ids: None},
                   **engine_args())
    yield llm
    shutdown(llm)


def same_prompt(n: int, seed: int, length: int = 23):
    p = {"prompt_token_ids": np.random.default_rng(seed).integers(0, SMALL["vocab_size"], length).tolist()}
    return [dict(p) for _ in range(n)]


def greedy(n: int, max_tokens: int = 8):
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for _ in range(n)]


def test_block_engine_splits_piecewise_and_breaks_full_graphs(engine):
    cc = engine.llm.llm_engine.vllm_config.compilation_config
    assert "tapc::boundary" in cc.splitting_ops and str(cc.cudagraph_mode).endswith("FULL_AND_PIECEWISE")
    full = engine.llm.collective_rpc("tapc_graph_breaks")[0]
    # Two module-point blocks (layers 1 and 2): every decode graph replays as three segments.
    assert full and all(steps == 2 for _, steps in full), full


def test_block_input_equals_in_graph_capture(engine):
    """Under continuous batching (chunked prefill of a 300-token prompt, late decode joins)."""
    from tapc import TapRequest

    outs = engine.generate(prompts(), sampling(), taps=TapRequest(capture="model.layers.1.resid"))
    for out in outs:
        assert out.error is None
        cap = out.taps["model.layers.1.resid"]
        seen = torch.cat(out.saved["x"])
        assert seen.shape[0] >= cap.shape[0]
        torch.testing.assert_close(seen[: cap.shape[0]].to(cap.dtype), cap)


def test_block_edit_equals_in_graph_edit(engine):
    """One batch, one prompt three times: steered in-graph, steered by the block, not steered."""
    from tapc import TapRequest

    asks = [TapRequest(capture="model.layers.3.resid", params={"steer": STEER}),
            TapRequest(capture="model.layers.3.resid", blocks={"edit": steer_block}),
            TapRequest(capture="model.layers.3.resid")]
    outs = engine.generate(same_prompt(3, 2), greedy(3), taps=asks)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens[0] == tokens[1], "the block's edit and the in-graph edit generate differently"
    assert tokens[0] != tokens[2], "steering changed nothing"
    assert_matches(outs[1].taps["model.layers.3.resid"], outs[0].taps["model.layers.3.resid"].float(), "block vs in-graph")


def test_a_batched_block_edits_as_the_in_graph_edit(engine):
    """One prompt four times in one batch: steered in-graph, steered by a batched block (two
    requests, one call a step), not steered; the unsteered request's rows may sit between the
    batched call's, which must leave them."""
    from tapc import TapRequest

    asks = [TapRequest(capture="model.layers.3.resid", params={"steer": STEER}),
            TapRequest(capture="model.layers.3.resid", blocks={"edit": steer_batched}),
            TapRequest(capture="model.layers.3.resid"),
            TapRequest(capture="model.layers.3.resid", blocks={"edit": steer_batched})]
    outs = engine.generate(same_prompt(4, 2), greedy(4), taps=asks)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens[0] == tokens[1] == tokens[3], "the batched block's edit and the in-graph edit generate differently"
    assert tokens[0] != tokens[2], "steering changed nothing"
    for i in (1, 3):
        assert_matches(outs[i].taps["model.layers.3.resid"], outs[0].taps["model.layers.3.resid"].float(),
                       f"batched block vs in-graph, request {i}")
    plain = engine.generate(same_prompt(1, 2), greedy(1), taps=TapRequest(capture="model.layers.3.resid"))
    assert_matches(outs[2].taps["model.layers.3.resid"], plain[0].taps["model.layers.3.resid"].float(), "unsteered")


def test_a_raising_batched_block_fails_the_requests_of_its_call_and_leaves_their_rows(engine):
    from tapc import TapRequest

    asks = [TapRequest(), TapRequest(blocks={"edit": failing_batched}), TapRequest(),
            TapRequest(blocks={"edit": failing_batched})]
    outs = engine.generate(prompts(4)[:4], sampling()[:4], taps=asks)
    plain = engine.generate(prompts(4)[:4], sampling()[:4])
    for i in (1, 3):
        assert isinstance(outs[i].error, Unlucky) and "at step 2" in str(outs[i].error)
    for i in range(4):   # the failed requests too: the call that raised wrote nothing back
        assert list(outs[i].outputs[0].token_ids) == list(plain[i].outputs[0].token_ids), f"request {i}"


def test_a_raising_block_fails_only_its_request(engine):
    from tapc import TapRequest

    asks = [TapRequest(), TapRequest(blocks={"edit": failing}), TapRequest(), TapRequest()]
    outs = engine.generate(prompts(4)[:4], sampling()[:4], taps=asks)
    plain = engine.generate(prompts(4)[:4], sampling()[:4])   # same batch, no failing block
    assert isinstance(outs[1].error, Unlucky) and "at step 2" in str(outs[1].error)
    assert "in tapc block `edit` at model.layers.2.output[0]" in outs[1].error.__notes__[0]
    assert "raise Unlucky" in outs[1].error.__notes__[0]
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert list(outs[i].outputs[0].token_ids) == list(plain[i].outputs[0].token_ids), f"request {i}"
    assert all(o.error is None for o in plain)   # the engine served the next call normally


def test_logits_equal_reference_and_samples_are_the_tokens(engine, path):
    from tapc import TapRequest

    outs = engine.generate(prompts(5)[:3], sampling()[:3], taps=TapRequest(capture=["logits", "samples"]))
    for i, out in enumerate(outs):
        gen = list(out.outputs[0].token_ids)
        assert out.taps["samples"].tolist() == gen
        tokens = list(out.prompt_token_ids) + gen
        ref = hf_forward(path, tokens[:-1]).logits[0].float().cpu()
        ref = ref[len(out.prompt_token_ids) - 1:]
        assert out.taps["logits"].shape == ref.shape == (len(gen), SMALL["vocab_size"])
        assert_matches(out.taps["logits"], ref, f"request {i} logits")
        assert out.taps["logits"].argmax(-1).tolist() == gen   # greedy: the logits chose the tokens


def test_forced_sample_is_returned_and_fed_back(engine):
    """The forced token comes back as generated token 0 and is the model's input at position P:
    its layer-1 activation equals that of the same token placed at the end of the prompt."""
    from tapc import TapRequest

    p = same_prompt(1, 6)[0]["prompt_token_ids"]
    P = len(p)
    outs = engine.generate([{"prompt_token_ids": p}, {"prompt_token_ids": p + [FORCED]}], greedy(2, 4),
                           taps=[TapRequest(capture=["samples", "model.layers.1.resid"], blocks={"pick": force}),
                                 TapRequest(capture="model.layers.1.resid")])
    forced = list(outs[0].outputs[0].token_ids)
    assert forced[0] == FORCED and outs[0].taps["samples"].tolist() == forced
    fed = outs[0].taps["model.layers.1.resid"][P:P + 1]
    as_prompt = outs[1].taps["model.layers.1.resid"][P:P + 1]
    assert_matches(fed, as_prompt.float(), "forced token's activation")


def structured(ctx, x):
    ctx.save("step", (ctx.positions.start, ctx.positions.stop, x[:, :4].clone()))
    ctx.save("meta", {"dtype": str(x.dtype), "rows": x.shape[0], "prompt": ctx.is_prompt})


def missing_key(ctx, x):
    if ctx.step == 1:
        raise KeyError(f"no key at {ctx.positions.start}")


def test_saved_values_and_errors_cross_the_process_boundary_without_pickle(engine):
    """Through the engine core's msgpack: tuples stay tuples, bf16 GPU tensors come back as CPU
    tensors of their rows, dicts as dicts; a builtin exception is itself again, with its args."""
    from tapc import TapRequest

    outs = engine.generate(same_prompt(2, 5, length=9), greedy(2, 4),
                           taps=[TapRequest(blocks={"edit": structured}), TapRequest(blocks={"edit": missing_key})])
    ok, bad = outs
    assert ok.error is None and all(isinstance(s, tuple) for s in ok.saved["step"])
    starts = [s[0] for s in ok.saved["step"]]
    stops = [s[1] for s in ok.saved["step"]]
    assert starts[0] == 0 and starts[1:] == stops[:-1] and stops[-1] >= 9 + 4 - 1
    for (start, stop, rows), meta in zip(ok.saved["step"], ok.saved["meta"]):
        assert rows.device.type == "cpu" and rows.dtype == torch.bfloat16 and rows.shape == (stop - start, 4)
        assert meta == {"dtype": "torch.bfloat16", "rows": stop - start, "prompt": stop <= 9}
    assert type(bad.error) is KeyError and bad.error.args == ("no key at 9",)
    assert "in tapc block `edit` at model.layers.2.output[0]" in bad.error.__notes__[0]
