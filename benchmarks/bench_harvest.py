"""`tapc.harvest.run.harvest` to local disk beside vanilla `LLM.generate` on the same prompts.

    python3 benchmarks/bench_harvest.py --out bench_harvest.md          # 8192x128 and 1024x1024
    python3 benchmarks/bench_harvest.py --quick                         # 1024x128 and 128x1024, 1 layer

One process, one GPU, three engines side by side: vanilla vLLM, a tapc engine capturing one
layer's residual stream (layer 16) and one capturing four (layers 4, 12, 20, 28). Llama-3.1-8B
shape with dummy weights (`load_format="dummy"`), token-id prompts, one greedy token each; the
harvest writes every prompt row (positions="prompt") to safetensors shards under `--dir`
(local disk, not /dev/shm), removed after each run. Runs are interleaved, `--repeats` rounds
after one warmup round; the table shows medians, the ratio is harvest time / vanilla time.
`--workloads 8192x128` picks some; `TAPC_ATTENTION_BACKEND` picks the attention backend.
`--ray` adds a row per workload, the same harvest over Ray (`tapc.harvest.cluster.harvest_ray`, as
`tapc harvest --ray` runs it): a Ray on this host, a Ray Data pool of one actor holding its own
1-layer engine, the prompts in parts of `--part-prompts`; its tokens/s over the parts after the
first, timed in the actor (its engine's start and first part left out, as the warm engines'
start is), against the in-process harvest's. The Ray engine is started anew each round, beside the others.
`--profile MD` adds, after the measured rounds, one watched run of vanilla and of each harvest on
the first workload: the Python stacks of every thread of the caller (feed, writer, its column
threads) and of the engine-core process, and the GPU's own kernel time (CUPTI), written to MD.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import ENGINE, LLAMA_31_8B  # noqa: E402
import record  # noqa: E402

LAYERS = {1: ["model.layers.16.resid"], 4: [f"model.layers.{i}.resid" for i in (4, 12, 20, 28)]}
FULL = ["8192x128", "1024x1024"]
QUICK = ["1024x128", "128x1024"]


def prompts(workload: str, seed: int) -> list[list[int]]:
    n, length = map(int, workload.split("x"))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128000, length).tolist() for _ in range(n)]


def vanilla_run(llm, ps) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert len(outs) == len(ps)
    return dt


def harvest_run(llm, ps, root: str) -> tuple[float, float]:
    """(seconds, GB written) of one harvest into a fresh folder under `root`."""
    from vllm import SamplingParams

    from tapc.harvest.run import harvest

    out = tempfile.mkdtemp(prefix="harvest-", dir=root)
    try:
        t0 = time.perf_counter()
        m = harvest(llm, ps, out, positions="prompt", shard_tokens=1_000_000, progress=False,
                    sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        dt = time.perf_counter() - t0
        assert not m.failed and m.rows == sum(map(len, ps)), (m.rows, m.failed[:3])
        gb = sum(os.path.getsize(os.path.join(out, s.file)) for s in m.shards) / 1e9
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return dt, gb


def ray_run(model: str, engine_args: dict, ps, root: str, part_prompts: int) -> tuple[float, int, float]:
    """(seconds end to end, rows of the parts after the first, the seconds the actor took for
    them) of one harvest over Ray into a fresh folder. The actor's own seconds, not the times the
    driver sees the parts' rows come back: Ray Data hands those on late and unevenly."""
    import ray
    import torch
    from vllm import SamplingParams

    from tapc.harvest.cluster import harvest_ray
    from tapc.harvest.engines import ModelEngine

    engine = ModelEngine(model, tuple(LAYERS[1]), engine_args)
    out = tempfile.mkdtemp(prefix="harvest-ray-", dir=root)
    parts = []
    free = torch.cuda.mem_get_info()[0]
    try:
        t0 = time.perf_counter()
        m = harvest_ray(engine, ray.data.from_items([{"prompt": p} for p in ps]), out, engines=1,
                        part_prompts=part_prompts, positions="prompt", shard_tokens=1_000_000,
                        sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                        on_part=lambda row: parts.append((row["rows"], row["seconds"])))
        dt = time.perf_counter() - t0
        assert not m.failed and m.rows == sum(map(len, ps)) and len(parts) > 1, (m.rows, m.failed[:3], len(parts))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    # the pool's actor ends once the dataset is done, and its engine's processes with it: wait for
    # its GPU memory, which the next round's engine needs
    deadline = time.monotonic() + 120
    while torch.cuda.mem_get_info()[0] < free - (2 << 30) and time.monotonic() < deadline:
        time.sleep(1)
    later = parts[1:]
    return dt, sum(r for r, _ in later), sum(s for _, s in later)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"smaller workloads ({', '.join(QUICK)}), one round, the 1-layer engine only (2 engines to start)")
    ap.add_argument("--workloads", nargs="*", default=None, help=f"NxLEN prompt sets (default {' '.join(FULL)})")
    ap.add_argument("--layers", nargs="*", type=int, default=None, choices=[1, 4], help="default: 1 and 4")
    ap.add_argument("--repeats", type=int, default=2, help="measured rounds after the warmup (default 2)")
    ap.add_argument("--dir", default="/tmp/tapc-bench-harvest", help="where shards are written (local disk)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--profile", default=None, metavar="MD",
                    help="after the rounds, one watched run per engine on the first workload; its report to MD")
    ap.add_argument("--ray", action="store_true", help="also the 1-layer harvest over a Ray of this host (above)")
    ap.add_argument("--part-prompts", type=int, default=1024, help="with --ray: prompts a part (default 1024)")
    ap.add_argument("--no-vanilla", action="store_true", help="with --ray: no vanilla engine (the Ray row's "
                    "reference is the in-process harvest)")
    args = ap.parse_args()
    workloads = args.workloads or (QUICK if args.quick else FULL)
    repeats = 1 if args.quick else args.repeats
    args.layers = args.layers or ([1] if args.quick else [1, 4])
    if args.ray and 1 not in args.layers:
        args.layers.insert(0, 1)   # the Ray row's reference

    if args.profile:   # the samplers reach the engine core through collective_rpc, as functions
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    from tapc.api.llm import VLLM

    os.makedirs(args.dir, exist_ok=True)
    model = tempfile.mkdtemp(prefix="llama-3.1-8b-shape-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f)
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"), gpu_memory_utilization=0.28)
    engines = {} if args.no_vanilla else {"vanilla": LLM(model, **common)}
    for n in args.layers:
        engines[n] = VLLM(model, taps=LAYERS[n], **common)
    if args.ray:   # a Ray of this host, its one GPU for the pool's actor (whose engine shares it with these)
        import ray

        ray.init(num_gpus=1, object_store_memory=2 << 30)

    times: dict = {}

    def report() -> None:
        """The table so far (printed, and written to --out): a run cut short keeps its rounds."""
        lines = ["| workload | layers | vanilla s | harvest s | ratio | GB written | GB/s |",
                 "|---|---|---|---|---|---|---|"]
        for w in workloads:
            if (w, "vanilla") not in times:
                continue
            van = statistics.median(times[(w, "vanilla")])
            for n in args.layers:
                if (w, n) in times:
                    dt = statistics.median(t for t, _ in times[(w, n)])
                    gb = times[(w, n)][0][1]
                    lines.append(f"| {w} | {n} | {van:.2f} | {dt:.2f} | {dt / van:.3f} | {gb:.2f} | {gb / dt:.2f} |")
        if args.ray:
            lines += ["", "| workload | in-process harvest tok/s | Ray harvest tok/s (the actor's parts after the "
                      "first) | ratio | Ray s end to end (its engine's start included) |", "|---|---|---|---|---|"]
            for w in workloads:
                if (w, "ray") in times and (w, 1) in times:
                    n, length = map(int, w.split("x"))
                    own = statistics.median(n * length / t for t, _ in times[(w, 1)])
                    rate = statistics.median(r / s for _, r, s in times[(w, "ray")])
                    wall = statistics.median(t for t, _, _ in times[(w, "ray")])
                    lines.append(f"| {w} | {own:,.0f} | {rate:,.0f} | {rate / own:.3f} | {wall:.1f} |")
        table = "\n".join(lines)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"bench_harvest: {', '.join(workloads)}; medians of {repeats} round(s)\n\n{table}\n")

    for rnd in range(repeats + 1):   # round 0 warms every engine up on every workload
        for w in workloads:
            ps = prompts(w, seed=rnd)
            if not args.no_vanilla:
                dt = vanilla_run(engines["vanilla"], ps)
                print(f"round {rnd} {w} vanilla {dt:.2f} s", file=sys.stderr, flush=True)
                if rnd:
                    times.setdefault((w, "vanilla"), []).append(dt)
            for n in args.layers:
                dt, gb = harvest_run(engines[n], ps, args.dir)
                print(f"round {rnd} {w} {n} layer(s) {dt:.2f} s, {gb:.2f} GB", file=sys.stderr, flush=True)
                if rnd:
                    times.setdefault((w, n), []).append((dt, gb))
            if args.ray and rnd:   # each Ray round starts its actor's engine: no warmup round for it
                got = ray_run(model, common, ps, args.dir, args.part_prompts)
                print(f"round {rnd} {w} ray {got[0]:.2f} s end to end, the parts after the first {got[1]} rows in "
                      f"{got[2]:.2f} s", file=sys.stderr, flush=True)
                times.setdefault((w, "ray"), []).append(got)
        if rnd:
            report()
    if not args.no_vanilla:   # (the Ray row's reference is the in-process harvest, not vanilla)
        seconds = {(w, "vanilla"): times[(w, "vanilla")] for w in workloads if (w, "vanilla") in times}
        seconds.update({(w, f"harvest, {n} layer{'s' if n > 1 else ''}"): [t for t, _ in times[(w, n)]]
                        for w in workloads for n in args.layers if (w, n) in times})
        record.append_compared("bench_harvest.py", seconds, workloads, "s", args.out)
    if args.profile:
        profile(engines, prompts(workloads[0], seed=repeats + 1), args.dir, args.profile, workloads[0])
    shutil.rmtree(model, ignore_errors=True)


