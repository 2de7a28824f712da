"""Reading a harvest back: `Shards(dir)` gives one key's rows in batches, for training.

    acts = Shards("./acts")
    for x in acts.batches("model.layers.12.resid", 4096, shuffle=True, seed=0):
        loss = sae(x.float().cuda())     # x: [4096, width]

One shard is in memory at a time (safetensors loads one tensor of it); shuffling permutes the
shards and the rows within each, so a batch mixes the rows of one shard. `token_ids`, `request`
and `position` are keys like the captures; `request(n)` gives one request's rows. An arrow
harvest reads the same way, a row per token (its windows' rows in order); `Activations` mixes
rows across shards for a DataLoader.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tapc.errors import TapcError
from tapc.harvest.run import INDEX_COLUMNS, Manifest


class Shards:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        self.keys = list(self.manifest.keys) + list(INDEX_COLUMNS)

        self.context = self.manifest.settings.get("context_size") if self.arrow else None

    @property
    def arrow(self) -> bool:
        return self.manifest.settings.get("format") == "arrow"

    def __len__(self) -> int:
        """Rows (tokens; an arrow harvest's manifest counts windows)."""
        return self.manifest.rows * (self.context or 1)

    def load(self, key: str, shard: int) -> torch.Tensor:
        """All rows of `key` in one shard (0 to the count less one: -1 is no last shard here)."""
        if key not in self.keys:
            raise TapcError(f"{key!r} is not in this harvest; it has {', '.join(self.keys)}")
        count = len(self.manifest.shards)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < count:
            raise TapcError(f"shard {shard!r}: {self.folder} has {count} shard(s), numbered 0 to {count - 1}"
                            if count else f"shard {shard!r}: {self.folder} has no shards")
        path = self.folder / self.manifest.shards[shard].file
        if not path.is_file():
            raise TapcError(f"{path}: shard {shard} of {self.folder}'s manifest is missing")
        try:
            if self.arrow:
                return self._load_arrow(key, path)
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except TapcError:
            raise
        except Exception as e:   # a damaged file raises whatever its reader hits first
            why = (str(e).splitlines() or [type(e).__name__])[0][:120]
            raise TapcError(f"{path}: shard {shard} of {self.folder} cannot be read ({why})") from None

    def _load_arrow(self, key: str, path: Path) -> torch.Tensor:
        from tapc.harvest.shardfiles import require_arrow

        pa = require_arrow()
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
        windows, c = table.num_rows, self.context
        if key == "position":
            return torch.arange(c, dtype=torch.int64).repeat(windows)
        if key == "request":
            return torch.from_numpy(table.column("request").to_numpy().copy()).repeat_interleave(c)
        if key == "token_ids":
            return torch.from_numpy(table.column("token_ids").combine_chunks().flatten().to_numpy().astype(np.int64))
        col = table.column(self.manifest.hooks[key]["saelens_hook_name"]).combine_chunks().storage
        values = col.flatten().flatten().to_numpy()
        return torch.from_numpy(values.copy()).view(windows * c, -1)

    def request(self, n: int) -> dict[str, torch.Tensor]:
        """Every key's rows of request `n` (its `request` column: the prompt's index, or under
        `tapc serve --save-to` the number its response carried), in position order. Each shard's
        `request` column says whether it holds some: only those shards' keys are read."""
        parts: dict[str, list[torch.Tensor]] = {}
        for i in range(len(self.manifest.shards)):
            mine = self.load("request", i) == n
            if mine.any():
                for key in self.keys:
                    parts.setdefault(key, []).append(self.load(key, i)[mine])
        if not parts:
            why = next((f["error"] for f in self.manifest.failed if f["request"] == n), None)
            raise TapcError(f"request {n} has no rows in {self.folder}" + (f": it failed: {why}" if why else ""))
        return {key: torch.cat(rows) for key, rows in parts.items()}

    def batches(self, key: str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> Iterator[torch.Tensor]:
        """`[batch_size, ...]` tensors of `key` (the last one smaller unless `drop_last`)."""
        check_batch_size(batch_size)
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self.manifest.shards)) if shuffle else range(len(self.manifest.shards))
        carry = None
        for s in order:
            rows = self.load(key, int(s))
            if shuffle:
                rows = rows[torch.from_numpy(rng.permutation(len(rows)))]
            if carry is not None:
                rows = torch.cat([carry, rows])
            full = len(rows) // batch_size * batch_size
            yield from rows[:full].split(batch_size)
            carry = rows[full:]
        if carry is not None and len(carry) and not drop_last:
            yield carry


class Activations(torch.utils.data.IterableDataset):
    """One key's rows as `[batch_size, width]` tensors for a torch DataLoader (`batch_size=None`)
    or any trainer that takes an iterator (dictionary_learning, sparsify, SAELens's SAETrainer).
    Shuffling mixes across shards: `mix` shards at a time, in a random order, their rows
    permuted together. DataLoader workers take every n-th group of shards. `config` is what
    dictionary_learning saves beside a trained dictionary."""

    def __init__(self, folder: str | Path, key: str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 mix: int = 4):
        self.shards, self.key, self.batch_size = Shards(folder), key, check_batch_size(batch_size)
        self.shuffle, self.seed, self.mix, self.epoch = shuffle, seed, max(1, mix), 0
        if key not in self.shards.keys:
            raise TapcError(f"{key!r} is not in this harvest; it has {', '.join(self.shards.keys)}")
        self.config = {"activation_dim": self.shards.manifest.hooks.get(key, {}).get("width"), "key": key,
                       "harvest": str(folder), "plan_digest": self.shards.manifest.plan_digest}

    def __iter__(self) -> Iterator[torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self.shards.manifest.shards)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        groups = [order[i: i + self.mix] for i in range(0, n, self.mix)]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            groups = groups[info.id:: info.num_workers]
        for group in groups:
            rows = torch.cat([self.shards.load(self.key, int(s)) for s in group])
            if self.shuffle:
                rows = rows[torch.from_numpy(rng.permutation(len(rows)))]
            yield from rows.split(self.batch_size)


def check_batch_size(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TapcError(f"batch_size must be a positive integer, not {n!r}")
    return n
