"""The harvest's writer alone, no engine: finished requests of `--keys` keys (4096 wide, bf16,
laid out as a capture group holds them: `[rows, keys, width]`, so each key is strided) through
`tapc.harvest.writer.Writer` into a safetensors shard, on `--threads` column threads.

    python3 benchmarks/bench_writer.py --keys 4 --dir /dev/shm --threads 1 4

Prints GB/s of activations written. Four layers of the Llama-3.1-8B shape at vanilla's pace
are about 1.4 GB/s (docs/harvest.md).
"""
import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tapc.harvest.feed import Done, Window  # noqa: E402
from tapc.harvest.writer import Layout, Writer  # noqa: E402

WIDTH, ROWS = 4096, 128


def run(keys: int, folder: str, requests: int, threads: int) -> float:
    names = tuple(f"model.layers.{i}.resid" for i in range(keys))
    out_dir = Path(tempfile.mkdtemp(dir=folder, prefix="tapc-bench-writer-"))
    try:
        layout = Layout(out_dir, "safetensors", names, tuple(f"blocks.{i}.hook_resid_post" for i in range(keys)),
                        (WIDTH,) * keys, torch.bfloat16, requests * ROWS, "all")
        src = torch.randn(ROWS, keys, WIDTH).to(torch.bfloat16)

        def done(i: int) -> Done:
            block = src.clone()   # each request's own capture block, as the arena hands it over
            out = SimpleNamespace(error=None, taps={k: block[:, j] for j, k in enumerate(names)},
                                  prompt_token_ids=list(range(ROWS)), outputs=[SimpleNamespace(token_ids=[1])])
            return Done(i, i, out, ROWS, suspect=False)

        groups = [[done(i) for i in range(g, min(g + 16, requests))] for g in range(0, requests, 16)]
        writer = Writer(layout, Window(1 << 40), lambda record: None, threads=threads)
        t0 = time.perf_counter()
        for group in groups:
            writer.put(group)
        writer.close()
        return requests * ROWS * keys * WIDTH * 2 / 1e9 / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    torch.set_num_threads(1)   # as a harvest runs (tapc/harvest/run.py)
    print("| keys | to | column threads | GB/s |\n|---:|---|---:|---:|")
    for threads in args.threads:
        print(f"| {args.keys} | {args.dir} | {threads} | {run(args.keys, args.dir, args.requests, threads):.2f} |")


if __name__ == "__main__":
    main()
