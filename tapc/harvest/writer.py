"""The harvest's writer: a thread that takes finished requests from a bounded queue, puts their
rows in input order, checks them, and writes them through to shard files.

Requests finish out of order; rows go to disk request after request in submission order, so a
shard's bounds are two (request, row) points and a harvest can restart from the last shard's
end. A request's rows are checked before they are written: a non-finite value fails the request
(listed by request, key and position, never written); each shard keeps per-key sums for the
manifest's statistics.
"""
from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tapc.errors import TapcError
from tapc.harvest.feed import Done, Window
from tapc.harvest.shardfiles import ArrowShard, Column, SafetensorsShard
from tapc.wire.positions import select

# Threads that flush a shard's key columns side by side. On the 16-core GPU host one thread
# writes fresh pages of one file at 2.4 GB/s (/dev/shm) to 3.3 GB/s (/tmp) and four threads no
# faster (the file's lock), but each column's copy to contiguous memory and its statistics come
# before its write, and those run side by side (benchmarks/probes/probe_io.py, docs/harvest.md).
COLUMN_THREADS = 4


@dataclass
class Stats:
    """Per key sums over the rows written: the manifest's statistics (mean, std, mean norm, min,
    max) and the non-finite values that kept requests out."""

    SAMPLE = 16

    rows: int = 0
    sampled: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    norm: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0

    def add(self, x: torch.Tensor) -> None:
        """Rows of one key (`[..., width]`, any float dtype). Rows and min / max are over every
        row; the sums (mean, std, mean norm) over every `SAMPLE`-th row of each piece written, a
        fixed choice so a restarted harvest sums the same rows: reductions over every row cost
        more host time than the engine takes to make them."""
        if not len(x):
            return
        x = x.reshape(-1, x.shape[-1])
        self.rows += len(x)
        lo, hi = torch.aminmax(x)
        self.min, self.max = min(self.min, lo.item()), max(self.max, hi.item())
        some = x[:: self.SAMPLE]
        norms = torch.linalg.vector_norm(some, dim=1, dtype=torch.float32)
        self.sampled += len(some)
        self.sum += some.sum(dtype=torch.float64).item()
        self.sumsq += norms.double().square().sum().item()
        self.norm += norms.sum(dtype=torch.float64).item()

    def merge(self, other: "Stats") -> None:
        self.rows += other.rows
        self.sampled += other.sampled
        self.sum, self.sumsq, self.norm = self.sum + other.sum, self.sumsq + other.sumsq, self.norm + other.norm
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
        self.nonfinite += other.nonfinite

    def summary(self, width: int) -> dict:
        n = self.sampled * width
        mean = self.sum / n if n else None
        return {"rows": self.rows, "mean": mean,
                "std": math.sqrt(max(self.sumsq / n - mean * mean, 0.0)) if n else None,
                "mean_norm": self.norm / self.sampled if self.sampled else None,
                "min": self.min if self.rows else None, "max": self.max if self.rows else None,
                "nonfinite_values": self.nonfinite,
                "sampled_rows": self.sampled}


@dataclass(frozen=True)
class Layout:
    """What the shards hold: `keys` (tapc's) stored as columns `names`, with their widths; `format`
    ("safetensors": `cap` token rows a shard; "arrow": `cap` windows of `context` tokens);
    `dtype` the stored dtype of the keys (arrow has no bf16)."""

    folder: Path
    format: str
    keys: tuple[str, ...]
    names: tuple[str, ...]
    widths: tuple[int, ...]
    dtype: torch.dtype
    cap: int
    positions: str | list[int]
    context: int | None = None
    metadata: dict = field(default_factory=dict)

    def columns(self) -> list[Column]:
        if self.format == "arrow":
            return ([Column(k, (self.context, w), self.dtype) for k, w in zip(self.names, self.widths)]
                    + [Column("token_ids", (self.context,), torch.int32), Column("request", (), torch.int64)])
        return ([Column(k, (w,), self.dtype) for k, w in zip(self.names, self.widths)]
                + [Column(c, (), torch.int64) for c in ("token_ids", "request", "position")])

    def file(self, n: int) -> str:
        return f"data-{n:05d}.arrow" if self.format == "arrow" else f"shard-{n:05d}.safetensors"

    def open(self, n: int, observe=None, pool=None, cap: int | None = None):
        """Shard `n`, sized for `cap` rows (default: the layout's)."""
        kind = ArrowShard if self.format == "arrow" else SafetensorsShard
        return kind(self.folder / self.file(n), self.columns(), cap or self.cap, self.metadata, observe, pool)


