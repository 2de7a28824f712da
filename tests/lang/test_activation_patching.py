"""Activation patching (`point | patch(src, rows=k)`) on the CPU: a request's own rows replace
its activation at their positions, inside the compiled graph.

The toy engine (tests/support/engine_toy.py) runs its model through `torch.compile(fullgraph=True)`;
every capture is compared with the toy model run on the request's tokens alone, the rows put
back by hand in a forward hook.
"""
import json

import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc.api.requests import TapRequest, check
from tapc.api.session import TapSession
from tapc.errors import PlanError, RequestError, ResolveError, TapSyntaxError
from tapc.lang.edits import patch_rows
from tapc.serving.asks import parse_ask
from tapc.wire.protocol import WireRequest
from tapc.plan.explain import render

LAST = f"model.layers.{LAYERS - 1}.resid"


def engine(taps, budget_rows: int = 64):
    plan = toy_plan(taps, rows=budget_rows)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, rows=budget_rows)
    runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    return plan, runner, hooks


def reference(tokens: list[int], layer: int | None = None, rows: dict | None = None) -> dict[str, torch.Tensor]:
    """Every layer's resid of the toy model on `tokens` alone; with `rows` ({position: row}),
    layer `layer`'s resid is replaced there by hand before the next layer reads it."""
    model = ToyModel()
    seen = {}

    def hook(out, i):
        h, r = out
        if i == layer:
            s = (h + r).clone()
            for p, row in rows.items():
                s[p] = row
            h = s - r
        seen[f"model.layers.{i}.resid"] = (h + r).detach().clone()
        return h, r

    for i, mod in enumerate(model.model.layers):
        mod.register_forward_hook(lambda m, a, out, i=i: hook(out, i))
    with torch.no_grad():
        model(torch.tensor(tokens), torch.arange(len(tokens)))
    return seen


def clean_and_corrupted(seed: int, n: int = 9, subject: int = 3):
    rng = np.random.default_rng(seed)
    clean = rng.integers(0, 50, n).tolist()
    corrupted = list(clean)
    corrupted[subject] = (corrupted[subject] + 17) % 50
    return clean, corrupted


def captured(plan, runner, hooks, prompt: list[int], max_tokens: int = 1) -> dict[str, torch.Tensor]:
    req = Req("clean", prompt, max_tokens, wire_for(plan, TapRequest(capture="*"), "clean"))
    run(runner, [req], budget=16)
    return collect(hooks, [req], TapSession(plan))["clean"].taps


def test_causal_tracing_restores_the_clean_rows_one_layer_per_request():
    """The two-call recipe (docs/blocks.md): capture the clean run, then one corrupted request
    per layer with the clean rows of two positions put back at that layer only."""
    taps = [*(f"model.layers.{i}.resid | patch(clean{i}, rows=2)" for i in range(LAYERS)), "model.layers.*.resid"]
    plan, runner, hooks = engine(taps)
    clean, corrupted = clean_and_corrupted(6)
    where = [3, 4]
    rows = captured(plan, runner, hooks, clean)
    reqs = [Req(f"layer{i}", list(corrupted), 3, wire_for(plan, TapRequest(
        capture="*", positions="prompt",
        params={f"clean{i}": {"positions": where, "rows": rows[f"model.layers.{i}.resid"][where]}}), f"layer{i}"))
        for i in range(LAYERS)]
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    for i, r in enumerate(reqs):
        ref = reference(corrupted, i, {p: rows[f"model.layers.{i}.resid"][p] for p in where})
        for j in range(LAYERS):
            torch.testing.assert_close(outs[r.rid].taps[f"model.layers.{j}.resid"], ref[f"model.layers.{j}.resid"])
    # restoring the rows changed the corrupted run from the subject on, and only there
    plain = reference(corrupted)[LAST]
    got = outs["layer0"].taps[LAST]
    assert torch.equal(got[:3], plain[:3]) and not torch.allclose(got[3:], plain[3:])


