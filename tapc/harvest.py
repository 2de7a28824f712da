"""Harvest: prompts through a tapped engine, captures to safetensors shards on disk.

    tapc harvest spec.yaml prompts.jsonl            # the spec's `output:` says where
    harvest(llm, prompts, "./acts", shard_tokens=1_000_000, positions="prompt")

A shard `shard-00000.safetensors` holds `shard_tokens` rows (the last one fewer): per captured
key a `[rows, width]` tensor, and per row `token_ids` (the input token at that position),
`request` (the prompt's index in the input) and `position`. Rows come request after request,
each in position order; a request may continue into the next shard. `manifest.json` lists the
plan, the keys, the shards and every request whose taps failed; it is rewritten after each
shard, so a harvest cut short still describes what it wrote. `tapc.data.Shards` reads them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from tapc.engine.positions import select
from tapc.engine.requests import ENGINE_POINTS, TapRequest
from tapc.errors import TapcError

log = logging.getLogger("tapc")

MANIFEST = "manifest.json"
INDEX_COLUMNS = ("token_ids", "request", "position")


@dataclasses.dataclass
class Shard:
    file: str
    rows: int


@dataclasses.dataclass
class Manifest:
    """What a harvest wrote: `shards` in order, and the requests it could not capture."""

    plan_digest: str
    keys: list[str]
    positions: str | list[int]
    shards: list[Shard] = dataclasses.field(default_factory=list)
    prompts: int = 0
    rows: int = 0
    failed: list[dict] = dataclasses.field(default_factory=list)   # {"request": i, "error": str}
    plan: dict = dataclasses.field(default_factory=dict)

    def write(self, folder: Path) -> None:
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, folder / MANIFEST)   # whole or not at all: a reader never sees half

    @classmethod
    def read(cls, folder: str | Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise TapcError(f"{folder}: no {MANIFEST} (not a tapc harvest, or one that wrote nothing yet)")
        data = json.loads(path.read_text())
        return cls(**{**data, "shards": [Shard(**s) for s in data["shards"]]})


class _ShardWriter:
    """Rows into preallocated shard tensors; a full shard goes to disk at once."""

    def __init__(self, folder: Path, shard_tokens: int, manifest: Manifest):
        self.folder, self.cap, self.manifest = folder, shard_tokens, manifest
        self.bufs: dict[str, torch.Tensor] = {}
        self.filled = 0

    def add(self, taps: dict[str, torch.Tensor], index: np.ndarray) -> None:
        """One request's rows: `taps` per key `[n, width]`, `index` `[n, 3]` (token, request, position)."""
        if not self.bufs:
            self.bufs = {k: torch.empty((self.cap, *taps[k].shape[1:]), dtype=taps[k].dtype) for k in self.manifest.keys}
            self.bufs.update({c: torch.empty(self.cap, dtype=torch.int64) for c in INDEX_COLUMNS})
        short = [k for k in self.manifest.keys if taps[k].shape[0] != len(index)]
        if short:
            raise TapcError(f"request {int(index[0, 1]) if len(index) else '?'}: {short[0]} has "
                            f"{taps[short[0]].shape[0]} rows for {len(index)} positions")
        index = torch.from_numpy(index)
        done, n = 0, len(index)
        while done < n:
            take = min(n - done, self.cap - self.filled)
            rows = slice(self.filled, self.filled + take)
            for k in self.manifest.keys:
                self.bufs[k][rows] = taps[k][done: done + take]
            for j, c in enumerate(INDEX_COLUMNS):
                self.bufs[c][rows] = index[done: done + take, j]
            self.filled += take
            done += take
            if self.filled == self.cap:
                self.flush()

    def flush(self) -> None:
        if not self.filled:
            return
        from safetensors.torch import save_file

        name = f"shard-{len(self.manifest.shards):05d}.safetensors"
        save_file({k: v[: self.filled] for k, v in self.bufs.items()}, str(self.folder / name),
                  metadata={"plan_digest": self.manifest.plan_digest})
        self.manifest.shards.append(Shard(name, self.filled))
        self.manifest.rows += self.filled
        self.manifest.write(self.folder)
        self.filled = 0


