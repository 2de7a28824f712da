"""One step's segments into their requests' host storage: each segment's rows from its group's
pool (or a snapshot of it) into its request's storage, all by address in one driver call where
the driver has it (memcpy.py `BatchCopy` says why); where it lacks it, or a call fails, one
`copy_` per block. A step that repeats the last copies by the addresses the last one kept
(`Repeated`).
"""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from tapc.worker.step import Segment


def copy_segments(segments: "list[Segment]", pools: list[torch.Tensor],
                  batch: Callable[[list[int], list[int], list[int], int], bool] | None = None,
                  stream: "torch.cuda.Stream | None" = None, last: "Repeated | None" = None) -> None:
    """Copy each segment's rows from its group's pool (or a snapshot of it) into its request's
    storage. Non-blocking: on the device, they go on `stream` (None: the current one), and the
    caller waits for it. `batch` (memcpy.BatchCopy) issues all the copies by address, in one
    call or one a copy (a step at batch 64 would otherwise make two tensor views a block, 5 us
    of host time each); where it is None or declines, each is one `copy_`. `last` keeps the
    addresses for a step that repeats this one (`Repeated`). The stream is named, not
    made current: entering `torch.cuda.stream` costs about 10 us of host time (H200 host), paid
    only by the one-by-one copies. Pools are contiguous `[rows, width]`, storage chunks
    contiguous `[rows, captures, width]`."""
    if batch is not None:
        # each pool's address and bytes a row, once: torch's accessors cost a microsecond a call
        bases = [(pool.data_ptr(), pool.shape[1] * pool.element_size()) for pool in pools]
        handle = stream.cuda_stream if stream is not None else torch._C._cuda_getCurrentRawStream(pools[0].get_device())
        again = last.addresses(segments, bases) if last is not None else None
        if again is not None:
            taken, addresses = again
            if batch(*addresses, handle):
                return
            _copy_on(stream, taken(), pools)
            return
    taken = [(seg, first) for seg in segments if (first := seg.store.take(seg.rows)) is not None]
    if not taken:
        return
    if batch is not None:
        dsts, srcs, sizes = [], [], []
        whole = len(taken) == len(segments)   # every block in its store's last chunk, so far
        for seg, first in taken:
            store = seg.store
            base, pool_row = bases[store.group]
            src = base + seg.start * pool_row
            if first >= store.last_base:   # the usual case: one block, in the last chunk
                dsts.append(store.last_ptr + (first - store.last_base) * store.row_bytes)
                srcs.append(src)
                sizes.append(seg.rows * store.row_bytes)
                continue
            whole = False
            for chunk, lo, n in store.span(first, seg.rows):
                size = n * store.row_bytes
                dsts.append(chunk.data_ptr() + lo * store.row_bytes)
                srcs.append(src)
                sizes.append(size)
                src += size
        if last is not None:
            last.keep(segments, bases, srcs, sizes) if whole else last.forget()
        if batch(dsts, srcs, sizes, handle):
            return
    _copy_on(stream, taken, pools)


class Repeated:
    """The last batched step's copies, for a step that repeats it. A decode step that repeats
    the last (rings.py `Repeat`) hands copy-out the very list of segments the last one had: the
    same stores, pool rows and sizes, and each store's next rows. So the sources and sizes are
    the same, and each destination moves on by what its store took. At batch 64 on the MoE
    plan, a step's 256 segments took 0.24 ms of a 2-core Xeon's host time to copy out, a tuple's
    worth of Python each (bench_host.py --moe). Now the stores' rows are read in one pass
    (`attrgetter`) and checked against what these copies left, and the addresses are numpy's.
    A store that must grow a chunk, another list or a pool elsewhere takes the full path. A
    store's rows move only by `Store.take`, on these copy paths and when kept prefix rows are
    admitted, which makes the next step's segments anew. Below `MANY` segments the full path
    is cheaper."""

    MANY = 16
    _rows = attrgetter("rows")

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        self.segments = None

    def keep(self, segments: "list[Segment]", bases: list, srcs: list[int], sizes: list[int]) -> None:
        """After a step whose every segment was one block in its store's last chunk. The arrays
        are made by the first step that repeats it: a step that none repeats (a served batch)
        pays nothing more here."""
        if len(segments) < self.MANY:
            self.forget()
            return
        self.segments, self.bases, self.srcs, self.sizes = segments, bases, srcs, sizes
        self.stores = None

    def _arrays(self) -> None:
        segments = self.segments
        self.stores = stores = [seg.store for seg in segments]
        n = len(segments)
        self.taking = np.fromiter((seg.rows for seg in segments), np.int64, n)
        self.rows = np.fromiter(map(self._rows, stores), np.int64, n)   # each store's rows now
        room = np.fromiter((st.room for st in stores), np.int64, n)
        # steps of these copies each store's last chunk has room for
        self.left = int(((room - self.rows) // self.taking).min())
        # the address of a store's row r: at + r * row_bytes, in its last chunk
        row_bytes = np.fromiter((st.row_bytes for st in stores), np.int64, n)
        self.at = np.fromiter((st.last_ptr - st.last_base * st.row_bytes for st in stores), np.int64, n)
        self.row_bytes = row_bytes
        self.srcs = np.array(self.srcs, dtype=np.uint64)
        self.sizes = np.array(self.sizes, dtype=np.uint64)

    def addresses(self, segments: "list[Segment]", bases: list) -> tuple[list, tuple] | None:
        """(taken, (dsts, srcs, sizes)) for a step whose segments are the kept ones (each store's
        rows taken), or None: the full path. `taken` is a callable: the (segment, first row)
        pairs, for copies one by one where the batch declines."""
        if segments is not self.segments or bases != self.bases:
            return None
        if self.stores is None:
            self._arrays()
        rows = self.rows
        if self.left < 1 or not np.array_equal(np.fromiter(map(self._rows, self.stores), np.int64, len(rows)), rows):
            self.forget()
            return None
        self.left -= 1
        self.rows = after = rows + self.taking
        for st, r in zip(self.stores, after.tolist()):
            st.rows = r
        dsts = (self.at + rows * self.row_bytes).astype(np.uint64)
        return (lambda: list(zip(segments, rows.tolist()))), (dsts, self.srcs, self.sizes)


def _copy_on(stream, taken: list, pools: list[torch.Tensor]) -> None:
    if stream is not None:
        with torch.cuda.stream(stream):
            _copy_each(taken, pools)
    else:
        _copy_each(taken, pools)


def _copy_each(taken: list, pools: list[torch.Tensor]) -> None:
    for seg, first in taken:
        pool, src = pools[seg.store.group], seg.start
        for chunk, lo, n in seg.store.span(first, seg.rows):
            dst = chunk[lo: lo + n].view(-1, chunk.shape[-1])
            dst.copy_(pool[src: src + dst.shape[0]], non_blocking=True)
            src += dst.shape[0]
