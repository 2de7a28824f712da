"""Harvest: prompts through a tapped engine, captures to shard files on disk, resumable.

    tapc harvest spec.yaml prompts.jsonl            # the spec's `output:` says where
    harvest(llm, prompts, "./acts", shard_tokens=1_000_000, positions="prompt")

The engine is fed continuously (tapc/harvest/feed.py); a writer thread puts finished requests in input
order and writes their rows through to shard files (tapc/harvest/writer.py, tapc/harvest/shardfiles.py). Rows
come request after request, each in position order; a request may continue into the next
shard. `manifest.json` is written first and after every shard: the settings, the plan, each
hook's names elsewhere (tapc/harvest/hooknames.py), and every committed shard with where it starts and
ends in the input, its per-key sums and the requests that failed. Started again on the same
folder with the same settings, a harvest goes on from the last committed shard's end: the files
come out as an uninterrupted run's. `tapc.data` reads them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tapc.api.requests import ENGINE_POINTS, TapRequest
from tapc.errors import TapcError
from tapc.harvest.feed import Window, feed
from tapc.harvest.hooknames import describe
from tapc.harvest.writer import Layout, ShardRecord, Stats, Writer
from tapc.wire.arena import shm_directory
from tapc.wire.positions import expected_rows

log = logging.getLogger("tapc")

MANIFEST = "manifest.json"
INDEX_COLUMNS = ("token_ids", "request", "position")
FORMATS = ("safetensors", "arrow")
# Tokens in flight by default, in engine steps: the engine keeps a full batch while finished
# requests wait for their collect (a round trip that waits for the step in flight) and the writer.
WINDOW_STEPS = 16
ARROW_SHARD_BYTES = 2 << 30   # HF datasets' writer has trouble past 2 GB a file (SAELens keeps under it)


@dataclasses.dataclass
class Manifest:
    """What a harvest wrote. `settings` must match for a restart to go on; `shards` in order;
    `failed`: every prompt not written ({"request": i, "error": why}); `stats` per key once
    `complete`."""

    plan_digest: str
    keys: list[str]
    positions: str | list[int]
    settings: dict
    hooks: dict[str, dict] = dataclasses.field(default_factory=dict)
    shards: list[ShardRecord] = dataclasses.field(default_factory=list)
    unwritten: ShardRecord | None = None   # failures after the last shard's rows
    prompts: int = 0
    rows: int = 0
    failed: list[dict] = dataclasses.field(default_factory=list)
    stats: dict[str, dict] = dataclasses.field(default_factory=dict)
    complete: bool = False
    plan: dict = dataclasses.field(default_factory=dict)

    def write(self, folder: Path) -> None:
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(self.dumps())
        os.replace(tmp, folder / MANIFEST)   # whole or not at all: a reader never sees half

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def read(cls, folder: str | Path) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise TapcError(f"{folder}: no {MANIFEST} (not a tapc harvest, or one that wrote nothing yet)")
        return cls.parse(path.read_text(), path)

    @classmethod
    def parse(cls, text: str, path) -> "Manifest":
        """A manifest from its JSON text (`path`: where it was read, for errors)."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            if "settings" not in data:
                raise TapcError(f"{path}: a manifest of an older tapc (no `settings`): harvest again into a new folder")
            data["shards"] = [ShardRecord(**s) for s in data["shards"]]
            data["unwritten"] = ShardRecord(**data["unwritten"]) if data.get("unwritten") else None
            return cls(**data)
        except (ValueError, TypeError, KeyError) as e:   # bad JSON or text, or not a manifest's fields
            why = (str(e).splitlines() or [""])[0][:120]
            raise TapcError(f"{path}: not a readable harvest manifest ({type(e).__name__}: {why})") from None

    def add(self, record: ShardRecord) -> None:
        if record.file is None:
            self.unwritten = record
        else:
            self.shards.append(record)
            self.rows += record.rows
        self.failed += record.failed
        self.prompts = record.end[0]

    def reopen(self) -> None:
        """Go on after the last shard: what came after it (failures, statistics) is redone."""
        self.unwritten, self.complete = None, False
        self.failed = [f for s in self.shards for f in s.failed]

    def finish(self, records: list[ShardRecord] | None = None) -> None:
        """Per-key statistics over every shard (or `records`: a merge's); the harvest is complete."""
        if records is None:
            records = self.shards + ([self.unwritten] if self.unwritten else [])
        for k in self.keys:
            total = Stats()
            for r in records:
                total.merge(Stats(**r.stats[k]))
            self.stats[k] = total.summary(self.hooks[k]["width"])
        self.complete = True


