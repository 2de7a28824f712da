"""One request's captures of one group in host memory: `[rows, captures, width]`, in chunks.

The first chunk is allocated when the request is admitted, sized for every row it can have;
later chunks (rarely: a preempted request, or max_tokens unknown) grow it by at least
`GROW_ROWS`. `take` makes room for a step's rows and `span` says where they are; the copy itself
is segmentcopy.copy_segments.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tapc.errors import RequestError
from tapc.worker.layout import Layout

# Rows a request's host storage grows by past its first allocation.
GROW_ROWS = 64

# (rows, captures, width, dtype) -> an empty CPU tensor; the worker allocates in the arena.
Alloc = Callable[[int, int, int, torch.dtype], torch.Tensor]


class Store:
    """One request's captures of one group on the host: `[rows, captures, width]`, in chunks."""

    def __init__(self, group: int, caps: np.ndarray, width: int, dtype: torch.dtype, alloc: Alloc, first: int):
        self.group = group
        self.caps = caps
        self.caps_key = caps.tobytes()  # compared for every request at every step: bytes are cheap
        self.taps = Layout.taps_mask(caps.tolist())   # its captures' table rows (capture c is row c)
        self.width = width
        self.dtype = dtype
        self.row_bytes = caps.size * width * dtype.itemsize   # one row, every capture
        self.alloc = alloc
        self.chunks: list[torch.Tensor] = []
        self.rows = 0                  # rows written
        self.room = 0                  # rows allocated
        self.failed: str | None = None  # why it stopped capturing (no room to grow)
        self.copied = None             # the event of its last step's copies to host memory
        self.filling = None            # the write of kept prefix rows into it, a Future (prefixrows.py)
        # The first allocation is made now, when the request is admitted, so that no room for it
        # is an error of this request before it runs (see Arena).
        self._grow(first)
        self.first = first             # rows of the first allocation

    def _grow(self, rows: int) -> None:
        chunk = self.alloc(rows, self.caps.size, self.width, self.dtype)
        self.chunks.append(chunk)
        self.last_base = self.room                        # first row of the last chunk
        self.last_ptr = chunk.data_ptr()                  # and its address (copies go by address)
        self.room += rows

    def take(self, n: int) -> int | None:
        """Room for the next n rows: the first one's row number (`span` says where they are),
        grown into a new chunk if they do not fit; None once the store has failed. This runs
        for every capturing request at every step: the usual case is two comparisons."""
        if self.rows + n > self.room:
            if self.failed is not None:
                return None
            try:
                self._grow(max(n - (self.room - self.rows), GROW_ROWS))
            except RequestError as e:
                # Its request fails at collect; the others' copies of this step go on. It never
                # captures again (a later row after a gap would sit at the wrong position), and
                # room = rows keeps every later call here.
                self.failed, self.room = str(e), self.rows
                return None
        first, self.rows = self.rows, self.rows + n
        return first

    def span(self, first: int, n: int) -> list[tuple[torch.Tensor, int, int]]:
        """Where rows [first, first + n) are: (chunk, its first row, rows), in order (two when
        they straddle a chunk boundary)."""
        if first >= self.last_base:
            return [(self.chunks[-1], first - self.last_base, n)]
        out, base = [], 0
        for chunk in self.chunks:
            lo, hi = max(first - base, 0), min(first + n - base, chunk.shape[0])
            if lo < hi:
                out.append((chunk, lo, hi - lo))
                first, n = first + hi - lo, n - (hi - lo)
            base += chunk.shape[0]
            if n == 0:
                break
        return out

    def filled(self) -> list[tuple[torch.Tensor, int]]:
        """Every chunk, with how many of its rows are written (0 for a chunk never reached)."""
        out, left = [], self.rows
        for chunk in self.chunks:
            out.append((chunk, min(left, chunk.shape[0])))
            left -= out[-1][1]
        return out
