"""`tapc serve` on the CPU: the command vLLM is started with (parsed by vLLM's own parser), and
tapc's endpoint plugin (routes and middleware) in a FastAPI app whose /v1/completions stands in
for vLLM's: it runs the toy async engine (tests/support/async_toy.py) on the body it receives, as vLLM
does (vllm_xargs -> SamplingParams.extra_args). Routing, validation and bookkeeping only;
correctness against a real engine is the GPU's (benchmarks/bench_serve.py)."""
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_toy import HIDDEN, toy_plan
from places import CONFIGS
from safetensors.torch import load as load_safetensors
from toy_checks import check as check_rows
from toy_server import TAPS, client, stand_in_app

from tapc.cli import main
from tapc.errors import TapcError
from tapc.plan.tapplan import TapPlan
from tapc.serving.launch import ENTRY, serve_argv, serve_env
from tapc.wire.config import EngineConfig
from tapc.serving.saving import SaveFolder

LLAMA = str(CONFIGS / "llama")


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's parser reads config defaults that need a platform; this machine has no GPU. (It
    caches them: a test that parses without this passed only after one that had it.)"""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())


def test_the_serve_command_is_what_vllms_parser_reads_as_the_plans_engine(cpu_platform):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = serve_argv(LLAMA, ["model.layers.*.resid", "model.layers.1.resid | add(steer)"],
                      engine={"max_num_seqs": 16}, extra=["--port", "8123"])
    assert argv[:2] == ["serve", LLAMA]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[1:])
    plan = TapPlan.from_json(EngineConfig.read(args.additional_config).plan)
    assert [t.source for t in plan.taps][-1] == "model.layers.1.resid | add(steer)" and plan.max_num_seqs == 16
    assert args.worker_cls == "tapc.worker.worker.TapWorker" and args.max_num_seqs == 16 and args.port == 8123
    assert args.max_num_batched_tokens == plan.max_num_batched_tokens


def test_tapc_serve_takes_the_sizes_into_the_plan(capsys):
    assert main(["serve", LLAMA, "--tap", "model.layers.0.resid", "--max-num-seqs=12", "--print", "--port", "9"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.count("--max-num-seqs") == 1 and "--max-num-seqs 12" in cmd and cmd.rstrip().endswith("--port 9")
    assert main(["serve", LLAMA, "--print"]) == 2
    assert "give a spec .yaml, or a model and its taps" in capsys.readouterr().err


def test_tapc_serve_takes_the_executor_into_the_engines_arguments(capsys):
    """`--distributed-executor-backend` goes where tapc checks it against the plan's sizes: once,
    as given ("ray"), and an executor a tapped engine on several GPUs cannot run is said in one line."""
    tap = ["--tap", "model.layers.0.resid", "-tp", "2", "--print"]
    assert main(["serve", LLAMA, *tap, "--distributed-executor-backend", "ray"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.count("--distributed-executor-backend") == 1 and "--distributed-executor-backend ray" in cmd
    assert main(["serve", LLAMA, *tap, "--distributed-executor-backend=uni"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "distributed_executor_backend='uni': tapped engines on several GPUs run vLLM's multiprocessing executor "
        "(\"mp\", the default) or its Ray executor (\"ray\") (docs/distributed.md)")
    for given in (["--distributed-executor-backend="], ["--distributed-executor-backend"]):
        assert main(["serve", LLAMA, "--tap", "model.layers.0.resid", "--print", *given]) == 2
        assert capsys.readouterr().err.strip().endswith("tapc serve: --distributed-executor-backend needs a value")


def test_tapc_serve_reserves_capture_memory_through_the_plans_config(capsys, cpu_platform):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert main(["serve", LLAMA, "--tap", "model.layers.0.resid", "--capture-memory-gib", "2",
                 "--prefix-rows-gib", "0.5", "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert "--capture-memory-gib" not in argv and "--prefix-rows-gib" not in argv, "tapc's own settings, not vLLM's"
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    config = EngineConfig.read(args.additional_config)
    assert (config.capture_memory, config.prefix_rows) == (2 << 30, 1 << 29)


def test_the_plugin_entry_point_is_found_without_installing_tapc():
    env = serve_env({"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert "tapc" in env["VLLM_PLUGINS"].split(",")
    got = subprocess.run([sys.executable, "-c", "from importlib.metadata import entry_points; "
                          "print([e.name + ' = ' + e.value for e in entry_points(group='vllm.endpoint_plugins')])"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert ENTRY in got


# ----------------------------------------------------------------------------- the plugin in an app


def xargs(**ask):
    return {"tapc": json.dumps(ask)}


def fetch(c, tid):
    r = c.get(f"/v1/tapc/results/{tid}")
    assert r.status_code == 200, r.text
    return load_safetensors(r.content)


def as_req(prompt, tokens):
    from types import SimpleNamespace as NS

    return NS(rid="r", prompt=prompt, tokens=list(prompt) + list(tokens))


@pytest.mark.parametrize("inline", [False, True], ids=["by-id", "inline"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tapped_completion_brings_its_captures(stream, inline):
    """By id from the results route, once; or, asked `inline`, in the response itself: under
    `tapc` in its JSON, or streamed in one more event (no choices) just before [DONE]."""
    import base64

    app, hooks = stand_in_app()
    prompt = np.random.default_rng(3).integers(0, 50, 9).tolist()
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "stream": stream,
                                            "vllm_xargs": xargs(capture=["model.layers.*.resid"], positions="all",
                                                                **({"inline": True} if inline else {}))})
        assert r.status_code == 200, r.text
        tid = r.headers["x-tapc-id"]
        if stream:
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            events = [json.loads(line[6:]) for line in lines[:-1]]
            assert lines[-1] == "data: [DONE]"
            tokens = [e["choices"][0]["token"] for e in events if e["choices"]]
            with_usage = [e for e in events if e.get("usage")]
            assert with_usage[-1]["usage"]["completion_tokens"] == 5, "tapc asked vLLM for the usage chunk"
            got = events[-1].get("tapc")
            assert (got is not None) == inline and (not inline or events[-1]["choices"] == []), \
                "inline results are the last event before [DONE], with no choices"
        else:
            body = r.json()
            assert int(r.headers["content-length"]) == len(r.content)
            tokens, got = body["choices"][0]["tokens"], body.get("tapc")
            assert (got is not None) == inline
        sent = app.state.seen[-1]
        assert isinstance(sent["vllm_xargs"]["tapc"], str) and "cache_salt" in sent, \
            "the wire as text; a capture of prompt rows reads no shared cache"
        if inline:
            assert got["id"] == tid
            taps = load_safetensors(base64.b64decode(got["safetensors"]))
        else:
            taps = fetch(c, tid)
        check_rows(as_req(prompt, tokens), taps, "all")
        assert c.get(f"/v1/tapc/results/{tid}", params={"wait": 0}).status_code == 404, \
            "results are fetched once; inline ones are not kept"
        untapped = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert untapped.status_code == 200 and "x-tapc-id" not in untapped.headers
        assert "cache_salt" not in app.state.seen[-1]
        assert c.get("/v1/tapc/held").json() == {"workers": [{"running": 0, "uncollected": 0, "chunks": 0,
                                                               "slots": 0}]}


@pytest.mark.parametrize("body,words", [
    ({"vllm_xargs": xargs(capture=["model.layers.9.resid"])}, "'model.layers.9.resid' is not a capture"),
    ({"vllm_xargs": {"tapc": {"capture": "*"}}}, "vllm_xargs.tapc must be a JSON string"),
    ({"vllm_xargs": {"tapc": "{nope"}}, "vllm_xargs.tapc is not JSON"),
    ({"vllm_xargs": xargs(capture="*", blocks={"probe": "code"})}, "unknown field(s) blocks"),
    ({"vllm_xargs": xargs(params={"steer": "happy"})}, "names vector 'happy', which is not registered"),
    ({"vllm_xargs": xargs(capture="*", inline="yes")}, "inline must be true or false, got 'yes'"),
    ({"vllm_xargs": xargs(params={"steer": [1.0, 2.0]})}, "parameter 'steer' (vector) must be 16 numbers"),
    ({"n": 2, "vllm_xargs": xargs(capture="*")}, "taps with n=2 choices are not supported"),
    ({"prompt": [[1, 2], [3]], "vllm_xargs": xargs(capture="*")}, "a tapped completion takes one prompt, got 2"),
    ({"vllm_xargs": xargs(capture="*", positions=[1, 10**12])}, "position 1000000000000 lies beyond the last this "
                                                                "request can reach, 3 (a prompt of 3 tokens and max_tokens=2)"),
    ({"vllm_xargs": xargs(capture="*", positions=[1.5])}, "positions must be one of all, prompt, generated, last or a "
                                                          "list of distinct non-negative token positions (integers), got [1.5]"),
])
def test_bad_tapped_requests_get_400_with_the_request_errors_words(body, words):
    app, _ = stand_in_app()
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        assert words in r.json()["error"]["message"], r.json()
        assert app.state.seen == [], "vLLM never saw it"


def test_engine_wide_values_steer_requests_that_ask_for_nothing():
    """A spec's `params:` bind edits for every request: one that sends no `vllm_xargs` is
    tapped too (the middleware reads its body, which it skips when nothing taps such a request)."""
    v = np.random.default_rng(1).standard_normal(HIDDEN) * 20
    app, _ = stand_in_app(params={"steer": v})
    prompt = [4, 8, 15, 16, 23, 42]
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200 and "x-tapc-id" in r.headers, "tapped, asking for nothing"
        sent = app.state.seen[-1]
        assert '"steer"' in sent["vllm_xargs"]["tapc"] and sent["cache_salt"].startswith("tapc-"), \
            "the engine's value travels to the worker, and the steered KV is salted"
    plain = stand_in_app()[0]
    with client(plain) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert "x-tapc-id" not in r.headers and "vllm_xargs" not in plain.state.seen[-1], "without them: untapped"


def test_vectors_registered_by_name_steer_and_share_a_salt():
    app, _ = stand_in_app()
    v = np.linspace(-1, 1, HIDDEN)
    with client(app) as c:
        assert c.post("/v1/tapc/vectors", json={"name": "happy", "values": v.tolist()}).json() == \
            {"name": "happy", "size": HIDDEN}
        assert c.post("/v1/tapc/vectors", json={"name": "bad", "values": [[1.0], [2.0]]}).status_code == 400
        assert c.post("/v1/tapc/vectors", content=b'{"name": "bad", "values": [1.0, NaN]}').status_code == 400
        assert c.get("/v1/tapc/vectors").json() == {"vectors": {"happy": HIDDEN}}
        prompt = [4, 8, 15, 16, 23, 42]
        ask = xargs(capture=["model.layers.2.resid"], positions="generated", params={"steer": "happy"})
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "vllm_xargs": ask})
        taps = fetch(c, r.headers["x-tapc-id"])
        check_rows(as_req(prompt, r.json()["choices"][0]["tokens"]), taps, "generated", [(1, v, 2.0, "all")])
        c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "vllm_xargs": ask})
        prompt_rows = {**ask, "tapc": ask["tapc"].replace('"generated"', '"all"')}
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "vllm_xargs": prompt_rows})
            taps = fetch(c, r.headers["x-tapc-id"])
            check_rows(as_req(prompt, r.json()["choices"][0]["tokens"]), taps, "all", [(1, v, 2.0, "all")])
        salts = [b.get("cache_salt") for b in app.state.seen]
        assert salts[0] == salts[1] and salts[0].startswith("tapc-"), "identical steering shares its salt"
        assert len({salts[0], salts[2], salts[3]}) == 3, \
            "a capture of prompt rows reads no cached KV, its twins' included: a salt of its own"
        assert TapPlan.from_json(c.get("/v1/tapc/plan").text).taps[-1].source == TAPS[-1]


def test_a_response_that_fails_gives_back_what_its_request_held():
    app, hooks = stand_in_app()
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": "boom", "vllm_xargs": xargs(capture="*")})
        assert r.status_code == 500
        tid = app.state.seen[-1]["vllm_xargs"]["tapc"]
        assert c.get(f"/v1/tapc/results/{json.loads(tid)['id']}").headers["x-tapc-error"] == "RequestError"
        c.portal.call(app.state.tapc.collector.settle)
        assert hooks.held() == {"running": 0, "uncollected": 0, "chunks": 0, "slots": 0}


def test_host_time_counts_each_forward_and_the_seconds_of_tapcs_hooks():
    """`/v1/tapc/host-time`: the forwards the hooks ran (counted here apart, by wrapping the
    worker's `begin_step`) and the seconds each hook took, growing with every load and never
    more than the load's own wall time."""
    import time

    app, hooks = stand_in_app()
    forwards = []
    begin = hooks.begin_step
    hooks.begin_step = lambda batch: (forwards.append(1), begin(batch))[1]
    prompt = np.random.default_rng(5).integers(0, 50, 7).tolist()
    with client(app) as c:
        before = c.get("/v1/tapc/host-time").json()["workers"]
        assert before == [{"steps": 0, "schedule_s": 0.0, "begin_step_s": 0.0, "end_step_s": 0.0, "collect_s": 0.0}]
        readings = []
        for _ in range(2):
            start = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                "vllm_xargs": xargs(capture=["model.layers.*.resid"])})
            fetch(c, r.headers["x-tapc-id"])
            wall = time.perf_counter() - start
            (now,) = c.get("/v1/tapc/host-time").json()["workers"]
            assert now["steps"] == len(forwards) and now["steps"] > (readings[-1]["steps"] if readings else 0)
            last = readings[-1] if readings else before[0]
            spent = {k: now[k] - last[k] for k in now if k.endswith("_s")}
            assert all(v > 0 for v in spent.values()), spent
            assert sum(spent.values()) < wall, (spent, wall)
            readings.append(now)


