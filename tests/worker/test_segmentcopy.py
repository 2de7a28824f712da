"""One step's segments into their requests' host storage (tapc/worker/segmentcopy.py): issued in
one batch, or one by one when the batch declines, and a repeated step by its kept addresses."""
import ctypes

import numpy as np
import torch
from engine_toy import host_batch
from segment_cases import check, copy_stream, cpu_alloc, segments_and_pool

from tapc.worker.segmentcopy import Repeated, copy_segments
from tapc.worker.step import Segment
from tapc.worker.storage import Store

STREAM = copy_stream()


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
