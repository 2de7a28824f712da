"""The device side of the taps: row tables, capture pools, per-slot parameter tables, copy-out.

Everything here is allocated once, when the worker installs the taps (before vLLM's first
forward), and never moves: the compiled graphs and CUDA graphs keep reading these addresses.

Per step (all stream-ordered on the compute stream, so async scheduling is safe):
1. `upload`: the host's row tables go up through one of `depth` pinned, device-visible (UVA)
   buffers, one copy kernel. The host writes buffer i while the device may still read buffer
   i-1; vLLM keeps at most `depth` steps in flight, so a buffer is never rewritten early. A
   step that owns no row skips it while the device's tables already own none among its rows
   (it took up to 96 us of host time a decode step on the MoE shape, timed with a sampling
   profiler on, where vLLM's step is 2.3 ms).
2. the forward's tap ops write capture rows into the pools and edit rows in place.
3. `copy_out`: the used rows of each pool are copied device-to-device into a snapshot (the next
   forward may overwrite the pools right away), then a side stream copies each request's block
   from the snapshot into its pinned host storage while the next step computes (all of them
   in one driver call where the driver has it, memcpy.py). A snapshot is rewritten only after
   its last host copies are done (an event). There are two, each with its own copy stream:
   one as large as the pools, and one of `max_num_seqs` rows a capture for decode-sized steps.
   A prompt step at TP=2 on the 8B shape copies 1 GiB a GPU (about 26 ms); with one snapshot
   the first decode step after it (7 ms) waited about 19 ms for those copies before it could
   rewrite the snapshot. A step's event is recorded once its copies and every earlier step's
   are done (the streams joined), which is what a collect waits for. While a harvest asks for it
   (`count_nonfinite`), the snapshot's non-finite values are counted on the device as it is
   made (`nonfinite`, a running total that reaches host memory with the step's copies), so the
   harvest checks rows on the host only once the device has seen a NaN or inf. Off otherwise:
   it is four more eager ops a capture group on every capturing step.
   A step of at most `DIRECT_BYTES` (a decode step at a small batch) skips the snapshot: its
   rows go to host memory straight from the pools, on the compute stream.
"""
from __future__ import annotations

import os
from operator import mul

import numpy as np
import torch

from tapc.errors import EngineError
from tapc.lang.edits import slot_row
from tapc.plan.sizing import edit_tables, param_slots, small_snapshot_rows
from tapc.worker.layout import Layout
from tapc.worker.memcpy import BatchCopy, DriverEvent, DriverEvents, Repeated, copy_segments, repeating
from tapc.worker.step import Segment

# A step that copies out at most this many bytes copies straight from the pools, on the compute
# stream (`Buffers._copy_direct`). Copies of 128 KiB or less are bound by latency, not bandwidth
# (cudf chose the same bound for its batched copies).
DIRECT_BYTES = 128 << 10
DIRECT = "TAPC_DIRECT_KIB"   # the bound in KiB, from the engine's environment (an A/B's setting)


EVENTS = "TAPC_STEP_EVENTS"   # "torch": a direct step's event by torch, not the driver (memcpy.DriverEvents), for an A/B


def driver_events() -> "DriverEvents | None":
    """The driver's events for direct steps (where the driver has them), unless
    `TAPC_STEP_EVENTS=torch` asks for torch's (None). In a running engine torch's event took
    17-21 us of the engine thread's CPU time a step (profile_step, docs/engine.md)."""
    value = os.environ.get(EVENTS, "")
    if value not in ("", "torch", "driver"):
        raise EngineError(f"{EVENTS}={value!r}: 'driver' (the default) or 'torch'")
    return None if value == "torch" else DriverEvents.load()


def direct_bytes() -> int:
    """`DIRECT_BYTES`, or `TAPC_DIRECT_KIB` KiB where the engine's environment sets it (0: every
    step through a snapshot)."""
    value = os.environ.get(DIRECT)
    if not value:
        return DIRECT_BYTES
    if not value.isdigit():
        raise EngineError(f"{DIRECT}={value!r}: a whole number of KiB, 0 or more (the default is {DIRECT_BYTES >> 10})")
    return int(value) << 10


