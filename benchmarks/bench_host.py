"""One step's host work in the engine worker, on the CPU: filling the row tables and the
copy-out bookkeeping, for the bench_engine.py plan (Llama-3.1-8B shape: 32 layers' residual
streams captured, one steering edit).

    python3 benchmarks/bench_host.py

The pools and host storage live on the meta device, so a copy costs its Python and dispatch
overhead but moves no bytes: on the GPU the copies are asynchronous and only their issue is
host time. Async scheduling overlaps this with the previous step on the GPU (about 12 ms at
batch 64 for an 8B model, 4.6 ms at batch 1), beside vLLM's own host work.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tapc.engine.protocol import WireRequest  # noqa: E402
from tapc.engine.requests import TapRequest, check  # noqa: E402
from tapc.engine.fill import fill_step  # noqa: E402
from tapc.engine.layout import Layout  # noqa: E402
from tapc.engine.memcpy import copy_segments  # noqa: E402
from tapc.engine.records import Record  # noqa: E402
from tapc.engine.step import StepBatch  # noqa: E402
from tapc.planner import build_plan  # noqa: E402
from tapc.tree import ModuleTree, Node  # noqa: E402

HIDDEN, LAYERS, ROWS, SEQS = 4096, 32, 8192, 256
TAPS = ["model.layers.*.resid", "model.layers.16.resid | add(steer, alpha=4.0)"]


def tree() -> ModuleTree:
    nodes = [Node("model", "LlamaModel", "tensor", HIDDEN, HIDDEN), Node("model.layers", "ModuleList", "none", None, None)]
    nodes += [Node(f"model.layers.{i}", "LlamaDecoderLayer", "pair", HIDDEN, HIDDEN, layer=i) for i in range(LAYERS)]
    return ModuleTree(model="bench", architecture="LlamaForCausalLM", hidden_size=HIDDEN, num_layers=LAYERS,
                      vocab_size=128256, dtype="bfloat16", layers_path="model.layers", vllm_version="0.26.0",
                      nodes=tuple(nodes))


def meta_alloc(rows, caps, width, dtype):
    return torch.empty((rows, caps, width), dtype=dtype, device="meta")


def scenario(plan, layout, ask: TapRequest, n_reqs: int, prompt_len: int, decode: bool):
    """(records, step arguments): n_reqs requests, all decoding one token at position
    prompt_len + 5, or all prefilling their whole prompt in one step."""
    checked = check(plan, ask, "bench")
    records, rids = {}, [f"r{i}" for i in range(n_reqs)]
    for rid in rids:
        rec = Record(layout, rid, WireRequest(rid, checked), prompt_len, 128, meta_alloc)
        rec.slot = 0 if rec.edits else -1
        records[rid] = rec
    per = 1 if decode else prompt_len
    qsl = np.arange(n_reqs + 1, dtype=np.int32) * per
    computed = np.full(n_reqs, prompt_len + 5 if decode else 0, dtype=np.int32)
    prompt_lens = np.full(n_reqs, prompt_len, dtype=np.int32)
    padded = int(qsl[-1])
    return records, StepBatch(rids, qsl, computed, prompt_lens, padded)


def time_step(layout, records, batch: StepBatch, repeats: int = 200) -> float:
    table = np.empty((layout.num_tables, ROWS), dtype=np.int32)
    pools = [torch.empty(len(g.caps) * ROWS, g.width, dtype=getattr(torch, g.dtype), device="meta")
             for g in layout.groups]
    times = []
    for _ in range(repeats):
        for rec in records.values():   # every repeat captures the same step again
            rec.next_pos = 0
            for st in rec.stores:
                st.rows = 0
        t0 = time.perf_counter()
        segments, used = fill_step(layout, table[:, :batch.padded], records, batch)
        copy_segments(segments, pools)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    plan = build_plan("bench", TAPS, max_num_batched_tokens=ROWS, max_num_seqs=SEQS, tree=tree())
    layout = Layout(plan)
    steer = {"steer": np.random.default_rng(0).standard_normal(HIDDEN).astype(np.float32)}
    cases = [
        ("decode 64, steer 1 layer", TapRequest(params=steer), 64, 512, True),
        ("decode 64, capture 32 layers", TapRequest(capture="model.layers.*.resid"), 64, 512, True),
        ("decode 256, steer 1 layer", TapRequest(params=steer), 256, 512, True),
        ("decode 256, capture 32 layers", TapRequest(capture="model.layers.*.resid"), 256, 512, True),
        ("prefill 64x128 = 8192 tokens, capture 1 layer (prompt)",
         TapRequest(capture="model.layers.16.resid", positions="prompt"), 64, 128, False),
        ("prefill 64x128 = 8192 tokens, capture 32 layers + steer",
         TapRequest(capture="model.layers.*.resid", params=steer), 64, 128, False),
    ]
    print("| step | host ms (median) |\n|---|---:|")
    for name, ask, n, plen, decode in cases:
        records, batch = scenario(plan, layout, ask, n, plen, decode)
        print(f"| {name} | {time_step(layout, records, batch):.3f} |")


if __name__ == "__main__":
    main()
