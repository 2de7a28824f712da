"""`AsyncVLLM`: vLLM's `AsyncLLM` with taps, for servers and many concurrent requests.

    engine = AsyncVLLM("path/to/model", taps=["model.layers.*.resid", "model.layers.10.resid | add(steer)"])
    async for out in engine.generate(prompt, SamplingParams(max_tokens=64), "req-1",
                                      taps=TapRequest(capture="model.layers.3.resid", params={"steer": v})):
        ...                    # streamed as vLLM streams; the final output (out.finished) also
                               # carries out.taps, out.saved and out.error, as VLLM.generate's do

Each request is checked before it is submitted (`RequestError`, raised by `generate` before
its first output); what fails once it runs is its `out.error` only. The finished requests'
results are fetched from the workers in batches: one `tapc_collect` for every request that
finished since the last one (`Collector`). A request that is aborted, cancelled or whose
consumer stops iterating gives back everything it held: vLLM's generator is closed (vLLM
aborts the request), then its tapc id is collected and its result discarded (the worker
frees its record and parameter slot; its capture chunks go back with the next release).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence

from tapc.api.llm import setup, spec_arguments
from tapc.api.prefix import salted
from tapc.api.requests import TapRequest
from tapc.api.session import Taps, TapSession
from tapc.errors import RequestError
from tapc.wire.protocol import Result

__all__ = ["AsyncVLLM", "Collector", "every_worker"]

log = logging.getLogger("tapc")


class AsyncVLLM:
    """vLLM's `AsyncLLM` with taps; arguments as `tapc.VLLM`'s (other keyword arguments go to
    vLLM's `AsyncEngineArgs`). `engine.engine` is the AsyncLLM, `engine.plan` the plan."""

    def __init__(self, model: str, taps: Sequence[str], *, blocks: dict | None = None, params: dict | None = None,
                 capture_dtype: str | None = None, functions: dict | None = None, **kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.plan, self.session, engine_args = setup(model, taps, blocks, params, capture_dtype, kwargs, functions)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine_args))
        self.session.max_model_len = self.engine.model_config.max_model_len
        self.collector = Collector(self.engine, self.session)
        self._blocks = blocks
        self._ready: asyncio.Task | None = None

    @classmethod
    def from_spec(cls, spec, **overrides) -> "AsyncVLLM":
        """An engine from a YAML spec, as `VLLM.from_spec`."""
        model, taps, kwargs = spec_arguments(spec, overrides)
        return cls(model, taps, **kwargs)

    @classmethod
    def over(cls, engine, session: TapSession) -> "AsyncVLLM":
        """Taps over an AsyncLLM (or an engine client with its `generate`, `abort` and
        `collective_rpc`) that runs `session`'s plan already, e.g. `vllm serve`'s."""
        self = cls.__new__(cls)
        self.plan, self.session, self.engine = session.plan, session, engine
        self.collector = Collector(engine, session)
        self._blocks, self._ready = None, None
        return self

    async def generate(self, prompt, sampling_params=None, request_id: str = "", *, taps: TapRequest | None = None,
                       **kwargs) -> AsyncGenerator:
        """vLLM's `AsyncLLM.generate` with `taps` (one `TapRequest`, or None: untapped). A bad
        request raises `RequestError` before anything is submitted."""
        from vllm import SamplingParams

        where = f"request {request_id}"
        prepared = self.session.prepare(sampling_params if sampling_params is not None else SamplingParams(),
                                        self.session.check(taps, where), where, prompt)
        await self._setup()
        self.collector.flush(now=True)   # chunks the caller dropped go back before more run
        stream = self.engine.generate(salted(prompt, prepared.salt), prepared.params, request_id, **kwargs)
        done = False
        try:
            async for out in stream:
                if out.finished:
                    done = True
                    if prepared.wire is not None and out.outputs and out.outputs[0].finish_reason == "abort":
                        self._aborted(out, prepared.wire.id)
                    else:
                        result = await self.collector.result(prepared.wire.id) if prepared.wire is not None else None
                        self.session.finish(out, prepared.wire, result)
                yield out
        finally:
            # Aborted, cancelled, or the consumer stopped: vLLM aborts the request when its
            # generator closes; then the worker gives back what it held for it.
            await stream.aclose()
            if not done and prepared.wire is not None:
                self.collector.drop(prepared.wire.id)

    def _aborted(self, out, tid: str) -> None:
        """vLLM's final output of a request aborted from outside: its captures stop wherever
        the abort found them, so they are dropped (and what it held goes back)."""
        self.collector.drop(tid)
        e = RequestError(f"request {out.request_id}: aborted before it finished; its taps are dropped")
        out.taps, out.saved, out.error = Taps(error=e), {}, e

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """vLLM's abort; the aborted requests' `generate` ends and gives back what they held."""
        await self.engine.abort(request_id)

    async def held(self) -> list[dict[str, int]]:
        """What requests hold on each worker now (`TapWorker.tapc_held`), after the chunks the
        caller dropped are given back."""
        await self.collector.settle()
        return await every_worker(self.engine, "tapc_held")

    async def aclose(self) -> None:
        """Stop the collector (its task ends on this loop) and shut the engine down; call it on
        the loop that ran the requests, so no task is left pending when the loop closes."""
        await self.collector.aclose()
        self.engine.shutdown()
        await asyncio.sleep(0)   # the engine's own tasks, cancelled by its shutdown, end here

    def shutdown(self) -> None:
        """`aclose` for callers off the loop: the collector task is cancelled, not awaited."""
        self.collector.close()
        self.engine.shutdown()

    async def _setup(self) -> None:
        """Engine-wide blocks reach the workers once, before the first request."""
        if not self._blocks:
            return
        if self._ready is None:
            import cloudpickle

            self._ready = asyncio.ensure_future(
                every_worker(self.engine, "tapc_set_blocks", (cloudpickle.dumps(dict(self._blocks)),)))
        await asyncio.shield(self._ready)


