"""Every environment variable tapc reads, in one place (as vLLM's `envs.py` keeps its own).

Each is read when asked for (`settings.TAPC_RINGS`), not at import, so a test or a launcher
that sets one before starting an engine is heard. A value tapc cannot use is refused with a
one-line error that names the variable.

- `TAPC_CACHE`: the folder for cached module trees and vLLM's names (default ~/.cache/tapc).
- `TAPC_SHM_DIR`: the tmpfs folder of the shared-memory arena captures come back through
  (default /dev/shm; tapc/wire/arena.py).
- `TAPC_RINGS`: "0" turns rings off (steady decode steps writing several steps' rows before one
  copy-out, tapc/worker/rings.py). Read in the API process; the choice reaches the
  workers in the engine's config (wire/config.py), which vLLM hashes into its compile-cache key.
- `TAPC_SWITCH_GRAPHS`: "0" turns the switch off (tapc/worker/switch.py): every tap kernel then
  runs at every replay, whether the step asks for it or not.
- `TAPC_STAGING_DIR`: the local folder where a harvest bound for object storage writes each part
  before it goes up (default: the system's temporary folder; tapc/harvest/store.py).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from tapc.errors import TapcError


def _flag(name: str) -> bool:
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise TapcError(f"{name}={value!r}: 1 (the default) or 0")
    return value == "1"


environment_variables: dict[str, Callable[[], Any]] = {
    "TAPC_CACHE": lambda: Path(os.environ.get("TAPC_CACHE") or Path.home() / ".cache" / "tapc"),
    "TAPC_SHM_DIR": lambda: os.environ.get("TAPC_SHM_DIR") or "/dev/shm",
    "TAPC_RINGS": lambda: _flag("TAPC_RINGS"),
    "TAPC_SWITCH_GRAPHS": lambda: _flag("TAPC_SWITCH_GRAPHS"),
    "TAPC_STAGING_DIR": lambda: Path(os.environ.get("TAPC_STAGING_DIR") or Path(tempfile.gettempdir()) / "tapc-staging"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
