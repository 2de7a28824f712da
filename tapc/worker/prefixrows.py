"""Captured rows of cached prompt blocks, so that a capture of prompt rows may read vLLM's
prefix cache (opt-in: the engine's `prefix_rows_gib`, one GPU).

A capture changes no KV, yet a request that captures prompt rows must compute every one of
them: vLLM serves a cached prefix without running the forward over it, and its rows would be
missing. Without this module such a request reads no cached KV (tapc/api/prefix.py), so a shared
system prompt is computed again by every request that captures it (bench_serve: 16% to 51% more
prompt tokens than vanilla). With it, the worker keeps the captured rows of prompt blocks that
several requests share, per block hash and capture, and lets the scheduler give a capturing
request a cache hit only as far as those rows go; the worker then writes them into the
request's storage before its first step, as if it had computed them.

- The scheduler (`limit`, through a wrapper of vLLM's `KVCacheManager.get_computed_blocks`,
  patches.py): a request that captures prompt rows may hit the cache over its leading blocks
  whose rows are kept for every capture it asks for, and no further. Its block hashes are kept
  for the worker, and every request's are counted: a block's rows are kept once a second
  request, tapped or not, has it (a shared prefix), not for every request's own prompt.
- The worker (a step component, component.py): `admit` writes the kept rows of a request that starts past 0 into
  its storage (or fails its captures, loudly, if they are gone): it takes their place in the
  storage at once, and the copy (megabytes: 16 MB for a 256-token prefix of 8 captures 4096
  wide, 12-60 ms of the engine's one thread the way it was first written, 0.38x vanilla under
  bench_serve's load) runs on a thread of its own, which the store's `filling` future
  tracks; collect waits for it. `keep` copies, for each
  request that captured every prompt row and whose copies to host memory are done (looked at
  each step, and when it is collected), the rows of its shared full blocks; `trim` drops the
  least recently used blocks past the budget, a prompt's tail before its head, each step.
Both run in the engine-core process's one thread, the scheduler's step then the worker's
(vLLM's single-process executor runs the worker in it): a hit allowed by one scheduler step is
admitted in the worker's next call, before anything is dropped. Several GPUs run their workers
in other processes, where neither the hashes nor the scheduler are at hand: refused there
(tapc/api/engine_args.py).
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tapc.errors import ProtocolError
from tapc.wire.positions import ALWAYS_COMPUTED, select
from tapc.wire.protocol import WireRequest
from tapc.worker.component import StepComponent
from tapc.worker.layout import Layout
from tapc.worker.patches import Patch, cache_lookup_patch

# Block hashes counted (how many requests had each): the most recent this many, a block seen
# again moving to the end. Every request's blocks are counted, so the bound is reached under
# any steady traffic: 256K entries (4M tokens of 16-token blocks) hold about 40 MB of the
# engine's host memory, hashes included.
COUNTED = 1 << 18


class PrefixRows(StepComponent):
    def __init__(self, layout: Layout, block: int, budget: int, kv_manager: type | None = None):
        """`kv_manager`: the scheduler's KV cache manager class whose lookup it limits (None: vLLM's)."""
        self.layout = layout
        self.kv_manager = kv_manager
        self.block = block                 # tokens a block (vLLM's cache_config.block_size)
        self.budget = budget               # bytes of rows kept
        self.size = 0
        self.rows: OrderedDict = OrderedDict()     # block hash -> {capture: [block, width] rows}, LRU first
        self.hashes: dict[str, list] = {}          # vLLM request id -> its block hashes (the scheduler's list)
        self._counts: OrderedDict = OrderedDict()  # block hash -> requests seen with it
        self._caps: dict[str, np.ndarray | None] = {}   # request id -> captures of prompt rows it asks for
        self._pending: dict[str, object] = {}      # request id -> record whose rows may be kept, not yet looked at
        self._prompt_copied: dict[str, list] = {}  # request id -> the events of its prompt rows' copies
        # One thread, so a store's later fill (a resumed request) runs after its earlier one;
        # torch's copies let go of the GIL, so the engine's thread goes on meanwhile.
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tapc-prefix-rows")

    # ---------------------------------------------------------------- the scheduler's side

    def patches(self, runner) -> list[Patch]:
        """vLLM's prefix-cache lookup, limited by `limit` (patches.py `cache_lookup_patch`)."""
        return [cache_lookup_patch(self, self.kv_manager)]

    def limit(self, rid: str, hashes: list, extra_args: dict | None) -> int | None:
        """The leading blocks whose cached KV request `rid` may read: None where it captures no
        prompt row (no limit), else as far as every capture it asks for has kept rows."""
        if rid not in self.hashes:
            # Every request's blocks are counted, untapped and steered ones too: the first request
            # that captures a system prompt the traffic shares then has its rows kept, and the
            # second reads them (counting capturing requests only, both computed it).
            self.hashes[rid] = hashes
            for h in hashes:
                self._counts[h] = self._counts.pop(h, 0) + 1
            while len(self._counts) > COUNTED:
                self._counts.popitem(last=False)
        caps = self._asks(rid, extra_args)
        if caps is None:
            return None
        n = 0
        while n < len(hashes) and _covers(self.rows.get(hashes[n]), caps):
            n += 1
        self._touch(hashes[:n])
        return n

    def _touch(self, hashes) -> None:
        """Used: most recent, the leading block most of all, so that a chain is dropped from its
        tail (a block is of use only behind the ones before it), as vLLM frees its blocks."""
        for h in reversed(hashes):
            self.rows.move_to_end(h)

    def _asks(self, rid: str, extra_args: dict | None) -> np.ndarray | None:
        if rid not in self._caps:
            self._caps[rid] = None
            raw = (extra_args or {}).get("tapc")
            if raw is not None:
                try:
                    ask = WireRequest.from_wire(raw).ask
                except ProtocolError:   # the worker refuses it at admission, and says why
                    ask = None
                if ask is not None and ask.capture and ask.positions not in ALWAYS_COMPUTED:
                    self._caps[rid] = np.array(sorted(self.layout.cap_index[k] for k in ask.capture
                                                      if k in self.layout.cap_index), dtype=np.int64)
        return self._caps[rid]

    # ---------------------------------------------------------------- the worker's side

    def scheduled(self, finished_untapped) -> None:
        for rid in finished_untapped:
            self.forget(rid)
        # after admissions, so what the scheduler allowed them is still kept
        self.keep()
        self.trim()

    def collect(self, rec) -> dict:
        # its copies are done (StepTables.collect): the last chance to keep its rows
        self.keep([rec])
        self.forget(rec.rid)
        return {}

    def admit(self, rec, computed: int) -> None:
        """`rec` starts at position `computed` (vLLM served the rest from its cache): its rows
        below that, from the kept ones, into its storage, as the step fill would have put them
        (their place taken now, written on the filler thread). A request that captures every
        prompt row is looked at by `keep` from now on."""
        if not rec.stores:   # it captures nothing (a steered request): no rows to write
            return
        if rec.positions in ("all", "prompt"):
            self._pending.setdefault(rec.rid, rec)
        pos = np.arange(rec.next_pos, computed)
        pos = pos[select(rec.positions, pos, rec.prompt_len)]
        if not pos.size:
            return
        hashes = self.hashes.get(rec.rid, [])
        # The blocks of its rows (`pos` ascends: each block's first row starts a run), and each
        # row's block among them: no sort, as np.unique and searchsorted would make.
        of_row = pos // self.block
        starts = np.empty(of_row.size, dtype=bool)
        starts[0], starts[1:] = True, of_row[1:] != of_row[:-1]
        blocks, src_block = of_row[starts].tolist(), np.cumsum(starts) - 1
        need = {int(c) for st in rec.stores for c in st.caps}   # every capture it asks for
        kept = []
        for b in blocks:
            rows = self.rows.get(hashes[b]) if b < len(hashes) else None
            if rows is None or not need <= rows.keys():
                for st in rec.stores:
                    st.failed = (f"its first {computed} tokens came from vLLM's prefix cache, and the captured rows "
                                 f"of block {b} are no longer kept (prefix_rows_gib)")
                rec.next_pos = computed
                return
            kept.append(rows)
        self._touch([hashes[b] for b in blocks])
        for st in rec.stores:
            first = st.take(len(pos))
            if first is not None:
                st.filling = self._filler.submit(_fill, st, st.span(first, len(pos)), kept, src_block, pos % self.block)
        rec.next_pos = computed

    def keep(self, records=None) -> None:
        """For each request that captured every prompt row (`records`, or all admitted so), once
        the copies of those rows to host memory are done: the rows of its full prompt blocks that
        another request shares."""
        for rec in list(self._pending.values()) if records is None else records:
            if rec.rid not in self._pending or rec.next_pos < rec.prompt_len:
                continue
            # the copies of the step that took its last prompt row (a later step's event would
            # do too, but a request still decoding always has one in flight)
            done = self._prompt_copied.get(rec.rid)
            if done is None:
                done = [st.copied for st in rec.stores]
                if any(e is None for e in done):
                    continue
                self._prompt_copied[rec.rid] = done
            if not all(e.query() for e in done) or any(st.filling is not None and not st.filling.done()
                                                         for st in rec.stores):
                continue
            del self._pending[rec.rid], self._prompt_copied[rec.rid]
            if any(st.failed is not None for st in rec.stores):
                continue
            hashes = self.hashes.get(rec.rid, [])
            for b in reversed(range(min(rec.prompt_len // self.block, len(hashes)))):   # the tail least recent
                h = hashes[b]
                if self._counts.get(h, 0) < 2:
                    continue
                rows = self.rows.setdefault(h, {})   # a block kept for other captures gets these too
                for st in rec.stores:
                    if _covers(rows, st.caps):
                        continue
                    block = torch.cat([chunk[lo: lo + n] for chunk, lo, n in st.span(b * self.block, self.block)])
                    for j, c in enumerate(st.caps):
                        if int(c) not in rows:
                            rows[int(c)] = block[:, j].clone()
                            self.size += rows[int(c)].nbytes

    def trim(self) -> None:
        """Drop the least recently used blocks' rows past the budget."""
        while self.size > self.budget and self.rows:
            _, kept = self.rows.popitem(last=False)
            self.size -= sum(t.nbytes for t in kept.values())

    def forget(self, rid: str) -> None:
        """`rid` finished (untapped), or was collected: its hashes and asks are not needed any more."""
        self.hashes.pop(rid, None)
        self._caps.pop(rid, None)
        self._pending.pop(rid, None)
        self._prompt_copied.pop(rid, None)


def _fill(st, spans: list, kept: list[dict], src_block: np.ndarray, src_row: np.ndarray) -> None:
    """Write kept rows into a store's place for them (`spans`, as `Store.span` gave it): row i
    is row `src_row[i]` of block `kept[src_block[i]]`. One `stack` a run of rows that lie
    together in both, every capture at once; a failure fails the store's captures. Under
    inference mode, as the worker's step that made the chunks (the mode is per thread)."""
    try:
        ends = np.cumsum([count for _, _, count in spans])
        cuts = np.flatnonzero((np.diff(src_block) != 0) | (np.diff(src_row) != 1)) + 1
        bounds = np.unique(np.concatenate([[0], cuts, ends]))
        span = 0
        with torch.inference_mode():
            for a, b in zip(bounds[:-1], bounds[1:]):
                while a >= ends[span]:
                    span += 1
                chunk, lo, _ = spans[span]
                at = lo + a - (ends[span - 1] if span else 0)
                rows, r = kept[src_block[a]], int(src_row[a])
                torch.stack([rows[int(c)][r: r + b - a] for c in st.caps], dim=1, out=chunk[at: at + b - a])
    except Exception as e:   # noqa: BLE001 - anything here is this request's loss alone
        st.failed = f"copying its kept prefix rows failed: {type(e).__name__}: {e}"


def _covers(rows: dict | None, caps) -> bool:
    """Whether a block's kept rows (None: none) hold every one of these captures."""
    return rows is not None and all(int(c) in rows for c in caps)
