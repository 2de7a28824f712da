"""A compiled function (`clamp`), the toy model run with a function applied by hand, and requests
to send them: the CPU tests of compiled functions and of what reaches them share these."""
import torch
from engine_toy import HIDDEN, Req, ToyModel, wire_for

import tapc

torch.manual_seed(0)
W = torch.randn(3, HIDDEN)


@tapc.function(params={"thr": "scalar"}, results={"score": 3})
def clamp(x, batch):
    """Halve the rows whose norm passes the request's threshold; score every row."""
    over = x.norm(dim=-1) > batch.params["thr"]
    return torch.where(over[:, None], x * 0.5, x), {"score": x @ W.T}


def reference(req: Req, layer: int, fn=None) -> dict[str, torch.Tensor]:
    """Every layer's resid for `req` alone, and the resid before `fn` (s -> s') edits `layer`."""
    model = ToyModel()
    toks = torch.tensor(req.tokens[:-1])
    seen = {}

    def hook(mod, args, out, i):
        h, r = out
        s = h + r
        if i == layer:
            seen["before"] = s.detach().clone()
            if fn is not None:
                h = fn(s) - r
        seen[f"model.layers.{i}.resid"] = (h + r).detach().clone()
        return h, r

    for i, layer_mod in enumerate(model.model.layers):
        layer_mod.register_forward_hook(lambda m, a, out, i=i: hook(m, a, out, i))
    with torch.no_grad():
        model(toks, torch.arange(len(toks)))
    return seen


def requests(plan, asks: dict, rng) -> list[Req]:
    return [Req(rid, rng.integers(0, 50, 5 + 3 * i).tolist(), 4, wire_for(plan, ask, rid))
            for i, (rid, ask) in enumerate(asks.items())]

