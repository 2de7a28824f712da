"""The device side of the taps: row tables, capture pools, per-slot parameter tables, copy-out.

Everything here is allocated once, when the worker installs the taps (before vLLM's first
forward), and never moves: the compiled graphs and CUDA graphs keep reading these addresses.

Per step (all stream-ordered on the compute stream, so async scheduling is safe):
1. `upload`: the host's row tables go up through one of `depth` pinned, device-visible (UVA)
   buffers, one copy kernel. The host writes buffer i while the device may still read buffer
   i-1; vLLM keeps at most `depth` steps in flight, so a buffer is never rewritten early.
2. the forward's tap ops write capture rows into the pools and edit rows in place.
3. `copy_out`: the used rows of each pool are copied device-to-device into a snapshot (the next
   forward may overwrite the pools right away), then a side stream copies each request's block
   from the snapshot into its pinned host storage while the next step computes (all of them
   in one driver call where the driver has it, memcpy.py). The snapshot is rewritten only
   after the previous step's host copies are done (an event).
"""
from __future__ import annotations

import numpy as np
import torch

from tapc.engine.fill import Segment
from tapc.engine.layout import Layout
from tapc.engine.memcpy import BatchCopy, copy_segments
from tapc.engine.requests import MAX_COLUMNS


class Buffers:
    def __init__(self, layout: Layout, rows: int, slots: int, depth: int, device: torch.device):
        self.layout = layout
        self.rows = rows
        k = layout.num_tables
        self.table = torch.full((k, rows), -1, dtype=torch.int32, device=device)
        self._uva = [_UvaTable(k * rows) for _ in range(max(depth, 2))]
        self._next = 0
        self.pools = [torch.zeros(len(g.caps) * rows, g.width, dtype=getattr(torch, g.dtype), device=device)
                      for g in layout.groups]
        self._snaps = [torch.empty_like(p) for p in self.pools]
        self._copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._batch = BatchCopy.load() if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None
        self.params = ParamTables(layout, slots, device)

    # ---------------------------------------------------------------- per step

    def host_table(self, padded: int) -> np.ndarray:
        """The next pinned buffer, as the host view `[num_tables, padded]` to fill."""
        buf = self._uva[self._next]
        return buf.np[: self.layout.num_tables * padded].reshape(self.layout.num_tables, padded)

    def upload(self, padded: int) -> None:
        buf = self._uva[self._next]
        self._next = (self._next + 1) % len(self._uva)
        k = self.layout.num_tables
        self.table[:, :padded].copy_(buf.uva[: k * padded].view(k, padded), non_blocking=True)

    def reset(self) -> None:
        """No request owns any row (profile and dummy runs)."""
        self.table.fill_(-1)

    def copy_out(self, segments: list[Segment], used: list[int]) -> None:
        compute = torch.cuda.current_stream()
        if self._copied is not None:
            compute.wait_event(self._copied)
        for snap, pool, n in zip(self._snaps, self.pools, used):
            if n:
                snap[:n].copy_(pool[:n])
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            copy_segments(segments, self._snaps, self._batch)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)

    def wait_copies(self) -> None:
        """Block until every capture enqueued so far is in host memory."""
        if self._copied is not None:
            self._copied.synchronize()


class _UvaTable:
    """Pinned host int32 memory (`np`, the host fills it) and its device view (`uva`, read by one
    copy kernel), through vLLM's general UVA utility rather than a runner's buffer class, so any
    runner adapter uses the same upload."""

    def __init__(self, n: int):
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

        self.cpu = torch.zeros(n, dtype=torch.int32, pin_memory=True)
        self.np = self.cpu.numpy()
        self.uva = get_accelerator_view_from_cpu_tensor(self.cpu)


