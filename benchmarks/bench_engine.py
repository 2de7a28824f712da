"""tapc's engine beside vanilla vLLM and enforce_eager, on a Llama-3.1-8B-shaped model.

    python3 benchmarks/bench_engine.py --out bench_engine.md

One process, one GPU. Dummy weights (`load_format="dummy"`, the real 8B config), greedy,
ignore_eos, token-id prompts. Vanilla vLLM (default torch.compile + FULL_AND_PIECEWISE graphs)
and one tapc engine (taps: every layer's residual stream, and an `add(steer)` on layer 16) run
side by side and their runs are interleaved, `--repeats` rounds, the first round discarded as
warmup; the table shows medians. enforce_eager runs last, once after a warmup, alone.

Workloads: decode at batch 1 and 64 (512 prompt tokens, 128 generated; output tokens/s) and a
prefill harvest (1024 prompts of 128 tokens, 1 generated token; seconds). tapc variants, all
on the same engine: requests asking for nothing; capturing every layer's residual stream at
every position (prompt and generated) or at generated positions only; steering every request
at layer 16; for the harvest, one layer's residual stream at every prompt position. Times
include bringing the captures back to the caller as CPU tensors.

Directional ablation (`project_out` on every layer's residual stream, every request) runs on a
second tapc engine, so that its 32 edit ops do not run in the first engine's variants: after
those rounds the first tapc engine is shut down, the ablating one started, and its decode runs
interleaved with vanilla's the same way. vanilla's medians are over both phases.
`--phases` runs some of the three (taps, ablation, eager), e.g. `--phases ablation` alone.
"""
import argparse
import gc
import json
import os
import platform
import tempfile
import time

import numpy as np

import record

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
TAPS = ["model.layers.*.resid", "model.layers.16.resid | add(steer, alpha=4.0)"]
ABLATE_TAPS = ["model.layers.*.resid | project_out(refusal)"]
ABLATE_WORKLOADS = ["decode bs1", "decode bs64"]
PHASES = ("taps", "ablation", "eager")
HARVEST_LAYER = "model.layers.16.resid"
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=8192,
              max_num_seqs=256, seed=0)
WORKLOADS = {  # name: (prompts, prompt tokens, generated tokens)
    "decode bs1": (1, 512, 128),
    "decode bs64": (64, 512, 128),
    "harvest 1024x128": (1024, 128, 1),
}


def prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, 128000, length).tolist()} for _ in range(n)]


def run_seed(phase: int, rnd: int, workload: int, variant: int) -> int:
    """The prompts' seed of one run: new prompts for every (phase, round, workload, variant).
    Every engine keeps vLLM's prefix caching on (tapped ones too: tapc/api/prefix.py), so a prompt an
    engine saw before would skip its prefill: the tapped engine's second variant would reuse the
    first's KV (capturing generated rows reads cache) and look faster than vanilla."""
    return ((phase * 100 + rnd) * 100 + workload) * 100 + variant


def timed(generate, workload: str, seed: int):
    """(output tokens/s for decode, seconds for the harvest) of one run."""
    from vllm import SamplingParams

    n, plen, gen = WORKLOADS[workload]
    ps = prompts(n, plen, seed)
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = generate(ps, sp)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n * gen
    failed = [o.error for o in outs if getattr(o, "error", None) is not None]  # a failed tap is no result
    assert not failed, f"{len(failed)} of {n} requests failed: {failed[0]}"
    return dt if workload.startswith("harvest") else n * gen / dt


def tapc_variants(llm, workload: str):
    from tapc import TapRequest

    if workload.startswith("harvest"):
        return {"tapc, nothing asked": None,
                "tapc, capture 1 layer (prompt rows)": TapRequest(capture=HARVEST_LAYER, positions="prompt")}
    steer = np.random.default_rng(0).standard_normal(4096).tolist()
    return {"tapc, nothing asked": None,
            "tapc, capture 32 layers (generated rows)": TapRequest(capture="model.layers.*.resid", positions="generated"),
            "tapc, capture 32 layers (all rows)": TapRequest(capture="model.layers.*.resid"),
            "tapc, steer 1 layer": TapRequest(params={"steer": steer})}


def ablation(llm, workload: str):
    """The ablating engine's one variant: every request projects a direction out of all 32
    layers' residual streams (the engine normalizes it)."""
    from tapc import TapRequest

    direction = np.random.default_rng(1).standard_normal(4096).tolist()
    return {"tapc, project_out 32 layers": TapRequest(params={"refusal": direction})}


