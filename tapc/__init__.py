"""tapc: a declarative tap compiler for vLLM.

Tap strings -> tap specs (`tapc.lang`) -> a `TapPlan` against vLLM's module tree (`tapc.plan`)
-> an engine with the taps compiled into its graphs (`tapc.api` in the caller's process, `tapc.worker`
inside vLLM's workers, `tapc.wire` between them). docs/architecture.md walks the route.
`tapc.vllm_surface` names every vLLM internal tapc touches (docs/internals/vllm.md).
"""
from __future__ import annotations

from tapc.errors import TapcError
from tapc.lang.blocks import batched
from tapc.lang.functions import Batch, function

__all__ = ["AsyncVLLM", "Batch", "TapRequest", "TapcError", "VLLM", "batched", "function"]


def __getattr__(name):
    # The engines pull in vLLM and torch: only on first use, so that `tapc explain` stays light.
    if name == "VLLM":
        from tapc.api.llm import VLLM

        return VLLM
    if name == "AsyncVLLM":
        from tapc.api.async_llm import AsyncVLLM

        return AsyncVLLM
    if name == "TapRequest":
        from tapc.api.requests import TapRequest

        return TapRequest
    raise AttributeError(f"module 'tapc' has no attribute {name!r}")
