"""Where decode's host time goes: a sampling profile of vLLM's engine-core process and of the
caller's while one engine decodes, for vanilla vLLM and tapc variants, with tok/s beside.

    python3 benchmarks/profile_step.py --shape moe --out profile_moe.md            # V1 runner
    python3 benchmarks/profile_step.py --shape 8b --runner v1 --out profile_8b.md
    python3 benchmarks/profile_step.py --shape 8b --tp 2 --batch 64 --generate 256 --out profile_tp2.md
    python3 benchmarks/profile_step.py --shape 8b --ablate --batch 64 --generate 256 --out profile_po.md
    python3 benchmarks/profile_step.py --shape 8b --probe --out profile_probe.md   # bench_blocks' compiled probe

At batch 1 a decode step takes a few milliseconds of GPU time, and vLLM prepares the next step on
the host meanwhile; host work added per step (tapc's table fill, copies, bookkeeping) shows in
tok/s only once the host is the slower of the two. This says which functions take that time.

Per variant: an untimed `generate`, a timed one with nothing watching (tok/s), then a profiled
one: a thread in each process reads every other thread's Python stack (`sys._current_frames`)
every `--interval` ms. That thread takes the GIL whenever the main thread lets it go, which is
in calls into CUDA and torch: the time it holds the GIL is charged to those calls, so read
their shares as upper bounds, and the tok/s of the unwatched run as the speed.
Reported per variant and thread: samples, the functions most often on the stack (inclusive),
tapc's functions apart, and the most frequent innermost frames; and for the tapped engine, the
wall time per call of tapc's per-step hooks in each worker (`schedule`, `begin_step`,
`end_step`, and within `end_step` the copy-out and its one driver call), timed in the unwatched
run, where no sampler takes the GIL from them; and the GPU's own kernel and copy time per step (CUPTI, through torch's profiler) beside the wall
time per step, which says which side bounds the step, and for each tapc variant the kernels whose GPU
time a step differs most from vanilla's. A thread waiting (on a queue, a socket)
is sampled too: its innermost frame says so; one waiting inside a CUDA call looks busy. Same engines, prompts and
workload as benchmarks/bench_moe.py (Qwen3-30B-A3B shape, dummy weights) or bench_engine.py
(Llama-3.1-8B shape).

The engine-core side runs through `collective_rpc` with this module's functions, sent by value:
VLLM_ALLOW_INSECURE_SERIALIZATION=1 is set for that. The entry point is guarded: vLLM spawns
its processes, which import this file again.
"""
import argparse
import gc
import os
import platform
import sys
import time

from bench_engine import ABLATE_TAPS, LLAMA_31_8B, ablation, prompts, started
from bench_moe import ENGINE, QWEN3_30B_A3B, RESID, ROUTER, model_dir
from devicetime import DeviceTimer, differing, totals
from stacks import Sampler, report_thread

KERNELS_SHOWN = 12   # a tapped variant's kernels, against vanilla's


def timed(spent: list, fn):
    """`fn`, counting its calls and seconds into `spent` ([calls, seconds]). Where `spent` has a
    third item, a list, each call's (wall, thread CPU) seconds are appended to it: a call whose
    wall time is well over its CPU time waited (for the GIL, a blocking driver call, the OS)."""
    samples = spent[2] if len(spent) > 2 else None

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        c0 = time.thread_time() if samples is not None else 0.0
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            spent[0] += 1
            spent[1] += dt
            if samples is not None:
                samples.append((dt, time.thread_time() - c0))
    return call


