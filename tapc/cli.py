"""`tapc` on the command line. `tapc explain MODEL [TAP...]` / `tapc explain SPEC.yaml [--json]`;
`tapc harvest SPEC.yaml PROMPTS` (a CUDA GPU and vLLM); `tapc serve SPEC.yaml|MODEL --tap ... [vllm serve
options]` (vLLM's OpenAI server with the plan: docs/serving.md)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import os
import sys

from tapc import paths
from tapc.errors import TapcError
from tapc.lang.schema import EngineArgs, checked
from tapc.plan.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

EXIT_SPEC_ERROR = 2
EXIT_BROKEN_PIPE = 141   # as a tool that SIGPIPE ends: the reader (`| head`) went away
# `tapc explain` flags that size the plan, as the engine arguments of the same names
PLAN_FLAGS = ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size")
DOCS = ("the tap language: docs/dsl.md; YAML specs and plans: docs/spec.md; harvests: docs/harvest.md; "
        "the engine: docs/engine.md; serving: docs/serving.md (in the tapc repository, and in README.md)")


def _explain(args) -> int:
    from tapc.lang.blockpaths import import_blocks
    from tapc.lang.specfile import is_spec_path
    from tapc.plan.explain import host_memory, render, render_points
    from tapc.plan.planner import build_plan
    from tapc.plan.tree import load_tree

    after = ""
    flags = {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}
    checked(EngineArgs, flags, "tapc explain", error=TapcError, label=lambda key: "--" + key.replace("_", "-"))
    if is_spec_path(args.target):
        if args.taps:
            raise TapcError(f"give taps either in {args.target} or on the command line, not both")
        from tapc.api.specs import spec_plan
        from tapc.lang.specfile import load_spec

        spec = load_spec(args.target)
        spec = dataclasses.replace(spec, engine={**spec.engine, **flags})  # a flag given overrides the spec
        plan = spec_plan(spec)
        engine_args = spec.engine   # the tree the plan was resolved on is the engine's (LoRA: tree.py)
        after = host_memory(spec.capture.memory_gib, spec.capture.memory_keep_gib)
        if spec.output is not None and not args.json:
            after += (f"harvest (`tapc harvest {args.target} PROMPTS`): the captures at {spec.capture.positions} "
                      f"positions go to {spec.output.dir}, {spec.output.shard_tokens} rows per shard\n")
    else:
        if not args.taps:
            if flags:   # the tree is the single-GPU one, whatever the engine's sizes
                raise TapcError(f"tapc explain {args.target} lists the model's tap points, which no engine size "
                                f"changes; {', '.join('--' + k.replace('_', '-') for k in flags)} size a plan: "
                                "give taps too")
            if args.json:
                print(load_tree(args.target).to_json())
            else:
                print(render_points(load_tree(args.target)), end="")
            return 0
        engine_args = {k: v for k, v in flags.items() if k.endswith("parallel_size")}
        sizes = {k: v for k, v in flags.items() if k not in engine_args}
        functions = import_blocks(dict(_named_path(f, "--function", "tapc explain") for f in args.function),
                                  "tapc explain", what="function")
        plan = build_plan(args.target, args.taps, **sizes, engine_args=engine_args, functions=functions)
    if args.json:
        print(plan.to_json(indent=2))
        return 0
    from tapc.plan.resolve import notes

    print(render(plan, notes(plan, load_tree(plan.model, engine_args))) + after, end="")
    return 0


@contextlib.contextmanager
def _skips_noted(noted: bool):
    """Where the plan's table is printed, its notes say what a `*` skipped: not a warning on stderr
    too. A filter, as vLLM's logging setup at its import turns a logger's `disabled` back off."""
    log = logging.getLogger("tapc.plan.resolve")
    quiet = lambda record: not noted   # noqa: E731
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _harvest(args) -> int:
    from tapc.lang.specfile import load_spec
    from tapc.api.engine_args import require_cuda

    if args.gpus < 1:
        raise TapcError(f"tapc harvest: --gpus {args.gpus}: give 1 or more (this host's GPUs the harvest uses)")
    spec = load_spec(args.spec)  # a spec's errors, and a missing prompts file, are worth knowing on any machine
    if spec.output is None:
        raise TapcError(f"{args.spec}: a harvest needs an `output:` section (dir, shard_tokens)")
    if "://" not in args.prompts and paths.kind(args.prompts, "prompts", TapcError) is None:   # a URL: Ray reads it
        raise TapcError(f"{paths.shown(args.prompts)}: no such prompts file")
    if args.ray is not None or args.gpus > 1:
        return _harvest_ray(args, spec)
    require_cuda()  # then, before prompts are read or vLLM is imported
    from tapc.api.llm import VLLM
    from tapc.harvest import corpus
    from tapc.harvest.run import harvest

    llm = VLLM.from_spec(spec)
    source = None
    if args.text_field or args.context_size:
        tokenizer = llm.llm.get_tokenizer()
        docs = corpus.read_texts(args.prompts, args.text_field or "text")
        prompts = (corpus.pack(docs, tokenizer, args.context_size) if args.context_size
                   else corpus.per_row(docs, tokenizer))
        source = corpus.describe(args.prompts, args.text_field or "text", tokenizer, args.context_size)
    else:
        prompts = corpus.read_prompts(args.prompts)
    if args.limit is not None:
        prompts = itertools.islice(prompts, args.limit)
    out = spec.output
    m = harvest(llm, prompts, out.dir, shard_tokens=out.shard_tokens, positions=spec.capture.positions,
                sampling_params=_sampling(args), format=out.format, dtype=out.dtype,
                context_size=args.context_size or out.context_size, source=source, window_tokens=args.window_tokens)
    print(f"{m.rows} rows of {len(m.keys)} keys from {m.prompts} prompts in {len(m.shards)} shards "
          f"under {out.dir}" + (f"; {len(m.failed)} prompts failed (see manifest.json)" if m.failed else ""))
    return 1 if m.failed else 0


def _harvest_ray(args, spec) -> int:
    """The harvest over a Ray cluster (`--ray [ADDRESS]`), or over this host's GPUs (`--gpus N`: a
    Ray of this host): tapc/harvest/cluster.py."""
    from tapc.harvest.cluster import harvest_ray, require_ray
    from tapc.harvest.engines import SpecEngine
    from tapc.api.engine_args import require_cuda

    ray = require_ray()
    if args.ray is None:
        require_cuda()   # this host runs the engines
        ray.init(num_gpus=args.gpus, ignore_reinit_error=True)
    else:   # the driver may be a machine without GPUs: the actors have theirs
        ray.init(address=args.ray or None, ignore_reinit_error=True)
    documents = bool(args.text_field or args.context_size)
    tokenizer = None
    if documents:   # packing runs here, and the manifest's source names the tokenizer
        from vllm.tokenizers import get_tokenizer

        tokenizer = get_tokenizer(spec.engine.get("tokenizer") or spec.model,
                                  trust_remote_code=bool(spec.engine.get("trust_remote_code")))
    out = spec.output
    m = harvest_ray(SpecEngine(spec), args.prompts, out.dir, part_prompts=args.part_prompts,
                    text_field=(args.text_field or "text") if documents else None, tokenizer=tokenizer,
                    limit=args.limit, shard_tokens=out.shard_tokens, positions=spec.capture.positions,
                    sampling_params=_sampling(args), format=out.format, dtype=out.dtype,
                    context_size=args.context_size or out.context_size, window_tokens=args.window_tokens)
    print(f"{m.rows} rows of {len(m.keys)} keys from {m.prompts} prompts in {len(m.shards)} shards under {out.dir}"
          + (f"; {len(m.failed)} prompts failed (see manifest.json)" if m.failed else ""))
    return 1 if m.failed else 0


def _sampling(args):
    """The harvest's sampling parameters: None (one greedy token) unless --max-tokens says more."""
    if args.max_tokens == 1:
        return None
    from vllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0)


