"""A step's capture copies issued in one batch, or one by one when the batch declines."""
import ctypes
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from engine_toy import host_batch

from tapc.worker.step import Segment
from tapc.worker.memcpy import BatchCopy, DriverEvents, Repeated, copy_segments
from tapc.worker.storage import Store


def cpu_alloc(rows, caps, width, dtype):
    return torch.zeros(rows, caps, width, dtype=dtype)


def segments_and_pool(device="cpu", alloc=cpu_alloc):
    """Two requests' blocks in one pool: 3 rows x 2 captures, then 1 row x 1 capture."""
    torch.manual_seed(0)
    pool = torch.randn(16, 5, device=device)
    a = Store(0, np.array([0, 1]), 5, torch.float32, alloc, first=4)
    b = Store(0, np.array([1]), 5, torch.float32, alloc, first=4)
    return [Segment(a, 0, 3), Segment(b, 6, 1)], pool, a, b


# A stream as copy_segments reads it: its handle for the batch, and the one-by-one copies made
# under it (a real one where there is a GPU: entering a stand-in fails there).
STREAM = torch.cuda.Stream() if torch.cuda.is_available() else NS(cuda_stream=1234)
HANDLE = STREAM.cuda_stream


def check(pool, a, b):
    torch.testing.assert_close(a.chunks[0][:3].reshape(6, 5).cpu(), pool[:6].cpu(), rtol=0, atol=0)
    torch.testing.assert_close(b.chunks[0][:1].reshape(1, 5).cpu(), pool[6:7].cpu(), rtol=0, atol=0)


def test_a_declined_batch_falls_back_to_one_copy_each():
    segments, pool, a, b = segments_and_pool()
    copy_segments(segments, [pool], lambda dsts, srcs, sizes, stream: False, STREAM)
    check(pool, a, b)


def test_an_issued_batch_is_the_only_copy():
    """The batch gets every block by address, as the driver would; its copies (here: from a
    pool + 1 at the same offsets, to tell them apart) are the ones that land, with no fallback
    copy after them."""
    segments, pool, a, b = segments_and_pool()
    other = pool + 1

    def batch(dsts, srcs, sizes, stream):
        assert stream == STREAM.cuda_stream
        for d, s, n in zip(dsts, srcs, sizes):
            assert pool.data_ptr() <= s and s + n <= pool.data_ptr() + pool.numel() * pool.element_size()
            ctypes.memmove(d, other.data_ptr() + (s - pool.data_ptr()), n)
        return True

    copy_segments(segments, [pool], batch, STREAM)
    check(other, a, b)


def test_without_a_stream_the_batch_goes_on_the_current_one(monkeypatch):
    """With no stream named (a direct step, on the compute stream) the batch gets the current
    stream's handle for the pools' device, and a declined batch still lands every block."""
    segments, pool, a, b = segments_and_pool()
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: ("current on", device))
    asked = []

    def batch(dsts, srcs, sizes, stream):
        asked.append(stream)
        return False

    copy_segments(segments, [pool], batch)
    assert asked == [("current on", pool.get_device())]
    check(pool, a, b)


def test_blocks_that_straddle_chunks_go_to_both_by_address():
    """A store that grows mid-step: the block lands in its first chunk's last rows and its new
    chunk's first, in order, through the batch's addresses and through the fallback alike."""
    for batch in (None, "memmove"):
        torch.manual_seed(1)
        pool = torch.randn(12, 5)
        st = Store(0, np.array([0, 1]), 5, torch.float32, cpu_alloc, first=2)
        st.take(1)   # one row written before this step: one left in the first chunk

        copy_segments([Segment(st, 2, 3)], [pool], host_batch if batch else None, STREAM)
        assert len(st.chunks) == 2, "it grew"
        got = torch.cat([c[:n] for c, n in st.filled()])[1:].reshape(-1, 5)
        torch.testing.assert_close(got, pool[2:8], rtol=0, atol=0)


