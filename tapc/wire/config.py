"""What a tapped engine is started with: `EngineConfig`, the one value under vLLM's
`additional_config["tapc"]`. It reaches every process vLLM starts (the engine core, each worker,
`vllm serve`'s API servers), which read it back with `EngineConfig.read`.

vLLM hashes `additional_config` into its compile-cache key (`VllmConfig.compute_hash`, the
whole dict as sorted JSON), so everything here that changes the graphs (the plan, the digest of
the code that runs inside them, rings, the compiled functions) keeps stale graphs from being
reused; the rest is hashed as well, which costs a recompile and nothing else. The plan travels
as its JSON text, so that this side imports no plan. A change to what a field means, or a field
added or removed, bumps `VERSION`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from tapc.errors import ProtocolError
from tapc.wire.protocol import wire_field

VERSION = 1
KEY = "tapc"   # its key in additional_config
WHAT = "tapc engine config"


@dataclass(frozen=True)
class EngineConfig:
    """A tapped engine's settings, as its API side made them (tapc/api/engine.py)."""

    plan: str                         # the plan's JSON (TapPlan.to_json)
    graph_digest: str                 # of the plan and the code that runs inside the graphs (api/engine_args.py)
    api_shm: str | None = None        # the API's shared memory (node.py); None: it could not read its own
    rings: bool = False               # the capture ops read the runner's positions (worker/rings.py)
    capture_memory: int = 0           # bytes of captures each worker pins at start (capture_memory_gib)
    capture_keep: int | None = None   # bytes each worker keeps once idle (capture_memory_keep_gib); None: all
    prefix_rows: int = 0              # bytes of kept rows of cached prompt blocks (prefix_rows_gib)
    functions: str | None = None      # the file of the plan's pickled compiled functions
    spec: str | None = None           # a server's spec, where its engine-wide parameters come from
    blocks: Mapping[str, str] = field(default_factory=dict)   # a server's blocks, by import path
    save: Mapping | None = None       # a server's save folder (serving/saving.py SaveFolder's arguments)
    version: int = VERSION

    def to_wire(self) -> dict:
        d = asdict(self)
        d["blocks"], d["save"] = dict(self.blocks), None if self.save is None else dict(self.save)
        return d

    @classmethod
    def from_wire(cls, d) -> "EngineConfig":
        """The config of its wire form; another version, or a missing or mistyped field, is a
        ProtocolError in one line."""
        if not isinstance(d, Mapping):
            raise ProtocolError(f"{WHAT}: expected a dict, got a {type(d).__name__}")
        if d.get("version") != VERSION:
            raise ProtocolError(f"{WHAT} of version {d.get('version')!r}, but this tapc reads version {VERSION}: "
                                "the engine was started by another tapc version")
        return cls(**{name: wire_field(d, name, types, WHAT) for name, types in _TYPES.items()})

    @classmethod
    def read(cls, additional_config) -> "EngineConfig | None":
        """The config in vLLM's `additional_config` (a dict, or the JSON text `vllm serve` was
        given, which vLLM's parser checked), or None where it holds none (an engine tapc did not
        start)."""
        if isinstance(additional_config, str):
            additional_config = json.loads(additional_config)
        d = (additional_config or {}).get(KEY)
        return None if d is None else cls.from_wire(d)

    def into(self, additional_config: Mapping | None) -> dict:
        """vLLM's `additional_config` with this config in it, the user's own keys kept."""
        return {**(additional_config or {}), KEY: self.to_wire()}


_OPTIONAL_STR = (str, type(None))
_TYPES = {"plan": str, "graph_digest": str, "api_shm": _OPTIONAL_STR, "rings": bool, "capture_memory": int,
          "capture_keep": (int, type(None)), "prefix_rows": int, "functions": _OPTIONAL_STR, "spec": _OPTIONAL_STR,
          "blocks": Mapping, "save": (Mapping, type(None)), "version": int}
