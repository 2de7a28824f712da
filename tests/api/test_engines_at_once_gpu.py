"""Three tapped engines starting at the same moment on one GPU, in three processes that share
one fresh compile cache, as data-parallel serving on one machine starts them: each starts, and
each one's captures equal HF transformers' on its own requests (GPU machine).

The processes are this file run as a script (`python tests/api/test_engines_at_once_gpu.py CHECKPOINT
FOLDER RANK`): each imports vLLM, says it is ready, and builds its engine once all three are.
vLLM's compile cache is on for them (the suite turns it off for its own engines), under one
folder with inductor's and Triton's, all empty at the start: the three compile the same graphs
into the same place at once.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args
from hf_checks import assert_matches, hf_reference
from places import ROOT, SUPPORT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENGINES = 3
TAPS = ["model.layers.*.resid"]
PROMPT_LENS = [7, 40, 19]
MAX_TOKENS = 5
START_S = 300   # each engine's import, start and requests; three compile at once on one GPU


def prompts(rank: int) -> list[dict]:
    rng = np.random.default_rng(100 + rank)
    return [{"prompt_token_ids": rng.integers(0, SMALL["vocab_size"], n).tolist()} for n in PROMPT_LENS]


def test_three_engines_started_at_once_sharing_the_compile_caches_each_equal_hf(checkpoints, tmp_path):
    path = checkpoints("llama")
    caches = tmp_path / "caches"
    env = dict(os.environ,
               # the engines' own environment (engine_args), with vLLM's compile cache on and shared
               VLLM_DISABLE_COMPILE_CACHE="0", VLLM_CACHE_ROOT=str(caches / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"),
               PYTHONPATH=os.pathsep.join([str(SUPPORT), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    children = []
    for rank in range(ENGINES):   # their logs to files: a pipe nobody reads meanwhile would stop them
        with open(tmp_path / f"log-{rank}", "w") as log:
            children.append(subprocess.Popen([sys.executable, __file__, path, str(tmp_path), str(rank)], env=env,
                                             stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + START_S
        while not all((tmp_path / f"ready-{r}").exists() for r in range(ENGINES)):
            assert all(c.poll() is None for c in children), _logs(children, tmp_path)
            assert time.monotonic() < deadline, "the engine processes never got ready"
            time.sleep(0.2)
        (tmp_path / "go").touch()   # the three build their engines now
        for c in children:
            c.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    assert [c.returncode for c in children] == [0] * ENGINES, _logs(children, tmp_path)
    compiled = caches / "vllm" / "torch_compile_cache"
    assert compiled.is_dir() and any(compiled.iterdir()), "vLLM's compile cache was off or elsewhere"
    for rank in range(ENGINES):
        got = torch.load(tmp_path / f"captures-{rank}.pt")
        for i, (tokens, taps) in enumerate(got):
            assert len(tokens) == PROMPT_LENS[i] + MAX_TOKENS
            ref = hf_reference(path, tokens[:-1])   # the last generated token is never fed back
            assert set(taps) == {f"model.layers.{n}.resid" for n in range(SMALL["num_hidden_layers"])}
            for key, value in taps.items():
                assert_matches(value, ref[key], f"engine {rank} request {i} {key}")


def _logs(children, folder: Path) -> str:
    return "\n".join(f"--- engine {rank} (exit {c.returncode}):\n{(folder / f'log-{rank}').read_text()[-6000:]}"
                     for rank, c in enumerate(children) if c.poll() is not None)


def _engine(path: str, folder: str, rank: int) -> None:
    """One engine process: ready, then at the go its engine, its requests, its captures saved."""
    from vllm import SamplingParams

    from tapc import TapRequest, VLLM

    (Path(folder) / f"ready-{rank}").touch()
    while not (Path(folder) / "go").exists():
        time.sleep(0.05)
    with VLLM(path, taps=TAPS, **engine_args()) as llm:
        outs = llm.generate(prompts(rank), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                            taps=TapRequest(capture="*"))
        got = [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), {k: v.clone() for k, v in o.taps.items()})
               for o in outs]
    torch.save(got, Path(folder) / f"captures-{rank}.pt")


if __name__ == "__main__":
    _engine(sys.argv[1], sys.argv[2], int(sys.argv[3]))
