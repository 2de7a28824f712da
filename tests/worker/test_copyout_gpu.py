"""Copy-out on the device (tapc/worker/copyout.py): a prompt step's captures still on their way to
host memory while decode steps copy theirs, through their own snapshot or (a step of few bytes)
straight from the pools on the compute stream. Every row lands, the pools can be rewritten
right after each step, and a step's event covers every earlier step."""
import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, LAYERS, toy_plan

from tapc.worker.buffers import Buffers
from tapc.worker.copyout import DIRECT_BYTES, CopyOut
from tapc.worker.step import Segment
from tapc.worker.layout import Layout
from tapc.worker.memcpy import FEW_COPIES, DriverEvent
from tapc.worker.storage import Store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, SEQS = 1 << 18, 8          # a prompt step of 256K rows x 3 layers x 16 floats: 48 MiB to host memory


def pinned(rows, caps, width, dtype):   # a Store's chunk allocator
    return torch.empty(rows, caps, width, dtype=dtype, pin_memory=True)


# direct_bytes 0: every step through a snapshot; DIRECT_BYTES: decode steps (1.5 KiB) straight
PATHS = pytest.mark.parametrize("direct", [0, DIRECT_BYTES], ids=["snapshots", "direct"])


@pytest.mark.parametrize("few", [FEW_COPIES, 0], ids=["a driver call a copy", "one batched call"])
@PATHS
def test_decode_steps_copy_out_while_a_prompt_steps_copies_run_and_every_row_lands(direct, few):
    """`few`: up to how many copies a step makes one driver call each (SEQS here), not one batch."""
    plan = toy_plan(["model.layers.*.resid"], rows=ROWS, slots=SEQS)
    layout = Layout(plan)
    dev = torch.device("cuda")
    buffers = Buffers(layout, ROWS, SEQS, 2, dev)
    out = CopyOut(layout, buffers.pools, ROWS, SEQS, dev)
    out.direct_bytes = direct
    assert out._batch is not None, "the driver has no batched copy: the test would not test it"
    out._batch.few = few
    (pool,) = buffers.pools
    caps = np.arange(LAYERS)
    gen = torch.Generator(device=dev).manual_seed(0)
    # a prompt of ROWS - SEQS rows for request 0 and one for each other, then decode steps of a
    # row a request; some steps are prompt-sized again
    prompts = [ROWS - SEQS] + [1] * (SEQS - 1)
    stores = [Store(0, caps, HIDDEN, torch.float32, pinned, n + 64) for n in prompts]
    want = [[] for _ in stores]
    plan_steps = [prompts] + [[1] * SEQS] * 5 + [[ROWS // SEQS] * SEQS] + [[1] * SEQS] * 3
    out.count_nonfinite(True)
    nans = 0
    events = []
    assert out._small is not None
    for step, rows in enumerate(plan_steps):
        segs, start = [], 0
        for store, n in zip(stores, rows):
            segs.append(Segment(store, start, n))
            start += n * LAYERS
        # the forward writes the pool on the compute stream
        pool[:start].normal_(generator=gen)
        if step in (0, 7):
            pool[start - 1, 3] = float("nan")
            nans += 1
        for k, seg in enumerate(segs):
            want[k].append(pool[seg.start: seg.start + seg.rows * LAYERS].view(seg.rows, LAYERS, HIDDEN).cpu())
        events.append(out.copy_out(segs, [start]))
        # and the next forward rewrites it at once
        pool.fill_(-7.0)
    events[-1].synchronize()   # a collect waits for a request's last step only
    assert (out._small.freed is None) == bool(direct), "the decode steps took the other path"
    for store, rows in zip(stores, want):
        expect = torch.cat(rows)
        got = torch.cat([c.view(-1, LAYERS, HIDDEN) for c in store.chunks])[: store.rows]
        assert store.rows == len(expect)
        torch.testing.assert_close(got, expect, rtol=0, atol=0, equal_nan=True)
    assert out.nonfinite() == nans


@pytest.mark.parametrize("direct,events", [(0, "torch"), (DIRECT_BYTES, "torch"), (DIRECT_BYTES, "driver")],
                         ids=["snapshots", "direct", "direct, driver events"])
def test_every_step_copies_through_one_snapshot_when_the_pools_are_decode_sized(direct, events):
    """`events`: whose events a direct step's collect waits on: the driver's, or torch's (where
    the driver has none)."""
    plan = toy_plan(["model.layers.*.resid"], rows=SEQS, slots=SEQS)
    layout, dev = Layout(plan), torch.device("cuda")
    buffers = Buffers(layout, SEQS, SEQS, 2, dev)
    out = CopyOut(layout, buffers.pools, SEQS, SEQS, dev)
    out.direct_bytes = direct
    if events == "torch":
        out._events = None
    else:
        assert out._events is not None, "the driver has no events: the test would not test them"
    assert out._small is None
    (pool,) = buffers.pools
    store = Store(0, np.arange(LAYERS), HIDDEN, torch.float32, pinned, 64)
    want = []
    for _ in range(4):
        pool[: SEQS * LAYERS].normal_()
        want.append(pool[: SEQS * LAYERS].view(SEQS, LAYERS, HIDDEN).cpu())
        event = out.copy_out([Segment(store, 0, SEQS)], [SEQS * LAYERS])
        pool.fill_(-7.0)
    assert isinstance(event, DriverEvent) == (bool(direct) and events == "driver")
    event.synchronize()
    assert event.query()
    assert (out._big.freed is None) == bool(direct), "the steps took the other path"
    torch.testing.assert_close(store.chunks[0][: store.rows].view(-1, LAYERS, HIDDEN), torch.cat(want), rtol=0, atol=0)


def test_the_row_tables_go_up_whole_and_leave_the_columns_past_the_step():
    """`upload` of a step's host tables (random entries, every padded size from one row to all):
    the device's first `padded` columns of every table equal them once the stream is done, and
    the columns past them keep what they held."""
    plan = toy_plan(["model.layers.*.resid", "model.layers.1.resid | add(steer, alpha=2.0)"], rows=512, slots=SEQS)
    buffers = Buffers(Layout(plan), 512, SEQS, 2, torch.device("cuda"))
    rng = np.random.default_rng(0)
    for padded in (1, 7, 8, 136, 511, 512):
        buffers.table.fill_(-5)
        host = buffers.host_table(padded)
        host[:] = rng.integers(-1, 1 << 20, size=host.shape)
        want = host.copy()
        buffers.upload(padded)
        torch.cuda.current_stream().synchronize()
        got = buffers.table.cpu().numpy()
        assert (got[:, :padded] == want).all(), padded
        assert (got[:, padded:] == -5).all(), padded
