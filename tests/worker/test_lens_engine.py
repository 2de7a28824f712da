"""The logit lens through the toy engine (tests/support/engine_toy.py), as the worker installs it:
each request's `:lens.ids` and `:lens.logits` against HF's RMSNorm and the unembedding applied
by hand to the toy model's own residual stream, under chunked prefill and decode."""
import numpy as np
import torch
from engine_toy import LAYERS, ToyModel, collect, hooks_for, run, toy_plan
from toy_checks import reference, rows_of
from toy_functions import requests
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tapc.api.requests import TapRequest
from tapc.api.session import TapSession

K = 4


def lens_by_hand(s: torch.Tensor, model: ToyModel):
    norm = LlamaRMSNorm(s.shape[1], eps=model.model.norm.variance_epsilon)
    norm.weight.data.copy_(model.model.norm.weight.data)
    with torch.no_grad():
        return (norm(s) @ model.lm_head.weight.T).topk(K, dim=-1)


def test_lens_rows_equal_the_norm_and_unembedding_of_each_layer():
    taps = [f"model.layers.*.resid | lens(k={K})", "model.layers.1.output[0] | lens(k=2)"]
    plan = toy_plan(taps)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model)
    rng = np.random.default_rng(5)
    reqs = requests(plan, {"all": TapRequest(capture="*"),
                           "last": TapRequest(capture=["model.layers.2.resid:lens.ids"], positions="last"),
                           "logits only": TapRequest(capture="model.layers.0.resid:lens.logits", positions="generated"),
                           "plain": None}, rng)
    run(runner, reqs, budget=9)   # prompts span steps: chunked prefill
    outs = collect(hooks, reqs, TapSession(plan))
    checked = 0
    for r in reqs:
        if r.wire is None:
            continue
        got = outs[r.rid].taps
        positions = r.wire.ask.positions
        rows = rows_of(r, positions)
        ref = reference(r, [f"model.layers.{i}.resid" for i in range(LAYERS)] + ["model.layers.1.output[0]"])
        for key, value in got.items():
            point, _, result = key.partition(":")
            k = 2 if point.endswith("output[0]") else K
            top = lens_by_hand(ref[point][rows], model)
            assert value.shape == (len(rows), k), key
            if result == "lens.ids":
                assert value.dtype == torch.int32
                assert torch.equal(value, top.indices[:, :k].to(torch.int32)), f"{r.rid} {key}"
            else:
                torch.testing.assert_close(value, top.values[:, :k], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == 2 * LAYERS + 2 + 1 + 1


def test_a_request_without_the_lens_is_bit_equal_to_an_engine_without_it():
    got = {}
    for name, taps in (("with", ["model.layers.*.resid | lens", "model.layers.*.resid"]),
                       ("without", ["model.layers.*.resid"])):
        plan = toy_plan(taps)
        runner, hooks = hooks_for(plan, ToyModel())
        reqs = requests(plan, {"lensed": TapRequest(capture="*"), "plain": TapRequest(capture="model.layers.*.resid")},
                        np.random.default_rng(6))
        run(runner, reqs, budget=16)
        got[name] = collect(hooks, reqs, TapSession(plan))["plain"].taps
    assert got["with"].keys() == got["without"].keys()
    for key, value in got["without"].items():
        assert torch.equal(got["with"][key], value), key
