"""The device side of the taps: row tables, capture pools and per-slot parameter tables.

Everything here is allocated once, when the worker installs the taps (before vLLM's first
forward), and never moves: the compiled graphs and CUDA graphs keep reading these addresses.

Per step (stream-ordered on the compute stream, so async scheduling is safe):
1. `upload`: the host's row tables go up through one of `depth` pinned, device-visible (UVA)
   buffers, one copy kernel. The host writes buffer i while the device may still read buffer
   i-1; vLLM keeps at most `depth` steps in flight, so a buffer is never rewritten early. A
   step that owns no row skips it while the device's tables already own none among its rows
   (it took up to 96 us of host time a decode step on the MoE shape, timed with a sampling
   profiler on, where vLLM's step is 2.3 ms).
2. the forward's tap ops write capture rows into the pools and edit rows in place.
3. copy-out takes the pools' rows to host memory (copyout.py).
"""
from __future__ import annotations

import numpy as np
import torch

from tapc.lang.edits import slot_row
from tapc.plan.sizing import edit_tables, param_slots
from tapc.worker.layout import Layout

class Buffers:
    """The device tensors tapc allocates for a plan but copy-out's (tapc/plan/sizing.py accounts
    for each): the row tables, the capture pools, the edits' parameter tables (`slots` slots:
    sizing's for `seqs` unless given), and for `logits` edits their parameter tables and a row
    table of `seqs` entries."""

    def __init__(self, layout: Layout, rows: int, seqs: int, depth: int, device: torch.device,
                 slots: int | None = None):
        self.layout = layout
        self.rows = rows
        self.slots = param_slots(seqs) if slots is None else slots
        k = layout.table_rows
        self.table = torch.full((k, rows), -1, dtype=torch.int32, device=device)
        # Columns [0, _clean) of `table` own no row (all -1): a step that owns none and runs at
        # most that many rows needs no upload (untapped traffic, "nothing asked").
        self._clean = rows
        self._uva = [_UvaTable(k * rows, device) for _ in range(max(depth, 2))]
        self._next = 0
        self.pools = [torch.zeros(len(g.caps) * rows, g.width, dtype=getattr(torch, g.dtype), device=device)
                      for g in layout.groups]
        self.staging = Staging(device)
        self.params = ParamTables(layout.edits, self.slots, device, layout.localize, self.staging)
        self.logit_params = ParamTables(layout.logit_edits, self.slots, device, staging=self.staging)
        self.logit_rows = torch.full((len(layout.logit_edits), seqs), -1, dtype=torch.int32, device=device)
        # The model runner's positions (one per row, on the device, rewritten each step), which a
        # ring's capture kernels read: the worker sets them before it installs the ops, where its
        # runner adapter knows them (None: no rings).
        self.positions: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor above, once (with copy-out's, their bytes are what `tapc explain` says the
        plan takes)."""
        return [self.table, *self.pools, *self.params.tensors(), *self.logit_params.tensors(), self.logit_rows]

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
