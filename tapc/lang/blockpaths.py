"""Python blocks and compiled functions named by import path, `package.module:function`: how a
spec (`blocks:`, `functions:`) and `tapc serve --block/--function` name them, so that no code
travels with a request or a plan; the engine imports them where they run. No torch here:
`tapc explain` checks a spec's paths without it."""
from __future__ import annotations

import importlib
from collections.abc import Callable

from tapc.errors import TapcError

FORM = "'package.module:function'"


def split_path(path) -> tuple[str, str] | None:
    """(module, attribute) of a block path, or None where it is not of the form FORM."""
    if not isinstance(path, str) or path.count(":") != 1:
        return None
    module, attr = path.split(":")
    return (module, attr) if module and attr else None


def import_blocks(paths: dict[str, str], where: str, what: str = "block") -> dict[str, Callable]:
    """The functions `paths` names, by block name (`what`: "function" for compiled functions).
    Errors name the block, the path and what failed."""
    out = {}
    for name, path in paths.items():
        parts = split_path(path)
        if parts is None:
            raise TapcError(f"{where}: {what} {name!r} is {path!r}; name it as {FORM}")
        module, attr = parts
        try:
            fn = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except ImportError as e:
            raise TapcError(f"{where}: {what} {name!r} ({path}): cannot import {module!r}: {e}") from None
        except AttributeError:
            raise TapcError(f"{where}: {what} {name!r} ({path}): {module!r} has no {attr!r}") from None
        if not callable(fn):
            raise TapcError(f"{where}: {what} {name!r} ({path}) is a {type(fn).__name__}, not a function")
        out[name] = fn
    return out
