"""One step's host work in the engine worker, on the CPU: filling the row tables and the
copy-out bookkeeping, for the bench_engine.py plan (Llama-3.1-8B shape: 32 layers' residual
streams captured, one steering edit).

    python3 benchmarks/bench_host.py
    python3 benchmarks/bench_host.py --moe     # bench_moe.py's plan (vLLM's tree of its shape, on meta)
    python3 benchmarks/bench_host.py --device  # on a GPU: fill, upload and copy-out as the worker runs them
    python3 benchmarks/bench_host.py --device --contend   # the same beside a thread that wants the GIL (the driver's and torch's events)
    python3 benchmarks/bench_host.py --device --busy      # the same behind a long kernel (a call that waits shows)
    python3 benchmarks/bench_host.py --requests  # the caller's check of bench_tracing.py's patched requests

The pools and host storage live on the meta device and the copies are built as the GPU path
builds them, one batch of addresses for the driver (`issued`), but not sent: on the GPU they
are asynchronous and only their issue is host time. The last row is a served batch of
bench_serve's default mix (`served_scenario`). A decode step that repeats the last one (the same requests, one position on) is not
filled (tapc/worker/rings.py `Repeat`): the last column times those. Async scheduling overlaps this with the previous step on the GPU (about 12 ms at
batch 64 for an 8B model, 4.6 ms at batch 1), beside vLLM's own host work.
"""
import contextlib
import functools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tapc.wire.protocol import WireRequest  # noqa: E402
from tapc.api.requests import TapRequest, check  # noqa: E402
from tapc.worker.fill import fill_step, tapped_of  # noqa: E402
from tapc.worker.layout import Layout  # noqa: E402
from tapc.worker.segmentcopy import Repeated, copy_segments  # noqa: E402
from tapc.worker.records import Record  # noqa: E402
from tapc.worker.rings import Repeat  # noqa: E402
from tapc.worker.step import StepBatch  # noqa: E402
from tapc.plan.planner import build_plan  # noqa: E402
from tapc.plan.tree import ModuleTree, Node  # noqa: E402

HIDDEN, LAYERS, ROWS, SEQS = 4096, 32, 8192, 256
TAPS = ["model.layers.*.resid", "model.layers.16.resid | add(steer, alpha=4.0)"]


def tree(layers: int = LAYERS) -> ModuleTree:
    nodes = [Node("model", "LlamaModel", "tensor", HIDDEN, HIDDEN), Node("model.layers", "ModuleList", "none", None, None)]
    nodes += [Node(f"model.layers.{i}", "LlamaDecoderLayer", "pair", HIDDEN, HIDDEN, layer=i) for i in range(layers)]
    return ModuleTree(model="bench", architecture="LlamaForCausalLM", hidden_size=HIDDEN, num_layers=layers,
                      vocab_size=128256, dtype="bfloat16", layers_path="model.layers", vllm_version="0.26.0",
                      nodes=tuple(nodes))


def meta_alloc(rows, caps, width, dtype):
    return torch.empty((rows, caps, width), dtype=dtype, device="meta")


def record(layout, rid: str, checked, prompt_len: int, max_tokens: int = 128, alloc=meta_alloc) -> Record:
    """A request's record as the worker admits it (its storage from `alloc`), its edits (if any)
    bound to slot 0."""
    rec = Record(layout, rid, WireRequest(rid, checked), prompt_len, max_tokens, alloc)
    rec.slot = 0 if rec.edits else -1
    return rec


def scenario(plan, layout, ask: TapRequest, n_reqs: int, prompt_len: int, decode: bool, make=record):
    """(records, step arguments): n_reqs requests, all decoding one token at position
    prompt_len + 5, or all prefilling their whole prompt in one step. `make`: `record`, or one
    with other storage."""
    checked = check(plan, ask, "bench")
    rids = [f"r{i}" for i in range(n_reqs)]
    records = {rid: make(layout, rid, checked, prompt_len) for rid in rids}
    per = 1 if decode else prompt_len
    qsl = np.arange(n_reqs + 1, dtype=np.int32) * per
    computed = np.full(n_reqs, prompt_len + 5 if decode else 0, dtype=np.int32)
    prompt_lens = np.full(n_reqs, prompt_len, dtype=np.int32)
    padded = int(qsl[-1])
    return records, StepBatch(rids, qsl, computed, prompt_lens, padded)


