"""How fast this host writes fresh pages: one thread or several, one file or one each, `pwrite`
or a shared mapping, into /dev/shm and /tmp. What bounds a harvest's writer (docs/harvest.md).

    python3 benchmarks/probes/probe_io.py --gb 4

Writes and removes `--gb` GB per case; no GPU, no vLLM.
"""
import argparse
import mmap
import os
import threading
import time

import numpy as np

GB = 1 << 30
CHUNK = 64 << 20
CASES = ("1 thread, 1 file", "4 threads, 1 file", "4 threads, 4 files", "8 threads, 8 files",
         "4 threads, 1 file, mmap", "1 thread, 1 file, fallocate first")


def threads(target, args_list) -> None:
    ts = [threading.Thread(target=target, args=a) for a in args_list]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def case(folder: str, how: str, total: int, buf: np.ndarray) -> float:
    """Seconds to write `total` bytes `how`; the files are removed after."""
    n_threads = int(how.split()[0])
    n_files = n_threads if how.endswith("files") else 1
    paths = [os.path.join(folder, f"tapc-probe-io-{i}") for i in range(n_files)]
    share = total // n_threads

    def pwrite(fd: int, lo: int, hi: int) -> None:
        for off in range(lo, hi, CHUNK):
            os.pwrite(fd, memoryview(buf)[: min(CHUNK, hi - off)], off)

    t0 = time.perf_counter()
    fds = [os.open(p, os.O_CREAT | os.O_RDWR | os.O_TRUNC) for p in paths]
    try:
        if "mmap" in how:
            os.ftruncate(fds[0], total)
            with mmap.mmap(fds[0], total) as m:
                dst = np.frombuffer(m, dtype=np.uint8)

                def copy(i: int) -> None:
                    for off in range(i * share, (i + 1) * share, CHUNK):
                        dst[off: off + CHUNK] = buf[: min(CHUNK, (i + 1) * share - off)]

                threads(copy, [(i,) for i in range(n_threads)])
                del dst
        else:
            if "fallocate" in how:
                os.posix_fallocate(fds[0], 0, total)
            if n_files > 1:
                threads(pwrite, [(fd, 0, share) for fd in fds])
            else:
                threads(pwrite, [(fds[0], i * share, (i + 1) * share) for i in range(n_threads)])
    finally:
        for fd in fds:
            os.close(fd)
        seconds = time.perf_counter() - t0
        for p in paths:
            os.unlink(p)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dirs", nargs="+", default=["/dev/shm", "/tmp"])
    args = ap.parse_args()
    total = int(args.gb * GB) // CHUNK * CHUNK
    buf = np.full(CHUNK, 7, dtype=np.uint8)
    print(f"{os.cpu_count()} cores\n\n| to | how | GB | seconds | GB/s |\n|---|---|---:|---:|---:|")
    for folder in args.dirs:
        for how in CASES:
            s = case(folder, how, total, buf)
            print(f"| {folder} | {how} | {total / GB:.1f} | {s:.2f} | {total / GB / s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