def spread(samples: list[tuple[float, float]]) -> dict:
    """Per-call us: mean, median and 90th percentile of the wall time, mean thread CPU time, and
    the share of calls that waited more than 20 us (wall over CPU)."""
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "cpu": 0.0, "waited": 0.0}
    wall = sorted(w for w, _ in samples)
    return {"p50": wall[len(wall) // 2] * 1e6, "p90": wall[int(len(wall) * 0.9)] * 1e6,
            "cpu": sum(c for _, c in samples) / len(samples) * 1e6,
            "waited": sum(w - c > 20e-6 for w, c in samples) / len(samples)}


class HookTimer:
    """Wall time and calls of tapc's per-step hooks (runner.py `RunnerHooks`) in a worker, by
    wrapping the bound methods the runner adapter calls, and of `end_step`'s parts: the copy-out
    (copyout.py `copy_out`), its direct path (`_copy_direct`, small steps), the segments' copies
    (segmentcopy.py `copy_segments`: the host's address lists and the driver call) and the batched
    driver copy itself (memcpy.py `BatchCopy`), the step's event (`_recorded`, or the driver's,
    `DriverEvents.record`) and the table's upload (`upload`); what copy-out spends outside them is
    its stream calls. Each call's wall and CPU time are kept (`spread`): a part whose wall time is
    well over its CPU time waits, for the GIL or in the driver. `stop` puts them back."""

    HOOKS = ("schedule", "begin_step", "end_step")

    def __init__(self, hooks):
        import tapc.worker.copyout as copyout_module
        from tapc.worker.tables import StepTables

        self.spent = {}
        self.tables = tables = hooks.component(StepTables)
        out = tables.copy_out
        wrapped = [(hooks, name) for name in self.HOOKS] + [(out, "copy_out"), (out, "_copy_direct"),
                                                            (copyout_module, "copy_segments"), (out, "_recorded"),
                                                            (tables.buffers, "upload")]
        for part in ("_batch", "_events"):
            if getattr(out, part, None) is not None:
                wrapped.append((out, part) if part == "_batch" else (out._events, "record"))
        # what each object held under the name itself (None: the name was its class's method)
        self.own = [(obj, name, obj.__dict__.get(name)) for obj, name in wrapped]
        for obj, name in wrapped:
            self.spent[name] = [0, 0.0, []]
            setattr(obj, name, timed(self.spent[name], getattr(obj, name)))
        # steps that repeated the last decode step (rings.py `Repeat`: no fill, no upload)
        self.repeated, repeat = 0, tables._repeat
        advance = repeat.advance

        def counted(computed):
            self.repeated += 1
            return advance(computed)
        repeat.advance = counted
        # the worker process's garbage collections meanwhile (vLLM freezes its startup heap; what
        # tapc allocates per step and per request is not frozen)
        self.gc = {g: [0, 0.0] for g in range(3)}
        self._gc_start = 0.0
        gc.callbacks.append(self._gc_seen)

    def _gc_seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            spent = self.gc[info["generation"]]
            spent[0] += 1
            spent[1] += time.perf_counter() - self._gc_start


    def stop(self) -> dict:
        for obj, name, own in self.own:
            if own is None:
                del obj.__dict__[name]
            else:
                setattr(obj, name, own)
        del self.tables._repeat.__dict__["advance"]
        gc.callbacks.remove(self._gc_seen)
        out = {name: {"calls": n, "us_per_call": s / n * 1e6 if n else 0.0, **spread(samples)}
               for name, (n, s, samples) in self.spent.items()}
        out["begin_step"]["repeated"] = self.repeated
        for name, label in (("upload", "begin_step: upload"), ("_batch", "end_step: driver batch copy"),
                            ("copy_out", "end_step: copy_out"), ("_copy_direct", "end_step: copy_out, direct path"),
                            ("copy_segments", "end_step: copy_segments"), ("_recorded", "end_step: torch's event"),
                            ("record", "end_step: the driver's event")):
            if name in out:
                out[label] = out.pop(name)
        for g, (n, spent) in self.gc.items():
            out[f"worker process: gc of generation {g}"] = {"calls": n, "us_per_call": spent / n * 1e6 if n else 0.0}
        return out


def _start_hook_timer(worker) -> None:
    hooks = getattr(worker, "tapc", None)   # a tapped engine's worker (tapc/worker/worker.py)
    worker._tapc_timer = HookTimer(hooks) if hooks is not None else None


def _stop_hook_timer(worker) -> dict:
    timer = worker._tapc_timer
    return timer.stop() if timer is not None else {}


def _start_sampler(worker, interval: float) -> None:
    worker._tapc_sampler = Sampler(interval)
    worker._tapc_device = DeviceTimer()


def _stop_sampler(worker) -> dict:
    threads = worker._tapc_sampler.stop()   # first: the profiler's stop is not the step's work
    kernels = worker._tapc_device.stop()
    return {"threads": threads, "device": totals(kernels), "kernels": kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("moe", "8b"), default="moe")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (moe: 24 of 48; 8b: 32)")
    ap.add_argument("--runner", choices=("v1", "v2"), default=None, help="8b only (moe runs on V1)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of both engines (2: the 2-GPU kind)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--generate", type=int, default=1024, help="tokens per request: enough samples at batch 1")
    ap.add_argument("--interval", type=float, default=2.0, help="ms between samples")
    ap.add_argument("--threads", type=int, default=3, help="busiest threads reported per process")
    ap.add_argument("--ablate", action="store_true",
                    help="8b only: the tapped engine's plan is bench_engine's ablation (project_out on every "
                         "layer's residual stream); variants nothing asked and project_out")
    ap.add_argument("--probe", action="store_true",
                    help="8b only: the tapped engine runs bench_blocks.py's compiled probe on every layer's "
                         "residual stream; variants nothing asked and the probe's scores kept")
    ap.add_argument("--capture-sizes", default=None, metavar="N,N",
                    help="the batch sizes both engines capture CUDA graphs for (vLLM's cudagraph_capture_sizes; "
                         "default: vLLM's list, 35 sizes on the MoE shape): fewer graphs start each engine sooner")
    ap.add_argument("--out", default="profile_step.md")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import cloudpickle
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from gpu_engines import model_runner, shutdown

    from tapc import VLLM
    from tapc import TapRequest

    import stacks

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(stacks)
    common = dict(ENGINE, attention_backend=os.environ.get("TAPC_ATTENTION_BACKEND"), tensor_parallel_size=args.tp)
    if args.capture_sizes:
        common["compilation_config"] = {"cudagraph_capture_sizes": [int(n) for n in args.capture_sizes.split(",")]}
    functions = None
    if args.shape == "moe":
        layers = args.layers or 24
        path, taps, runner = model_dir(QWEN3_30B_A3B, layers), [RESID, *ROUTER], "v1"
        asks = {"tapc, nothing asked": None, "tapc, residual": TapRequest(capture=RESID),
                "tapc, router": TapRequest(capture=ROUTER), "tapc, residual + router": TapRequest(capture="*")}
    else:
        layers = args.layers or LLAMA_31_8B["num_hidden_layers"]
        path, runner = model_dir(LLAMA_31_8B, layers), args.runner or "v2"
        if args.ablate:
            taps = ABLATE_TAPS
            asks = {"tapc, nothing asked": None, **ablation(None, "decode")}   # bench_engine's request
        elif args.probe:
            import bench_blocks
            from bench_blocks import Probe

            cloudpickle.register_pickle_by_value(bench_blocks)   # the workers get the class itself
            taps, functions = [f"{RESID} | call(probe)"], {"probe": Probe(LLAMA_31_8B["hidden_size"])}
            asks = {"tapc, nothing asked": None, "tapc, probe scores kept": TapRequest(capture="*")}
        else:
            taps = [RESID]
            asks = {"tapc, nothing asked": None, "tapc, residual": TapRequest(capture=RESID)}
    with model_runner(runner):
        vanilla = started("vanilla", lambda: LLM(path, gpu_memory_utilization=0.42, **common))
        tapped = started("tapc", lambda: VLLM(path, taps=taps, gpu_memory_utilization=0.42, functions=functions,
                                               **common))
    sp = SamplingParams(max_tokens=args.generate, temperature=0.0, ignore_eos=True)
    variants = {"vanilla": lambda ps: vanilla.generate(ps, sp, use_tqdm=False)}
    for name, ask in asks.items():
        variants[name] = lambda ps, ask=ask: tapped.generate(ps, sp, taps=ask, use_tqdm=False)
    engines = {"vanilla": vanilla}
    lines = [f"# profile_step: {torch.cuda.get_device_name()}, vLLM {vllm.__version__}, torch {torch.__version__}, "
             f"Python {platform.python_version()}", "",
             f"{args.shape} shape, {layers} layers, {runner.upper()} runner, decode batch {args.batch} "
             f"({args.prompt} prompt tokens, {args.generate} generated), a sample every {args.interval} ms"
             + (f", CUDA graphs for batch sizes {args.capture_sizes} only" if args.capture_sizes else "") + ".", "",
             "tok/s: a run with nothing watching. Then a profiled run of the same kind: wall ms/step; "
             "GPU time, CUPTI's kernel and copy times summed over it (streams that overlap count twice), "
             "per step.", "",
             "| variant | tok/s | ratio to vanilla | profiled: wall ms/step | GPU kernels ms/step | GPU copies ms/step "
             "| kernel launches/step | tapc kernels/step | tapc kernel ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    details, base, vanilla_kernels = [], None, None
    for i, (name, gen) in enumerate(variants.items()):
        engine = engines.get(name, tapped)
        inner = getattr(engine, "llm", engine)
        gen(prompts(args.batch, args.prompt, seed=100 + i))   # untimed: the same kind of run first
        # The samplers hold the GIL while they walk stacks, and the hook timer and CUPTI add their
        # own work, so the speed comes from a run without them.
        inner.collective_rpc(_start_hook_timer)   # a few perf_counter calls a step
        t0 = time.perf_counter()
        outs = gen(prompts(args.batch, args.prompt, seed=200 + i))
        dt = time.perf_counter() - t0
        hooks = inner.collective_rpc(_stop_hook_timer)   # one reply per GPU, rank 0 first
        assert not [o for o in outs if getattr(o, "error", None) is not None], f"{name}: a request failed"
        # dropped, so the profiled run reuses their host memory: held, its admissions would grow
        # the arena (pinning takes about a second a GiB) and the profile would show that instead
        del outs
        inner.collective_rpc(_start_sampler, args=(args.interval / 1e3,))
        here = Sampler(args.interval / 1e3)
        t0 = time.perf_counter()
        outs = gen(prompts(args.batch, args.prompt, seed=300 + i))
        watched = time.perf_counter() - t0
        api = here.stop()
        ranks = inner.collective_rpc(_stop_sampler)   # one reply per GPU, rank 0 first
        got = ranks[0]
        core = got["threads"]
        assert not [o for o in outs if getattr(o, "error", None) is not None], f"{name}: a request failed"
        tok_s = args.batch * args.generate / dt
        base = base or tok_s
        steps = args.generate
        busiest = max(ranks, key=lambda r: r["device"]["kernels_ms"])
        dev = busiest["device"]
        lines.append(f"| {name} | {tok_s:.1f} | {tok_s / base:.3f}x | {watched / steps * 1e3:.3f} | "
                     f"{dev['kernels_ms'] / steps:.3f} | {dev['copies_ms'] / steps:.3f} | "
                     f"{dev['launches'] / steps:.1f} | {dev['tapc_launches'] / steps:.1f} | "
                     f"{dev['tapc_ms'] / steps:.4f} |")
        print(f"{name}: {tok_s:.1f} tok/s", flush=True)
        details += [f"## {name}", ""]
        if vanilla_kernels is None:
            vanilla_kernels = busiest["kernels"]
        else:   # where its GPU time goes beyond vanilla's
            details += [f"The {KERNELS_SHOWN} kernels and copies whose GPU time a step differs most from vanilla's "
                        "(the busiest GPU's, profiled runs):", "",
                        f"| kernel or copy | vanilla ms a step | {name} ms a step | difference | vanilla launches a step "
                        f"| {name} launches a step |", "|---|---:|---:|---:|---:|---:|",
                        *differing(vanilla_kernels, busiest["kernels"], steps, steps, KERNELS_SHOWN), ""]
        if hooks[0]:
            details += ["| tapc hook (worker, unwatched run) | GPU | calls | us per call | p50 us | p90 us | CPU us per call "
                        "| calls that waited > 20 us | steps that repeated the last |",
                        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
                        *[f"| `{h}` | {rank} | {v['calls']} | {v['us_per_call']:.1f} | {v.get('p50', 0):.1f} | "
                          f"{v.get('p90', 0):.1f} | {v.get('cpu', 0):.1f} | {v.get('waited', 0):.0%} | {v.get('repeated', '')} |"
                          for rank, r in enumerate(hooks) for h, v in r.items()], ""]
        worker = "engine-core process" if args.tp == 1 else "GPU 0's worker process"
        for where, threads in ((worker, core), ("caller's process", api)):
            details += [f"### {where}", ""]
            for tname, got in list(threads.items())[: args.threads]:
                details += report_thread(tname, got)
    for engine in (vanilla, tapped):
        shutdown(engine)
    with open(args.out, "w") as f:
        f.write("\n".join(lines + [""] + details) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
