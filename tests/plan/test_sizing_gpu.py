"""On the real engine: the device memory tapc allocates is what the plan and `tapc explain` say,
and `logits` edits (one op per edit over the batch, per-request slots) edit the right rows."""
import gc

import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TAPS = ["model.layers.*.resid", "model.layers.1.mlp.gate_up_proj.output",     # two widths, one pool each
        "model.layers[0,2].self_attn.qkv_proj.output",
        "model.layers.*.resid | add(steer, alpha=a)", "model.layers.3.resid | project_out(steer)",
        "model.layers.0.mlp.down_proj.output | set([1, 5], value=0.5)", "model.layers.2.resid | zero(cols)",
        "logits", "samples", "logits | add(bias)", "logits | set(banned, value=-1000.0)"]


RESERVE_GIB = 0.25


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tapc import VLLM

    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    llm = VLLM(path, taps=TAPS, capture_memory_gib=RESERVE_GIB, **engine_args())
    yield llm
    del llm
    gc.collect()


def test_engine_allocates_what_explain_says(engine):
    from tapc.plan.explain import human_bytes, render

    mem = engine.llm.collective_rpc("tapc_memory")[0]
    assert mem["owned"] == engine.plan.total_buffer_bytes == sum(t.buffer_bytes for t in engine.plan.taps)
    # The caching allocator hands out blocks in multiples of 512 bytes.
    assert 0 <= mem["allocated"] - mem["owned"] < 512 * mem["tensors"], mem
    assert f"preallocated: {human_bytes(mem['owned'])} on the device" in render(engine.plan)


def test_capture_memory_asked_for_is_made_at_start_and_requests_within_it_do_not_grow_it(engine):
    from vllm import SamplingParams

    from tapc import TapRequest

    before = engine.llm.collective_rpc("tapc_memory")[0]
    assert before["host"] == RESERVE_GIB * 2**30 and before["host_growth_s"] > 0
    prompt = {"prompt_token_ids": list(range(3, 40))}
    outs = engine.generate([prompt] * 4, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           taps=TapRequest(capture="model.layers.*.resid"))
    assert all(o.taps["model.layers.0.resid"].shape[0] == 37 + 8 - 1 for o in outs)   # the last token is not run
    after = engine.llm.collective_rpc("tapc_memory")[0]
    assert (after["host"], after["host_growth_s"]) == (before["host"], before["host_growth_s"])


def test_logits_edits_apply_per_request_on_the_rows_they_bind(engine):
    from vllm import SamplingParams

    from tapc import TapRequest

    rng = np.random.default_rng(3)
    prompt = {"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], 17).tolist()}
    bias = rng.normal(size=SMALL["vocab_size"]).astype(np.float32)
    banned = sorted(rng.choice(SMALL["vocab_size"], 9, replace=False).tolist())
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    edited, plain = TapRequest(capture="logits", params={"bias": bias, "banned": banned}), TapRequest(capture="logits")
    outs = engine.generate([prompt, prompt, prompt], [sp] * 3, taps=[plain, edited, plain])
    a, b, c = (o.taps["logits"] for o in outs)
    assert a.shape == (6, SMALL["vocab_size"])
    torch.testing.assert_close(a, c, atol=1e-2, rtol=1e-3)  # untouched by the other request's edits
    want = a[0] + torch.from_numpy(bias)                   # same prompt: the first prediction differs only by the edits
    want[banned] = -1000.0
    torch.testing.assert_close(b[0], want, atol=2e-2, rtol=1e-2)   # the edit is rounded once, to the logits' dtype
    assert not set(outs[1].outputs[0].token_ids) & set(banned)
    assert (b[:, banned] == -1000.0).all()