def test_vllms_api_key_guards_tapc_routes():
    app, _ = stand_in_app(api_key="sesame")
    with client(app) as c:
        assert c.get("/v1/tapc/vectors").status_code == 401
        assert c.get("/v1/tapc/vectors", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_the_python_client_registers_completes_and_fetches():
    from tapc.serving.client import TapcClient
    from tapc.errors import RequestError

    app, _ = stand_in_app()
    v = np.linspace(1, 2, HIDDEN)
    with client(app) as c:
        tc = TapcClient("http://testserver/v1", api_key="k", http_client=c)
        assert tc.register("calm", v) == HIDDEN
        prompt = [3, 1, 4, 1, 5, 9, 2]
        resp, tid = tc.complete(model="toy", prompt=prompt, max_tokens=3,
                                taps=tc.ask(capture="model.layers.2.resid", params={"steer": "calm"}))
        taps = tc.results(tid)
        check_rows(as_req(prompt, resp.choices[0].tokens), taps, "all", [(1, v, 2.0, "all")])
        with pytest.raises(RequestError, match="names vector 'sad', which is not registered"):
            tc.complete(model="toy", prompt=prompt, max_tokens=3, taps=tc.ask(params={"steer": "sad"}))


def test_a_client_on_the_servers_host_reads_results_where_they_are_and_gives_them_back():
    """`via=shm`: the captures as views of the engine's own arena blocks (no bytes over HTTP),
    equal to the toy model's rows; they stay the client's (held on the worker) until it gives
    them back, once; a block's saved tensors (not arena memory) come through a file of their
    own, removed with the give-back. The Python client does both in one `with`."""
    import torch

    from tapc.serving.client import TapcClient, shared_views

    taps = [*TAPS, "model.layers.0.resid -> probe"]
    app, hooks = stand_in_app(taps, blocks={"probe": "test_server:saving_probe"})
    prompt = np.random.default_rng(7).integers(0, 50, 8).tolist()
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5,
                                            "vllm_xargs": xargs(capture=["model.layers.*.resid"])})
        tid = r.headers["x-tapc-id"]
        lent = c.get(f"/v1/tapc/results/{tid}", params={"via": "shm"}).json()
        assert lent["error"] == "" and lent["keep_s"] > 0
        arena = {d["path"] for k, d in lent["tensors"].items() if not k.startswith("saved/")}
        assert len(arena) >= 1 and all(os.path.basename(p).startswith("tapc-") for p in arena)
        assert all(d["stride"][0] > d["shape"][1] for k, d in lent["tensors"].items() if not k.startswith("saved/")), \
            "each key a strided view of its request's [rows, keys, width] block, as it lies"
        (copied,) = {d["path"] for k, d in lent["tensors"].items() if k.startswith("saved/")}
        got = shared_views(lent["tensors"])
        check_rows(as_req(prompt, r.json()["choices"][0]["tokens"]), {k: v for k, v in got.items()
                                                                     if not k.startswith("saved/")}, "all")
        saved = torch.cat([got[k] for k in sorted((k for k in got if k.startswith("saved/x/")),
                                                  key=lambda k: int(k.rsplit("/", 1)[1]))])
        assert torch.equal(saved, got["model.layers.0.resid"]), "the block's saved rows, through their own file"
        c.portal.call(app.state.tapc.collector.settle)
        assert hooks.held()["chunks"] > 0, "lent: the worker does not reuse them"
        assert c.get(f"/v1/tapc/results/{tid}", params={"via": "shm", "wait": 0}).status_code == 404, "lent once"
        assert c.delete(f"/v1/tapc/results/{tid}").json() == {"id": tid, "given_back": True}
        assert not os.path.exists(copied)
        assert c.delete(f"/v1/tapc/results/{tid}").status_code == 404
        del got, saved
        c.portal.call(app.state.tapc.collector.settle)
        assert hooks.held() == {"running": 0, "uncollected": 0, "chunks": 0, "slots": 0}

        tc = TapcClient("http://testserver/v1", api_key="k", http_client=c)
        _, tid = tc.complete(model="toy", prompt=prompt, max_tokens=3, taps=tc.ask(capture="model.layers.1.resid"))
        with tc.shared(tid) as views:
            kept = views["model.layers.1.resid"].clone()
        assert kept.shape == (len(prompt) + 2, HIDDEN)
        assert c.delete(f"/v1/tapc/results/{tid}").status_code == 404, "the `with` gave them back"
        assert c.get(f"/v1/tapc/results/{tid}", params={"via": "pigeon"}).status_code == 400