def test_a_patch_lands_across_prefill_chunks_and_on_generated_rows():
    """A prompt split over three steps (a budget of 4 tokens a step) and a generated position:
    the rows are for absolute positions, wherever the step that runs them cuts."""
    taps = ["model.layers.1.resid | patch(src, rows=3)", "model.layers.*.resid"]
    plan, runner, hooks = engine(taps)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 50, 10).tolist()
    where = [2, 5, 11]                     # the first step, the second, a generated row
    new = torch.from_numpy(rng.standard_normal((3, HIDDEN)).astype(np.float32))
    req = Req("r", prompt, 4, wire_for(plan, TapRequest(capture="*", params={"src": {"positions": where,
                                                                                      "rows": new}}), "r"))
    run(runner, [req], budget=4)
    got = collect(hooks, [req], TapSession(plan))["r"].taps
    ref = reference(req.tokens[:-1], 1, dict(zip(where, new)))
    for j in range(LAYERS):
        torch.testing.assert_close(got[f"model.layers.{j}.resid"], ref[f"model.layers.{j}.resid"])
    torch.testing.assert_close(got["model.layers.1.resid"][where], new)


def test_requests_in_one_batch_get_their_own_rows_and_others_none():
    """Two patched requests and a plain one in the same steps; the plain one is bit-equal to an
    engine without the patch."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 50, n).tolist() for n in (7, 9, 8)]
    rows = [torch.from_numpy(rng.standard_normal((1, HIDDEN)).astype(np.float32)) for _ in range(2)]
    got = {}
    for name, taps in (("with", ["model.layers.0.resid | patch(src)", "model.layers.*.resid"]),
                       ("without", ["model.layers.*.resid"])):
        plan, runner, hooks = engine(taps)
        asks = [TapRequest(capture="*", params={"src": {"positions": [p], "rows": r}}) if name == "with" else None
                for p, r in zip((1, 4), rows)] + [TapRequest(capture="*")]
        reqs = [Req(f"r{k}", prompts[k], 3, wire_for(plan, a, f"r{k}") if a is not None else None)
                for k, a in enumerate(asks)]
        run(runner, reqs, budget=32)
        got[name] = collect(hooks, reqs, TapSession(plan))
        if name == "with":
            for k, p in enumerate((1, 4)):
                ref = reference(reqs[k].tokens[:-1], 0, {p: rows[k][0]})
                torch.testing.assert_close(got[name][f"r{k}"].taps[LAST], ref[LAST])
    for key, value in got["without"]["r2"].taps.items():
        assert torch.equal(got["with"]["r2"].taps[key], value), key


def test_one_name_at_a_glob_patches_every_layer_with_the_same_rows():
    taps = ["model.layers.*.resid | patch(src)", "model.layers.*.resid"]
    plan, runner, hooks = engine(taps)
    assert len([p for p in plan.params if p.name == "src"]) == 1
    row = torch.from_numpy(np.random.default_rng(9).standard_normal(HIDDEN).astype(np.float32))
    prompt = list(range(3, 11))
    req = Req("r", prompt, 2, wire_for(plan, TapRequest(capture="*", params={"src": {"positions": [5],
                                                                                      "rows": row[None]}}), "r"))
    run(runner, [req], budget=16)
    got = collect(hooks, [req], TapSession(plan))["r"].taps
    for j in range(LAYERS):
        torch.testing.assert_close(got[f"model.layers.{j}.resid"][5], row)


def test_over_http_a_request_binds_its_rows_as_json():
    """`vllm_xargs.tapc` JSON to the engine's wire text and back: the same positions and rows."""
    plan = toy_plan(["model.layers.1.resid | patch(src, rows=2)"])
    rows = np.random.default_rng(10).standard_normal((2, HIDDEN)).astype(np.float32)
    text = json.dumps({"params": {"src": {"positions": [4, 1], "rows": rows.tolist()}}})
    ask = check(plan, parse_ask(text, {}, "request 0").request, "request 0")
    back = WireRequest.from_wire(WireRequest("t", ask).to_text()).ask
    positions, got = patch_rows(back.params["src"])
    assert positions.tolist() == [4, 1]
    np.testing.assert_array_equal(got, rows)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("value, words", [
    ({"positions": [1, 2, 3], "rows": np.zeros((3, HIDDEN))}, "has 3 rows, but `model.layers.1.resid | patch(src, "
                                                              "rows=2)` holds 2 a request"),
    ({"positions": [1], "rows": np.zeros((1, HIDDEN - 1))}, f"rows must be [1, {HIDDEN}] (a row per position)"),
    ({"positions": [1, 1], "rows": np.zeros((2, HIDDEN))}, "positions must be distinct non-negative"),
    ({"positions": [-1], "rows": np.zeros((1, HIDDEN))}, "positions must be distinct non-negative"),
    ({"positions": [1], "rows": np.full((1, HIDDEN), np.nan)}, "rows have non-finite entries"),
    (np.zeros((1, HIDDEN)), '"positions": [p, ...]'),
    ({"positions": [1], "values": [0.0]}, '"positions": [p, ...]'),
])
def test_bad_rows_are_refused_naming_the_parameter(value, words):
    plan = toy_plan(["model.layers.1.resid | patch(src, rows=2)"])
    with pytest.raises(RequestError, match="parameter 'src' \\(rows\\)|'src' has") as e:
        check(plan, TapRequest(params={"src": value}), "request 0")
    assert words in str(e.value)


