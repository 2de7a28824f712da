"""Compiled functions (`point | call(name)`) on the CPU: traced into one graph with the model,
gated per request, results kept per request, refusals said before any engine starts.

The toy engine (tests/support/engine_toy.py) runs its model through `torch.compile(fullgraph=True)`,
so a function that broke the graph would fail here; every capture is compared with the toy
model run on the request's tokens alone with the function applied by hand in a forward hook.
"""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, ToyModel, collect, hooks_for, run, toy_plan, wire_for
from toy_functions import W, clamp, reference, requests

import tapc
from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.errors import PlanError, RequestError, TapcError, TapSyntaxError
from tapc.lang.syntax import parse_tap
from tapc.wire.positions import select
from tapc.worker.slots import EditSlots


def clamp_ref(s: torch.Tensor, thr: float) -> torch.Tensor:
    over = s.norm(dim=-1) > thr
    return torch.where(over[:, None], s * 0.5, s)


@tapc.function(params={"v": "vector"})
def push(x, batch):
    """Add the request's vector, scaled by the row's position: reads the batch view's positions."""
    return x + batch.params["v"] * (1.0 + batch.position[:, None].float())


@tapc.function(results={"logit": 1})
class Probe(torch.nn.Module):
    """A learned linear probe: its weights are module state, moved to the model's device."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(HIDDEN, 1))

    def forward(self, x, batch):
        return {"logit": torch.sigmoid(x @ self.w)}


def engine(taps, functions):
    """A toy engine whose model runs compiled as one graph (fullgraph: a break is an error)."""
    plan = toy_plan(taps, functions=functions)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, functions=functions)
    runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    return plan, runner, hooks


def test_a_compiled_function_edits_its_requests_and_keeps_their_results():
    taps = ["model.layers.1.resid | call(clamp)", "model.layers.*.resid"]
    plan, runner, hooks = engine(taps, {"clamp": clamp})
    rng = np.random.default_rng(1)
    thr = {"low": 0.5, "high": 3.0}
    reqs = requests(plan, {"low": TapRequest(capture="*", params={"thr": 0.5}),
                           "high": TapRequest(capture="*", params={"thr": 3.0}),
                           "plain": TapRequest(capture="model.layers.*.resid")}, rng)
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        got = outs[r.rid].taps
        ref = reference(r, 1, (lambda s, t=thr[r.rid]: clamp_ref(s, t)) if r.rid in thr else None)
        for i in range(LAYERS):
            torch.testing.assert_close(got[f"model.layers.{i}.resid"], ref[f"model.layers.{i}.resid"])
        if r.rid in thr:   # the probe's scores: of the activation the function was given
            torch.testing.assert_close(got["model.layers.1.resid:clamp.score"], ref["before"] @ W.T)
    # the threshold mattered: some rows of "low" were clamped that "high" left alone
    edited = reference(reqs[0], 1, lambda s: clamp_ref(s, 0.5))["model.layers.2.resid"]
    assert not torch.allclose(edited, reference(reqs[0], 1)["model.layers.2.resid"])
    assert hooks.component(EditSlots).slots.held == 0


def test_requests_that_do_not_apply_it_are_bit_equal_to_an_engine_without_it():
    rng = np.random.default_rng(2)
    got = {}
    for name, taps, fns in (("with", ["model.layers.0.resid | call(clamp)", "model.layers.*.resid"], {"clamp": clamp}),
                            ("without", ["model.layers.*.resid"], {})):
        plan, runner, hooks = engine(taps, fns)
        asks = {"steered": TapRequest(params={"thr": 0.1}) if fns else None,
                "plain": TapRequest(capture="model.layers.*.resid")}
        reqs = requests(plan, asks, np.random.default_rng(2))
        run(runner, reqs, budget=16)
        got[name] = collect(hooks, reqs, TapSession(plan))["plain"].taps
    for key, value in got["without"].items():
        assert torch.equal(got["with"][key], value), key
    del rng


def test_positions_params_and_at_reach_the_function():
    """A vector parameter and the row positions, on generated rows only (`at=generated`)."""
    taps = ["model.layers.2.resid | call(push, at=generated)", "model.layers.2.resid"]
    plan, runner, hooks = engine(taps, {"push": push})
    rng = np.random.default_rng(3)
    v = rng.standard_normal(HIDDEN).astype(np.float32)
    reqs = requests(plan, {"a": TapRequest(capture="*", params={"v": v})}, rng)
    run(runner, reqs, budget=16)
    got = collect(hooks, reqs, TapSession(plan))["a"].taps["model.layers.2.resid"]
    r = reqs[0]
    pos = torch.arange(len(r.tokens) - 1)
    gen = torch.from_numpy(select("generated", pos.numpy(), len(r.prompt)))

    def by_hand(s):
        out = s.clone()
        out[gen] += torch.from_numpy(v) * (1.0 + pos[gen, None].float())
        return out

    torch.testing.assert_close(got, reference(r, 2, by_hand)["model.layers.2.resid"])
    assert gen.any() and not gen.all()


def test_a_module_function_keeps_its_weights_as_graph_inputs():
    """A probe module at every layer: its scores equal the probe on each layer's resid; after its
    weight changes in place, the same compiled graph scores with the new weight (a weight
    baked in as a constant would keep the old)."""
    probe = Probe()
    taps = ["model.layers.*.resid | call(probe)", "model.layers.*.resid"]
    plan, runner, hooks = engine(taps, {"probe": probe})
    assert sum(p is probe.w for _, p in runner.model.named_parameters(remove_duplicate=False)) == LAYERS
    for seed in (4, 5):
        reqs = requests(plan, {"a": TapRequest(capture="*")}, np.random.default_rng(seed))
        run(runner, reqs, budget=16)
        got = collect(hooks, reqs, TapSession(plan))["a"].taps
        for i in range(LAYERS):
            want = torch.sigmoid(got[f"model.layers.{i}.resid"] @ probe.w.detach())
            torch.testing.assert_close(got[f"model.layers.{i}.resid:probe.logit"], want)
        with torch.no_grad():
            probe.w.mul_(-1.0)


# ----------------------------------------------------------------------------- refusals


def test_a_data_dependent_branch_is_refused_with_the_reason_and_the_line():
    def branchy(x, batch):
        if x.norm().item() > 1.0:   # a host sync on a traced value
            return x * 2
        return x

    with pytest.raises(PlanError) as e:
        toy_plan(["model.layers.1.resid | call(branchy)"], functions={"branchy": branchy})
    msg = str(e.value)
    assert "cannot run inside a compiled graph" in msg and "item" in msg
    assert f"test_functions.py:{branchy.__code__.co_firstlineno + 1}" in msg
    assert "-> name" in msg


@pytest.mark.parametrize("fn, declared, words", [
    (lambda x, batch: x[:, :3], {}, "keep the point's shape"),
    (lambda x, batch: {"a": x @ W.T}, {"results": {"b": 3}}, "returns results ['a'] but declares ['b']"),
    (lambda x, batch: {"a": x}, {"results": {"a": 3}}, "result 'a' is (4, 16)"),
    (lambda x, batch: [x], {}, "returned a list"),
    (lambda x, batch: x @ torch.ones(3, 3), {}, "fails on a [4, 16] float32 tensor: RuntimeError: mat1 and mat2"),
])
def test_what_a_function_returns_is_checked(fn, declared, words):
    fn = tapc.function(**declared)(fn)
    with pytest.raises(PlanError, match="function 'f'") as e:
        toy_plan(["model.layers.1.resid | call(f)"], functions={"f": fn})
    assert words in str(e.value).replace("returned results", "returns results")


@pytest.mark.parametrize("tap, words", [
    ("model.layers.1.resid | call(nope)", "no compiled function 'nope' was given"),
    ("model.layers.1.resid | call(clamp, thr=1.0, k=2)", "has no parameter 'k'"),
    ("model.layers.1.resid | call(clamp, thr=[1, 2])", "'thr' is a scalar"),
    ("model.layers.1.resid | call(push, v=[1, 2])", "vector of the point's 16 columns"),
    ("logits | call(clamp)", "outside them"),
])
def test_plan_refusals_name_the_tap(tap, words):
    with pytest.raises(TapcError, match=words.replace("(", r"\(").replace("[", r"\[")):
        toy_plan([tap], functions={"clamp": clamp, "push": push})


@pytest.mark.parametrize("tap", ["x.output | call()", "x.output | call(f, 3)", "x.output | call(f, a=1, a=2)",
                                 "x.output | call(f, at=soon)", "x.output | call(f, a=[b, 1])"])
def test_call_syntax_errors(tap):
    with pytest.raises(TapSyntaxError, match="call"):
        parse_tap(tap)


def test_a_result_needs_the_function_applied():
    plan = toy_plan(["model.layers.1.resid | call(clamp)"], functions={"clamp": clamp})
    with pytest.raises(RequestError, match="bind them to capture it"):
        wire_for(plan, TapRequest(capture="model.layers.1.resid:clamp.score"), "r")
    assert wire_for(plan, TapRequest(capture="*", params={"thr": 1.0}), "r").ask.capture == \
        ("model.layers.1.resid:clamp.score",)


def test_the_digest_covers_the_functions_code_and_state():
    def first(x, batch):
        return x * 2

    def second(x, batch):
        return x * 3

    digests = {toy_plan(["model.layers.1.resid | call(f)"], functions={"f": fn}).digest
               for fn in (first, second, Probe(), Probe())}
    assert len(digests) == 4
    same = toy_plan(["model.layers.1.resid | call(f)"], functions={"f": first}).digest
    assert same in digests


def test_the_workers_load_the_pickles_the_digest_was_made_from(monkeypatch):
    """Around a plan and its shipped file each function is pickled once (an SAE's weights are
    hundreds of MB); the workers' load gives the same function back. Outside, a module changed
    in place between two plans is pickled afresh: another digest."""
    import cloudpickle

    from tapc.api.engine import ship_functions
    from tapc.plan.calls import pickled_once
    from tapc.worker.worker import _functions

    dumps = []
    real = cloudpickle.dumps
    monkeypatch.setattr(cloudpickle, "dumps", lambda obj, *a, **k: dumps.append(obj) or real(obj, *a, **k))
    probe = Probe()
    with pickled_once():
        plan = toy_plan(["model.layers.*.resid | call(probe)"], functions={"probe": probe})
        loaded = _functions(str(ship_functions(plan, {"probe": probe})))
    assert dumps == [probe]
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(loaded["probe"](x, None)["logit"], probe(x, None)["logit"])
    with torch.no_grad():
        probe.w.add_(1.0)
    assert toy_plan(["model.layers.*.resid | call(probe)"], functions={"probe": probe}).digest != plan.digest


@tapc.function(params={"clean": "vector", "pos": "scalar"})
def restore(x, batch):
    here = batch.position[:, None].float() == batch.params["pos"][:, None]
    return torch.where(here, batch.params["clean"], x)


def test_causal_tracing_restores_one_clean_row_one_layer_per_request():
    """Per-layer parameters of one function, causal tracing written as a compiled function (the
    built-in edit is `patch`: tests/lang/test_activation_patching.py): capture a clean run, then one corrupted
    request per layer with the clean resid restored at the subject's position at that layer
    only; each equals the model run on the corrupted tokens with that row replaced by hand."""
    # the restores first: taps at one point run in plan order, so the captures see them
    taps = [*(f"model.layers.{i}.resid | call(restore, clean=clean{i}, pos=pos{i})" for i in range(LAYERS)),
            "model.layers.*.resid"]
    plan, runner, hooks = engine(taps, {"restore": restore})
    rng = np.random.default_rng(6)
    clean_prompt = rng.integers(0, 50, 9).tolist()
    corrupted = list(clean_prompt)
    subject = 3
    corrupted[subject] = (corrupted[subject] + 17) % 50
    clean = requests(plan, {"clean": TapRequest(capture="*", positions="prompt")}, rng)
    clean[0].prompt = clean_prompt
    run(runner, clean, budget=16)
    rows = collect(hooks, clean, TapSession(plan))["clean"].taps
    asks = {f"layer{i}": TapRequest(capture="*", positions="prompt",
                                    params={f"clean{i}": rows[f"model.layers.{i}.resid"][subject], f"pos{i}": subject})
            for i in range(LAYERS)}
    reqs = requests(plan, asks, rng)
    for r in reqs:
        r.prompt = list(corrupted)
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    last = f"model.layers.{LAYERS - 1}.resid"
    for i, r in enumerate(reqs):
        def put_back(s, i=i):
            s = s.clone()
            s[subject] = rows[f"model.layers.{i}.resid"][subject]
            return s
        ref = reference(r, i, put_back)
        got = outs[r.rid].taps[last]
        torch.testing.assert_close(got, ref[last][:len(corrupted)])
    # restoring the row changed the corrupted run after the subject
    assert not torch.allclose(outs["layer0"].taps[last], reference(reqs[0], 0)[last][:len(corrupted)])