def test_lent_results_not_given_back_are_dropped_after_the_keep_time():
    app, hooks = stand_in_app()
    app.state.tapc.results.keep_s = 0.0
    prompt = [5, 3, 8, 1]
    with client(app) as c:
        tids = []
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "vllm_xargs": xargs(capture="*")})
            tids.append(r.headers["x-tapc-id"])
            assert c.get(f"/v1/tapc/results/{tids[-1]}", params={"via": "shm"}).status_code == 200
        # the second result's arrival swept the first, lent past its keep time
        assert c.delete(f"/v1/tapc/results/{tids[0]}").status_code == 404
        assert c.delete(f"/v1/tapc/results/{tids[1]}").status_code == 200
        c.portal.call(app.state.tapc.collector.settle)
        assert hooks.held()["chunks"] == 0


def test_with_several_api_server_processes_results_are_lent_from_their_shared_folder(tmp_path):
    """A result finished on one process is lent by another (its file in the folder they share,
    tensor by tensor), once, and given back through either; nothing is left behind."""
    from tapc.serving.client import shared_views

    a, _ = stand_in_app(shared=str(tmp_path))
    b, _ = stand_in_app(shared=str(tmp_path))
    prompt = np.random.default_rng(13).integers(0, 50, 6).tolist()
    with client(a) as ca, client(b) as cb:
        r = ca.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                             "vllm_xargs": xargs(capture=["model.layers.*.resid"])})
        tid = r.headers["x-tapc-id"]
        lent = cb.get(f"/v1/tapc/results/{tid}", params={"via": "shm"}).json()
        assert lent["error"] == "" and {d["path"] for d in lent["tensors"].values()} == {str(tmp_path / f"{tid}.lent")}
        check_rows(as_req(prompt, r.json()["choices"][0]["tokens"]), shared_views(lent["tensors"]), "all")
        assert ca.get(f"/v1/tapc/results/{tid}", params={"via": "shm", "wait": 0}).status_code == 404, "lent once"
        assert ca.delete(f"/v1/tapc/results/{tid}").status_code == 200
        assert cb.delete(f"/v1/tapc/results/{tid}").status_code == 404
        assert cb.get("/v1/tapc/results/x", params={"via": "pigeon"}).status_code == 400
    assert sorted(os.listdir(tmp_path)) == ["vectors"], "nothing left behind but the vectors"


