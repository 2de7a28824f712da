"""tapc's endpoint plugin for `vllm serve` (entry point group `vllm.endpoint_plugins`, name
`tapc`; vLLM loads it only when `VLLM_PLUGINS` names it, which `tapc serve` sets).

Routes, all under `/v1/` so that vLLM's `--api-key` guards them as it guards its own:
    POST   /v1/tapc/vectors          {"name": ..., "values": [...]}: a vector requests name
    GET    /v1/tapc/vectors          the registered names and sizes
    GET    /v1/tapc/plan             the plan (TapPlan JSON): what requests may capture and bind
    GET    /v1/tapc/results/{id}     a finished request's captures, safetensors bytes (once), streamed
                                     from the captures' own memory (results.py; with several API
                                     server processes, from the folder they share); `?via=shm`:
                                     for a client on the same host, JSON saying where they are
                                     in shared memory (once), held for it until
    DELETE /v1/tapc/results/{id}     gives them back
    GET    /v1/tapc/held             what requests hold on the workers now (all zero when idle)
    GET    /v1/tapc/host-time        seconds tapc's hooks took on each worker's engine thread, and its
                                     steps, since it started
and a middleware on vLLM's `/v1/completions` and `/v1/chat/completions`: a body with
`vllm_xargs["tapc"]` is checked and rewritten (server.py `admit`; a bad one gets HTTP 400 with
its `TapcError`'s words, and vLLM never sees it), its response carries the request's tapc id
in the `x-tapc-id` header (streamed responses too: headers go first), and once the response
went out whole the results are collected; a response that did not (the client went away)
gives back what its request held. A request that asked for its results inline gets them in
its response, under `tapc` (server.py `inline`): a JSON response's body is held until they are
in; a stream gets them in one more event before `data: [DONE]`. vLLM's handlers and responses
are not patched: the middleware adds to what they send.
"""
from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tapc.api.async_llm import every_worker
from tapc.errors import RequestError, TapcError

log = logging.getLogger("tapc")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
HEADER = b"x-tapc-id"
DONE = b"data: [DONE]"   # the last event of a streamed completion


class TapcEndpoints:
    """The `vllm.endpoint_plugins` object (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "tapc"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router())
        app.add_middleware(TapcMiddleware)

    async def init_state(self, engine_client, state, args) -> None:
        state.tapc = server_for(engine_client, args)


def server_for(engine_client, args):
    """The TapcServer of a `vllm serve` whose `--additional-config` holds tapc's engine config
    (and the spec its engine-wide parameters come from), or None where there is none."""
    from tapc.api.engine import Engine
    from tapc.serving.results import shared_folder
    from tapc.serving.server import TapcServer

    engine = None if engine_client is None else Engine.read(args.additional_config)
    if engine is None:
        log.warning("tapc: this server has no tapc plan (start it with `tapc serve`); tapc's routes answer 503")
        return None
    config = engine.config
    params = None
    if config.spec:
        from tapc.lang.specfile import load_spec

        params = load_spec(config.spec).param_values() or None
    # several API server processes (`--api-server-count`) share vectors and results through a folder
    several = (getattr(args, "api_server_count", None) or 1) > 1
    shared = shared_folder() if several else None
    save = None
    if config.save:
        from tapc.serving.saving import SaveFolder

        if several:
            raise TapcError("tapc serve --save-to writes one folder's shards from one process: run it with "
                            "--api-server-count 1")
        save = SaveFolder(engine.plan, **config.save)
    # the plan's blocks run on the workers, which import them (worker.py): requests need not send any
    session = engine.session(params, config.blocks, max_model_len=engine_client.model_config.max_model_len,
                             prefix_caching=engine_client.vllm_config.cache_config.enable_prefix_caching is not False)
    return TapcServer(engine_client, session, shared=shared, save=save)


def error(status: int, message: str):
    """vLLM's error body (ErrorResponse), so OpenAI clients raise it as usual."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status)


