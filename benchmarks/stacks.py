"""Sampling profiles of Python stacks: what every thread of a process is doing, every few ms.

A thread of the process reads every other thread's stack (`sys._current_frames`) at each tick.
It takes the GIL whenever a thread lets it go, which is in calls into CUDA and torch: the time
it holds it is charged to those calls, so read their shares as upper bounds. Used by
profile_step.py (in vLLM's engine-core process, through collective_rpc) and by bench_serve.py's
`--profile` (every process of a server, through serve_stacks/sitecustomize.py).
"""
import collections
import os
import sys
import threading

IDLE = {"wait", "select", "poll", "recv", "recv_into", "_wait_for_tstate_lock", "acquire", "sleep", "get",
        "dequeue", "acquire_read", "epoll", "_recv", "wait_for"}


class Sampler:
    """Every `interval` seconds, the Python stack of every other thread of this process."""

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: collections.Counter = collections.Counter()     # thread -> samples
        self.inclusive: collections.Counter = collections.Counter()   # (thread, function) -> samples on stack
        self.innermost: collections.Counter = collections.Counter()   # (thread, function) -> samples on top
        self.names: dict[int, str] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tapc-sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.done.wait(self.interval):
            self.names.update({t.ident: t.name for t in threading.enumerate()})
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                seen = []
                while frame is not None:
                    seen.append(_label(frame.f_code))
                    frame = frame.f_back
                self.samples[tid] += 1
                self.innermost[(tid, seen[0])] += 1
                for fn in set(seen):
                    self.inclusive[(tid, fn)] += 1

    def stop(self, top: int = 25) -> dict:
        """Plain data (it crosses processes): per thread with samples, its counts."""
        self.done.set()
        self.thread.join()
        out = {}
        for tid, n in self.samples.items():
            def best(counter, keep=lambda fn: True):
                return [(fn, c) for (t, fn), c in counter.most_common() if t == tid and keep(fn)][:top]
            idle = sum(c for (t, fn), c in self.innermost.items() if t == tid and fn.rsplit(".", 1)[-1] in IDLE)
            out[f"{self.names.get(tid, tid)}"] = {
                "samples": n, "idle": idle, "inclusive": best(self.inclusive),
                "tapc": best(self.inclusive, lambda fn: fn.startswith("tapc")), "innermost": best(self.innermost)}
        # busiest first: every thread is sampled at every tick, so order by samples not waiting
        return dict(sorted(out.items(), key=lambda kv: kv[1]["idle"] - kv[1]["samples"]))


def _label(code) -> str:
    """module-ish path and function: `tapc/engine/fill.fill_step`, `vllm/v1/worker/....execute_model`."""
    path = code.co_filename
    for root in ("site-packages/", "/tapc/", "/benchmarks/"):
        if root in path:
            tail = path.split(root, 1)[1]
            path = ("tapc/" if root == "/tapc/" else "") + tail
            break
    else:
        path = os.path.basename(path)
    return f"{path.removesuffix('.py')}.{code.co_name}"


def _table(rows: list[tuple[str, int]], total: int) -> list[str]:
    return [f"| `{fn}` | {c / total:.1%} |" for fn, c in rows]


def report_thread(name: str, got: dict) -> list[str]:
    n = got["samples"]
    lines = [f"#### thread `{name}`: {n} samples, {got['idle'] / n:.0%} waiting", "",
             "| on the stack (inclusive) | share |", "|---|---:|", *_table(got["inclusive"], n), ""]
    if got["tapc"]:
        lines += ["| tapc's functions (inclusive) | share |", "|---|---:|", *_table(got["tapc"], n), ""]
    lines += ["| innermost | share |", "|---|---:|", *_table(got["innermost"][:12], n), ""]
    return lines