def test_the_wire_as_text_round_trips_and_refuses_blocks():
    from tapc.wire.protocol import WireRequest
    from tapc.api.requests import TapRequest, check
    from tapc.errors import ProtocolError

    plan = toy_plan(TAPS)
    wire = WireRequest("id1", check(plan, TapRequest(capture="*", positions=[0, 3], params={"steer": np.ones(HIDDEN)}),
                                    "r"))
    assert WireRequest.from_wire(wire.to_text()) == wire
    with pytest.raises(ProtocolError, match="tapc request: not JSON"):
        WireRequest.from_wire("{nope")
    with pytest.raises(ProtocolError, match=r"a vector parameter is not \{'base64': ...\}"):
        WireRequest.from_wire(json.dumps({**json.loads(wire.to_text()), "params": {"steer": {"hex": "00"}}}))
    with pytest.raises(ProtocolError, match=r"a vector parameter is not \{'base64': ...\}"):   # not base64's digits
        WireRequest.from_wire(json.dumps({**json.loads(wire.to_text()), "params": {"steer": {"base64": "AAA!"}}}))
    with_blocks = WireRequest("id2", check(toy_plan(["model.layers.0.resid -> probe"]),
                                           TapRequest(blocks={"probe": lambda ctx, x: None}), "r"))
    with pytest.raises(ProtocolError, match="per-request blocks do not travel as text"):
        with_blocks.to_text()


