"""Harvest to shards and reading them back, over the toy engine (tests/support/engine_toy.py).

Every row on disk is compared with the toy model run on its request's tokens alone.
"""
import json

import numpy as np
import pytest
import torch
from engine_toy import Req, toy_plan, toy_vllm
from places import EXAMPLES, SUPPORT
from toy_checks import TAPS, reference
from toy_harvests import LENS, generated, harvested, prompts

from tapc.cli import main
from tapc.data import Shards
from tapc.errors import TapcError
from tapc.harvest.corpus import read_prompts
from tapc.harvest.run import harvest
from tapc.worker.tables import StepTables


def test_shards_hold_every_row_of_every_request_in_order(tmp_path):
    m, ps, hooks = harvested(tmp_path)
    keys = list(toy_plan(TAPS).capture_keys)   # the plan's `logits` is not written
    assert m.keys == keys and m.prompts == len(ps) and not m.failed
    assert m.rows == sum(n + 3 - 1 for n in LENS)
    assert [s.rows for s in m.shards] == [16] * (m.rows // 16) + ([m.rows % 16] if m.rows % 16 else [])
    acts = Shards(tmp_path / "acts")
    cols = {k: torch.cat(list(acts.batches(k, 7, shuffle=False))) for k in acts.keys}
    assert all(len(v) == m.rows for v in cols.values())
    start = 0
    for i, prompt in enumerate(ps):
        n = len(prompt) + 3 - 1
        rows = slice(start, start + n)
        assert (cols["request"][rows] == i).all() and torch.equal(cols["position"][rows], torch.arange(n))
        # the toy engine generates deterministically from the tokens so far
        req = Req(str(i), prompt, 3, tokens=prompt + generated(prompt, 3))
        assert cols["token_ids"][rows].tolist() == req.tokens[:-1]
        ref = reference(req, keys)
        for k in keys:
            torch.testing.assert_close(cols[k][rows], ref[k], rtol=1e-5, atol=1e-5, msg=lambda s: f"prompt {i} {k}: {s}")
        assert all(torch.equal(v, cols[k][rows]) for k, v in acts.request(i).items()), \
            "one request's rows, across the shards it spans"
        start += n
    assert not hooks.by_id and not hooks.records
    for k in keys:   # the manifest's statistics: rows, min and max over every row written
        st = m.stats[k]
        assert (st["rows"], st["min"], st["max"]) == (m.rows, cols[k].min().item(), cols[k].max().item())
        assert st["nonfinite_values"] == 0 and 0 < st["sampled_rows"] <= m.rows


def test_prompt_positions_and_a_shard_larger_than_the_run(tmp_path):
    m, ps, _ = harvested(tmp_path, positions="prompt", shard_tokens=10_000)
    assert m.rows == sum(LENS) and [s.rows for s in m.shards] == [sum(LENS)]
    pos = Shards(tmp_path / "acts").load("position", 0)
    assert torch.equal(pos, torch.cat([torch.arange(n) for n in LENS]))


def test_a_failed_request_is_listed_and_the_harvest_goes_on(tmp_path, no_room_past_8k):
    # the 60-token prompt's captures (about 24 kB) find no room; the others fit
    m, ps, _ = harvested(tmp_path, lens=[5, 60, 7])
    assert [f["request"] for f in m.failed] == [1] and "no room for its captures" in m.failed[0]["error"]
    assert m.rows == (5 + 2) + (7 + 2)
    req = Shards(tmp_path / "acts").load("request", 0)
    assert set(req.tolist()) == {0, 2}
    on_disk = json.loads((tmp_path / "acts" / "manifest.json").read_text())
    assert on_disk["failed"] == m.failed and on_disk["rows"] == m.rows


def test_shuffled_batches_are_a_permutation_of_the_rows(tmp_path):
    harvested(tmp_path)
    acts = Shards(tmp_path / "acts")
    key = "model.layers.1.resid"
    plain = torch.cat(list(acts.batches(key, 5, shuffle=False)))
    batches = list(acts.batches(key, 5, shuffle=True, seed=3))
    assert all(len(b) == 5 for b in batches[:-1]) and 0 < len(batches[-1]) <= 5
    mixed = torch.cat(batches)
    assert not torch.equal(mixed, plain)
    assert torch.equal(_sorted_rows(mixed), _sorted_rows(plain))
    assert all(len(b) == 5 for b in acts.batches(key, 5, drop_last=True))
    with pytest.raises(TapcError, match="'model.layers.9.resid' is not in this harvest; it has model.layers.0.resid"):
        acts.load("model.layers.9.resid", 0)


def test_a_prompt_rows_harvest_makes_its_last_shard_at_its_size(tmp_path, monkeypatch):
    """One token made, prompt rows: every request's rows are known once submitted, so the short
    last shard is made at its size, never rewritten (no copy of its rows after the engine is
    done), and holds the model's rows like the others."""
    import os

    from safetensors.torch import load_file
    from vllm import SamplingParams

    def no_rewrite(*args):
        raise AssertionError("the last shard was rewritten (copy_file_range)")

    monkeypatch.setattr(os, "copy_file_range", no_rewrite)
    llm, _ = toy_vllm(TAPS)
    ps = prompts()
    # a window that takes every prompt at once: all are submitted before the first write
    m = harvest(llm, ps, tmp_path / "acts", shard_tokens=16, positions="prompt", window_tokens=1000,
                sampling_params=SamplingParams(max_tokens=1), progress=False)
    assert [s.rows for s in m.shards] == [16, 16, 16, 16, 13] and not m.failed
    keys = list(toy_plan(TAPS).capture_keys)
    shards = [load_file(tmp_path / "acts" / s.file) for s in m.shards]   # safetensors' own reader
    assert all(len(t) == s.rows for s, sh in zip(m.shards, shards) for t in sh.values())
    cols = {k: torch.cat([sh[k] for sh in shards]) for k in keys + ["request", "position"]}
    start = 0
    for i, prompt in enumerate(ps):
        rows = slice(start, start + len(prompt))
        assert (cols["request"][rows] == i).all() and torch.equal(cols["position"][rows], torch.arange(len(prompt)))
        ref = reference(Req(str(i), prompt, 1, tokens=prompt + generated(prompt, 1)), keys)
        for k in keys:
            torch.testing.assert_close(cols[k][rows], ref[k][: len(prompt)], rtol=1e-5, atol=1e-5)
        start += len(prompt)


@pytest.mark.parametrize("expect", [None, "exact", "low", "high"])
def test_the_writer_makes_the_same_files_whether_or_not_it_sized_the_last_shard(tmp_path, expect):
    """`Writer.expect` only chooses how the last shard is made: told the exact rows to come, a
    count that is too high (the shard ends short: compacted), or too low (the rest goes to one
    more shard), the shards hold the same rows in order; exact or not told, the files are the
    same bytes."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from tapc.harvest.feed import Done, Window
    from tapc.harvest.writer import Layout, Writer

    lens = [5, 17, 3, 9, 30, 1, 12]
    rng = np.random.default_rng(0)
    outs = [SimpleNamespace(error=None, taps={"k": torch.from_numpy(rng.standard_normal((n, 8), dtype=np.float32))},
                            prompt_token_ids=list(range(n)), outputs=[SimpleNamespace(token_ids=[1])]) for n in lens]

    def write(folder, told):
        layout = Layout(folder, "safetensors", ("k",), ("k",), (8,), torch.float32, 16, "prompt")
        folder.mkdir()
        records = []
        writer = Writer(layout, Window(1 << 20), records.append, threads=1)
        if told is not None:
            writer.expect(told)
        for i, out in enumerate(outs):
            writer.put([Done(i, i, SimpleNamespace(**vars(out)), lens[i], suspect=False)])
        writer.close()
        return records

    total = sum(lens)   # 77 rows: four shards of 16 and 13 rows
    told = {None: None, "exact": total, "low": total - 7, "high": total + 5}[expect]
    records = write(tmp_path / "got", told)
    ref = write(tmp_path / "ref", None)
    got = [load_file(tmp_path / "got" / r.file) for r in records]
    assert torch.equal(torch.cat([g["k"] for g in got]), torch.cat([o.taps["k"] for o in outs]))
    assert torch.equal(torch.cat([g["position"] for g in got]), torch.cat([torch.arange(n) for n in lens]))
    if expect in (None, "exact"):
        assert [r.rows for r in records] == [16, 16, 16, 16, 13]
        for r in ref:
            assert (tmp_path / "got" / r.file).read_bytes() == (tmp_path / "ref" / r.file).read_bytes()
    elif expect == "low":   # the shard sized for the 6 rows left fills, the last 7 go to one more
        assert [r.rows for r in records] == [16, 16, 16, 16, 6, 7]
    else:
        assert [r.rows for r in records] == [16, 16, 16, 16, 13]


def test_a_harvest_without_max_tokens_is_refused_before_it_starts(tmp_path):
    from vllm import SamplingParams

    llm, _ = toy_vllm(TAPS)
    with pytest.raises(TapcError, match="max_tokens is None; give a number"):
        harvest(llm, prompts(), tmp_path / "acts", sampling_params=SamplingParams(max_tokens=None), progress=False)
    assert not (tmp_path / "acts").exists()


def test_harvest_goes_on_only_with_the_same_settings_and_refuses_a_plan_without_captures(tmp_path):
    m, _, _ = harvested(tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "acts").iterdir()}
    again, _, _ = harvested(tmp_path)   # complete: nothing to do, nothing rewritten
    assert again.complete and again.rows == m.rows
    assert {p.name: p.read_bytes() for p in (tmp_path / "acts").iterdir()} == before
    with pytest.raises(TapcError, match="holds another harvest \\(shard_tokens: 16 there, 17 now\\)"):
        harvested(tmp_path, shard_tokens=17)
    llm, _ = toy_vllm(TAPS)
    with pytest.raises(TapcError, match="holds another harvest \\(plan digest"):
        harvest(llm, prompts(), tmp_path / "acts", shard_tokens=16)
    steer_only, _ = toy_vllm(["model.layers.1.resid | add(steer)"])
    with pytest.raises(TapcError, match="captures nothing in the graph"):
        harvest(steer_only, prompts(), tmp_path / "other")
    with pytest.raises(TapcError, match="no manifest.json"):
        Shards(tmp_path / "other")


def test_read_prompts_forms_and_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('"a text"\n[1, 2, 3]\n\n{"prompt": "b"}\n{"prompt_token_ids": [4, 5]}\n')
    assert list(read_prompts(good)) == ["a text", [1, 2, 3], "b", [4, 5]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"text": 1}\n')
    with pytest.raises(TapcError, match="bad.jsonl:2: a prompt is a string"):
        list(read_prompts(bad))
    (tmp_path / "t.txt").write_text("one\n\ntwo\n")
    assert list(read_prompts(tmp_path / "t.txt")) == ["one", "two"]
    with pytest.raises(TapcError, match="no such prompts file"):
        list(read_prompts(tmp_path / "missing.jsonl"))


def test_cli_harvest_needs_an_output_section(capsys):
    spec = EXAMPLES / "steer.yaml"
    assert main(["harvest", str(spec), "prompts.jsonl"]) == 2
    assert "needs an `output:` section" in capsys.readouterr().err


def _sorted_rows(x):
    return x[np.lexsort(x.T.numpy()[::-1])]


@pytest.mark.parametrize("kill_at,prompt_rows", [(2, False), (7, False), (13, False), (5, True), (15, True)])
def test_a_harvest_killed_mid_shard_goes_on_to_the_same_files(tmp_path, kill_at, prompt_rows, monkeypatch):
    """SIGKILL while a shard is half written; the same command again finishes the harvest:
    every file (shards and manifest) equals an uninterrupted run's, byte for byte. With prompt
    rows the writer may size the last shard (Writer.expect) in one run and not the other: the
    files are the same."""
    import os
    import signal
    import subprocess
    import sys

    import harvest_child

    monkeypatch.setenv("HARVEST_CHILD_PROMPT", "1" if prompt_rows else "0")
    child = [sys.executable, str(SUPPORT / "harvest_child.py"), str(tmp_path / "cut")]
    ref = harvest_child.run(tmp_path / "whole")
    assert len(ref.shards) >= 3 and ref.complete
    killed = subprocess.run(child + [str(kill_at)], capture_output=True, text=True, timeout=300, env=os.environ)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    partial = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert not partial["complete"] and any((tmp_path / "cut").glob("*.partial"))
    done = subprocess.run(child, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == whole
    for name in whole:
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    # and the rows are right, not merely the same: every request, in order, once
    cols = {k: torch.cat(list(Shards(tmp_path / "cut").batches(k, 1000, shuffle=False))) for k in ("request", "position")}
    lens = harvest_child.LENS if prompt_rows else [n + 2 - 1 for n in harvest_child.LENS]
    assert cols["request"].tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
    assert cols["position"].tolist() == [p for n in lens for p in range(n)]


def test_activations_dataset_shuffles_across_shards_and_keeps_every_row(tmp_path):
    from tapc.data import Activations

    m, _, _ = harvested(tmp_path)
    key = "model.layers.1.resid"
    plain = torch.cat(list(Shards(tmp_path / "acts").batches(key, 100, shuffle=False)))
    ds = Activations(tmp_path / "acts", key, 5, seed=1, mix=3)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
    mixed = torch.cat(batches)
    assert torch.equal(_sorted_rows(mixed), _sorted_rows(plain)) and not torch.equal(mixed, plain)
    # a batch can hold rows of several shards: the first group's rows come from `mix` shards
    first = torch.cat(batches[:9])
    shard_of = torch.cat([torch.full((s.rows,), i) for i, s in enumerate(m.shards)])
    owners = {int(shard_of[(plain == r).all(dim=1)][0]) for r in first}
    assert len(owners) > 1 and ds.config["activation_dim"] == 16


def test_reading_back_a_bad_batch_size_a_damaged_manifest_or_a_missing_shard_is_a_tapc_error(tmp_path):
    from tapc.data import Activations

    m, _, _ = harvested(tmp_path)
    folder, key = tmp_path / "acts", "model.layers.1.resid"
    for n in (0, -3, 2.5, True):
        with pytest.raises(TapcError, match=f"^batch_size must be a positive integer, not {n!r}$"):
            next(Shards(folder).batches(key, n))
        with pytest.raises(TapcError, match="batch_size must be a positive integer"):
            Activations(folder, key, n)
    shard = folder / m.shards[1].file
    shard.rename(shard.with_suffix(".gone"))
    with pytest.raises(TapcError, match=f"^{shard}: shard 1 of {folder}'s manifest is missing$"):
        list(Shards(folder).batches(key, 4, shuffle=False))
    shard.with_suffix(".gone").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{junk}")
    shard.with_suffix(".gone").rename(shard)
    with pytest.raises(TapcError, match=f"^{shard}: shard 1 of {folder} cannot be read"):
        Shards(folder).load(key, 1)
    manifest = folder / "manifest.json"
    for damaged in (manifest.read_text()[:50], "[1, 2]", '{"settings": {}}'):
        manifest.write_text(damaged)
        with pytest.raises(TapcError, match=f"^{manifest}: not a readable harvest manifest"):
            Shards(folder)


def test_a_prompt_vllm_refuses_is_listed_and_the_others_written(tmp_path):
    from vllm import SamplingParams

    llm, _ = toy_vllm(TAPS)
    ps = [[1, 2, 3], [4, 99, 5], [6, 7]]   # token 99 is past the toy's vocabulary
    m = harvest(llm, ps, tmp_path / "acts", shard_tokens=100, positions="prompt",
                sampling_params=SamplingParams(max_tokens=1), progress=False)
    assert m.failed == [{"request": 1, "error": "vLLM refused it: Token id 99 is out of vocabulary"}]
    assert m.rows == 5 and Shards(tmp_path / "acts").load("request", 0).tolist() == [0, 0, 0, 2, 2]


def test_a_nan_is_counted_on_the_device_and_its_request_listed_never_written(tmp_path):
    from vllm import SamplingParams

    llm, hooks = toy_vllm(TAPS)
    copy_out = hooks.component(StepTables).copy_out
    counted, count = [], copy_out.nonfinite
    copy_out.nonfinite = lambda: counted.append(count()) or counted[-1]   # what each collect reply says
    with torch.no_grad():
        llm.llm.runner.model.model.embed_tokens.weight[13] = float("nan")   # token 13: NaN from layer 0 on (the toy has no attention: only its own rows)
    ps = [[1, 2, 3], [4, 13, 5, 13], [6, 7], [8, 9, 13]]
    m = harvest(llm, ps, tmp_path / "acts", shard_tokens=4, positions="prompt", window_tokens=8, collect_every=1,
                sampling_params=SamplingParams(max_tokens=1), progress=False)
    assert [f["request"] for f in m.failed] == [1, 3]
    assert "non-finite values (NaN or inf) in model.layers.0.resid at positions [1, 3]; not written" in m.failed[0]["error"]
    assert "at positions [2]" in m.failed[1]["error"]
    assert counted[0] == 0 and counted[-1] > 0   # counted as the captures left the (toy) device
    assert count() is None                        # and no longer once the harvest is done
    assert m.rows == 5 and set(Shards(tmp_path / "acts").load("request", 0).tolist()) | set(
        Shards(tmp_path / "acts").load("request", 1).tolist()) == {0, 2}
    assert m.stats["model.layers.0.resid"]["nonfinite_values"] > 0
    assert m.stats["model.layers.0.resid"]["rows"] == 5
