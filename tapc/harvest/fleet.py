"""One harvest over several GPUs: one process and one engine per GPU, each with its share of
the prompts (prompt i goes to rank i mod n), each writing its own resumable part
(`DIR/rank-R/`), and one manifest over all parts at the end.

    tapc harvest spec.yaml prompts.jsonl --gpus 4     # launch(...) then merge(DIR, 4)

A part is a whole harvest (tapc/harvest/run.py) with `split=(rank, n)`: killed and started again
with the same command, every part goes on where it stopped and finished parts do nothing.
Over several nodes: run the same command on each node with `--rank`/`--ranks` per GPU (ranks
numbered over all nodes) into a shared folder, or into local ones gathered afterwards, then
`tapc.harvest.fleet.merge(DIR, n)`.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tapc.errors import TapcError
from tapc.harvest.run import Manifest
from tapc.harvest.writer import ShardRecord


def part(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}"


def launch(commands: list[list[str]], devices: list[str] | None = None) -> None:
    """Run one command per GPU at once (`CUDA_VISIBLE_DEVICES` = its device), wait for all;
    a failed one is an error naming its rank (the others' parts stay, to go on from)."""
    procs = []
    for r, cmd in enumerate(commands):
        env = dict(os.environ)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[r]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c not in (0, 1)]   # 1: done, some prompts failed
    if bad:
        raise TapcError(f"harvest rank {bad[0][0]} exited with {bad[0][1]}: run the same command again to go on")


def merge(folder: str | os.PathLike, n: int) -> Manifest:
    """`DIR/manifest.json` over the parts `DIR/rank-0` .. `rank-{n-1}`, all complete: their
    shards (paths relative to DIR), failures and statistics as one harvest's."""
    folder = Path(folder)
    parts = []
    for r in range(n):
        m = Manifest.read(part(folder, r))
        if not m.complete:
            raise TapcError(f"{part(folder, r)}: this part is not finished: run the harvest again to go on")
        if m.settings.get("split") != [r, n]:
            raise TapcError(f"{part(folder, r)}: a part of split {m.settings.get('split')}, not rank {r} of {n}")
        parts.append(m)
    first = parts[0]
    shards, records, failed = [], [], []
    for r, m in enumerate(parts):
        if m.plan_digest != first.plan_digest:
            raise TapcError(f"{part(folder, r)}: another plan than rank 0's")
        shards += [ShardRecord(**{**vars(s), "file": f"rank-{r}/{s.file}"}) for s in m.shards]
        records += m.shards + ([m.unwritten] if m.unwritten else [])
        failed += m.failed
    whole = Manifest(first.plan_digest, first.keys, first.positions, {**first.settings, "split": [None, n]},
                     first.hooks, shards=shards, prompts=sum(m.prompts for m in parts),
                     rows=sum(m.rows for m in parts), failed=sorted(failed, key=lambda f: f["request"]),
                     plan=first.plan)
    whole.finish(records)
    whole.write(folder)
    return whole
