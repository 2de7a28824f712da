"""The CUDA driver's calls for a step's copy-out, loaded through ctypes from libcuda: the
batched device-to-host copy (`BatchCopy`) and events (`DriverEvents`); each `load` is None where
the driver lacks them.

A step at batch 64 that captures every layer copies one block per request from the device to
that request's host storage: 64 `copy_` calls, a few microseconds of host time each, on the
host's critical path (vLLM's own host loop nearly fills the GPU's decode step at that batch).
`cuMemcpyBatchAsync_v2` (the CUDA driver's batched copy, CUDA 13) issues them all at once, in
stream order, on the copy engines, flagged to overlap with compute. A step of a few copies
(decode at batch 1) makes one `cuMemcpyDtoHAsync_v2` a copy instead: in a running engine the
batched call took 45-60 us of the engine thread's CPU time for one to three copies
(profile_step on the Qwen3-30B-A3B shape, benchmarks/results/findings-engine.md).

Where the driver lacks the batched copy, or a call fails, the caller falls back to one `copy_`
per block (segmentcopy.py `copy_segments`), and a failure is logged once.
"""
from __future__ import annotations

import array
import ctypes
import logging

import numpy as np

from tapc.worker.cugraph import bind, check

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
