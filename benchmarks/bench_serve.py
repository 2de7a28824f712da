"""Load test of `tapc serve` against vanilla `vllm serve`, both started by this script on one GPU.

    source .gpu/activate && python3 benchmarks/bench_serve.py --quick --out bench_serve.md

A random Llama checkpoint with realistic init (and a word-level tokenizer over its vocabulary)
is written; a vanilla server and a tapc server (captures of every layer's residual stream,
a steering edit with per-request vectors) run side by side, each on its share of the GPU.
After 64 untimed warm-up requests, the same request list goes to each, over real HTTP, from `--clients` concurrent clients with
staggered (Poisson) arrivals: untapped, capturing (all / prompt / generated rows), steered by
one of three registered vectors (some capturing too), a share streamed, `--abort` of them
aborted mid-stream (the client closes the connection), and half behind one shared system
prompt. The vanilla server gets the same prompts and lengths without taps. `--mix` sets the
shares of the four kinds; several mixes run one after the other on the same two servers (one
server start, minutes of GPU time, for all), each with prompts of its own. Each mix runs
`--rounds` times on each server, the servers in turn (the other one first every other round),
with new prompts every round: one 10-second load's reading moved by a fifth from run to run,
so the table gives medians and each round's own ratio; `--check-rounds K` checks the answers
of the first K rounds only (the check is the longest part of a round), so that a run of limited
time holds more timed rounds. `--inline S`: a
share S of the capturing requests ask for their captures in the response (checked the same way).
`--block`: the tapc server also runs a Python block at a layer, named by import path and
imported by each worker (`tapc serve --block`); the norms it saves are checked against HF's.
`--save S`: the tapc server has a save folder (`tapc serve --save-to`), and a share S of the
requests capturing all rows ask `save: true`; once the servers have stopped (which commits the
last shard), their rows in the folder's shards are checked against HF's like the fetched ones.

A capturing request's client fetches its captures (`GET /v1/tapc/results/{id}`) as soon as its
response ends, inside the timed load, as a client would (until 2026-12-01 they were fetched after
the load, so every result of a load stayed in the server's host memory meanwhile and the load grew
it, which costs the engine's steps about a second a GiB: the table says how long the tapc
server spent doing so in each load).

Checked for every finished request of the tapc server, against HF transformers on the same
weights (teacher-forced on the tokens the request went through, with the request's own
steering): every capture has exactly the rows its positions promise and equals HF's within
bf16 tolerance; every generated token is HF's greedy choice unless HF's top two are within a
near-tie margin (vLLM is not batch-invariant). A wider model puts vLLM's bf16 logits further from
the float32 reference's, on vanilla's path as on tapc's, so a token within `NEAR` margins is a near
miss: the same check runs on vanilla's own answers to the requests that steer nothing, both
servers' near misses are printed a load, and tapc's are a problem only where they are more often
than vanilla's; a farther miss is a problem on its own. No response lost; the server healthy after, and
its workers hold nothing (`GET /v1/tapc/held`) once every result was fetched (the aborted
requests' too: a response the server sent whole just before its client closed keeps its results).
Reported: output tokens/s of each server and their ratio (goal >= 0.95x), and the share of
untapped prompt tokens served from the prefix cache (`usage.prompt_tokens_details`, goal: equal
to vanilla's). Beside them, what each engine did in the load, from vLLM's own counters at
/metrics: its steps, tokens a step, prompt tokens it computed and wall ms a step, which say
whether a slower tapc server computed more prefill (its cache salts), took longer a step (the
engine's own cost), or ran smaller steps (requests reaching it more slowly: the API side); and
for the tapc server, the engine thread's milliseconds a step in tapc's own hooks, which the
worker times itself (`GET /v1/tapc/host-time`), so the part of a slower step that is tapc's
host work is read without a sampler.
`--profile MD` says where a process's time went: every process of both servers samples its
stacks during the timed loads (serve_stacks/sitecustomize.py, on their PYTHONPATH), written to
MD per process and thread; the sampling slows both servers' loads. `--timers MD` times the engine
thread's calls of vLLM's engine-loop functions (scheduler, executor, model runner, the wait for
the GPU: timers.py) on both servers and writes their ms a step side by side: which part of a
slower tapc step is vLLM's own work grown, and which is not vLLM's; with the GPU's side of each
step (CUDA events) and Python's collections, each mix apart. `--kernels MD` records the GPU's
kernel and copy times in both engine cores (CUPTI, devicetime.py), each mix apart: whether a
slower tapc step is more GPU work, and which kernels. `--dummy-weights` serves a
model too large to write to disk quickly with vLLM's own random weights on both servers (nothing
can be checked then: `--check-rounds 0`), and `--capture GLOB` sets what capturing requests
ask for (e.g. one layer of 32, as an SAE harvest asks): the load where a step is the GPU's work
rather than the host's.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fnmatch
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEER_LAYER, ALPHA = 1, 4.0
BLOCK_LAYER = 2   # --block: `probe` at this layer's residual stream, imported by the server by path
WARMUP = 64   # requests sent to each server before its timed run


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


def write_model(path: str, hidden: int, layers: int, vocab: int, weights: bool = True) -> None:
    """A random Llama and its word-level tokenizer; `weights` False: the config and tokenizer only,
    for servers that make their own weights (`--load-format dummy`)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                                      num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=4096,
                                      initializer_range=0.02, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    if weights:
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    else:
        config.dtype, config.architectures = torch.bfloat16, ["LlamaForCausalLM"]   # as save_pretrained of the model writes them
        config.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1",
                                         unk_token="t2").save_pretrained(path)


def probe(ctx, x):
    """The `--block` block (each worker imports it by path: `benchmarks.bench_serve:probe`): every
    row's norm at its point, which the check compares with HF's."""
    ctx.save("norm", x.float().norm(dim=-1).cpu())


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


def taps_of(job: Job) -> dict | None:
    ask = {}
    if job.save:   # the folder's captures and positions
        ask["save"] = True
    elif "capture" in job.kind:
        ask["capture"] = [job.capture]
        ask["positions"] = job.positions
    if "steer" in job.kind:
        ask["params"] = {"steer": f"v{job.vector}"}
    if job.inline:
        ask["inline"] = True
    return {"tapc": json.dumps(ask)} if ask else None


