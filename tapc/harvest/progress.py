"""A harvest's progress on the terminal (rich): prompts and tokens in, tokens/s, GB written,
ETA when the number of prompts is known; a summary at the end. Quiet when stderr is not a
terminal: then the opening line and the summary go to the `tapc` logger."""
from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("tapc")


class HarvestProgress:
    def __init__(self, show: bool | None, folder: Path, total: int | None = None):
        self.show = sys.stderr.isatty() if show is None else show
        self.folder, self.total = folder, total
        self.prompts = self.tokens = self.rows = self.bytes = 0
        self.skipped = 0   # prompts a restart does not run again
        self.started = time.monotonic()
        self._lock = threading.Lock()   # the writer thread counts rows, the feed counts prompts
        self._bar = None

    def say(self, text: str) -> None:
        if self.show:
            from rich.console import Console

            Console(stderr=True).print(text, highlight=False)
        else:
            log.info(text)

    def __enter__(self):
        if self.show:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("harvest"), BarColumn(), TextColumn("{task.completed:,} prompts"),
                                 TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[written]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("harvest", total=self.total, rate="", written="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._refresh()
            self._bar.stop()

    def submitted(self, tokens: int) -> None:
        with self._lock:
            self.prompts += 1
            self.tokens += tokens
        if self._bar is not None and self.prompts % 64 == 0:
            self._refresh()

    def written(self, rows: int, nbytes: int) -> None:
        with self._lock:
            self.rows += rows
            self.bytes += nbytes

    def _refresh(self) -> None:
        dt = max(time.monotonic() - self.started, 1e-9)
        self._bar.update(self._task, completed=self.prompts + self.skipped, rate=f"{self.tokens / dt:,.0f} tok/s",
                         written=f"{self.bytes / 1e9:.2f} GB")

    def summary(self, manifest) -> None:
        dt = time.monotonic() - self.started
        self.say(f"tapc harvest: {manifest.prompts:,} prompts, {manifest.rows:,} rows in {len(manifest.shards)} "
                 f"shard(s) of {self.folder} ({self.bytes / 1e9:.2f} GB written this run in {dt:.1f} s, "
                 f"{self.tokens / max(dt, 1e-9):,.0f} tokens/s); {len(manifest.failed)} prompt(s) failed")
