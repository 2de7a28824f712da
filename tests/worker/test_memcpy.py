"""The CUDA driver's calls for copy-out (tapc/worker/memcpy.py): the batched copy as the driver
sees it, on stand-ins and on a GPU, and the driver's events."""
import ctypes
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from segment_cases import check, copy_stream, segments_and_pool

from tapc.worker.memcpy import BatchCopy, DriverEvents
from tapc.worker.segmentcopy import copy_segments

STREAM = copy_stream()
HANDLE = STREAM.cuda_stream


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

    # a repeated step's addresses come as uint64 arrays (segmentcopy.Repeated): the same copies either way
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
