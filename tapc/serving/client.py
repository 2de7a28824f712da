"""`tapc.serving.client`: taps over a `tapc serve` server, for Python users of the `openai` client.

    from tapc.serving.client import TapcClient
    tc = TapcClient("http://localhost:8000/v1", api_key="...")
    tc.register("happy", vector)                                  # once; requests name it
    resp, tid = tc.complete(model="m", prompt="Hello", max_tokens=16,
                            taps=tc.ask(capture=["model.layers.3.resid"], params={"steer": "happy"}))
    captures = tc.results(tid)                                   # {key: torch.Tensor}, read once

With `ask(..., inline=True)` the results come in the response itself: `tc.inline(resp)` (or,
streamed, `tc.inline(chunk)` of the chunk that has them) reads them. A client on the server's
host can read them where they are, with no bytes over HTTP:

    with tc.shared(tid) as captures:                             # views of the server's memory
        kept = captures["model.layers.3.resid"].clone()          # valid inside the `with` only

`ask(...)` is the `extra_body` of any `openai` call (`vllm_xargs`, docs/serving.md), so the plain
client works too: `client.chat.completions.create(..., extra_body=tc.ask(...))`, with the
request's tapc id in the response's `x-tapc-id` header (`with_raw_response`).
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
from collections.abc import Iterator, Sequence

import pybase64

from tapc.errors import RequestError, TapcError


class TapcClient:
    """`base_url`: the server's OpenAI base URL (ending in /v1); `http_client`: an httpx client
    for both (e.g. with its own timeouts); other keyword arguments go to `openai.OpenAI`."""

    def __init__(self, base_url: str = "http://localhost:8000/v1", api_key: str = "EMPTY", *, http_client=None,
                 **openai_kwargs):
        import openai

        self.openai = openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http_client, **openai_kwargs)
        self._http = self.openai._client           # the httpx client the openai client sends with
        self._base = str(self.openai.base_url).rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"}

    @staticmethod
    def ask(capture: str | Sequence[str] = (), positions: str | Sequence[int] = "all", params: dict | None = None,
            inline: bool = False, save: bool = False) -> dict:
        """A request's taps as `extra_body`: `params` values are numbers, lists of numbers, or
        the names of registered vectors; `inline`: its results come in its response; `save`:
        they go to the server's save folder (its keys and positions, unless named here), and
        the response says under which request number (`saved`). Only what is given is sent."""
        ask = {}
        if capture:
            ask["capture"] = [capture] if isinstance(capture, str) else list(capture)
        if positions != "all":
            ask["positions"] = positions if isinstance(positions, str) else list(positions)
        if params:
            ask["params"] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in params.items()}
        for flag, on in (("inline", inline), ("save", save)):
            if on:
                ask[flag] = True
        return {"vllm_xargs": {"tapc": json.dumps(ask)}}

    def register(self, name: str, vector) -> int:
        """Register a vector under `name` on the server; returns its size."""
        values = vector.tolist() if hasattr(vector, "tolist") else list(vector)
        return self._json("POST", "/tapc/vectors", {"name": name, "values": values})["size"]

    def complete(self, *, taps: dict | None = None, chat: bool = False, **kwargs):
        """(the completion, its tapc id) of `/v1/completions` (chat: `/v1/chat/completions`).
        A request the server refuses (HTTP 400) raises `RequestError` with the server's words."""
        import openai

        api = self.openai.chat.completions if chat else self.openai.completions
        extra = {**kwargs.pop("extra_body", {}), **(taps or {})}
        try:
            raw = api.with_raw_response.create(**kwargs, extra_body=extra)
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) else {}
            raise RequestError(body.get("message") or str(e)) from None
        return raw.parse(), raw.headers.get("x-tapc-id")

    def results(self, tid: str, wait: float = 60.0) -> dict:
        """A finished request's captures (and blocks' saved tensors under `saved/<name>/<i>`),
        once. A request whose taps failed raises `RequestError` with the server's words."""
        r = self._http.get(f"{self._base}/tapc/results/{tid}", params={"wait": wait}, headers=self._auth)
        if r.status_code != 200:
            raise TapcError(f"tapc results {tid}: HTTP {r.status_code}: {_message(r)}")
        return _load(r.content)

    @contextlib.contextmanager
    def shared(self, tid: str, wait: float = 60.0) -> Iterator[dict]:
        """A finished request's results as `results` gives them, once, for a client on the
        server's host (and user): views of the server's shared memory, no copy and no bytes over
        HTTP. Valid inside the `with` only: its end gives the memory back to the server, which
        fills it with other requests' captures, so `.clone()` what you keep. The server holds
        them for its keep time at most (10 minutes by default). A request whose taps failed
        raises `RequestError` with the server's words."""
        r = self._http.get(f"{self._base}/tapc/results/{tid}", params={"wait": wait, "via": "shm"},
                           headers=self._auth)
        if r.status_code != 200:
            raise (RequestError if r.status_code == 400 else TapcError)(
                f"tapc results {tid} via=shm: HTTP {r.status_code}: {_message(r)}")
        try:
            lent = r.json()
            if lent.get("error"):
                raise RequestError(lent["error"])
            yield shared_views(lent["tensors"])
        finally:
            self._http.delete(f"{self._base}/tapc/results/{tid}", headers=self._auth)

    def inline(self, response) -> dict:
        """The results a request asked for inline, from its completion (or the streamed chunk
        that carries them: the last before the stream ends), as `results` gives them; results
        too large to come inline are fetched."""
        got = response.get("tapc") if isinstance(response, dict) else (response.model_extra or {}).get("tapc")
        if not got:
            raise TapcError("this response carries no inline tapc results (ask with inline=True; streamed, "
                            "they are in the chunk before the stream ends)")
        if "error" in got:
            raise RequestError(got["error"])
        if "fetch" in got:
            return self.results(got["id"])
        return _load(pybase64.b64decode(got["safetensors"]))

    def _json(self, method: str, path: str, body=None) -> dict:
        r = self._http.request(method, f"{self._base}{path}", json=body, headers=self._auth)
        if r.status_code != 200:
            raise (RequestError if r.status_code == 400 else TapcError)(f"{path}: HTTP {r.status_code}: {_message(r)}")
        return r.json()


def _message(r) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text


def shared_views(described: dict) -> dict:
    """Tensors over the files a `via=shm` reply describes (name -> path, offset, dtype, shape,
    stride, storage_offset), each file mapped once, copy-on-write: the caller's writes stay its
    own."""
    import torch

    from tapc.harvest.shardfiles import SAFETENSORS_DTYPES

    dtypes = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    maps: dict[str, mmap.mmap] = {}
    out = {}
    for name, d in described.items():
        dtype, shape, stride = dtypes[d["dtype"]], d["shape"], d["stride"]
        if math.prod(shape) == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        if d["path"] not in maps:
            with open(d["path"], "rb") as f:
                maps[d["path"]] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        # the elements from the storage's first to the view's last
        extent = d["storage_offset"] + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
        base = torch.frombuffer(maps[d["path"]], dtype=torch.uint8, count=extent * dtype.itemsize,
                                offset=d["offset"]).view(dtype)
        out[name] = base.as_strided(shape, stride, d["storage_offset"])
    return out


def _load(data: bytes) -> dict:
    from safetensors.torch import load

    tensors = load(data)
    error = _metadata(data).get("error")
    if error:
        raise RequestError(error)
    return tensors


def _metadata(data: bytes) -> dict:
    """The metadata of safetensors bytes (its JSON header)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
