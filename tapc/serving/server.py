"""The server's side of tapped requests over HTTP, without the HTTP: the endpoint plugin
(http.py) calls it around vLLM's own completion handlers.

- `admit(body)`: a `/v1/completions` or `/v1/chat/completions` JSON body with
  `vllm_xargs["tapc"]` (asks.py) is checked against the plan (`RequestError`: HTTP 400 with
  the same words), given its tapc id and its wire (`WireRequest.to_text`, in `vllm_xargs`,
  whence vLLM copies it into `SamplingParams.extra_args`), its `cache_salt` (tapc/prefix.py;
  a capture of prompt rows gets a salt of its own, since `skip_reading_prefix_cache` cannot be
  set through the OpenAI API) and, when streamed, `stream_options.include_usage` (the usage
  chunk tells the server how many tokens the request has).
- `finished(tid, usage)`: after the response went out: the result is collected (batched,
  async_engine.Collector) and assembled, and kept until the client fetches it.
- `abandoned(tid)`: the response did not complete (the client went away, an error): what the
  request held on the workers goes back.
- `fetch(tid)`: a finished request's captures as safetensors bytes, once.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace as NS

import numpy as np

from tapc.async_engine import Collector
from tapc.engine.protocol import WireRequest
from tapc.errors import RequestError
from tapc.prefix import salted
from tapc.serving.asks import parse_ask
from tapc.session import TapSession


@dataclass
class Stored:
    """A finished request's results, until fetched."""

    taps: dict
    saved: dict
    error: BaseException | None
    at: float = field(default_factory=time.monotonic)


class TapcServer:
    """`engine`: vLLM's engine client (its `collective_rpc`); `session`: the plan's session."""

    def __init__(self, engine, session: TapSession, keep_s: float = 600.0):
        self.session = session
        self.collector = Collector(engine, session)
        self.vectors: dict[str, np.ndarray] = {}
        self.running: dict[str, tuple[WireRequest, asyncio.Event]] = {}
        self.results: dict[str, Stored] = {}
        self.keep_s = keep_s       # results not fetched within this long are dropped

    # ---------------------------------------------------------------- requests

    def admit(self, body: dict, where: str) -> tuple[dict, str | None]:
        """The body vLLM must see, and the request's tapc id (None: it runs untapped)."""
        xargs = body.get("vllm_xargs") or {}
        raw = xargs.get("tapc")
        ask = parse_ask(raw, self.vectors, where) if raw is not None else None
        checked = self.session.check(ask, where)
        if checked is None:
            return body, None
        if body.get("n", 1) != 1:
            raise RequestError(f"{where}: taps with n={body['n']} choices are not supported; send the request "
                               "several times instead")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt) and len(prompt) != 1:
            raise RequestError(f"{where}: a tapped completion takes one prompt, got {len(prompt)}")
        wire = WireRequest(uuid.uuid4().hex, checked)
        use = self.session.prefix.use(checked, wire.id)
        salt = use.salt or (self.session.prefix.unique(wire.id) if use.skip_read else None)
        # a request body carries `cache_salt` as a prompt dict does: the same rule adds ours
        body = salted({**body, "vllm_xargs": {**xargs, "tapc": wire.to_text()}}, salt)
        if body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        self.running[wire.id] = (wire, asyncio.Event())
        return body, wire.id

    async def finished(self, tid: str, usage: dict | None) -> None:
        """The response of `tid` went out whole; `usage` is its usage object."""
        wire, done = self.running.pop(tid)
        try:
            if not usage or "prompt_tokens" not in usage or "completion_tokens" not in usage:
                self.collector.drop(tid)
                error = RequestError(f"request {tid}: its response carried no usage, so its rows cannot be counted")
                self._store(tid, Stored({}, {}, error))
                return
            result = await self.collector.result(tid)
            # What assembly reads of vLLM's output: how many prompt and generated tokens there were.
            out = NS(request_id=tid, prompt_token_ids=range(usage["prompt_tokens"]),
                     outputs=[NS(token_ids=range(usage["completion_tokens"]))])
            self.session.finish(out, wire, result)
            self._store(tid, Stored(dict(out.taps), out.saved, out.error))
        finally:
            done.set()

    def abandoned(self, tid: str) -> None:
        """The response of `tid` did not complete: vLLM aborted the request; free what it held."""
        if self.running.pop(tid, None) is None:
            return
        self.collector.drop(tid)
        self._store(tid, Stored({}, {}, RequestError(f"request {tid}: its response did not complete (aborted); "
                                                     "its taps are dropped")))

    async def fetch(self, tid: str, wait_s: float) -> Stored | None:
        """The results of `tid` (waiting up to `wait_s` for a request still running), once; None:
        unknown (never tapped, fetched already, or dropped after `keep_s`)."""
        if tid in self.running:
            try:
                await asyncio.wait_for(asyncio.shield(self.running[tid][1].wait()), wait_s)
            except asyncio.TimeoutError:
                return None
        return self.results.pop(tid, None)

    def _store(self, tid: str, stored: Stored) -> None:
        cutoff = time.monotonic() - self.keep_s
        for old in [t for t, s in self.results.items() if s.at < cutoff]:
            del self.results[old]
        self.results[tid] = stored

    # ---------------------------------------------------------------- vectors

    def register(self, name: str, values) -> int:
        """A named vector requests may refer to (asks.py); its width is checked where it is used."""
        if not isinstance(name, str) or not name:
            raise RequestError("a vector needs a non-empty string name")
        try:
            v = np.asarray(values, dtype=np.float32)
        except (TypeError, ValueError):
            raise RequestError(f"vector {name!r}: values must be a list of numbers") from None
        if v.ndim != 1 or v.size == 0 or not np.isfinite(v).all():
            raise RequestError(f"vector {name!r}: values must be a non-empty list of finite numbers")
        self.vectors[name] = v
        return int(v.size)


def encode(stored: Stored) -> tuple[bytes, list]:
    """A request's results in the safetensors format, as its header and the tensors whose bytes
    follow it in that order: each capture under its key, each saved tensor under
    `saved/<name>/<i>`; the metadata holds `error` and the saved values that are not tensors
    (JSON). The response streams the tensors' own bytes (`tensor_bytes`): a capture of every
    layer over a long prompt is gigabytes, which one `bytes` would hold twice and copy on the
    server's event loop."""
    import torch

    tensors = dict(stored.taps)
    other = {}
    for name, values in stored.saved.items():
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                tensors[f"saved/{name}/{i}"] = v.detach().cpu()
            else:
                other.setdefault(name, {})[str(i)] = v
    meta = {"error": "" if stored.error is None else str(stored.error), "saved": json.dumps(other, default=repr)}
    header, offset, names = {"__metadata__": meta}, 0, _dtype_names()
    for name, t in tensors.items():
        if t.dtype not in names:
            raise RequestError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the format's alignment of the data that follows
    return len(text).to_bytes(8, "little") + text, list(tensors.values())


def tensor_bytes(t) -> memoryview:
    """A CPU tensor's bytes in row-major order: its own memory when it is contiguous, else a
    copy (a capture that shares its storage rows with others of its group is strided)."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _dtype_names() -> dict:
    """torch dtype -> its name in a safetensors header."""
    import torch

    return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
            torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
            torch.bool: "BOOL"}
