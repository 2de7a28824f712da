"""What making and pinning host memory for captures costs on this host, and how fast the GPU
copies into it: the arena's way (tapc/wire/arena.py) beside ways that might pin faster.

    python3 benchmarks/probes/probe_pin.py --gib 2 --out probe_pin.md

Each case makes `--gib` GiB in /dev/shm (`TAPC_SHM_DIR`), maps it, optionally touches or
advises it, registers it with CUDA (`cudaHostRegister`, as the worker does), then times one
device-to-host copy of up to 1 GiB into it; every file is unregistered and removed after. A reference
row uses torch's own pinned allocation (`cudaHostAlloc`, not shareable with another process).
An H200 host took about 1.2 s a GiB for the arena's way (docs/engine.md): this says which phase
that is and whether another way is cheaper. The last case replays CUDA graphs on the main
thread while another thread pins: whether pinning ahead, off the step's thread, would keep it
off the step's path. Without a GPU only the host phases run.
"""
import argparse
import mmap
import os
import platform
import threading
import time

import torch

GIB = 1 << 30
THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def register(t: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if err:
        raise RuntimeError(f"cudaHostRegister failed: error {err}")


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def d2h_gbs(dst: torch.Tensor, src: torch.Tensor) -> float:
    """GB/s of one asynchronous copy of `src` (on the GPU) into `dst` (pinned host bytes)."""
    n = min(src.numel(), dst.numel())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst[:n].copy_(src[:n], non_blocking=True)   # warm: the first copy maps the driver's paths
    start.record()
    dst[:n].copy_(src[:n], non_blocking=True)
    end.record()
    end.synchronize()
    return n / (start.elapsed_time(end) / 1e3) / 1e9


class Case:
    """One way of making `size` bytes: phases timed into `self.times` (name -> seconds)."""

    def __init__(self, folder: str, size: int, name: str):
        self.path = os.path.join(folder, f"tapc-probe-pin-{os.getpid()}-{name.replace(' ', '-')}")
        self.size, self.times, self.keep = size, {}, []

    def timed(self, phase: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0
        return out

    def file(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.timed("fallocate", os.posix_fallocate, fd, 0, self.size)
        return fd

    def close(self) -> None:
        for t in self.keep:
            if torch.cuda.is_available():
                unregister(t)
        self.keep.clear()
        if os.path.exists(self.path):
            os.unlink(self.path)


def arena_way(c: Case) -> torch.Tensor:
    os.close(c.file())
    return c.timed("map", lambda: torch.from_file(c.path, shared=True, size=c.size, dtype=torch.uint8))


def touched(c: Case) -> torch.Tensor:
    t = arena_way(c)
    c.timed("touch", t.zero_)   # every page faulted in by the CPU before the driver pins it
    return t


def populated(c: Case) -> torch.Tensor:
    fd = c.file()
    m = c.timed("map", lambda: mmap.mmap(fd, c.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    os.close(fd)
    return torch.frombuffer(m, dtype=torch.uint8)


def huge(c: Case) -> torch.Tensor:
    fd = c.file()
    m = c.timed("map", lambda: mmap.mmap(fd, c.size, flags=mmap.MAP_SHARED))
    os.close(fd)
    c.timed("madvise", m.madvise, mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    c.timed("touch", t.zero_)
    return t


WAYS = {"arena (fallocate, map, register)": arena_way, "touched before register": touched,
        "MAP_POPULATE": populated, "MADV_HUGEPAGE, touched": huge}


def run_way(folder: str, size: int, name: str, way, src) -> dict:
    c = Case(folder, size, name.split()[0])
    try:
        t = way(c)
        if src is not None:
            c.timed("register", register, t)
            c.keep.append(t)
            c.times["D2H GB/s"] = d2h_gbs(t, src)
        return c.times
    finally:
        c.close()


def in_threads(folder: str, size: int, n: int, src) -> dict:
    """`n` files of size/n made and registered at once, one thread each (does pinning scale?)."""
    device = torch.cuda.current_device() if src is not None else None
    cases = [Case(folder, size // n, f"thread{i}") for i in range(n)]
    errors = []

    def one(c: Case) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)   # the thread's own current device is GPU 0
            t = arena_way(c)
            if device is not None:
                c.timed("register", register, t)
                c.keep.append(t)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in cases:
        c.close()
    if errors:
        raise errors[0]
    return {"wall (all threads)": wall}


def beside_launches(folder: str, size: int) -> dict:
    """Would pinning ahead of need, on a thread of its own, keep it off the step's path? The main
    thread replays a CUDA graph of 200 small kernels (syncing every 8, as a step's sampler does)
    alone, then while another thread makes and registers `size` bytes the arena's way: the loop's
    wall time and its longest single launch say whether the registration held the launches."""
    x = torch.randn(64, 4096, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):   # warm the kernels before capture, as torch asks
        y = x
        for _ in range(200):
            y = y * 1.0001 + 0.0001
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(200):
            y = y * 1.0001 + 0.0001
    torch.cuda.synchronize()

    def loop(n: int = 3000) -> tuple[float, float]:
        longest, t0 = 0.0, time.perf_counter()
        for i in range(n):
            a = time.perf_counter()
            graph.replay()
            longest = max(longest, time.perf_counter() - a)
            if i % 8 == 7:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, longest

    alone, alone_longest = loop()
    c = Case(folder, size, "beside")
    pinned = {}

    def pin() -> None:
        t0 = time.perf_counter()
        t = arena_way(c)
        register(t)
        c.keep.append(t)
        pinned["s"] = time.perf_counter() - t0

    try:
        th = threading.Thread(target=pin)
        th.start()
        busy, busy_longest = loop()
        th.join()
    finally:
        c.close()
    return {"graph loop alone": alone, "its longest launch": alone_longest, "made and pinned on a thread": pinned["s"],
            "graph loop meanwhile": busy, "its longest launch meanwhile": busy_longest}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--out", default="probe_pin.md")
    args = ap.parse_args()
    folder = os.environ.get("TAPC_SHM_DIR", "/dev/shm")
    size = int(args.gib * GIB)
    gpu = torch.cuda.is_available()
    src = torch.randn(GIB // 2, dtype=torch.bfloat16, device="cuda").view(torch.uint8) if gpu else None
    thp = open(THP).read().strip() if os.path.exists(THP) else "(not present)"
    lines = [f"# probe_pin: {torch.cuda.get_device_name() if gpu else 'no GPU'}, torch {torch.__version__}, "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs", "",
             f"{args.gib:g} GiB a case in {folder}; {THP}: `{thp}`. Seconds per phase, per GiB; the D2H "
             "column: one 1 GiB copy from the GPU into the registered memory.", "",
             "| case | phase | seconds | s per GiB |", "|---|---|---:|---:|"]
    results = {name: run_way(folder, size, name, way, src) for name, way in WAYS.items()}
    results["4 threads, 4 files (arena way)"] = in_threads(folder, size, 4, src)
    if gpu:
        t0 = time.perf_counter()
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        results["torch pin_memory (cudaHostAlloc)"] = {"allocate": time.perf_counter() - t0,
                                                       "D2H GB/s": d2h_gbs(pinned, src)}
        del pinned
        results["pinning on a side thread, graphs replayed meanwhile"] = beside_launches(folder, size)
    for name, times in results.items():
        for phase, v in times.items():
            per = "" if phase.endswith("GB/s") or "loop" in phase or "launch" in phase else f"{v / args.gib:.3f}"
            lines.append(f"| {name} | {phase} | {v:.3f} | {per} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
