"""A harvest over a Ray cluster: prompts read as a Ray dataset (tapc/harvest/dataset.py), a Ray
Data actor pool of tapped engines (one per GPU, or per tensor / pipeline parallel group), and
each part of the input harvested whole by one actor, which writes its shards
(tapc/harvest/parts.py) to a shared folder or to object storage (tapc/harvest/store.py).

    harvest_ray(SpecEngine("spec.yaml"), "prompts.jsonl", "s3://bucket/acts", part_prompts=4096)
    tapc harvest spec.yaml prompts.jsonl --ray [ADDRESS]     # the same; --gpus N: this host's GPUs

The driver reads the prompts in input order and cuts them into parts (prompt i is in part
i // part_prompts), leaving out the parts the store holds whole, and Ray Data hands each part to
an idle actor. An actor that dies is started again by Ray and handed its part again, which
goes on from its last shard; a driver that dies is started again with the same arguments:
whole parts are left out, the others go on from their last shards. So no prompt is written
twice and none is lost. Once every part is whole, the store's manifest lists them all.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from tapc.errors import TapcError
from tapc.harvest.corpus import describe, pack
from tapc.harvest.dataset import cut, decode, read_dataset, stream
from tapc.harvest.engines import SpecEngine
from tapc.harvest.parts import Part, harvest_part, merge, open_top, whole_parts
from tapc.harvest.run import Manifest, default_sampling
from tapc.harvest.store import Store

log = logging.getLogger("tapc")

PART_PROMPTS = 4096


def harvest_ray(engine, prompts, out: str | os.PathLike, *, engines: int | None = None,
                gpus_per_engine: float | None = None, cpus_per_engine: float = 1.0, actor_options: dict | None = None,
                part_prompts: int = PART_PROMPTS, text_field: str | None = None, context_size: int | None = None,
                tokenizer=None, limit: int | None = None, storage_options: dict | None = None, filesystem=None,
                shard_tokens: int = 1_000_000, positions: str | list[int] = "all", sampling_params=None,
                format: str = "safetensors", dtype: str | None = None, window_tokens: int | None = None,
                collect_every: int = 256, on_part: Callable[[dict], None] | None = None) -> Manifest:
    """Harvest `prompts` on the Ray cluster this process is connected to (`ray.init`; without
    it Ray Data starts one on this host) into `out`, a folder every actor reaches or an fsspec
    URL (`s3://...`, with `storage_options`; or `filesystem`, a pyarrow or fsspec one). See the
    module doc; the store's manifest is returned once every part is whole.

    `engine`: a spec (path or `Spec`), or a factory with `plan()` (run here) that makes the
    tapped engine when called (in each actor): tapc.harvest.engines. `engines`: actors (default:
    as many as the cluster's GPUs hold), each with `gpus_per_engine` GPUs (default: the plan's
    tensor x pipeline parallel size) and `cpus_per_engine` CPUs; `actor_options`: more Ray
    options for them (`resources=`, `runtime_env=`, ...). `prompts`: a path or URL (or a list),
    or a Ray dataset (its column `text_field`, default `prompt`); `text_field` makes the files
    documents, a prompt each, or with `context_size` packed into windows on the driver (needs
    `tokenizer`, the engine's). `part_prompts`: prompts a part (a restart must keep it).
    `on_part(row)`: after each part written, with its name, prompts, rows, failures, the seconds
    its engine took (harvest and put) and its node.
    The rest is as `tapc.harvest.run.harvest` takes it."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init()
    engine = engine if callable(engine) else SpecEngine(engine)
    params = default_sampling(sampling_params)
    plan = engine.plan()
    gpus = plan.tensor_parallel_size * plan.pipeline_parallel_size if gpus_per_engine is None else gpus_per_engine
    engines = engines or _engines_fitting(ray, gpus)
    store = Store(out, storage_options, filesystem)
    ds, column, kind = read_dataset(prompts, text_field)
    packer = None
    if text_field is not None and context_size:
        if tokenizer is None:
            raise TapcError("packing documents into windows (context_size with text_field) runs on the driver: "
                            "give tokenizer=, the engine's")
        packer = lambda texts: pack(texts, tokenizer, context_size)   # noqa: E731
    source = {"kind": "prompts"} if text_field is None else describe(
        prompts if isinstance(prompts, (str, os.PathLike)) else "a Ray dataset", text_field, tokenizer, context_size)
    top, layout = open_top(store, plan, part_prompts=part_prompts, format=format, dtype=dtype,
                           shard_tokens=shard_tokens, context_size=context_size, positions=positions,
                           more={"max_tokens": params.max_tokens, "source": source})
    if top.complete:
        log.warning("tapc harvest: %s already holds this harvest, complete: nothing to do", store.url)
        return top
    whole = whole_parts(store, top)
    parts, todo = [], []
    drop = "blank" if text_field is None else None if packer else "empty"
    for part, values in cut(stream(ds, column, drop=drop, pack=packer, limit=limit), part_prompts):
        parts.append(part)
        span = whole.get(part.name)
        if span is not None and span != [part.start, part.stop]:
            raise TapcError(f"{store.url}/{part.name} holds prompts {span[0]} to {span[1] - 1}, but this input's "
                            f"part {part.no} is {part.start} to {part.stop - 1}: another input; harvest into a new "
                            "folder")
        if span is None:
            todo.append(ray.put(_block(part, values)))
    if todo:
        options = dict(shard_tokens=shard_tokens, positions=positions, sampling_params=params, format=format,
                       dtype=dtype, context_size=context_size, source=source, window_tokens=window_tokens,
                       collect_every=collect_every)
        rows = ray.data.from_arrow_refs(todo).map_batches(
            # a batch is a part: each block holds one, and all but the last are part_prompts long (Ray
            # Data wants a batch size where actors take GPUs)
            PartWorker, batch_size=part_prompts, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=min(engines, len(todo))),
            num_gpus=gpus, num_cpus=cpus_per_engine,
            fn_constructor_kwargs=dict(engine=engine, store=(store.url, storage_options, filesystem),
                                       part_prompts=part_prompts, kind=kind, options=options),
            **(actor_options or {}))
        done = len(parts) - len(todo)
        for row in rows.iter_rows():
            if row["error"]:
                raise TapcError(f"{row['part']}: {row['error']}")
            done += 1
            log.info("tapc harvest: %s written (%d prompts, %d rows, %d failed, %.1f s) on node %s: %d of %d parts",
                     row["part"], row["prompts"], row["rows"], row["failed"], row["seconds"], row["node"][:12], done,
                     len(parts))
            if on_part is not None:
                on_part(row)
    return merge(store, top, layout, parts)


