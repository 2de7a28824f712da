"""Activation patching across prompts, layer by layer.

The clean prompt's run captures the residual stream (and the embeddings) at every prompt
position. Then the corrupted prompt runs once per site and position, each request bringing the
clean run's row for that one site (`patch`, in the compiled graph): all of them in one
`generate` call, on one engine. Printed: how much of the clean run's logit difference each patch
restores (1: all of it, 0: none).

    python examples/patching/patching.py

Four patches are known exactly, whatever the weights: the corrupted token's embedding restores
everything and its row after the last layer nothing (no later layer reads it); the last
position's embedding restores nothing (both prompts end with the same token) and its row after
the last layer everything (the logits read only it). The script checks those four.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/, for small_models
from small_models import SMALL, engine_args, require_gpu, small_model, verdict  # noqa: E402

CLEAN = "The tower is in the city of Paris, so the tower is in"
CORRUPT = "The tower is in the city of Rome, so the tower is in"
LAYERS = SMALL["num_hidden_layers"]
SITES = ["model.embed_tokens.output"] + [f"model.layers.{i}.resid" for i in range(LAYERS)]
# One parameter a site: a request that binds `at_3` is patched at layer 3 and nowhere else. The
# patches come first: taps at one point run in plan order, so the captures see the patched rows.
PARAM = {site: "at_embed" if i == 0 else f"at_{i - 1}" for i, site in enumerate(SITES)}
TAPS = [*(f"{site} | patch({PARAM[site]})" for site in SITES), *SITES, "logits"]
TOLERANCE = 0.05   # bf16, and runs batched differently


def name(site: str) -> str:
    return "embeddings" if site.startswith("model.embed_tokens") else "layer " + site.split(".")[2]


def main() -> int:
    require_gpu()
    from vllm import SamplingParams

    from tapc import VLLM, TapRequest

    llm = VLLM(small_model("llama"), taps=TAPS, **engine_args())
    tok = llm.llm.get_tokenizer()
    clean, corrupt = tok.encode(CLEAN), tok.encode(CORRUPT)
    assert len(clean) == len(corrupt), "the two prompts must line up token for token"
    changed = next(p for p, (a, b) in enumerate(zip(clean, corrupt)) if a != b)
    last = len(clean) - 1
    one = SamplingParams(max_tokens=1, temperature=0.0)   # one token: its logits are the last position's

    def prompt(ids):
        return {"prompt_token_ids": ids}

    # 1. The clean run's rows at every site.
    (run,) = llm.generate([prompt(clean)], one, taps=TapRequest(capture=SITES, positions="prompt"))
    rows = {site: run.taps[site].clone() for site in SITES}   # clone: the captures are views of shared memory

    # 2. The corrupted prompt once per (site, position), each with its own row to patch in; both
    # prompts unpatched in the same call, as the baselines.
    cases = [(site, pos) for site in SITES for pos in (changed, last)]
    asks = [TapRequest(capture="logits", params={PARAM[site]: {"positions": [pos], "rows": rows[site][[pos]]}})
            for site, pos in cases]
    outs = llm.generate([prompt(corrupt)] * len(cases) + [prompt(clean), prompt(corrupt)], one,
                        taps=asks + [TapRequest(capture="logits")] * 2)
    for out in outs:
        if out.error is not None:
            raise SystemExit(f"a request failed: {out.error}")
    logits = [out.taps["logits"][0] for out in outs]
    clean_logits, corrupt_logits = logits[-2], logits[-1]

    # The metric: the logit difference of two tokens. With a trained model these are the two
    # answers (' paris' against ' rome'); on random weights, the two tokens whose logits the
    # corruption moved furthest apart, so that the difference is well above bf16's noise.
    moved = clean_logits - corrupt_logits
    a, b = int(moved.argmax()), int(moved.argmin())

    def diff(x):
        return float(x[a] - x[b])

    lo, hi = diff(corrupt_logits), diff(clean_logits)
    restored = {case: (diff(x) - lo) / (hi - lo) for case, x in zip(cases, logits)}
    print(f"logit difference {tok.decode([a])!r} - {tok.decode([b])!r}: clean {hi:.4f}, corrupted {lo:.4f}")
    print("share of it restored by patching the clean row in at one position of the corrupted run:")
    head = (f"{tok.decode([clean[changed]])!r} (position {changed})", f"last (position {last})")
    print(f"{'site':<12}{head[0]:>24}{head[1]:>24}")
    for site in SITES:
        print(f"{name(site):<12}{restored[site, changed]:>24.3f}{restored[site, last]:>24.3f}")

    known = {(SITES[0], changed): 1.0, (SITES[-1], changed): 0.0, (SITES[0], last): 0.0, (SITES[-1], last): 1.0}
    wrong = [f"{name(s)} at {p}: {restored[s, p]:.3f}, not {v}" for (s, p), v in known.items()
             if abs(restored[s, p] - v) > TOLERANCE]
    return verdict(wrong, "the four exactly known patches restore what they must")


if __name__ == "__main__":
    sys.exit(main())
