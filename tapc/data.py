"""Reading a harvest back: `Shards(dir)` gives one key's rows in batches, for training.

    acts = Shards("./acts")
    for x in acts.batches("model.layers.12.resid", 4096, shuffle=True, seed=0):
        loss = sae(x.float().cuda())     # x: [4096, width]

One shard is in memory at a time (safetensors loads one tensor of it); shuffling permutes the
shards and the rows within each, so a batch mixes the rows of one shard. `token_ids`, `request`
and `position` are keys like the captures.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tapc.errors import TapcError
from tapc.harvest import INDEX_COLUMNS, Manifest


class Shards:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        self.keys = list(self.manifest.keys) + list(INDEX_COLUMNS)

    def __len__(self) -> int:
        return self.manifest.rows

    def load(self, key: str, shard: int) -> torch.Tensor:
        """All rows of `key` in one shard."""
        from safetensors import safe_open

        if key not in self.keys:
            raise TapcError(f"{key!r} is not in this harvest; it has {', '.join(self.keys)}")
        with safe_open(str(self.folder / self.manifest.shards[shard].file), framework="pt") as f:
            return f.get_tensor(key)

    def batches(self, key: str, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> Iterator[torch.Tensor]:
        """`[batch_size, ...]` tensors of `key` (the last one smaller unless `drop_last`)."""
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
