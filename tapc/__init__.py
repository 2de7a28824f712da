"""tapc: a declarative tap compiler for vLLM.

Tap strings -> tap specs (`tapc.spec`) -> a `TapPlan` against vLLM's module tree
(`tapc.plan`) -> an engine with the taps compiled into its graphs (`tapc.engine`, `tapc.api`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

from tapc.errors import TapcError

__all__ = ["TapcError", "VLLM"]


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """From a source checkout, find `tapc.kernels` / `tapc.grammar` in the top-level folders.

    The design card keeps Triton kernels in `kernels/` and the grammar in `grammar/`; an
    installed tapc carries them as `tapc/kernels` and `tapc/grammar` (pyproject's package-dir).
    """

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.rpartition(".")
        if pkg != "tapc" or name not in ("kernels", "grammar"):
            return None
        folder = self.root / name
        if not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


_here = Path(__file__).resolve().parent
if not (_here / "kernels").is_dir():
    sys.meta_path.append(_SourceTreeFinder(_here.parent))


def __getattr__(name):
    # `VLLM` pulls in vLLM and torch: only on first use, so that `tapc explain` stays light.
    if name == "VLLM":
        from tapc.api import VLLM

        return VLLM
    raise AttributeError(f"module 'tapc' has no attribute {name!r}")
