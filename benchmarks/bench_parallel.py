"""tapc's engine beside vanilla vLLM under tensor parallelism (TP=2), on Llama-3.1 shapes.

    python3 benchmarks/bench_parallel.py --out bench_parallel.md             # 8B shape
    python3 benchmarks/bench_parallel.py --shape 70b --out bench_parallel_70b.md

Two GPUs of one host, vLLM's multiprocessing executor (one worker per GPU), dummy weights
(`load_format="dummy"`, the real configs), greedy, ignore_eos, token-id prompts, default
compilation (torch.compile + FULL_AND_PIECEWISE graphs). NVLink multicast is off
(NCCL_NVLS_ENABLE=0), as on the lent machines.

8B shape: vanilla TP=2 and one tapped TP=2 engine (taps: every layer's residual stream, and
`add(steer)` on every layer's residual stream) are both alive, their runs interleaved over
`--repeats` rounds, the first round discarded as warmup; the table shows medians and ratios to
vanilla TP=2. Decode at batch 1 and 64 (512 prompt tokens, 128 generated; output tokens/s).
Variants on the tapped engine: requests asking for nothing; capturing all 32 layers at every
position; steering all 32 layers.

70B shape (80 layers, about 66 GiB of weights per GPU at TP=2): two engines do not fit side by
side, so vanilla runs its rounds, is shut down, then the tapped engine (every layer's residual
stream) runs its own; decode at batch 1 and 16, capturing every layer at every position. Both
run at max_num_seqs=16, so each captures CUDA graphs up to 32 tokens and both starts fit one
device call (141 s and 95 s on the 2-GPU H200 machine).
Times include bringing the captures back to the caller as CPU tensors (sharded columns are
not involved: the residual stream is replicated and written by rank 0).

The entry point is guarded: vLLM spawns its workers, which import this file again.
"""
import argparse
import gc
import json
import os
import platform
import tempfile
import time

import numpy as np
from bench_engine import LLAMA_31_8B, prompts, run_seed, started, write_table
import record

LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                "num_hidden_layers": 80, "num_key_value_heads": 8}
SHAPES = {
    # name: (config, workloads {name: (prompts, prompt tokens, generated)}, engine settings, side by side)
    "8b": (LLAMA_31_8B, {"decode bs1": (1, 512, 128), "decode bs64": (64, 512, 128)},
           dict(gpu_memory_utilization=0.42, max_num_seqs=256), True),
    # at most 16 sequences: both engines then capture CUDA graphs up to 32 tokens, not 512, which
    # keeps each of the two 80-layer engine starts to a couple of minutes
    "70b": (LLAMA_31_70B, {"decode bs1": (1, 512, 128), "decode bs16": (16, 512, 128)},
            dict(gpu_memory_utilization=0.9, max_num_seqs=16), False),
}
TP = 2
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=8192,
              seed=0, tensor_parallel_size=TP)


def taps_for(shape: str) -> list[str]:
    steer = ["model.layers.*.resid | add(steer, alpha=4.0)"] if shape == "8b" else []
    return ["model.layers.*.resid"] + steer


def variants(shape: str, hidden: int) -> dict:
    from tapc import TapRequest

    every = TapRequest(capture="model.layers.*.resid")
    if shape == "70b":
        return {"tapc, capture 80 layers (all rows)": every}
    steer = np.random.default_rng(0).standard_normal(hidden).tolist()
    return {"tapc, nothing asked": None, "tapc, capture 32 layers (all rows)": every,
            "tapc, steer 32 layers": TapRequest(params={"steer": steer})}


def timed(generate, workload: tuple[int, int, int], seed: int) -> float:
    """Output tokens/s of one decode run; a failed tap is no result."""
    from vllm import SamplingParams

    n, plen, gen = workload
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    ps = prompts(n, plen, seed)
    t0 = time.perf_counter()
    outs = generate(ps, sp)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == n * gen
    failed = [o.error for o in outs if getattr(o, "error", None) is not None]
    assert not failed, f"{len(failed)} of {n} requests failed: {failed[0]}"
    return n * gen / dt


def rounds(workloads: dict, runs: dict, repeats: int, results: dict, report, phase: int = 0, after=None) -> None:
    """`repeats` rounds, every run of `runs` ({name: generate}) on every workload in turn;
    round 0 is warmup unless it is the only one. New prompts for every run (`run_seed`).
    `after(workload, name, kept)`, if given, runs after each timed run, outside its time."""
    for rnd in range(repeats):
        for i, (w, shape) in enumerate(workloads.items()):
            for v, (name, gen) in enumerate(runs.items()):
                value = timed(gen, shape, seed=run_seed(phase, rnd, i, v))
                print(f"round {rnd} {w:14s} {name:40s} {value:10.2f}", flush=True)
                kept = rnd > 0 or repeats == 1
                if kept:
                    results.setdefault((w, name), []).append(value)
                if after is not None:
                    after(w, name, kept)
        report()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--out", default="bench_parallel.md")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import vllm
    from vllm import LLM

    from tapc import VLLM

    config, workloads, settings, side_by_side = SHAPES[args.shape]
    model = tempfile.mkdtemp(prefix=f"llama-3.1-{args.shape}-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    common = dict(ENGINE, **settings, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"))
    results: dict[tuple[str, str], list[float]] = {}

    def report() -> None:
        lines = [f"# bench_parallel: {args.shape} shape, TP={TP} on {torch.cuda.device_count()} x "
                 f"{torch.cuda.get_device_name()}, vLLM {vllm.__version__}, torch {torch.__version__}, "
                 f"Python {platform.python_version()}", "",
                 f"Llama-3.1-{args.shape.upper()} shape, dummy weights, bf16; medians of {max(1, args.repeats - 1)} "
                 f"rounds; engines {'side by side, runs interleaved' if side_by_side else 'one after the other'}. "
                 "Decode: output tok/s (higher is better); ratios to vanilla TP=2.", ""]
        write_table(lines, results, workloads, args.out)

    def tapped_runs(engine) -> dict:
        return {name: (lambda ps, sp, ask=ask: engine.generate(ps, sp, taps=ask, use_tqdm=False))
                for name, ask in variants(args.shape, config["hidden_size"]).items()}

    vanilla = started("vanilla", lambda: LLM(model, **common))
    vanilla_run = {"vanilla": lambda ps, sp, llm=vanilla: llm.generate(ps, sp, use_tqdm=False)}
    if side_by_side:
        tapped = started("tapc", lambda: VLLM(model, taps=taps_for(args.shape), **common))
        rounds(workloads, {**vanilla_run, **tapped_runs(tapped)}, args.repeats, results, report)
    else:
        rounds(workloads, vanilla_run, args.repeats, results, report)
        vanilla.llm_engine.engine_core.shutdown()
        del vanilla, vanilla_run
        gc.collect()
        tapped = started("tapc", lambda: VLLM(model, taps=taps_for(args.shape), **common))
        rounds(workloads, tapped_runs(tapped), args.repeats, results, report)
    # the shape names the workload: both shapes decode at "bs1"
    record.append_compared("bench_parallel.py", {(f"{args.shape} {w}", v): r for (w, v), r in results.items()},
                           [f"{args.shape} {w}" for w in workloads], "tok/s", args.out)


if __name__ == "__main__":
    main()