def run_rounds(workloads, runs_for, repeats: int, results: dict, report, phase: int) -> None:
    """`repeats` rounds over `workloads`, each running every variant of `runs_for(workload)`
    ({name: generate}) in turn; round 0 is warmup unless it is the only one. Prompts are new for
    every run (`run_seed`)."""
    for rnd in range(repeats):
        for i, w in enumerate(workloads):
            for v, (name, gen) in enumerate(runs_for(w).items()):
                value = timed(gen, w, seed=run_seed(phase, rnd, i, v))
                print(f"round {rnd} {w:18s} {name:42s} {value:10.2f}", flush=True)
                if rnd > 0 or repeats == 1:
                    results.setdefault((w, name), []).append(value)
        if results:
            report()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_engine.md")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                    help="tapc's engine beside vanilla; the ablating engine beside vanilla; enforce_eager")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the parent touches CUDA between engines
    import torch
    import vllm
    from vllm import LLM

    from tapc import VLLM

    model = tempfile.mkdtemp(prefix="llama-3.1-8b-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f)
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"))

    results: dict[tuple[str, str], list[float]] = {}

    def report() -> None:  # after every measured round and at the end: a run cut short keeps its table
        rounds = max(1, args.repeats - 1)
        eager = "enforce_eager: 1" if (next(iter(WORKLOADS)), "vanilla enforce_eager") in results else "enforce_eager: not yet run"
        lines = [f"# bench_engine: {torch.cuda.get_device_name()}, vLLM {vllm.__version__}, torch {torch.__version__}, "
                 f"Python {platform.python_version()}",
                 "", f"Llama-3.1-8B shape, dummy weights, bf16; medians of {rounds} rounds ({eager}). Decode: output "
                 "tok/s (higher is better); harvest: seconds (lower is better).", ""]
        write_table(lines, results, WORKLOADS, args.out)

    def runs_for(engine, variants):
        def runs(w: str) -> dict:
            out = {"vanilla": lambda ps, sp: vanilla.generate(ps, sp, use_tqdm=False)}
            for name, ask in variants(engine, w).items():
                out[name] = lambda ps, sp, ask=ask: engine.generate(ps, sp, taps=ask, use_tqdm=False)
            return out
        return runs

    if "taps" in args.phases or "ablation" in args.phases:
        vanilla = started("vanilla", lambda: LLM(model, gpu_memory_utilization=0.42, **common))
    if "taps" in args.phases:
        tapped = started("tapc", lambda: VLLM(model, taps=TAPS, gpu_memory_utilization=0.42, **common))
        run_rounds(WORKLOADS, runs_for(tapped, tapc_variants), args.repeats, results, report, phase=1)
        del tapped
        gc.collect()
        torch.cuda.empty_cache()
    if "ablation" in args.phases:
        ablating = started("tapc ablation", lambda: VLLM(model, taps=ABLATE_TAPS, gpu_memory_utilization=0.42,
                                                         **common))
        run_rounds(ABLATE_WORKLOADS, runs_for(ablating, ablation), args.repeats, results, report, phase=2)
        del ablating
    if "taps" in args.phases or "ablation" in args.phases:
        del vanilla
        gc.collect()
        torch.cuda.empty_cache()
    if "eager" in args.phases:
        eager = LLM(model, enforce_eager=True, gpu_memory_utilization=0.85, **common)
        for i, w in enumerate(WORKLOADS):
            timed(lambda ps, sp: eager.generate(ps, sp, use_tqdm=False), w, seed=3000 + i)
            results[(w, "vanilla enforce_eager")] = [timed(lambda ps, sp: eager.generate(ps, sp, use_tqdm=False), w,
                                                           seed=3100 + i)]
        report()
    record.append_compared("bench_engine.py", results, WORKLOADS, metric, args.out)


def started(what: str, start):
    """`start()`, its time printed."""
    t0 = time.perf_counter()
    engine = start()
    print(f"engine start: {what} {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def write_table(head: list[str], results: dict, workloads, out: str, unit: str | None = None) -> None:
    """`head`, then a markdown table of median values and their ratio to vanilla's, printed and
    written to `out`. results: (workload, variant) -> values, one a round in round order;
    "vanilla" is the baseline. Beside the ratio of medians, the median (and range) of each
    round's own ratio (record.compared)."""
    lines = head + ["| workload | variant | value | ratio to vanilla | per-round ratio, median (range) |",
                    "|---|---|---:|---:|---:|"]
    for c in record.compared(results, workloads):
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}x"
        paired = "" if c["per_round"] is None else f"{c['per_round']:.3f}x ({c['low']:.3f}-{c['high']:.3f})"
        lines.append(f"| {c['workload']} | {c['variant']} | {c['value']:.2f} {unit or metric(c['workload'])} | "
                     f"{ratio} | {paired} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)


def metric(workload: str) -> str:
    """A workload's unit: the harvest is timed, decode counts output tokens."""
    return "s" if workload.startswith("harvest") else "tok/s"


if __name__ == "__main__":
    main()
