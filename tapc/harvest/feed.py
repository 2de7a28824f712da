"""Keeping a tapped engine fed for a harvest: prompts go in through vLLM's own request loop
(`LLMEngine.add_request` / `step`, as `LLM.generate` drives it) while earlier ones run, so the
engine never drains between batches; finished requests are collected in groups and handed on.

    window = Window(tokens=65_536)
    feed(llm, prompts, params, ask, window, hand=writer.put)    # writer: window.give(tokens) per request

`window` bounds what is in flight: a prompt is submitted only while the tokens submitted and not
yet written (`Window.give`) leave room for it. The captures of those requests are what sits in
/dev/shm, so the window is the harvest's host memory bound; a slow writer fills it and the feed
waits, never dropping a row.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

from tapc.api.prefix import salted
from tapc.api.requests import TapRequest
from tapc.errors import TapcError


@dataclass(frozen=True)
class Done:
    """A finished request: `seq` its place in submission order (0, 1, ...), `request` the
    prompt's index in the whole input, `out` vLLM's RequestOutput with `taps` and `error`;
    `suspect`: the engine had counted NaN or inf values in its captures by the time this
    request was collected (until then, every capture is known finite on the device)."""

    seq: int
    request: int
    out: object
    tokens: int
    suspect: bool = True


class Window:
    """Tokens submitted and not yet written. The feed takes, the writer gives back; `fail`
    wakes the feed with the writer's error."""

    def __init__(self, tokens: int):
        if tokens < 1:
            raise TapcError(f"window_tokens must be at least 1, got {tokens}")
        self.cap, self.used = tokens, 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def room(self, n: int) -> bool:
        """Whether `n` more tokens fit (always, when nothing is in flight: a prompt longer than
        the window still runs, alone)."""
        with self._cond:
            return self.used == 0 or self.used + n <= self.cap

    def take(self, n: int) -> None:
        with self._cond:
            self.used += n

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait(self, n: int) -> None:
        """Until `n` tokens fit, or the writer failed."""
        with self._cond:
            self._cond.wait_for(lambda: self.error is not None or self.used == 0 or self.used + n <= self.cap)
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise TapcError(f"the harvest's writer failed: {self.error}") from self.error


def feed(llm, prompts: Iterator[tuple[int, list[int]]], sampling_params, ask: TapRequest, window: Window,
         hand: Callable[[list[Done]], None], collect_every: int = 256,
         submitted: Callable[[int], None] | None = None, first_seq: int = 0,
         exhausted: Callable[[], None] | None = None) -> int:
    """Run `prompts` ((index, token ids) pairs) through `llm` (a `tapc.VLLM`), calling `hand`
    with each group of finished requests in completion order. A group is collected from the
    engine when `collect_every` requests have finished, when the window is full and a quarter
    of it has finished, at every step once all prompts are in, or when the engine has nothing
    else to run; one `tapc_collect` per group keeps the engine's calls few.
    `first_seq`: the `seq` of the first prompt (a restart numbers on from where it stopped).
    `submitted(tokens)` follows each prompt handed to the engine; `exhausted()` comes once, when
    the last one has been (requests may still be running). Returns the `seq` after the last
    prompt. On an error, requests still running are aborted."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm.llm_engine
    session = llm.session
    checked = session.check(ask, "the harvest's TapRequest")
    params = copy.copy(sampling_params)
    params.output_kind = RequestOutputKind.FINAL_ONLY   # as LLM.generate asks: one output per request
    live: dict[str, tuple[int, int, object, int]] = {}   # vLLM id -> (seq, request, Prepared, tokens)
    finished: list = []
    seq = first_seq
    nxt = next(prompts, None)
    try:
        while True:
            window.check()
            while nxt is not None and window.room(cost := len(nxt[1]) + params.max_tokens):
                index, tokens = nxt
                prepared = session.prepare(params, checked, f"prompt {index}")
                if seq % collect_every == 0:
                    llm._give_back()   # the chunks the writer has dropped: the worker reuses them
                rid = f"tapc-h{seq}"   # outputs and aborts name the id given here (vLLM's own has a suffix)
                try:
                    engine.add_request(rid, salted({"prompt_token_ids": tokens}, prepared.salt), prepared.params)
                except ValueError as e:   # vLLM refuses the prompt (too long, bad token): that prompt fails
                    hand([Done(seq, index, SimpleNamespace(error=TapcError(f"vLLM refused it: {e}")), 0)])
                else:
                    live[rid] = (seq, index, prepared, cost)
                    window.take(cost)
                if submitted is not None:
                    submitted(len(tokens))
                seq += 1
                nxt = next(prompts, None)
            if nxt is None and exhausted is not None:
                exhausted()
                exhausted = None
            idle = True
            if engine.has_unfinished_requests():
                finished += [o for o in engine.step() if o.finished]
                idle = not engine.has_unfinished_requests()
            # A collect makes the engine core wait for the step in flight (the worker's copies):
            # when the window is full, wait until a quarter of it is done before paying for one.
            full = nxt is not None and not window.room(len(nxt[1]) + params.max_tokens) and \
                sum(live[o.request_id][3] for o in finished) * 4 >= window.cap
            # Once every prompt is in, each step's finished requests go at once: what the writer
            # has left when the engine is done is then one step's rows, not a group's.
            if finished and (idle or full or nxt is None or len(finished) >= collect_every):
                hand(_collect(llm, finished, live))
                finished = []
            elif idle:
                if nxt is None:
                    return seq
                window.wait(len(nxt[1]) + params.max_tokens)
    except BaseException:
        if live:
            engine.abort_request(list(live))
        raise


def _collect(llm, outs: list, live: dict) -> list[Done]:
    """The captures of finished requests, from the engine: one `tapc_collect` for all, which
    carries back the chunks the writer has dropped."""
    metas = [live.pop(o.request_id) for o in outs]
    prepared = [m[2] for m in metas]
    wanted = llm.session.wanted(prepared)
    if wanted:
        replies = llm.llm.collective_rpc("tapc_collect", args=(wanted, llm.session.released()))
    else:
        replies = None
        llm._give_back()
    # counted on the GPU as the captures were copied out (the harvest turned counting on): 0
    # means every value so far is finite; None, a worker that does not count
    suspect = replies is None or any(r.get("nonfinite") != 0 for r in replies)
    llm.session.finish_batch(outs, prepared, replies)
    return [Done(seq, index, out, cost, suspect) for (seq, index, _, cost), out in zip(metas, outs)]