class Buffers:
    """Every device tensor tapc allocates for a plan (tapc/plan/sizing.py accounts for each): the row
    tables, the capture pools and their snapshots, the edits' parameter tables, and for `logits`
    edits their parameter tables and a row table of `seqs` entries."""

    def __init__(self, layout: Layout, rows: int, seqs: int, depth: int, device: torch.device):
        self.layout = layout
        self.rows = rows
        self.slots = param_slots(seqs)
        k = layout.table_rows
        self.table = torch.full((k, rows), -1, dtype=torch.int32, device=device)
        # Columns [0, _clean) of `table` own no row (all -1): a step that owns none and runs at
        # most that many rows needs no upload (untapped traffic, "nothing asked").
        self._clean = rows
        self._uva = [_UvaTable(k * rows, device) for _ in range(max(depth, 2))]
        self._next = 0
        self.pools = [torch.zeros(len(g.caps) * rows, g.width, dtype=getattr(torch, g.dtype), device=device)
                      for g in layout.groups]
        self._big = _Snapshot(self.pools, [len(p) for p in self.pools], device)
        # decode steps (a row a request) use their own snapshot and stream
        small = small_snapshot_rows(rows, seqs)
        self._small = _Snapshot(self.pools, [len(g.caps) * small for g in layout.groups], device) \
            if small and self.pools else None
        self._join = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._row_bytes = [p.shape[1] * p.element_size() for p in self.pools]
        self.direct_bytes = direct_bytes()
        self._batch = BatchCopy.load() if device.type == "cuda" else None
        self._repeated = Repeated() if repeating() else None   # the last step's copies, for a step that repeats it
        self._device = self.table.get_device()   # its index, for the compute stream's handle
        self._events = driver_events() if device.type == "cuda" else None
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self._nonfinite_host = torch.zeros((), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._counting = False
        self.staging = Staging(device)
        self.params = ParamTables(layout.edits, self.slots, device, layout.localize, self.staging)
        self.logit_params = ParamTables(layout.logit_edits, self.slots, device, staging=self.staging)
        self.logit_rows = torch.full((len(layout.logit_edits), seqs), -1, dtype=torch.int32, device=device)
        # The model runner's positions (one per row, on the device, rewritten each step), which a
        # ring's capture kernels read: the worker sets them before it installs the ops, where its
        # runner adapter knows them (None: no rings).
        self.positions: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor above, once (their bytes are what `tapc explain` says the plan takes)."""
        snaps = [t for snap in (self._big, self._small) if snap is not None for t in snap.tensors]
        return [self.table, *self.pools, *snaps, *self.params.tensors(), *self.logit_params.tensors(),
                self.logit_rows]

    # ---------------------------------------------------------------- per step

    def host_table(self, padded: int) -> np.ndarray:
        """The next pinned buffer, as the host view `[table_rows, padded]` to fill."""
        buf = self._uva[self._next]
        return buf.np[: self.layout.table_rows * padded].reshape(self.layout.table_rows, padded)

    def clean(self, padded: int) -> bool:
        """Whether the device's tables already own no row among a step's first `padded`."""
        return padded <= self._clean

    def upload(self, padded: int, owns_rows: bool = True) -> None:
        """The host table just filled goes up; `owns_rows` False when it is all -1."""
        buf = self._uva[self._next]
        self._next = (self._next + 1) % len(self._uva)
        k = self.layout.table_rows
        self.table[:, :padded].copy_(buf.uva[: k * padded].view(k, padded), non_blocking=True)
        self._clean = 0 if owns_rows else max(self._clean, padded)

    def reset(self) -> None:
        """No request owns any row (profile and dummy runs)."""
        self.table.fill_(-1)
        self._clean = self.rows

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
        about 30 us of a running engine's thread (profile_step, docs/engine.md)."""
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


class _UvaTable:
    """Pinned host int32 memory (`np`, the host fills it) and its device view (`uva`, read by one
    copy kernel), through vLLM's general UVA utility rather than a runner's buffer class, so any
    runner adapter uses the same upload. On a CPU device (tests) the host memory is the table."""

    def __init__(self, n: int, device: torch.device):
        cuda = device.type == "cuda"
        self.cpu = torch.zeros(n, dtype=torch.int32, pin_memory=cuda)
        self.np = self.cpu.numpy()
        if cuda:
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            self.uva = get_accelerator_view_from_cpu_tensor(self.cpu)
        else:
            self.uva = self.cpu


class ParamTables:
    """Per-slot parameter tables of some edits (`taps`), in the shapes their `tapc::` ops read
    (tapc/lang/edits.py `tables`; tapc/plan/sizing.py counts the same): `tables[e][arg]` of edit e.

    A named parameter's vector or scalar table is shared by every edit of `taps` that uses the
    name (a glob `add(steer)` over 32 layers holds one `steer` table); literal arguments, and
    the column tables of set/zero, belong to their edit and hold the literal in every slot.
    """

    def __init__(self, taps, slots: int, device: torch.device, localize=None, staging: "Staging | None" = None):
        self.taps = taps
        # per edit: a request's values -> this GPU's (layout.py `localize`; None: as they come)
        self.localize = localize or [None] * len(taps)
        self.staging = staging or Staging(device)
        self.specs = edit_tables(taps)
        self._writes: dict[tuple[int, ...], list[tuple[int, list]]] = {}
        self.tables: list[dict[str, torch.Tensor]] = []
        shared: dict[tuple, torch.Tensor] = {}
        for tap, specs in zip(taps, self.specs):
            literals = {a.name: a.value for a in tap.args if a.param is None}
            mine = {}
            for spec, first in specs:
                if not first:
                    mine[spec.arg] = shared[spec.share]
                    continue
                t = torch.full((slots, *spec.shape), -1 if spec.dtype == "int32" else 0,
                               dtype=getattr(torch, spec.dtype), device=device)
                if spec.literal:
                    t[:] = torch.from_numpy(slot_row(tap.action, spec, literals))
                if spec.share is not None:
                    shared[spec.share] = t
                mine[spec.arg] = t
            self.tables.append(mine)

    def write(self, slot: int, edits: list[int], params: dict) -> None:
        """Put one request's parameter values in `slot` of every table its edits read (`edits`:
        indices into `taps`; `params`: the request's wire values by parameter name)."""
        for e, specs in self._tables_to_write(edits):
            tap = self.taps[e]
            values = {a.name: a.value if a.param is None else params[a.param] for a in tap.args}
            if self.localize[e] is not None:
                values = {**values, **self.localize[e](_global_values(tap, values))}
            for spec in specs:
                self.staging.put(self.tables[e][spec.arg][slot], slot_row(tap.action, spec, values))

    def _tables_to_write(self, edits: list[int]) -> list[tuple[int, list]]:
        """Per edit of `edits`, the tables a write fills: not the literal ones, and a shared one
        at its first edit here only (a glob over 32 layers writes its named vector once). Kept
        by `edits`: requests of one kind bind the same edits."""
        key = tuple(edits)
        out = self._writes.get(key)
        if out is None:
            done: set[int] = set()
            out = []
            for e in key:
                specs = [spec for spec, _ in self.specs[e] if not spec.literal and id(self.tables[e][spec.arg]) not in done]
                done.update(id(self.tables[e][spec.arg]) for spec in specs)
                if specs:
                    out.append((e, specs))
            if len(self._writes) >= 1024:   # many kinds of request: start over rather than grow
                self._writes.clear()
            self._writes[key] = out
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The tables, a shared one once."""
        return list({id(t): t for ts in self.tables for t in ts.values()}.values())


def _global_values(tap, values: dict) -> dict:
    """The values of an edit still in the single-GPU layout on a GPU of several: its parameters,
    and a literal `value` list whose columns are a parameter (tapc/plan/ranks.py maps the rest)."""
    cols_bound = any(a.name == "cols" and a.param is not None for a in tap.args)
    return {a.name: values[a.name] for a in tap.args
            if a.param is not None or (cols_bound and a.name == "value")}


class Staging:
    """Pinned host memory that parameter rows and the logits edits' row tables go up to the
    device through, with no allocation per upload (`pin_memory()` of each row went through
    torch's caching host allocator: on the 8B shape, admitting a request that projects a
    direction out of 32 layers took 450 us of the engine's host time, most of it there).

    Two halves, used in turn. Each upload is a non-blocking copy on the current (compute)
    stream, so it lands before the next forward reads the table. Before the host writes into
    a half again it waits for the event recorded when it left that half, after the copies that
    read it: long done, since a half holds hundreds of rows. A row larger than a half (a logits
    vector of a large vocabulary is 0.5 MiB) is pinned on its own. On a CPU device (tests) the
    copy is direct."""

    HALF = 4 << 20
    ALIGN = 64      # every row starts aligned for any dtype's view

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buf = torch.empty(2 * self.HALF if self.cuda else 0, dtype=torch.uint8, pin_memory=self.cuda)
        self.np = self.buf.numpy()
        self.side = 0
        self.used = 0
        self.left: list[torch.cuda.Event | None] = [None, None]

    def put(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """`dst` <- `src` (of its shape and dtype), without blocking, in stream order."""
        src = src if src.flags.c_contiguous else src.copy()   # (ascontiguousarray makes a scalar 1-d)
        n = src.nbytes
        if not self.cuda or n > self.HALF:
            t = torch.from_numpy(src)
            dst.copy_(t.pin_memory() if self.cuda else t, non_blocking=True)
            return
        if self.used + n > self.HALF:
            left = torch.cuda.Event()
            left.record()
            self.left[self.side] = left
            self.side, self.used = 1 - self.side, 0
            if self.left[self.side] is not None:
                self.left[self.side].synchronize()
        at = self.side * self.HALF + self.used
        self.np[at: at + n] = src.reshape(-1).view(np.uint8)
        dst.copy_(self.buf[at: at + n].view(dst.dtype).view(dst.shape), non_blocking=True)
        self.used += -(-n // self.ALIGN) * self.ALIGN
