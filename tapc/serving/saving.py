"""A server's harvest folder: requests that ask `"save": true` have their captures written there
as `tapc harvest` writes them (shards and `manifest.json`, which `tapc.data` and the SAE
trainers read), rather than kept for a fetch.

    tapc serve MODEL --tap 'model.layers.*.resid' --save-to /data/acts [--save-positions all]

Every saving request captures the folder's keys (the plan's in-graph captures) at the folder's
positions. It gets its number when its response has gone out whole, in that order: the
`request` column of its rows, which its response carries (`"tapc": {"id", "saved": n}`, in
the JSON body or in one more streamed event). Its rows then go to the writer thread; a request
whose taps failed, or whose captures hold a NaN or inf, is listed in the manifest's `failed`
instead. A request whose response did not complete (aborted, failed) gets no number and is not
in the folder. Shards are committed when full and when the server stops (SIGTERM, Ctrl-C; a
request still being collected then is listed as failed); a
server killed outright loses the rows after the last committed shard, and a server started
again on the folder numbers on after it. One API server process only: two writers cannot
share one folder's shards. The captures waiting for the writer stay where the engine put them
(the arena in /dev/shm): a writer slower than the traffic fills it, and saving requests then
fail as any tapped request does when there is no room for its captures.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
from pathlib import Path
from types import SimpleNamespace as NS

from tapc.api.requests import TapRequest
from tapc.errors import RequestError, TapcError
from tapc.harvest.feed import Done, Window
from tapc.harvest.run import open_folder
from tapc.harvest.writer import ShardRecord, Writer
from tapc.serving.asks import HttpAsk

log = logging.getLogger("tapc")


class SaveFolder:
    def __init__(self, plan, folder: str | Path, *, shard_tokens: int = 1_000_000, positions="all",
                 format: str = "safetensors", dtype: str | None = None, context_size: int | None = None):
        self.folder = Path(folder)
        self.layout, self.manifest = open_folder(plan, self.folder, format=format, dtype=dtype,
                                                 shard_tokens=shard_tokens, context_size=context_size,
                                                 positions=positions, more={"source": {"kind": "server"}})
        self.keys, self.positions = list(self.layout.keys), positions
        # A server's requests cannot run again: the failures listed after the last shard stay.
        before = self.manifest.unwritten.failed if self.manifest.unwritten else []
        self.manifest.reopen()
        seq, row = self.manifest.shards[-1].end if self.manifest.shards else (0, 0)
        seq = max(seq, self.manifest.prompts)   # numbers failed after the last shard were given already
        cut = row > 0   # a request cut by the last committed shard: the rest of its rows died with the server
        self.next = seq + cut
        # The server's captures wait in the writer's queue (bounded: a put waits, in a thread),
        # not in a window of tokens in flight.
        self.window = Window(1 << 62)
        self.writer = Writer(self.layout, self.window, self._commit, start=(self.next, 0),
                             first_shard=len(self.manifest.shards))
        self.writer.record.failed += before   # listed again with the next shard
        if cut:
            self.writer.record.failed.append({"request": seq, "error": f"its first {row} rows are in the last "
                                                                      "shard; the server stopped before the rest"})
        self.unsent: set[int] = set()   # numbers given whose rows have not gone to the writer
        self.closed = False
        atexit.register(self.close)

    def ask(self, ask: HttpAsk, where: str) -> TapRequest:
        """The ask a saving request runs: the folder's keys at its positions. A request that
        names other captures or positions is refused: the shards hold one set of columns."""
        if self.window.error is not None:   # the writer stopped (a full disk): say so before the request runs
            raise RequestError(f"{where}: the save folder {self.folder} takes no more rows: {self.window.error}")
        capture = ask.request.capture
        if capture and capture not in ("*", ["*"]) and sorted(capture) != sorted(self.keys):
            raise RequestError(f"{where}: a saving request captures this server's save keys ({', '.join(self.keys)}); "
                               "leave `capture` out, or ask for its results by id instead of `save`")
        if "positions" in ask.given and ask.request.positions != self.positions:
            raise RequestError(f"{where}: this server saves positions {self.positions!r}, not "
                               f"{ask.request.positions!r}; leave `positions` out, or ask for its results by id "
                               "instead of `save`")
        return TapRequest(capture=self.keys, positions=self.positions, params=ask.request.params)

    def number(self) -> int:
        """The next request's number (its `request` column): in the order responses complete."""
        self.next += 1
        self.unsent.add(self.next - 1)
        return self.next - 1

    async def put(self, n: int, prompt_token_ids, token_ids, taps: dict, error) -> None:
        """Request `n`'s rows (or its error) to the writer, which writes them in number order."""
        out = NS(prompt_token_ids=list(prompt_token_ids), outputs=[NS(token_ids=list(token_ids))], taps=taps,
                 error=error)
        self.unsent.discard(n)
        await asyncio.to_thread(self.writer.put, [Done(n, n, out, 0)])

    def close(self) -> None:
        """Write what is left, commit the last shard and the manifest (at the server's exit).
        Numbers given to requests whose rows never reached the writer (the server stopped while
        they were collected) are listed as failed, so the rows after them are still written."""
        if self.closed:
            return
        self.closed = True
        for n in sorted(self.unsent):
            why = TapcError("the server stopped before its captures were collected")
            self.writer.put([Done(n, n, NS(error=why), 0)])
        try:
            self.writer.close()
        except TapcError as e:
            log.error("tapc: the save folder %s: %s", self.folder, e)
            return
        self.manifest.finish()
        self.manifest.write(self.folder)
        if self.layout.format == "arrow":
            from tapc.harvest.shardfiles import write_dataset_files

            write_dataset_files(self.folder, self.layout.columns(), [s.file for s in self.manifest.shards],
                                self.manifest.plan_digest)

    def _commit(self, record: ShardRecord) -> None:
        self.manifest.add(record)
        self.manifest.write(self.folder)