class Waits:
    """Where the harvest's pipeline stalls: the feed waiting for room in the window with the
    engine idle (`Window.wait`: the writer is behind), the feed waiting for room in the
    writer's queue (`Writer.put`), and the writer's tail once the engine is done
    (`Writer.close`); calls and seconds of each."""

    def __init__(self):
        from profile_step import timed

        from tapc.harvest.feed import Window
        from tapc.harvest.writer import Writer

        self.spent = {}
        self.own = [(Window, "wait", Window.wait), (Writer, "put", Writer.put), (Writer, "close", Writer.close)]
        for cls, attr, fn in self.own:
            spent = self.spent[f"{cls.__name__}.{attr}"] = [0, 0.0]
            setattr(cls, attr, timed(spent, fn))

    def stop(self) -> None:
        for cls, attr, fn in self.own:
            setattr(cls, attr, fn)

    def report(self) -> list[str]:
        return ["| the feed waited in | calls | s |", "|---|---:|---:|",
                *[f"| `{k}` | {n} | {s:.2f} |" for k, (n, s) in self.spent.items()], ""]


def profile(engines: dict, ps, root: str, out: str, workload: str, interval: float = 2e-3) -> None:
    """One run per engine with samplers in the caller and in the engine-core process (profile_step's)."""
    import cloudpickle

    import profile_step
    import stacks

    cloudpickle.register_pickle_by_value(profile_step)
    cloudpickle.register_pickle_by_value(stacks)
    lines = [f"# bench_harvest profile: {workload}, a sample every {interval * 1e3:.0f} ms", "",
             "| engine | wall s | GPU kernels s | GPU copies s |", "|---|---:|---:|---:|"]
    details = []
    for name, llm in engines.items():
        inner = getattr(llm, "llm", llm)
        waits = Waits()
        inner.collective_rpc(profile_step._start_sampler, args=(interval,))
        here = stacks.Sampler(interval)
        print(f"profile {name}: starts at {time.time():.0f}", file=sys.stderr, flush=True)
        dt = vanilla_run(llm, ps) if name == "vanilla" else harvest_run(llm, ps, root)[0]
        caller = here.stop()
        core = inner.collective_rpc(profile_step._stop_sampler)[0]
        waits.stop()
        dev = core["device"]
        lines.append(f"| {name} | {dt:.2f} | {dev['kernels_ms'] / 1e3:.2f} | {dev['copies_ms'] / 1e3:.2f} |")
        label = name if name == "vanilla" else f"harvest, {name} layer(s)"
        details += [f"## {label}", ""]
        if name != "vanilla":
            details += waits.report()
        for where, threads in (("engine-core process", core["threads"]), ("caller's process", caller)):
            details += [f"### {where}", ""]
            for tname, got in list(threads.items())[:8]:
                details += stacks.report_thread(tname, got)
    with open(out, "w") as f:
        f.write("\n".join(lines + [""] + details) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
