"""The hooks' stream work through the CUDA driver, keeping the GIL (buffers.py, with
`TAPC_STREAM_CALLS=driver`): the copy-out's events (recorded, waited on, queried and
synchronized) and copies between device buffers, the parameter rows' copies at admission
(`StreamOps`), and the row tables' upload as a copy kernel captured in CUDA graphs that the
driver launches (`UploadGraphs`).

A torch call that reaches the GPU lets the GIL go around it. In a served engine core, vLLM's
output thread is often waiting for the GIL then; it takes it, and the engine's thread waits for
the end of that thread's burst of Python before it launches the rest of the step. Beside such a
thread (`bench_host.py --device --contend`, H200 host, second session of 2026-12-02), the table
upload's torch copy took 53-419 us a step (medians) where the driver's 2-D copy took 13-20 us,
and with the upload by the driver the wait moved on to the copy-out's torch calls: a copy, two
events and two waits on a capturing step. These are their driver calls, bound through
`ctypes.PyDLL` like memcpy.py's copies and cugraph.py's graph calls; the GPU runs the same work
in the same order as torch's calls queue it. Only a collect's wait for an event
(`Event.synchronize`, which may take milliseconds) lets the GIL go. The upload stays a copy
kernel on the SMs, not the driver's 2-D copy (a DMA: buffers.py says why), launched from a graph.
"""
from __future__ import annotations

import bisect
import ctypes

import torch

from tapc.engine.cugraph import Driver, bind, check

_DISABLE_TIMING = 0x2   # CU_EVENT_DISABLE_TIMING, as torch.cuda.Event's default
_NOT_READY = 600        # CUDA_ERROR_NOT_READY


class StreamOps:
    """libcuda's event and device-copy calls, bound once (`load`); streams by their raw handle
    (`torch.cuda.Stream.cuda_stream`)."""

    def __init__(self, lib, releasing_lib):
        vp = ctypes.c_void_p
        self._create = bind(lib.cuEventCreate, [ctypes.POINTER(vp), ctypes.c_uint])
        self._record = bind(lib.cuEventRecord, [vp, vp])
        self._wait = bind(lib.cuStreamWaitEvent, [vp, vp, ctypes.c_uint])
        self._copy = bind(lib.cuMemcpyDtoDAsync_v2, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, vp])
        self._up = bind(lib.cuMemcpyHtoDAsync_v2, [ctypes.c_uint64, vp, ctypes.c_size_t, vp])
        self.query_fn = bind(lib.cuEventQuery, [vp])
        self.destroy_fn = bind(lib.cuEventDestroy_v2, [vp])
        self.synchronize_fn = bind(releasing_lib.cuEventSynchronize, [vp])

    @classmethod
    def load(cls) -> "StreamOps | None":
        """The calls, or None where there is no driver (the caller uses torch's)."""
        try:
            return cls(ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def event(self, stream: int) -> "Event":
        """A new event, recorded on `stream` after the work queued there."""
        handle = ctypes.c_void_p()
        check(self._create(ctypes.byref(handle), _DISABLE_TIMING), "cuEventCreate")
        event = Event(self, handle)
        check(self._record(handle, ctypes.c_void_p(stream)), "cuEventRecord")
        return event

    def wait(self, stream: int, event: "Event") -> None:
        """Work queued on `stream` from now on waits for `event`."""
        check(self._wait(ctypes.c_void_p(stream), event.handle, 0), "cuStreamWaitEvent")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """`nbytes` from device address `src` to `dst`, on `stream`."""
        check(self._copy(dst, src, nbytes, ctypes.c_void_p(stream)), "cuMemcpyDtoDAsync_v2")

    def copy_up(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """`nbytes` from pinned host address `src` to device address `dst`, on `stream` (what
        torch's non-blocking copy of a pinned tensor makes: a DMA)."""
        check(self._up(dst, ctypes.c_void_p(src), nbytes, ctypes.c_void_p(stream)), "cuMemcpyHtoDAsync_v2")


class Event:
    """A driver event, with as much of `torch.cuda.Event` as the engine's readers use (`query`,
    `synchronize`); destroyed with the object (the driver lets a pending one complete first)."""

    __slots__ = ("_ops", "handle")

    def __init__(self, ops: StreamOps, handle: ctypes.c_void_p):
        self._ops, self.handle = ops, handle

    def query(self) -> bool:
        """Whether the work before it is done."""
        err = self._ops.query_fn(self.handle)
        if err == _NOT_READY:
            return False
        check(err, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Wait for the work before it, letting the GIL go meanwhile."""
        check(self._ops.synchronize_fn(self.handle), "cuEventSynchronize")

    def __del__(self):
        self._ops.destroy_fn(self.handle)


class UploadGraphs:
    """The row tables' upload: torch's copy kernel from a pinned buffer (through its UVA view)
    into the device's `[tables, rows]` table, captured once for each buffer and each width (the
    powers of two up to `rows`, and `rows`), launched by the driver on the current stream.
    A step's host table is laid out at the width that holds its rows (`width`), the columns past
    them -1, so one graph serves every step of up to that many rows."""

    def __init__(self, table: torch.Tensor, sources: list[torch.Tensor], driver: Driver):
        k, rows = table.shape
        self.widths = self.widths_for(rows)
        self.driver = driver
        self.device = table.device.index
        # Captured on a side stream by hand: `torch.cuda.graph` would collect garbage and empty
        # torch's cache for each of these (2 x 14 graphs at 8192 rows) while the worker loads.
        side, here = torch.cuda.Stream(device=table.device), torch.cuda.current_stream(table.device)
        side.wait_stream(here)
        self.graphs: list[list[torch.cuda.CUDAGraph]] = []   # kept: their instantiated graphs are launched
        with torch.cuda.stream(side):
            for src in sources:
                per = []
                for w in self.widths:
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(capture_error_mode="thread_local")   # other threads' CUDA calls go on
                    table[:, :w].copy_(src[: k * w].view(k, w), non_blocking=True)
                    graph.capture_end()
                    per.append(graph)
                self.graphs.append(per)
        here.wait_stream(side)
        self.execs = [[g.raw_cuda_graph_exec() for g in per] for per in self.graphs]

    @staticmethod
    def widths_for(rows: int) -> list[int]:
        """The powers of two below `rows`, and `rows`."""
        return sorted({min(1 << i, rows) for i in range(rows.bit_length() + 1)})

    def width(self, padded: int) -> int:
        """The narrowest width that holds `padded` columns."""
        return self.widths[bisect.bisect_left(self.widths, padded)]

    def launch(self, source: int, padded: int) -> int:
        """The copy from pinned buffer `source` of the narrowest width that holds `padded`
        columns, on the current stream; that width."""
        i = bisect.bisect_left(self.widths, padded)
        self.driver.launch(self.execs[source][i], torch._C._cuda_getCurrentRawStream(self.device))
        return self.widths[i]
