"""A step's captured rows on their way to host memory: `CopyOut.copy_out` after each forward.

The used rows of each pool are copied device-to-device into a snapshot (the next forward may
overwrite the pools right away), then a side stream copies each request's block from the
snapshot into its pinned host storage while the next step computes (segmentcopy.py: all of them
in one driver call where the driver has it). A snapshot is rewritten only after its last host
copies are done (an event). There are two, each with its own copy stream: one as large as the
pools, and one of `max_num_seqs` rows a capture for decode-sized steps. A step's event is
recorded once its copies and every earlier step's are done (the streams joined), which is what
a collect waits for. While a harvest asks for it (`count_nonfinite`), the snapshot's
non-finite values are counted on the device as it is made (`nonfinite`, a running total that
reaches host memory with the step's copies), so the harvest checks rows on the host only once
the device has seen a NaN or inf. Off otherwise: it is four more eager ops a capture group on
every capturing step. A step of at most `DIRECT_BYTES` (a decode step at a small batch) skips
the snapshot: its rows go to host memory straight from the pools, on the compute stream.
`route` holds the rules, one table with the reasons: which way a step's rows go and how its
event is made.
"""
from __future__ import annotations

from collections.abc import Collection
from operator import mul
from typing import NamedTuple

import torch

from tapc.plan.sizing import small_snapshot_rows
from tapc.worker.memcpy import BatchCopy, DriverEvent, DriverEvents
from tapc.worker.segmentcopy import Repeated, copy_segments
from tapc.worker.step import Segment

# A step whose rows are at most this many bytes (a ring's steps: each step's share) copies them
# straight from the pools, on the compute stream (`route` says why).
DIRECT_BYTES = 128 << 10

# Where a step's rows are copied from, and how the event a collect waits on is made.
POOLS, SMALL, BIG = "pools", "small snapshot", "big snapshot"
DRIVER, TORCH, JOINED = "driver event", "torch event", "joined"


class Route(NamedTuple):
    """The way of one step's copy-out (`route`)."""
    source: str                  # POOLS, SMALL or BIG
    event: str                   # DRIVER, TORCH or JOINED
    joins: tuple[str, ...] = ()  # the snapshots (BIG, SMALL) a joined event waits for too


