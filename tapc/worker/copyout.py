"""A step's captured rows on their way to host memory: `CopyOut.copy_out` after each forward.

The used rows of each pool are copied device-to-device into a snapshot (the next forward may
overwrite the pools right away), then a side stream copies each request's block from the
snapshot into its pinned host storage while the next step computes (all of them in one driver
call where the driver has it, memcpy.py). A snapshot is rewritten only after its last host
copies are done (an event). There are two, each with its own copy stream: one as large as the
pools, and one of `max_num_seqs` rows a capture for decode-sized steps. A prompt step at TP=2
on the 8B shape copies 1 GiB a GPU (about 26 ms); with one snapshot the first decode step after
it (7 ms) waited about 19 ms for those copies before it could rewrite the snapshot. A step's
event is recorded once its copies and every earlier step's are done (the streams joined), which
is what a collect waits for. While a harvest asks for it (`count_nonfinite`), the snapshot's
non-finite values are counted on the device as it is made (`nonfinite`, a running total that
reaches host memory with the step's copies), so the harvest checks rows on the host only once
the device has seen a NaN or inf. Off otherwise: it is four more eager ops a capture group on
every capturing step. A step of at most `DIRECT_BYTES` (a decode step at a small batch) skips
the snapshot: its rows go to host memory straight from the pools, on the compute stream.
"""
from __future__ import annotations

from operator import mul

import torch

from tapc.plan.sizing import small_snapshot_rows
from tapc.worker.memcpy import BatchCopy, DriverEvent, DriverEvents, Repeated, copy_segments
from tapc.worker.step import Segment

# A step that copies out at most this many bytes copies straight from the pools, on the compute
# stream (`CopyOut._copy_direct`). Copies of 128 KiB or less are bound by latency, not bandwidth
# (cudf chose the same bound for its batched copies).
DIRECT_BYTES = 128 << 10