def saving_probe(ctx, x):
    """A block the tests below name by import path (`test_server:saving_probe`)."""
    ctx.save("x", x.clone())


def _served_config(argv: list[str]) -> EngineConfig:
    return EngineConfig.read(argv[argv.index("--additional-config") + 1])


def test_blocks_are_named_by_import_path_and_run_for_every_served_request(tmp_path, capsys):
    """`tapc serve --block NAME=module:function` (or a spec's `blocks:`) puts the path in the
    engine's config, never code; the server's worker imports it and runs it for every tapped
    request, whose saved values come back with its captures. Names the plan lacks and paths
    that do not import are refused before vLLM starts."""
    import shlex

    import torch

    path = "test_server:saving_probe"
    taps = ["model.layers.0.resid", "model.layers.0.resid -> probe"]
    assert main(["serve", LLAMA, *[a for t in taps for a in ("--tap", t)], "--block", f"probe={path}", "--print"]) == 0
    assert _served_config(shlex.split(capsys.readouterr().out)).blocks == {"probe": path}
    spec = tmp_path / "serve.yaml"
    spec.write_text(f"model: {LLAMA}\ntaps: {json.dumps(taps)}\nblocks: {{probe: '{path}'}}\n")
    assert main(["serve", str(spec), "--print"]) == 0
    assert _served_config(shlex.split(capsys.readouterr().out)).blocks == {"probe": path}
    for block, words in ((f"prob={path}", "blocks= names prob, which no tap of the plan runs"),
                         ("probe=test_server:nothing", "'test_server' has no 'nothing'"),
                         ("probe=no_such_module:f", "cannot import 'no_such_module'"),
                         ("probe=test_server", "name it as 'package.module:function'")):
        assert main(["serve", LLAMA, *[a for t in taps for a in ("--tap", t)], "--block", block, "--print"]) == 2
        assert words in capsys.readouterr().err

    app, _ = stand_in_app(taps, blocks={"probe": path})
    prompt = np.random.default_rng(5).integers(0, 50, 7).tolist()
    with client(app) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "vllm_xargs": xargs(capture="*")})
        assert r.status_code == 200, r.text
        got = fetch(c, r.headers["x-tapc-id"])
    seen = torch.cat([got[k] for k in sorted((k for k in got if k.startswith("saved/x/")), key=lambda k: int(k.split("/")[-1]))])
    assert seen.shape[0] == len(prompt) + 3 and torch.equal(seen, got["model.layers.0.resid"]), \
        "the block saw each of the request's rows at its point, as the capture there"


def test_results_encode_as_safetensors_reads_them_with_every_dtype_and_the_metadata():
    """The streamed results (a header, then each tensor's own bytes) are what safetensors loads:
    values, dtypes and shapes of captures and saved tensors, metadata; a non-contiguous capture
    is written in its logical order (one value with odd strides too); a dtype safetensors has no
    name for is refused by name."""
    import torch
    from safetensors import safe_open

    from tapc.errors import RequestError
    from tapc.serving.results import Stored, encode, tensor_bytes

    g = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 12, generator=g)
    taps = {"model.layers.0.resid": torch.randn(5, 16, generator=g).to(torch.bfloat16),
            "model.layers.1.mlp.act_fn.output": wide[:, ::2],     # not contiguous
            "logits": torch.randn(3, 33, generator=g, dtype=torch.float64).float(),
            "samples": torch.randint(0, 1000, (3,), generator=g),
            "one": wide.to(torch.bfloat16).as_strided((1, 1), (7, 3), 29)}   # one value, odd strides
    saved = {"probe": [torch.randn(2, 4, generator=g).half(), {"note": 1}, torch.tensor(True)],
             "ids": [torch.randint(-5, 5, (4,), dtype=torch.int32, generator=g), torch.tensor(7, dtype=torch.uint8)]}
    head, tensors = encode(Stored(taps, saved, RequestError("boom at layer 3"), (40, 41)))
    data = head + b"".join(bytes(tensor_bytes(t)) for t in tensors)
    got = load_safetensors(data)
    want = {**taps, "saved/probe/0": saved["probe"][0], "saved/probe/2": saved["probe"][2],
            "saved/ids/0": saved["ids"][0], "saved/ids/1": saved["ids"][1]}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        with safe_open(f.name, "pt") as st:
            meta = st.metadata()
    assert meta["error"] == "boom at layer 3" and json.loads(meta["saved"]) == {"probe": {"1": {"note": 1}}}
    assert json.loads(meta["unreached"]) == [40, 41], "listed positions the request stopped before"
    with pytest.raises(RequestError, match="saved/c/0: dtype torch.complex64"):
        encode(Stored({}, {"c": [torch.zeros(2, dtype=torch.complex64)]}, None))


def test_results_that_cannot_be_sent_are_an_error_that_says_why():
    """A result holding a tensor safetensors has no dtype for (a block's saved value) gets HTTP
    500 naming it; the server goes on serving."""
    import torch

    from tapc.serving.results import Stored

    app, _ = stand_in_app()
    with client(app) as c:
        c.portal.call(app.state.tapc.results.put, "bad", Stored({}, {"probe": [torch.zeros(2, dtype=torch.complex64)]},
                                                                None))
        r = c.get("/v1/tapc/results/bad")
        assert r.status_code == 500, r.text
        assert "saved/probe/0: dtype torch.complex64 has no safetensors name" in r.json()["error"]["message"]
        assert c.get("/v1/tapc/plan").status_code == 200


