"""A toy-engine harvest in a process of its own, for tests that kill it (not a test module).

    python tests/support/harvest_child.py OUT_DIR [KILL_AT]

Harvests `PROMPTS` into OUT_DIR with the toy engine (tests/support/engine_toy.py). With KILL_AT, the
process SIGKILLs itself as it makes its KILL_AT-th write to a shard file: mid-shard, the open
shard's `.partial` file on disk, as a crash or `kill -9` would leave it. `HARVEST_CHILD_PROMPT=1`:
prompt rows and one token made (every request's rows known when it is submitted, so the writer
may size the last shard), instead of all rows of two tokens.
"""
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]   # engine_toy, tapc

import numpy as np  # noqa: E402

TAPS = ["model.layers.*.resid", "model.layers.1.mlp.down_proj.input"]
LENS = [5, 17, 3, 9, 30, 1, 12, 8, 21, 4, 15, 6, 11, 2, 19, 7]
SHARD_TOKENS = 24
WINDOW_TOKENS = 40


def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 50, n).tolist() for n in LENS]


def run(out_dir, kill_at: int | None = None):
    from engine_toy import toy_vllm
    from vllm import SamplingParams

    from tapc.harvest.run import harvest
    from tapc.harvest.shardfiles import SafetensorsShard

    if kill_at is not None:
        write, calls = SafetensorsShard.write, [0]

        def write_then_die(self, cols):
            calls[0] += 1
            if calls[0] == kill_at:
                write(self, {c: v[: max(1, len(v) // 2)] for c, v in cols.items()})   # half a request's rows
                self.flush()   # ... in the file
                os.kill(os.getpid(), signal.SIGKILL)
            write(self, cols)

        SafetensorsShard.write = write_then_die
    llm, _ = toy_vllm(TAPS)
    prompt_rows = os.environ.get("HARVEST_CHILD_PROMPT") == "1"
    return harvest(llm, prompts(), out_dir, shard_tokens=SHARD_TOKENS, positions="prompt" if prompt_rows else "all",
                   window_tokens=WINDOW_TOKENS, collect_every=3, progress=False,
                   sampling_params=SamplingParams(max_tokens=1 if prompt_rows else 2))


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
