"""The toy engine as a Ray harvest's engine factory, and a Ray harvest's driver in a process of
its own, for the test that kills it (not a test module).

    python tests/support/harvest_ray_child.py ADDRESS PROMPTS OUT_DIR [--die-after-parts N]

`ToyEngine` is what tapc.harvest.engines' factories are for the GPU: `plan()` on the driver,
and called in each actor, a `tapc.VLLM` over the toy engine (tests/support/engine_toy.py); with
`die_at`, the actor SIGKILLs itself as it makes that write to a shard file (half a request's
rows flushed: mid-shard), once (a marker file says it did), as a crash would. The driver
harvests the PROMPTS file (`write_prompts`) over the cluster at ADDRESS into OUT_DIR with
`ToyEngine` (its actors' process ids in OUT_DIR/../pids); with --die-after-parts it SIGKILLs
itself once N parts are written, the other actors mid-part.
"""
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]   # engine_toy, tapc

import numpy as np  # noqa: E402

TAPS = ("model.layers.*.resid", "model.layers.1.mlp.down_proj.input")
LENS = [5, 17, 3, 9, 30, 1, 12, 8, 21, 4, 15, 6, 11, 2, 19, 7, 13, 3, 26, 10, 5, 8]
PART_PROMPTS = 4
SHARD_TOKENS = 16
WINDOW_TOKENS = 40


def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 50, n).tolist() for n in LENS]


def write_prompts(path) -> None:
    """`prompts()` as a prompts file, in its forms: a list of token ids, an object, a blank line."""
    import json

    lines = [json.dumps(p if i % 2 else {"prompt_token_ids": p}) for i, p in enumerate(prompts())]
    Path(path).write_text("\n".join(lines[:5] + ["  "] + lines[5:]) + "\n")


@dataclass(frozen=True)
class ToyEngine:
    taps: tuple = TAPS
    die_at: tuple | None = None   # (the write to a shard file to die at, a marker file)
    pids: str | None = None       # a folder where each actor leaves a file named by its process id

    def plan(self):
        from engine_toy import toy_plan

        return toy_plan(list(self.taps))

    def __call__(self):
        from engine_toy import toy_vllm

        if self.pids is not None:
            Path(self.pids).mkdir(parents=True, exist_ok=True)
            (Path(self.pids) / str(os.getpid())).touch()
        if self.die_at is not None and not os.path.exists(self.die_at[1]):
            _die_at_write(*self.die_at)
        return toy_vllm(list(self.taps))[0]


def _die_at_write(n: int, marker: str) -> None:
    from tapc.harvest.shardfiles import SafetensorsShard

    write, calls = SafetensorsShard.write, [0]

    def write_then_die(self, cols):
        calls[0] += 1
        if calls[0] == n and _first(marker):
            write(self, {c: v[: max(1, len(v) // 2)] for c, v in cols.items()})   # half a request's rows
            self.flush()   # ... in the file
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, cols)

    SafetensorsShard.write = write_then_die


def _first(marker: str) -> bool:
    """Whether this process is the first to get here (it makes the marker file)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def run(prompts, out_dir, engine=ToyEngine(), **kwargs):
    """The toy harvest of `prompts` (a file, or a Ray dataset) over the cluster this process is
    connected to (`kwargs`: harvest_ray's, over these)."""
    from vllm import SamplingParams

    from tapc.harvest.cluster import harvest_ray

    defaults = dict(engines=2, gpus_per_engine=0, cpus_per_engine=0.5, part_prompts=PART_PROMPTS,
                    shard_tokens=SHARD_TOKENS, positions="all", window_tokens=WINDOW_TOKENS, collect_every=3,
                    sampling_params=SamplingParams(max_tokens=2))
    return harvest_ray(engine, prompts, out_dir, **{**defaults, **kwargs})


if __name__ == "__main__":
    import ray

    ray.init(address=sys.argv[1], log_to_driver=False)
    die_after = int(sys.argv[5]) if len(sys.argv) > 4 and sys.argv[4] == "--die-after-parts" else None
    written = []

    def on_part(row):
        written.append(row["part"])
        print("written", row["part"], flush=True)
        if len(written) == die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    run(sys.argv[2], sys.argv[3], ToyEngine(pids=str(Path(sys.argv[3]).parent / "pids")), on_part=on_part)
