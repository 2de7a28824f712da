"""The toy engine's captures checked against its model run on one request's tokens alone, and the
requests several CPU test modules send it."""
from types import SimpleNamespace as NS

import numpy as np
import torch
from engine_toy import Req, ToyModel, collect, run, wire_for

from tapc.api.requests import TapRequest
from tapc.api.session import TapSession
from tapc.wire.positions import select


def reference(req: Req, keys: list[str], edits=()) -> dict[str, torch.Tensor]:
    """Activations of every row `req` sent through the model: the model alone on its tokens.
    edits: (layer, vector, alpha, at) added to that layer's residual stream."""
    model = ToyModel()
    toks = req.tokens[:-1]
    seen: dict[str, torch.Tensor] = {}
    handles = []
    plen = len(req.prompt)
    pos = torch.arange(len(toks))
    for i, layer in enumerate(model.model.layers):
        def hook(mod, args, out, i=i):
            h, r = out
            for layer_i, vec, alpha, at in edits:
                if layer_i == i:
                    rows = torch.from_numpy(select(at, pos.numpy(), plen))
                    h[rows] += alpha * torch.as_tensor(vec, dtype=h.dtype)
            seen[f"model.layers.{i}.resid"] = (h + r).detach().clone()
            seen[f"model.layers.{i}.output[0]"] = h.detach().clone()
            seen[f"model.layers.{i}.output[1]"] = r.detach().clone()
        handles.append(layer.register_forward_hook(hook))
        handles.append(layer.mlp.down_proj.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(f"model.layers.{i}.mlp.down_proj.output", out[0].detach().clone())))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(f"model.layers.{i}.mlp.down_proj.input", a[0].detach().clone())))
    with torch.no_grad():
        model(torch.tensor(toks), pos)
    return {k: seen[k] for k in keys}


def rows_of(req: Req, positions) -> np.ndarray:
    pos = np.arange(len(req.tokens) - 1)
    return pos[select(positions, pos, len(req.prompt))]


def check(req: Req, got: dict, positions, edits=()):
    ref = reference(req, list(got), edits)
    rows = rows_of(req, positions)
    for key, value in got.items():
        assert value.shape == (len(rows), ref[key].shape[1]), f"{req.rid} {key}: shape {tuple(value.shape)}"
        torch.testing.assert_close(value, ref[key][rows], rtol=1e-5, atol=1e-5, msg=lambda m: f"{req.rid} {key}: {m}")


TAPS = ["model.layers.*.resid", "model.layers.1.output[0]", "model.layers.2.mlp.down_proj.output",
        "model.layers.0.mlp.down_proj.input"]


def make_requests(plan):
    asks = [
        ("a", 3, 5, 0, None, TapRequest(capture="*")),
        ("b", 11, 3, 0, None, TapRequest(capture=["model.layers.*.resid"], positions="prompt")),
        ("c", 25, 6, 2, 6, TapRequest(capture=["model.layers.1.output[0]", "model.layers.0.mlp.down_proj.input"],
                                      positions="generated")),
        ("d", 7, 4, 5, None, TapRequest(capture=["model.layers.2.resid"], positions="last")),
        ("e", 9, 4, 1, None, TapRequest(capture="*", positions=[0, 4, 8, 9, 11, 40])),
        ("f", 5, 3, 0, None, None),
    ]
    rng = np.random.default_rng(0)
    reqs = []
    for rid, plen, max_tokens, arrive, preempt, ask in asks:
        wire = wire_for(plan, ask, rid)
        reqs.append(Req(rid, rng.integers(0, 50, plen).tolist(), max_tokens, wire, arrive, preempt))
    return reqs


def run_and_check(runner, hooks, plan) -> list[Req]:
    """`make_requests`' batch through the toy runner and its hooks, budget 16 (chunked prefill, late
    arrivals, a preemption): every tapped request's captures equal the reference; the requests."""
    reqs = make_requests(plan)
    run(runner, reqs, budget=16)
    outs = collect(hooks, reqs, TapSession(plan))
    for r in reqs:
        if r.wire is not None:
            check(r, dict(outs[r.rid].taps), r.wire.ask.positions)
    return reqs


def params(max_tokens=5):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def prompt(seed: int, n: int = 14):
    return {"prompt_token_ids": np.random.default_rng(seed).integers(0, 50, n).tolist()}


def as_req(out):
    """A finished toy output as `check` wants it."""
    return NS(rid=out.request_id, prompt=out.prompt_token_ids,
              tokens=list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
