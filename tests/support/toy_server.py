"""tapc's endpoint plugin in a FastAPI app whose /v1/completions stands in for vLLM's, over the toy
async engine (async_toy.py), and a client of it: the CPU tests of `tapc serve` and of the HTTP
asks share them."""
import json

from async_toy import ToyAsyncLLM
from engine_toy import ToyModel, hooks_for, toy_plan

from tapc.api.session import TapSession
from tapc.worker.points import EnginePoints

TAPS = ["model.layers.*.resid", "model.layers.1.resid | add(steer, alpha=2.0)"]


def stand_in_app(taps=TAPS, api_key=None, blocks=None, shared=None, save=None, params=None, prefix_rows=False):
    """An app with tapc's plugin whose /v1/completions runs the toy engine like vLLM's handler
    (`return_token_ids` too: the prompt's ids on the first choice, each event's new ids);
    `blocks` (name -> import path) registered on the toy worker as the server's worker does;
    `shared`: the folder of several API server processes; `save`: the save folder's settings;
    `params`: engine-wide parameter values (a spec's `params:`); `prefix_rows`: the engine keeps
    captured rows of shared prompt blocks (`prefix_rows_gib`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm import SamplingParams

    from tapc.serving.http import TapcEndpoints
    from tapc.serving.saving import SaveFolder
    from tapc.serving.server import TapcServer

    plan = toy_plan(taps)
    runner, hooks = hooks_for(plan, ToyModel())
    toy = ToyAsyncLLM(runner, hooks)
    app = FastAPI()
    app.state.seen = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.seen.append(body)
        if body.get("prompt") == "boom":
            raise RuntimeError("the handler failed")
        sp = SamplingParams(max_tokens=body.get("max_tokens", 4), extra_args=dict(body.get("vllm_xargs") or {}) or None)
        rid = f"cmpl-{len(app.state.seen)}"
        stream = toy.generate({"prompt_token_ids": body["prompt"]}, sp, rid)
        ids = body.get("return_token_ids")
        if not body.get("stream"):
            outs = [o async for o in stream]
            n = len(outs[-1].outputs[0].token_ids)
            choice = {"tokens": outs[-1].outputs[0].token_ids}
            if ids:
                choice.update(prompt_token_ids=body["prompt"], token_ids=outs[-1].outputs[0].token_ids)
            return JSONResponse({"id": rid, "choices": [choice],
                                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})

        async def events():
            n = 0
            async for o in stream:
                choice = {"token": o.outputs[0].token_ids[-1]}
                if ids:
                    choice.update(token_ids=list(o.outputs[0].token_ids[n:]), **({"prompt_token_ids": body["prompt"]}
                                                                                  if n == 0 else {}))
                n = len(o.outputs[0].token_ids)
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    TapcEndpoints().attach_router(app)
    if api_key:
        from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware

        app.add_middleware(AuthenticationMiddleware, tokens=[api_key])
    if blocks:
        from tapc.lang.blockpaths import import_blocks

        hooks.component(EnginePoints).runtime.register(import_blocks(blocks, "the engine's plan"))
    app.state.tapc = TapcServer(toy, TapSession(plan, params, blocks=blocks or (), prefix_rows=prefix_rows), shared=shared,
                                save=SaveFolder(plan, **save) if save else None)
    return app, hooks


def client(app):
    from fastapi.testclient import TestClient

    return TestClient(app, raise_server_exceptions=False)

