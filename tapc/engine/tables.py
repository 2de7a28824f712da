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
from tapc.plan import BLOCK, EDIT, ENGINE, READ, TapPlan
from tapc.sizing import is_logit_edit

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
        self.captures = plan.by_kind(READ)
        self.edits = plan.by_kind(EDIT)
        self.blocks = plan.by_kind(BLOCK)     # boundary op k is blocks[k]
        self.engine = plan.by_kind(ENGINE)    # logits / samples: in the runner, outside the graphs
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
        # Edits of the logits, in the runner (points.py): the same ops over the step's logits rows.
        self.logit_edits = tuple(t for t in self.engine if is_logit_edit(t))
        self.logit_edit_params = [tuple(a.param for a in t.args if a.param is not None) for t in self.logit_edits]
        # Edits without parameters are part of the engine's model: they apply to every request.
        self.always = [e for e, names in enumerate(self.edit_params) if not names]

    def edit_row(self, e: int) -> int:
        return len(self.captures) + e


class Store:
    """One request's captures of one group on the host: `[rows, captures, width]`, in chunks."""

    def __init__(self, group: int, caps: np.ndarray, width: int, dtype: torch.dtype, alloc: Alloc, first: int):
        self.group = group
        self.caps = caps
        self.caps_key = caps.tobytes()  # compared for every request at every step: bytes are cheap
        self.width = width
        self.dtype = dtype
        self.alloc = alloc
        self.chunks: list[torch.Tensor] = []
        self.rows = 0                  # rows written
        self.room = 0                  # rows allocated
        self.failed: str | None = None  # why it stopped capturing (no room to grow)
        # The first allocation is made now, when the request is admitted, so that no room for it
        # is an error of this request before it runs (see Arena).
        self._grow(first)
        self.first = first             # rows of the first allocation

    def _grow(self, rows: int) -> None:
        chunk = self.alloc(rows, self.caps.size, self.width, self.dtype)
        self.chunks.append(chunk)
        self._last_base = self.room                       # first row of the last chunk
        self._last_flat = chunk.view(-1, self.width)      # it as `[rows * captures, width]`
        self.room += rows

    def reserve(self, n: int) -> list[torch.Tensor]:
        """Where the next n rows go: views `[rows_i * captures, width]` of the chunks, in order
        (two when they straddle a chunk boundary). This runs for every capturing request at
        every step: the usual case, rows that fit in the last chunk, is one slice."""
        k = self.caps.size
        if self._last_base <= self.rows and self.rows + n <= self.room:
            lo = (self.rows - self._last_base) * k
            self.rows += n
            return [self._last_flat[lo: lo + n * k]]
        if self.failed is not None:
            return []
        if self.room - self.rows < n:
            try:
                self._grow(max(n - (self.room - self.rows), GROW_ROWS))
            except RequestError as e:
                # Its request fails at collect; the others' copies of this step go on. It never
                # captures again (a later row after a gap would sit at the wrong position), and
                # room = rows keeps every later call off the fast path above.
                self.failed, self.room = str(e), self.rows
                return []
        out, start, left = [], self.rows, n
        base = 0
        for chunk in self.chunks:
            lo, hi = max(start - base, 0), min(start + left - base, chunk.shape[0])
            if lo < hi:
                out.append(chunk[lo:hi].view(-1, self.width))
                start, left = start + hi - lo, left - (hi - lo)
            base += chunk.shape[0]
            if left == 0:
                break
        self.rows += n
        return out

    def filled(self) -> list[tuple[torch.Tensor, int]]:
        """Every chunk, with how many of its rows are written (0 for a chunk never reached)."""
        out, left = [], self.rows
        for chunk in self.chunks:
            out.append((chunk, min(left, chunk.shape[0])))
            left -= out[-1][1]
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
        self.logit_edits = [e for e, names in enumerate(layout.logit_edit_params)
                            if names and all(n in self.params for n in names)]
        # The same, as a mask over the plan's edits: fill_step stacks these for a whole batch.
        self.edit_mask = np.zeros(len(layout.edits), dtype=bool)
        self.edit_mask[self.edits] = True
        self.store_of: list[Store | None] = [None] * len(layout.groups)
        for st in self.stores:
            self.store_of[st.group] = st
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

    This runs on the host every step, beside vLLM's own step preparation: it works on arrays
    over all rows of the tapped requests at once (one fancy assignment per group and per edit),
    and its Python per request is attribute reads and one Segment per capturing request.
    """
    table[:, :padded] = -1
    used = [0] * len(layout.groups)
    segments: list[Segment] = []
    batch = [(i, rec) for i, rid in enumerate(req_ids) if (rec := records.get(rid)) is not None]
    if batch:
        rows = _BatchRows(batch, query_start_loc, num_computed)
        if any(rec.stores for rec in rows.recs):
            segments = _fill_captures(layout, table, rows, used)
        if any(rec.slot >= 0 and rec.edits for rec in rows.recs):
            _fill_edits(layout, table, rows)
    if layout.always:
        _fill_always(layout, table, query_start_loc, num_computed, prompt_lens, len(req_ids))
    return segments, used


class _BatchRows:
    """The rows of one step's tapped requests, flattened: for each row its request (index into
    `recs`), its row in the batch and its absolute position."""

    def __init__(self, batch: list[tuple[int, Record]], query_start_loc: np.ndarray, num_computed: np.ndarray):
        idx = np.fromiter((i for i, _ in batch), dtype=np.int64, count=len(batch))
        self.recs = [rec for _, rec in batch]
        starts = query_start_loc[idx].astype(np.int64)
        counts = query_start_loc[idx + 1].astype(np.int64) - starts
        self.req = np.repeat(np.arange(len(batch)), counts)
        offset = np.arange(self.req.size) - np.repeat(np.cumsum(counts) - counts, counts)
        self.row = np.repeat(starts, counts) + offset
        self.pos = np.repeat(num_computed[idx].astype(np.int64), counts) + offset
        self.plen = np.array([rec.prompt_len for rec in self.recs], dtype=np.int64)[self.req]

    def selected(self, ks: list[int], key) -> np.ndarray:
        """Mask over the rows: rows of requests `ks` whose positions (`key` of each request)
        select them; requests with equal positions share one vectorized test."""
        out = np.zeros(self.req.size, dtype=bool)
        by_positions: dict = {}
        for k in ks:
            positions = key(self.recs[k])
            by_positions.setdefault(positions if isinstance(positions, str) else tuple(positions), []).append(k)
        for positions, members in by_positions.items():
            mine = np.zeros(len(self.recs), dtype=bool)
            mine[members] = True
            m = mine[self.req]
            out[m] = select(positions if isinstance(positions, str) else list(positions), self.pos[m], self.plen[m])
        return out


def _fill_captures(layout: Layout, table: np.ndarray, rows: _BatchRows, used: list[int]) -> list[Segment]:
    recs = rows.recs
    capturing = [k for k, rec in enumerate(recs) if rec.stores]
    next_pos = np.array([rec.next_pos for rec in recs], dtype=np.int64)
    want = rows.selected(capturing, lambda rec: rec.positions) & (rows.pos >= next_pos[rows.req])
    sel = np.flatnonzero(want)
    if not sel.size:
        return []
    req = rows.req[sel]
    # Rows are in batch order, so each request's selected rows are one run: its last row sets
    # next_pos, and a row's rank in its run is its index minus the run's start.
    last = np.flatnonzero(np.append(req[1:] != req[:-1], True))
    for k, p in zip(req[last].tolist(), rows.pos[sel[last]].tolist()):
        recs[k].next_pos = p + 1
    n_rows = np.bincount(req, minlength=len(recs))
    rank = np.arange(sel.size) - (np.cumsum(n_rows) - n_rows)[req]
    segments: list[Segment] = []
    for g in range(len(layout.groups)):
        stores = [rec.store_of[g] for rec in recs]
        n_caps = np.array([0 if st is None else st.caps.size for st in stores], dtype=np.int64)
        if not n_caps.any():
            continue
        block = n_rows * n_caps                          # pool rows of each request in this step
        base = used[g] + np.cumsum(block) - block
        keep = n_caps[req] > 0
        r, row, nc = req[keep], rows.row[sel[keep]], n_caps[req[keep]]
        first = base[r] + rank[keep] * nc                # pool row of each row's first capture
        mine = [st for st in stores if st is not None]
        if all(st.caps_key == mine[0].caps_key for st in mine[1:]):
            # The usual case, every request asking for the same captures: one broadcast.
            caps = mine[0].caps
            table[caps[:, None], row[None, :]] = first[None, :] + np.arange(caps.size)[:, None]
        else:
            # One entry per (row, capture j): pool row first + j, table row = the capture.
            j = np.arange(int(nc.sum())) - np.repeat(np.cumsum(nc) - nc, nc)
            caps = np.concatenate([st.caps for st in mine])
            cap_start = np.cumsum(n_caps) - n_caps
            table[caps[np.repeat(cap_start[r], nc) + j], np.repeat(row, nc)] = np.repeat(first, nc) + j
        segments += [Segment(stores[k], int(base[k]), int(n_rows[k])) for k in np.flatnonzero(block).tolist()]
        used[g] += int(block.sum())
    return segments


def _fill_edits(layout: Layout, table: np.ndarray, rows: _BatchRows) -> None:
    """Each bound edit: the request's slot on the rows its tap's `at` covers."""
    slot = np.array([rec.slot for rec in rows.recs], dtype=np.int64)
    bound = np.stack([rec.edit_mask for rec in rows.recs]) & (slot >= 0)[:, None]
    for e in np.flatnonzero(bound.any(axis=0)).tolist():
        m = bound[rows.req, e] & select(layout.edit_at[e], rows.pos, rows.plen)
        table[layout.edit_row(e), rows.row[m]] = slot[rows.req[m]]


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


def copy_segments(segments: list[Segment], pools: list[torch.Tensor],
                  batch: Callable[[list[torch.Tensor], list[torch.Tensor]], bool] | None = None) -> None:
    """Copy each segment's rows from its group's pool (or a snapshot of it) into its request's
    storage. Non-blocking: on the device, the caller orders it on a stream and waits for it.
    `batch` (memcpy.BatchCopy) issues all the copies in one call; where it is None or declines,
    each is one `copy_`."""
    dsts, srcs = [], []
    for seg in segments:
        pool, src = pools[seg.store.group], seg.start
        for view in seg.store.reserve(seg.rows):
            n = view.shape[0]
            dsts.append(view)
            srcs.append(pool[src: src + n])
            src += n
    if batch is None or not batch(dsts, srcs):
        for dst, src in zip(dsts, srcs):
            dst.copy_(src, non_blocking=True)


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
