"""A harvest in parts, for many engines at once: prompt i of the input belongs to part
i // part_prompts, and each part is a whole harvest of its own (tapc/harvest/run.py) in
`part-NNNNNN/` of the store (tapc/harvest/store.py), written by whichever engine took it.

    top, layout = open_top(store, plan, part_prompts=4096, ...)       # the driver, first
    harvest_part(llm, store, Part(3, 12288, 16384), prompts, ...)     # any engine, any machine
    merge(store, top, layout, parts)                           # the driver, when every part is whole

The store's manifest is written first with the settings (a restart with other settings is
refused, as run.py refuses one), and once every part is whole it is replaced by one listing
every part's shards (paths relative to the store), failures and statistics: the folder then
reads as one harvest (`tapc.data.Shards`). A part cut short goes on from its last shard when it
is taken again, as a harvest does; a part whose manifest says complete is never run again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tapc.errors import TapcError
from tapc.harvest.run import MANIFEST, Manifest, harvest, harvest_layout, new_manifest, same_harvest
from tapc.harvest.shardfiles import dataset_files
from tapc.harvest.store import Store
from tapc.harvest.writer import Layout, ShardRecord


@dataclass(frozen=True)
class Part:
    """Prompts `start` to `stop - 1` of the input: part `no`."""

    no: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"part-{self.no:06d}"


def harvest_part(llm, store: Store, part: Part, prompts: list, **options) -> Manifest:
    """Harvest `prompts` (the part's, in input order) with `llm` into the part's folder and put
    it into the store (`options`: tapc.harvest.run.harvest's)."""
    if len(prompts) != part.stop - part.start:
        raise TapcError(f"{part.name}: {len(prompts)} prompts for a part of {part.stop - part.start}")
    folder = store.folder(part.name)
    m = harvest(llm, prompts, folder, part=(part.start, part.stop), **options)
    store.put(folder, part.name)
    return m


def open_top(store: Store, plan, *, part_prompts: int, format: str, dtype: str | None, shard_tokens: int,
             context_size: int | None, positions, more: dict) -> tuple[Manifest, Layout]:
    """The store's own manifest, the one there when it holds a harvest in parts with these
    settings, else a new one, written now; and the parts' shard layout."""
    if part_prompts < 1:
        raise TapcError(f"part_prompts must be at least 1, got {part_prompts}")
    layout, settings = harvest_layout(plan, store.local, format=format, dtype=dtype, shard_tokens=shard_tokens,
                                      context_size=context_size, positions=positions,
                                      more={**more, "parts": part_prompts})
    text = store.read_text(MANIFEST)
    if text is not None:
        top = Manifest.parse(text, f"{store.url}/{MANIFEST}")
        same_harvest(top, plan.digest, settings, store.url)
        return top, layout
    top = new_manifest(plan, layout, settings)
    store.write_text(MANIFEST, top.dumps())
    return top, layout


def whole_parts(store: Store, top: Manifest) -> dict[str, list[int]]:
    """The parts the store holds whole: the prompts each covers ([start, stop]), by name. A part
    of another harvest is refused."""
    spans = {}
    for name, text in store.manifests().items():
        m = Manifest.parse(text, f"{store.url}/{name}/{MANIFEST}")
        if m.complete:
            same_harvest(m, top.plan_digest, part_settings(top, m.settings.get("part")), f"{store.url}/{name}")
            spans[name] = m.settings["part"]
    return spans


def part_settings(top: Manifest, span) -> dict:
    """The settings a part of the harvest `top` covering prompts `span` ([start, stop]) has."""
    settings = {k: v for k, v in top.settings.items() if k != "parts"}
    return {**settings, "part": span}


def merge(store: Store, top: Manifest, layout: Layout, parts: list[Part]) -> Manifest:
    """The store's manifest over `parts` (every part of the input, in order), all whole: their
    shards (paths relative to the store, bounds in the whole input), failures and statistics as
    one harvest's. Written, and returned; an arrow harvest's folder is then one HF dataset
    too (`datasets.load_from_disk`), over every part's files."""
    shards, records, failed, rows = [], [], [], 0
    for part in parts:
        where = f"{store.url}/{part.name}"
        text = store.read_text(f"{part.name}/{MANIFEST}")
        if text is None:
            raise TapcError(f"{where}: this part is missing: run the harvest again to go on")
        m = Manifest.parse(text, f"{where}/{MANIFEST}")
        same_harvest(m, top.plan_digest, part_settings(top, [part.start, part.stop]), where)
        if not m.complete:
            raise TapcError(f"{where}: this part is not finished: run the harvest again to go on")
        shards += [ShardRecord(**{**vars(s), "file": f"{part.name}/{s.file}",
                                  "start": [part.start + s.start[0], s.start[1]],
                                  "end": [part.start + s.end[0], s.end[1]]}) for s in m.shards]
        records += m.shards + ([m.unwritten] if m.unwritten else [])
        failed += m.failed
        rows += m.rows
    whole = dataclasses.replace(top, shards=shards, unwritten=None, prompts=parts[-1].stop if parts else 0, rows=rows,
                                failed=sorted(failed, key=lambda f: f["request"]), stats={})
    whole.finish(records)
    store.write_text(MANIFEST, whole.dumps())
    if layout.format == "arrow":
        for name, text in dataset_files(layout.columns(), [s.file for s in whole.shards], whole.plan_digest):
            store.write_text(name, text)
    return whole
