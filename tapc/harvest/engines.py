"""Engine factories for a harvest over many engines (tapc/harvest/cluster.py): plain data,
shipped to each actor, with two calls.

- `plan()`: the engine's tap plan, built where the harvest is driven (no GPU: `tapc explain`
  builds the same), so that the folder's settings are checked before any engine starts;
- a call: the tapped engine (`tapc.VLLM`), made in each actor, on the GPUs Ray gave it.

The tests build the toy engine (tests/support/engine_toy.py) through a factory of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecEngine:
    """The engine of a YAML spec (`tapc.VLLM.from_spec`). `spec`: its path, or a loaded `Spec`
    (its model, and its parameters' files, must be at the same paths where the actors run)."""

    spec: object

    def __post_init__(self):
        from tapc.lang.specfile import load_spec

        if not hasattr(self.spec, "taps"):   # a path: loaded here, so a bad spec is said at once
            object.__setattr__(self, "spec", load_spec(self.spec))

    def plan(self):
        from tapc.api.specs import spec_plan

        return spec_plan(self.spec)

    def __call__(self):
        from tapc.api.llm import VLLM

        return VLLM.from_spec(self.spec)


@dataclass(frozen=True)
class ModelEngine:
    """`tapc.VLLM(model, taps, **kwargs)`."""

    model: str
    taps: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)

    def plan(self):
        from tapc.api.engine import plan_for

        tapc_args = ("blocks", "params", "capture_dtype", "functions")   # VLLM's own, not vLLM's
        vllm_args = {k: v for k, v in self.kwargs.items() if k not in tapc_args}
        return plan_for(self.model, list(self.taps), self.kwargs.get("capture_dtype"), vllm_args,
                        self.kwargs.get("functions"))[0]

    def __call__(self):
        from tapc.api.llm import VLLM

        return VLLM(self.model, list(self.taps), **self.kwargs)
