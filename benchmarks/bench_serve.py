"""Load test of `tapc serve` against vanilla `vllm serve`, both started by this script on one GPU.

    source .gpu/activate && python3 benchmarks/bench_serve.py --quick --out bench_serve.md

A random Llama checkpoint (and a word-level tokenizer over its vocabulary) is written; a vanilla
server and a tapc server (captures of every layer's residual stream, a steering edit with
per-request vectors) run side by side, each on its share of the GPU. After untimed warm-up
requests, the same request list goes to each over real HTTP from `--clients` concurrent clients
with staggered (Poisson) arrivals: untapped, capturing (all / prompt / generated rows), steered by
one of three registered vectors (some capturing too), a share streamed, `--abort` of them aborted
mid-stream, and half behind one shared system prompt; a capturing request's client fetches its
captures as soon as its response ends, inside the timed load. `--mix` sets the shares of the four
kinds; each mix runs `--rounds` times on each server, the servers in turn, new prompts every
round, and the table gives medians and each round's own ratio.

Reported per mix: output tokens/s of each server and their ratio (goal >= 0.95x), the untapped
prompt tokens' prefix-cache hit rate (goal: vanilla's), what each engine did in the load from
vLLM's counters at /metrics (steps, tokens a step, prompt tokens computed, wall ms a step), and
the tapc engine thread's ms a step in tapc's hooks, which the worker times itself
(`GET /v1/tapc/host-time`). The answers of the first `--check-rounds` rounds are checked against
HF (serve_check.py); `--profile`, `--timers` and `--kernels` read every server process during
the loads (readings.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import record
from readings import CallTimes, Kernels, Stacks, call_times_report, kernels_report
from serve_check import (
    ALPHA,
    BLOCK_LAYER,
    NEAR,
    STEER_LAYER,
    Reference,
    check,
    check_saved,
    near_miss_problems,
    vanilla_misses,
)
from serve_load import KINDS, MIX, Done, Job, load, make_jobs

WARMUP = 64   # requests sent to each server before its timed run


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
                    help=f"shares of {', '.join(KINDS)} (e.g. 1,0,0,0: untapped traffic alone); several mixes run "
                         "one after the other on the same two servers")
    ap.add_argument("--rounds", type=int, default=None, help="loads of each mix on each server (default 3, --quick 1)")
    ap.add_argument("--check-rounds", type=int, default=None, metavar="K",
                    help="check the answers of each mix's first K rounds only (default: every round); errors and "
                         "lost requests are counted in every round")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dummy-weights", action="store_true",
                    help="both servers make their own random weights (--load-format dummy), for a model too large to "
                         "write (e.g. --hidden 4096 --layers 32); nothing can be checked: needs --check-rounds 0")
    ap.add_argument("--capture", default=Job.capture, help="what capturing requests ask for, a glob over the taps")
    ap.add_argument("--inline", type=float, default=0.0,
                    help="share of capturing requests that ask for their captures in the response")
    ap.add_argument("--block", action="store_true", help="the tapc server also runs a Python block at a layer")
    ap.add_argument("--save", type=float, default=0.0,
                    help="share of the requests capturing all rows that ask to be saved in the server's save folder")
    ap.add_argument("--via", choices=("http", "shm"), default="http",
                    help="clients fetch their captures over HTTP, or copy them from the server's shared memory")
    ap.add_argument("--prefix-rows-gib", type=float, default=0.0,
                    help="the tapc server keeps captured rows of shared prompt blocks (tapc serve --prefix-rows-gib)")
    ap.add_argument("--api-server-count", type=int, default=1, help="API server processes of each server")
    ap.add_argument("--out", default=None, help="write the summary table (markdown) here")
    ap.add_argument("--profile", default=None, metavar="MD",
                    help="sample the stacks of every server process during the loads (slower loads) and write them here")
    ap.add_argument("--kernels", default=None, metavar="MD",
                    help="record both engine cores' GPU kernel and copy times (CUPTI) during the loads, ms a step here")
    ap.add_argument("--timers", default=None, metavar="MD",
                    help="time both engine threads' calls of vLLM's engine-loop functions during the loads, ms a step here")
    args = ap.parse_args()
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
                                  "--block", "probe=benchmarks.serve_check:probe"] if args.block else []),
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
                checked, near = check(ref, results["tapc"][0], args.block, saved)
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