"""The host side of every step: which rows of the batch go where, and what each request kept.

vLLM runs one flat `[num_tokens, width]` slab per step, requests back to back
(`query_start_loc`), padded up to a CUDA-graph size. Before each forward the host fills one
int32 row table per tap (`table[k, row]`), and the graphs read them on the device:

- capture c (a READ tap): the row of its group's pool the row goes to, -1 to skip it;
- edit e (an EDIT tap): the slot of the request's parameters in the per-slot tables, -1 to
  leave the row alone.

Captures of one width and dtype share a pool (a *group*). A request's rows are laid out
position-major, `[rows, its captures in the group, width]`, so that one step's block of one
request is one contiguous run of the pool and lands with one copy in that request's host
storage, which has the same layout. Padding rows and requests that ask for nothing stay -1.

Nothing here touches the device: `buffers` moves the tables and pools, `runner` calls `fill`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from tapc.engine.requests import select
from tapc.errors import EngineError, RequestError
from tapc.plan import EDIT, READ, TapPlan

# Rows a request's host storage grows by past its first allocation, which is sized for every
# row the request can have (rarely exceeded: a preempted request, or max_tokens unknown).
GROW_ROWS = 64

# (rows, captures, width, dtype) -> an empty CPU tensor; the worker allocates pinned memory.
Alloc = Callable[[int, int, int, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class Group:
    """Captures that share one pool: same width, same dtype."""

    width: int
    dtype: str
    caps: tuple[int, ...]          # capture indices, in plan order


class Layout:
    """The plan's in-graph taps as table rows: capture c is row c, edit e is row C + e."""

    def __init__(self, plan: TapPlan):
        unsupported = [t for t in plan.taps if t.kind not in (READ, EDIT) or t.point.site == "source"]
        if unsupported:
            t = unsupported[0]
            raise EngineError(f"`{t.source}`: this engine runs in-graph captures and edits at module inputs, "
                              "outputs and `.resid`; Python blocks, `logits`, `samples` and `.source` points are "
                              "not served yet")
        self.captures = plan.by_kind(READ)
        self.edits = plan.by_kind(EDIT)
        self.plan_order = {id(t): i for i, t in enumerate(plan.taps)}
        self.cap_index = {t.key: i for i, t in enumerate(self.captures)}
        groups: dict[tuple[int, str], list[int]] = {}
        for i, t in enumerate(self.captures):
            groups.setdefault((t.width, t.dtype), []).append(i)
        self.groups = tuple(Group(w, d, tuple(c)) for (w, d), c in groups.items())
        self.cap_group = np.zeros(len(self.captures), dtype=np.int64)
        for g, group in enumerate(self.groups):
            self.cap_group[list(group.caps)] = g
        self.num_tables = len(self.captures) + len(self.edits)
        self.edit_at = [next((a.value for a in t.args if a.name == "at"), "all") for t in self.edits]
        self.edit_params = [tuple(a.param for a in t.args if a.param is not None) for t in self.edits]
        # Edits without parameters are part of the engine's model: they apply to every request.
        self.always = [e for e, names in enumerate(self.edit_params) if not names]

    def edit_row(self, e: int) -> int:
        return len(self.captures) + e


class Store:
    """One request's captures of one group on the host: `[rows, captures, width]`, in chunks."""

    def __init__(self, group: int, caps: np.ndarray, width: int, dtype: torch.dtype, alloc: Alloc, first: int):
        self.group = group
        self.caps = caps
        self.width = width
        self.dtype = dtype
        self.alloc = alloc
        self.chunks: list[torch.Tensor] = []
        self.rows = 0                  # rows written
        self.room = 0                  # rows allocated
        self.first = first             # rows of the first allocation

    def reserve(self, n: int) -> list[torch.Tensor]:
        """Views for the next n rows, in order (two when they straddle a chunk boundary)."""
        if self.room - self.rows < n:
            grow = max(n - (self.room - self.rows), GROW_ROWS if self.chunks else self.first)
            self.chunks.append(self.alloc(grow, len(self.caps), self.width, self.dtype))
            self.room += grow
        out, start, left = [], self.rows, n
        base = 0
        for chunk in self.chunks:
            lo, hi = max(start - base, 0), min(start + left - base, chunk.shape[0])
            if lo < hi:
                out.append(chunk[lo:hi])
                start, left = start + hi - lo, left - (hi - lo)
            base += chunk.shape[0]
            if left == 0:
                break
        self.rows += n
        return out

    def filled(self) -> list[torch.Tensor]:
        """The written rows, chunk by chunk."""
        out, left = [], self.rows
        for chunk in self.chunks:
            if left == 0:
                break
            out.append(chunk[: min(left, chunk.shape[0])])
            left -= out[-1].shape[0]
        return out


