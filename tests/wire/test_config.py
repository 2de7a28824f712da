"""The engine's config: one typed value under vLLM's `additional_config["tapc"]`, built in one
place for `VLLM`, `AsyncVLLM` and `tapc serve`, and read back by the worker and the server."""
import dataclasses
import json
import random
import string

import pytest
from places import CONFIGS
from engine_toy import over_the_wire

from tapc.errors import ProtocolError
from tapc.wire.config import VERSION, EngineConfig

LLAMA = str(CONFIGS / "llama")
TAPS = ["model.layers.*.resid", "model.layers.1.resid | add(steer)"]


def text(rng: random.Random) -> str:
    return "".join(rng.choice(string.printable) for _ in range(rng.randrange(1, 40)))


def maybe(rng: random.Random, value):
    return value if rng.random() < 0.5 else None


def random_config(rng: random.Random) -> EngineConfig:
    return EngineConfig(
        plan=json.dumps({"taps": [text(rng) for _ in range(rng.randrange(4))]}), graph_digest=f"{rng.getrandbits(64):016x}",
        api_shm=maybe(rng, text(rng)), rings=rng.random() < 0.5, capture_memory=rng.randrange(1 << 40),
        capture_keep=maybe(rng, rng.randrange(1 << 40)), prefix_rows=rng.randrange(1 << 32),
        functions=maybe(rng, text(rng)), spec=maybe(rng, text(rng)),
        blocks={text(rng): text(rng) for _ in range(rng.randrange(3))},
        save=maybe(rng, {"folder": text(rng), "shard_tokens": rng.randrange(1, 1 << 30),
                         "positions": rng.choice(["all", "last", [rng.randrange(9) for _ in range(3)]])}))


@pytest.mark.parametrize("seed", range(20))
def test_the_config_comes_back_equal_from_each_form_it_travels_in(seed):
    """As vLLM's arguments carry it (a dict), as its processes get it (msgpack), as `vllm serve`
    is given it (JSON text), and as `additional_config` holds it beside the user's own keys."""
    config = random_config(random.Random(seed))
    assert EngineConfig.from_wire(config.to_wire()) == config
    assert EngineConfig.from_wire(over_the_wire(config.to_wire())) == config
    additional = config.into({"mine": 1})
    assert additional["mine"] == 1 and EngineConfig.read(additional) == config
    assert EngineConfig.read(json.dumps(additional)) == config


def test_an_engine_tapc_did_not_start_has_no_config():
    assert EngineConfig.read(None) is None and EngineConfig.read({}) is None and EngineConfig.read({"mine": 1}) is None


def test_another_version_is_refused_in_one_line():
    d = random_config(random.Random(0)).to_wire()
    for version in (VERSION + 1, None, "1"):
        with pytest.raises(ProtocolError) as refused:
            EngineConfig.from_wire({**d, "version": version})
        assert str(refused.value) == (f"tapc engine config of version {version!r}, but this tapc reads version "
                                      f"{VERSION}: the engine was started by another tapc version")
    with pytest.raises(ProtocolError, match="^tapc engine config of version None"):
        EngineConfig.from_wire({k: v for k, v in d.items() if k != "version"})


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineConfig) if f.name != "version"])
def test_a_missing_or_mistyped_field_is_named(name):
    d = random_config(random.Random(1)).to_wire()
    with pytest.raises(ProtocolError, match=f"^tapc engine config: no field '{name}'$"):
        EngineConfig.from_wire({k: v for k, v in d.items() if k != name})
    with pytest.raises(ProtocolError, match=f"^tapc engine config: field '{name}' is a "):
        EngineConfig.from_wire({**d, name: object()})


# each field, changed: the graph-affecting ones (plan, code digest, rings, functions) first
CHANGED = {"plan": '{"taps": ["other"]}', "graph_digest": "0" * 16, "rings": True, "functions": "/other.pkl",
           "api_shm": "boot:1:2", "capture_memory": 1, "capture_keep": 0, "prefix_rows": 1, "spec": "/s.yaml",
           "blocks": {"f": "m:f"}, "save": {"folder": "/acts"}}


def vllm_key(additional_config: dict) -> str:
    """What vLLM hashes of `additional_config` into its compile-cache key (`VllmConfig.compute_hash`)."""
    return json.dumps(additional_config, sort_keys=True)


def test_every_field_changes_vllms_compile_cache_key():
    """vLLM hashes the whole config into its compile-cache key (as sorted JSON): a change to any
    field, the plan, the code in the graphs, rings or the functions first, is a new key."""
    assert set(CHANGED) == {f.name for f in dataclasses.fields(EngineConfig)} - {"version"}
    base = EngineConfig(plan='{"taps": []}', graph_digest="f" * 16)
    for name, value in CHANGED.items():
        changed = dataclasses.replace(base, **{name: value})
        assert vllm_key(changed.into({})) != vllm_key(base.into({})), name
    assert vllm_key(base.into({})) == vllm_key(EngineConfig(plan='{"taps": []}', graph_digest="f" * 16).into({})), \
        "stable"


def test_vllm_and_tapc_serve_start_engines_with_equal_configs(monkeypatch, tmp_path):
    """`VLLM(...)` and `tapc serve` build their engines through one builder (tapc/api/engine.py):
    equal inputs, equal configs, and the server's session reads the same plan back."""
    import tapc.api.llm as llm
    from tapc.api.engine import Engine
    from tapc.serving.launch import serve_argv

    monkeypatch.setattr(llm, "require_cuda", lambda: None)
    engine = {"max_num_seqs": 16, "capture_memory_gib": 0.5, "capture_memory_keep_gib": 1, "prefix_rows_gib": 0.25}
    plan, session, args = llm.setup(LLAMA, TAPS, None, None, "float32", engine)
    argv = serve_argv(LLAMA, TAPS, capture_dtype="float32", engine=engine)
    served = EngineConfig.read(argv[argv.index("--additional-config") + 1])
    config = EngineConfig.read(args["additional_config"])
    assert served == config and vllm_key(served.into({})) == vllm_key(config.into({}))
    assert (config.capture_memory, config.capture_keep, config.prefix_rows) == (1 << 29, 1 << 30, 1 << 28)
    server = Engine.read(config.into(None))
    assert server.plan == plan
    assert session.prefix.rows_kept is server.session(None, {}, prefix_caching=True).prefix.rows_kept is True
    again = serve_argv(LLAMA, TAPS, capture_dtype="float32", engine=engine)
    assert EngineConfig.read(again[again.index("--additional-config") + 1]) == config, "stable for equal inputs"
