"""The logit lens: at which layer does the model's answer first top the lens?

Every layer's residual stream at the last prompt position, read through the model's own final
norm and unembedding inside the compiled graph (`model.layers.*.resid | lens(k=5)`): each
layer's five best tokens and their logits. For each prompt the script prints the token the
model answers (its greedy next token) and, layer by layer, that token's rank in the lens, and
the first layer whose best token it is.

    python examples/lens/lens.py

What holds for any weights, and is checked: the last layer's lens is the model's own output
distribution, so its five best tokens and logits are those of the logits vLLM computed for the
next token (captured beside it, `logits`), up to bf16 rounding, and its best token is the one
the model chose.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import SMALL, engine_args, require_gpu, small_model, verdict  # noqa: E402

PROMPTS = ["The tower is in the city of", "A cat sat on the", "She went to the market and bought a",
           "The river runs from the mountains to the"]
LAYERS = SMALL["num_hidden_layers"]
K = 5
TAPS = [f"model.layers.*.resid | lens(k={K})", "logits"]
LAST = f"model.layers.{LAYERS - 1}.resid"
TOLERANCE = 0.02   # of the largest logit: bf16, and the final norm's add rounded differently


def main() -> int:
    require_gpu()
    from vllm import SamplingParams

    from tapc import VLLM, TapRequest

    llm = VLLM(small_model("llama"), taps=TAPS, **engine_args())
    tok = llm.llm.get_tokenizer()
    one = SamplingParams(max_tokens=1, temperature=0.0)   # its logits are the last prompt position's
    outs = llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS], one,
                        taps=TapRequest(capture="*", positions="last"))
    wrong = []
    for prompt, out in zip(PROMPTS, outs):
        if out.error is not None:
            raise SystemExit(f"a request failed: {out.error}")
        answer = out.outputs[0].token_ids[0]
        ranks = []
        for i in range(LAYERS):
            ids = out.taps[f"model.layers.{i}.resid:lens.ids"][0].tolist()
            ranks.append(ids.index(answer) + 1 if answer in ids else None)
        first = next((i for i, r in enumerate(ranks) if r == 1), None)
        shown = " ".join("-" if r is None else str(r) for r in ranks)
        print(f"{prompt!r} -> {tok.decode([answer])!r}: its rank in each layer's lens {shown}; "
              f"first best at layer {first}")
        # the last layer's lens against the model's own logits
        logits = out.taps["logits"][0].float()
        top = logits.topk(K)
        got_ids = out.taps[f"{LAST}:lens.ids"][0]
        got = out.taps[f"{LAST}:lens.logits"][0]
        scale = float(logits.abs().max())
        if (got - top.values.cpu()).abs().max() > TOLERANCE * scale:
            wrong.append(f"{prompt!r}: the last layer's lens logits {got.tolist()} are not the model's {top.values.tolist()}")
        if float(logits[int(got_ids[0])]) < float(top.values[0]) - TOLERANCE * scale:
            wrong.append(f"{prompt!r}: the last layer's best token {int(got_ids[0])} is not the model's choice {answer}")
    return verdict(wrong, "the last layer's lens is the model's own next-token logits, and its best token the answer")


if __name__ == "__main__":
    sys.exit(main())