def harvest(llm, prompts: Iterable, out_dir: str | os.PathLike, *, shard_tokens: int = 1_000_000,
            positions: str | list[int] = "all", sampling_params=None, batch_size: int = 256,
            progress: Callable[[int], None] | None = None) -> Manifest:
    """Run `prompts` (strings, token-id lists, or vLLM prompt dicts) through `llm` (a
    `tapc.VLLM`), `batch_size` per `generate` call, and write every in-graph capture of its
    plan at `positions` to shards in `out_dir`. `sampling_params` default: one greedy token,
    so `positions="all"` is the prompt. `progress(n)` is called after each batch with the
    prompts done. A request whose taps fail is logged and listed in the manifest's `failed`;
    the harvest goes on."""
    from vllm import SamplingParams

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.glob("shard-*.safetensors")):
        raise TapcError(f"{folder} already holds shards: harvest into an empty folder")
    keys = [k for k in llm.plan.capture_keys if k not in ENGINE_POINTS]
    if not keys:
        raise TapcError("the plan captures nothing in the graph: a harvest needs a capture tap "
                        "(e.g. model.layers.*.resid)")
    skipped = [k for k in llm.plan.capture_keys if k in ENGINE_POINTS]
    if skipped:
        log.warning("tapc harvest: %s not written (one row per generated token, not per position)", ", ".join(skipped))
    manifest = Manifest(llm.plan.digest, keys, positions, plan=json.loads(llm.plan.to_json()))
    writer = _ShardWriter(folder, shard_tokens, manifest)
    params = sampling_params or SamplingParams(max_tokens=1, temperature=0.0)
    ask = TapRequest(capture=keys, positions=positions)
    for batch in _batches(prompts, batch_size):
        outs = llm.generate(batch, params, taps=ask, use_tqdm=False)
        for out in outs:
            i = manifest.prompts
            manifest.prompts += 1
            if out.error is not None:
                log.warning("tapc harvest: prompt %d not captured: %s", i, out.error)
                manifest.failed.append({"request": i, "error": str(out.error)})
                continue
            writer.add(out.taps, _index(out, positions, i))
        outs = out = None   # the captures are copied: their shared-memory blocks can go back
        if progress is not None:
            progress(manifest.prompts)
    writer.flush()
    manifest.write(folder)
    return manifest


def read_prompts(path: str | os.PathLike) -> Iterator:
    """Prompts from a file, lazily: `.jsonl`, one per line as a string, a list of token ids or
    an object with `prompt` (text) or `prompt_token_ids`; any other file, one text per line.
    Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise TapcError(f"{path}: no such prompts file")
    with path.open() as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise TapcError(f"{path}:{n}: not JSON ({e.msg})") from None
            if isinstance(item, dict) and set(item) & {"prompt", "prompt_token_ids"}:
                item = item.get("prompt_token_ids", item.get("prompt"))
            if isinstance(item, str) or (isinstance(item, list) and item and all(isinstance(t, int) for t in item)):
                yield item
            else:
                raise TapcError(f"{path}:{n}: a prompt is a string, a list of token ids, or an object "
                                f"with `prompt` or `prompt_token_ids`; got {line[:80]!r}")


def _batches(prompts: Iterable, n: int) -> Iterator[list]:
    batch = []
    for p in prompts:
        batch.append({"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _index(out, positions, request: int) -> np.ndarray:
    """`[rows, 3]`: token id, request, position of each captured row (positions that went
    through the model: the prompt and every generated token but the last)."""
    tokens = np.asarray(list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1], dtype=np.int64)
    pos = np.arange(len(tokens))
    pos = pos[select(positions, pos, len(out.prompt_token_ids))]
    return np.stack([tokens[pos], np.full(len(pos), request), pos], axis=1)