def served_scenario(plan, layout, steer: dict, n_reqs: int = 64, prefilling: int = 2, prompt_len: int = 230,
                    make=record):
    """(records, step) of a served batch as bench_serve's default mix makes them: of n_reqs
    requests 40% untapped, 20% capturing (positions all, prompt, generated, last in turn), 25%
    steered, 15% both; the first `prefilling` run their whole prompt, the others decode."""
    rng = np.random.default_rng(0)
    asks = {"capture": [TapRequest(capture="model.layers.*.resid", positions=p)
                        for p in ("all", "prompt", "generated", "last")],
            "steer": [TapRequest(params=steer)],
            "both": [TapRequest(capture="model.layers.*.resid", positions=p, params=steer) for p in ("all", "generated")]}
    records, rids = {}, [f"r{i}" for i in range(n_reqs)]
    for i, rid in enumerate(rids):
        kind = ("untapped", "capture", "steer", "both")[int(np.searchsorted([0.4, 0.6, 0.85], rng.random(), side="right"))]
        if kind != "untapped":
            records[rid] = make(layout, rid, check(plan, asks[kind][i % len(asks[kind])], "bench"), prompt_len)
    per = np.array([prompt_len] * prefilling + [1] * (n_reqs - prefilling))
    qsl = np.concatenate([[0], np.cumsum(per)]).astype(np.int32)
    computed = np.where(per > 1, 0, prompt_len + 10).astype(np.int32)
    return records, StepBatch(rids, qsl, computed, np.full(n_reqs, prompt_len, dtype=np.int32), int(qsl[-1]))


def issued(dsts, srcs, sizes, stream) -> bool:
    """The driver's batched copy (memcpy.BatchCopy) as issued: the addresses are built, the call
    itself (asynchronous, one ctypes call) is left out."""
    return True


class Stream:
    """A stream as copy_segments reads it (the batched copy is issued only on a named stream)."""

    cuda_stream = 1


def time_step(layout, records, batch: StepBatch, repeats: int = 200, repeating: bool = False, fill=None) -> float:
    """Median host ms of one step's fill and copy-out bookkeeping. `repeating`: decode steps
    that each repeat the last (the runner's `Repeat`: no fill), one position on each time.
    `fill`: the compiled fill (fill_jit.CompiledFill, the engine's) in place of numpy's."""
    fill = fill or functools.partial(fill_step, layout)
    table = np.empty((layout.table_rows, ROWS), dtype=np.int32)
    pools = [torch.empty(len(g.caps) * ROWS, g.width, dtype=getattr(torch, g.dtype), device="meta")
             for g in layout.groups]
    repeat, last = Repeat(), Repeated()
    if repeating:
        tapped = tapped_of(records, batch)
        repeat.keep(batch, tapped, fill_step(layout, table[:, :batch.padded], tapped, batch))
    times = []
    for k in range(repeats):
        for rec in records.values():
            if repeating:   # each step a store's next row, as in an engine (a store that grows: the median's not)
                continue
            for st in rec.stores:   # the same rows again (no store grows)
                st.rows = 0
            rec.next_pos = 0        # every repeat captures the same step again
        step = replace(batch, num_computed=batch.num_computed + k + 1) if repeating else batch
        t0 = time.perf_counter()
        got = repeat.same(step) if repeating else fill(table[:, :batch.padded], tapped_of(records, batch), batch)
        copy_segments(got[0], pools, issued, Stream(), last)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def moe_main():
    """bench_moe.py's engine plan (24 layers of the Qwen3-30B-A3B shape: residual streams, gate
    logits, the router's weights and expert ids) at its decode batches: one capture group per
    width and dtype, so a router capture is three segments a request where the residual is one."""
    from bench_moe import QWEN3_30B_A3B, RESID, ROUTER, model_dir

    plan = build_plan(model_dir(QWEN3_30B_A3B, 24), [RESID, *ROUTER], max_num_batched_tokens=ROWS, max_num_seqs=128)
    layout = Layout(plan)
    print("| step (MoE plan) | host ms (median) | repeating the last step |\n|---|---:|---:|")
    for name, cap in (("residual", RESID), ("router", ROUTER), ("residual + router", [RESID, *ROUTER])):
        for n in (1, 64):
            ask = TapRequest(capture=cap)
            fresh = time_step(layout, *scenario(plan, layout, ask, n, 512, True))
            again = time_step(layout, *scenario(plan, layout, ask, n, 512, True), repeating=True)
            print(f"| decode {n}, capture {name} 24 layers | {fresh:.3f} | {again:.3f} |")


