"""What a tap op that selects no row costs a captured CUDA graph: inline, on a forked stream, switched off.

    python3 benchmarks/probes/probe_nodes.py --out probe_nodes.md

A stand-in decode forward (24 layers of 18 small ops: bf16 [bs, 2048] x [2048, 2048] matmuls and
pointwise ops, about 2 ms a graph at batch 1, near the Qwen3-30B-A3B shape's decode step) is
captured in a CUDA graph without taps, with 1 or 3 of tapc's capture kernels a layer whose row
table is all -1 (`capture_sum`, `capture`, `capture_pair`: what "nothing asked" leaves in the
graph), launched inline; launched on a side stream forked from the layer and joined at the
end of the forward; and inline in the engine's `SwitchedGraph` (tapc/worker/switch.py), replayed
as a step that asks for no tap does (its bare copy, without the tap nodes) and as one that asks
for a tap the others are not (the tap nodes disabled). Reported per graph: replay time (GPU,
median of 5 x 100 replays), the host's time to launch one replay, and for the switched graph the
time of two replays, switched off and back on, from the host's first call to the GPU's end.
Torch and tapc's kernels only; no vLLM.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tapc.worker.patches import Patch  # noqa: E402
from tapc.worker.cugraph import Driver  # noqa: E402
from tapc.worker.switch import ALL, Switch, SwitchedGraph  # noqa: E402
from tapc.kernels import ops  # noqa: E402
from tapc.kernels.ops import capture, capture_pair, capture_sum  # noqa: E402

HIDDEN, LAYERS, OPS = 2048, 24, 18
# The switched modes: the want of a step that asks for no tap, and of one that asks for a tap
# none of these nodes serves (table row 1: the stand-in's ops all read row 0).
OFF = {"switched off": 0, "nodes disabled": 1 << 1}


def build(bs: int):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(4)]
    table = torch.full((1, 8192), -1, dtype=torch.int32, device=dev)   # no request asked: every row -1
    dst = table[0]
    pools = (torch.zeros(64, HIDDEN, dtype=torch.bfloat16, device=dev), torch.zeros(64, 128, device=dev),
             torch.zeros(64, 8, dtype=torch.int32, device=dev), torch.zeros(64, 8, device=dev))
    side = torch.cuda.Stream()

    def forward(x, mode: str, taps: int):
        main = torch.cuda.current_stream()
        for _ in range(LAYERS):
            r = x
            for i in range(OPS):
                x = torch.mm(x, weights[i % 4]) if i % 3 == 0 else torch.nn.functional.silu(x) * 0.5 + r
            logits = x[:, :128].float()
            ids = logits[:, :8].to(torch.int32)
            ops = [lambda: capture_sum(x, r, dst, pools[0]), lambda: capture(logits, dst, pools[1]),
                   lambda: capture_pair(ids, logits[:, :8], dst, dst, pools[2], pools[3])][:taps]
            if mode == "inline" or mode in OFF:
                for op in ops:
                    op()
            elif mode == "side stream":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    for op in ops:
                        op()
        if mode == "side stream":
            main.wait_stream(side)
        return x

    return torch.randn(bs, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g), forward, table


def measure(x, forward, mode: str, taps: int, switch: Switch) -> tuple[float, float, str]:
    """(GPU us a replay, host us to launch one, for a switched graph: its nodes and the host's
    us to switch them off and on)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            forward(x, mode, taps)
    torch.cuda.synchronize()
    switched = mode in OFF
    graph = SwitchedGraph.bound(switch)() if switched else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), Patch(ops, "_launch_observer", switch.observe if switched else None):
        forward(x, mode, taps)
    toggle = ""
    if switched:
        times = []
        for _ in range(11):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            switch.want = OFF[mode]
            graph.replay()
            switch.want = ALL
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
        toggle = f"{len(graph.nodes)} nodes, {sorted(times)[5]:.0f} us for 2 replays (off, on)"
        switch.want = OFF[mode]
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    gpu = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(100):
            graph.replay()
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 10)    # ms over 100 replays -> us a replay
    host = []
    for _ in range(51):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
    return sorted(gpu)[2], sorted(host)[25], toggle


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_nodes.md")
    args = ap.parse_args()
    lines = [f"# probe_nodes: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             f"A stand-in forward of {LAYERS} layers x {OPS} ops in one CUDA graph; tap ops with no row selected.", "",
             "| batch | tap ops a layer | launched | GPU us a replay | added us | us a tap op | ratio to no taps | "
             "host us to launch | switching |", "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    driver = Driver.load()
    for bs in (1, 64):
        x, forward, table = build(bs)
        switch = Switch(driver, table, ops.KERNELS)
        modes = ("inline", "side stream") + (tuple(OFF) if driver is not None else ())
        for taps in (1, 3):
            base, host, _ = measure(x, forward, "none", taps, switch)
            lines.append(f"| {bs} | 0 | - | {base:.1f} | | | 1.000x | {host:.1f} | |")
            for mode in modes:
                us, host, toggle = measure(x, forward, mode, taps, switch)
                n = taps * LAYERS
                lines.append(f"| {bs} | {taps} | {mode} | {us:.1f} | {us - base:.1f} | {(us - base) / n:.2f} | "
                             f"{base / us:.3f}x | {host:.1f} | {toggle} |")
            print("\n".join(lines[-1 - len(modes):]), flush=True)
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
