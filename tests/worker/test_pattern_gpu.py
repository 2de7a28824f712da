"""Attention patterns on a real vLLM engine against HF transformers' eager attention (GPU machine).

The session's random Llama and Qwen3 checkpoints with vLLM's defaults: compile,
FULL_AND_PIECEWISE graphs, chunked prefill (128 tokens a step for three requests), prefix
caching, FlashAttention. Llama's q and k projections are scaled up (x5 each) so that its
heads attend sharply, not near-uniformly: a key read from the wrong block or slot then moves
the weights far past bf16 noise. Each captured row is compared with HF's
`output_attentions=True` (`attn_implementation="eager"`) on the request's tokens: every head's
weights over keys 0..p, zeros after, within bf16 rounding, and the most-attended key the same.
"""
import shutil

import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args, greedy, random_prompts, shutdown

import tapc
from tapc.errors import RequestError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS, HEADS, KEYS = SMALL["num_hidden_layers"], SMALL["num_attention_heads"], 256
PICKED = (5, 0)   # the last layer's heads, in the tap's order
TAPS = [f"model.layers[0:{LAYERS - 1}].self_attn.pattern | capture(keys={KEYS})",
        f"model.layers.{LAYERS - 1}.self_attn.pattern | capture(heads=[{PICKED[0]}, {PICKED[1]}], keys={KEYS})"]
SHARP = 5.0


def sharpened(src: str, dst) -> str:
    """A copy of the checkpoint at `src` with every q_proj and k_proj weight times SHARP."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    file = dst / "model.safetensors"
    weights = load_file(file)
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * SHARP
    save_file(weights, file, metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch_path(request, checkpoints, tmp_path_factory):
    path = checkpoints(request.param)
    return sharpened(path, tmp_path_factory.mktemp("sharp")) if request.param == "llama" else path


@pytest.fixture(scope="module")
def engine(arch_path):
    llm = tapc.VLLM(arch_path, taps=TAPS, **engine_args())
    yield llm
    shutdown(llm)


def hf_attentions(path: str, tokens: list[int]) -> list[torch.Tensor]:
    """HF's eager attention weights on `tokens`, one `[heads, query, key]` a layer (float32 on the CPU)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], device="cuda"), output_attentions=True)
    return [a[0].float().cpu() for a in out.attentions]


def check_rows(got: torch.Tensor, want: torch.Tensor, positions, heads, what: str) -> None:
    """tapc's rows `[rows, heads, KEYS]` against HF's `[heads, query, key]` at `positions`."""
    assert got.shape == (len(positions), len(heads), KEYS) and got.dtype == torch.float32, (what, got.shape)
    for r, p in enumerate(positions):
        mine, hf = got[r, :, : p + 1], want[list(heads), p, : p + 1]
        assert (got[r, :, p + 1:] == 0).all(), f"{what} position {p}: weights past the row's own key"
        torch.testing.assert_close(mine.sum(-1), torch.ones(len(heads)), atol=1e-4, rtol=0, msg=what)
        err = (mine - hf).abs().max()
        assert err <= 0.03, f"{what} position {p}: weights differ from HF's by {err:.3f}"
        same = (mine.argmax(-1) == hf.argmax(-1)) | (hf.gather(1, mine.argmax(-1, keepdim=True))[:, 0]
                                                     >= hf.max(-1).values - 0.02)
        assert same.all(), f"{what} position {p}: another most-attended key than HF's"


def rows_of(ask, plen: int, total: int):
    pos = np.arange(total - 1)
    if not isinstance(ask.positions, str):
        return list(ask.positions)
    return list({"all": pos, "last": pos[plen - 1:plen], "generated": pos[plen:]}[ask.positions])


def check_out(out, ask, path: str, what: str) -> None:
    assert out.error is None, out.error
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    att = hf_attentions(path, tokens[:-1])
    rows = rows_of(ask, len(out.prompt_token_ids), len(tokens))
    for layer in range(LAYERS):
        heads = PICKED if layer == LAYERS - 1 else tuple(range(HEADS))
        check_rows(out.taps[f"model.layers.{layer}.self_attn.pattern"], att[layer], rows, heads,
                   f"{what} layer {layer}")


def test_patterns_equal_hf_at_prompt_and_generated_positions_in_a_batch(engine, arch_path):
    asks = [tapc.TapRequest(capture="*"), tapc.TapRequest(capture="*", positions="last"),
            tapc.TapRequest(capture="*", positions="generated"), None, tapc.TapRequest(capture="*", positions=[0, 7, 19])]
    outs = engine.generate(random_prompts(5, 1), greedy(6), taps=asks)
    for i, (out, ask) in enumerate(zip(outs, asks)):
        if ask is None:
            assert out.taps.keys() == set()
            continue
        check_out(out, ask, arch_path, f"request {i}")


def test_a_request_behind_a_cached_prefix_attends_to_the_cached_keys(engine, arch_path):
    """The second request's first 64 tokens come from the prefix cache: its rows' weights over
    those keys are read from blocks an earlier request wrote, and equal HF's on its whole list
    (a kernel that read only this request's own steps' keys would put none there)."""
    shared = np.random.default_rng(7).integers(0, SMALL["vocab_size"], 64).tolist()
    engine.generate(random_prompts(1, 8, shared), greedy(2))
    ask = tapc.TapRequest(capture="*", positions="generated")
    out = engine.generate(random_prompts(1, 9, shared), greedy(4), taps=ask)[0]
    check_out(out, ask, arch_path, "behind a prefix")
    assert out.taps["model.layers.0.self_attn.pattern"][:, :, :64].sum() > 0.05


def test_a_request_that_would_pass_the_keys_is_refused_alone(engine):
    asks = [tapc.TapRequest(capture="*", positions="generated"), tapc.TapRequest(capture="*", positions="last")]
    long = {"prompt_token_ids": list(range(KEYS))}
    with pytest.raises(RequestError, match=f"holds {KEYS} keys a row"):
        engine.generate([long, random_prompts(1, 3)[0]], greedy(4), taps=asks)