class ParamTables:
    """Per-slot parameter tables of the edits, in the shapes the `tapc::` edit ops read.

    A named parameter's vector or scalar table is shared by every tap that uses the name (a glob
    `add(steer)` over 32 layers holds one `steer` table); literal arguments, and the column
    tables of set/zero, belong to their tap and hold the literal in every slot.
    """

    def __init__(self, layout: Layout, slots: int, device: torch.device):
        self.layout = layout
        self.device = device
        self._shared: dict[tuple[str, bool], torch.Tensor] = {}
        self.tables: list[dict[str, torch.Tensor]] = [self._tables_for(t, slots) for t in layout.edits]

    def _tables_for(self, tap, slots: int) -> dict[str, torch.Tensor]:
        args = {a.name: a for a in tap.args}
        unit = tap.action == "project_out"
        out: dict[str, torch.Tensor] = {}
        for name, arg in args.items():
            if arg.kind == "vector":
                out[name] = self._vector_table(arg, slots, tap.width, unit)
            elif arg.kind == "scalar":
                out[name] = self._scalar_table(arg, slots)
        if tap.action in ("set", "zero"):
            cols = args["cols"]
            ncols = MAX_COLUMNS if cols.param else len(cols.value)
            out["cols"] = torch.full((slots, ncols), -1, dtype=torch.int32, device=self.device)
            out["vals"] = torch.zeros((slots, ncols), dtype=torch.float32, device=self.device)
            if cols.param is None:
                out["cols"][:] = torch.tensor(cols.value, dtype=torch.int32)
            value = args.get("value")
            if value is not None and value.param is None:
                v = value.value
                out["vals"][:] = torch.tensor([v] * ncols if isinstance(v, (int, float)) else
                                              list(v) + [0.0] * (ncols - len(v)), dtype=torch.float32)
        return out

    def _vector_table(self, arg, slots: int, width: int, unit: bool) -> torch.Tensor:
        if arg.param is not None:
            key = (arg.param, unit)
            if key not in self._shared:
                self._shared[key] = torch.zeros((slots, width), dtype=torch.float32, device=self.device)
            return self._shared[key]
        t = torch.zeros((slots, width), dtype=torch.float32, device=self.device)
        t[:] = _vector(arg.value, unit)
        return t

    def _scalar_table(self, arg, slots: int) -> torch.Tensor:
        if arg.param is not None:
            key = (arg.param, False)
            if key not in self._shared:
                self._shared[key] = torch.zeros(slots, dtype=torch.float32, device=self.device)
            return self._shared[key]
        return torch.full((slots,), float(arg.value), dtype=torch.float32, device=self.device)

    def write(self, slot: int, edits: list[int], params: dict) -> None:
        """Put one request's parameter values in `slot` of every table its edits read."""
        done: set[int] = set()
        for e in edits:
            tap = self.layout.edits[e]
            tables = self.tables[e]
            unit = tap.action == "project_out"
            for arg in tap.args:
                if arg.param is None:
                    continue
                if arg.kind in ("vector", "scalar"):
                    table = tables[arg.name]
                    if id(table) in done:
                        continue
                    done.add(id(table))
                    value = _vector(params[arg.param], unit) if arg.kind == "vector" else \
                        torch.tensor(params[arg.param], dtype=torch.float32)
                    _upload(table[slot], value)
            if tap.action in ("set", "zero"):
                self._write_columns(slot, tap, tables, params)

    @staticmethod
    def _write_columns(slot: int, tap, tables: dict[str, torch.Tensor], params: dict) -> None:
        args = {a.name: a for a in tap.args}
        ncols = tables["cols"].shape[1]
        cols = args["cols"]
        if cols.param is not None:
            given = params[cols.param]
            _upload(tables["cols"][slot], torch.tensor(given + [-1] * (ncols - len(given)), dtype=torch.int32))
        value = args.get("value")
        if value is not None and value.param is not None:
            v = params[value.param]
            n = len(params[cols.param]) if cols.param else ncols
            v = v * n if len(v) == 1 else v
            _upload(tables["vals"][slot], torch.tensor(v + [0.0] * (ncols - len(v)), dtype=torch.float32))


def _vector(value, unit: bool) -> torch.Tensor:
    """A literal (tuple) or a request's value (float32 bytes, see requests.check)."""
    v = torch.frombuffer(bytearray(value), dtype=torch.float32) if isinstance(value, bytes) else \
        torch.tensor(value, dtype=torch.float32)
    if unit:
        norm = v.norm()
        v = v / norm if norm > 0 else v
    return v


def _upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Host -> device without stalling: pinned source, ordered on the compute stream before the
    next forward (the caching host allocator keeps `src` alive until the copy has run)."""
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)
