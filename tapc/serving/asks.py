"""A request's taps as an HTTP client sends them: JSON text in `vllm_xargs["tapc"]` (vLLM's
`vllm_xargs` carries strings, numbers and lists only), e.g.

    {"capture": ["model.layers.3.resid"], "positions": "generated", "params": {"steer": "happy", "alpha": 4.0}}

`capture` and `positions` as in `TapRequest`; in `params` a string names a vector registered
on the server (`POST /v1/tapc/vectors`), a number or a list of numbers is the value itself;
`inline: true` brings the results back in the response itself (http.py) rather than from the
results route. No code: blocks are named in the server's plan, never sent.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from tapc.engine.requests import TapRequest
from tapc.errors import RequestError

FIELDS = ("capture", "positions", "params", "inline")


def parse_ask(text, vectors: Mapping, where: str) -> tuple[TapRequest, bool]:
    """`vllm_xargs["tapc"]` as a TapRequest (checked against the plan later, by the session)
    and whether its results go inline."""
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
    inline = d.get("inline", False)
    if not isinstance(inline, bool):
        raise RequestError(f"{where}: vllm_xargs.tapc inline must be true or false, got {inline!r}")
    return TapRequest(capture=d.get("capture", ()), positions=d.get("positions", "all"), params=bound), inline