class Contender:
    """A thread like vLLM's output thread in a served engine core: bursts of Python work that
    hold the GIL (`burst_s`, as encoding a step's outputs does), then a wait that lets it go
    (`idle_s`, as the socket's send and the queue's get do). A call on the timed thread that lets
    the GIL go while this one waits for it hands it over, and waits for the burst to end."""

    def __init__(self, burst_s: float = 300e-6, idle_s: float = 300e-6):
        import threading
        self.burst_s, self.idle_s = burst_s, idle_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            end = time.perf_counter() + self.burst_s
            while time.perf_counter() < end:
                pass
            time.sleep(self.idle_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def device_main():
    """`--device`: the same steps on the path the worker runs on a GPU, each part timed on the
    host: the fill, the table's upload (`Buffers.upload`) and the copy-out (`CopyOut.copy_out`:
    the snapshot, its events and the batched copy into pinned arena storage). The GPU has no
    forward to run between steps, so each part's time is its host work alone. Each case with
    numpy's fill and with the compiled one (the engine's), and once with torch's events for
    direct steps (where the driver has none) where the others have the driver's (the
    engine's); with `--contend`, again beside
    a `Contender` (torch's calls that reach the GPU let the GIL go); with `--busy`, again behind
    a long kernel, where a call that waits for the GPU takes the kernel's milliseconds."""
    from tapc.wire.arena import Arena
    from tapc.worker.buffers import Buffers
    from tapc.worker.copyout import CopyOut
    from tapc.worker.fill_jit import CompiledFill
    from tapc.worker.worker import _register

    dev = torch.device("cuda")
    arena = Arena(register=_register)
    arena.reserve(4 << 30)   # the cases' storage, pinned up front as `capture_memory_gib` does (no growth lines)
    # medians, and means in brackets: a thread that takes the GIL makes some calls wait its burst
    print("| step | fill us | upload us | copy-out us | segments |\n|---|---:|---:|---:|---:|")
    # their storage in pinned arena memory, as admitted (16 tokens each: under the reserve)
    make = functools.partial(record, max_tokens=16, alloc=arena.tensor)
    for layers in (8, 32):
        plan = build_plan("bench", TAPS[:1] + ["model.layers.1.resid | add(steer, alpha=4.0)"],
                          max_num_batched_tokens=ROWS, max_num_seqs=SEQS, tree=tree(layers))
        layout = Layout(plan)
        steer = {"steer": np.random.default_rng(0).standard_normal(HIDDEN).astype(np.float32)}
        cases = [("served: 64 of bench_serve's mix, 2 prefilling 230 tokens", served_scenario(plan, layout, steer, make=make)),
                 ("decode 64, capture every layer", scenario(plan, layout, TapRequest(capture="model.layers.*.resid"),
                                                             64, 100, True, make=make)),
                 # 64 KiB a step (8 layers: straight from the pools) or 256 KiB (32: through a snapshot)
                 ("decode 1, capture every layer", scenario(plan, layout, TapRequest(capture="model.layers.*.resid"),
                                                            1, 100, True, make=make))]
        # (label, a GIL-holding thread beside, a kernel of ~5 ms queued before each step, the
        # fill, whose events a direct step records: the driver's, the engine's, unless the label says torch's)
        modes = [("", False, False, None, "driver"), (", compiled fill", False, False, CompiledFill(layout), "driver"),
                 (", torch's events", False, False, None, "torch")]
        if "--contend" in sys.argv[1:]:
            modes.append((", beside a GIL-holding thread", True, False, None, "driver"))
            modes.append((", beside a GIL-holding thread, torch's events", True, False, None, "torch"))
        if "--busy" in sys.argv[1:]:   # a call that waits for the GPU takes the kernel's time
            modes.append((", the GPU busy", False, True, None, "driver"))
        buffers = Buffers(layout, ROWS, SEQS, 2, dev)
        copy_out = {}
        for events in {m[-1] for m in modes}:
            copy_out[events] = CopyOut(layout, buffers.pools, ROWS, SEQS, dev)
            if events == "torch":
                copy_out[events]._events = None   # as where the driver has none
        for name, (records, batch) in cases:
            for how, contend, busy, fill, events in modes:
                with Contender() if contend else contextlib.nullcontext():
                    parts, segs = time_device_step(layout, buffers, copy_out[events], records, batch, busy=busy,
                                                   fill=fill)
                cells = [f"{statistics.median(p[k] for p in parts) * 1e6:.0f} ({statistics.fmean(p[k] for p in parts) * 1e6:.0f})"
                         for k in range(3)]
                print(f"| {layers} layers, {name}{how} | {' | '.join(cells)} | {segs} |", flush=True)
        del buffers, copy_out
        torch.cuda.synchronize()


def time_device_step(layout, buffers, copy_out, records, batch: StepBatch, repeats: int = 200, busy: bool = False,
                     fill=None):
    """Each of `repeats` steps' (fill, upload, copy-out) host seconds, and the step's segments;
    `busy`: each step behind a kernel of about 5 ms, as a served step's calls are behind the
    forwards queued before them; `fill`: the compiled fill in place of numpy's."""
    fill = fill or functools.partial(fill_step, layout)
    parts, segs = [], 0
    for _ in range(repeats):
        for rec in records.values():
            rec.next_pos = 0
            for st in rec.stores:
                st.rows = 0
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(10_000_000)   # clock cycles: about 5 ms at the H200's 1.98 GHz
        t0 = time.perf_counter()
        step = fill(buffers.host_table(batch.padded), tapped_of(records, batch), batch)
        t1 = time.perf_counter()
        buffers.upload(batch.padded)
        t2 = time.perf_counter()
        copy_out.copy_out(*step)
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2))
        segs = len(step[0])
    return parts, segs


