"""Induction heads: which heads attend from a repeated token to the token after its first copy?

Each prompt is a block of random tokens twice over. At a position i of the second copy, an
induction head attends to position i - L + 1 (L the block's length): the token that followed
the current token last time. The script captures every head's attention weights at the second
copy's positions (`model.layers.*.self_attn.pattern`, in the graph) and prints each layer's
induction score per head: the mean weight on that key. On trained models a few heads score near
1; on this random checkpoint every head scores about what uniform attention would (1 / p).

    python examples/induction/induction.py

What holds for any weights, and is checked: each row's weights over keys 0..p sum to 1 with zeros
after, and they equal HF transformers' eager attention (`output_attentions=True`) on the same
tokens, within bf16 rounding.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import SMALL, engine_args, require_gpu, small_model, verdict  # noqa: E402

BLOCK, PROMPTS, KEYS = 24, 3, 64
LAYERS, HEADS = SMALL["num_hidden_layers"], SMALL["num_attention_heads"]
TAPS = [f"model.layers.*.self_attn.pattern | capture(keys={KEYS})"]
TOLERANCE = 0.03   # of a weight: HF's eager attention rounds its logits and weights to bf16


def hf_attentions(path: str, tokens: list[int]):
    """HF's eager attention weights on `tokens`: one [heads, query, key] float32 tensor a layer."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], device="cuda"), output_attentions=True)
    return [a[0].float().cpu() for a in out.attentions]


def main() -> int:
    require_gpu()
    import numpy as np
    from vllm import SamplingParams

    from tapc import VLLM, TapRequest

    path = small_model("llama")
    llm = VLLM(path, taps=TAPS, **engine_args())
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, SMALL["vocab_size"], BLOCK).tolist() for _ in range(PROMPTS)]
    second = list(range(BLOCK, 2 * BLOCK))   # the second copy's positions
    outs = llm.generate([{"prompt_token_ids": b + b} for b in blocks], SamplingParams(max_tokens=1),
                        taps=TapRequest(capture="*", positions=second))
    wrong = []
    scores = np.zeros((LAYERS, HEADS))
    for n, (block, out) in enumerate(zip(blocks, outs)):
        if out.error is not None:
            raise SystemExit(f"a request failed: {out.error}")
        hf = hf_attentions(path, block + block)
        for layer in range(LAYERS):
            rows = out.taps[f"model.layers.{layer}.self_attn.pattern"]   # [positions, heads, keys]
            for r, p in enumerate(second):
                scores[layer] += rows[r, :, p - BLOCK + 1].numpy() / (PROMPTS * BLOCK)
                sums = rows[r, :, : p + 1].sum(-1)
                if (sums - 1).abs().max() > 1e-4 or rows[r, :, p + 1:].abs().max() > 0:
                    wrong.append(f"prompt {n} layer {layer} position {p}: weights sum to {sums.tolist()}")
                err = float((rows[r, :, : p + 1] - hf[layer][:, p, : p + 1]).abs().max())
                if err > TOLERANCE:
                    wrong.append(f"prompt {n} layer {layer} position {p}: {err:.3f} from HF's eager attention")
    uniform = float(np.mean([1 / (p + 1) for p in second]))
    for layer in range(LAYERS):
        print(f"layer {layer}: induction score per head " + " ".join(f"{s:.3f}" for s in scores[layer]))
    best = np.unravel_index(scores.argmax(), scores.shape)
    print(f"best head: layer {best[0]} head {best[1]} ({scores.max():.3f}; uniform attention scores {uniform:.3f})")
    return verdict(wrong[:3], "every row sums to 1 over its keys and equals HF's eager attention weights")


if __name__ == "__main__":
    sys.exit(main())
