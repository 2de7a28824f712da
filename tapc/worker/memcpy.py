"""One step's capture copies to host memory: each segment's rows into its request's storage,
all in one driver call where the driver has it.

A step at batch 64 that captures every layer copies one block per request from the device to
that request's host storage: 64 `copy_` calls, a few microseconds of host time each, on the
host's critical path (vLLM's own host loop nearly fills the GPU's decode step at that batch).
`cuMemcpyBatchAsync_v2` (the CUDA driver's batched copy, CUDA 13) issues them all at once, in
stream order, on the copy engines, flagged to overlap with compute. A step of a few copies
(decode at batch 1) makes one `cuMemcpyDtoHAsync_v2` a copy instead: in a running engine the
batched call took 45-60 us of the engine thread's CPU time for one to three copies
(profile_step on the Qwen3-30B-A3B shape, benchmarks/results/findings-engine.md).

Loaded through ctypes from libcuda; where the driver lacks it, or a call fails, the caller
falls back to one `copy_` per block (`copy_segments`), and a failure is logged once.
"""
from __future__ import annotations

import array
import ctypes
import logging
from operator import attrgetter
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from tapc.worker.cugraph import bind, check

if TYPE_CHECKING:
    from tapc.worker.step import Segment

log = logging.getLogger("tapc")

_SRC_ACCESS_ORDER_STREAM = 0x1      # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the source in stream order
# The batch refuses the legacy default stream (handle 0), which is torch's default stream and the
# V1 runner's compute stream. The per-thread default stream (CU_STREAM_PER_THREAD) is a blocking
# stream, so the driver orders it with the legacy stream both ways: the copies start after the
# legacy stream's earlier work (the forward) and its later work (an event, the next forward) waits
# for them, the same order as on the legacy stream itself, with no event or stream call added.
_LEGACY_STREAM, _PER_THREAD_STREAM = 0x0, 0x2
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
FEW_COPIES = 8   # up to this many, one driver call a copy (BatchCopy.few)


class _Location(ctypes.Structure):   # CUmemLocation: a hint, ignored for non-managed memory
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes_v1, fields in the header's order
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


class BatchCopy:
    """Device-to-host copies by address: up to `few` one driver call each, more in one batch."""

    def __init__(self, fn, one):
        self._fn = bind(fn, [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                             ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(_Attributes),
                             ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p])
        self._one = bind(one, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p])
        self._attrs = _Attributes(_SRC_ACCESS_ORDER_STREAM, _Location(), _Location(), _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        self._first = (ctypes.c_size_t * 1)(0)   # the one attribute set applies from copy 0 on
        self.few = FEW_COPIES
        self.failed = False

    @classmethod
    def load(cls) -> "BatchCopy | None":
        """The driver's batched copy, or None where there is none (no driver, or older than 13)."""
        try:
            # PyDLL keeps the GIL over the call (a few microseconds in the driver): a release would
            # let vLLM's output thread take it, and the engine's step wait for it back
            lib = ctypes.PyDLL("libcuda.so.1")
            return cls(lib.cuMemcpyBatchAsync_v2, lib.cuMemcpyDtoHAsync_v2)
        except (OSError, AttributeError):
            return None

    def __call__(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> bool:
        """Copy sizes[i] bytes from device address srcs[i] to host address dsts[i] for all i, on
        `stream` (a `cuda_stream` handle; for the batch, the legacy default stream, 0, is stood in
        for by the per-thread one). False when they were not all issued: the caller copies them
        one by one (a copy issued twice writes the same bytes)."""
        if self.failed:
            return False
        n = len(dsts)
        if n == 0:
            return True
        if n <= self.few:
            if isinstance(dsts, np.ndarray):   # ctypes takes Python ints
                dsts, srcs, sizes = dsts.tolist(), srcs.tolist(), sizes.tolist()
            handle = ctypes.c_void_p(stream)
            for i in range(n):
                err = self._one(dsts[i], srcs[i], sizes[i], handle)
                if err != 0:
                    return self._fail("cuMemcpyDtoHAsync_v2", err)
            return True
        if stream == _LEGACY_STREAM:
            stream = _PER_THREAD_STREAM
        err = self._fn(_c_array(ctypes.c_uint64, dsts), _c_array(ctypes.c_uint64, srcs), _c_array(ctypes.c_size_t, sizes),
                       n, ctypes.byref(self._attrs), self._first, 1, ctypes.c_void_p(stream))
        if err != 0:
            return self._fail("cuMemcpyBatchAsync_v2", err)
        return True

    def _fail(self, call: str, err: int) -> bool:
        self.failed = True
        log.warning("tapc: %s failed (CUresult %d); captures are copied by torch from now on", call, err)
        return False


_EVENT_DISABLE_TIMING = 0x2   # CU_EVENT_DISABLE_TIMING
_NOT_READY = 600              # CUDA_ERROR_NOT_READY


class DriverEvents:
    """Events after a step's copies, made and recorded by the driver through `ctypes.PyDLL`,
    which keeps the GIL: torch's `Event.record` lets it go (THCPEvent_record), and under a
    served load another thread of the engine's process (vLLM's output thread) may take it then
    and hold the step until its burst ends; and in a running engine torch's took 17-21 us of the
    engine thread's CPU a step (profile_step). A direct step's (copyout.py), where the driver has
    them; the copies and their order are the same either way."""

    def __init__(self, keep, free):
        vp = ctypes.c_void_p
        self._create = bind(keep.cuEventCreate, [ctypes.POINTER(vp), ctypes.c_uint])
        self._record = bind(keep.cuEventRecord, [vp, vp])
        self._query = bind(keep.cuEventQuery, [vp])
        self._sync = bind(free.cuEventSynchronize, [vp])   # a wait: the GIL goes meanwhile
        # Events no one reads any more (`DriverEvent.__del__`), recorded again by a later step:
        # a step costs one driver call, not three (create, record, destroy). As many as were
        # ever read at once; they last as long as the engine.
        self._free: list[ctypes.c_void_p] = []

    @classmethod
    def load(cls) -> "DriverEvents | None":
        try:
            return cls(ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def record(self, stream: int) -> "DriverEvent":
        """An event recorded on `stream` (a `cuda_stream` handle) after the work queued there."""
        if self._free:
            event = self._free.pop()
        else:
            event = ctypes.c_void_p()
            check(self._create(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
        done = DriverEvent(self, event)
        check(self._record(event, ctypes.c_void_p(stream)), "cuEventRecord")
        return done


class DriverEvent:
    """One event of `DriverEvents`, read as a torch event is (`query`, `synchronize`)."""

    def __init__(self, events: DriverEvents, handle: ctypes.c_void_p):
        self._events, self._handle = events, handle

    def query(self) -> bool:
        err = self._events._query(self._handle)
        if err == _NOT_READY:
            return False
        check(err, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        check(self._events._sync(self._handle), "cuEventSynchronize")

    def __del__(self):
        self._events._free.append(self._handle)


def _c_array(ctype, values: "list[int] | np.ndarray"):
    """A C array of 64-bit `values`: over a uint64 numpy array as it is, or over an array.array,
    which fills its buffer in C: 8x faster than `(ctype * n)(*values)`, 20 us a list at batch 64
    with three capture groups. The ctypes array keeps the buffer alive."""
    buffer = values if isinstance(values, np.ndarray) else array.array("Q", values)
    return (ctype * len(values)).from_buffer(buffer)


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
