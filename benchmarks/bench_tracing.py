"""A causal-tracing sweep as a workload: restore one clean residual row, one layer per request.

    python3 benchmarks/bench_tracing.py [--prompts 256] [--length 64] --out bench_tracing.md

Llama-3.1-8B shape, dummy weights, one GPU. For each of `--prompts` corrupted prompts and each
of the 32 layers, one request restores the clean run's residual row at the subject's position
at that layer (docs/blocks.md "Activation patching": 32 taps `model.layers.i.resid |
patch(clean_i)`, each request binding one layer's row): 8,192 patched prefill
requests at the defaults, one generated token each. Vanilla vLLM runs the same 8,192 prompts
unpatched. Prefix caching is off in both engines: the sweep repeats each prompt 32 times, and
vanilla would read 31 of them from the cache that the patched requests (whose KV is their own)
cannot. Requests per second, rounds interleaved, the first discarded as warmup.
"""
import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np
import torch
from bench_engine import ENGINE, LLAMA_31_8B, write_table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--subject", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    ap.add_argument("--out", default="bench_tracing.md")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm
    from vllm import LLM, SamplingParams

    from tapc import VLLM, TapRequest

    layers, hidden = LLAMA_31_8B["num_hidden_layers"], LLAMA_31_8B["hidden_size"]
    model = tempfile.mkdtemp(prefix="8b-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f)
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"), gpu_memory_utilization=0.4,
                  enable_prefix_caching=False)
    taps = [f"model.layers.{i}.resid | patch(clean{i})" for i in range(layers)]
    engines = {"vanilla": LLM(model, **common),
               f"tapc, {layers} patch taps, one bound a request": VLLM(model, taps=taps, **common)}
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    workload = f"sweep {args.prompts}x{layers}"
    results: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.repeats):
        rng = np.random.default_rng(rnd)
        corrupted = [rng.integers(0, 128000, args.length).tolist() for _ in range(args.prompts)]
        prompts = [{"prompt_token_ids": p} for p in corrupted for _ in range(layers)]
        clean = rng.standard_normal((args.prompts, hidden)).astype(np.float32)   # the clean run's rows
        asks = [TapRequest(params={f"clean{i}": {"positions": [args.subject], "rows": clean[p][None]}})
                for p in range(args.prompts) for i in range(layers)]
        for label, llm in engines.items():
            extra = {} if label == "vanilla" else {"taps": asks}
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False, **extra)
            value = len(prompts) / (time.perf_counter() - t0)
            failed = [o.error for o in outs if getattr(o, "error", None) is not None]
            assert not failed, f"{len(failed)} requests failed: {failed[0]}"
            print(f"round {rnd} {label:50s} {value:10.1f} requests/s", flush=True)
            if rnd > 0 or args.repeats == 1:
                results.setdefault((workload, label), []).append(value)
        if results:
            rounds = len(next(iter(results.values())))
            head = [f"# bench_tracing: {torch.cuda.get_device_name()}, vLLM {vllm.__version__}, "
                    f"torch {torch.__version__}, Python {platform.python_version()}", "",
                    f"Llama-3.1-8B shape, dummy weights, bf16, prefix caching off; {len(prompts)} prefill requests "
                    f"of {args.length} tokens, one restored row each; requests/s, medians of {rounds} rounds.", ""]
            write_table(head, results, [workload], args.out, unit="requests/s")


if __name__ == "__main__":
    main()
