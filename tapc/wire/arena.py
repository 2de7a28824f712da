"""Host memory for captures, shared between the engine's worker and the API process.

Captures used to come back as bytes in the `collective_rpc` reply (msgpack over ZMQ: several
host copies of gigabytes). Instead the worker's side stream copies each request's rows into
an arena of files in /dev/shm (`TAPC_SHM_DIR`), mapped in the worker and, on the GPU,
registered as pinned memory once per file so the copies are asynchronous DMA. `collect`
answers with where the rows are (file, byte offset, rows), and the API hands them to the caller
as tensors over those same bytes, without a copy: gigabytes of captures cost the caller no
memcpy. A block's space goes back to the worker (`release`) once no tensor of the caller uses
it; until then the worker never writes there again.

Files are created when the arena runs out of room (segments of at least `SEGMENT_BYTES`) and
removed when the worker exits. They are kept for the engine's life unless the arena has a bound
(`keep`, the engine's `capture_memory_keep_gib`): then a segment that holds no block goes back
(unpinned, its pages freed, its file removed) while the others hold at least that much, newest
first; a later growth makes a file of a new name, so that no reader's old mapping of one is
taken for it. A worker that was killed cannot remove
them, so each arena holds a shared `flock` on its files while it lives, and a new arena removes
the files no process holds (`sweep`: older than a minute, so a file just made and not yet locked
is left alone; the lock, unlike a pid, is seen across containers that share /dev/shm). Their space is reserved when they are
made (`posix_fallocate`): a /dev/shm too small for the captures asked is a clear error when a
request is admitted, never a SIGBUS or a short capture.

Making and pinning a segment costs about a second a GiB (measured on an H200 host: 6.4 GiB of
admissions took 8 s), and growth happens while requests are admitted, on the step's path: every
request of the batch waits. It happens once per high-water mark (or, with a bound, per burst past
it), but a server's first burst or a harvest's first window pays it; `reserve` (the engine's
`capture_memory_gib`) pays it at start, and the bound never gives back what it reserved.
Pinning ahead on another thread would not help: `cudaHostRegister` holds up the launching
thread's graph replays while it runs (benchmarks/probes/probe_pin.py).
"""
from __future__ import annotations

import atexit
import bisect
import fcntl
import logging
import math
import mmap
import os
import re
import time
import uuid
import weakref
from typing import Callable

import numpy as np
import torch

from tapc import settings
from tapc.errors import EngineError, RequestError

log = logging.getLogger("tapc")

SEGMENT_BYTES = 1 << 30
ALIGN = 512       # bytes; keeps every block aligned for DMA and for any dtype
SEGMENT_NAME = re.compile(r"tapc-\d+-[0-9a-f]{8}-\d+")   # an arena's files (Arena.path)
STALE_S = 60.0    # a segment nobody locks, older than this, is a dead worker's


def shm_directory() -> str:
    """Where tapc's shared-memory files go: `TAPC_SHM_DIR`, else /dev/shm."""
    return settings.TAPC_SHM_DIR