def harvest(llm, prompts: Iterable, out_dir: str | os.PathLike, *, shard_tokens: int = 1_000_000,
            positions: str | list[int] = "all", sampling_params=None, format: str = "safetensors",
            dtype: str | None = None, context_size: int | None = None, source: dict | None = None,
            window_tokens: int | None = None, collect_every: int = 256, part: tuple[int, int] | None = None,
            progress: bool | None = None) -> Manifest:
    """Run `prompts` (token-id lists, strings, or vLLM prompt dicts; strings go through the
    engine's tokenizer) through `llm` (a `tapc.VLLM`) and write every in-graph capture of its
    plan at `positions` to shards in `out_dir`; a folder holding an unfinished harvest with the
    same settings is continued (see the module doc).

    `format`: "safetensors" (`shard_tokens` rows a shard) or "arrow" (the HF datasets layout
    SAELens loads: one row per window of `context_size` tokens, files under 2 GB).
    `dtype`: stored dtype of the captures (default: the capture dtype; float32 for arrow, which
    has no bfloat16). `sampling_params` default: one greedy token, so `positions="all"` is the
    prompt. `source`: what the prompts are (tapc.harvest.corpus), recorded in the manifest.
    `window_tokens`: tokens submitted and not yet written (default `WINDOW_STEPS` engine steps' worth): this
    bounds the captures held in /dev/shm. `part=(start, stop)`: `prompts` are those of index start
    to stop - 1 of a larger input (a part of a harvest in parts: tapc/harvest/parts.py); rows'
    `request` counts from start. `progress`: a progress bar (default: when stderr is a terminal). A request whose taps fail, or whose captures hold a NaN or inf, is
    listed in the manifest's `failed` and not written; the harvest goes on."""
    from tapc.harvest.progress import HarvestProgress

    params = default_sampling(sampling_params)
    folder = Path(out_dir)
    layout, manifest = open_folder(llm.plan, folder, format=format, dtype=dtype, shard_tokens=shard_tokens,
                                   context_size=context_size, positions=positions,
                                   more={"max_tokens": params.max_tokens, "source": source or {"kind": "prompts"},
                                         **({"part": list(part)} if part else {})})
    keys = list(layout.keys)
    taps = {t.key: t for t in llm.plan.taps if t.action == "capture"}
    if manifest.complete:
        log.warning("tapc harvest: %s already holds this harvest, complete: nothing to do", folder)
        return manifest
    manifest.reopen()   # the prompts after the last shard run again: their failures too
    start = manifest.shards[-1].end if manifest.shards else [0, 0]
    window = Window(window_tokens or WINDOW_STEPS * llm.plan.max_num_batched_tokens)
    row_bytes = sum(t.width * getattr(torch, t.dtype).itemsize for t in taps.values())
    total = len(prompts) if hasattr(prompts, "__len__") else None   # a list: the bar shows the time left
    bar = HarvestProgress(progress, folder, total)
    bar.skipped = start[0]
    bar.say(f"tapc harvest -> {folder} ({format}{', continuing at prompt ' + str(start[0]) if start[0] else ''}): "
            f"at most {window.cap:,} tokens in flight, {window.cap * row_bytes / 2**30:.2f} GiB of captures in "
            f"{shm_directory()}; rows are written through to the shard files")

    def commit(record: ShardRecord) -> None:
        manifest.add(record)
        manifest.write(folder)

    writer = Writer(layout, window, commit, start=tuple(start), first_shard=len(manifest.shards),
                    progress=bar.written)
    ask = TapRequest(capture=keys, positions=positions)
    todo = itertools.islice(_tokens(llm, prompts, part[0] if part else 0), start[0], None)
    # Where a request's rows follow from its prompt (the prompt's positions, or one token made),
    # the writer learns the rows to come once all are submitted, and sizes the last shard.
    sized = format == "safetensors" and (positions == "prompt" or params.max_tokens == 1)
    promised = -start[1]   # a restart: rows of its first request that the last shard holds

    def submitted(tokens: int) -> None:
        nonlocal promised
        bar.submitted(tokens)
        if sized:   # one token made, or prompt rows (which do not depend on how many)
            promised += expected_rows(positions, tokens, 1)

    if sized and part:
        # A part's prompts are few: read first, so the writer knows its rows before the first
        # shard opens. A part smaller than a shard is then made at its size, not opened at
        # `shard_tokens` and rewritten after the engine is done (a second of copying a GB a part).
        counted = list(todo)
        writer.expect(promised + sum(expected_rows(positions, len(tokens), 1) for _, tokens in counted))
        todo = iter(counted)

    try:
        with bar, _one_cpu_thread(), _counting_nonfinite(llm):
            feed(llm, todo, params, ask, window, writer.put, collect_every, submitted=submitted,
                 first_seq=start[0], exhausted=(lambda: writer.expect(promised)) if sized else None)
            writer.close()
    except BaseException:
        writer.abandon()
        raise
    manifest.finish()
    manifest.write(folder)
    if format == "arrow":
        from tapc.harvest.shardfiles import write_dataset_files

        write_dataset_files(folder, layout.columns(), [s.file for s in manifest.shards], manifest.plan_digest)
    bar.summary(manifest)
    return manifest


