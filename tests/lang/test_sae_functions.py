"""SAE features and feature steering as compiled functions (tapc/sae.py) on the CPU toy engine,
against SAELens' own encoder on the same weights (an SAE it saved, loaded by tapc)."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, hooks_for, run, toy_plan, ToyModel, collect
from toy_functions import reference, requests

import tapc.sae
from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.errors import TapcError

sae_lens = pytest.importorskip("sae_lens")
D_SAE, K, FEATURE, VALUE = 64, 5, 7, 3.0


@pytest.fixture(scope="module", params=["standard", "jumprelu"])
def saved(request, tmp_path_factory):
    """(SAELens' SAE, its folder): random weights, saved by SAELens."""
    torch.manual_seed(3)
    if request.param == "standard":
        sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=HIDDEN, d_sae=D_SAE))
    else:
        sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(d_in=HIDDEN, d_sae=D_SAE))
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        if request.param == "jumprelu":
            sae.threshold.copy_(torch.rand_like(sae.threshold) * 0.5)
    path = tmp_path_factory.mktemp(request.param)
    sae.save_model(str(path))
    return sae, path


def test_the_loaded_encoder_equals_saelens(saved):
    sae, path = saved
    mine = tapc.sae.SAE.load(path)
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(mine.encode(x), sae.encode(x), rtol=1e-5, atol=1e-5)
    assert (mine.encode(x) == 0).any(), "no feature is off: the activation did nothing"


def test_features_and_a_clamp_in_the_graph_per_request(saved):
    sae, path = saved
    mine = tapc.sae.SAE.load(path)
    functions = {"feats": tapc.sae.features(mine, k=K), "steer": tapc.sae.clamp(mine)}
    taps = ["model.layers.1.resid | call(feats)", "model.layers.1.resid | call(steer)", "model.layers.*.resid"]
    plan = toy_plan(taps, functions=functions)
    model = ToyModel()
    runner, hooks = hooks_for(plan, model, functions=functions)
    runner.model = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    reqs = requests(plan, {"steered": TapRequest(capture="*", params={"feature": FEATURE, "value": VALUE}),
                           "plain": TapRequest(capture="*")}, np.random.default_rng(8))
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    w_dec = sae.W_dec.detach()[FEATURE]

    def steer(s):
        with torch.no_grad():
            return s + (VALUE - sae.encode(s)[:, FEATURE])[:, None] * w_dec

    for r in reqs:
        got = outs[r.rid].taps
        ref = reference(r, 1, steer if r.rid == "steered" else None)
        for i in range(LAYERS):
            torch.testing.assert_close(got[f"model.layers.{i}.resid"], ref[f"model.layers.{i}.resid"],
                                       rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            top = sae.encode(ref["before"]).topk(K, dim=-1)
        torch.testing.assert_close(got["model.layers.1.resid:feats.values"], top.values, rtol=1e-4, atol=1e-4)
        assert torch.equal(got["model.layers.1.resid:feats.ids"], top.indices.to(torch.int32))
    # the clamp moved the steered request: its resid is not the unsteered model's
    unsteered = reference(reqs[0], 1)["model.layers.2.resid"]
    assert not torch.allclose(outs["steered"].taps["model.layers.2.resid"], unsteered, atol=1e-3)


def test_a_folder_that_is_not_an_sae_is_said(tmp_path):
    with pytest.raises(TapcError, match="not an SAE folder"):
        tapc.sae.SAE.load(tmp_path)