class PartWorker:
    """A Ray Data actor: one tapped engine (`engine()`), harvesting each part it is handed (a
    block of `_block`) into the store. It answers a row per part; tapc's own errors come back
    in it as words (Ray's wrapping of an exception loses the TapcError), and the driver raises."""

    def __init__(self, engine, store: tuple, part_prompts: int, kind: str, options: dict):
        self.size, self.kind, self.options = part_prompts, kind, options
        self.error = ""
        try:
            self.llm = engine()
            self.store = Store(*store)
        except TapcError as e:   # no engine here (no GPU, a bad spec): each part says why
            self.error = str(e)

    def __call__(self, block) -> dict:
        import ray

        index = block.column("index").to_numpy()
        start = int(index[0])
        part = Part(start // self.size, start, start + len(index))
        row = {"part": [part.name], "prompts": [len(index)], "rows": [0], "failed": [0], "seconds": [0.0],
               "error": [self.error], "node": [ray.get_runtime_context().get_node_id()]}
        if self.error:
            return row
        try:
            if start % self.size or not np.array_equal(index, np.arange(part.start, part.stop)):
                raise TapcError(f"a block of prompts {start} to {int(index[-1])} is not one part of {self.size}: "
                                "Ray Data split or joined the parts")
            prompts = decode(block.column("prompt").to_pylist(), self.kind, start)
            t0 = time.perf_counter()
            m = harvest_part(self.llm, self.store, part, prompts, progress=False, **self.options)
        except TapcError as e:
            row["error"] = [str(e)]
            return row
        return {**row, "rows": [m.rows], "failed": [len(m.failed)], "seconds": [time.perf_counter() - t0]}


def require_ray():
    """Ray with Ray Data, or an error naming the extra that brings it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise TapcError("a harvest over Ray needs ray[data]: pip install 'tapc[ray]'") from None
    return ray


def _block(part: Part, values):
    """A part as one Ray block: its prompts' indices and the prompts."""
    import pyarrow as pa

    return pa.table({"index": pa.array(np.arange(part.start, part.stop)), "prompt": values})


def _engines_fitting(ray, gpus: float) -> int:
    total = ray.cluster_resources().get("GPU", 0)
    if not gpus:
        raise TapcError("engines: give how many engines to run (they take no GPU, so the cluster's GPUs do not say)")
    if total < gpus:
        raise TapcError(f"the Ray cluster has {total:g} GPUs and an engine takes {gpus:g} (gpus_per_engine; by "
                        "default the plan's tensor x pipeline parallel size): no engine fits")
    return int(total // gpus)
