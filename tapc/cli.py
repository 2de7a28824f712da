"""`tapc` on the command line. `tapc explain MODEL [TAP...]` / `tapc explain SPEC.yaml [--json]`;
`tapc harvest SPEC.yaml PROMPTS` (a CUDA GPU and vLLM)."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

from tapc.errors import TapcError
from tapc.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

EXIT_SPEC_ERROR = 2
DOCS = ("the tap language: docs/dsl.md; YAML specs and plans: docs/spec.md; harvests: docs/harvest.md; "
        "the engine: docs/engine.md (in the tapc repository, and in README.md)")


def _explain(args) -> int:
    from tapc.explain import render, render_points
    from tapc.planner import build_plan
    from tapc.specfile import is_spec_path
    from tapc.tree import load_tree

    after = ""
    sizes = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                               ("max_num_seqs", args.max_num_seqs)) if v is not None}
    if is_spec_path(args.target):
        if args.taps:
            raise TapcError(f"give taps either in {args.target} or on the command line, not both")
        from tapc.specfile import load_spec

        spec = load_spec(args.target)
        spec = dataclasses.replace(spec, engine={**spec.engine, **sizes})  # a flag given overrides the spec
        plan = spec.plan()
        engine_args = spec.engine   # the tree the plan was resolved on is the engine's (LoRA: tree.py)
        if spec.output is not None and not args.json:
            after = (f"harvest (`tapc harvest {args.target} PROMPTS`): the captures at {spec.capture.positions} "
                     f"positions go to {spec.output.dir}, {spec.output.shard_tokens} rows per shard\n")
    else:
        if not args.taps:
            if args.json:
                print(load_tree(args.target).to_json())
            else:
                print(render_points(load_tree(args.target)), end="")
            return 0
        engine_args = {"tensor_parallel_size": args.tensor_parallel_size,
                       "pipeline_parallel_size": args.pipeline_parallel_size}
        plan = build_plan(args.target, args.taps, **sizes, engine_args=engine_args)
    if args.json:
        print(plan.to_json(indent=2))
        return 0
    from tapc.resolve import notes

    print(render(plan, notes(plan, load_tree(plan.model, engine_args))) + after, end="")
    return 0


def _harvest(args) -> int:
    from tapc.engine.config import require_cuda
    from tapc.specfile import load_spec

    spec = load_spec(args.spec)  # a spec's errors are worth knowing on any machine
    if spec.output is None:
        raise TapcError(f"{args.spec}: a harvest needs an `output:` section (dir, shard_tokens)")
    require_cuda()  # then, before prompts are read or vLLM is imported
    if args.gpus > 1 and args.rank is None:
        return _harvest_gpus(args, spec)
    from tapc import corpus, fleet
    from tapc.api import VLLM
    from tapc.harvest import harvest

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
    sampling = None
    if args.max_tokens != 1:
        from vllm import SamplingParams

        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    out = spec.output
    split = (0, 1) if args.rank is None else (args.rank, args.ranks)
    folder = out.dir if args.rank is None else str(fleet.part(out.dir, args.rank))
    m = harvest(llm, prompts, folder, split=split, shard_tokens=out.shard_tokens, positions=spec.capture.positions,
                sampling_params=sampling, format=out.format, dtype=out.dtype,
                context_size=args.context_size or out.context_size, source=source,
                window_tokens=args.window_tokens)
    print(f"{m.rows} rows of {len(m.keys)} keys from {m.prompts} prompts in {len(m.shards)} shards "
          f"under {out.dir}" + (f"; {len(m.failed)} prompts failed (see manifest.json)" if m.failed else ""))
    return 1 if m.failed else 0


def _harvest_gpus(args, spec) -> int:
    """One `tapc harvest --rank R --ranks N` process per GPU, then one manifest (tapc/fleet.py)."""
    from tapc import fleet

    n = args.gpus
    cmd = [sys.executable, "-m", "tapc.cli", *args.argv, "--ranks", str(n)]
    fleet.launch([[*cmd, "--rank", str(r)] for r in range(n)], [str(r) for r in range(n)])
    m = fleet.merge(spec.output.dir, n)
    print(f"{m.rows} rows of {len(m.keys)} keys from {m.prompts} prompts in {len(m.shards)} shards over {n} GPUs "
          f"under {spec.output.dir}" + (f"; {len(m.failed)} prompts failed (see manifest.json)" if m.failed else ""))
    return 1 if m.failed else 0


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
    ex.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"request slots in parameter tables (default: the spec's, else {DEFAULT_MAX_NUM_SEQS})")
    ex.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs per pipeline stage: shows each point replicated or sharded, bytes per GPU")
    ex.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (each point's stage)")
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
    hv.add_argument("--gpus", type=int, default=1, help="one engine per GPU, each on its share of the prompts")
    hv.add_argument("--rank", type=int, default=None, help="run part RANK of --ranks (the --gpus launcher's)")
    hv.add_argument("--ranks", type=int, default=1, help="parts in all, over every node")
    hv.add_argument("--window-tokens", type=int, default=None,
                    help="tokens in flight (submitted, not yet written); bounds /dev/shm use (default: 8 steps)")
    hv.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt (default 1)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # what --gpus runs again per GPU
    # vLLM logs to stdout at import; `--json` output must stay clean
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        return _explain(args) if args.command == "explain" else _harvest(args)
    except TapcError as e:
        print(f"tapc: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_SPEC_ERROR


if __name__ == "__main__":
    sys.exit(main())
