"""A toy `AsyncLLM` over the toy runner (tests/support/engine_toy.py), stepping on the event loop (not
a test module).

It plays what `tapc.AsyncVLLM` uses of vLLM's AsyncLLM: `generate` streams one output per
generated token (`finished` on the last), and aborts its request when the generator is closed
or cancelled; `abort`; `collective_rpc` to the worker's tapc methods. A background task runs
one step of engine_toy's `Scheduler` per loop turn, as `engine_toy.run` does: at most `max_seqs` requests running,
a token budget per step (chunked prefill), finished and aborted requests reported to the
worker with the next step.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

from engine_toy import Req, Scheduler, over_the_wire

from tapc.wire.protocol import WireRequest


class ToyAsyncLLM:
    def __init__(self, runner, hooks, budget: int = 16, max_seqs: int = 8):
        self.runner, self.hooks = runner, hooks
        self.sched = Scheduler(runner, budget, max_seqs)
        self.queues: dict[str, asyncio.Queue] = {}
        self.task: asyncio.Task | None = None
        self.rpcs: list[str] = []                      # methods called, in order
        self.submitted: dict[str, NS] = {}            # request id -> its prompt and params

    async def generate(self, prompt, params, request_id: str):
        wire = (params.extra_args or {}).get("tapc")
        req = Req(request_id, list(prompt["prompt_token_ids"]), params.max_tokens,
                  None if wire is None else WireRequest.from_wire(over_the_wire(wire)))
        req.sampling_params = params
        self.submitted[request_id] = NS(prompt=prompt, params=params)
        self.sched.add(req)
        self.queues[request_id] = asyncio.Queue()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._loop())
        try:
            while True:
                out = await self.queues[request_id].get()
                if isinstance(out, Exception):   # the engine loop died
                    raise out
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)
            raise
        finally:
            self.queues.pop(request_id, None)

    async def abort(self, request_id, internal: bool = False) -> None:
        """Like vLLM's: the stream of a request aborted from outside ends with a final output
        (finish_reason "abort")."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            r = self.sched.abort(rid)
            if r is None:
                continue
            if not internal and rid in self.queues:
                self.queues[rid].put_nowait(output(r, True, "abort"))

    def shutdown(self) -> None:
        self.queues.clear()

    async def collective_rpc(self, method, args=()):
        self.rpcs.append(method)
        await asyncio.sleep(0)
        worker = {"tapc_collect": lambda ids, release=(): self.hooks.collect(ids, release).to_wire(), "tapc_release": self.hooks.release,
                  "tapc_held": self.hooks.held, "tapc_host_time": self.hooks.host_time}
        return [over_the_wire(worker[method](*args))]

    async def _loop(self) -> None:
        try:
            while self.sched.busy():
                done = self.sched.step()
                for r in self.sched.produced:
                    q = self.queues.get(r.rid)
                    if q is not None:
                        q.put_nowait(output(r, r in done, "length" if r in done else None))
                await asyncio.sleep(0)
        except Exception as e:
            for q in self.queues.values():
                q.put_nowait(e)
            raise


def output(r: Req, finished: bool, reason: str | None):
    """What vLLM's RequestOutput carries that AsyncVLLM and the assembly read."""
    return NS(request_id=r.rid, prompt_token_ids=r.prompt, finished=finished,
              outputs=[NS(token_ids=r.tokens[len(r.prompt):], finish_reason=reason)])

