"""tapc: a declarative tap compiler for vLLM.

Tap strings -> tap specs (`tapc.spec`) -> a `TapPlan` against vLLM's module tree
(`tapc.plan`) -> an engine with the taps compiled into its graphs (`tapc.engine`, `tapc.api`).
"""
from __future__ import annotations

from pathlib import Path

from tapc.errors import TapcError

__all__ = ["AsyncVLLM", "TapcError", "VLLM"]


# From a source checkout, `tapc.kernels` and `tapc.grammar` are the top-level folders `kernels/`
# and `grammar/` (an installed tapc carries them as tapc/kernels and tapc/grammar: pyproject's
# package-dir). The package's own search path reaches them: no import hook, nothing process-wide.
_here = Path(__file__).resolve().parent
if not (_here / "kernels").is_dir():
    __path__.append(str(_here.parent))


def __getattr__(name):
    # The engines pull in vLLM and torch: only on first use, so that `tapc explain` stays light.
    if name == "VLLM":
        from tapc.api import VLLM

        return VLLM
    if name == "AsyncVLLM":
        from tapc.async_engine import AsyncVLLM

        return AsyncVLLM
    raise AttributeError(f"module 'tapc' has no attribute {name!r}")
