"""What every process of a server that bench_serve.py starts reads during its timed loads
(serve_stacks/sitecustomize.py loads the readers into each process): `--profile` its stack
samples (stacks.py), `--timers` the engine thread's calls of vLLM's engine-loop functions
(timers.py: scheduler, executor, model runner, the wait for the GPU, with the GPU's side of each
step and Python's collections), `--kernels` the GPU's kernel and copy times (CUPTI, devicetime.py).
Here: the window that marks a load, and the reports of both servers' readings side by side, each
mix apart."""
from __future__ import annotations

import json
import os
import time


class Window:
    """A reading that every process of one server takes while a timed load runs: the file `on`
    in `folder` marks the load (serve_stacks/sitecustomize.py); each load leaves a file a process."""

    def __init__(self, folder: str):
        self.folder = folder
        self.flag = os.path.join(folder, "on")

    def __enter__(self):
        open(self.flag, "w").close()

    # A process's reading may take a while to write once the flag goes (CUPTI's records of a load
    # are hundreds of thousands of kernels): the mix's readings are set aside only once all are in.
    WRITE_S = 600

    def __exit__(self, *exc):
        os.remove(self.flag)
        time.sleep(0.2)   # each process sees the flag gone within a tick
        deadline = time.time() + self.WRITE_S
        while any(f.endswith(".open") for f in os.listdir(self.folder)):
            if time.time() > deadline:
                raise RuntimeError(f"a server process did not write its reading in {self.WRITE_S} s ({self.folder})")
            time.sleep(0.1)

    def set_aside(self, name: str) -> Window:
        """The loads' readings so far, moved into a folder of their own (`name`, in this one), as
        a window of that folder: one mix's loads, read apart from the next mix's."""
        dest = os.path.join(self.folder, name)
        os.makedirs(dest)
        for f in os.listdir(self.folder):
            if f.endswith(".json"):
                os.replace(os.path.join(self.folder, f), os.path.join(dest, f))
        return type(self)(dest)

    def readings(self) -> list[dict]:
        out = []
        for path in sorted(f for f in os.listdir(self.folder) if f.endswith(".json")):
            with open(os.path.join(self.folder, path)) as f:
                out.append(json.load(f))
        return out


class Stacks(Window):
    """`--profile`: stack samples of every process of one server during its timed loads
    (stacks.py), summed over the loads, as markdown per process and thread."""

    ENV = "TAPC_STACKS_DIR"

    def report(self, server: str, top: int = 3) -> list[str]:
        from collections import Counter

        from stacks import report_thread

        procs: dict[str, dict[str, dict]] = {}
        for got in self.readings():
            threads = procs.setdefault(f"{got['process']} (pid {got['pid']})", {})
            for tname, t in got["threads"].items():
                if tname in ("tapc-stacks", "tapc-sampler", "tapc-timers"):   # the readings' own
                    continue
                acc = threads.setdefault(tname, {"samples": 0, "idle": 0, "inclusive": Counter(), "tapc": Counter(),
                                                 "innermost": Counter()})
                acc["samples"] += t["samples"]
                acc["idle"] += t["idle"]
                for key in ("inclusive", "tapc", "innermost"):
                    acc[key].update(dict(t[key]))
        lines = [f"## {server} server", ""]

        def busy(threads):
            return sum(t["samples"] - t["idle"] for t in threads.values())

        for proc, threads in sorted(procs.items(), key=lambda kv: -busy(kv[1])):
            if busy(threads) < 0.05 * max(t["samples"] for t in threads.values()):
                continue   # a helper process that waited throughout (resource tracker, ...)
            lines += [f"### process `{proc}`", ""]
            for tname, t in sorted(threads.items(), key=lambda kv: kv[1]["idle"] - kv[1]["samples"])[:top]:
                lines += report_thread(tname, {**t, **{k: t[k].most_common(25) for k in ("inclusive", "tapc", "innermost")}})
        return lines


class CallTimes(Window):
    """`--timers`: the engine thread's milliseconds a step in vLLM's engine-loop functions
    (timers.py), summed over one server's timed loads."""

    ENV = "TAPC_TIMERS_DIR"

    def per_step(self, steps: float) -> tuple[dict[str, tuple[float, float]], list[str]]:
        """{function: (ms a step, calls a step)} of the engine-core process, and targets missing."""
        engine = [got for got in self.readings() if got["process"].startswith("EngineCore")]
        if not engine:
            raise RuntimeError(f"--timers: no engine-core process left a reading in {self.folder}")
        seconds, calls, missing = {}, {}, set()
        for got in engine:
            missing.update(got["missing"])
            for k, v in got["seconds"].items():
                seconds[k] = seconds.get(k, 0.0) + v
                calls[k] = calls.get(k, 0) + got["calls"][k]
        steps = max(steps, 1.0)
        return {k: (seconds[k] * 1e3 / steps, calls[k] / steps) for k in seconds}, sorted(missing)


