"""Harvests over Ray (tapc/harvest/cluster.py) on a real Ray cluster: two nodes on this host
(`ray.cluster_utils.Cluster`, a CPU each), a Ray Data actor pool with the toy engine in each
actor (tests/support/harvest_ray_child.py), and object storage through a local S3 server (moto's).

Every row is compared with a harvest of the same prompts in one process and with the toy model
run on its request's tokens alone; a harvest cut short (an actor killed mid-shard, the driver
killed mid-harvest) and started again writes the same files, byte for byte, as one that was not.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_toy import Req, toy_vllm
from gpu_engines import environ
from harvest_ray_child import (LENS, PART_PROMPTS, SHARD_TOKENS, TAPS, WINDOW_TOKENS, ToyEngine, prompts, run,
                               write_prompts)
from places import EXAMPLES, ROOT, SUPPORT
from toy_checks import reference
from toy_harvests import generated

from tapc.data import Shards
from tapc.errors import TapcError

ENGINE = {"engine": 1}   # a node's room for one engine: one actor on each node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes on this host, this process connected as a driver. The nodes' workers (the
    actors) import the toy engine from tests/support and tapc from the checkout."""
    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    env = {"PYTHONPATH": os.pathsep.join([str(SUPPORT), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0", "TAPC_STAGING_DIR": str(tmp_path_factory.mktemp("staging"))}
    # A GPU a node, as Ray counts them (the toy engine uses none): the pool asks for them as on GPUs.
    # Ray refuses a node more GPUs than CUDA_VISIBLE_DEVICES lists ("" hides every GPU, as on a CPU
    # machine): "-1" is one entry to Ray and no device to CUDA, and with NOSET Ray leaves it so in
    # the actors, which thus see no GPU however the machine hides its own (or does not). Only the
    # nodes get it: this process keeps its own GPUs.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)   # the nodes' processes start with this environment
    node = {"num_cpus": 1, "num_gpus": 1, "resources": ENGINE, "object_store_memory": 150 << 20}
    with environ("CUDA_VISIBLE_DEVICES", "-1"), environ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1"):
        c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        c.add_node(**node)
    ray.init(address=c.address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    write_prompts(path)
    return path


@pytest.fixture(scope="module")
def whole(cluster, prompts_file, tmp_path_factory):
    """The harvest over the pool, uninterrupted, with each part's node."""
    rows = []
    folder = tmp_path_factory.mktemp("whole") / "acts"
    m = run(prompts_file, folder, gpus_per_engine=1, on_part=rows.append)
    return folder, m, rows


def test_the_pool_harvest_equals_one_process_and_the_model(whole, tmp_path):
    from vllm import SamplingParams

    from tapc.harvest.run import harvest

    folder, m, rows = whole
    assert m.complete and m.prompts == len(LENS) and not m.failed
    assert sorted(r["part"] for r in rows) == [f"part-{i:06d}" for i in range(-(-len(LENS) // PART_PROMPTS))]
    assert len({r["node"] for r in rows}) == 2, "an engine on each node"
    assert all(r["seconds"] > 0 and r["rows"] > 0 for r in rows), rows
    assert json.loads((folder / "manifest.json").read_text())["complete"]
    llm, _ = toy_vllm(list(TAPS))
    one = harvest(llm, prompts(), tmp_path / "one", shard_tokens=SHARD_TOKENS, positions="all",
                  window_tokens=WINDOW_TOKENS, collect_every=3, sampling_params=SamplingParams(max_tokens=2),
                  progress=False)
    assert m.rows == one.rows and m.keys == one.keys
    for k in m.keys:   # over every row: exact (the sums sample rows of each piece written, which parts move)
        assert [m.stats[k][s] for s in ("rows", "min", "max")] == [one.stats[k][s] for s in ("rows", "min", "max")]
    pool, ref = Shards(folder), Shards(tmp_path / "one")
    cols = {k: torch.cat(list(pool.batches(k, 1000, shuffle=False))) for k in pool.keys}
    refs = {k: torch.cat(list(ref.batches(k, 1000, shuffle=False))) for k in ref.keys}
    assert torch.equal(cols["request"], refs["request"]), "every request, in input order, once"
    for i, prompt in enumerate(prompts()):
        mine = cols["request"] == i
        model = reference(Req(str(i), prompt, 2, tokens=prompt + generated(prompt, 2)), m.keys)
        for k in pool.keys:
            assert torch.equal(cols[k][mine], refs[k][refs["request"] == i]), (i, k)
        for k in m.keys:
            torch.testing.assert_close(cols[k][mine], model[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda s: f"prompt {i} {k}: {s}")


def test_a_killed_actor_is_started_again_and_its_part_goes_on(whole, prompts_file, tmp_path):
    """An actor SIGKILLs itself mid-shard; Ray starts it again and hands it the part again,
    which goes on from its last shard: the files are the uninterrupted harvest's."""
    marker = tmp_path / "died"
    run(prompts_file, tmp_path / "acts", ToyEngine(die_at=(3, str(marker))), actor_options={"resources": ENGINE})
    assert marker.exists(), "an actor died"
    _same_files(tmp_path / "acts", whole[0])


def test_a_killed_driver_started_again_goes_on_with_the_parts_left(cluster, whole, prompts_file, tmp_path):
    """The driver SIGKILLs itself once two parts are written (Ray then ends its actors, mid-part):
    started again, it leaves the whole parts out and the others go on from their last shards."""
    folder = tmp_path / "acts"
    child = subprocess.run([sys.executable, str(SUPPORT / "harvest_ray_child.py"), cluster.address, str(prompts_file),
                            str(folder), "--die-after-parts", "2"], capture_output=True, text=True, timeout=240)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    first = [line.split()[1] for line in child.stdout.splitlines() if line.startswith("written")]
    assert len(first) == 2 and not json.loads((folder / "manifest.json").read_text())["complete"]
    _wait_for_the_job_to_end(tmp_path / "pids")
    again = []
    run(prompts_file, folder, on_part=again.append)
    assert not set(first) & {r["part"] for r in again}, "a whole part ran again"
    _same_files(folder, whole[0])


def test_a_harvest_to_s3_goes_through_staging_into_the_bucket(whole, prompts_file, tmp_path):
    """Output to object storage through fsspec (s3fs) and a local S3 server: each part is
    harvested in a staging folder and put into the bucket when whole; the bucket then holds the
    files of a harvest to a folder, and the staging folders are gone."""
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("acts-bucket")
        m = run(prompts_file, "s3://acts-bucket/run/acts", storage_options=options, engines=1)
        assert m.complete and m.rows == whole[1].rows
        fs.get("acts-bucket/run/acts/", str(tmp_path / "got") + "/", recursive=True)
    finally:
        server.stop()
    _same_files(tmp_path / "got", whole[0])
    staging = Path(os.environ["TAPC_STAGING_DIR"])
    assert not list(staging.glob("*/part-*")), "staging folders left behind"


def test_a_ray_dataset_of_token_ids_harvests_as_the_prompts_file(whole, tmp_path):
    """Prompts as a Ray dataset whose column holds token ids (no file, no text): the files of
    the same prompts' harvest from a prompts file."""
    import ray.data

    m = run(ray.data.from_items([{"prompt": p} for p in prompts()]), tmp_path / "acts",
            actor_options={"resources": ENGINE})
    assert m.complete and m.rows == whole[1].rows
    _same_files(tmp_path / "acts", whole[0])


def test_bad_input_is_one_line_naming_what_is_wrong(cluster, prompts_file, tmp_path):
    import ray.data

    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n[4, 5\n")
    with pytest.raises(TapcError, match=r"^part-000000: prompt 1: not JSON \(Expecting ',' delimiter\)$"):
        run(bad, tmp_path / "a", engines=1)
    with pytest.raises(TapcError, match="no such prompts file"):
        run(tmp_path / "missing.jsonl", tmp_path / "b")
    with pytest.raises(TapcError, match="the prompts dataset has no column 'prompt'; it has text"):
        run(ray.data.from_items([{"text": "a"}]), tmp_path / "c")
    with pytest.raises(TapcError, match="documents .* need text_field"):
        run(tmp_path, tmp_path / "d")
    with pytest.raises(TapcError, match=r"holds another harvest \(parts: 4 there, 5 now\)"):
        run(bad, tmp_path / "a", part_prompts=5)
    with pytest.raises(TapcError, match="part_prompts must be at least 1, got 0"):
        run(prompts_file, tmp_path / "f", part_prompts=0)


def test_the_cli_on_ray_says_in_one_line_what_stops_its_engines(cluster, capsys):
    """`tapc harvest SPEC PROMPTS --ray ADDRESS`: the spec's plan is built on the driver, and an
    actor that cannot make its engine (here: Ray counts a GPU on each node, torch sees none) says
    why in one line naming its part."""
    from tapc.cli import main

    spec = EXAMPLES / "harvest.yaml"
    argv = ["harvest", str(spec), str(EXAMPLES / "prompts.jsonl"), "--ray", cluster.address]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("tapc: TapcError: part-000000: the engine needs a CUDA GPU, and torch sees none here; "
                       "`tapc explain` shows the plan on any machine"), err


def test_no_engine_fitting_the_clusters_gpus_is_said_before_anything_starts(cluster, prompts_file, tmp_path):
    with pytest.raises(TapcError, match=r"^the Ray cluster has 2 GPUs and an engine takes 3 \(gpus_per_engine; by "
                                        r"default the plan's tensor x pipeline parallel size\): no engine fits$"):
        run(prompts_file, tmp_path / "acts", engines=None, gpus_per_engine=3)
    assert not (tmp_path / "acts").exists()


def _same_files(got: Path, want: Path) -> None:
    names = sorted(str(p.relative_to(want)) for p in want.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def _wait_for_the_job_to_end(pids: Path, timeout: float = 60) -> None:
    """Until the dead driver's actors are gone (Ray ends them when it sees the driver gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(int(p.name)) for p in pids.iterdir()):
            return
        time.sleep(0.2)
    raise AssertionError("the killed driver's actors never ended")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
