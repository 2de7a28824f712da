"""Cost of interventions beyond the built-in edits, beside vanilla vLLM in the same process:
Python blocks at graph boundaries, and compiled functions inside the graphs.

    python3 benchmarks/bench_blocks.py [--shape 8b|1b] [--variants one all batched fn-noop fn-probe fn-sae lens-last lens-gen pattern-last] --out bench_blocks.md

Engines (dummy weights, greedy, ignore_eos, token-id prompts; runs interleaved, the first round
discarded as warmup): vanilla vLLM (defaults: compile, FULL_AND_PIECEWISE graphs); tapc with a
no-op block on one layer (`model.layers.{L/2}.resid -> noop`, `one`); tapc with a no-op block on
every layer, called per request (`all`) or batched, once per layer and step (`batched`); tapc
with a compiled function on every layer's resid (`| call(...)`), a no-op (`fn-noop`: returns its
input, every request applies it) or a linear probe (`fn-probe`: hidden -> 16, sigmoid, fp32,
every request keeps every layer's scores at every position), or an SAE feature clamp (`fn-sae`:
16k features on layer 16, every request steered, tapc/sae.py); the logit lens (`| lens(k=10)`) on
every layer's resid, every request keeping its last prompt position's (`lens-last`) or every
generated position's (`lens-gen`); attention patterns (`.pattern | capture(keys=512)`, every head)
on 4 layers, every request keeping its last prompt position's (`pattern-last`). Block engines split their graphs
at each block; function engines split none. Decode at batch 1 and 64, 512 prompt tokens, 128
generated; output tokens/s and the ratio to vanilla.
"""
import argparse
import gc
import json
import os
import platform
import tempfile
import time

from bench_engine import ENGINE, LLAMA_31_8B, timed, write_table
import record

import torch

import tapc
import tapc.sae
from tapc import batched

LLAMA_32_1B = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True}
SHAPES = {"8b": ("Llama-3.1-8B", LLAMA_31_8B), "1b": ("Llama-3.2-1B", LLAMA_32_1B)}
WORKLOADS = ("decode bs1", "decode bs64")


def noop(ctx, x):
    return None


@batched
def noop_batched(batch, x):
    return None


def noop_fn(x, batch):
    return x


@tapc.function(results={"p": 16})
class Probe(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden, 16) / hidden ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x, batch):
        return {"p": torch.sigmoid(x.float() @ self.w + self.b)}


def random_sae(d_in: int, d_sae: int):
    g = torch.Generator().manual_seed(0)
    return tapc.sae.SAE(torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5, torch.zeros(d_sae),
                        torch.randn(d_sae, d_in, generator=g) / d_sae ** 0.5, torch.zeros(d_in))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="8b")
    ap.add_argument("--out", default="bench_blocks.md")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    ap.add_argument("--variants", nargs="+",
                    choices=("one", "all", "batched", "fn-noop", "fn-probe", "fn-sae", "lens-last", "lens-gen",
                             "pattern-last"),
                    default=["one", "all", "batched", "fn-noop", "fn-probe", "fn-sae"],
                    help="the tapc engines beside vanilla")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm
    from vllm import LLM

    from tapc import VLLM, TapRequest

    name, config = SHAPES[args.shape]
    layers = config["num_hidden_layers"]
    model = tempfile.mkdtemp(prefix=f"{args.shape}-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    # every engine stays alive for the interleaved rounds: each 8B engine needs about 20 GB, so an
    # 80 GB GPU holds vanilla and two variants, a 141 GB one vanilla and four
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"),
                  gpu_memory_utilization=min(0.28, 0.9 / (1 + len(args.variants))))
    engines = {}
    variants = {
        "one": (f"tapc, no-op block on layer {layers // 2}",
                lambda: VLLM(model, taps=[f"model.layers.{layers // 2}.resid -> noop"], blocks={"noop": noop}, **common)),
        "all": (f"tapc, no-op block on all {layers} layers",
                lambda: VLLM(model, taps=["model.layers.*.resid -> noop"], blocks={"noop": noop}, **common)),
        "batched": (f"tapc, batched no-op block on all {layers} layers",
                    lambda: VLLM(model, taps=["model.layers.*.resid -> noop"], blocks={"noop": noop_batched}, **common)),
        "fn-noop": (f"tapc, compiled no-op function on all {layers} layers",
                    lambda: VLLM(model, taps=["model.layers.*.resid | call(noop)"], functions={"noop": noop_fn},
                                 **common)),
        "fn-probe": (f"tapc, compiled probe on all {layers} layers, scores kept",
                     lambda: VLLM(model, taps=["model.layers.*.resid | call(probe)"],
                                  functions={"probe": Probe(config["hidden_size"])}, **common)),
        "fn-sae": (f"tapc, SAE feature clamp (16k features) on layer {layers // 2}, every request",
                   lambda: VLLM(model, taps=[f"model.layers.{layers // 2}.resid | call(steer)"],
                                functions={"steer": tapc.sae.clamp(random_sae(config["hidden_size"], 16384))},
                                **common)),
        "lens-last": (f"tapc, logit lens (k=10) on all {layers} layers, last prompt position",
                      lambda: VLLM(model, taps=["model.layers.*.resid | lens(k=10)"], **common)),
        "lens-gen": (f"tapc, logit lens (k=10) on all {layers} layers, every generated position",
                     lambda: VLLM(model, taps=["model.layers.*.resid | lens(k=10)"], **common)),
        "pattern-last": (f"tapc, attention patterns (all heads, 512 keys) on 4 of {layers} layers, last prompt position",
                         lambda: VLLM(model, taps=[f"model.layers[0:{layers}:{layers // 4}].self_attn.pattern | "
                                                   "capture(keys=512)"], **common)),
    }
    # what each engine's requests ask: the probe's requests keep every layer's scores, the SAE's steer,
    # the lenses' their rows
    asks = {variants["fn-probe"][0]: TapRequest(capture="*"),
            variants["fn-sae"][0]: TapRequest(params={"feature": 1234, "value": 8.0}),
            variants["lens-last"][0]: TapRequest(capture="*", positions="last"),
            variants["lens-gen"][0]: TapRequest(capture="*", positions="generated"),
            variants["pattern-last"][0]: TapRequest(capture="*", positions="last")}
    for label, make in [("vanilla", lambda: LLM(model, **common))] + [variants[v] for v in args.variants]:
        t0 = time.perf_counter()
        engines[label] = make()
        print(f"engine start {label}: {time.perf_counter() - t0:.0f} s", flush=True)

    results: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.repeats):
        for w in WORKLOADS:
            for label, llm in engines.items():
                ask = {"taps": asks[label]} if label in asks else {}
                value = timed(lambda ps, sp, llm=llm, ask=ask: llm.generate(ps, sp, use_tqdm=False, **ask), w, seed=rnd)
                print(f"round {rnd} {w:12s} {label:40s} {value:10.1f}", flush=True)
                if rnd > 0 or args.repeats == 1:
                    results.setdefault((w, label), []).append(value)
        if results:  # after every measured round, so a run cut short still leaves its table
            rounds = len(next(iter(results.values())))
            lines = [f"# bench_blocks: {torch.cuda.get_device_name()}, vLLM {vllm.__version__}, "
                     f"torch {torch.__version__}, Python {platform.python_version()}", "",
                     f"{name} shape, dummy weights, bf16; output tok/s, medians of {rounds} rounds.", ""]
            write_table(lines, results, WORKLOADS, args.out)
    record.append_compared("bench_blocks.py", results, WORKLOADS, "tok/s", args.out)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