class Record:
    """What the worker keeps about one tapped request, from its first step until it is collected."""

    def __init__(self, layout: Layout, rid: str, wire: dict, prompt_len: int, max_tokens: int, alloc: Alloc):
        self.rid = rid                 # vLLM's request id
        self.id: str = wire["id"]      # the API's id for it
        self.prompt_len = prompt_len
        self.positions = wire["positions"]
        self.params: dict = wire["params"]
        try:
            caps = np.array(sorted(layout.cap_index[k] for k in wire["capture"]), dtype=np.int64)
        except KeyError as e:
            raise RequestError(f"capture {e.args[0]!r} is not in this engine's plan") from None
        # Every row it can have, plus one: with async scheduling vLLM may run one more step for a
        # request that has just finished (the API drops that row).
        first = expected_rows(self.positions, prompt_len, max_tokens) + 1
        self.stores = []
        for g, group in enumerate(layout.groups):
            mine = caps[layout.cap_group[caps] == g]
            if mine.size:
                self.stores.append(Store(g, mine, group.width, getattr(torch, group.dtype), alloc, first))
        self.edits = [e for e, names in enumerate(layout.edit_params) if names and all(n in self.params for n in names)]
        self.slot = -1
        # Positions below this were captured already: a request preempted and resumed recomputes
        # its tokens from 0, and each position is kept once, the first time it went through.
        self.next_pos = 0
        self.finished = False


@dataclass(frozen=True)
class Segment:
    """One request's block of one step in one group: pool rows [start, start + rows * C)."""

    store: Store
    start: int
    rows: int


def fill_step(layout: Layout, table: np.ndarray, records: dict[str, Record], req_ids: list[str],
              query_start_loc: np.ndarray, num_computed: np.ndarray, prompt_lens: np.ndarray,
              padded: int) -> tuple[list[Segment], list[int]]:
    """Write `table[:, :padded]` for one batch; return the capture segments to copy out after the
    forward and the rows used in each group's pool.

    req_ids, query_start_loc (len R + 1), num_computed (tokens of each request before this step,
    i.e. the position of its first row) and prompt_lens are in batch order; records maps vLLM
    request ids to tapped requests (the others are left alone).
    """
    table[:, :padded] = -1
    used = [0] * len(layout.groups)
    segments: list[Segment] = []
    for i, rid in enumerate(req_ids):
        rec = records.get(rid)
        if rec is None:
            continue
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        pos = np.arange(num_computed[i], num_computed[i] + end - start)
        if rec.stores:
            rows = np.flatnonzero(select(rec.positions, pos, rec.prompt_len) & (pos >= rec.next_pos))
            if rows.size:
                rec.next_pos = int(pos[rows[-1]]) + 1
                for st in rec.stores:
                    n_caps = st.caps.size
                    base = used[st.group]
                    dst = base + np.arange(rows.size)[None, :] * n_caps + np.arange(n_caps)[:, None]
                    table[st.caps[:, None], (start + rows)[None, :]] = dst
                    segments.append(Segment(st, base, int(rows.size)))
                    used[st.group] += int(rows.size) * n_caps
        if rec.slot >= 0:
            for e in rec.edits:
                rows = np.flatnonzero(select(layout.edit_at[e], pos, rec.prompt_len))
                table[layout.edit_row(e), start + rows] = rec.slot
    if layout.always:
        _fill_always(layout, table, query_start_loc, num_computed, prompt_lens, len(req_ids))
    return segments, used


def _fill_always(layout: Layout, table: np.ndarray, query_start_loc, num_computed, prompt_lens,
                 num_reqs: int) -> None:
    """Parameterless edits: every row of every request, by the tap's `at`. Slot 0: their
    tables hold the same literals in every slot."""
    counts = np.diff(query_start_loc[: num_reqs + 1])
    num_tokens = int(query_start_loc[num_reqs])
    starts = np.repeat(query_start_loc[:num_reqs], counts)
    pos = np.repeat(num_computed[:num_reqs], counts) + np.arange(num_tokens) - starts
    plen = np.repeat(prompt_lens[:num_reqs], counts)
    for e in layout.always:
        rows = np.flatnonzero(select(layout.edit_at[e], pos, plen))
        table[layout.edit_row(e), rows] = 0


def copy_segments(segments: list[Segment], pools: list[torch.Tensor]) -> None:
    """Copy each segment's rows from its group's pool (or a snapshot of it) into its request's
    storage. Non-blocking: on the device, the caller orders it on a stream and waits for it."""
    for seg in segments:
        pool, n_caps, src = pools[seg.store.group], seg.store.caps.size, seg.start
        for view in seg.store.reserve(seg.rows):
            n = view.shape[0] * n_caps
            view.view(n, -1).copy_(pool[src: src + n], non_blocking=True)
            src += n


class Slots:
    """Slots of the per-request parameter tables; a request holds one while it is scheduled."""

    def __init__(self, n: int):
        self.free = list(range(n - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            raise EngineError("all parameter slots are taken: more edited requests are running than "
                              "max_num_seqs allows")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)


def expected_rows(positions, prompt_len: int, num_generated: int) -> int:
    """How many rows a finished request's capture has: positions that went through the model
    (0 .. prompt_len + num_generated - 2) and that `positions` covers."""
    pos = np.arange(prompt_len + max(num_generated, 1) - 1)
    return int(select(positions, pos, prompt_len).sum())