def route(step_bytes: int, steps: int, fits_small: bool, pending: Collection[str], counting: bool,
          driver_events: bool, direct_bytes: int = DIRECT_BYTES) -> Route:
    """Where a step's rows are copied from, and how the event a collect waits on is made.
    `step_bytes`: the rows' bytes, of `steps` steps (a ring's, fill.py `Repeat`); `fits_small`:
    there is a small snapshot and each group's rows fit it; `pending`: the snapshots (BIG,
    SMALL) whose copies may still run; `counting`: non-finite values are counted
    (`CopyOut.count_nonfinite`); `driver_events`: the driver's events were loaded.

    The source, the first row that holds:

      when                                source  why
      step_bytes <= direct_bytes * steps  POOLS   Copies of 128 KiB or less are bound by latency,
                                                  not bandwidth (cudf chose the same bound for
                                                  its batched copies). At batch 1 the host's
                                                  time shows in the step (the V1 runner on the
                                                  Qwen3-30B-A3B shape: a 2.1 ms step with 2.0 ms
                                                  of GPU work), and copy-out through a snapshot
                                                  took 229 us a step there; these copies are a
                                                  few microseconds of DMA on the GPU instead. A
                                                  ring's steps go this way where each step's
                                                  share would: at batch 1 that spares the
                                                  snapshot, and at batch 64 the compute stream is
                                                  not held up by 8 steps' DMA (tens of MB on the
                                                  MoE plan) while the next forward waits.
      fits_small                          SMALL   Decode steps (a row a request) have their own
                                                  snapshot and copy stream. A prompt step at TP=2
                                                  on the 8B shape copies 1 GiB a GPU (about
                                                  26 ms); with one snapshot the first decode step
                                                  after it (7 ms) waited about 19 ms for those
                                                  copies before it could rewrite the snapshot.
      otherwise                           BIG     As large as the pools.

    The event, the first row that holds:

      when                                 event   why
      a snapshot other than the source     JOINED  Its copies may still run (a prompt step's,
      is in `pending`                              under the decode steps after it): the step
                                                   is done when both streams are, joined on a
                                                   third, so that a collect waits for a
                                                   request's last step only.
      source POOLS, driver_events and not  DRIVER  torch's `Event.record` took 17-21 us of the
      counting                                     engine thread a step in a running engine
                                                   (profile_step) and lets the GIL go
                                                   (memcpy.py `DriverEvents`). While counting,
                                                   the non-finite total goes to the host on the
                                                   compute stream by torch, before torch's event.
      otherwise                            TORCH   On the source's stream: the compute stream
                                                   for the pools, else the snapshot's copy
                                                   stream.
    """
    if step_bytes <= direct_bytes * steps:
        source = POOLS
    elif fits_small:
        source = SMALL
    else:
        source = BIG
    joins = tuple(snap for snap in (BIG, SMALL) if snap in pending and snap != source)
    if joins:
        return Route(source, JOINED, joins)
    if source == POOLS and driver_events and not counting:
        return Route(source, DRIVER)
    return Route(source, TORCH)


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
        # the driver's events for direct steps, where it has them (`route` says why)
        self._events = DriverEvents.load() if cuda else None
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self._nonfinite_host = torch.zeros((), dtype=torch.int64, pin_memory=cuda)
        self._counting = False

    def tensors(self) -> list[torch.Tensor]:
        """The snapshots' tensors (Buffers.tensors has the rest)."""
        return [t for snap in (self._big, self._small) if snap is not None for t in snap.tensors]

    def copy_out(self, segments: list[Segment], used: list[int], steps: int = 1) -> "torch.cuda.Event | DriverEvent":
        """Start the step's copies to host memory, the way `route` gives; the event is recorded
        once they, and every earlier step's, are done. `steps`: the steps whose rows these are
        (a ring's, fill.py `Repeat`)."""
        small = self._small
        pending = [name for name, snap in ((BIG, self._big), (SMALL, small)) if snap is not None and _pending(snap)]
        fits_small = small is not None and all(n <= len(t) for n, t in zip(used, small.tensors))
        way = route(sum(map(mul, used, self._row_bytes)), steps, fits_small, pending, self._counting,
                    self._events is not None, self.direct_bytes)
        joins = [self._snapshot(name) for name in way.joins]
        if way.source == POOLS:
            return self._copy_direct(segments, used, way.event == DRIVER, joins)
        snap = self._snapshot(way.source)
        compute = torch.cuda.current_stream()
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
        snap.freed = self._recorded(snap.stream, joins)
        return self._joined(snap.freed, joins)

    def _copy_direct(self, segments: list[Segment], used: list[int], driver: bool,
                     joins: list["_Snapshot"]) -> "torch.cuda.Event | DriverEvent":
        """A step of few bytes (a decode step at a small batch) copies straight from the pools on
        the compute stream (on the V1 runner's, the legacy default stream: memcpy.py says how each
        of its driver calls goes there): the next forward, queued behind the copies,
        cannot rewrite the pools early, and the step costs no snapshot copy, no event between
        streams and no stream switch. Its event is the driver's where `driver`, else torch's,
        joined with the snapshots' `joins`.
        The compute stream is named by its handle, not a `torch.cuda.Stream`: making one took
        about 30 us of a running engine's thread (profile_step, benchmarks/results/findings-engine.md)."""
        self._count(self.pools, used)
        copy_segments(segments, self.pools, self._batch, last=self._repeated)
        if driver:
            return self._events.record(torch._C._cuda_getCurrentRawStream(self._device))
        return self._joined(self._recorded(torch.cuda.current_stream(), joins), joins)

    def _snapshot(self, name: str) -> "_Snapshot":
        return self._big if name == BIG else self._small

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
