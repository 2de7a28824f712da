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

Beside them (`--peers`, both by default), the same sweep as users write it without tapc, on
HF transformers' model of the same shape in bf16 (random weights, std 0.02): `hf`, forward
hooks on a batch of 32 copies of each prompt, copy i patched at layer i; `nnsight` (0.8.1), the
same batch in one `trace` that sets each layer's output row. Both keep the last position's
logits only and take its greedy token, as the engines do.
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
import record

PEERS = ("hf", "nnsight")


def hf_model(config: dict):
    """HF transformers' model of `config` on the GPU in bf16, randomly initialized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def hf_sweep(model, corrupted, clean, subject: int) -> torch.Tensor:
    """One forward a prompt over 32 copies of it; a hook at layer i writes the clean row into
    copy i at the subject. Greedy tokens [prompts, layers]."""
    layers = model.model.layers
    out = []
    for ids, row in zip(corrupted, clean):
        def patch(i):
            def hook(module, args, output):
                (output[0] if isinstance(output, tuple) else output)[i, subject] = row
            return hook
        hooks = [layer.register_forward_hook(patch(i)) for i, layer in enumerate(layers)]
        try:
            with torch.no_grad():
                logits = model(ids.expand(len(layers), -1), logits_to_keep=1).logits[:, -1]
        finally:
            for h in hooks:
                h.remove()
        out.append(logits.argmax(-1).cpu())
    return torch.stack(out)


def nnsight_sweep(traced, corrupted, clean, subject: int) -> torch.Tensor:
    """The same as `hf_sweep`, written with nnsight: each layer's output row set in the trace."""
    layers = traced.model.layers
    out = []
    for ids, row in zip(corrupted, clean):
        with traced.trace(ids.expand(len(layers), -1), logits_to_keep=1):
            for i in range(len(layers)):
                layers[i].output[i, subject] = row
            tokens = traced.output.logits[:, -1].argmax(-1).save()
        out.append(tokens.cpu())
    return torch.stack(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--subject", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                    help="the same sweep without tapc: HF transformers' hooks, nnsight")
    ap.add_argument("--out", default="bench_tracing.md")
    args = ap.parse_args()
    if "nnsight" in args.peers:
        try:
            from nnsight import NNsight
        except ImportError:
            ap.error("nnsight is not installed (pip install nnsight==0.8.1), or leave it out: --peers hf")
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm
    from vllm import LLM, SamplingParams

    from tapc import VLLM, TapRequest

    layers, hidden = LLAMA_31_8B["num_hidden_layers"], LLAMA_31_8B["hidden_size"]
    model = tempfile.mkdtemp(prefix="8b-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f)
    # HF's model (16 GB) shares the GPU with both engines where peers run
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"),
                  gpu_memory_utilization=0.3 if args.peers else 0.4, enable_prefix_caching=False)
    taps = [f"model.layers.{i}.resid | patch(clean{i})" for i in range(layers)]
    engines = {"vanilla": LLM(model, **common),
               f"tapc, {layers} patch taps, one bound a request": VLLM(model, taps=taps, **common)}
    peers = {}
    if args.peers:
        model_hf = hf_model(LLAMA_31_8B)
        if "hf" in args.peers:
            peers["HF transformers, forward hooks, 32 copies a forward"] = lambda c, r: hf_sweep(model_hf, c, r, args.subject)
        if "nnsight" in args.peers:
            traced = NNsight(model_hf)
            peers["nnsight 0.8.1, one trace a prompt, 32 copies"] = lambda c, r: nnsight_sweep(traced, c, r, args.subject)
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
        ids = torch.tensor(corrupted, device="cuda")
        rows = torch.from_numpy(clean).to("cuda", torch.bfloat16)
        for label, sweep in peers.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = sweep(ids, rows)
            value = len(prompts) / (time.perf_counter() - t0)
            assert tokens.shape == (args.prompts, layers)
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
    record.append_compared("bench_tracing.py", results, [workload], "requests/s", args.out)


if __name__ == "__main__":
    main()