async def every_worker(engine, method: str, args: tuple = ()) -> list:
    """`collective_rpc` on every worker of every engine, one reply each, an engine's workers in
    rank order and the engines in turn. Under data parallelism vLLM's own `collective_rpc`
    answers with the first engine's workers only (`DPAsyncMPClient.call_utility_async`), and a
    request's results are on the engine that ran it: each engine is asked itself."""
    core = getattr(engine, "engine_core", None)
    engines = getattr(core, "core_engines", None) or ()
    if len(engines) < 2:
        return await engine.collective_rpc(method, args=args)
    replies = await asyncio.gather(*(core._call_utility_async("collective_rpc", method, None, args, None, engine=e)
                                     for e in engines))
    return [reply for one in replies for reply in one]


class Collector:
    """Batches the engine round trips of many concurrent requests: one `tapc_collect` of every
    request that finished (awaited with `result`) or was abandoned (`drop`: its result is
    discarded) since the last round, carrying the chunks callers dropped back to the workers.
    Every round trip is a call the engine makes between two steps of everyone's requests.
    Chunks dropped with no request to collect wait up to `RELEASE_DELAY_S` for one, then go in a
    `tapc_release` of their own. Runs as one task on the event loop, started on demand."""

    RELEASE_DELAY_S = 0.02

    def __init__(self, engine, session: TapSession):
        self.engine, self.session = engine, session
        self.waiting: dict[str, asyncio.Future] = {}
        self.dropped: list[str] = []
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.task: asyncio.Task | None = None
        self._later: asyncio.TimerHandle | None = None   # the release round `flush` scheduled

    def result(self, tid: str) -> asyncio.Future:
        """The collected `Result` of a finished request, at the next round."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting[tid] = fut
        self._kick()
        return fut

    def drop(self, tid: str) -> None:
        """A request nobody will read: collect it anyway, so the worker frees what it holds."""
        self.dropped.append(tid)
        self._kick()

    def flush(self, now: bool = False) -> None:
        """Give back the chunks callers dropped: at the next round, started `now`, else with the
        next collect or on their own within `RELEASE_DELAY_S`."""
        if not self.session.arena.pending:
            return
        if now:
            self._cancel_later()
            self._kick()
        elif self._later is None:
            self._later = asyncio.get_running_loop().call_later(self.RELEASE_DELAY_S, self._release_round)

    def _release_round(self) -> None:
        self._later = None
        if self.session.arena.pending:
            self._kick()

    async def settle(self) -> None:
        """Until every round asked for so far, releases included, is done."""
        import gc

        gc.collect()   # captures the caller dropped in reference cycles note their chunks now
        while not self.idle.is_set() or self.wake.is_set() or self.session.arena.pending:
            self.flush(now=True)   # what a round discards meanwhile goes now, not after the delay
            await self.idle.wait()
            await asyncio.sleep(0)

    def close(self) -> None:
        self._cancel_later()
        if self.task is not None:
            self.task.cancel()

    async def aclose(self) -> None:
        """Cancel the task and wait for it to end."""
        self._cancel_later()
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _kick(self) -> None:
        self.idle.clear()
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            waiting, self.waiting = self.waiting, {}
            dropped, self.dropped = self.dropped, []
            try:
                await self._round(waiting, dropped)
            except Exception as e:   # the engine is gone or answered nonsense: each request hears why
                log.warning("tapc: collecting results failed: %s", e)
                for tid, fut in waiting.items():
                    if not fut.done():
                        fut.set_result(Result(tid, error=f"collecting its taps failed: {e}"))
            if not self.wake.is_set():
                self.idle.set()

    def _cancel_later(self) -> None:
        if self._later is not None:
            self._later.cancel()
            self._later = None

    async def _round(self, waiting: dict[str, asyncio.Future], dropped: list[str]) -> None:
        chunks = self.session.released()
        ids = [*waiting, *dropped]
        if not ids:
            if chunks:
                await every_worker(self.engine, "tapc_release", (chunks,))
            return
        got = self.session.results(await every_worker(self.engine, "tapc_collect", (ids, chunks)))
        for tid, fut in waiting.items():
            result = got.pop(tid, None)
            if fut.cancelled():          # its generate was cancelled while it waited
                if result is not None:
                    self.session.discard(result)
            else:
                fut.set_result(result)
        for result in got.values():      # the dropped ones
            self.session.discard(result)
        self.flush()                     # what was discarded goes back soon