def requests_main(prompts: int = 128, rounds: int = 5):
    """The caller's host time a request before vLLM sees it (`TapSession.prepare_batch`: the
    check against the plan, the reach of its positions, the prefix-cache salt, the wire form)
    for bench_tracing.py's sweep: 32 taps `model.layers.i.resid | patch(clean_i)`, each request
    binding one of them with one 4096-wide row."""
    import gc

    from vllm import SamplingParams

    from tapc.api.session import TapSession

    plan = build_plan("bench", [f"model.layers.{i}.resid | patch(clean{i})" for i in range(LAYERS)],
                      max_num_batched_tokens=ROWS, max_num_seqs=SEQS, tree=tree())
    rng = np.random.default_rng(0)
    prompts_ = [{"prompt_token_ids": rng.integers(0, 128000, 64).tolist()} for _ in range(prompts) for _ in range(LAYERS)]
    clean = rng.standard_normal((prompts, HIDDEN)).astype(np.float32)
    asks = [TapRequest(params={f"clean{i}": {"positions": [10], "rows": clean[p][None]}})
            for p in range(prompts) for i in range(LAYERS)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for caching in (True, False):   # bench_tracing's engines run with prefix caching off
        session, times = TapSession(plan, prefix_caching=caching), []
        for _ in range(rounds):
            gc.collect()
            t0 = time.perf_counter()
            session.prepare_batch(prompts_, sp, asks)
            times.append((time.perf_counter() - t0) / len(asks) * 1e6)
        print(f"| {len(asks)} patched requests (bench_tracing's sweep), prefix caching {'on' if caching else 'off'} | "
              f"{statistics.median(times):.1f} us a request (rounds {min(times):.1f}-{max(times):.1f}) |")


def main():
    if "--requests" in sys.argv[1:]:
        return requests_main()
    if "--device" in sys.argv[1:]:
        return device_main()
    if "--moe" in sys.argv[1:]:
        return moe_main()
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
    from tapc.worker.fill_jit import CompiledFill

    compiled = CompiledFill(layout)
    print("| step | host ms (median), numpy's fill | the fill compiled (the engine's) | repeating the last step |\n"
          "|---|---:|---:|---:|")
    for name, ask, n, plen, decode in cases:
        records, batch = scenario(plan, layout, ask, n, plen, decode)
        fresh = time_step(layout, records, batch)
        fast = time_step(layout, records, batch, fill=compiled)
        again = f"{time_step(layout, *scenario(plan, layout, ask, n, plen, decode), repeating=True):.3f}" if decode else ""
        print(f"| {name} | {fresh:.3f} | {fast:.3f} | {again} |")
    records, batch = served_scenario(plan, layout, steer)
    print(f"| served: 64 requests of bench_serve's mix, 2 of them prefilling 230 tokens | "
          f"{time_step(layout, records, batch):.3f} | {time_step(layout, records, batch, fill=compiled):.3f} |  |")


if __name__ == "__main__":
    main()
