"""Achieved bandwidth of the tap kernels beside a torch device-to-device copy of the same bytes.

    python3 benchmarks/bench_kernels.py --out bench.md

Each kernel runs through its `torch.ops.tapc` op on bf16 activations with every row selected
(the most bytes it can move), over token counts x widths. Two timings per row, each beside a
`copy_` that reads and writes the same number of bytes in the same run:
- graph: replayed back to back from a CUDA graph (`triton.testing.do_bench_cudagraph`), as in
  vLLM's captured batches: GPU time only, no L2 flush, so sets below ~50 MB partly hit L2;
- eager: `triton.testing.do_bench`, L2 flushed, host launch included, as in batches larger
  than vLLM's largest capture size.
A second table gives each op's cost per call inside a graph at one token (the launch cost),
and its host cost per eager call.

Without CUDA (TRITON_INTERPRET=1, tiny sizes) it only checks that the script runs: the
timings are CPU wall clock and mean nothing.
"""
import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import tapc.kernels  # noqa: F401  (registers torch.ops.tapc)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16
SLOTS = 4
NUM_COLS = 8
QUANTILES = [0.5, 0.2, 0.8]


def graph_us(fn) -> list[float]:
    """p50, p20, p80 in microseconds of fn replayed from a CUDA graph."""
    if not ON_GPU:
        return wall_us(fn)
    # The inputs were made on the default stream and do_bench_cudagraph runs fn on its own.
    torch.cuda.synchronize()
    return [ms * 1e3 for ms in triton.testing.do_bench_cudagraph(fn, rep=10, quantiles=QUANTILES)]


def eager_us(fn) -> list[float]:
    if not ON_GPU:
        return wall_us(fn)
    return [ms * 1e3 for ms in triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=QUANTILES)]


def wall_us(fn, runs: int = 3) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return [statistics.median(times), min(times), max(times)]


def host_us(fn, calls: int = 200) -> float:
    """Host time per eager call, launches queued behind each other."""
    fn()
    if ON_GPU:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if ON_GPU:
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def setup(kernel: str, tokens: int, width: int):
    """(fn, bytes it must read and write) for one kernel at one size; all rows selected."""
    x = torch.randn(tokens, width, device=DEVICE).to(DTYPE)
    b = torch.randn(tokens, width, device=DEVICE).to(DTYPE)
    rows = torch.arange(tokens, device=DEVICE, dtype=torch.int32)
    slot = rows % SLOTS
    es = x.element_size()
    act = tokens * width * es  # one activation-sized read or write
    per_slot = SLOTS * width * 4  # an fp32 [slots, width] table, read once per slot
    ops = torch.ops.tapc
    if kernel == "capture":
        out = torch.empty(tokens, width, device=DEVICE, dtype=DTYPE)
        return (lambda: ops.capture(x, rows, out)), 2 * act
    if kernel == "capture bf16->fp32":
        out = torch.empty(tokens, width, device=DEVICE, dtype=torch.float32)
        return (lambda: ops.capture(x, rows, out)), 3 * act
    if kernel == "capture column slice":
        wide = torch.randn(tokens, 2 * width, device=DEVICE).to(DTYPE)
        out = torch.empty(tokens, width, device=DEVICE, dtype=DTYPE)
        return (lambda: ops.capture(wide[:, width:], rows, out)), 2 * act
    if kernel == "capture_sum":
        out = torch.empty(tokens, width, device=DEVICE, dtype=DTYPE)
        return (lambda: ops.capture_sum(x, b, rows, out)), 3 * act
    if kernel == "add_":
        vec = torch.randn(SLOTS, width, device=DEVICE)
        alpha = torch.zeros(SLOTS, device=DEVICE)  # repeated in place: keep x finite
        return (lambda: ops.add_(x, b, slot, vec, alpha)), 2 * act + per_slot
    if kernel == "scale_ (x+b)":
        factor = torch.ones(SLOTS, device=DEVICE)
        return (lambda: ops.scale_(x, b, slot, factor)), 3 * act
    if kernel == "project_out_ (x+b)":
        dirs = F.normalize(torch.randn(SLOTS, width, device=DEVICE), dim=1)
        return (lambda: ops.project_out_(x, b, slot, dirs)), 3 * act + per_slot
    if kernel == "set_cols_ (x+b)":
        cols = torch.stack([torch.randperm(width, device=DEVICE)[:NUM_COLS] for _ in range(SLOTS)])
        cols = cols.to(torch.int32)
        vals = torch.randn(SLOTS, NUM_COLS, device=DEVICE)
        moved = tokens * NUM_COLS * 2 * es + SLOTS * NUM_COLS * 8
        return (lambda: ops.set_cols_(x, b, slot, cols, vals)), moved
    raise ValueError(kernel)


