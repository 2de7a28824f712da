"""The server's side of tapped requests over HTTP, without the HTTP: the endpoint plugin
(http.py) calls it around vLLM's own completion handlers.

- `admit(body)`: a `/v1/completions` or `/v1/chat/completions` JSON body with
  `vllm_xargs["tapc"]` (asks.py) is checked against the plan (`RequestError`: HTTP 400 with
  the same words), given its tapc id and its wire (`WireRequest.to_text`, in `vllm_xargs`,
  whence vLLM copies it into `SamplingParams.extra_args`), its `cache_salt` (tapc/api/prefix.py;
  a capture of prompt rows gets a salt of its own, since `skip_reading_prefix_cache` cannot be
  set through the OpenAI API) and, when streamed, `stream_options.include_usage` (the usage
  chunk tells the server how many tokens the request has).
- `finished(tid, usage)`: after the response went out: the result is collected (batched,
  async_llm.Collector), assembled, and kept (results.py) until the client fetches it.
- `abandoned(tid)`: the response did not complete (the client went away, an error): what the
  request held on the workers goes back.
- `fetch(tid)`: a finished request's results, as safetensors bytes, once; or `lend(tid)`, for a
  client on the same host: where they are in shared memory, held until it calls `give_back`.
- `inline(tid, usage)`: instead of `finished`, for a request that asked for its results in its
  response (`inline: true`): them, base64 safetensors, while the response waits. For a request
  that asked to `save` them (the server's save folder, saving.py): its number there, at once,
  while its rows go to the folder's writer.

With several API server processes (`--api-server-count`), each runs its own TapcServer over
one folder they share (`shared`): a vector registered on one and a result finished on one are
seen by all.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from types import SimpleNamespace as NS

import numpy as np
import pybase64

from tapc.api.async_llm import Collector
from tapc.api.prefix import salted
from tapc.api.session import TapSession, prompt_tokens
from tapc.errors import RequestError
from tapc.lang.quoted import shown
from tapc.serving.asks import HttpAsk, parse_ask
from tapc.serving.results import FolderResults, MemoryResults, Reply, Stored, safetensors_bytes
from tapc.serving.saving import SaveFolder
from tapc.wire.protocol import WireRequest

log = logging.getLogger("tapc")

INLINE_MAX = 16 << 20   # bytes of results a response carries inline; larger ones wait for their fetch


class TapcServer:
    """`engine`: vLLM's engine client (its `collective_rpc`); `session`: the plan's session;
    `shared`: the folder the server's API processes share, where there are several."""

    def __init__(self, engine, session: TapSession, keep_s: float = 600.0, shared: str | None = None,
                 save: SaveFolder | None = None):
        self.session = session
        self.collector = Collector(engine, session)
        self.running: dict[str, WireRequest] = {}
        # running requests whose response carries their `tapc` object: their results (inline),
        # or, for those in `saving`, their number in the save folder
        self.inlined: set[str] = set()
        self.save = save                        # the save folder (saving.py), where the server has one
        self.saving: set[str] = set()
        self._ending: set[asyncio.Task] = set()   # finished/abandoned tasks, referenced until done
        # results not fetched within keep_s are dropped
        self.results = (FolderResults(shared, keep_s, self.collector.flush) if shared
                        else MemoryResults(keep_s, self.collector.flush))

    # ---------------------------------------------------------------- requests

    def admit(self, body: dict, where: str) -> tuple[dict, str | None]:
        """The body vLLM must see, and the request's tapc id (None: it runs untapped)."""
        xargs = body.get("vllm_xargs") or {}
        for name, value in (("vllm_xargs", xargs), ("stream_options", body.get("stream_options") or {})):
            if not isinstance(value, dict):   # tapc adds to both
                raise RequestError(f"{where}: {name} must be an object, got {shown(value)}")
        raw = xargs.get("tapc")
        asked = parse_ask(raw, self.results.vectors(), where) if raw is not None else HttpAsk(None)
        ask = asked.request
        if asked.save:
            if self.save is None:
                raise RequestError(f"{where}: this server has no save folder (start it with `tapc serve ... "
                                   "--save-to FOLDER`); ask for the results by id or inline")
            ask = self.save.ask(asked, where)
        checked = self.session.check(ask, where)
        if checked is None:
            return body, None
        if body.get("n", 1) != 1:
            raise RequestError(f"{where}: taps with n={body['n']} choices are not supported; send the request "
                               "several times instead")
        prompt = body.get("prompt")
        # a list of prompts (strings or token lists), not one prompt's token ids: the OpenAI API
        # types a list by its items, so the first says which (a scan of every id cost 40 us)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
            raise RequestError(f"{where}: a tapped completion takes one prompt, got {len(prompt)}")
        one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list) else prompt
        self.session.check_reach(checked, prompt_tokens(one), _max_tokens(body), where)
        wire = WireRequest(uuid.uuid4().hex, checked)
        use = self.session.prefix.use(checked, wire.id)
        # A capture of prompt rows reads no cached KV: a salt of its own even where identical
        # steering would share one (that one would read the KV its twins left, short of rows).
        salt = self.session.prefix.unique(wire.id) if use.skip_read else use.salt
        # a request body carries `cache_salt` as a prompt dict does: the same rule adds ours
        body = salted({**body, "vllm_xargs": {**xargs, "tapc": wire.to_text()}}, salt)
        if body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if asked.save:   # the saved rows' token_ids column: the response says which tokens they were
            if body.get("echo"):
                raise RequestError(f"{where}: a saving request cannot `echo` its prompt (its token ids would "
                                   "mix with the generated ones)")
            body["return_token_ids"] = True
            self.saving.add(wire.id)
        self.running[wire.id] = wire
        if asked.inline or asked.save:
            self.inlined.add(wire.id)
        else:
            self.results.begin(wire.id)
        return body, wire.id

    def ended(self, tid: str, whole: bool, usage: dict | None) -> None:
        """The response of `tid` ended, `whole` (sent complete, status 200) or not: its results
        are collected, or what it held is given back, in a task of the event loop."""
        task = asyncio.get_running_loop().create_task(self.finished(tid, usage) if whole else self.abandoned(tid))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def finished(self, tid: str, usage: dict | None) -> None:
        """The response of `tid` went out whole; `usage` is its usage object."""
        await self.results.put(tid, await self._result(tid, usage))

    async def inline(self, tid: str, usage: dict | None, tokens: tuple[list, list] | None = None) -> dict:
        """The results of `tid`, which asked for them inline, as the `tapc` object its response
        carries: `{"id", "safetensors": base64}`; or, past `INLINE_MAX` bytes, `{"id", "fetch":
        route, "why"}` (they wait for that fetch); or `{"id", "error"}` when they cannot be sent.
        For a saving request, at once: `{"id", "saved": n}`, its number in the save folder, while
        its rows go there (`tokens`: its prompt's and its generated token ids, from the response)."""
        if tid in self.saving:
            self.saving.discard(tid)
            n = self.save.number()
            task = asyncio.get_running_loop().create_task(self._save(tid, usage, tokens, n))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
            return {"id": tid, "saved": n}
        stored = await self._result(tid, usage)
        size = sum(t.numel() * t.element_size() for t in stored.taps.values())
        if size > INLINE_MAX:
            await self.results.put(tid, stored)
            return {"id": tid, "fetch": f"/v1/tapc/results/{tid}",
                    "why": f"its captures are {size} bytes, more than the {INLINE_MAX} a response carries inline"}
        try:
            data = await asyncio.to_thread(safetensors_bytes, stored)
        except RequestError as e:
            return {"id": tid, "error": f"its results cannot be sent: {e}"}
        finally:
            stored.drop_tensors()
            self.collector.flush()
        return {"id": tid, "safetensors": pybase64.b64encode(data).decode()}

    async def _save(self, tid: str, usage: dict | None, tokens: tuple[list, list] | None, n: int) -> None:
        stored = await self._result(tid, usage)
        error = stored.error
        if tokens is None and error is None:
            error = RequestError(f"request {tid}: its response carried no token ids, so its rows cannot be saved")
        prompt, generated = tokens or ((), ())
        try:   # the writer drops the tensors once written; their chunks go back with a later collect
            await self.save.put(n, prompt, generated, stored.taps if error is None else {}, error)
        except Exception as e:   # the writer failed: the folder stops taking rows, the server goes on
            log.error("tapc: request %s (saved as %d) could not be written: %s", tid, n, e)

    async def _result(self, tid: str, usage: dict | None) -> Stored:
        wire = self.running.pop(tid)
        self.inlined.discard(tid)
        try:
            return await self._assemble(tid, wire, usage)
        except Exception as e:   # a defect here: its fetch hears of it rather than waiting out its time
            log.exception("tapc: the results of request %s could not be assembled", tid)
            return Stored({}, {}, RequestError(f"request {tid}: its results could not be assembled: {e!r}"))

    async def _assemble(self, tid: str, wire: WireRequest, usage: dict | None) -> Stored:
        if not usage or "prompt_tokens" not in usage or "completion_tokens" not in usage:
            self.collector.drop(tid)
            return Stored({}, {}, RequestError(f"request {tid}: its response carried no usage, so its rows "
                                               "cannot be counted"))
        result = await self.collector.result(tid)
        # What assembly reads of vLLM's output: how many prompt and generated tokens there were.
        out = NS(request_id=tid, prompt_token_ids=range(usage["prompt_tokens"]),
                 outputs=[NS(token_ids=range(usage["completion_tokens"]))])
        self.session.finish(out, wire, result)
        return Stored(dict(out.taps), out.saved, out.error, out.taps.unreached)

    async def abandoned(self, tid: str) -> None:
        """The response of `tid` did not complete: vLLM aborted the request; free what it held."""
        if self.running.pop(tid, None) is None:
            return
        self.inlined.discard(tid)
        self.saving.discard(tid)   # no number: a response that did not complete is not saved
        self.collector.drop(tid)
        await self.results.put(tid, Stored({}, {}, RequestError(f"request {tid}: its response did not complete "
                                                                "(aborted); its taps are dropped")))

    async def fetch(self, tid: str, wait_s: float) -> Reply | None:
        """The results of `tid`, ready to send (waiting up to `wait_s` for a request still
        running), once; None: unknown (never tapped, fetched already, or dropped after
        `keep_s`). RequestError: they cannot be sent (results.py `encode`)."""
        return await self.results.take(tid, wait_s)

    async def lend(self, tid: str, wait_s: float) -> dict | None:
        """The results of `tid`, once, for a client on this host: where their bytes are in shared
        memory, held for it until `give_back` (results.py `MemoryResults.lend`; with several API
        server processes, their shared folder's file). None and RequestError: as `fetch`."""
        return await self.results.lend(tid, wait_s, self.session.arena.where)

    def give_back(self, tid: str) -> bool:
        """The client is done with what `lend` described (False: nothing is lent under `tid`)."""
        return self.results.give_back(tid)

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
        self.results.add_vector(name, v)
        return int(v.size)


def _max_tokens(body: dict) -> int | None:
    """The body's bound on generated tokens (chat's `max_completion_tokens`, or `max_tokens`);
    None where it sets none, or one vLLM will refuse itself."""
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