def test_a_step_that_repeats_the_last_copies_to_each_stores_next_rows():
    """`Repeated`: steps handed the same segment list (fill.py `Repeat`'s kept step) copy, by the
    kept addresses, into each store's next rows, whatever the pools hold each step; a store
    that must grow a chunk, another list, or a pool at another address take the full path,
    and every row still lands where its store says."""
    torch.manual_seed(2)
    pools = [torch.empty(8, 5), torch.empty(8, 3, dtype=torch.float64)]
    a = Store(0, np.array([0, 1]), 5, torch.float32, cpu_alloc, first=4)   # grows on its fifth step
    b = Store(1, np.array([0]), 3, torch.float64, cpu_alloc, first=16)
    c = Store(0, np.array([1]), 5, torch.float32, cpu_alloc, first=16)
    segments = [Segment(a, 0, 1), Segment(b, 2, 1), Segment(c, 4, 1)]
    last, fast, sent = Repeated(), [], []
    last.MANY = 1   # the fast path whatever the count
    addresses = last.addresses

    def spied(segs, bases):
        got = addresses(segs, bases)
        fast.append(got is not None)
        return got

    last.addresses = spied
    for step in range(7):
        for pool in pools:
            pool.copy_(torch.randn(pool.shape))
        sent.append([pools[0][0:2].clone(), pools[1][2:3].clone(), pools[0][4:5].clone()])
        segs = segments if step != 5 else list(segments)   # step 5: a list of its own
        copy_segments(segs, pools, host_batch, STREAM, last)
    # step 0 keeps, 1-3 repeat, 4 grows a's chunk (full path), 5 is another list, 6 keeps again
    assert fast == [False, True, True, True, False, False, False], fast
    for k, (st, width) in enumerate(((a, 5), (b, 3), (c, 5))):
        got = torch.cat([ch[:n] for ch, n in st.filled()])
        assert st.rows == 7 and got.shape[0] == 7
        want = torch.stack([s[k].reshape(-1, width) for s in sent])
        torch.testing.assert_close(got.reshape(7, -1, width), want.reshape(7, -1, width), rtol=0, atol=0)
    assert len(a.chunks) == 2 and len(b.chunks) == 1
    copy_segments(segments, [pools[0].clone(), pools[1]], host_batch, STREAM, last)   # a pool elsewhere
    assert fast[-1] is False and a.rows == 8


def test_the_batch_hands_the_driver_every_address_size_and_the_stream():
    """`BatchCopy` as the driver sees it (stand-ins for cuMemcpyBatchAsync_v2 and
    cuMemcpyDtoHAsync_v2 that copy with memmove): past `few` copies, the arrays of destinations,
    sources and sizes, their count, one attribute set from copy 0, and the stream named; up to
    `few`, one call a copy on the stream named; a driver error turns both off for good."""
    seen, each = [], []

    def driver(dsts, srcs, sizes, n, attrs, first, count, stream):
        seen.append((n, [first[i] for i in range(count)], count, stream.value))
        for i in range(n):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0

    def one(dst, src, size, stream):
        each.append((size, stream.value))
        ctypes.memmove(dst, src, size)
        return 0

    segments, pool, a, b = segments_and_pool()
    batch = BatchCopy(driver, one)
    batch.few = 0
    copy_segments(segments, [pool], batch, STREAM)
    check(pool, a, b)
    assert seen == [(2, [0], 1, HANDLE)] and each == []
    # the legacy default stream (0), which the batch refuses, goes as the per-thread one (0x2)
    assert batch([pool.data_ptr()], [pool.data_ptr()], [4], 0)
    assert seen[1] == (1, [0], 1, 0x2)

    segments, pool, a, b = segments_and_pool()
    copy_segments(segments, [pool], BatchCopy(driver, one), STREAM)   # two copies: one call each
    check(pool, a, b)
    assert len(seen) == 2 and each == [(6 * 5 * 4, HANDLE), (5 * 4, HANDLE)]
    assert BatchCopy(driver, one)([pool.data_ptr()], [pool.data_ptr()], [4], 0)
    assert each[2] == (4, None), "one copy goes on the legacy stream itself (ctypes reads handle 0 as None)"

    # a repeated step's addresses come as uint64 arrays (memcpy.Repeated): the same copies either way
    dst, src = torch.zeros(4), torch.arange(1.0, 5.0)
    for few in (0, 8):
        copies = BatchCopy(driver, one)
        copies.few = few
        assert copies(*(np.array([v], dtype=np.uint64) for v in (dst.data_ptr(), src.data_ptr(), 16)), HANDLE)
        assert torch.equal(dst, src), f"few={few}"
        dst.zero_()
    assert seen[-1][0] == 1 and each[-1] == (16, HANDLE)

    def failing(*args):
        return 1   # CUDA_ERROR_INVALID_VALUE

    for few in (0, 8):
        segments, pool, a, b = segments_and_pool()
        batch = BatchCopy(failing, failing)
        batch.few = few
        copy_segments(segments, [pool], batch, STREAM)
        assert batch.failed
        check(pool, a, b)   # copied one by one instead


