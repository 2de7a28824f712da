"""Does a thread-block cluster close project_out_'s gap at few rows? (docs/kernels.md)

    python3 benchmarks/probes/probe_ctas.py --out probe.md

Below 512 rows one program per row moves its row at what one multiprocessor can move. With
`num_ctas` > 1 on sm90, Triton splits each program's row over a cluster of CTAs, one a
multiprocessor, and reduces the dot through distributed shared memory in the same launch.
This runs the kernel as it is with num_ctas 1, 2, 4 and 8 (each checked against the
reference first), timed in a CUDA graph beside a copy of the same bytes, as bench_kernels'
graph column. A configuration that fails to compile or to match is reported, not skipped.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton

from tapc.kernels.edit import _project_out_kernel, project_out_config, project_out_ref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # benchmarks/, for bench_kernels
from bench_kernels import graph_us  # noqa: E402


def run(x, b, slot, dirs, num_ctas):
    num_tokens, width = x.shape
    block, one_pass, warps = project_out_config(num_tokens, width)
    _project_out_kernel[(num_tokens,)](
        x, b, slot, dirs, width, dirs.shape[0], x.stride(0), x.stride(1), b.stride(0),
        b.stride(1), dirs.stride(0),
        HAS_B=True, BLOCK=block, ONE_PASS=one_pass, num_warps=warps, num_ctas=num_ctas,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--widths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--ctas", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out")
    args = p.parse_args()
    lines = ["| tokens | width | elements | copy us | " +
             " | ".join(f"ctas={c} us (ratio)" for c in args.ctas) + " |",
             "|---" * (4 + len(args.ctas)) + "|"]
    for width in args.widths:
        for tokens in args.tokens:
            g = torch.Generator(device="cuda").manual_seed(tokens * width)
            x = torch.randn(tokens, width, device="cuda", generator=g).to(torch.bfloat16)
            b = torch.randn(tokens, width, device="cuda", generator=g).to(torch.bfloat16)
            dirs = F.normalize(torch.randn(4, width, device="cuda", generator=g), dim=1)
            slot = (torch.arange(tokens, device="cuda") % 4).to(torch.int32)
            nbytes = 3 * x.numel() * x.element_size() + dirs.numel() * dirs.element_size()
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy = graph_us(lambda: dst.copy_(src))[0]
            cells = []
            for ctas in args.ctas:
                try:
                    want = x.clone()
                    project_out_ref(want, b, slot, dirs)
                    got = x.clone()
                    run(got, b, slot, dirs, ctas)
                    torch.cuda.synchronize()
                    err = (got.float() - want.float()).abs().max().item()
                    if err > 5e-2:
                        cells.append(f"wrong (max err {err:.3g})")
                        continue
                    us = graph_us(lambda: run(got, b, slot, dirs, ctas))[0]
                    cells.append(f"{us:.2f} ({copy / us:.2f})")
                except Exception as e:  # noqa: BLE001  (a probe reports what failed)
                    cells.append(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}")
            lines.append(f"| {tokens} | {width} | {tokens * width} | {copy:.2f} | " +
                         " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"triton {triton.__version__}, {torch.cuda.get_device_name()}\n\n{text}\n")


if __name__ == "__main__":
    main()