def _named_path(text: str, flag: str = "--block", where: str = "tapc serve") -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not (eq and name and path):
        raise TapcError(f"{where}: {flag} {text!r}: give NAME=package.module:function")
    return name, path


def _save_folder(args) -> dict | None:
    """`--save-to` and its settings, as the server's save folder takes them (serving/saving.py)."""
    if args.save_to is None:
        return None
    positions = args.save_positions
    if positions not in ("all", "prompt", "generated", "last"):
        try:
            positions = [int(p) for p in positions.split(",")]
        except ValueError:
            raise TapcError(f"tapc serve: --save-positions {positions!r}: all, prompt, generated, last or "
                            "a list of positions like 0,5,9") from None
    return {"folder": args.save_to, "shard_tokens": args.save_shard_tokens, "positions": positions}


def _serve(args, rest: list[str]) -> int:
    import shlex

    from tapc.serving.launch import run, serve_argv, sizes
    from tapc.api.engine_args import require_cuda

    engine, rest = sizes(rest)   # the plan is built for these (and the executor checked): not past it
    if args.capture_memory_gib is not None:
        engine["capture_memory_gib"] = args.capture_memory_gib
    if args.capture_memory_keep_gib is not None:
        engine["capture_memory_keep_gib"] = args.capture_memory_keep_gib
    if args.prefix_rows_gib is not None:
        engine["prefix_rows_gib"] = args.prefix_rows_gib
    save = _save_folder(args)
    spec = None
    if args.target.endswith((".yaml", ".yml")):
        from tapc.lang.specfile import load_spec

        if args.tap or args.block or args.function:
            raise TapcError("tapc serve: give a spec or --tap/--block/--function, not both (the spec's taps are the plan)")
        spec = load_spec(args.target)
    elif not args.tap:
        raise TapcError("tapc serve: give a spec .yaml, or a model and its taps (--tap ...)")
    blocks = dict(_named_path(b) for b in args.block)
    functions = dict(_named_path(f, "--function") for f in args.function)
    if not args.print:   # what was given is checked on any machine; then the GPU, before the plan
        require_cuda()
    if spec is not None:
        from tapc.api.llm import spec_arguments

        model, taps, kwargs = spec_arguments(spec, engine)
        kwargs.pop("params")       # the server loads them from the spec
        kwargs.pop("blocks")       # each worker imports them, by the spec's paths
        kwargs.pop("functions")
        argv = serve_argv(model, taps, capture_dtype=kwargs.pop("capture_dtype"), spec_path=args.target,
                          engine=kwargs, extra=rest, blocks=spec.blocks, save=save, functions=spec.functions)
    else:
        argv = serve_argv(args.target, args.tap, capture_dtype=args.capture_dtype, engine=engine, extra=rest,
                          blocks=blocks, save=save, functions=functions)
    if args.print:
        print(shlex.join(["vllm", *argv]))
        return 0
    run(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tapc", description="A declarative tap compiler for vLLM.",
                                     epilog=f"Docs: {DOCS}.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="show what a tap plan does: points, buffers, graph splits (no GPU)",
                        description="Show what a tap plan does (no GPU). With a model and no taps: the model's "
                                    "tap points.", epilog=f"Docs: {DOCS}.")
    ex.add_argument("target", help="a model (directory with config.json, or a cached hub id) or a spec .yaml")
    ex.add_argument("taps", nargs="*", help="tap strings, e.g. 'model.layers.*.resid'; none: list the model's tap points")
    ex.add_argument("--json", action="store_true", help="print the plan (or, without taps, the module tree) as JSON")
    ex.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help=f"rows each buffer holds (default: the spec's, else {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    ex.add_argument("--function", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                    help="the compiled function of a tap `point | call(NAME)`: traced on the CPU, refused if it "
                         "cannot run in a graph (repeat)")
    ex.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"request slots in parameter tables (default: the spec's, else {DEFAULT_MAX_NUM_SEQS})")
    ex.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="GPUs per pipeline stage: shows each point replicated or sharded, bytes per GPU "
                         "(default: the spec's, else 1)")
    ex.add_argument("--pipeline-parallel-size", type=int, default=None,
                    help="pipeline stages: each point's stage (default: the spec's, else 1)")
    hv = sub.add_parser("harvest", help="run prompts through the spec's engine, write captures to shards (CUDA GPU)",
                        epilog=f"Docs: {DOCS}.")
    hv.add_argument("spec", help="a spec .yaml with an `output:` section")
    hv.add_argument("prompts", help=".jsonl (strings, token-id lists, or {prompt|prompt_token_ids}) or text, one per "
                                    "line; with --text-field/--context-size: documents in .jsonl/.txt/.parquet "
                                    "or a datasets folder")
    hv.add_argument("--text-field", default=None, help="read documents' text from this field (default text)")
    hv.add_argument("--context-size", type=int, default=None,
                    help="pack documents into windows of N tokens, BOS first (as SAELens); without it, one "
                         "prompt per document")
    hv.add_argument("--limit", type=int, default=None, help="only the first N prompts (windows when packing)")
    hv.add_argument("--gpus", type=int, default=1,
                    help="this host's GPUs, an engine on each (or on each tensor x pipeline parallel group), on Ray")
    hv.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run on a Ray cluster, an engine per GPU (or group) of every node (ADDRESS: the cluster's; "
                         "default: RAY_ADDRESS, else a Ray of this host)")
    hv.add_argument("--part-prompts", type=int, default=4096,
                    help="with --ray or --gpus: prompts a part, the unit an engine takes (a restart must keep it)")
    hv.add_argument("--window-tokens", type=int, default=None,
                    help="tokens in flight (submitted, not yet written); bounds /dev/shm use "
                         "(default: 16 engine steps of max_num_batched_tokens)")
    hv.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt (default 1)")
    sv = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with the taps (vllm serve; CUDA GPU)",
                        description="Run `vllm serve` with a tap plan; options tapc does not know go to vLLM. "
                                    "Requests ask for taps in vllm_xargs (docs/serving.md).", epilog=f"Docs: {DOCS}.")
    sv.add_argument("target", help="a spec .yaml, or a model (with --tap)")
    sv.add_argument("--tap", action="append", default=[], help="a tap string (repeat); not with a spec")
    sv.add_argument("--block", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                    help="the function of a tap's block `point -> NAME`, imported by the server (repeat)")
    sv.add_argument("--function", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                    help="the compiled function of a tap `point | call(NAME)`, traced into the graphs (repeat)")
    sv.add_argument("--capture-dtype", default=None, help="dtype captures are kept in (default: the model's)")
    sv.add_argument("--capture-memory-gib", type=float, default=None, metavar="GIB",
                    help="host memory for captures each GPU pins at start, so no request waits for it")
    sv.add_argument("--capture-memory-keep-gib", type=float, default=None, metavar="GIB",
                    help="host memory for captures each GPU keeps once idle: what a burst grew past it goes back "
                         "when no capture is held in it (default: all of it, for the server's life)")
    sv.add_argument("--prefix-rows-gib", type=float, default=None, metavar="GIB",
                    help="host memory for captured rows of shared prompt blocks, so that captures of prompt rows "
                         "read the prefix cache (one GPU; docs/serving.md)")
    sv.add_argument("--save-to", default=None, metavar="FOLDER",
                    help="requests asking `save: true` have their captures written here, as `tapc harvest` "
                         "writes them (one API server process)")
    sv.add_argument("--save-positions", default="all", help="positions saved (all, prompt, generated, last, or 0,5,9)")
    sv.add_argument("--save-shard-tokens", type=int, default=1_000_000, help="rows a saved shard holds")
    sv.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command != "serve":   # vLLM logs to stdout at import; `--json` output must stay clean
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        if args.command == "serve":
            return _serve(args, rest)
        if args.command == "harvest":
            return _harvest(args)
        with _skips_noted(not args.json):
            rc = _explain(args)
        sys.stdout.flush()   # here, where a closed pipe can be caught, not at the interpreter's exit
        return rc
    except TapcError as e:
        print(f"tapc: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except BrokenPipeError:
        # what is left in stdout's buffer goes nowhere, so that Python's exit does not fail on it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
