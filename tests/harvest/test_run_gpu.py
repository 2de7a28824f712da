"""`tapc harvest` on a real engine: shards on disk equal HF transformers on the same weights.

The API harvest runs on the session's tapped Llama engine (tests/support/gpu_engines.py): it captures
every resid, `model.layers.1.output[0]` and layer 2's down_proj output, all checked against HF.
"""
import numpy as np
import pytest
import torch
from gpu_engines import SMALL, engine_args, shares, shutdown
from hf_checks import assert_matches, hf_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@shares("tapped llama v2")
def test_harvest_shards_equal_hf(tmp_path, checkpoints, tapped_engine):
    from tapc.data import Shards
    from tapc.harvest.run import harvest

    path = checkpoints("llama")
    llm = tapped_engine("llama")
    rng = np.random.default_rng(11)
    lens = [7, 130, 3, 41, 64, 9, 200, 15]   # 130 and 200 are split over steps (budget 128)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in lens]
    m = harvest(llm, prompts, tmp_path / "acts", shard_tokens=100, positions="prompt", window_tokens=256,
                collect_every=2, progress=False)   # a small window: requests join while others run
    assert not m.failed and m.rows == sum(lens) and len(m.shards) == -(-sum(lens) // 100)
    acts = Shards(tmp_path / "acts")
    cols = {k: torch.cat([acts.load(k, s) for s in range(len(m.shards))]) for k in acts.keys}
    start = 0
    for i, p in enumerate(prompts):
        rows = slice(start, start + len(p))
        assert cols["token_ids"][rows].tolist() == p and (cols["request"][rows] == i).all()
        ref = hf_reference(path, p)
        for k in m.keys:
            assert_matches(cols[k][rows], ref[k], f"prompt {i} {k}")
        start += len(p)


def test_cli_harvest_writes_what_the_api_does(tmp_path, checkpoints, monkeypatch):
    """`tapc harvest spec.yaml prompts.jsonl` on the same checkpoint: the same rows."""
    import json

    import yaml

    from tapc.api.llm import VLLM
    from tapc.cli import main
    from tapc.data import Shards

    path = checkpoints("llama")
    # The command's engine is this test's alone: keep hold of it to stop it when done.
    started = []
    start = VLLM.from_spec

    def keep(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(VLLM, "from_spec", keep)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in (12, 150, 5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    engine = {k: v for k, v in engine_args().items() if v is not None}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "model": path, "engine": engine, "taps": ["model.layers.1.resid"],
        "capture": {"positions": "prompt"}, "output": {"dir": "acts", "shard_tokens": 64}}))
    try:
        assert main(["harvest", str(tmp_path / "spec.yaml"), str(tmp_path / "prompts.jsonl")]) == 0
    finally:
        for llm in started:
            shutdown(llm)
    acts = Shards(tmp_path / "acts")
    assert len(acts) == 167 and [s.rows for s in acts.manifest.shards] == [64, 64, 39]
    got = torch.cat(list(acts.batches("model.layers.1.resid", 1000, shuffle=False)))
    start = 0
    for i, p in enumerate(prompts):
        ref = hf_reference(path, p)["model.layers.1.resid"]
        assert_matches(got[start: start + len(p)], ref, f"prompt {i}")
        start += len(p)


@pytest.mark.parametrize("where", [
    pytest.param(["--ray"], id="a new Ray of this host"),
    pytest.param(["--gpus", "2"], id="two GPUs", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                         reason="needs 2 GPUs"))])
def test_cli_harvest_over_ray_equals_hf(tmp_path, checkpoints, where):
    """`tapc harvest --ray` (no address: a Ray of this host, its GPUs) and `--gpus 2`: a Ray Data
    pool of an engine per GPU, each taking parts of two prompts, one manifest; every row equals HF
    on the same weights, and a second run finds it complete."""
    import json

    import yaml

    from tapc.cli import main
    from tapc.data import Shards

    path = checkpoints("llama")
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, SMALL["vocab_size"], n).tolist() for n in (12, 150, 5, 33, 70)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    engine = {k: v for k, v in engine_args().items() if v is not None}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({
        "model": path, "engine": engine, "taps": ["model.layers.1.resid"],
        "capture": {"positions": "prompt"}, "output": {"dir": "acts", "shard_tokens": 64}}))
    pytest.importorskip("ray.data", reason="tapc[ray] runs --ray and --gpus")
    import ray

    argv = ["harvest", str(tmp_path / "spec.yaml"), str(tmp_path / "prompts.jsonl"), *where, "--part-prompts", "2"]
    try:
        assert main(argv) == 0
        manifest = (tmp_path / "acts" / "manifest.json").read_bytes()
        assert main(argv) == 0, "a second run finds the harvest complete"
    finally:
        ray.shutdown()   # this process's Ray, and the pool's actors with it
    acts = Shards(tmp_path / "acts")
    m = acts.manifest
    assert m.complete and m.prompts == len(prompts) and len(acts) == sum(map(len, prompts))
    assert {s.file.split("/")[0] for s in m.shards} == {"part-000000", "part-000001", "part-000002"}
    got = {k: torch.cat([acts.load(k, s) for s in range(len(m.shards))]) for k in acts.keys}
    for i, p in enumerate(prompts):
        rows = got["request"] == i
        assert got["token_ids"][rows].tolist() == p
        assert_matches(got["model.layers.1.resid"][rows], hf_reference(path, p)["model.layers.1.resid"], f"prompt {i}")
    assert (tmp_path / "acts" / "manifest.json").read_bytes() == manifest
