"""The arrow format read by HF `datasets` and SAELens, over the toy engine (tests/support/engine_toy.py).

Needs the `[sae]` extra (sae-lens, which brings datasets and pyarrow); skips without it.
"""
import numpy as np
import pytest
import torch
from engine_toy import Req, next_token
from toy_checks import reference
from toy_harvests import CONTEXT, arrow_harvest

datasets = pytest.importorskip("datasets", reason="the arrow format needs the [data] extra (pyarrow, datasets)")


def test_arrow_harvest_loads_with_datasets_and_equals_the_model(tmp_path):
    m, ps = arrow_harvest(tmp_path)
    assert not m.failed and m.complete and m.rows == len(ps)
    ds = datasets.load_from_disk(str(tmp_path / "acts"))
    names = {k: m.hooks[k]["saelens_hook_name"] for k in m.keys}
    assert names["model.layers.1.resid"] == "model.layers.1"
    assert m.hooks["model.layers.1.resid"]["transformer_lens"] == "blocks.1.hook_resid_post"
    assert set(ds.column_names) == {*names.values(), "token_ids", "request"}
    ds.set_format("torch")
    ds = ds[:]   # every column as a tensor
    assert ds["request"].tolist() == list(range(len(ps)))
    assert ds["token_ids"].tolist() == ps
    for k, name in names.items():
        got = ds[name]
        assert got.shape == (len(ps), CONTEXT, 16) and got.dtype == torch.float32
        for i, p in enumerate(ps):
            ref = reference(Req(str(i), p, 1, tokens=p + [next_token(p)]), [k])[k]
            torch.testing.assert_close(got[i], ref, rtol=1e-5, atol=1e-5)
    stats = m.stats["model.layers.0.resid"]
    allrows = ds[names["model.layers.0.resid"]]
    sampled = allrows[:, ::16].reshape(-1, 16)   # the sums sample every 16th row of each window written
    assert stats["rows"] == len(ps) * CONTEXT and stats["sampled_rows"] == len(sampled) == len(ps)
    assert stats["mean"] == pytest.approx(sampled.mean().item(), rel=1e-4)
    assert stats["mean_norm"] == pytest.approx(sampled.norm(dim=1).mean().item(), rel=1e-4)
    assert stats["max"] == pytest.approx(allrows.max().item()) and stats["min"] == pytest.approx(allrows.min().item())


def test_sae_lens_trains_from_the_harvest_and_its_loss_goes_down(tmp_path):
    pytest.importorskip("sae_lens", reason="sae-lens is not installed (pip install 'tapc[sae]')")
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.saes.sae import TrainStepInput
    from sae_lens.training.activations_store import ActivationsStore

    m, _ = arrow_harvest(tmp_path, n=100)
    hook = m.hooks["model.layers.2.resid"]["saelens_hook_name"]
    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
                             context_size=CONTEXT, d_in=16, n_batches_in_buffer=8, total_training_tokens=100 * CONTEXT,
                             store_batch_size_prompts=32, train_batch_size_tokens=32, prepend_bos=False,
                             normalize_activations="none", device=torch.device("cpu"), dtype="float32",
                             cached_activations_path=str(tmp_path / "acts"))
    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=16, d_sae=32, l1_coefficient=1e-3, dtype="float32",
                                                        device="cpu"))
    opt = torch.optim.Adam(sae.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        x = next(store)
        out = sae.training_forward_pass(step_input=TrainStepInput(sae_in=x, coefficients={"l1": 1e-3}, dead_neuron_mask=None,
                                                                    n_training_steps=0, is_logging_step=False))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert x.shape == (32, 16)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5]), losses


def test_shards_and_activations_read_an_arrow_harvest_a_row_per_token(tmp_path):
    from tapc.data import Activations, Shards

    m, ps = arrow_harvest(tmp_path, n=12)
    acts = Shards(tmp_path / "acts")
    assert len(acts) == 12 * CONTEXT
    ds = datasets.load_from_disk(str(tmp_path / "acts")).with_format("torch")[:]
    for k in m.keys:
        got = acts.load(k, 0)
        assert torch.equal(got, ds[m.hooks[k]["saelens_hook_name"]].reshape(-1, 16))
    assert acts.load("token_ids", 0).tolist() == [t for p in ps for t in p]
    assert acts.load("request", 0).tolist() == [i for i in range(12) for _ in range(CONTEXT)]
    assert acts.load("position", 0).tolist() == list(range(CONTEXT)) * 12
    rows = torch.cat(list(Activations(tmp_path / "acts", "model.layers.2.resid", 10)))
    assert rows.shape == (12 * CONTEXT, 16)
