"""tapc on a mixture-of-experts model beside vanilla vLLM, and vLLM's V1 runner beside V2.

    python3 benchmarks/bench_moe.py --out bench_moe.md            # about 15 minutes on an H200
    python3 benchmarks/bench_moe.py --quick --out bench_moe.md    # a smoke run, a few minutes

One process, one GPU; needs vLLM's MoE kernels (the GPU bundle with TAPC_GPU_MOE=1). Dummy
weights (`load_format="dummy"`), greedy, ignore_eos, token-id prompts; engines of one phase run
side by side and their runs are interleaved, `--repeats` rounds, the first discarded as warmup;
the table shows medians and each variant's ratio to vanilla vLLM in the same phase. A second
table gives tapc's own host time a step on the engine thread (its hooks' timers, read through
`tapc_host_time` between runs, outside their time), summed over the kept rounds.

Phase `moe`: Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of width 768, top 8, renormalized), `--layers` of its 48 layers (24 by default, so
that a vanilla and a tapped engine fit on one H200 together: the ratio is per layer's work).
vLLM runs MoE models on its V1 runner. Decode at batch 1 and 64 (`--batches`; 512 prompt tokens, 128
generated, `--generate` to change; output tokens/s). tapc variants on one engine: nothing asked; every layer's residual
stream at every position; every layer's router (the gate's logits, the chosen experts and their
weights) at every position; both; both at the last prompt position only, which replays the
tapped graph (tapc/worker/switch.py) at every decode step with no row to capture or copy out:
what its kernels and launches cost by themselves.

Phase `runners`: the Llama-3.1-8B shape (bench_engine.py's config) on vLLM's V2 runner (its
default for dense models) and on V1 (VLLM_USE_V2_MODEL_RUNNER=0), vanilla and tapped (every
layer's residual stream at every position), the same decode workloads: the cost of V1 itself
and of tapc on it. `--phases` picks some of the two.
"""
import argparse
import json
import os
import platform
import tempfile

from bench_engine import LLAMA_31_8B, started, write_table
from bench_parallel import rounds
import record

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "hidden_act": "silu", "hidden_size": 2048, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
    "num_hidden_layers": 48, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
RESID = "model.layers.*.resid"
ROUTER = ["model.layers.*.mlp.gate.output", "model.layers.*.mlp.experts.router.output"]
PHASES = ("moe", "runners")
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, max_num_batched_tokens=8192,
              max_num_seqs=128, seed=0)


def workloads(quick: bool, generate: int = 128, batches=(1, 64)) -> dict[str, tuple[int, int, int]]:
    """name: (prompts, prompt tokens, generated tokens)."""
    prompt, generate = (64, 32) if quick else (512, generate)
    return {f"decode bs{n}": (n, prompt, generate) for n in batches}


