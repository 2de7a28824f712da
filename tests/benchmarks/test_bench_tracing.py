"""bench_tracing's peers compute the sweep they are timed on: on a small random Llama, the
HF-hooks and nnsight sweeps (32 copies of a prompt, copy i patched at layer i) give the greedy
tokens of one unbatched forward a (prompt, layer) patched by hand."""
import sys

import pytest
import torch
from places import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_tracing  # noqa: E402

LAYERS, SUBJECT = 4, 5


@pytest.fixture(scope="module")
def sweep():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)).eval()
    corrupted = torch.randint(0, 1000, (3, 12))
    clean = torch.randn(3, 64) * 4
    expected = torch.zeros(3, LAYERS, dtype=torch.long)
    for p in range(3):
        for i in range(LAYERS):
            def put(module, args, output, row=clean[p]):
                (output[0] if isinstance(output, tuple) else output)[0, SUBJECT] = row
            hook = model.model.layers[i].register_forward_hook(put)
            with torch.no_grad():
                expected[p, i] = model(corrupted[p][None]).logits[0, -1].argmax()
            hook.remove()
    assert len(set(expected.flatten().tolist())) > 1   # the patches change the tokens
    return model, corrupted, clean, expected


def test_the_hf_hooks_sweep_patches_copy_i_at_layer_i(sweep):
    model, corrupted, clean, expected = sweep
    assert torch.equal(bench_tracing.hf_sweep(model, corrupted, clean, SUBJECT), expected)


def test_the_nnsight_sweep_patches_copy_i_at_layer_i(sweep):
    pytest.importorskip("nnsight")
    from nnsight import NNsight

    model, corrupted, clean, expected = sweep
    assert torch.equal(bench_tracing.nnsight_sweep(NNsight(model), corrupted, clean, SUBJECT), expected)