def router() -> APIRouter:
    r = APIRouter()

    def server_of(request: Request):
        return getattr(request.app.state, "tapc", None)

    @r.post("/v1/tapc/vectors")
    async def register(request: Request):
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        try:
            body = await request.json()
        except ValueError as e:
            return error(400, f"tapc vectors: the body is not JSON: {e}")
        if not isinstance(body, dict) or set(body) != {"name", "values"}:
            return error(400, 'tapc vectors: the body is {"name": ..., "values": [numbers]}')
        try:
            size = server.register(body["name"], body["values"])
        except RequestError as e:
            return error(400, str(e))
        return JSONResponse({"name": body["name"], "size": size})

    @r.get("/v1/tapc/vectors")
    async def vectors(request: Request):
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        return JSONResponse({"vectors": {k: int(v.size) for k, v in server.results.vectors().items()}})

    @r.get("/v1/tapc/plan")
    async def plan(request: Request):
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        return Response(server.session.plan.to_json(), media_type="application/json")

    @r.get("/v1/tapc/held")
    async def held(request: Request):
        """What requests hold on each worker (TapWorker.tapc_held), after dropped captures went
        back: all zero on an idle server whose results were fetched. With several API server
        processes, this one's dropped captures; the others' go back within their collectors'
        release delay."""
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        await server.collector.settle()
        return JSONResponse({"workers": await every_worker(server.collector.engine, "tapc_held")})

    @r.get("/v1/tapc/host-time")
    async def host_time(request: Request):
        """Seconds each worker's engine thread spent in tapc's per-step hooks and collects, and
        its steps, since it started (TapWorker.tapc_host_time): two readings around a load say
        what tapc cost its steps."""
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        return JSONResponse({"workers": await every_worker(server.collector.engine, "tapc_host_time")})

    @r.get("/v1/tapc/results/{tid}")
    async def results(request: Request, tid: str, wait: float = 60.0, via: str = "http"):
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        if via not in ("http", "shm"):
            return error(400, f"tapc results: via={via!r}; give http (the bytes) or shm (where they are in "
                              "shared memory, for a client on the server's host)")
        wait = min(max(wait, 0.0), 600.0)
        try:
            reply = await (server.lend(tid, wait) if via == "shm" else server.fetch(tid, wait))
        except RequestError as e:   # a block saved a tensor safetensors cannot hold
            return error(500, f"tapc: results of {tid!r} cannot be sent: {e}")
        if reply is None:
            return error(404, f"tapc: no results for {tid!r} (not a tapped request, fetched already, still "
                              f"running after {wait:g} s, or kept longer than {server.results.keep_s:g} s)")
        if via == "shm":
            return JSONResponse(reply)
        headers = {"x-tapc-error": reply.error_type} if reply.error_type else {}
        return StreamingResponse(reply.chunks, media_type="application/octet-stream",
                                 headers={**headers, "content-length": str(reply.size)})

    @r.delete("/v1/tapc/results/{tid}")
    async def give_back(request: Request, tid: str):
        """The client is done with results it got `via=shm`: their memory goes back."""
        server = server_of(request)
        if server is None:
            return error(503, "tapc: this server runs no tap plan")
        if not server.give_back(tid):
            return error(404, f"tapc: no results of {tid!r} are lent (never asked via=shm, given back already, "
                              f"or held longer than {server.results.keep_s:g} s)")
        return JSONResponse({"id": tid, "given_back": True})

    return r