class Kernels(Window):
    """`--kernels`: the GPU's time by kernel (CUPTI's records, devicetime.py) in one server's
    engine-core process during its timed loads."""

    ENV = "TAPC_KERNELS_DIR"

    def summed(self) -> dict[str, list]:
        """{kernel or copy: [launches, GPU us]} summed over the loads."""
        got: dict[str, list] = {}
        for reading in self.readings():
            for name, (count, us) in reading["kernels"].items():
                acc = got.setdefault(name, [0, 0.0])
                acc[0] += count
                acc[1] += us
        if not got:
            raise RuntimeError(f"--kernels: no process recorded a kernel in {self.folder}")
        return got


def kernels_report(kernels: dict[str, Kernels], steps: dict[str, float], mix: str, top: int = 30) -> list[str]:
    """Both servers' GPU time a step over one mix's loads: kernels, copies and tapc's own
    kernels in all (devicetime.totals), then the kernels whose time differs most between the two."""
    from devicetime import differing, totals

    got = {name: k.summed() for name, k in kernels.items()}
    per = {name: max(steps[name], 1.0) for name in got}
    sums = {name: totals(g) for name, g in got.items()}
    lines = [f"# bench_serve --kernels, mix {mix}: the GPU's ms a step (CUPTI's kernel and copy records in each "
             "engine-core process during the timed loads; streams that overlap count twice; the records slow the "
             "host, so these loads' speeds are not the benchmark's)", "",
             f"steps: vanilla {steps['vanilla']:.0f}, tapc {steps['tapc']:.0f}", "",
             "| GPU work | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla launches a step | tapc launches a step |",
             "|---|---:|---:|---:|---:|---:|"]
    for what, ms, n in (("kernels", "kernels_ms", "launches"), ("copies and memsets", "copies_ms", "copies"),
                        ("tapc's kernels", "tapc_ms", "tapc_launches")):
        (vm, vn), (tm, tn) = ((sums[name][ms] / per[name], sums[name][n] / per[name]) for name in ("vanilla", "tapc"))
        lines.append(f"| {what} | {vm:.3f} | {tm:.3f} | {tm - vm:+.3f} | {vn:.1f} | {tn:.1f} |")

    lines += ["", f"The {top} kernels and copies whose GPU time a step differs most:", "",
              "| kernel or copy | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla launches a step | tapc launches a step |",
              "|---|---:|---:|---:|---:|---:|",
              *differing(got["vanilla"], got["tapc"], per["vanilla"], per["tapc"], top)]
    return lines + [""]


def call_times_report(timers: dict[str, CallTimes], steps: dict[str, float], seconds: dict[str, float],
                      mix: str) -> list[str]:
    """Both servers' engine threads side by side over one mix's loads: ms a step in each timed
    function (inclusive: a function's callees count in it too), calls a step, and the difference."""
    got = {name: t.per_step(steps[name]) for name, t in timers.items()}
    wall = {name: seconds[name] * 1e3 / max(steps[name], 1.0) for name in timers}
    lines = [f"# bench_serve --timers, mix {mix}: the engine thread's ms a step in vLLM's engine-loop functions, "
             "during the timed loads (inclusive; calls on the engine core's main thread only; (GPU) rows from "
             "CUDA events, (gc) rows Python's collections)", "",
             f"steps: vanilla {steps['vanilla']:.0f}, tapc {steps['tapc']:.0f}", "",
             "| function | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla calls a step | tapc calls a step |",
             "|---|---:|---:|---:|---:|---:|",
             f"| (wall) | {wall['vanilla']:.3f} | {wall['tapc']:.3f} | {wall['tapc'] - wall['vanilla']:+.3f} | | |"]
    names = sorted(set(got["vanilla"][0]) | set(got["tapc"][0]), key=lambda k: -got["vanilla"][0].get(k, (0, 0))[0])
    for k in names:
        (vm, vc), (tm, tc) = got["vanilla"][0].get(k, (0.0, 0.0)), got["tapc"][0].get(k, (0.0, 0.0))
        lines.append(f"| `{k}` | {vm:.3f} | {tm:.3f} | {tm - vm:+.3f} | {vc:.2f} | {tc:.2f} |")
    missing = sorted(set(got["vanilla"][1]) | set(got["tapc"][1]))
    if missing:
        lines += ["", f"not in this vLLM (not timed): {', '.join(missing)}"]
    return lines
