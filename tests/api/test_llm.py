"""The API's request handling over the toy engine: engine-wide parameters, specs, what is submitted."""
import textwrap

import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, toy_vllm
from safetensors.torch import save_file

from tapc.api.llm import VLLM
from tapc.wire.protocol import WireRequest
from tapc.api.requests import TapRequest
from tapc.errors import RequestError


def test_engine_params_are_defaults_a_request_overrides():
    v, w = np.ones(HIDDEN), np.full(HIDDEN, 2.0)
    llm = toy_vllm(["model.layers.1.resid | add(steer, alpha=a)"], {"steer": v, "a": 3.0})[0]
    merged = llm.session.with_defaults(None)
    assert merged.params["a"] == 3.0 and merged.params["steer"] is v
    own = llm.session.with_defaults(TapRequest(capture=(), params={"steer": w}))
    assert own.params["steer"] is w and own.params["a"] == 3.0
    assert toy_vllm(["model.layers.1.resid"])[0].session.with_defaults(None) is None


def test_bad_engine_params_fail_at_construction():
    with pytest.raises(RequestError, match="engine params: parameter 'steer' \\(vector\\) must be 16 numbers"):
        toy_vllm(["model.layers.1.resid | add(steer)"], {"steer": [1.0, 2.0]})
    with pytest.raises(RequestError, match="engine params: parameter 'stear' is not named"):
        toy_vllm(["model.layers.1.resid | add(steer)"], {"stear": np.ones(HIDDEN)})


def test_from_spec_passes_model_taps_params_and_engine_args(tmp_path, monkeypatch):
    vec = torch.randn(HIDDEN)
    save_file({"l1": vec}, str(tmp_path / "v.safetensors"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "spec.yaml").write_text(textwrap.dedent("""
        model: m
        engine: {max_num_seqs: 4, gpu_memory_utilization: 0.3}
        taps:
          - model.layers.1.resid | add(steer, alpha=2.0)
          - model.layers.*.resid
        params: {steer: {file: v.safetensors, key: l1}}
        capture: {dtype: float32, memory_gib: 4}
    """))
    seen = {}
    monkeypatch.setattr(VLLM, "__init__", lambda self, model, taps, **kw: seen.update(model=model, taps=taps, **kw))
    VLLM.from_spec(str(tmp_path / "spec.yaml"), attention_backend="TRITON_ATTN")
    assert seen["model"] == str(tmp_path / "m")
    assert seen["taps"] == ["model.layers.1.resid | add(steer, alpha=2.0)", "model.layers.*.resid"]
    assert torch.equal(seen["params"]["steer"], vec) and seen["capture_dtype"] == "float32"
    assert seen["capture_memory_gib"] == 4
    assert seen["max_num_seqs"] == 4 and seen["gpu_memory_utilization"] == 0.3
    assert seen["attention_backend"] == "TRITON_ATTN"


def test_a_shared_request_gets_one_id_per_prompt_and_the_callers_params_stay_untouched():
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.*.resid", "model.layers.1.resid | add(steer)"])
    sp = SamplingParams(max_tokens=3, extra_args={"mine": 1})
    ask = TapRequest(capture="model.layers.2.resid", params={"steer": np.ones(HIDDEN)})
    llm.generate([{"prompt_token_ids": [1, 2]}] * 4 + [{"prompt_token_ids": [3]}], sp,
                 taps=[ask] * 4 + [None])
    sent = llm.llm.submitted
    wires = [WireRequest.from_wire(p.extra_args["tapc"]) for p in sent[:4]]
    assert len({w.id for w in wires}) == 4
    assert all(w.ask.capture == ("model.layers.2.resid",) and p.extra_args["mine"] == 1 for w, p in zip(wires, sent))
    assert sent[4] is sp and sp.extra_args == {"mine": 1}, "untapped requests and the caller's object unchanged"


def test_a_bad_request_among_shared_ones_fails_before_anything_is_submitted():
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.*.resid"])
    good, bad = TapRequest(capture="model.layers.1.resid"), TapRequest(capture="model.layers.9.resid")
    with pytest.raises(RequestError, match="request 3: .*model.layers.9.resid"):
        llm.generate([{"prompt_token_ids": [1]}] * 5, SamplingParams(max_tokens=2), taps=[good] * 3 + [bad, good])
    assert llm.llm.submitted is None


def test_engine_blocks_the_plan_does_not_run_are_refused():
    from engine_toy import toy_plan

    from tapc.errors import EngineError
    from tapc.api.session import TapSession

    with pytest.raises(EngineError, match="blocks= names prob, which no tap of the plan runs .*blocks: probe"):
        TapSession(toy_plan(["model.layers.0.resid -> probe"]), blocks={"prob"})


def test_generate_refuses_what_it_cannot_tap_before_submitting():
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.*.resid"])
    one = [{"prompt_token_ids": [1, 2]}]
    with pytest.raises(RequestError, match="request 0: taps with n=2 samples per prompt are not supported"):
        llm.generate(one, SamplingParams(n=2, max_tokens=2), taps=TapRequest(capture="*"))
    with pytest.raises(RequestError, match="2 prompts but 1 sampling params and 2 tap requests"):
        llm.generate(one * 2, [SamplingParams(max_tokens=2)], taps=TapRequest(capture="*"))
    assert llm.llm.submitted is None
    llm.generate(one, SamplingParams(n=2, max_tokens=2))   # untapped: vLLM's own n is fine
def test_engine_params_may_bind_part_of_a_tap_and_requests_bring_the_rest():
    """The shipped examples/steer.yaml sets only `alpha` engine-wide: `steer` comes per request."""
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.1.resid | add(steer, alpha=a)"], {"a": 3.0})
    llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2),
                 taps=TapRequest(params={"steer": np.ones(HIDDEN)}))
    from tapc.wire.protocol import WireRequest

    params = WireRequest.from_wire(llm.llm.submitted[0].extra_args["tapc"]).ask.params
    assert params["a"] == 3.0 and len(params["steer"]) == HIDDEN * 4
    with pytest.raises(RequestError, match="engine params: parameter 'a' \\(scalar\\) must be a finite number"):
        toy_vllm(["model.layers.1.resid | add(steer, alpha=a)"], {"a": float("nan")})


