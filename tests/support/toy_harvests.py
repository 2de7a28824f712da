"""Harvests of the toy engine that test modules of several packages read back."""
import numpy as np
from engine_toy import next_token, toy_vllm
from toy_checks import TAPS

from tapc.harvest.run import harvest

LENS = [5, 17, 3, 9, 30, 1, 12]


def prompts(seed=0, lens=LENS):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, n).tolist() for n in lens]


def harvested(tmp_path, positions="all", max_tokens=3, lens=LENS, shard_tokens=16):
    from vllm import SamplingParams

    llm, hooks = toy_vllm(TAPS + ["logits"])
    ps = prompts(lens=lens)
    m = harvest(llm, ps, tmp_path / "acts", shard_tokens=shard_tokens, positions=positions, window_tokens=40, collect_every=2,
                sampling_params=SamplingParams(max_tokens=max_tokens))
    return m, ps, hooks


def generated(prompt, n):
    """The toy model's greedy tokens after `prompt`."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


CONTEXT = 8


def arrow_harvest(tmp_path, n=40, dtype=None):
    from vllm import SamplingParams

    llm, _ = toy_vllm(["model.layers.*.resid"])
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 50, CONTEXT).tolist() for _ in range(n)]
    m = harvest(llm, ps, tmp_path / "acts", format="arrow", context_size=CONTEXT, positions="prompt", dtype=dtype,
                window_tokens=48, collect_every=4, sampling_params=SamplingParams(max_tokens=1), progress=False)
    return m, ps

