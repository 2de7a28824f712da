"""A toy `AsyncLLM` over the toy runner (tests/engine_toy.py), stepping on the event loop (not
a test module).

It plays what `tapc.AsyncVLLM` uses of vLLM's AsyncLLM: `generate` streams one output per
generated token (`finished` on the last), and aborts its request when the generator is closed
or cancelled; `abort`; `collective_rpc` to the worker's tapc methods. A background task runs
one scheduler step per loop turn, like `engine_toy.run`: at most `max_seqs` requests running,
a token budget per step (chunked prefill), finished and aborted requests reported to the
worker with the next step.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

from engine_toy import Req, new_request, next_token, over_the_wire

from tapc.engine.protocol import WireRequest


class ToyAsyncLLM:
    def __init__(self, runner, hooks, budget: int = 16, max_seqs: int = 8):
        self.runner, self.hooks, self.budget, self.max_seqs = runner, hooks, budget, max_seqs
        self.reqs: dict[str, Req] = {}               # running
        self.queues: dict[str, asyncio.Queue] = {}
        self.added: set[str] = set()
        self.finished: set[str] = set()               # for the next step's scheduler output
        self.task: asyncio.Task | None = None
        self.steps = 0
        self.rpcs: list[str] = []                      # methods called, in order
        self.submitted: dict[str, NS] = {}            # request id -> its prompt and params

    async def generate(self, prompt, params, request_id: str):
        wire = (params.extra_args or {}).get("tapc")
        req = Req(request_id, list(prompt["prompt_token_ids"]), params.max_tokens,
                  None if wire is None else WireRequest.from_wire(over_the_wire(wire)))
        req.tokens = list(req.prompt)
        req.sampling_params = params
        self.submitted[request_id] = NS(prompt=prompt, params=params)
        self.reqs[request_id], self.queues[request_id] = req, asyncio.Queue()
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
            r = self.reqs.pop(rid, None)
            if r is None:
                continue
            if rid in self.added:
                self.finished.add(rid)
                self.added.discard(rid)
            if not internal and rid in self.queues:
                self.queues[rid].put_nowait(output(r, True, "abort"))

    async def collective_rpc(self, method, args=()):
        self.rpcs.append(method)
        await asyncio.sleep(0)
        worker = {"tapc_collect": lambda ids: self.hooks.collect(ids).to_wire(), "tapc_release": self.hooks.release,
                  "tapc_held": self.hooks.held}
        return [over_the_wire(worker[method](*args))]

    async def _loop(self) -> None:
        try:
            while self.reqs:
                self._step()
                await asyncio.sleep(0)
        except Exception as e:
            for q in self.queues.values():
                q.put_nowait(e)
            raise

    def _step(self) -> None:
        new, sched, computed, left = [], {}, {}, self.budget
        for r in list(self.reqs.values()):
            if r.rid not in self.added:
                if len(self.added) == self.max_seqs:   # like vLLM's max_num_seqs: it waits
                    continue
                new.append(new_request(r))
                self.added.add(r.rid)
            n = min(len(r.tokens) - r.computed, left)
            if n > 0:
                sched[r.rid], computed[r.rid] = n, r.computed
                left -= n
        if not sched:
            return
        self.runner.execute_model(NS(scheduled_new_reqs=new, finished_req_ids=set(self.finished),
                                     preempted_req_ids=set(), num_scheduled_tokens=sched, num_computed=computed,
                                     tokens={r.rid: r.tokens for r in self.reqs.values()}))
        self.finished.clear()
        self.steps += 1
        for rid, n in sched.items():
            r = self.reqs[rid]
            r.computed += n
            if r.computed < len(r.tokens):
                continue
            r.tokens.append(next_token(r.tokens))
            done = len(r.tokens) - len(r.prompt) == r.max_tokens
            if done:
                del self.reqs[rid]
                self.added.discard(rid)
                self.finished.add(rid)
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(output(r, done, "length" if done else None))


def output(r: Req, finished: bool, reason: str | None):
    """What vLLM's RequestOutput carries that AsyncVLLM and the assembly read."""
    return NS(request_id=r.rid, prompt_token_ids=r.prompt, finished=finished,
              outputs=[NS(token_ids=r.tokens[len(r.prompt):], finish_reason=reason)])