def model_dir(config: dict, layers: int | None = None) -> str:
    path = tempfile.mkdtemp(prefix=f"{config['model_type']}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config, num_hidden_layers=layers or config["num_hidden_layers"]), f)
    return path


class HookTimes:
    """tapc's hooks' host time a step for each (workload, variant) on a tapped engine: the
    difference of the worker's `tapc_host_time` readings around each run (the runs of one
    engine's variants follow one another, so the reading after one run is the next's start)."""

    def __init__(self):
        self.last: dict[int, dict] = {}
        self.sums: dict[tuple[str, str], dict[str, float]] = {}
        self.engines: dict[str, object] = {}   # variant -> its tapped engine

    @staticmethod
    def read(engine) -> dict[str, float]:
        return engine.llm.collective_rpc("tapc_host_time")[0]

    def start(self, variant: str, engine) -> None:
        self.engines[variant] = engine
        self.last.setdefault(id(engine), self.read(engine))

    def __call__(self, workload: str, variant: str, kept: bool) -> None:
        engine = self.engines.get(variant)
        if engine is None:
            return
        now, before = self.read(engine), self.last[id(engine)]
        self.last[id(engine)] = now
        if kept:
            acc = self.sums.setdefault((workload, variant), {})
            for k, v in now.items():
                acc[k] = acc.get(k, 0.0) + v - before[k]

    def table(self) -> list[str]:
        lines = ["tapc's hooks on the engine thread, us a step (sums over the kept rounds' runs)", "",
                 "| workload | variant | steps | schedule | begin_step | end_step | all hooks |",
                 "|---|---|---:|---:|---:|---:|---:|"]
        for (w, name), acc in self.sums.items():
            steps = max(acc["steps"], 1)
            per = {k: acc[f"{k}_s"] / steps * 1e6 for k in ("schedule", "begin_step", "end_step")}
            lines.append(f"| {w} | {name} | {acc['steps']:.0f} | {per['schedule']:.1f} | {per['begin_step']:.1f} | "
                         f"{per['end_step']:.1f} | {sum(per.values()):.1f} |")
        return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_moe.md")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the first is warmup")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers of the Qwen3-30B-A3B shape (48: all)")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--generate", type=int, default=128,
                    help="tokens each request generates (longer runs: less of bs1's round-to-round spread)")
    ap.add_argument("--batches", default="1,64", metavar="N,N",
                    help="decode batch sizes (one alone: more rounds of it in a call's time)")
    ap.add_argument("--quick", action="store_true", help="short prompts and outputs, 4 MoE and 8 Llama layers, "
                                                         "2 rounds: checks the script end to end")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import sys

    import torch
    import vllm
    from vllm import LLM

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from gpu_engines import model_runner, shutdown   # the tests' runner switch and engine stop

    from tapc import VLLM
    from tapc import TapRequest

    repeats = 2 if args.quick else args.repeats
    shapes = workloads(args.quick, args.generate, [int(n) for n in args.batches.split(",")])
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"))
    results: dict[tuple[str, str], list[float]] = {}
    names = []
    hooks = HookTimes()

    def report() -> None:
        head = [f"# bench_moe: {torch.cuda.get_device_name()}, vLLM {vllm.__version__}, torch {torch.__version__}, "
                f"Python {platform.python_version()}", "",
                f"Dummy weights, bf16; medians of {max(1, repeats - 1)} rounds{' (--quick)' if args.quick else ''}. "
                "Output tok/s (higher is better); ratio to vanilla vLLM of the same phase and workload.", "",
                *names, ""]
        write_table(head, results, [w for w in dict.fromkeys(w for w, _ in results)], args.out)
        if hooks.sums:
            text = "\n".join(["", *hooks.table()]) + "\n"
            print(text)
            with open(args.out, "a") as f:
                f.write(text)

    def generating(engine, ask=None):
        if ask is None and not isinstance(engine, VLLM):
            return lambda ps, sp: engine.generate(ps, sp, use_tqdm=False)
        return lambda ps, sp: engine.generate(ps, sp, taps=ask, use_tqdm=False)

    if "moe" in args.phases:
        layers = 4 if args.quick else args.layers
        names.append(f"moe: Qwen3-30B-A3B shape, {layers} of 48 layers, V1 runner (vLLM's choice for MoE)")
        path = model_dir(QWEN3_30B_A3B, layers)
        vanilla = started("vanilla MoE", lambda: LLM(path, gpu_memory_utilization=0.45, **common))
        tapped = started("tapc MoE", lambda: VLLM(path, taps=[RESID, *ROUTER], gpu_memory_utilization=0.45, **common))
        variants = {"vanilla": generating(vanilla), "tapc, nothing asked": generating(tapped, None),
                    f"tapc, residual {layers} layers": generating(tapped, TapRequest(capture=RESID)),
                    f"tapc, router {layers} layers": generating(tapped, TapRequest(capture=ROUTER)),
                    f"tapc, residual + router {layers} layers": generating(tapped, TapRequest(capture="*")),
                    # the tapped graph with no decode row to capture: its kernels' and launches' own cost
                    "tapc, residual + router, last prompt position": generating(
                        tapped, TapRequest(capture="*", positions="last"))}
        for name in variants:
            if name.startswith("tapc"):
                hooks.start(name, tapped)
        rounds({f"moe {w}": v for w, v in shapes.items()}, variants, repeats, results, report, phase=1, after=hooks)
        for engine in (vanilla, tapped):
            shutdown(engine)
        torch.cuda.empty_cache()

    if "runners" in args.phases:
        layers = 8 if args.quick else LLAMA_31_8B["num_hidden_layers"]
        names.append(f"runners: Llama-3.1-8B shape, {layers} of 32 layers, vLLM's V2 runner and V1 "
                     "(VLLM_USE_V2_MODEL_RUNNER=0)")
        path = model_dir(LLAMA_31_8B, layers)
        engines = {}
        for runner in ("v2", "v1"):
            with model_runner(runner):
                engines[f"vanilla {runner}"] = started(f"vanilla {runner}", lambda: LLM(
                    path, gpu_memory_utilization=0.2, **common))
                engines[f"tapc {runner}"] = started(f"tapc {runner}", lambda: VLLM(
                    path, taps=[RESID], gpu_memory_utilization=0.2, **common))
        variants = {"vanilla": generating(engines["vanilla v2"]), "vanilla V1": generating(engines["vanilla v1"])}
        for runner in ("v2", "v1"):
            variants[f"tapc {runner.upper()}, residual {layers} layers"] = generating(
                engines[f"tapc {runner}"], TapRequest(capture=RESID))
        for runner in ("v2", "v1"):
            hooks.start(f"tapc {runner.upper()}, residual {layers} layers", engines[f"tapc {runner}"])
        rounds({f"llama {w}": v for w, v in shapes.items()}, variants, repeats, results, report, phase=2, after=hooks)
        for engine in engines.values():
            shutdown(engine)
    report()
    record.append_compared("bench_moe.py", results, dict.fromkeys(w for w, _ in results), "tok/s", args.out)


if __name__ == "__main__":
    main()
