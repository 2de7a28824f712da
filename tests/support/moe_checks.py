"""HF transformers' activations and logits of a MoE model (the routers' math as transformers writes
it), and the captures of tapc's engine checked against them: the MoE GPU test modules share these."""
import numpy as np
import torch
from gpu_engines import MOE, hf_forward

LAYERS, TOP_K = MOE["num_hidden_layers"], 2
STEER_LAYER, ALPHA = 1, 8.0
PROMPT_LENS = [5, 37, 150, 12]
MAX_TOKENS = [6, 9, 4, 8]
# Router ties: HF's k-th and (k+1)-th logits closer than this may swap under bf16 noise (the
# logits' spread is ~0.3 at this init; bf16 noise in them ~0.002, and a few times that on
# tokens that attend to one whose routing swapped).
ROUTER_TIE = 0.02


def prompts(seed: int, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, MOE["vocab_size"], n).tolist()} for n in lens]


def sampling(max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


class _Swap:
    """`obj.name = value` until `remove()` (the handle `hf_forward` removes after its run)."""

    def __init__(self, obj, name, value):
        self.obj, self.name = obj, name
        setattr(obj, name, value)

    def remove(self):
        delattr(self.obj, self.name)


def hf_reference(path: str, moe: str, tokens: list[int], steer=None, ban=None):
    """HF's activations on `tokens`, keyed like tapc's points, and its logits. steer: a vector
    added (times ALPHA) to layer STEER_LAYER's output; ban: a vector added to every layer's
    router logits before the softmax (HF's router math, as transformers writes it)."""
    import torch.nn.functional as F

    seen: dict[str, torch.Tensor] = {}

    def router(gate, i):
        renorm = getattr(gate, "norm_topk_prob", True)   # Mixtral always renormalizes

        def forward(hidden_states):
            x = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(x, gate.weight)
            if ban is not None:
                logits = logits + torch.as_tensor(ban, device=logits.device).to(logits.dtype)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, ids = torch.topk(probs, gate.top_k, dim=-1)
            if renorm:
                top = top / top.sum(dim=-1, keepdim=True)
            seen[f"model.layers.{i}.{moe}.gate.output"] = logits.float()
            seen[f"model.layers.{i}.{moe}.experts.router.output[0]"] = top.float()
            seen[f"model.layers.{i}.{moe}.experts.router.output[1]"] = ids.to(torch.int32)
            return logits, top.to(logits.dtype) if moe == "mlp" else top, ids
        return forward

    def layer_hook(i):
        def hook(mod, args, out):
            h = out[0] if isinstance(out, tuple) else out
            if steer is not None and i == STEER_LAYER:
                h = h + ALPHA * torch.as_tensor(steer, device=h.device, dtype=h.dtype)
            seen[f"model.layers.{i}.resid"] = h[0].float()
            return (h, *out[1:]) if isinstance(out, tuple) else h
        return hook

    def shared(mlp, i):   # vLLM's shared expert output is already times its sigmoid gate
        def hook(mod, args, out):
            gate = torch.sigmoid(mlp.shared_expert_gate(args[0]))
            seen[f"model.layers.{i}.{moe}.shared_expert.output"] = (gate * out).float()
        return hook

    def hooks(model):
        handles = []
        for i, layer in enumerate(model.model.layers):
            handles.append(_Swap(layer.mlp.gate, "forward", router(layer.mlp.gate, i)))
            if hasattr(layer.mlp, "shared_expert"):
                handles.append(layer.mlp.shared_expert.register_forward_hook(shared(layer.mlp, i)))
            handles.append(layer.register_forward_hook(layer_hook(i)))
            handles.append(layer.mlp.register_forward_hook(
                lambda m, a, o, i=i: seen.__setitem__(f"model.layers.{i}.{moe}.output", o[0].float())))
        return handles

    out = hf_forward(path, tokens, hooks)
    return {k: v.cpu() for k, v in seen.items()}, out.logits[0].float().cpu()


def untied(logits: torch.Tensor, k: int, tie: float) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th largest logits are at least `tie` apart."""
    top = logits.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) >= tie


def assert_matches_hf(taps: dict, ref: dict, moe: str, what: str, before=("gate.output",)) -> torch.Tensor:
    """One request's captures against HF's, layer by layer; returns the rows (tokens) whose
    routing never left HF's.

    At each layer, on the tokens whose routing matched HF's at every earlier layer: the expert
    ids are exactly HF's (as sets) wherever HF's router is not near a tie, and their weights
    HF's (matched by id); a token whose router picks differently at a near tie leaves the
    comparison from there on (its MoE output, and so its residual stream and later routing,
    are then legitimately different). On the tokens still in: the residual stream, the router
    logits and the MoE output match in bf16 (relative error under 3%, every row's cosine over
    0.99: a token that left changes what the others attend to, a little). Most tokens must
    stay in and most rows be untied, or the test proves nothing."""
    n = ref["model.layers.0.resid"].shape[0]
    clean = torch.ones(n, dtype=torch.bool)
    checked = 0
    for i in range(LAYERS):
        key = f"model.layers.{i}.{moe}.experts.router.output"
        ids, w = taps[f"{key}[1]"], taps[f"{key}[0]"]
        assert ids.dtype == torch.int32 and w.dtype == torch.float32, f"{what} layer {i}: {ids.dtype}, {w.dtype}"
        order, ref_order = ids.long().argsort(dim=1), ref[f"{key}[1]"].long().argsort(dim=1)
        got_ids, want_ids = ids.gather(1, order), ref[f"{key}[1]"].gather(1, ref_order)
        same = (got_ids == want_ids).all(dim=1)
        firm = untied(ref[f"model.layers.{i}.{moe}.gate.output"], TOP_K, ROUTER_TIE)
        bad = (clean & firm & ~same).nonzero().flatten().tolist()
        assert not bad, (f"{what} layer {i}: experts {got_ids[bad[:5]].tolist()} where HF chose "
                         f"{want_ids[bad[:5]].tolist()} (rows {bad[:5]}), away from any tie")
        both = clean & same
        torch.testing.assert_close(w.gather(1, order)[both], ref[f"{key}[0]"].gather(1, ref_order)[both], rtol=0,
                                   atol=2e-2, msg=lambda m: f"{what} layer {i} routing weights: {m}")
        checked += int((clean & firm).sum())
        # `before` (the gate's logits, a shared expert) depend on this layer's input only; the
        # MoE output and the residual stream on this layer's choice too
        for point, rows in [(f"{moe}.{p}", clean) for p in before] + [(f"{moe}.output", both), ("resid", both)]:
            k = f"model.layers.{i}.{point}"
            assert_rows(taps[k][rows], ref[k][rows], f"{what} {k}")
        clean = both
    assert clean.float().mean() >= 0.7, f"{what}: only {clean.float().mean():.2f} of tokens kept HF's routing"
    assert checked >= 0.6 * n * LAYERS, f"{what}: only {checked} of {n * LAYERS} routing rows were away from a tie"
    return clean


def assert_rows(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got = got.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1).min().item()
    assert rel < 3e-2 and cos > 0.99, f"{what}: relative error {rel:.4f}, worst row cosine {cos:.5f}"

