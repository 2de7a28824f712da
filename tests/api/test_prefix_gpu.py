"""Prefix caching kept on a tapped engine (tapc/api/prefix.py), on the GPU.

The session's tapped Llama engine (tests/support/gpu_engines.py) runs with vLLM's default prefix
caching (block size 16). vLLM reports per request how many prompt tokens it took from the
cache (`RequestOutput.num_cached_tokens`); captures are compared with HF transformers on the
tokens that went through the model, so a capture that read KV it should not have (unsteered
KV under a steered request, or the other way round) shows in its values, and one that missed
rows shows in its shape. Prompts are drawn fresh for this module: the engine is shared.
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, shares
from hf_checks import assert_matches, hf_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              shares("tapped llama v2")]

BLOCK = 16   # vLLM's default block size on CUDA


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(0, SMALL["vocab_size"], n).tolist()


def greedy(max_tokens: int = 8):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(checkpoints, tapped_engine):
    return checkpoints("llama"), tapped_engine("llama")


def run(llm, prompt: list[int], ask=None, max_tokens: int = 8):
    return llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens), taps=ask)[0]


def test_a_capture_of_prompt_rows_behind_a_cached_prefix_has_every_row_and_equals_the_uncached_one(llama):
    from tapc import TapRequest

    path, llm = llama
    shared = tokens(1, 6 * BLOCK)
    prompt, other = shared + tokens(2, 21), shared + tokens(3, 13)
    ask = TapRequest(capture="*", positions="all")
    cold = run(llm, prompt, ask)                  # the first sight of this prefix: nothing cached
    assert cold.error is None and cold.num_cached_tokens == 0
    run(llm, other)                               # untapped: reads the prefix cold's KV left
    warm_plain = run(llm, prompt)
    assert warm_plain.num_cached_tokens >= len(shared), "untapped traffic shares the cache as in vanilla vLLM"
    warm = run(llm, prompt, ask)
    assert warm.error is None and warm.num_cached_tokens == 0, "a capture of prompt rows reads no cached KV"
    rows = len(prompt) + 8 - 1
    ref = hf_reference(path, (list(warm.prompt_token_ids) + list(warm.outputs[0].token_ids))[:-1])
    for key in llm.plan.capture_keys:
        assert warm.taps[key].shape[0] == rows, f"{key}: {warm.taps[key].shape[0]} rows of {rows}"
        assert_matches(warm.taps[key], ref[key], f"warm {key}")
        n = min(len(cold.outputs[0].token_ids), len(warm.outputs[0].token_ids))
        same = len(prompt) + n - 1    # rows of identical tokens (greedy may split at a near tie)
        assert_matches(warm.taps[key][:same], cold.taps[key][:same].float(), f"warm vs cold {key}")
    # A prefix of a request cached by another's prompt rows: every row of the new tail too.
    again = run(llm, other, TapRequest(capture="model.layers.1.resid", positions="prompt"))
    assert again.error is None and again.taps["model.layers.1.resid"].shape[0] == len(other)
    assert_matches(again.taps["model.layers.1.resid"], hf_reference(path, other)["model.layers.1.resid"],
                   "prompt rows of the second prompt")


def test_generated_and_last_captures_read_the_cache_and_are_whole(llama):
    from tapc import TapRequest

    path, llm = llama
    prompt = tokens(4, 5 * BLOCK + 3)
    run(llm, prompt)
    for positions, first in (("generated", len(prompt)), ("last", len(prompt) - 1)):
        out = run(llm, prompt, TapRequest(capture="model.layers.3.resid", positions=positions))
        assert out.error is None and out.num_cached_tokens >= 5 * BLOCK, f"{positions}: read no cache"
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        want = hf_reference(path, seq[:-1])["model.layers.3.resid"][first:first + (1 if positions == "last" else 7)]
        assert_matches(out.taps["model.layers.3.resid"], want, f"{positions} behind a cached prefix")


def test_a_steered_request_never_reuses_unsteered_kv_nor_the_other_way_round(llama):
    """Captures at generated rows only (they read the cache) after layer 2's steer: their
    values equal HF's under the request's own edit only if every KV it read was computed
    under that same edit."""
    from tapc import TapRequest

    path, llm = llama
    rng = np.random.default_rng(11)
    v, w = (rng.standard_normal(SMALL["hidden_size"]).tolist() for _ in range(2))
    key = "model.layers.3.resid"

    def steered(prompt, vec):
        out = run(llm, prompt, TapRequest(capture=key, positions="generated", params={"steer": vec}))
        assert out.error is None
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref = hf_reference(path, seq[:-1], steer=(2, vec, 8.0))[key][len(prompt):]
        assert_matches(out.taps[key], ref, f"steered capture (cached {out.num_cached_tokens})")
        return out

    def plain(prompt):
        out = run(llm, prompt, TapRequest(capture=key, positions="generated"))
        assert out.error is None
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert_matches(out.taps[key], hf_reference(path, seq[:-1])[key][len(prompt):],
                       f"plain capture (cached {out.num_cached_tokens})")
        return out

    a = tokens(5, 5 * BLOCK + 7)
    assert plain(a).num_cached_tokens == 0
    assert plain(a).num_cached_tokens >= 5 * BLOCK       # the plain KV is there to be read
    assert steered(a, v).num_cached_tokens == 0, "steered read unsteered KV"
    assert steered(a, v).num_cached_tokens >= 5 * BLOCK, "identical steering shares its KV"
    assert steered(a, w).num_cached_tokens == 0, "another vector read the first one's KV"
    b = tokens(6, 5 * BLOCK + 7)
    steered(b, v)                                          # only steered KV of b is cached
    assert plain(b).num_cached_tokens == 0, "unsteered read steered KV"


@pytest.fixture(scope="module")
def keeping(checkpoints, engines):
    """The tapped Llama engine's taps with kept prefix rows (`prefix_rows_gib`)."""
    from gpu_engines import CAPTURES, STEER, engine_args

    from tapc import VLLM

    path = checkpoints("llama")
    return path, engines.get("tapped llama prefix rows",
                             lambda: VLLM(path, taps=CAPTURES + [STEER], prefix_rows_gib=0.25, **engine_args()))


def test_kept_prefix_rows_let_a_capture_of_prompt_rows_read_the_cache_and_it_has_every_row(keeping):
    """Two captures share a prefix: neither reads the cache (no rows kept yet), and the second
    makes its blocks shared, so their rows are kept; a third reads the cache over exactly those
    blocks (vLLM's lookup sees only their hashes), and each of its rows equals HF's."""
    from tapc import TapRequest

    path, llm = keeping
    shared = tokens(7, 6 * BLOCK)
    ask = TapRequest(capture="*", positions="all")
    for seed, tail in ((8, 11), (9, 17)):
        out = run(llm, shared + tokens(seed, tail), ask)
        assert out.error is None and out.num_cached_tokens == 0, "nothing kept yet: its prompt computed in full"
    prompt = shared + tokens(10, 9)
    out = run(llm, prompt, ask)
    assert out.error is None and out.num_cached_tokens == len(shared), out.num_cached_tokens
    seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref = hf_reference(path, seq[:-1])
    for key in llm.plan.capture_keys:
        assert out.taps[key].shape[0] == len(seq) - 1, f"{key}: {out.taps[key].shape[0]} rows of {len(seq) - 1}"
        assert_matches(out.taps[key], ref[key], f"behind kept rows {key}")