def test_a_position_beyond_what_the_request_can_reach_is_refused_at_submission():
    """Rows are positions 0 .. P + max_tokens - 2 at most (tapc/wire/positions.py), and below the
    engine's max_model_len - 1 for any prompt: a position past them would come back with no row."""
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.*.resid"])
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    with pytest.raises(RequestError, match=r"^request 0: position 7 lies beyond the last this request can reach, 6 "
                                           r"\(a prompt of 5 tokens and max_tokens=3\)$"):
        llm.generate([prompt], SamplingParams(max_tokens=3), taps=TapRequest(capture="*", positions=[0, 7]))
    assert llm.llm.submitted is None, "nothing was submitted"
    llm.session.max_model_len = 64
    with pytest.raises(RequestError, match=r"^request 0: positions 61, 1000000000000 lie beyond the last this request "
                                           r"can reach, 60 \(a prompt of 5 tokens and max_tokens=57\)$"):
        llm.generate([prompt], SamplingParams(max_tokens=57), taps=TapRequest(capture="*", positions=[60, 61, 10**12]))
    with pytest.raises(RequestError, match=r"position 1000000000000 lies beyond the last this request can reach, 62 "
                                           r"\(the engine's max_model_len=64\)"):   # text: its length is the engine's to find
        llm.generate(["a text prompt"], SamplingParams(max_tokens=3), taps=TapRequest(capture="*", positions=[10**12]))
    for bad in ([2.5], [True], ["3"], 7):
        with pytest.raises(RequestError, match="positions must be one of all, prompt, generated, last or a list of "
                                               "distinct non-negative token positions"):
            llm.generate([prompt], SamplingParams(max_tokens=3), taps=TapRequest(capture="*", positions=bad))
    out, = llm.generate([prompt], SamplingParams(max_tokens=3), taps=TapRequest(capture="*", positions=[0, 6]))
    assert out.error is None and out.taps["model.layers.0.resid"].shape[0] == 2 and out.taps.unreached == ()
