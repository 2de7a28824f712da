"""A harvest in parts (tapc/harvest/parts.py) and its stores (tapc/harvest/store.py), without
Ray: parts harvested one after the other by the toy engine (tests/support/engine_toy.py), as the actors
of tests/harvest/test_cluster.py harvest them, merged, and read back as one harvest of the input.
"""
import numpy as np
import pytest
import torch
from engine_toy import toy_vllm

from tapc.data import Shards
from tapc.errors import TapcError
from tapc.harvest.dataset import cut
from tapc.harvest.parts import Part, harvest_part, merge, open_top, whole_parts
from tapc.harvest.run import harvest
from tapc.harvest.store import Store

TAPS = ["model.layers.*.resid"]
CONTEXT = 8


def windows(n=11, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, CONTEXT).tolist() for _ in range(n)]


def in_parts(store, prompts, size, fmt="arrow", parts=None, **more):
    """The harvest of `prompts` in parts of `size`, one part after the other, into `store`."""
    import pyarrow as pa
    from vllm import SamplingParams

    llm, _ = toy_vllm(TAPS)
    options = dict(format=fmt, dtype="float32", shard_tokens=16, context_size=CONTEXT, positions="prompt")
    top, layout = open_top(store, llm.plan, part_prompts=size, more={"max_tokens": 1, "source": {"kind": "prompts"}},
                           **options)
    every = [part for part, _ in cut(iter([pa.array(range(len(prompts)))]), size)]
    for part in every if parts is None else [every[i] for i in parts]:
        harvest_part(llm, store, part, prompts[part.start: part.stop], sampling_params=SamplingParams(max_tokens=1),
                     progress=False, source={"kind": "prompts"}, **options, **more)
    return top, layout, every


def test_arrow_parts_through_object_storage_read_as_one_harvest_and_one_hf_dataset(tmp_path, monkeypatch):
    """Parts bound for object storage (fsspec's memory filesystem) are harvested in staging
    folders and put into the store whole; merged, the store reads as the harvest of the whole
    input in one process, row for row, and as one HF dataset (what SAELens loads)."""
    import datasets
    import fsspec
    from vllm import SamplingParams

    monkeypatch.setenv("TAPC_STAGING_DIR", str(tmp_path / "staging"))
    store = Store("memory://tapc-test-parts/acts")
    prompts = windows()
    top, layout, every = in_parts(store, prompts, 4)
    assert [p.name for p in every] == ["part-000000", "part-000001", "part-000002"] and every[-1].stop == 11
    assert not list((tmp_path / "staging").glob("*/part-*")), "staging folders left behind"
    m = merge(store, top, layout, every)
    assert m.complete and m.prompts == 11 and m.rows == 11 and [s.start for s in m.shards][:2] == [[0, 0], [4, 0]]
    fsspec.filesystem("memory").get("/tapc-test-parts/acts/", str(tmp_path / "got") + "/", recursive=True)
    llm, _ = toy_vllm(TAPS)
    harvest(llm, prompts, tmp_path / "one", format="arrow", dtype="float32", context_size=CONTEXT, positions="prompt",
            sampling_params=SamplingParams(max_tokens=1), progress=False)
    got, one = Shards(tmp_path / "got"), Shards(tmp_path / "one")
    for key in one.keys:
        assert torch.equal(torch.cat(list(got.batches(key, 100, shuffle=False))),
                           torch.cat(list(one.batches(key, 100, shuffle=False)))), key
    ds = datasets.load_from_disk(str(tmp_path / "got"))
    assert ds["request"] == list(range(11)) and ds["token_ids"] == prompts


def test_a_part_smaller_than_a_shard_is_made_at_its_size(tmp_path, monkeypatch):
    """A part's rows are counted before its first shard opens: a part smaller than `shard_tokens`
    is one shard made at its size, never rewritten after the engine is done, though the engine's
    first rows come before the part's last prompt is submitted (a window of two prompts); merged,
    the parts hold the rows of the harvest in one process."""
    import os

    import pyarrow as pa
    from vllm import SamplingParams

    prompts = windows()
    options = dict(format="safetensors", dtype="float32", shard_tokens=1000, context_size=CONTEXT, positions="prompt")
    llm, _ = toy_vllm(TAPS)
    harvest(llm, prompts, tmp_path / "one", sampling_params=SamplingParams(max_tokens=1), progress=False, **options)

    def no_rewrite(*args):
        raise AssertionError("a part's shard was rewritten (copy_file_range)")

    monkeypatch.setattr(os, "copy_file_range", no_rewrite)
    store = Store(tmp_path / "acts")
    source = {"kind": "prompts"}
    top, layout = open_top(store, llm.plan, part_prompts=8, more={"max_tokens": 1, "source": source}, **options)
    every = [part for part, _ in cut(iter([pa.array(range(len(prompts)))]), 8)]
    for part in every:
        m = harvest_part(llm, store, part, prompts[part.start: part.stop], sampling_params=SamplingParams(max_tokens=1),
                         progress=False, source=source, window_tokens=2 * (CONTEXT + 1), **options)
        assert [s.rows for s in m.shards] == [(part.stop - part.start) * CONTEXT] and not m.failed
    merge(store, top, layout, every)
    got, one = Shards(tmp_path / "acts"), Shards(tmp_path / "one")
    for key in one.keys:
        assert torch.equal(torch.cat(list(got.batches(key, 100, shuffle=False))),
                           torch.cat(list(one.batches(key, 100, shuffle=False)))), key


def test_a_part_goes_on_only_as_the_same_part_of_the_same_harvest(tmp_path):
    store = Store(tmp_path / "acts")
    top, layout, every = in_parts(store, windows(), 4, parts=[0, 2])
    assert whole_parts(store, top) == {"part-000000": [0, 4], "part-000002": [8, 11]}
    missing = f"^{tmp_path / 'acts'}/part-000001: this part is missing: run the harvest again"
    with pytest.raises(TapcError, match=missing):
        merge(store, top, layout, every)
    with pytest.raises(TapcError, match=r"part-000002 holds another harvest \(part: \[8, 11\] there, \[8, 12\] now\)"):
        merge(store, top, layout, [every[0], Part(2, 8, 12)])
    with pytest.raises(TapcError, match=r"holds another harvest \(parts: 4 there, 5 now\)"):
        in_parts(store, windows(), 5, parts=[])
    llm, _ = toy_vllm(TAPS)
    with pytest.raises(TapcError, match="^part-000001: 3 prompts for a part of 4$"):
        harvest_part(llm, store, every[1], windows()[4:7])


def test_stores_refuse_what_they_cannot_reach_in_one_line():
    with pytest.raises(TapcError, match="^nosuch://bucket/acts: Protocol not known: nosuch$"):
        Store("nosuch://bucket/acts")
    with pytest.raises(TapcError, match="^filesystem: an fsspec or pyarrow filesystem, not dict$"):
        Store("s3://bucket/acts", filesystem={})


def test_a_specs_output_url_stays_a_url_and_a_folder_is_the_specs(tmp_path):
    import yaml

    from tapc.lang.specfile import load_spec

    for out, want in (("s3://bucket/acts", "s3://bucket/acts"), ("acts", str(tmp_path / "acts"))):
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"model": "m", "taps": ["model.layers.0.resid"],
                                                            "output": {"dir": out}}))
        assert load_spec(tmp_path / "spec.yaml").output.dir == want
