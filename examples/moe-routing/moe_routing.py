"""Expert use per prompt on a mixture-of-experts model, and one expert banned per request.

A small Qwen3-MoE (Qwen3-30B-A3B's routing: softmax top-2 of 8 experts, renormalized) on 4
layers. Each prompt's routing is captured at every layer (the expert ids the fused experts ran)
and counted. Then each prompt runs again with the expert it used most banned, by a router edit
bound per request; its counts say that expert was never chosen.

    python examples/moe-routing/moe_routing.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import MOE, engine_args, require_gpu, small_model, verdict  # noqa: E402

LAYERS, EXPERTS, TOP_K = MOE["num_hidden_layers"], 8, 2
ROUTING = "model.layers.*.mlp.experts.router.output"
TAPS = ["model.layers.*.mlp.gate.output | set(ban, -1e4)",   # a request's `ban`: experts it bans
        ROUTING]                                             # [0]: top-k weights, [1]: expert ids
PROMPTS = ["The king and the queen lived in a house by the river.",
           "One two three four five six seven eight nine ten.",
           "Mary gave the book to John because he asked for it.",
           "The sun, the moon and the stars were over the sea."]


def expert_use(taps):
    """[layers, experts]: how many of a request's tokens chose each expert, at each layer."""
    import torch

    return torch.stack([torch.bincount(taps[f"model.layers.{i}.mlp.experts.router.output[1]"].flatten().long(),
                                       minlength=EXPERTS) for i in range(LAYERS)])


def main() -> int:
    require_gpu()
    from vllm import SamplingParams

    from tapc import VLLM, TapRequest

    llm = VLLM(small_model("qwen3_moe"), taps=TAPS, **engine_args())
    one = SamplingParams(max_tokens=1, temperature=0.0)
    plain = llm.generate(PROMPTS, one, taps=TapRequest(capture=ROUTING, positions="prompt"))
    used = [expert_use(out.taps) for out in plain]
    banned = [int(u.sum(0).argmax()) for u in used]   # each prompt bans the expert it used most
    asks = [TapRequest(capture=ROUTING, positions="prompt", params={"ban": [e]}) for e in banned]
    edited = llm.generate(PROMPTS, one, taps=asks)

    wrong = []
    print(f"expert use per prompt, summed over {LAYERS} layers (tokens x top-{TOP_K}):")
    print(f"{'prompt':<8}{'tokens':>7}  {'experts 0..7':<40}{'banned':>7}  with the ban")
    for i, (out, u, e, ban) in enumerate(zip(plain, used, banned, edited)):
        after = expert_use(ban.taps)
        tokens = len(out.prompt_token_ids)
        print(f"{i:<8}{tokens:>7}  {' '.join(f'{n:4d}' for n in u.sum(0).tolist()):<40}{e:>7}  "
              f"{' '.join(f'{n:4d}' for n in after.sum(0).tolist())}")
        if (u.sum(1) != tokens * TOP_K).any() or (after.sum(1) != tokens * TOP_K).any():
            wrong.append(f"prompt {i}: not {TOP_K} experts per token at every layer")
        if after[:, e].any():
            wrong.append(f"prompt {i}: banned expert {e} still chosen {after[:, e].tolist()} times per layer")
    return verdict(wrong, f"every token chose {TOP_K} experts at every layer, and no banned expert was chosen")


if __name__ == "__main__":
    sys.exit(main())
