"""One tapped engine as its caller's side builds it, for `VLLM`, `AsyncVLLM` and `tapc serve`
alike: the plan, the `EngineConfig` its processes read (tapc/wire/config.py), vLLM's engine
arguments that carry it (engine_args.py), the compiled functions shipped to the workers; and the
session that checks requests against it, built the same way where the config was read back
(`vllm serve`'s API server, tapc/serving/http.py).
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tapc import settings
from tapc.api.engine_args import engine_kwargs
from tapc.api.session import TapSession
from tapc.plan.calls import pickled, pickled_once
from tapc.plan.planner import build_plan
from tapc.plan.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from tapc.plan.tapplan import TapPlan
from tapc.wire.config import EngineConfig


@dataclass(frozen=True)
class Engine:
    """A tapped engine's plan and config."""

    plan: TapPlan
    config: EngineConfig

    @classmethod
    def build(cls, model: str, taps: Sequence[str], kwargs: dict, *, capture_dtype: str | None = None,
              functions: dict | None = None, **fields) -> tuple[Engine, dict]:
        """The engine of `model` with `taps` and the user's engine arguments `kwargs`, and vLLM's
        engine arguments that start it (no GPU needed). `functions`: compiled functions by name,
        shipped to the workers; `fields`: more of the config's (a server's spec, blocks, save)."""
        with pickled_once():
            plan, kwargs = plan_for(model, taps, capture_dtype, kwargs, functions)
            if plan.functions:
                fields["functions"] = str(ship_functions(plan, functions))
            args, config = engine_kwargs(plan, kwargs, **fields)
        return cls(plan, config), args

    @classmethod
    def read(cls, additional_config) -> Engine | None:
        """The engine a vLLM process was started with, from its `additional_config` (None: tapc
        did not start it)."""
        config = EngineConfig.read(additional_config)
        return None if config is None else cls(TapPlan.from_json(config.plan), config)

    def session(self, params: dict | None, blocks, *, prefix_caching: bool,
                max_model_len: int | None = None) -> TapSession:
        """The session of this engine's requests: engine-wide `params` and `blocks` (names) checked
        against the plan; `prefix_caching`: whether vLLM's prefix cache is on."""
        return TapSession(self.plan, params, blocks or {}, prefix_rows=bool(self.config.prefix_rows),
                          max_model_len=max_model_len, prefix_caching=prefix_caching)


def plan_for(model: str, taps: Sequence[str], capture_dtype: str | None, kwargs: dict,
             functions: dict | None = None) -> tuple[TapPlan, dict]:
    """The plan of an engine with vLLM arguments `kwargs` (no GPU needed), and those arguments
    with the batch sizes the plan is built for."""
    kwargs = dict(kwargs)
    kwargs.setdefault("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
    kwargs.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    plan = build_plan(model, list(taps), max_num_batched_tokens=kwargs["max_num_batched_tokens"],
                      max_num_seqs=kwargs["max_num_seqs"], capture_dtype=capture_dtype, engine_args=kwargs,
                      functions=functions)
    return plan, kwargs


def ship_functions(plan: TapPlan, functions: dict) -> Path:
    """The plan's compiled functions pickled by value (code, closures, a module's weights) into a
    file of tapc's cache named by the plan's digest, which covers their code: every worker
    process loads them from there before vLLM traces the model (worker.py). Within
    `pickled_once`, the pickles the plan's hash was made from."""
    path = settings.TAPC_CACHE / "functions" / f"{plan.digest}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps({f.name: pickled(functions[f.name]) for f in plan.functions}))
    tmp.replace(path)
    return path
