"""One root for every error tapc raises on purpose; one subclass per stage."""
from __future__ import annotations


class TapcError(Exception):
    """Root of tapc's own errors: bad taps, bad specs, plans an engine cannot run."""


class TapSyntaxError(TapcError, ValueError):
    """A tap string that does not parse. The message shows the tap and a caret."""

    def __init__(self, message: str, tap: str, column: int | None = None):
        super().__init__(message)
        self.tap = tap
        self.column = column


class SpecError(TapcError, ValueError):
    """A YAML spec (or its values) that is malformed: unknown keys, wrong types, missing files."""


class ResolveError(TapcError, LookupError):
    """A tap that names a module path, `.source` op or element the model does not have."""


class PlanError(TapcError, ValueError):
    """Taps that parse and resolve but cannot be planned together (duplicates, illegal edits)."""


class EngineError(TapcError, RuntimeError):
    """The engine cannot serve a tap as asked (runner not instrumented, wrong parallel sizes, ...)."""


class ProtocolError(EngineError):
    """A message between tapc's API side and the engine's worker that this side cannot read:
    another protocol version (two tapc versions), or a missing or mistyped field."""


class RequestError(TapcError, ValueError):
    """One request asked for something the engine's plan does not have; only that request fails."""


class BlockFailed(TapcError, RuntimeError):
    """A Python block raised an exception that could not be carried back as itself."""