def test_a_position_the_request_cannot_reach_is_refused_at_submission():
    plan = toy_plan(["model.layers.1.resid | patch(src, rows=2)"])
    session = TapSession(plan)
    ask = check(plan, TapRequest(params={"src": {"positions": [3, 12], "rows": np.zeros((2, HIDDEN))}}), "r")
    session.check_reach(ask, 8, 6, "request 0")     # the rows a prompt of 8 and 6 new tokens runs: 0..12
    with pytest.raises(RequestError, match=r"request 0: patch\(\) rows at position 12 lies beyond the last this "
                                           r"request can reach, 11 \(a prompt of 8 tokens and max_tokens=5\)"):
        session.check_reach(ask, 8, 5, "request 0")


@pytest.mark.parametrize("tap, error, words", [
    ("logits | patch(src)", ResolveError, "the logits are its output"),
    ("model.layers.1.resid | patch([1, 2])", TapSyntaxError, "'src' must be a parameter name"),
    ("model.layers.1.resid | patch(src, rows=0)", TapSyntaxError, "whole number of rows in 1..256"),
    ("model.layers.1.resid | patch(src, rows=k)", TapSyntaxError, "sizes the engine's tables: give a number"),
])
def test_patch_taps_are_refused_where_they_cannot_run(tap, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        toy_plan([tap])


def test_one_name_at_two_widths_is_refused():
    with pytest.raises(PlanError, match="'src' is 16 wide at model.layers.1.resid but 24 at"):
        toy_plan(["model.layers.1.resid | patch(src)", "model.layers.1.mlp.up_proj.output | patch(src)"])


def test_the_plan_sizes_the_rows_a_slot_holds():
    """Each slot of `rows=k` holds k rows of the point's width (float32) and their k positions."""
    small, large = (toy_plan([f"model.layers.1.resid | patch(src, rows={k})"]) for k in (1, 8))
    slots = 2 * 8   # toy_plan's max_num_seqs of 8, two slots a sequence
    assert large.taps[0].buffer_bytes - small.taps[0].buffer_bytes == slots * 7 * (HIDDEN + 1) * 4
    shown = render(large, width=200)
    assert "patch(src=$src, rows=8)" in shown and "parameters: src (rows of 16)" in shown