class CopyOut:
    """Copy-out of `pools` (Buffers.pools) on `device`, with snapshots sized for `rows` rows a
    capture and decode steps of up to `seqs` requests. It copies on a CUDA device; on the CPU it
    is made only to count its memory (the toy engine's tests copy with an object of the same
    methods, tests/support/engine_toy.py)."""

    def __init__(self, layout, pools: list[torch.Tensor], rows: int, seqs: int, device: torch.device):
        self.pools = pools
        self._big = _Snapshot(pools, [len(p) for p in pools], device)
        # decode steps (a row a request) use their own snapshot and stream
        small = small_snapshot_rows(rows, seqs)
        self._small = _Snapshot(pools, [len(g.caps) * small for g in layout.groups], device) \
            if small and pools else None
        cuda = device.type == "cuda"
        self._join = torch.cuda.Stream(device=device) if cuda else None
        self._row_bytes = [p.shape[1] * p.element_size() for p in pools]
        self.direct_bytes = DIRECT_BYTES
        self._batch = BatchCopy.load() if cuda else None
        self._repeated = Repeated()   # the last step's copies, for a step that repeats it
        self._device = pools[0].get_device() if pools else -1   # its index, for the compute stream's handle
        # the driver's events for direct steps, where it has them (torch's took 17-21 us of the
        # engine thread a step in a running engine: profile_step)
        self._events = DriverEvents.load() if cuda else None
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self._nonfinite_host = torch.zeros((), dtype=torch.int64, pin_memory=cuda)
        self._counting = False

    def tensors(self) -> list[torch.Tensor]:
        """The snapshots' tensors (Buffers.tensors has the rest)."""
        return [t for snap in (self._big, self._small) if snap is not None for t in snap.tensors]

    def copy_out(self, segments: list[Segment], used: list[int], steps: int = 1) -> "torch.cuda.Event | DriverEvent":
        """Start the step's copies to host memory; the event is recorded once they, and every
        earlier step's, are done. `steps`: the steps whose rows these are (a ring's, fill.py
        `Repeat`), which go straight from the pools where each step's share would: at batch 1
        that spares the snapshot, and at batch 64 the compute stream is not held up by 8 steps'
        DMA (tens of MB on the MoE plan) while the next forward waits."""
        if sum(map(mul, used, self._row_bytes)) <= self.direct_bytes * steps:
            return self._copy_direct(segments, used)
        compute = torch.cuda.current_stream()
        snap, other = self._big, self._small
        if other is not None and all(n <= len(t) for n, t in zip(used, other.tensors)):
            snap, other = other, snap
        if snap.freed is not None:
            compute.wait_event(snap.freed)
        for t, pool, n in zip(snap.tensors, self.pools, used):
            if n:
                t[:n].copy_(pool[:n])
        self._count(snap.tensors, used)
        ready = torch.cuda.Event()
        ready.record(compute)
        snap.stream.wait_event(ready)
        copy_segments(segments, snap.tensors, self._batch, snap.stream, self._repeated)
        # The other snapshot's copies may still run (a prompt step's, under the decode steps
        # after it): then this step is done when both streams are, joined on a third.
        pending = [other] if other is not None and _pending(other) else []
        snap.freed = self._recorded(snap.stream, pending)
        return self._joined(snap.freed, pending)

    def _copy_direct(self, segments: list[Segment], used: list[int]) -> "torch.cuda.Event | DriverEvent":
        """A step of few bytes (a decode step at a small batch) copies straight from the pools on
        the compute stream (on the V1 runner's, the legacy default stream: memcpy.py says how each
        of its driver calls goes there): the next forward, queued behind the copies,
        cannot rewrite the pools early, and the step costs no snapshot copy, no event between
        streams and no stream switch.
        At batch 1 the host's time shows in the step (the V1 runner on the Qwen3-30B-A3B shape: a
        2.1 ms step with 2.0 ms of GPU work), and copy-out through a snapshot took 229 us a step
        there; these copies are a few microseconds of DMA on the GPU instead.
        The compute stream is named by its handle, not a `torch.cuda.Stream`: making one took
        about 30 us of a running engine's thread (profile_step, benchmarks/results/findings-engine.md)."""
        self._count(self.pools, used)
        copy_segments(segments, self.pools, self._batch, last=self._repeated)
        pending = [s for s in (self._big, self._small) if s is not None and _pending(s)]
        if self._events is not None and not pending and not self._counting:
            return self._events.record(torch._C._cuda_getCurrentRawStream(self._device))
        return self._joined(self._recorded(torch.cuda.current_stream(), pending), pending)

    def _count(self, tensors: list[torch.Tensor], used: list[int]) -> None:
        """While counting, add the non-finite values of each tensor's first `used` rows (on the
        compute stream, the step's rows as copy-out reads them)."""
        if self._counting:
            for t, n in zip(tensors, used):
                if n:
                    self._nonfinite += torch.isfinite(t[:n]).logical_not_().sum()

    def _recorded(self, stream, pending: list["_Snapshot"]) -> torch.cuda.Event:
        """An event on `stream` after the step's copies there. While counting, and with no other
        snapshot's copies pending, the running non-finite total goes to the host first, on that
        stream (else `_joined` sends it once every stream's copies are done)."""
        if self._counting and not pending:
            with torch.cuda.stream(stream):
                self._nonfinite_host.copy_(self._nonfinite, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _joined(self, done: torch.cuda.Event, pending: list["_Snapshot"]) -> torch.cuda.Event:
        """`done`, or where snapshots' copies are still pending, an event recorded once they and
        `done` are: a collect waits for a request's last step only."""
        if not pending:
            return done
        with torch.cuda.stream(self._join):
            self._join.wait_event(done)
            for snap in pending:
                self._join.wait_event(snap.freed)
            if self._counting:   # the live total, read once every stream's copies are done
                self._nonfinite_host.copy_(self._nonfinite, non_blocking=True)
            joined = torch.cuda.Event()
            joined.record(self._join)
        return joined

    def count_nonfinite(self, on: bool) -> None:
        """Count from now on (from 0), or stop counting."""
        if on:
            self._nonfinite.zero_()
            self._nonfinite_host.zero_()
        self._counting = on

    def nonfinite(self) -> int | None:
        """Non-finite values in the captures copied since counting began, at least through the
        copies whose events have completed (a running total, copied to the host after each
        step's captures: no sync here, which would wait for the steps queued since); None when
        not counting."""
        return int(self._nonfinite_host) if self._counting else None


def _pending(snap: "_Snapshot") -> bool:
    """Whether `snap`'s copies may still run; it forgets an event that has completed."""
    if snap.freed is not None and snap.freed.query():
        snap.freed = None
    return snap.freed is not None


class _Snapshot:
    """Where copy-out reads a step's capture rows from while the next forward rewrites the pools:
    `rows[g]` rows of each pool's width, read into host memory by its own copy stream; `freed` is
    recorded after its last copies (None: none pending)."""

    def __init__(self, pools: list[torch.Tensor], rows: list[int], device: torch.device):
        self.tensors = [torch.empty(n, p.shape[1], dtype=p.dtype, device=device) for n, p in zip(rows, pools)]
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.freed: torch.cuda.Event | None = None
