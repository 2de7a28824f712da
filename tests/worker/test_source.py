"""`.source` points in the engine: the forward rewritten at a named call (toy model, CPU).

The toy MLP's forward is `h, _ = self.up_proj(x)`, `a, b = h.split([...])`,
`self.down_proj(torch.tanh(torch.cat([a, b * 0.5])))`. Captures and edits at its calls are
compared with plain forward hooks on the same model.
"""
import numpy as np
import pytest
import torch
from engine_toy import HALF, HIDDEN, INTER, Req, ToyModel, collect, hooks_for, run, toy_plan, wire_for

from tapc.api.requests import TapRequest
from tapc.errors import EngineError
from tapc.api.session import TapSession
from tapc.plan.forwards import forward_calls


def test_names_match_the_plan():
    from engine_toy import MLP, MLP_SOURCE

    assert [name for name, _ in forward_calls(MLP)[2]] == [op.name for op in MLP_SOURCE]


def reference(tokens, scale_up=None):
    """Layer 1's MLP internals on `tokens` alone, with hooks; scale_up multiplies up_proj's out."""
    model = ToyModel()
    mlp = model.model.layers[1].mlp
    seen = {}

    def up_hook(m, args, out):
        h = out[0] * scale_up if scale_up is not None else out[0]
        seen["up"] = h.detach().clone()
        return (h, None)

    mlp.up_proj.register_forward_hook(up_hook)
    mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("down_in", a[0].detach().clone()))
    model.model.layers[2].register_forward_hook(lambda m, a, o: seen.__setitem__("resid2", (o[0] + o[1]).detach().clone()))
    with torch.no_grad():
        model(torch.tensor(tokens), torch.arange(len(tokens)))
    return seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_source_captures_equal_hooks(compiled):
    taps = ["model.layers.1.mlp.source.self_up_proj_0.output", "model.layers.1.mlp.source.h_split_0.output[1]",
            "model.layers.1.mlp.source.self_down_proj_0.input"]
    plan = toy_plan(taps)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model)
    if compiled:
        runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    rng = np.random.default_rng(4)
    reqs = [Req(rid, rng.integers(0, 50, n).tolist(), 4, wire_for(plan, TapRequest(capture="*"), rid), arrive)
            for rid, n, arrive in (("a", 5, 0), ("b", 19, 0), ("c", 3, 2))]
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        out = outs[r.rid].taps
        ref = reference(r.tokens[:-1])
        torch.testing.assert_close(out["model.layers.1.mlp.source.self_up_proj_0.output"], ref["up"])
        torch.testing.assert_close(out["model.layers.1.mlp.source.h_split_0.output[1]"], ref["up"][:, HALF:])
        torch.testing.assert_close(out["model.layers.1.mlp.source.self_down_proj_0.input"], ref["down_in"])
        assert out["model.layers.1.mlp.source.h_split_0.output[1]"].shape[1] == INTER - HALF


def test_source_edit_reaches_the_rest_of_the_forward():
    plan = toy_plan(["model.layers.1.mlp.source.self_up_proj_0.output | scale(f)", "model.layers.2.resid"])
    runner, hooks = hooks_for(plan, ToyModel())
    rng = np.random.default_rng(5)
    reqs = [Req("s", rng.integers(0, 50, 6).tolist(), 3, wire_for(plan, TapRequest(capture="*", params={"f": 0.25}), "s")),
            Req("p", rng.integers(0, 50, 7).tolist(), 3, wire_for(plan, TapRequest(capture="*"), "p"))]
    run(runner, reqs, budget=32)
    outs = collect(hooks, reqs, TapSession(plan))
    steered, plain = outs["s"].taps, outs["p"].taps
    torch.testing.assert_close(steered["model.layers.2.resid"], reference(reqs[0].tokens[:-1], scale_up=0.25)["resid2"])
    torch.testing.assert_close(plain["model.layers.2.resid"], reference(reqs[1].tokens[:-1])["resid2"])
    assert HIDDEN == plain["model.layers.2.resid"].shape[1]


def test_a_call_the_model_lacks_is_a_clear_error():
    import dataclasses

    from tapc.plan.tapplan import Point

    plan = toy_plan(["model.layers.1.mlp.source.self_up_proj_0.output"])
    tap = dataclasses.replace(plan.taps[0], point=Point("model.layers.1.mlp", "source", op="self_gate_proj_0"))
    with pytest.raises(EngineError, match="MLP.forward has no call 'self_gate_proj_0'.*self_up_proj_0, h_split_0"):
        hooks_for(dataclasses.replace(plan, taps=(tap,)), ToyModel())