@dataclass
class ShardRecord:
    """A committed shard: its rows, where it starts and ends ([seq, row] of the input order),
    per-key sums and the requests that failed while it was open."""

    file: str | None
    rows: int
    start: list[int]
    end: list[int]
    stats: dict[str, dict] = field(default_factory=dict)
    failed: list[dict] = field(default_factory=list)


class Writer:
    """Takes groups of `Done` (`put`, blocking when `depth` groups wait: backpressure), writes
    them in `seq` order from `start` ([seq, rows of it already written]), and calls `commit`
    with each finished shard. `window.give` returns each request's tokens once written."""

    def __init__(self, layout: Layout, window: Window, commit: Callable[[ShardRecord], None], *,
                 start: tuple[int, int] = (0, 0), first_shard: int = 0, depth: int = 4,
                 progress: Callable[[int, int], None] | None = None, threads: int = COLUMN_THREADS):
        self.layout, self.window, self.commit = layout, window, commit
        # flushes a shard's key columns side by side (shardfiles.SafetensorsShard.flush)
        self.pool = ThreadPoolExecutor(min(threads, len(layout.keys)), thread_name_prefix="tapc-harvest-column") \
            if threads > 1 and len(layout.keys) > 1 else None
        self.next_seq, self.skip = start
        self.shard_no = first_shard
        self.written = 0                   # rows this writer has written
        self.expected: int | None = None   # rows it will write in all, where known (`expect`)
        self.progress = progress
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.pending: dict[int, Done] = {}
        self.file = None
        self.key_of = dict(zip(layout.names, layout.keys))   # column name -> tapc key
        self._new_record(list(start))
        self.thread = threading.Thread(target=self._run, name="tapc-harvest-writer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- feed side

    def put(self, group: list[Done]) -> None:
        while True:
            self.window.check()
            try:
                self.q.put(group, timeout=0.5)
                return
            except queue.Full:
                continue

    def expect(self, rows: int) -> None:
        """Every request has been submitted, and this writer will write `rows` rows in all (from
        `start`): the last shard is then opened at its size. Opened at `cap` and ending short, it
        would be rewritten compactly at the close, a copy of all its rows after the engine is
        done (1.6 s for 1.6 GB on the 2-core CPU machine). A request that fails leaves the shard
        short (then compacted); a count that is too low only splits the rest into one more shard."""
        self.expected = rows

    def close(self) -> None:
        """Write what is left (the last shard, short) and stop."""
        self.put(None)
        self.thread.join()
        self.window.check()

    def abandon(self) -> None:
        """Stop without committing the open shard (the feed failed)."""
        try:
            self.q.put_nowait(False)
        except queue.Full:
            pass
        self.thread.join(timeout=30)

    # ------------------------------------------------------------- writer thread

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self.pool is not None:
                self.pool.shutdown()

    def _loop(self) -> None:
        try:
            while True:
                group = self.q.get()
                if group is False:
                    if self.file is not None:
                        self.file.discard()
                    return
                if group is None:
                    if self.pending:
                        raise TapcError(f"requests {sorted(self.pending)[:5]} finished, but request "
                                        f"{self.next_seq} never came back from the engine")
                    self._finish_shard([self.next_seq, 0])
                    return
                for done in group:
                    self.pending[done.seq] = done
                tokens = 0
                while self.next_seq in self.pending:
                    done = self.pending.pop(self.next_seq)
                    self._write(done)
                    self.next_seq += 1
                    self.skip = 0
                    tokens += done.tokens
                if self.file is not None:
                    self.file.flush()
                self.window.give(tokens)
                done = group = None   # drop the captures: their arena chunks go back
        except BaseException as e:   # the feed raises it (Window.check)
            if self.file is not None:
                self.file.discard()
                self.file = None
            self.window.fail(e)

    def _write(self, done: Done) -> None:
        out = done.out
        if out.error is not None:
            self.record.failed.append({"request": done.request, "error": str(out.error)})
            return
        index = _index(out, self.layout.positions, done.request)
        taps = {k: out.taps[k] for k in self.layout.keys}
        out.taps = None
        why = self._check(taps, index, done.suspect)
        if why is not None:
            self.record.failed.append({"request": done.request, "error": why})
            return
        cols = self._columns(taps, index)
        taps = None
        n = len(next(iter(cols.values())))
        at = self.skip   # a restart: rows of this request the last committed shard already has
        while at < n:
            if self.file is None:
                left = self.layout.cap if self.expected is None else self.expected - self.written
                self.file = self.layout.open(self.shard_no, self._observe, self.pool,
                                             left if 0 < left < self.layout.cap else None)
            take = min(n - at, self.file.cap - self.file.rows)
            part = {c: v[at: at + take] for c, v in cols.items()}
            self.file.write(part)   # its keys' statistics are taken as the file writes them (`_observe`)
            at += take
            self.written += take
            self.record.rows += take
            if self.progress is not None:
                self.progress(take, sum(v.nbytes for v in part.values()))
            if self.file.rows == self.file.cap:
                end = [done.seq, at] if at < n else [done.seq + 1, 0]
                self._finish_shard(end)
                self._new_record(end)

    def _check(self, taps: dict[str, torch.Tensor], index: np.ndarray, suspect: bool) -> str | None:
        short = [k for k in self.layout.keys if taps[k].shape[0] != len(index)]
        if short:
            return f"{short[0]} has {taps[short[0]].shape[0]} rows for {len(index)} positions"
        if self.layout.format == "arrow" and len(index) != self.layout.context:
            return (f"{len(index)} rows, but the arrow format stores windows of {self.layout.context} tokens: "
                    "pack the prompts (data: {context_size: ...}) or give prompts of that length")
        for k in self.layout.keys:
            x = taps[k].to(self.layout.dtype)
            if not suspect and (x.dtype == taps[k].dtype or x.dtype.itemsize > taps[k].dtype.itemsize):
                continue   # finite on the device, and no narrowing cast (float16 can overflow) since
            finite = torch.isfinite(x)
            if not bool(finite.all()):
                bad = ~finite.reshape(len(x), -1).all(dim=1)
                self.stats[k].nonfinite += int((~finite).sum())
                pos = index[bad.numpy(), 2].tolist()
                return (f"non-finite values (NaN or inf) in {k} at positions {pos[:10]}"
                        f"{f' and {len(pos) - 10} more' if len(pos) > 10 else ''}; not written")
        return None

    def _columns(self, taps: dict[str, torch.Tensor], index: np.ndarray) -> dict[str, torch.Tensor]:
        """The shard's columns: each key's rows at their plan width (an attention pattern's
        `[heads, keys]` rows flat, as the plan sizes them), and where each row came from."""
        dtype = self.layout.dtype
        taps = {k: taps[k].flatten(1) for k in self.layout.keys}
        if self.layout.format == "arrow":
            cols = {name: taps[k].to(dtype)[None] for k, name in zip(self.layout.keys, self.layout.names)}
            cols["token_ids"] = torch.from_numpy(index[:, 0].astype(np.int32))[None]
            cols["request"] = torch.tensor([int(index[0, 1])], dtype=torch.int64)
            return cols
        cols = {name: taps[k].to(dtype) for k, name in zip(self.layout.keys, self.layout.names)}
        for j, c in enumerate(("token_ids", "request", "position")):
            cols[c] = torch.from_numpy(index[:, j].copy())   # a copy: numpy's column view of one row keeps its stride
        return cols

    def _observe(self, name: str, rows: torch.Tensor) -> None:
        key = self.key_of.get(name)
        if key is not None:
            self.stats[key].add(rows)

    def _new_record(self, start: list[int]) -> None:
        self.record = ShardRecord(self.layout.file(self.shard_no), 0, start, start)
        self.stats = {k: Stats() for k in self.layout.keys}

    def _finish_shard(self, end: list[int]) -> None:
        """Commit the open shard, ending at `end`. At the close with no rows open, a record with
        no file still carries the failures since the last shard."""
        if self.file is not None:
            self.file.finish()
            self.file = None
        elif not self.record.failed and not any(s.nonfinite for s in self.stats.values()):
            return
        self.record.end = list(end)
        if not self.record.rows:
            self.record.file = None
        self.record.stats = {k: vars(s) for k, s in self.stats.items()}
        self.commit(self.record)
        self.shard_no += 1


def _index(out, positions, request: int) -> np.ndarray:
    """`[rows, 3]`: token id, request, position of each captured row (positions that went
    through the model: the prompt and every generated token but the last)."""
    tokens = np.asarray(list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1], dtype=np.int64)
    pos = np.arange(len(tokens))
    pos = pos[select(positions, pos, len(out.prompt_token_ids))]
    return np.stack([tokens[pos], np.full(len(pos), request), pos], axis=1)