class Arena:
    """`register(t)` pins a new segment's tensor and `unregister(t)` unpins one given back; `keep`:
    bytes kept once their blocks are free (None: every segment, for the engine's life)."""

    def __init__(self, register: Callable[[torch.Tensor], None] | None = None, directory: str | None = None,
                 segment_bytes: int = SEGMENT_BYTES, keep: int | None = None,
                 unregister: Callable[[torch.Tensor], None] | None = None):
        self.directory = directory or shm_directory()
        self.prefix = f"tapc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.register = register
        self.unregister = unregister
        self.segment_bytes = segment_bytes
        self.keep = keep
        # Segments by number, oldest first; a number is never reused (nor is its file's name).
        self.maps: dict[int, torch.Tensor] = {}              # uint8 over its file
        self.free: dict[int, list[tuple[int, int]]] = {}     # sorted (offset, size)
        self.held: dict[tuple[int, int], int] = {}           # (segment, offset) -> size
        self.segment: dict[str, int] = {}                    # file -> segment
        self.locks: dict[int, int] = {}                      # an open fd holding a shared flock
        self.made = 0                                        # segments made so far
        self.growth_s = 0.0                                  # seconds spent making and pinning segments
        atexit.register(self.close)
        self.swept = sweep(self.directory)

    @property
    def size(self) -> int:
        """Bytes of all segments, free or held."""
        return sum(m.numel() for m in self.maps.values())

    def reserve(self, nbytes: int) -> None:
        """Make (and pin) room for `nbytes` of captures now, at the engine's start, so that
        admissions up to that much never grow the arena on the step's path."""
        short = nbytes - self.size
        if short > 0:
            try:
                self._grow(-(-short // ALIGN) * ALIGN, why="reserved at start")
            except RequestError as e:
                raise EngineError(f"capture_memory_gib={nbytes / 2**30:g}: this GPU's worker cannot reserve it in "
                                  f"{self.directory}: {e}") from None
        if self.keep is not None:   # what was reserved at start is never given back
            self.keep = max(self.keep, self.size)

    def path(self, seg: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{seg}")

    def tensor(self, rows: int, caps: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """An empty `[rows, caps, width]` tensor in the arena (the `Alloc` of host storage)."""
        nbytes = rows * caps * width * dtype.itemsize
        size = -(-nbytes // ALIGN) * ALIGN
        seg, off = self._take(size)
        self.held[(seg, off)] = size
        return self.maps[seg][off: off + nbytes].view(dtype).view(rows, caps, width)

    def locate(self, t: torch.Tensor) -> tuple[str, int]:
        """(file, byte offset) of a tensor from `tensor` (or a view starting where it starts)."""
        p = t.data_ptr()
        for seg, m in self.maps.items():
            if m.data_ptr() <= p < m.data_ptr() + m.numel():
                return self.path(seg), p - m.data_ptr()
        raise ValueError("not a tensor of this arena")

    def owns(self, path: str) -> bool:
        """Whether `path` is one of this arena's files (each worker process has its own)."""
        return path in self.segment

    def give_back(self, path: str, off: int) -> None:
        """Free the block at (file, offset) that `tensor` gave out."""
        seg = self.segment.get(path, -1)
        size = self.held.pop((seg, off), None)
        if size is None:
            raise ValueError(f"{path} at {off}: no block of this arena starts there (given back twice?)")
        free = self.free[seg]
        i = bisect.bisect(free, (off, size))
        free.insert(i, (off, size))
        # Merge with the neighbours, so a freed run can take a block of any size again.
        if i + 1 < len(free) and off + size == free[i + 1][0]:
            free[i] = (off, size + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])
        if self.keep is not None and free == [(0, self.maps[seg].numel())]:
            self._shrink()

    def _shrink(self) -> None:
        """Give back segments that hold no block, newest first, while the rest hold `keep`."""
        for seg in reversed(list(self.maps)):
            size = self.maps[seg].numel()
            if self.free[seg] == [(0, size)] and self.size - size >= self.keep:
                self._drop(seg)

    def _drop(self, seg: int) -> None:
        """Unpin a segment, free its pages and remove its file. The pages go at once, whoever
        still maps the file (the API's reader, a client's views of blocks given back): nobody
        reads a block that was given back, and a truncated file holds no memory."""
        t, path = self.maps.pop(seg), self.path(seg)
        if self.unregister is not None:
            self.unregister(t)
        del self.free[seg], self.segment[path]
        fd = self.locks.pop(seg)
        os.ftruncate(fd, 0)
        os.unlink(path)
        os.close(fd)
        log.info("tapc: host memory for captures went back to %.2f GiB in %s (%.2f GiB held no capture)",
                 self.size / 2**30, self.directory, t.numel() / 2**30)

    def give_back_tensor(self, t: torch.Tensor) -> None:
        """Free the block of a tensor from `tensor` that no caller was given."""
        self.give_back(*self.locate(t))

    def _take(self, size: int) -> tuple[int, int]:
        for seg, free in self.free.items():
            for i, (off, room) in enumerate(free):
                if room >= size:
                    if room == size:
                        free.pop(i)
                    else:
                        free[i] = (off + size, room - size)
                    return seg, off
        self._grow(max(size, self.segment_bytes), why="while admitting requests: the step waited for it; "
                   "capture_memory_gib (of VLLM, `tapc serve --capture-memory-gib`, a spec's capture.memory_gib) "
                   "pins it at start", stalled=True)
        return self._take(size)

    def _grow(self, size: int, why: str, stalled: bool = False) -> None:
        """Make and pin a segment of `size` bytes; `stalled`: on a step's path, which an operator
        hears of (a warning: every request of the step waited), where a reserve at start is info."""
        t0 = time.perf_counter()
        seg = self.made
        path = self.path(seg)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)   # held while this arena lives: `sweep` leaves the file alone
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            held = sum(self.held.values()) / 2**30
            raise RequestError(f"no room for its captures: {self.directory} cannot hold {size / 2**30:.2f} GiB more "
                               f"({held:.2f} GiB held by captures, running or still referenced by the caller; "
                               f"{e.strerror}). Drop captures you no longer need (or .clone() those you keep), "
                               "capture fewer rows or layers per call, give /dev/shm more space (docker: "
                               "--shm-size), or point TAPC_SHM_DIR at a larger tmpfs") from None
        self.made += 1
        self.locks[seg] = fd
        t = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        if self.register is not None:
            self.register(t)
        self.segment[path] = seg
        self.maps[seg] = t
        self.free[seg] = [(0, size)]
        took = time.perf_counter() - t0
        self.growth_s += took
        log.log(logging.WARNING if stalled else logging.INFO,
                "tapc: host memory for captures grew to %.2f GiB in %s (%.2f GiB made and pinned in %.2f s, %s)",
                self.size / 2**30, self.directory, size / 2**30, took, why)

    def close(self) -> None:
        for seg in self.maps:
            try:
                os.unlink(self.path(seg))
            except FileNotFoundError:
                pass
        for fd in self.locks.values():
            os.close(fd)
        self.locks = {}


def sweep(directory: str) -> list[str]:
    """Remove the arena files in `directory` that no living arena holds (a killed worker's), and
    say which; a file younger than STALE_S is left, being perhaps made right now."""
    gone = []
    try:
        names = [n for n in os.listdir(directory) if SEGMENT_NAME.fullmatch(n)]
    except OSError:
        return gone
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < STALE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held: a living arena's
            continue
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:   # another arena starting beside this one swept it first
                continue
            gone.append(name)
        finally:
            os.close(fd)
    if gone:
        log.warning("tapc: removed %d capture file(s) of workers that are gone from %s", len(gone), directory)
    return gone


class ArenaReader:
    """The API's side: blocks of the worker's files as tensors. Each file is mapped once; each
    block is its own array over that mapping, so that it is free again when the caller drops
    the last tensor that uses it (a finalizer notes it; `drain` hands the notes to the
    worker's `release`)."""

    def __init__(self):
        self._maps: dict[str, mmap.mmap] = {}
        self._bases: list[tuple[int, int, str]] = []   # (address, bytes, file) of each mapping, sorted
        self._unused: list[tuple[str, int]] = []

    def view(self, path: str, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize * math.prod(shape)
        if n == 0:
            self.unused(path, offset)
            return torch.empty(shape, dtype=dtype)
        m = self._maps.get(path)
        if m is None:
            self._forget_removed()
            with open(path, "r+b") as f:
                m = self._maps[path] = mmap.mmap(f.fileno(), 0)
            bisect.insort(self._bases, (np.frombuffer(m, dtype=np.uint8).ctypes.data, len(m), path))
        a = np.frombuffer(m, dtype=np.uint8, count=n, offset=offset)
        # Every tensor made from it keeps `a` alive: it dies with the caller's last view.
        weakref.finalize(a, self.unused, path, offset)
        return torch.from_numpy(a).view(dtype).view(shape)

    def _forget_removed(self) -> None:
        """Unmap the files the worker gave back (an arena with a bound: `Arena._drop`) that no
        tensor of the caller uses: they hold no memory, but a server's bursts would pile them up."""
        for path, m in list(self._maps.items()):
            if os.path.exists(path):
                continue
            try:
                m.close()
            except BufferError:   # a view of it is alive (a block the caller still holds)
                continue
            del self._maps[path]
            self._bases = [b for b in self._bases if b[2] != path]

    def close(self) -> None:
        """Forget every mapping: each goes once no tensor of the caller uses it."""
        self._maps.clear()
        self._bases.clear()
        self._unused.clear()

    def where(self, t: torch.Tensor) -> tuple[str, int] | None:
        """The file and byte offset of the memory under `t` (its storage's first byte), where that
        is one of the arena's blocks; None for any other memory (a copy, a tensor made here)."""
        ptr = t.untyped_storage().data_ptr()
        i = bisect.bisect_right(self._bases, (ptr, math.inf, "")) - 1
        if i < 0:
            return None
        base, size, path = self._bases[i]
        return (path, ptr - base) if ptr < base + size else None

    def unused(self, path: str, offset: int) -> None:
        """The block at (path, offset) can go back (finalizers call this from any thread)."""
        self._unused.append((path, offset))

    @property
    def pending(self) -> bool:
        """Whether blocks were noted since the last `drain`."""
        return bool(self._unused)

    def drain(self) -> list[tuple[str, int]]:
        out = []
        while self._unused:  # pop, not a swap: a finalizer may append meanwhile
            out.append(self._unused.pop())
        return out