def test_the_driver_events_no_one_reads_are_recorded_again():
    """`DriverEvents` with stand-ins for the driver's event calls: an event is made only when
    every one made before is still read (held by a store, a collect); once none holds it, a
    later step records it again, on that step's stream."""
    made, recorded = [], []

    def create(ptr, flags):
        ptr._obj.value = 100 + len(made)
        made.append(ptr._obj.value)
        return 0

    lib = NS(cuEventCreate=create, cuEventRecord=lambda ev, stream: recorded.append((ev.value, stream.value)) or 0,
             cuEventQuery=lambda ev: 0, cuEventSynchronize=lambda ev: 0)
    events = DriverEvents(lib, lib)
    held = [events.record(7) for _ in range(3)]
    assert made == [100, 101, 102] and recorded == [(100, 7), (101, 7), (102, 7)]
    keep = held[1]
    del held   # two of them read by no one any more
    again = [events.record(8), events.record(8), events.record(8)]
    assert made == [100, 101, 102, 103], "one made: the other two steps recorded the freed events"
    assert sorted(recorded[3:]) == [(100, 8), (102, 8), (103, 8)]
    assert keep.query() and all(e.query() for e in again)


def counted(batch: BatchCopy, few: int) -> list:
    """The driver calls `batch` makes from now on: the batch's copy counts, or 1 a copy."""
    issued, many, one = [], batch._fn, batch._one
    batch.few = few
    batch._fn = lambda *args: issued.append(args[3]) or many(*args)
    batch._one = lambda *args: issued.append(1) or one(*args)
    return issued


CALLS = pytest.mark.parametrize("few,calls", [(0, [2]), (8, [1, 1])], ids=["one batched call", "a call a copy"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@CALLS
def test_driver_copies_device_blocks_into_registered_host_memory(few, calls):
    batch = BatchCopy.load()
    assert batch is not None, "the driver has no cuMemcpyBatchAsync_v2 (CUDA 13 driver API)"

    pinned = []

    def registered(rows, caps, width, dtype):
        t = torch.zeros(rows, caps, width, dtype=dtype)
        assert int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0
        pinned.append(t)
        return t

    segments, pool, a, b = segments_and_pool("cuda", registered)
    stream = torch.cuda.Stream()
    issued = counted(batch, few)
    stream.wait_stream(torch.cuda.current_stream())
    copy_segments(segments, [pool], batch, stream)
    stream.synchronize()
    try:
        assert issued == calls
        assert not batch.failed
        check(pool, a, b)
    finally:   # the next case's host memory may lie at the same addresses
        for t in pinned:
            assert int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@CALLS
def test_on_the_legacy_default_stream_the_copies_keep_their_order(few, calls):
    """torch's default stream (the V1 runner's compute stream) is the legacy one, which the driver's
    batch refuses; the batch goes on the per-thread default stream instead, which the driver orders
    with it both ways (one call a copy goes on the legacy stream itself). A forward still running
    when the copies are issued (a sleep, then the pool written) lands whole, and the next
    forward's overwrite, issued right after, waits for them."""
    batch = BatchCopy.load()
    assert batch is not None, "the driver has no cuMemcpyBatchAsync_v2 (CUDA 13 driver API)"
    legacy = torch.cuda.default_stream()
    assert legacy.cuda_stream == 0
    issued = counted(batch, few)
    with torch.cuda.stream(legacy):
        segments, pool, a, b = segments_and_pool("cuda", lambda rows, caps, width, dtype: torch.zeros(
            rows, caps, width, dtype=dtype, pin_memory=True))
        want = pool.clone()
        pool.fill_(-1.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)   # tens of ms of GPU time before the pool holds its rows
        pool.copy_(want)
        copy_segments(segments, [pool], batch, legacy)
        pool.fill_(-7.0)                # the next forward
        done = torch.cuda.Event()
        done.record(legacy)
    done.synchronize()
    assert issued == calls and not batch.failed, "the copies were issued, not declined"
    check(want, a, b)