def default_sampling(sampling_params=None):
    """A harvest's sampling parameters: one greedy token unless given; a number of tokens."""
    from vllm import SamplingParams

    params = sampling_params or SamplingParams(max_tokens=1, temperature=0.0)
    if params.max_tokens is None:   # vLLM's "until the context is full": no bound for the window
        raise TapcError("harvest: sampling_params.max_tokens is None; give a number (tokens in flight, which bound "
                        "the host memory of the captures, are each prompt's length plus max_tokens)")
    return params


@contextlib.contextmanager
def _one_cpu_thread():
    """torch's CPU ops on one thread while the harvest runs. The writer reduces one request's rows
    at a time, too few to gain from intra-op threads, which then only contend with the engine's
    processes for the cores: on the 2-GPU H200 host (the harvest on 16 of its cores) an aminmax
    of a request's 128 rows took 1 ms in the writer; on one thread it takes 0.07 ms (measured
    on a 2-core CPU machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _counting_nonfinite(llm):
    """The workers count NaN / inf values as the captures leave the GPU while the harvest runs
    (a collect reply with a count of 0 spares the writer its check); off again afterwards."""
    llm.llm.collective_rpc("tapc_count_nonfinite", args=(True,))
    try:
        yield
    finally:
        llm.llm.collective_rpc("tapc_count_nonfinite", args=(False,))


def harvest_keys(plan) -> list[str]:
    """The keys a harvest of `plan` writes: its in-graph captures (`logits` and `samples` have
    one row per generated token, not per position)."""
    keys = [k for k in plan.capture_keys if k not in ENGINE_POINTS]
    if not keys:
        raise TapcError("the plan captures nothing in the graph: a harvest needs a capture tap "
                        "(e.g. model.layers.*.resid)")
    skipped = [k for k in plan.capture_keys if k in ENGINE_POINTS]
    if skipped:
        log.warning("tapc harvest: %s not written (one row per generated token, not per position)", ", ".join(skipped))
    return keys


def open_folder(plan, folder: Path, *, format: str, dtype: str | None, shard_tokens: int, context_size: int | None,
                positions, more: dict) -> tuple[Layout, Manifest]:
    """The shard layout of a harvest of `plan`'s keys into `folder`, and the manifest to go on
    with (the folder's own when it holds a harvest with these settings, `more` included)."""
    layout, settings = harvest_layout(plan, folder, format=format, dtype=dtype, shard_tokens=shard_tokens,
                                      context_size=context_size, positions=positions, more=more)
    folder.mkdir(parents=True, exist_ok=True)
    return layout, _start(folder, plan, settings, layout)


def harvest_layout(plan, folder: Path, *, format: str, dtype: str | None, shard_tokens: int,
                   context_size: int | None, positions, more: dict) -> tuple[Layout, dict]:
    """The shard layout of a harvest of `plan`'s keys into `folder`, and its settings (`more`
    added): what a restart must find the same."""
    if format not in FORMATS:
        raise TapcError(f"format {format!r}: a harvest writes {' or '.join(FORMATS)}")
    keys = harvest_keys(plan)
    taps = {t.key: t for t in plan.taps if t.action == "capture"}
    layout, settings = _layout(plan, keys, taps, folder, format=format, dtype=dtype, shard_tokens=shard_tokens,
                               context_size=context_size, positions=positions)
    settings.update(more)
    return layout, settings


def new_manifest(plan, layout: Layout, settings: dict) -> Manifest:
    """The manifest of a harvest that has written nothing yet."""
    taps = {t.key: t for t in plan.taps if t.action == "capture"}
    return Manifest(plan.digest, list(layout.keys), layout.positions, json.loads(json.dumps(settings)),
                    {k: describe(taps[k]) for k in layout.keys}, plan=json.loads(plan.to_json()))


def _layout(plan, keys, taps, folder: Path, *, format, dtype, shard_tokens, context_size, positions):
    capture = {taps[k].dtype for k in keys}
    if len(capture) != 1:
        raise TapcError(f"the captured keys have dtypes {sorted(capture)}: a harvest stores one dtype; pass dtype=")
    stored = dtype or ("float32" if format == "arrow" else capture.pop())
    if format == "arrow" and stored == "bfloat16":
        raise TapcError("the arrow format has no bfloat16 (HF datasets cannot type it): store float16 or float32")
    if not isinstance(getattr(torch, stored, None), torch.dtype):
        raise TapcError(f"dtype {stored!r} is not a torch dtype")
    widths = tuple(taps[k].width for k in keys)
    settings = {"format": format, "dtype": stored, "positions": positions}
    if format == "arrow":
        if not context_size:
            raise TapcError("the arrow format stores windows of context_size tokens: give context_size "
                            "(or pack the prompts with tapc.harvest.corpus, which sets it)")
        window_bytes = context_size * (sum(widths) * getattr(torch, stored).itemsize + 4) + 8
        cap = max(1, ARROW_SHARD_BYTES // window_bytes)
        # SAELens's column names (tapc/harvest/hooknames.py): the layout writes them, the manifest maps back.
        names = tuple(describe(taps[k])["saelens_hook_name"] for k in keys)
        settings.update(context_size=context_size, windows_per_shard=cap)
    else:
        if shard_tokens < 1:
            raise TapcError(f"shard_tokens must be at least 1, got {shard_tokens}")
        cap, names = shard_tokens, tuple(keys)
        settings.update(shard_tokens=shard_tokens, context_size=context_size)
    layout = Layout(folder, format, tuple(keys), names, widths, getattr(torch, stored), cap, positions, context_size,
                    {"plan_digest": plan.digest})
    return layout, settings


def _start(folder: Path, plan, settings, layout: Layout) -> Manifest:
    """The folder's manifest when it holds a harvest with these settings (as written: complete
    or not), else a new one (written now, so a restart knows the settings even before the
    first shard)."""
    if (folder / MANIFEST).is_file():
        m = Manifest.read(folder)
        same_harvest(m, plan.digest, settings, folder)
        return m
    if any(folder.glob("shard-*.safetensors")) or any(folder.glob("data-*.arrow")):
        raise TapcError(f"{folder} holds shards but no {MANIFEST}: harvest into an empty folder")
    m = new_manifest(plan, layout, settings)
    m.write(folder)
    return m


def same_harvest(m: Manifest, plan_digest: str, settings: dict, where) -> None:
    """Refuse to go on in `where`, whose manifest is `m`, unless it holds a harvest of this plan
    with these settings (a key only one side has differs too; `split`, which older tapc wrote for
    a whole input, is left out)."""
    theirs = {"plan digest": m.plan_digest, **m.settings}
    if theirs.get("split") == [0, 1]:
        del theirs["split"]
    ours = {"plan digest": plan_digest, **json.loads(json.dumps(settings))}
    diff = [k for k in {**ours, **theirs} if theirs.get(k) != ours.get(k)]
    if diff:
        raise TapcError(f"{where} holds another harvest ({diff[0]}: {theirs.get(diff[0])!r} there, "
                        f"{ours.get(diff[0])!r} now): harvest into a new folder, or run the same command")


def _tokens(llm, prompts: Iterable, first: int) -> Iterator[tuple[int, list[int]]]:
    """(index, token ids) of each prompt, numbered from `first`."""
    tokenizer = None
    for i, p in enumerate(prompts, first):
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            if tokenizer is None:
                tokenizer = llm.llm.get_tokenizer()
            p = tokenizer.encode(p)
        if not isinstance(p, (list, tuple)) or not p:
            raise TapcError(f"prompt {i}: a prompt is a string, a non-empty list of token ids or a dict with "
                            f"`prompt` / `prompt_token_ids`; got {str(p)[:80]!r}")
        yield i, [int(t) for t in p]
