"""YAML specs (tapc.lang.specfile) turned into what the engine and `tapc explain` need."""
from __future__ import annotations

from tapc.api.requests import check_engine_params
from tapc.errors import ResolveError, SpecError
from tapc.lang.blockpaths import import_blocks
from tapc.lang.specfile import Spec
from tapc.plan.planner import build_plan
from tapc.plan.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from tapc.plan.tapplan import TapPlan
from tapc.plan.modeldir import config_path


def spec_plan(spec: Spec) -> TapPlan:
    """The spec's plan, with its `params:` checked as the engine will check them (the engine's
    own checker) and its blocks imported as `VLLM.from_spec` imports them, so that `tapc explain`
    refuses what the GPU machine would."""
    try:
        config_path(spec.model)   # here, so that a model that is not one names the spec and its key
    except ResolveError as e:
        raise SpecError(f"{spec.path}: model: {e}") from None
    import_blocks(spec.blocks, f"{spec.path}: blocks")
    for tap in spec.taps:   # a spec's engine has only its own blocks (a harvest, `tapc serve`)
        if tap.action.block is not None and tap.action.block not in spec.blocks:
            raise SpecError(f"{spec.path}: taps[{tap.line - 1}] `{tap.text}` runs block `{tap.action.block}`, which "
                            f"`blocks:` does not name (give it as {tap.action.block}: 'package.module:function')")
    engine = spec.engine
    plan = build_plan(spec.model, spec.taps, capture_dtype=spec.capture.dtype,
                      max_num_batched_tokens=int(engine.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)),
                      max_num_seqs=int(engine.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)), engine_args=engine,
                      functions=spec_functions(spec))
    if spec.params:
        check_engine_params(plan, spec.param_values(), f"{spec.path}: params")
    return plan


def spec_functions(spec: Spec) -> dict:
    """The spec's compiled functions, imported (the plan traces them on the CPU)."""
    return import_blocks(spec.functions, f"{spec.path}: functions", what="function")
