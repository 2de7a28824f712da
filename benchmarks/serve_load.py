"""bench_serve's clients: the request list of a mix (untapped, capturing, steered, both; streamed,
aborted mid-stream, half behind one shared system prompt, staggered arrivals) and its load over
real HTTP from concurrent clients, each capturing request's captures fetched as soon as its
response ends (over HTTP, or `via` shm: copied from the server's shared memory, then given back,
as bench_results.py fetches them too)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np

from tapc.serving.client import TapcClient, shared_views


@dataclass
class Job:
    i: int
    prompt: list[int]
    max_tokens: int
    kind: str                    # untapped | capture | steer | steer+capture
    positions: str = "all"
    vector: int = -1             # which registered vector steers it
    stream: bool = False
    abort_after: int = 0         # streamed chunks read before closing the connection (0: never)
    at: float = 0.0              # seconds after the start when it is sent
    inline: bool = False         # its captures come in its response (else fetched by id)
    save: bool = False           # its captures go to the server's save folder
    capture: str = "model.layers.*.resid"   # what a capturing request asks for (a glob over the server's taps)


@dataclass
class Done:
    job: Job
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: int = 0
    tid: str | None = None
    error: str | None = None
    aborted: bool = False
    inline: dict | None = None   # the response's `tapc` object (inline results)
    fetched: bytes | None = None  # its captures, fetched as soon as its response ended (safetensors)
    taps: dict | None = None      # or (`--via shm`) copied from the server's shared memory
    result_error: str = ""        # the error its fetched results carry ('' if none)


KINDS = ("untapped", "capture", "steer", "steer+capture")


MIX = (0.4, 0.2, 0.25, 0.15)   # the share of each kind in the default load


def make_jobs(n: int, vocab: int, rate: float, abort: float, seed: int = 0, mix=MIX, inline: float = 0.0,
              save: float = 0.0, capture: str = Job.capture) -> list[Job]:
    rng = random.Random(seed)
    bounds = np.cumsum(mix) / sum(mix)
    system = [rng.randrange(3, vocab) for _ in range(256)]
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 200))]
        prompt = system + own if i % 2 == 0 else own
        r = rng.random()
        kind = KINDS[min(int(np.searchsorted(bounds, r, side="right")), len(KINDS) - 1)]
        job = Job(i, prompt, rng.randrange(16, 96), kind, at=t,
                  positions=rng.choice(["all", "prompt", "generated"]), vector=rng.randrange(3), capture=capture)
        job.stream = rng.random() < 0.25
        if rng.random() < abort:
            job.stream, job.abort_after = True, rng.randrange(1, 8)
        # by index, not the generator: the other draws stay what they were without --inline
        job.inline = "capture" in kind and (i * 0.618034) % 1.0 < inline
        # the save folder keeps every row: requests capturing all of them
        job.save = "capture" in kind and job.positions == "all" and not job.inline and (i * 0.381966) % 1.0 < save
        jobs.append(job)
    return jobs


async def send(session, url: str, model: str, job: Job, tapped: bool, via: str = "http") -> Done:
    import aiohttp

    done = Done(job)
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": job.stream}
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    if tapped and job.kind != "untapped":
        capture = "capture" in job.kind and not job.save   # a saving request: the folder's captures and positions
        body.update(TapcClient.ask(capture=job.capture if capture else (), positions=job.positions if capture else "all",
                                   params={"steer": f"v{job.vector}"} if "steer" in job.kind else None,
                                   inline=job.inline, save=job.save))
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            done.tid = resp.headers.get("x-tapc-id")
            if resp.status != 200:
                done.error = f"HTTP {resp.status}: {await resp.text()}"
                return done
            if not job.stream:
                data = await resp.json()
                done.tokens = list(data["choices"][0]["token_ids"])
                usage = data["usage"]
                done.inline = data.get("tapc")
            else:
                usage, chunks = None, 0
                async for line in sse_lines(resp):
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    for choice in event.get("choices") or []:
                        done.tokens += choice.get("token_ids") or []
                        chunks += 1
                    usage = event.get("usage") or usage
                    done.inline = event.get("tapc") or done.inline
                    if job.abort_after and chunks >= job.abort_after:
                        done.aborted = True
                        resp.close()
                        return done
            done.prompt_tokens = usage["prompt_tokens"]
            done.cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if done.tid and "capture" in job.kind and not (job.save or (done.inline and "safetensors" in done.inline)):
            # as a client would: its captures at once (the server then holds nothing of it), in
            # the timed load, over the same HTTP; or, `via` shm, where they lie, copied out before
            # the server gets the memory back
            async with session.get(f"{url}/v1/tapc/results/{done.tid}", params={"via": via}) as resp:
                if resp.status != 200:
                    done.error = f"fetching its captures: HTTP {resp.status}: {await resp.text()}"
                elif via == "http":
                    done.fetched = await resp.read()
                    n = int.from_bytes(done.fetched[:8], "little")
                    done.result_error = json.loads(done.fetched[8:8 + n]).get("__metadata__", {}).get("error", "")
                else:
                    lent = await resp.json()
                    done.result_error = lent.get("error", "")
                    done.taps = await asyncio.to_thread(kept, lent["tensors"])
                    async with session.delete(f"{url}/v1/tapc/results/{done.tid}") as back:
                        if back.status != 200:
                            done.error = f"giving back its captures: HTTP {back.status}: {await back.text()}"
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError) as e:
        done.error = f"{type(e).__name__}: {e}"
    return done


def kept(described: dict) -> dict:
    """A copy of each tensor a `via=shm` reply describes (tapc.serving.client.shared_views)."""
    return {k: v.clone() for k, v in shared_views(described).items()}


async def sse_lines(resp):
    """The response's lines of any length: an inline result's event is one line of up to 16 MiB of
    base64, past aiohttp's line limit (512 KiB) for `async for line in resp.content`."""
    parts: list[bytes] = []  # the current line's pieces: joined once, not re-scanned per chunk
    async for chunk in resp.content.iter_any():
        *ends, tail = chunk.split(b"\n")
        for end in ends:
            yield b"".join(parts) + end
            parts = []
        parts.append(tail)
    if any(parts):
        yield b"".join(parts)


async def load(url: str, model: str, jobs: list[Job], clients: int, tapped: bool,
               via: str = "http") -> tuple[list[Done], float]:
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    out: list[Done] = []
    start = time.perf_counter()

    async def client(session):
        while not queue.empty():
            job = queue.get_nowait()
            delay = job.at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            out.append(await send(session, url, model, job, tapped, via))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return sorted(out, key=lambda d: d.job.i), time.perf_counter() - start