# ----------------------------------------------------------------------------- several API server processes


def test_api_server_processes_share_vectors_and_results_through_their_folder(tmp_path):
    """With `--api-server-count 2` a client's calls land on either process: a vector registered
    on one steers a request served by the other, and a result finished on one is fetched from
    the other, once; an aborted request's error and a result that cannot be sent say so there
    too. Each process's engine ends holding nothing."""
    import torch

    from tapc.serving.results import Stored

    a, hooks_a = stand_in_app(shared=str(tmp_path))
    b, _ = stand_in_app(shared=str(tmp_path))
    v = np.linspace(-2, 1, HIDDEN)
    with client(a) as ca, client(b) as cb:
        assert cb.post("/v1/tapc/vectors", json={"name": "happy", "values": v.tolist()}).status_code == 200
        assert ca.get("/v1/tapc/vectors").json() == {"vectors": {"happy": HIDDEN}}
        prompt = np.random.default_rng(11).integers(0, 50, 8).tolist()
        # layer 2, after the steered layer 1 (a capture listed before an edit of its point sees the
        # value before it, which the toy's reference does not model)
        ask = xargs(capture=["model.layers.0.resid", "model.layers.2.resid"], positions="all",
                    params={"steer": "happy"})
        r = ca.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "vllm_xargs": ask})
        assert r.status_code == 200, r.text
        tid = r.headers["x-tapc-id"]
        check_rows(as_req(prompt, r.json()["choices"][0]["tokens"]), fetch(cb, tid), "all", [(1, v, 2.0, "all")])
        assert ca.get(f"/v1/tapc/results/{tid}").status_code == 404, "fetched once, whichever process asks"
        assert cb.get(f"/v1/tapc/results/{tid}").status_code == 404

        ca.post("/v1/completions", json={"prompt": "boom", "vllm_xargs": xargs(capture="*")})
        lost = json.loads(a.state.seen[-1]["vllm_xargs"]["tapc"])["id"]
        assert cb.get(f"/v1/tapc/results/{lost}").headers["x-tapc-error"] == "RequestError"

        bad = "0" * 32
        ca.portal.call(a.state.tapc.results.put, bad, Stored({}, {"p": [torch.zeros(2, dtype=torch.complex64)]}, None))
        r = cb.get(f"/v1/tapc/results/{bad}")
        assert r.status_code == 500 and "saved/p/0: dtype torch.complex64" in r.json()["error"]["message"]

        assert ca.get("/v1/tapc/held").json()["workers"] == [{"running": 0, "uncollected": 0, "chunks": 0,
                                                               "slots": 0}]
    assert sorted(os.listdir(tmp_path)) == ["vectors"], "nothing left behind but the vectors"