async def send(session, url: str, model: str, job: Job, tapped: bool, via: str = "http") -> Done:
    import aiohttp

    done = Done(job)
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": job.stream}
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    xargs = taps_of(job) if tapped else None
    if xargs:
        body["vllm_xargs"] = xargs
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
    from tapc.serving.client import shared_views

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


def start_server(cmd: list[str], log: str, readings: dict[str, str] | None = None) -> subprocess.Popen:
    """`readings`: environment variable -> folder, where every process of the server leaves its
    reading of each load (`Stacks`, `CallTimes`: serve_stacks/sitecustomize.py)."""
    env = None
    if readings:
        for folder in readings.values():
            os.makedirs(folder, exist_ok=True)
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_stacks")
        env = {**os.environ, **readings,
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


class Window:
    """A reading that every process of one server takes while a timed load runs: the file `on`
    in `folder` marks the load (serve_stacks/sitecustomize.py); each load leaves a file a process."""

    def __init__(self, folder: str):
        self.folder = folder
        self.flag = os.path.join(folder, "on")

    def __enter__(self):
        open(self.flag, "w").close()

    # A process's reading may take a while to write once the flag goes (CUPTI's records of a load
    # are hundreds of thousands of kernels): the mix's readings are set aside only once all are in.
    WRITE_S = 600

    def __exit__(self, *exc):
        os.remove(self.flag)
        time.sleep(0.2)   # each process sees the flag gone within a tick
        deadline = time.time() + self.WRITE_S
        while any(f.endswith(".open") for f in os.listdir(self.folder)):
            if time.time() > deadline:
                raise RuntimeError(f"a server process did not write its reading in {self.WRITE_S} s ({self.folder})")
            time.sleep(0.1)

    def set_aside(self, name: str) -> "Window":
        """The loads' readings so far, moved into a folder of their own (`name`, in this one), as
        a window of that folder: one mix's loads, read apart from the next mix's."""
        dest = os.path.join(self.folder, name)
        os.makedirs(dest)
        for f in os.listdir(self.folder):
            if f.endswith(".json"):
                os.replace(os.path.join(self.folder, f), os.path.join(dest, f))
        return type(self)(dest)

    def readings(self) -> list[dict]:
        out = []
        for path in sorted(f for f in os.listdir(self.folder) if f.endswith(".json")):
            with open(os.path.join(self.folder, path)) as f:
                out.append(json.load(f))
        return out


class Stacks(Window):
    """`--profile`: stack samples of every process of one server during its timed loads
    (stacks.py), summed over the loads, as markdown per process and thread."""

    ENV = "TAPC_STACKS_DIR"

    def report(self, server: str, top: int = 3) -> list[str]:
        from collections import Counter

        from stacks import report_thread

        procs: dict[str, dict[str, dict]] = {}
        for got in self.readings():
            threads = procs.setdefault(f"{got['process']} (pid {got['pid']})", {})
            for tname, t in got["threads"].items():
                if tname in ("tapc-stacks", "tapc-sampler", "tapc-timers"):   # the readings' own
                    continue
                acc = threads.setdefault(tname, {"samples": 0, "idle": 0, "inclusive": Counter(), "tapc": Counter(),
                                                 "innermost": Counter()})
                acc["samples"] += t["samples"]
                acc["idle"] += t["idle"]
                for key in ("inclusive", "tapc", "innermost"):
                    acc[key].update(dict(t[key]))
        lines = [f"## {server} server", ""]

        def busy(threads):
            return sum(t["samples"] - t["idle"] for t in threads.values())

        for proc, threads in sorted(procs.items(), key=lambda kv: -busy(kv[1])):
            if busy(threads) < 0.05 * max(t["samples"] for t in threads.values()):
                continue   # a helper process that waited throughout (resource tracker, ...)
            lines += [f"### process `{proc}`", ""]
            for tname, t in sorted(threads.items(), key=lambda kv: kv[1]["idle"] - kv[1]["samples"])[:top]:
                lines += report_thread(tname, {**t, **{k: t[k].most_common(25) for k in ("inclusive", "tapc", "innermost")}})
        return lines


class CallTimes(Window):
    """`--timers`: the engine thread's milliseconds a step in vLLM's engine-loop functions
    (timers.py), summed over one server's timed loads."""

    ENV = "TAPC_TIMERS_DIR"

    def per_step(self, steps: float) -> tuple[dict[str, tuple[float, float]], list[str]]:
        """{function: (ms a step, calls a step)} of the engine-core process, and targets missing."""
        engine = [got for got in self.readings() if got["process"].startswith("EngineCore")]
        if not engine:
            raise RuntimeError(f"--timers: no engine-core process left a reading in {self.folder}")
        seconds, calls, missing = {}, {}, set()
        for got in engine:
            missing.update(got["missing"])
            for k, v in got["seconds"].items():
                seconds[k] = seconds.get(k, 0.0) + v
                calls[k] = calls.get(k, 0) + got["calls"][k]
        steps = max(steps, 1.0)
        return {k: (seconds[k] * 1e3 / steps, calls[k] / steps) for k in seconds}, sorted(missing)


class Kernels(Window):
    """`--kernels`: the GPU's time by kernel (CUPTI's records, devicetime.py) in one server's
    engine-core process during its timed loads."""

    ENV = "TAPC_KERNELS_DIR"

    def summed(self) -> dict[str, list]:
        """{kernel or copy: [launches, GPU us]} summed over the loads."""
        got: dict[str, list] = {}
        for reading in self.readings():
            for name, (count, us) in reading["kernels"].items():
                acc = got.setdefault(name, [0, 0.0])
                acc[0] += count
                acc[1] += us
        if not got:
            raise RuntimeError(f"--kernels: no process recorded a kernel in {self.folder}")
        return got


def kernels_report(kernels: dict[str, Kernels], steps: dict[str, float], mix: str, top: int = 30) -> list[str]:
    """Both servers' GPU time a step over one mix's loads: kernels, copies and tapc's own
    kernels in all (devicetime.totals), then the kernels whose time differs most between the two."""
    from devicetime import differing, totals

    got = {name: k.summed() for name, k in kernels.items()}
    per = {name: max(steps[name], 1.0) for name in got}
    sums = {name: totals(g) for name, g in got.items()}
    lines = [f"# bench_serve --kernels, mix {mix}: the GPU's ms a step (CUPTI's kernel and copy records in each "
             "engine-core process during the timed loads; streams that overlap count twice; the records slow the "
             "host, so these loads' speeds are not the benchmark's)", "",
             f"steps: vanilla {steps['vanilla']:.0f}, tapc {steps['tapc']:.0f}", "",
             "| GPU work | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla launches a step | tapc launches a step |",
             "|---|---:|---:|---:|---:|---:|"]
    for what, ms, n in (("kernels", "kernels_ms", "launches"), ("copies and memsets", "copies_ms", "copies"),
                        ("tapc's kernels", "tapc_ms", "tapc_launches")):
        (vm, vn), (tm, tn) = ((sums[name][ms] / per[name], sums[name][n] / per[name]) for name in ("vanilla", "tapc"))
        lines.append(f"| {what} | {vm:.3f} | {tm:.3f} | {tm - vm:+.3f} | {vn:.1f} | {tn:.1f} |")

    lines += ["", f"The {top} kernels and copies whose GPU time a step differs most:", "",
              "| kernel or copy | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla launches a step | tapc launches a step |",
              "|---|---:|---:|---:|---:|---:|",
              *differing(got["vanilla"], got["tapc"], per["vanilla"], per["tapc"], top)]
    return lines + [""]


def call_times_report(timers: dict[str, CallTimes], steps: dict[str, float], seconds: dict[str, float],
                      mix: str) -> list[str]:
    """Both servers' engine threads side by side over one mix's loads: ms a step in each timed
    function (inclusive: a function's callees count in it too), calls a step, and the difference."""
    got = {name: t.per_step(steps[name]) for name, t in timers.items()}
    wall = {name: seconds[name] * 1e3 / max(steps[name], 1.0) for name in timers}
    lines = [f"# bench_serve --timers, mix {mix}: the engine thread's ms a step in vLLM's engine-loop functions, "
             "during the timed loads (inclusive; calls on the engine core's main thread only; (GPU) rows from "
             "CUDA events, (gc) rows Python's collections)", "",
             f"steps: vanilla {steps['vanilla']:.0f}, tapc {steps['tapc']:.0f}", "",
             "| function | vanilla ms a step | tapc ms a step | tapc - vanilla | vanilla calls a step | tapc calls a step |",
             "|---|---:|---:|---:|---:|---:|",
             f"| (wall) | {wall['vanilla']:.3f} | {wall['tapc']:.3f} | {wall['tapc'] - wall['vanilla']:+.3f} | | |"]
    names = sorted(set(got["vanilla"][0]) | set(got["tapc"][0]), key=lambda k: -got["vanilla"][0].get(k, (0, 0))[0])
    for k in names:
        (vm, vc), (tm, tc) = got["vanilla"][0].get(k, (0.0, 0.0)), got["tapc"][0].get(k, (0.0, 0.0))
        lines.append(f"| `{k}` | {vm:.3f} | {tm:.3f} | {tm - vm:+.3f} | {vc:.2f} | {tc:.2f} |")
    missing = sorted(set(got["vanilla"][1]) | set(got["tapc"][1]))
    if missing:
        lines += ["", f"not in this vLLM (not timed): {', '.join(missing)}"]
    return lines


_T0 = time.perf_counter()


def progress(what: str) -> None:
    """A line on stderr with the seconds since the start: a run cut short by a time limit
    shows how far the run got (the tables print only once a round is done)."""
    print(f"[bench_serve +{time.perf_counter() - _T0:.0f} s] {what}", file=sys.stderr, flush=True)


def wait_healthy(proc: subprocess.Popen, port: int, log: str) -> None:
    import urllib.request

    for _ in range(600):
        if proc.poll() is not None:
            with open(log, errors="replace") as f:   # its log may be on a machine nobody reads after
                tail = "".join(f.readlines()[-40:])
            raise SystemExit(f"server on port {port} exited ({proc.returncode}); the end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"server on port {port} did not start in 10 minutes; see {log}")


def http_json(method: str, url: str, body=None):
    import urllib.request

    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status, r.read()


class Reference:
    """HF transformers on the checkpoint: residual stream per layer and logits, with steering.
    In float32 (the checkpoint's bf16 weights exactly): the served engine's bf16 rounding is
    then the only error a comparison sees, where a bf16 reference adds its own (four greedy
    tokens in 7,600 untapped requests of one run fell outside the near-tie margin against a
    bf16 reference, on vanilla vLLM's own path). Sequences run in batches (right-padded: causal
    attention keeps every real position's activations what they are alone, up to the batched
    kernels' rounding)."""

    # Padded tokens per batch at the default model (1024 wide, 8 layers); wider or deeper models
    # get fewer, in proportion: the hooks keep every layer's float32 rows of a batch on the GPU.
    TOKENS = 32768

    def __init__(self, path: str, vectors, device: str = "cuda"):
        import torch
        import transformers

        self.torch, self.device = torch, device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        config = self.model.config
        self.tokens = max(2048, self.TOKENS * 1024 * 8 // (config.hidden_size * config.num_hidden_layers))
        self.vectors = [torch.tensor(v, dtype=torch.float32, device=device) for v in vectors]

    def run(self, seqs: list[tuple[list[int], int, bool]]) -> list[tuple[dict, object]]:
        """For each (tokens, steering vector or -1, residual wanted): ({key: [tokens, hidden]
        float32 on the CPU} or {}, logits [tokens, vocab] float32 on the device)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        out: list = [None] * len(seqs)
        batch: list[int] = []
        for i in order:
            if batch and (len(batch) + 1) * len(seqs[i][0]) > self.tokens:
                self._batch([seqs[j] for j in batch], batch, out)
                batch = []
            batch.append(i)
        if batch:
            self._batch([seqs[j] for j in batch], batch, out)
        return out

    def _batch(self, seqs, where: list[int], out: list) -> None:
        torch = self.torch
        width = max(len(t) for t, _, _ in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        steer = torch.zeros((len(seqs), 1, self.model.config.hidden_size), dtype=torch.float32, device=self.device)
        for b, (tokens, vector, _) in enumerate(seqs):
            ids[b, :len(tokens)] = torch.tensor(tokens)
            if vector >= 0:
                steer[b, 0] = ALPHA * self.vectors[vector]
        layers: list = []

        def hook(i):
            def f(mod, args, out):
                h = out[0] if isinstance(out, tuple) else out
                layers.append(h)
                if i == STEER_LAYER:   # + 0 on the rows not steered
                    h = h + steer
                    return (h, *out[1:]) if isinstance(out, tuple) else h
            return f

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.model.model.layers)]
        try:
            with torch.no_grad():
                logits = self.model(ids.to(self.device)).logits.float()
        finally:
            for h in handles:
                h.remove()
        for b, (tokens, _, resid) in enumerate(seqs):
            n = len(tokens)
            seen = {f"model.layers.{i}.resid": h[b, :n].float().cpu() for i, h in enumerate(layers)} if resid else {}
            out[where[b]] = (seen, logits[b, :n])


# A token HF scores at most this many margins below its top choice is a near miss: bf16 drift,
# which grows with the model's width and depth (at 4096 wide, 8 layers, vanilla vllm serve's
# answers missed the margin by up to 2.2 margins as often as tapc serve's: 149 and 158 of 1,135).
# Near misses are counted on both servers and compared; a farther one is a problem on its own.
NEAR = 4.0


@dataclass
class Miss:
    text: str
    near: bool   # within NEAR margins of HF's top


def greedy_miss(rows, tokens: list[int]) -> Miss | None:
    """Whether `tokens` are greedy under the reference's logits `rows` ([tokens, vocab], the rows
    that chose them): each HF's top choice, but for near ties; the first one that is not, or None."""
    import torch

    top2 = rows.topk(2, dim=-1).values
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
    # Two bf16 steps at the logit's size: vLLM's bf16 logits are one step from the float32
    # reference's at a near tie (the GPU tests use the same margin against a bf16 HF).
    margin = 2e-2 * rows.abs().amax(dim=-1) + 1e-3
    gap = top2[:, 0] - chosen
    bad = (gap > margin) & ((top2[:, 0] - top2[:, 1]) > margin)
    if not bad.any():
        return None
    k = int(bad.nonzero()[0])
    far = bad & (gap > NEAR * margin)
    return Miss(f"generated token {k} is not the greedy choice (HF top {top2[k, 0]:.4f}, chosen {chosen[k]:.4f})",
                near=not bool(far.any()))


def more_often(k: int, n: int, j: int, m: int) -> bool:
    """Whether k near misses of n are more than j of m (the baseline) explains: a one-sided
    two-proportion test at three standard errors, plus one request."""
    if n == 0:
        return False
    p = (k + j) / (n + m)
    bound = j / m if m else 0.0
    return k / n > bound + 3 * math.sqrt(p * (1 - p) * (1 / n + (1 / m if m else 1.0))) + 1 / n


def vanilla_misses(ref: Reference, done: list[Done]) -> tuple[int, int, int]:
    """The greedy-token check on vanilla vllm serve's own answers (its unsteered requests: it
    steers none): (requests with a near miss, with a farther one, requests checked). The baseline
    for tapc's near misses: a wider or deeper model puts vLLM's bf16 logits further from the
    float32 reference's, on vanilla's path as on tapc's."""
    todo = [d for d in done if not (d.error or d.aborted) and "steer" not in d.job.kind
            and len(d.tokens) == d.job.max_tokens]
    refs = ref.run([((d.job.prompt + d.tokens)[:-1], -1, False) for d in todo])
    misses = [greedy_miss(logits[len(d.job.prompt) - 1:], d.tokens) for d, (_, logits) in zip(todo, refs)]
    near = sum(m is not None and m.near for m in misses)
    return near, sum(m is not None for m in misses) - near, len(todo)


def near_miss_problems(where: str, tapc: dict[str, tuple[int, int]], vanilla: tuple[int, int, int]) -> list[str]:
    """tapc's near misses ({"unsteered": (k, n), "steered": (k, n)}) against vanilla's answers to
    the requests that steer nothing (`vanilla_misses`): a problem where tapc's are more often."""
    j, _, m = vanilla
    return [f"{where}: {kind} requests' generated tokens miss the greedy margin more often on tapc serve ({k} of {n}) "
            f"than vanilla vllm serve's unsteered ones ({j} of {m})"
            for kind, (k, n) in tapc.items() if more_often(k, n, j, m)]


def check(ref: Reference, url: str, done: list[Done], block: bool = False,
          saved: list | None = None) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """Every finished tapc request against HF; the captures fetched from the server (`block`:
    and the norms the server's block saved). Saving requests: (their number, where, HF's rows,
    their tokens) go to `saved`, checked in the folder once the server has stopped. Returns the
    problems (a generated token far outside the greedy margin among them), and its near misses
    ({"unsteered": (near misses, checked), "steered": ...}), which `near_miss_problems` compares
    with vanilla's."""
    import torch
    from safetensors.torch import load

    from tapc.wire.positions import expected_rows, select

    problems, todo = [], []
    near = {"unsteered": [0, 0], "steered": [0, 0]}   # requests with a near miss, requests checked
    for d in done:
        job = d.job
        if d.error or d.aborted:
            continue
        if len(d.tokens) != job.max_tokens:
            problems.append(f"request {job.i}: {len(d.tokens)} tokens of {job.max_tokens}")
            continue
        todo.append(d)
    refs = ref.run([((d.job.prompt + d.tokens)[:-1], d.job.vector if "steer" in d.job.kind else -1,
                     "capture" in d.job.kind) for d in todo])
    for d, (seen, logits) in zip(todo, refs):
        job = d.job
        where = f"request {job.i} ({job.kind}, {job.positions}, stream={job.stream})"
        seq = job.prompt + d.tokens
        miss = greedy_miss(logits[len(job.prompt) - 1:], d.tokens)
        if miss and not miss.near:
            problems.append(f"{where}: {miss.text}")
        counts = near["steered" if "steer" in job.kind else "unsteered"]
        counts[0] += miss is not None and miss.near
        counts[1] += 1
        if "capture" not in job.kind:
            continue
        if job.save:
            if not (d.inline and "saved" in d.inline):
                problems.append(f"{where}: asked to save, the response carried {d.inline!r}")
            else:
                saved.append((d.inline["saved"], where, seen, seq[:-1]))
            continue
        if job.inline and not (d.inline and ("safetensors" in d.inline or "fetch" in d.inline)):
            problems.append(f"{where}: asked inline, the response carried {d.inline!r}")
            continue
        if d.taps is not None:
            taps = d.taps
        else:
            taps = load(base64.b64decode(d.inline["safetensors"]) if job.inline and "safetensors" in d.inline
                        else d.fetched)
        seen = {k: v for k, v in seen.items() if fnmatch.fnmatchcase(k, job.capture)}
        missing = sorted(set(seen) - set(taps))
        if missing:
            problems.append(f"{where}: its results lack {len(missing)} captures ({missing[0]}, ...)"
                            + (f"; their error: {d.result_error}" if d.result_error else ""))
        want = expected_rows(job.positions, len(job.prompt), len(d.tokens))
        pos = np.arange(len(seq) - 1)
        keep = torch.from_numpy(select(job.positions, pos, len(job.prompt)))
        norms = sorted((k for k in taps if k.startswith("saved/norm/")), key=lambda k: int(k.rsplit("/", 1)[1]))
        if block and job.positions == "all":   # the block sees every row; with positions "all" HF's are all here
            got = torch.cat([taps.pop(k) for k in norms]).float()
            hf = seen[f"model.layers.{BLOCK_LAYER}.resid"].norm(dim=-1).cpu()
            if got.shape != hf.shape or not torch.allclose(got, hf, rtol=3e-2, atol=1e-2):
                problems.append(f"{where}: the block's saved norms differ from HF's ({tuple(got.shape)} rows)")
        for k in norms:
            taps.pop(k, None)
        for key, got in taps.items():
            if got.shape[0] != want:
                problems.append(f"{where}: {key} has {got.shape[0]} rows, its positions promise {want}")
                continue
            problems += differs(where, key, got, seen[key][keep])
    return problems, {kind: tuple(c) for kind, c in near.items()}


def taken_after_abort(url: str, d: Done) -> list[str]:
    """Fetch what the server kept of a tapped request the client closed mid-stream, so that the
    check of what the workers hold afterwards is exact: its error (the server saw the response
    cut short) or, where the server had sent the whole response before the client closed, its
    results. Inline and saving requests keep nothing when their response went out whole."""
    import urllib.error

    try:
        http_json("GET", f"{url}/v1/tapc/results/{d.tid}?wait=60")
    except urllib.error.HTTPError as e:
        if e.code != 404 or not (d.job.inline or d.job.save):
            return [f"request {d.job.i} (aborted): fetching what the server kept gave HTTP {e.code}: {e.read()[:200]!r}"]
    return []


def differs(where: str, key: str, got, hf) -> list[str]:
    """A problem if `got` is not HF's rows within bf16 tolerance."""
    import torch

    rel = ((got.float() - hf).norm() / hf.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.float(), hf, dim=1).min().item()
    if rel > 5e-2 or cos < 0.99:
        return [f"{where}: {key} differs from HF: relative error {rel:.4f}, worst cosine {cos:.4f}"]
    return []


def check_saved(folder: str, saved: list) -> list[str]:
    """The saved requests' rows in the stopped server's save folder: each request's number once,
    its token ids, every position, each key equal to HF's."""
    import torch

    from tapc.data import Shards
    from tapc.harvest.run import Manifest

    m = Manifest.read(folder)
    if not m.complete:
        return [f"{folder}: the manifest is not complete (the server did not stop cleanly)"]
    shards = Shards(folder)
    cols = {k: torch.cat([shards.load(k, i) for i in range(len(m.shards))]) if m.shards else torch.zeros(0)
            for k in (*m.keys, "request", "token_ids", "position")}
    problems = [f"{folder}: request {f['request']} failed: {f['error']}" for f in m.failed]
    for n, where, seen, tokens in saved:
        mine = cols["request"] == n
        if cols["token_ids"][mine].tolist() != tokens or cols["position"][mine].tolist() != list(range(len(tokens))):
            problems.append(f"{where}: saved as {n}, its rows' token ids or positions are not its own")
            continue
        for key in m.keys:
            problems += differs(f"{where} (saved as {n})", key, cols[key][mine], seen[key])
    return problems


# vLLM's own counters (Prometheus text at /metrics), summed over its engines: `iteration_tokens_total`
# is a histogram of the tokens of each engine step, so its count is the steps and its sum their tokens
COUNTERS = {"vllm:iteration_tokens_total_count": "steps", "vllm:iteration_tokens_total_sum": "step_tokens",
            "vllm:prompt_tokens_total": "prompt_tokens", "vllm:prompt_tokens_cached_total": "cached_tokens"}


def engine_counters(url: str) -> dict[str, float]:
    _, text = http_json("GET", f"{url}/metrics")
    return counters_in(text.decode())


def counters_in(text: str) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def engine_view(before: dict, after: dict, seconds: float) -> dict:
    """What the engine did in a load: its steps, tokens a step, prompt tokens it computed (not
    read from the prefix cache) and wall ms a step. Beside vanilla's on the same load, it splits
    a slower server into more prefill (cache salts), slower steps (the engine's own cost), or
    smaller steps (requests reaching it more slowly)."""
    d = {k: after[k] - before[k] for k in after}
    steps = max(d["steps"], 1.0)
    return {"steps": d["steps"], "tokens_a_step": d["step_tokens"] / steps,
            "computed_k": (d["prompt_tokens"] - d["cached_tokens"]) / 1e3, "ms_a_step": seconds * 1e3 / steps}


def host_time(url: str) -> dict[str, float]:
    """tapc's hooks' seconds on the engine thread so far, and its steps (`/v1/tapc/host-time`;
    the slowest worker's where there are several)."""
    _, body = http_json("GET", f"{url}/v1/tapc/host-time")
    workers = json.loads(body)["workers"]
    return {k: max(w[k] for w in workers) for k in workers[0]}


def hooks_view(before: dict, after: dict) -> dict:
    """Milliseconds a step of each of tapc's hooks in a load (the engine thread's wall time in
    them, timed by the worker itself: no sampler's distortion)."""
    steps = max(after["steps"] - before["steps"], 1)
    return {k.removesuffix("_s"): (after[k] - before[k]) * 1e3 / steps for k in after if k.endswith("_s")}


def summary(done: list[Done], seconds: float) -> dict:
    finished = [d for d in done if not d.error and not d.aborted]
    untapped = [d for d in finished if d.job.kind == "untapped" and d.prompt_tokens]
    return {"requests": len(done), "finished": len(finished), "aborted": sum(d.aborted for d in done),
            "errors": [d.error for d in done if d.error][:5], "seconds": seconds,
            "tok_s": sum(len(d.tokens) for d in finished) / seconds,
            "hit_rate": sum(d.cached for d in untapped) / max(1, sum(d.prompt_tokens for d in untapped))}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def per_round(v: list[dict], t: list[dict]) -> list[float]:
    """Each round's tapc / vanilla output tok/s."""
    return [b["tok_s"] / a["tok_s"] for a, b in zip(v, t)]


def table_rows(mix: str, v: list[dict], t: list[dict]) -> list[str]:
    """A mix's two rows: each server's medians over the rounds, the ratio of the medians, and the
    median (range) of each round's own ratio."""
    ratios = per_round(v, t)
    rows = []
    for name, runs in (("vanilla vllm serve", v), ("tapc serve", t)):
        tapped = runs is t
        per = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if tapped else ""
        pinning = f"{sum(run['pinning'] for run in runs):.2f}" if tapped else ""
        hooks = ""
        if tapped:
            ms = {k: statistics.median(run["hooks"][k] for run in runs) for k in runs[0]["hooks"]}
            hooks = f"{sum(ms.values()):.3f} ({' / '.join(f'{v:.3f}' for v in ms.values())})"
        rows.append(f"| {mix} | {name} | {len(runs)} | {med(runs, 'requests'):.0f} | {med(runs, 'finished'):.0f} | "
                    f"{med(runs, 'aborted'):.0f} | {med(runs, 'seconds'):.1f} | {med(runs, 'tok_s'):.0f} | "
                    f"{med(runs, 'tok_s') / med(v, 'tok_s'):.3f}x | {per} | {med(runs, 'hit_rate'):.3f} | {pinning} | "
                    f"{med(runs, 'steps'):.0f} | {med(runs, 'tokens_a_step'):.1f} | {med(runs, 'computed_k'):.1f} | "
                    f"{med(runs, 'ms_a_step'):.2f} | {hooks} |")
    return rows


def pinning_s(log: str) -> float:
    """Seconds the tapc server's workers spent making and pinning host memory for captures so
    far, from their log lines (tapc/wire/arena.py): growth runs on the step's path, so a load that
    grows the arena pays it in its time."""
    with open(log, errors="replace") as f:
        return sum(float(m.group(1)) for m in re.finditer(r"made and pinned in ([0-9.]+) s", f.read()))


def report(args, rows: list[str], problems: list[str], final: bool, baseline: list[str] = ()) -> None:
    """The table so far (after each mix, so a run cut short keeps what it measured); `baseline`:
    the greedy-token check on vanilla's answers, a line per load."""
    lines = [f"shares of {', '.join(KINDS)} per mix", "",
             "medians over the rounds; per-round ratio: the median (range) of each round's tapc / vanilla", "",
             "engine columns, from each server's /metrics: its steps in the load, tokens a step, prompt tokens it "
             "computed (thousands; the rest came from the prefix cache) and wall ms a step; tapc's hooks: the "
             "engine thread's ms a step in them, from the worker's own timers (/v1/tapc/host-time): all (schedule "
             "/ begin_step / end_step / collect)", "",
             "| mix | server | rounds | requests | finished | aborted | seconds | output tok/s | ratio | "
             "per-round ratio | untapped prefix-cache hit rate | s pinning capture memory meanwhile (all rounds) | "
             "engine steps | tokens a step | prompt tokens computed (k) | ms a step | tapc's hooks, ms a step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]
    lines += [*baseline, ""] if baseline else []
    if final:
        lines.append(f"checks: {'all passed' if not problems else f'{len(problems)} problems'}")
    else:
        lines.append(f"(running: {len(problems)} problems in the checks run so far)")
    lines += [f"- {p}" for p in problems[:50]]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"bench_serve ({'quick' if args.quick else 'full'}, {args.hidden} wide, {args.layers} layers, "
                    f"{args.clients} clients, {args.requests} requests a mix, {args.api_server_count} API server "
                    f"process(es), {args.inline:g} of capturing requests inline, captures fetched via {args.via}"
                    f"{', a block by path' if args.block else ''}"
                    f"{f', {args.save:g} of all-row captures saved' if args.save else ''}"
                    f"{f', prefix rows kept in {args.prefix_rows_gib:g} GiB' if args.prefix_rows_gib else ''}"
                    f"{f', capturing {args.capture}' if args.capture != Job.capture else ''}"
                    f"{', dummy weights (vLLM makes them, the same on both servers; nothing checked)' if args.dummy_weights else ''}"
                    f"{f', answers checked in the first {args.check_rounds} round(s) of each mix' if args.check_rounds is not None and args.check_rounds < args.rounds else ''})\n\n{text}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 requests on a 4-layer, 512-wide model (< 5 min)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rate", type=float, default=200.0, help="mean arrivals per second")
    ap.add_argument("--abort", type=float, default=0.05, help="share of requests aborted mid-stream")
    ap.add_argument("--mix", nargs="+", default=[",".join(map(str, MIX))],
                    help=f"shares of {', '.join(KINDS)} (e.g. 1,0,0,0: untapped traffic alone); several "
                         "mixes run one after the other on the same two servers")
    ap.add_argument("--rounds", type=int, default=None,
                    help="loads of each mix on each server, in turn (new prompts each round); the table shows medians "
                         "(default 3, with --quick 1)")
    ap.add_argument("--check-rounds", type=int, default=None, metavar="K",
                    help="check the answers of each mix's first K rounds only (default: every round); the check "
                         "takes longer than a round's two loads, so more rounds fit in a run of limited time this way. Errors "
                         "and lost requests are counted in every round")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dummy-weights", action="store_true",
                    help="both servers make their own random weights (vLLM's --load-format dummy, the same on both): "
                         "models too large to write to disk quickly (e.g. --hidden 4096 --layers 32, an 8B-sized body "
                         "whose steps are the GPU's, not the host's). There is no checkpoint for HF, so nothing is "
                         "checked: needs --check-rounds 0")
    ap.add_argument("--capture", default=Job.capture,
                    help="what capturing requests ask for, a glob over the server's taps (every layer's residual "
                         "stream); e.g. one layer's, as an SAE harvest asks, on a model of many")
    ap.add_argument("--inline", type=float, default=0.0,
                    help="share of capturing requests that ask for their captures in the response")
    ap.add_argument("--block", action="store_true",
                    help="the tapc server also runs a Python block (imported by path) at a layer: every request "
                         "then has taps, and the graph splits there")
    ap.add_argument("--save", type=float, default=0.0,
                    help="share of the requests capturing all rows that ask to be saved in the server's save folder")
    ap.add_argument("--via", choices=("http", "shm"), default="http",
                    help="how clients fetch their captures: the bytes over HTTP, or (the client on the server's "
                         "host) where they lie in the server's shared memory, copied, then given back")
    ap.add_argument("--prefix-rows-gib", type=float, default=0.0,
                    help="the tapc server keeps captured rows of shared prompt blocks (tapc serve --prefix-rows-gib), "
                         "so captures of prompt rows read the prefix cache")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API server processes of each server (vLLM's --api-server-count)")
    ap.add_argument("--out", default=None, help="write the summary table (markdown) here")
    ap.add_argument("--profile", default=None, metavar="MD",
                    help="sample the stacks of every process of both servers during the timed loads (a "
                         "thread per process takes the GIL every 2 ms: slower loads) and write them here")
    ap.add_argument("--kernels", default=None, metavar="MD",
                    help="record the GPU's kernel and copy times (CUPTI) in both servers' engine cores during the "
                         "timed loads (benchmarks/devicetime.py) and write each mix's ms a step here; the records slow "
                         "both servers")
    ap.add_argument("--timers", default=None, metavar="MD",
                    help="time the engine thread's calls of vLLM's engine-loop functions on both servers during "
                         "the timed loads (benchmarks/timers.py: two clock reads a call) and write ms a step here")
    args = ap.parse_args()
    import record   # here: the servers import this module as benchmarks.bench_serve, from the root

    if args.quick:
        args.requests, args.hidden, args.layers = 300, 512, 4
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.dummy_weights and (args.check_rounds != 0 or args.save or args.block):
        ap.error("--dummy-weights: there are no weights for HF's reference; give --check-rounds 0, and no --save or --block")
    mixes = []
    for text in args.mix:
        mix = [float(x) for x in text.split(",")]
        if len(mix) != len(KINDS) or min(mix) < 0 or sum(mix) <= 0:
            ap.error(f"--mix {text}: give {len(KINDS)} shares >= 0 ({', '.join(KINDS)}), not all 0")
        mixes.append(mix)
    vocab = 2048
    work = tempfile.mkdtemp(prefix="bench-serve-")
    model = os.path.join(work, "model")
    write_model(model, args.hidden, args.layers, vocab, weights=not args.dummy_weights)
    vectors = [np.random.default_rng(10 + k).standard_normal(args.hidden).astype(np.float32) for k in range(3)]
    common = ["--gpu-memory-utilization", "0.35", "--max-model-len", "2048", "--enable-prompt-tokens-details",
              "--attention-backend", os.environ.get("TAPC_ATTENTION_BACKEND", "TRITON_ATTN"),
              "--max-num-seqs", "128", *(["--load-format", "dummy"] if args.dummy_weights else [])]
    if args.api_server_count > 1:   # tapc's processes then share vectors and results (serving/results.py)
        common += ["--api-server-count", str(args.api_server_count)]
    env_py = sys.executable
    logs = {port: os.path.join(work, f"{name}.log") for port, name in ((8101, "vanilla"), (8102, "tapc"))}
    # each server's readings during its timed loads: stack samples, call timers
    windows = {name: [kind(os.path.join(work, f"{kind.__name__.lower()}-{name}"))
                      for kind, wanted in ((Stacks, args.profile), (CallTimes, args.timers), (Kernels, args.kernels))
                      if wanted]
               for name in ("vanilla", "tapc")}
    timed = {"steps": dict.fromkeys(windows, 0.0), "seconds": dict.fromkeys(windows, 0.0)}
    timed_mixes = []   # --timers, --kernels: per mix, (mix, each server's windows of its loads, steps, seconds)
    vanilla = start_server([env_py, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", "8101", *common],
                           logs[8101], {w.ENV: w.folder for w in windows["vanilla"]})
    tapped = None
    rows: list[str] = []
    problems: list[str] = []
    save_dir, saved = os.path.join(work, "saved"), []
    baseline: list[str] = []
    try:
        # One after the other: vLLM's memory profile at start fails when another process on the
        # GPU changes its memory use meanwhile.
        wait_healthy(vanilla, 8101, logs[8101])
        progress("vanilla vllm serve is up")
        tapped = start_server([env_py, "-m", "tapc.cli", "serve", model, "--port", "8102",
                               "--tap", "model.layers.*.resid",
                               "--tap", f"model.layers.{STEER_LAYER}.resid | add(steer, alpha={ALPHA})",
                               *(["--tap", f"model.layers.{BLOCK_LAYER}.resid -> probe",
                                  "--block", "probe=benchmarks.bench_serve:probe"] if args.block else []),
                               *(["--save-to", save_dir, "--save-shard-tokens", "4096"] if args.save else []),
                               *(["--prefix-rows-gib", str(args.prefix_rows_gib)] if args.prefix_rows_gib else []), *common],
                              logs[8102], {w.ENV: w.folder for w in windows["tapc"]})
        wait_healthy(tapped, 8102, logs[8102])
        progress("tapc serve is up")
        for k, v in enumerate(vectors):
            http_json("POST", "http://127.0.0.1:8102/v1/tapc/vectors", {"name": f"v{k}", "values": v.tolist()})
        # Untimed first: every kind of request (other prompts), so neither server's timed runs
        # pay for first-use work (kernel JIT, CUDA-graph sizes, host buffers).
        warm = make_jobs(WARMUP, vocab, args.rate, 0.0, seed=1)
        for url, tap in (("http://127.0.0.1:8101", False), ("http://127.0.0.1:8102", True)):
            asyncio.run(load(url, model, warm, args.clients, tap, args.via))   # (captures fetched as they end)
        progress("warmed up")
        ref = None
        servers = (("vanilla", "http://127.0.0.1:8101", False), ("tapc", "http://127.0.0.1:8102", True))
        for m, mix in enumerate(mixes):
            per: dict[str, list[dict]] = {"vanilla": [], "tapc": []}
            for r in range(args.rounds):
                # prompts of their own for each mix and round (the first mix's first round as
                # before): no load is served from the cache an earlier one filled
                jobs = make_jobs(args.requests, vocab, args.rate, args.abort,
                                 seed=(0 if m == 0 else 100 + m) + 1000 * r, mix=mix, inline=args.inline, save=args.save,
                                 capture=args.capture)
                results = {}
                # in turn, the other first in every other round: a drift of the machine's speed
                # over a mix falls on both
                for name, url, tap in (servers if r % 2 == 0 else servers[::-1]):
                    pinned, counted = pinning_s(logs[8102]), engine_counters(url)
                    hooked = host_time(url) if tap else None
                    with contextlib.ExitStack() as reading:
                        for w in windows[name]:
                            reading.enter_context(w)
                        done, seconds = asyncio.run(load(url, model, jobs, args.clients, tap, args.via))
                    results[name] = (done, {**summary(done, seconds), **engine_view(counted, engine_counters(url), seconds)})
                    timed["steps"][name] += results[name][1]["steps"]
                    timed["seconds"][name] += seconds
                    progress(f"mix {args.mix[m]}, round {r}: {name}'s load took {seconds:.1f} s")
                    if tap:
                        results[name][1]["pinning"] = pinning_s(logs[8102]) - pinned
                        results[name][1]["hooks"] = hooks_view(hooked, host_time(url))
                found = [f"tapc: {e}" for e in results["tapc"][1]["errors"]]
                # every round, checked or not: what the server kept of them is held until fetched
                found += [p for d in results["tapc"][0] if d.aborted and d.tid
                          for p in taken_after_abort("http://127.0.0.1:8102", d)]
                found += [f"vanilla: {e}" for e in results["vanilla"][1]["errors"]]
                lost = len(jobs) - len(results["tapc"][0])
                if lost:
                    found.append(f"{lost} requests lost")
                for name in per:
                    per[name].append(results[name][1])
                # the round's table before its check: a check that fails to run keeps what was timed
                report(args, rows + table_rows(args.mix[m], per["vanilla"], per["tapc"]), problems, final=False,
                       baseline=baseline)
                where = f"mix {args.mix[m]}" + (f", round {r}" if args.rounds > 1 else "")
                if args.check_rounds is not None and r >= args.check_rounds:   # reported with the next table
                    problems += [f"{where}: {p}" for p in found]
                    continue
                ref = ref or Reference(model, vectors)   # after the first timed runs: its GPU memory is not theirs
                checked, near = check(ref, "http://127.0.0.1:8102", results["tapc"][0], args.block, saved)
                found += checked
                problems += [f"{where}: {p}" for p in found]
                base = vanilla_misses(ref, results["vanilla"][0])
                problems += near_miss_problems(where, near, base)
                baseline.append(f"{where}: requests with a generated token outside the greedy margin (within "
                                f"{NEAR:g} margins): tapc serve {near['unsteered'][0]} of {near['unsteered'][1]} that "
                                f"steer nothing and {near['steered'][0]} of {near['steered'][1]} steered, vanilla vllm "
                                f"serve {base[0]} of {base[2]} (all that steer nothing), and {base[1]} farther (tapc's "
                                "farther ones are listed below as problems)")
                report(args, rows + table_rows(args.mix[m], per["vanilla"], per["tapc"]), problems, final=False,
                       baseline=baseline)
            rows += table_rows(args.mix[m], per["vanilla"], per["tapc"])
            ratios = per_round(per["vanilla"], per["tapc"])
            record.append({"script": "bench_serve.py", "variant": "tapc serve",
                           "workload": f"{args.hidden} wide, {args.layers} layers, mix {args.mix[m]}",
                           "ratio": f"{med(per['tapc'], 'tok_s') / med(per['vanilla'], 'tok_s'):.3f}",
                           "low": f"{min(ratios):.3f}", "high": f"{max(ratios):.3f}", "metric": "tok/s",
                           "source": args.out or ""})
            if args.timers or args.kernels:   # each mix's readings apart
                timed_mixes.append((args.mix[m], {name: [w.set_aside(f"mix{m}") if isinstance(w, (CallTimes, Kernels))
                                                         else w for w in ws] for name, ws in windows.items()},
                                    {k: dict(v) for k, v in timed.items()}))
                timed = {k: dict.fromkeys(windows, 0.0) for k in timed}
        http_json("GET", "http://127.0.0.1:8102/health")
        for _ in range(50):   # saved requests' captures go back once the writer thread has written them
            _, held = http_json("GET", "http://127.0.0.1:8102/v1/tapc/held")
            workers = json.loads(held)["workers"]
            if not any(any(w.values()) for w in workers):
                break
            time.sleep(0.1)
        if any(any(w.values()) for w in workers):
            problems.append(f"the workers still hold something after every result was fetched: {workers}")
    finally:
        for proc in (vanilla, tapped):
            if proc is not None:
                proc.terminate()   # SIGTERM: the tapc server commits its save folder's last shard
                proc.wait(60)
    if args.save:
        problems += check_saved(save_dir, saved)
        if not saved:
            problems.append("--save: no request was saved")
    report(args, rows, problems, final=True, baseline=baseline)
    if args.profile:
        lines = [f"# bench_serve --profile: stack samples every {float(os.environ.get('TAPC_STACKS_INTERVAL', '0.002')) * 1e3:g} ms "
                 "in every process of each server, during its timed loads", ""]
        for name, ws in windows.items():
            lines += next(w for w in ws if isinstance(w, Stacks)).report(name)
        with open(args.profile, "w") as f:
            f.write("\n".join(lines) + "\n")
    for path, kind in ((args.timers, CallTimes), (args.kernels, Kernels)):
        if not path:
            continue
        lines = []
        for mix, views, got in timed_mixes:
            mine = {name: next(w for w in ws if isinstance(w, kind)) for name, ws in views.items()}
            lines += call_times_report(mine, got["steps"], got["seconds"], mix) if kind is CallTimes \
                else kernels_report(mine, got["steps"], mix)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
