"""HF transformers' activations of the small Llama checkpoints (gpu_engines.py), the requests the
GPU test modules send, and their checks of tapc's captures against HF's (bf16 tolerance)."""
import numpy as np
import torch
from gpu_engines import SMALL, hf_forward

PROMPT_LENS = [5, 37, 300, 12, 90, 3]
MAX_TOKENS = [6, 12, 4, 9, 7, 10]


def prompts(seed: int = 1):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], n).tolist()} for n in PROMPT_LENS]


def sampling():
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]


def hf_reference(path: str, tokens: list[int], steer=None) -> dict[str, torch.Tensor]:
    """Activations of HF transformers on `tokens`, keyed like tapc's points. steer: (layer,
    vector, alpha) added to that layer's output (after it is recorded, like the plan's order)."""
    seen = {}

    def layer_hook(i):
        def hook(mod, args, out):
            h = out[0] if isinstance(out, tuple) else out
            seen[f"model.layers.{i}.resid"] = h.float().clone()
            if steer is not None and steer[0] == i:
                h = h + steer[2] * torch.as_tensor(steer[1], device=h.device, dtype=h.dtype)
                return (h, *out[1:]) if isinstance(out, tuple) else h
        return hook

    def hooks(model):
        handles = []
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.register_forward_hook(layer_hook(i)))
            handles.append(layer.mlp.register_forward_hook(
                lambda m, a, o, i=i: seen.__setitem__(f"model.layers.{i}.output[0]", o.float())))
            handles.append(layer.mlp.down_proj.register_forward_hook(
                lambda m, a, o, i=i: seen.__setitem__(f"model.layers.{i}.mlp.down_proj.output", o.float())))
        return handles

    hf_forward(path, tokens, hooks)
    return {k: v[0].cpu() for k, v in seen.items()}


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str):
    """bf16 through a few layers: whole-tensor relative error under 3%, every row pointing the
    same way (cosine > 0.995)."""
    got = got.float()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1).min().item()
    assert rel < 3e-2 and cos > 0.995, f"{what}: relative error {rel:.4f}, worst row cosine {cos:.5f}"


def assert_same_or_tie(path: str, prompt: list[int], got: list[int], ref: list[int], what: str) -> None:
    """An untapped request's greedy tokens `got` are `ref` (its tokens in another run), or part
    where HF's top two logits, on the prompt and `ref`'s tokens before the first divergence, are
    within bf16 noise of each other (vLLM is not batch-invariant: a request whose batch, or
    whose prefix-cache hit, differs between the two runs may split at a near tie)."""
    if got == ref:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert k is not None, f"{what}: {len(got)} tokens against {len(ref)}"
    logits = hf_forward(path, prompt + ref[:k]).logits[0, -1].float()
    margin = abs((logits[ref[k]] - logits[got[k]]).item())
    assert margin <= 2e-2 * logits.abs().max().item(), \
        f"{what}: token {k} is {got[k]} against {ref[k]}, with a logit margin of {margin:.4f} (not a near tie)"


def assert_captures_equal_hf(outs, path: str, keys, hf_points, label: str = "") -> None:
    """Every request's captures at `keys` equal `hf_points(path, tokens)` on the tokens that went
    through the model (the last generated one is never fed back)."""
    for i, out in enumerate(outs):
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_points(path, tokens[:-1])
        for key in keys:
            assert_matches(out.taps[key], ref[key], f"{label}request {i} {key}")


def rows_for(positions: str, prompt_len: int, n_gen: int) -> slice:
    total = prompt_len + n_gen - 1
    return {"all": slice(0, total), "prompt": slice(0, prompt_len), "generated": slice(prompt_len, total),
            "last": slice(prompt_len - 1, prompt_len)}[positions]