class TapcMiddleware:
    """Pure ASGI (streamed responses pass through as they are sent)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        server = getattr(getattr(scope.get("app"), "state", None), "tapc", None) if scope["type"] == "http" else None
        if server is None or scope.get("method") != "POST" or path not in COMPLETIONS:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return   # the client went away before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
        tid = None
        if b'"vllm_xargs"' not in body and not server.session.taps_all:
            # untapped (asks are in vllm_xargs): not parsed, as the API server's one thread has
            # vLLM's own work to do
            return await self.app(scope, _replay(body, receive), send)
        try:
            data = json.loads(body)
            if isinstance(data, dict):
                data, tid = server.admit(data, f"request to {path}")
        except TapcError as e:   # anything checking finds wrong is the request's: vLLM never sees it
            await error(400, str(e))(scope, receive, send)
            return
        except ValueError:
            pass   # not JSON: vLLM answers it
        if tid is not None:
            body = json.dumps(data).encode()
        return await self._forward(scope, _replay(body, receive), send, server, tid, bool(data.get("stream"))
                                   if tid is not None else False)

    async def _forward(self, scope, receive, send, server, tid, stream: bool):
        if tid is None:
            return await self.app(scope, receive, send)
        seen = Usage(stream, tokens=tid in server.saving)
        state = {"status": 0, "done": False, "ended": False}
        inline = tid in server.inlined
        held = []   # the start of a non-streamed inline response: its length changes

        async def results() -> dict:
            state["ended"] = True
            return await server.inline(tid, seen.usage(), seen.token_ids())

        async def send_tapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (HEADER, tid.encode())]}
                if inline and not stream and state["status"] == 200:
                    held.append(message)
                    return
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                state["done"] = not message.get("more_body", False)
                inlining = inline and state["status"] == 200
                if inlining and stream and DONE in chunk:
                    # the results go in one more event, after the usage event, before [DONE]
                    before, _, after = chunk.partition(DONE)
                    seen.feed(before)
                    event = {**seen.event, "choices": [], "usage": None, "tapc": await results()}
                    message = {**message, "body": before + b"data: " + json.dumps(event).encode() + b"\n\n" + DONE + after}
                else:
                    seen.feed(chunk)
                    if inlining and not stream:   # the whole JSON body, then the results in it
                        if not state["done"]:
                            return
                        start, body = _with_results(held.pop(), seen.parsed(), await results())
                        await send(start)
                        message = {**message, "body": body}
            await send(message)

        try:
            await self.app(scope, receive, send_tapped)
        finally:
            if not state["ended"]:
                whole = state["done"] and state["status"] == 200
                server.ended(tid, whole, seen.usage() if whole else None)


def _with_results(start: dict, data: dict, results: dict) -> tuple[dict, bytes]:
    """A JSON response (its start, and its body as parsed) with the request's results under `tapc`."""
    body = json.dumps({**data, "tapc": results}).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    return {**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, body


def _replay(body: bytes, receive):
    """`receive` that hands the (rewritten) body once, then the client's own messages."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class Usage:
    """The `usage` object of a response: the JSON body's, or the last one of a stream's
    server-sent events (`data: {...}` lines); with `tokens`, also its prompt's and its generated
    token ids (`return_token_ids`: on the choices, or for chat the prompt's at the top)."""

    def __init__(self, stream: bool, tokens: bool = False):
        self.stream = stream
        self.body = bytearray()
        self.last = None
        self.event: dict = {}   # the last event that carried a usage (its id, object, created, model)
        self.tokens = tokens
        self._json: dict | None = None
        self.prompt_ids: list | None = None
        self.generated: list = []

    def feed(self, chunk: bytes) -> None:
        if not self.stream:
            self.body += chunk
            return
        if not self.tokens and b'"usage"' not in chunk:
            return
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and (self.tokens or b'"usage"' in line):
                event = json.loads(line[6:])
                if self.tokens:
                    self._take_tokens(event)
                if event.get("usage"):
                    self.last = event["usage"]
                    self.event = {k: event[k] for k in ("id", "object", "created", "model") if k in event}

    def _take_tokens(self, event: dict) -> None:
        for choice in event.get("choices") or []:
            self.prompt_ids = choice.get("prompt_token_ids") or self.prompt_ids
            self.generated += choice.get("token_ids") or []
        self.prompt_ids = event.get("prompt_token_ids") or self.prompt_ids

    def parsed(self) -> dict:
        """A JSON response's body, parsed once it is whole ({} if it is not JSON)."""
        if self._json is None:
            try:
                data = json.loads(bytes(self.body))
            except ValueError:
                data = None
            self._json = data if isinstance(data, dict) else {}
        return self._json

    def usage(self) -> dict | None:
        return self.last if self.stream else self.parsed().get("usage")

    def token_ids(self) -> tuple[list, list] | None:
        """(prompt, generated) token ids, when asked for and the response had them."""
        if not self.tokens:
            return None
        if not self.stream:
            self._take_tokens(self.parsed())
        return None if self.prompt_ids is None else (self.prompt_ids, self.generated)