BANDWIDTH_KERNELS = [
    "capture", "capture bf16->fp32", "capture column slice", "capture_sum", "add_",
    "scale_ (x+b)", "project_out_ (x+b)",
]
LAUNCH_KERNELS = BANDWIDTH_KERNELS + ["set_cols_ (x+b)"]


def copy_of(nbytes: int):
    """A torch copy_ that reads and writes nbytes in all, in the activation dtype."""
    n = max(1, nbytes // (2 * DTYPE.itemsize))
    src = torch.randn(n, device=DEVICE).to(DTYPE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def _vs_copy(nbytes: int, kernel_us: float, copy_us: float) -> tuple:
    """Kernel GB/s, copy GB/s, and the kernel's share of the copy's bandwidth."""
    return (f"{gbps(nbytes, kernel_us):.0f}", f"{gbps(nbytes, copy_us):.0f}",
            f"{copy_us / kernel_us:.2f}")


def bandwidth_rows(kernels, tokens_list, widths):
    yield ("kernel", "tokens", "width", "elements", "MB", "graph p50 us (p20-p80)",
           "graph GB/s", "copy GB/s", "ratio", "eager GB/s", "eager copy GB/s", "eager ratio")
    for kernel in kernels:
        for width in widths:
            for tokens in tokens_list:
                fn, nbytes = setup(kernel, tokens, width)
                copy = copy_of(nbytes)
                g, gc = graph_us(fn), graph_us(copy)
                e, ec = eager_us(fn), eager_us(copy)
                yield (
                    kernel, tokens, width, tokens * width, f"{nbytes / 1e6:.3g}",
                    f"{g[0]:.2f} ({g[1]:.2f}-{g[2]:.2f})",
                    *_vs_copy(nbytes, g[0], gc[0]), *_vs_copy(nbytes, e[0], ec[0]),
                )


def launch_rows(kernels, width: int):
    yield ("op (1 token)", "in graph p50 us (p20-p80)", "eager host us per call")
    for kernel in kernels:
        fn, _ = setup(kernel, 1, width)
        g = graph_us(fn)
        yield kernel, f"{g[0]:.2f} ({g[1]:.2f}-{g[2]:.2f})", f"{host_us(fn):.1f}"
    copy = copy_of(2 * width * 2)
    g = graph_us(copy)
    yield "torch copy_ of one row", f"{g[0]:.2f} ({g[1]:.2f}-{g[2]:.2f})", f"{host_us(copy):.1f}"


def markdown(rows) -> str:
    rows = [tuple(str(c) for c in r) for r in rows]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096, 16384])
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--launch-width", type=int, default=4096)
    parser.add_argument("--kernels", nargs="+", choices=LAUNCH_KERNELS, default=LAUNCH_KERNELS,
                        metavar="KERNEL", help=f"only these (default all: {LAUNCH_KERNELS})")
    parser.add_argument("--out", help="also write the tables here, as markdown")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if ON_GPU else f"CPU {platform.processor()} (interpreter)"
    header = (f"gpu: {gpu}; torch {torch.__version__}; triton {triton.__version__}; dtype {DTYPE}; "
              f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    print(header, flush=True)
    parts = [header]
    for title, rows in (
        ("Launch cost", launch_rows(args.kernels, args.launch_width)),
        ("Bandwidth", bandwidth_rows([k for k in args.kernels if k in BANDWIDTH_KERNELS],
                                     args.tokens, args.widths)),
    ):
        table = []
        for row in rows:
            table.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
        parts.append(f"## {title}\n\n{markdown(table)}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