def test_a_fetch_waits_for_a_result_another_process_is_finishing_and_one_claim_wins(tmp_path):
    import asyncio
    import threading

    import torch

    from tapc.serving.results import FolderResults, Stored

    async def main():
        released = []
        mine, other = (FolderResults(str(tmp_path), 60.0, lambda: released.append(1)) for _ in range(2))
        tid = "a" * 32
        mine.begin(tid)
        waiting = asyncio.create_task(other.take(tid, 5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "the request is still running: the fetch waits"
        rows = torch.randn(6, 16).to(torch.bfloat16)
        await mine.put(tid, Stored({"model.layers.0.resid": rows}, {}, None))
        got = load_safetensors(await _drain(await waiting))
        assert torch.equal(got["model.layers.0.resid"], rows) and released == [1]
        assert await other.take(tid, 0.0) is None and await other.take("b" * 32, 0.2) is None
        assert await other.take("../../etc/passwd", 0.0) is None, "only tapc ids name files"

        tid = "c" * 32
        mine.begin(tid)
        await mine.put(tid, Stored({"x": rows}, {}, None))
        return tid

    async def many():
        """64 results written at once (threads side by side, a sweep among them), each taken
        once by the other process."""
        mine, other = (FolderResults(str(tmp_path), 60.0, lambda: None) for _ in range(2))
        tids = [f"{k:032x}" for k in range(64)]
        rows = {t: torch.full((3, 4), float(k)) for k, t in enumerate(tids)}
        for t in tids:
            mine.begin(t)
        await asyncio.gather(*(mine.put(t, Stored({"x": rows[t].clone()}, {}, None)) for t in tids))
        for t in tids:
            got = load_safetensors(await _drain(await other.take(t, 1.0)))
            assert torch.equal(got["x"], rows[t])
        assert sorted(os.listdir(tmp_path)) == ["c" * 32 + ".safetensors", "vectors"]

    tid = asyncio.run(main())
    asyncio.run(many())
    wins = []
    gate = threading.Barrier(8)

    def claim():
        gate.wait()
        reply = asyncio.run(FolderResults(str(tmp_path), 60.0, lambda: None).take(tid, 0.0))
        if reply is not None:
            wins.append(asyncio.run(_drain(reply)))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and "x" in load_safetensors(wins[0]), "exactly one of eight fetches gets it"


async def _drain(reply):
    return b"".join([bytes(c) async for c in reply.chunks])


def test_a_result_the_shared_folder_has_no_room_for_is_an_error_that_says_so(tmp_path, monkeypatch):
    import asyncio
    import errno

    import torch

    import tapc.serving.results as results
    from tapc.errors import RequestError
    from tapc.serving.results import FolderResults, Stored

    def full(t):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results, "tensor_bytes", full)
    store = FolderResults(str(tmp_path), 60.0, lambda: None)
    tid = "f" * 32
    store.begin(tid)
    asyncio.run(store.put(tid, Stored({"x": torch.ones(2, 3)}, {}, None)))
    with pytest.raises(RequestError, match=f"could not be written to {tmp_path}.*No space left on device"):
        asyncio.run(store.take(tid, 0.0))
    assert os.listdir(tmp_path) == ["vectors"], "no partial file left behind"


def test_the_shared_folder_drops_old_results_its_own_at_exit_and_the_folders_of_servers_gone(tmp_path):
    import asyncio
    import time

    from tapc.serving.results import FolderResults, Stored, shared_folder

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"tapc-serve-{gone.pid}"
    (stale / "vectors").mkdir(parents=True)
    folder = shared_folder(str(tmp_path))
    assert not stale.exists() and folder == str(tmp_path / f"tapc-serve-{os.getppid()}")

    store = FolderResults(folder, keep_s=30.0, released=lambda: None)
    old, new = "d" * 32, "e" * 32
    for tid in (old, new):
        store.begin(tid)
        asyncio.run(store.put(tid, Stored({}, {}, None)))
    hour_ago = time.time() - 3600
    os.utime(os.path.join(folder, old + ".safetensors"), (hour_ago, hour_ago))
    store._sweep()
    assert sorted(os.listdir(folder)) == [new + ".safetensors", "vectors"]
    store._drop_written()   # at the process's exit: what it wrote and nobody fetched
    assert os.listdir(folder) == ["vectors"]


def test_the_plugin_shares_a_folder_only_with_several_api_servers(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    import tapc.serving.results as results
    from tapc.serving.http import server_for
    from tapc.serving.results import FolderResults, MemoryResults

    monkeypatch.setattr(results, "shared_folder", lambda: str(tmp_path))
    config = EngineConfig(toy_plan(TAPS).to_json(), "").into(None)
    engine = NS(model_config=NS(max_model_len=64),   # vLLM's engine client, as the plugin reads it
                vllm_config=NS(cache_config=NS(enable_prefix_caching=True)))
    one = server_for(engine, NS(additional_config=config, api_server_count=None))
    two = server_for(engine, NS(additional_config=config, api_server_count=2))
    assert one.session.max_model_len == 64, "requests' positions are bounded by the engine's context"
    assert isinstance(one.results, MemoryResults) and isinstance(two.results, FolderResults)
    assert two.results.folder == str(tmp_path)
    saving = EngineConfig(toy_plan(TAPS).to_json(), "", save={"folder": str(tmp_path / "acts"), "positions": "all"}).into(None)
    with pytest.raises(TapcError, match="writes one folder's shards from one process: run it with --api-server-count 1"):
        server_for(engine, NS(additional_config=saving, api_server_count=2))


def test_tapc_serve_save_to_puts_the_save_folder_in_the_servers_config(capsys, tmp_path):
    assert main(["serve", LLAMA, "--tap", "model.layers.0.resid", "--save-to", str(tmp_path / "acts"),
                 "--save-positions", "0,3", "--print"]) == 0
    import shlex

    cmd = shlex.split(capsys.readouterr().out)
    config = _served_config(cmd)
    assert config.save == {"folder": str(tmp_path / "acts"), "shard_tokens": 1_000_000, "positions": [0, 3]}
    assert main(["serve", LLAMA, "--tap", "model.layers.0.resid", "--save-to", "x", "--save-positions", "some"]) == 2
    assert "--save-positions 'some': all, prompt, generated, last" in capsys.readouterr().err


# ----------------------------------------------------------------------------- results inline


def test_results_too_large_to_come_inline_wait_for_their_fetch(monkeypatch):
    """Over the inline limit the response says why and where they are; the Python client
    fetches them, so `tc.inline` reads either kind."""
    import tapc.serving.server as server
    from tapc.serving.client import TapcClient

    app, _ = stand_in_app()
    prompt = [5, 3, 5, 8, 9, 7, 9, 3]
    with client(app) as c:
        tc = TapcClient("http://testserver/v1", http_client=c)
        ask = tc.ask(capture=["model.layers.2.resid"], positions="all", inline=True)
        resp, tid = tc.complete(model="toy", prompt=prompt, max_tokens=3, taps=ask)
        small = tc.inline(resp)
        check_rows(as_req(prompt, resp.choices[0].tokens), small, "all")
        monkeypatch.setattr(server, "INLINE_MAX", 100)
        resp, tid = tc.complete(model="toy", prompt=prompt, max_tokens=3, taps=ask)
        assert resp.model_extra["tapc"]["fetch"] == f"/v1/tapc/results/{tid}"
        assert "more than the 100 a response carries inline" in resp.model_extra["tapc"]["why"]
        check_rows(as_req(prompt, resp.choices[0].tokens), tc.inline(resp), "all")


def test_saved_requests_are_written_to_the_save_folder_as_a_harvest(tmp_path):
    """`save: true`: the response carries the request's number (in the JSON body, or in one more
    streamed event), and its rows land in the save folder's shards under that number, in the
    order responses completed, with their token ids and positions, equal to the toy run alone
    (a steered request's under its steering); a response that failed gets no number; asks that
    name other captures or positions, or ask inline too, get 400; a server started again on the
    folder numbers on."""
    import time

    from tapc.data import Shards
    from tapc.harvest.run import Manifest

    folder = tmp_path / "acts"
    save = {"folder": str(folder), "shard_tokens": 16, "positions": "all"}
    app, hooks = stand_in_app(save=save)
    rng = np.random.default_rng(5)
    steer = rng.standard_normal(HIDDEN).astype(np.float32)
    asks = [({"stream": False}, {}), ({"stream": True}, {}), ({"stream": False}, {"params": {"steer": steer.tolist()}}),
            ({"stream": True}, {"capture": "*", "positions": "all"})]
    sent = []
    with client(app) as c:
        for k, (how, ask) in enumerate(asks):
            prompt = rng.integers(0, 50, 6 + 3 * k).tolist()
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **how,
                                                "vllm_xargs": xargs(save=True, **ask)})
            assert r.status_code == 200, r.text
            if how["stream"]:
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                tokens = [e["choices"][0]["token"] for e in events if e["choices"]]
                got = events[-1]["tapc"]
            else:
                tokens, got = r.json()["choices"][0]["tokens"], r.json()["tapc"]
            assert got == {"id": r.headers["x-tapc-id"], "saved": k}, got
            sent.append((prompt, tokens, ask))
        from tapc.serving.client import TapcClient

        tc = TapcClient("http://testserver/v1", http_client=c)
        prompt = rng.integers(0, 50, 7).tolist()
        resp, tid = tc.complete(model="toy", prompt=prompt, max_tokens=3, taps=tc.ask(save=True))
        assert resp.model_extra["tapc"] == {"id": tid, "saved": len(sent)}, "the Python client asks to save too"
        sent.append((prompt, resp.choices[0].tokens, {}))
        failed = c.post("/v1/completions", json={"prompt": "boom", "vllm_xargs": xargs(save=True)})
        assert failed.status_code == 500
        for ask, words in [({"save": True, "positions": "prompt"}, "this server saves positions 'all', not 'prompt'"),
                           ({"save": True, "capture": ["model.layers.0.resid"]}, "captures this server's save keys"),
                           ({"save": True, "inline": True}, "asks for its results inline and saved"),
                           ({"save": True, "echo": True}, "cannot `echo` its prompt")]:
            echo = {"echo": ask.pop("echo")} if "echo" in ask else {}
            r = c.post("/v1/completions", json={"prompt": [1, 2], **echo, "vllm_xargs": xargs(**ask)})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 30
        while app.state.tapc._ending and time.monotonic() < deadline:
            time.sleep(0.01)
        app.state.tapc.save.close()
    m = Manifest.read(folder)
    assert m.complete and not m.failed and m.settings["source"] == {"kind": "server"}
    shards = Shards(folder)
    assert torch.cat([shards.load("request", i) for i in range(len(m.shards))]).unique().tolist() == \
        list(range(len(sent))), "every number once, none for the failed response"
    for n, (prompt, tokens, ask) in enumerate(sent):
        rows = shards.request(n)
        seq = prompt + tokens[:-1]
        assert rows["token_ids"].tolist() == seq and rows["position"].tolist() == list(range(len(seq)))
        # the plan captures layer 1's residual before its steering (plan order), later layers after
        edits = [(1, torch.from_numpy(steer), 2.0, "all")] if "params" in ask else ()
        before = {"model.layers.0.resid", "model.layers.1.resid"}
        check_rows(as_req(prompt, tokens), {k: rows[k] for k in m.keys if k in before}, "all")
        check_rows(as_req(prompt, tokens), {k: rows[k] for k in m.keys if k not in before}, "all", edits)
    with pytest.raises(TapcError, match=f"request {len(sent)} has no rows in"):
        shards.request(len(sent))
    again = SaveFolder(toy_plan(TAPS), **save)
    assert again.number() == len(sent), "a server started again numbers on after the folder's last request"
    again.close()   # that number never reached the writer: listed, not waited for
    lost = {"request": len(sent), "error": "the server stopped before its captures were collected"}
    assert Manifest.read(folder).failed == [lost]
    third = SaveFolder(toy_plan(TAPS), **save)
    assert third.number() == len(sent) + 1, "a number given out before is not given again"
    third.close()
    assert Manifest.read(folder).failed == [lost, {**lost, "request": len(sent) + 1}], "earlier failures stay listed"
    with pytest.raises(TapcError, match="it failed: the server stopped before its captures were collected"):
        Shards(folder).request(len(sent))


def test_with_kept_prefix_rows_a_capture_of_prompt_rows_shares_the_cache():
    """Without kept rows a capture of prompt rows gets a salt of its own (the server cannot set
    `skip_reading_prefix_cache`); with them (`prefix_rows_gib`), none: the engine's lookup lets
    it read the cache as far as the rows go. A steered one keeps its steering's salt."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for rows, salted_apart in ((False, True), (True, False)):
        app, _ = stand_in_app(prefix_rows=rows)
        with client(app) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "vllm_xargs": xargs(capture="*")})
            assert r.status_code == 200
            assert ("cache_salt" in app.state.seen[-1]) == salted_apart
            assert fetch(c, r.headers["x-tapc-id"])
    v = np.linspace(0, 1, HIDDEN).tolist()
    app, _ = stand_in_app(prefix_rows=True)
    with client(app) as c:
        for _ in range(2):
            c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                            "vllm_xargs": xargs(capture="*", params={"steer": v})})
    assert app.state.seen[-1]["cache_salt"] == app.state.seen[-2]["cache_salt"], "identical steering shares"
