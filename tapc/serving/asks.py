"""A request's taps as an HTTP client sends them: JSON text in `vllm_xargs["tapc"]` (vLLM's
`vllm_xargs` carries strings, numbers and lists only), e.g.

    {"capture": ["model.layers.3.resid"], "positions": "generated", "params": {"steer": "happy", "alpha": 4.0}}

`capture` and `positions` as in `TapRequest`; in `params` a string names a vector registered
on the server (`POST /v1/tapc/vectors`), a number or a list of numbers is the value itself;
`inline: true` brings the results back in the response itself (http.py) rather than from the
results route; `save: true` writes them to the server's save folder (saving.py). No code:
blocks are named in the server's plan, never sent.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from tapc.api.requests import TapRequest
from tapc.errors import RequestError

FIELDS = ("capture", "positions", "params", "inline", "save")


@dataclass(frozen=True)
class HttpAsk:
    """`request` (checked against the plan later, by the session); whether its results go
    `inline` or are `save`d; the fields the client `given`."""

    request: TapRequest
    inline: bool = False
    save: bool = False
    given: frozenset = frozenset()


def parse_ask(text, vectors: Mapping, where: str) -> HttpAsk:
    """`vllm_xargs["tapc"]` as an HttpAsk."""
    if not isinstance(text, str):
        raise RequestError(f"{where}: vllm_xargs.tapc must be a JSON string (vLLM's vllm_xargs holds strings, "
                           f"numbers and lists), got a {type(text).__name__}")
    try:
        d = json.loads(text)
    except ValueError as e:
        raise RequestError(f"{where}: vllm_xargs.tapc is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise RequestError(f"{where}: vllm_xargs.tapc must be a JSON object with {', '.join(FIELDS)}")
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
        raise RequestError(f"{where}: vllm_xargs.tapc has unknown field(s) {', '.join(unknown)}; it takes "
                           f"{', '.join(FIELDS)}")
    params = d.get("params", {})
    if not isinstance(params, dict):
        raise RequestError(f"{where}: vllm_xargs.tapc params must be an object of name -> value")
    bound = {}
    for name, value in params.items():
        if isinstance(value, str):
            if value not in vectors:
                known = ", ".join(sorted(vectors)) or "none yet"
                raise RequestError(f"{where}: parameter {name!r} names vector {value!r}, which is not registered "
                                   f"(POST /v1/tapc/vectors; registered: {known})")
            value = vectors[value]
        bound[name] = value
    flags = {}
    for flag in ("inline", "save"):
        flags[flag] = d.get(flag, False)
        if not isinstance(flags[flag], bool):
            raise RequestError(f"{where}: vllm_xargs.tapc {flag} must be true or false, got {flags[flag]!r}")
    if flags["inline"] and flags["save"]:
        raise RequestError(f"{where}: vllm_xargs.tapc asks for its results inline and saved; ask for one")
    request = TapRequest(capture=d.get("capture", ()), positions=d.get("positions", "all"), params=bound)
    return HttpAsk(request, flags["inline"], flags["save"], frozenset(d))
