"""Prompts for a harvest in parts: read as a Ray dataset, then cut into parts in input order.

    ds, column, kind = read_dataset("prompts.jsonl")                  # a JSON line each
    ds, column, kind = read_dataset("corpus.parquet", text_field="text")   # documents
    for part, values in cut(stream(ds, column, kind), 4096): ...        # (Part, pyarrow array)

Ray reads the files (local paths, or URLs through pyarrow's filesystems); the driver takes the
rows in input order (the dataset's order kept) and numbers them, so prompt i is the same prompt
in every run, whatever the cluster. The same prompts as `tapc harvest` without Ray reads
(tapc/harvest/corpus.py): `.jsonl` lines parsed as prompts (by the actor, `decode`), other
files' lines as text, blank lines left out; documents (`text_field`) from `.jsonl`, `.txt`,
`.parquet` or a `datasets` folder, empty ones left out, or packed into windows on the driver.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from tapc.errors import TapcError
from tapc.harvest.corpus import parse_prompt
from tapc.harvest.parts import Part

BATCH = 4096   # rows the driver takes from Ray at a time
KINDS = ("jsonl", "values")   # a JSON line each (parsed by the actor), or prompts as they are


def read_dataset(prompts, text_field: str | None = None):
    """(Ray dataset, its column of prompts, kind) of `prompts`: a path or URL (or a list of
    them), or a Ray dataset (its column `text_field`, default `prompt`: text or token ids).
    With `text_field`, files hold documents; without, prompts."""
    import ray.data

    if isinstance(prompts, ray.data.Dataset):
        column = text_field or "prompt"
        if column not in prompts.columns():
            raise TapcError(f"the prompts dataset has no column {column!r}; it has {', '.join(prompts.columns())}")
        return prompts, column, "values"
    paths = [os.fspath(p) for p in ([prompts] if isinstance(prompts, (str, os.PathLike)) else prompts)]
    for p in paths:
        if "://" not in p and not Path(p).exists():
            raise TapcError(f"{p}: no such prompts file")
    suffix = Path(paths[0]).suffix
    if text_field is None:
        if suffix == ".parquet" or Path(paths[0]).is_dir():
            raise TapcError(f"{paths[0]}: documents (a .parquet or a datasets folder) need text_field, the column "
                            "of their text (--text-field)")
        return ray.data.read_text(paths), "text", "jsonl" if suffix == ".jsonl" else "values"
    if Path(paths[0]).is_dir():
        from datasets import load_from_disk

        ds = ray.data.from_huggingface(load_from_disk(paths[0]))
    elif suffix == ".parquet":
        ds = ray.data.read_parquet(paths)
    elif suffix == ".jsonl":
        ds = ray.data.read_json(paths, lines=True)
    else:
        return ray.data.read_text(paths), "text", "values"
    if text_field not in ds.columns():
        raise TapcError(f"{paths[0]}: no column {text_field!r}; it has {', '.join(ds.columns())}")
    return ds, text_field, "values"


def stream(ds, column: str, *, drop: str | None = None, pack: Callable | None = None,
           limit: int | None = None) -> Iterator:
    """The prompts of `ds`'s `column` in input order, as pyarrow arrays. `drop`: "blank" leaves
    out whitespace-only strings (prompt lines), "empty" empty ones (documents); token-id prompts
    are kept as they are (an empty one is refused as the harvest reads it); `pack(texts)`:
    the token-id windows of the texts, made here (tapc.harvest.corpus.pack); `limit`: only the
    first prompts (windows when packing)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ds.context.execution_options.preserve_order = True   # rows in input order: prompt i is always prompt i

    def arrays():
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=BATCH):
            a = batch.column(column).combine_chunks()
            text = pa.types.is_string(a.type) or pa.types.is_large_string(a.type)
            if text and drop == "blank":
                a = a.filter(pc.not_equal(pc.utf8_trim_whitespace(a), ""))
            elif text and drop == "empty":
                a = a.filter(pc.not_equal(a, ""))
            yield a

    out = arrays()
    if pack is not None:
        out = _chunks(pack(t for a in out for t in a.to_pylist()), pa)
    left = limit
    for a in out:
        if left is not None:
            a = a.slice(0, left)
            left -= len(a)
        if len(a):
            yield a
        if left == 0:
            return


def cut(arrays: Iterator, size: int) -> Iterator[tuple[Part, object]]:
    """(part, its prompts as one array) of consecutive arrays of prompts: `size` a part, the last
    part what is left."""
    import pyarrow as pa

    held, n, no = [], 0, 0
    for a in arrays:
        while len(a):
            take = min(size - n, len(a))
            held.append(a.slice(0, take))
            a, n = a.slice(take), n + take
            if n == size:
                yield Part(no, no * size, no * size + size), pa.concat_arrays(held)
                held, n, no = [], 0, no + 1
    if n:
        yield Part(no, no * size, no * size + n), pa.concat_arrays(held)


def decode(values: list, kind: str, first: int) -> list:
    """The prompts of a part as `harvest` takes them (`first`: the index of the first)."""
    if kind == "jsonl":
        return [parse_prompt(v, f"prompt {i}") for i, v in enumerate(values, first)]
    return values


def _chunks(prompts: Iterator[list[int]], pa) -> Iterator:
    chunk = []
    for p in prompts:
        chunk.append(p)
        if len(chunk) == BATCH:
            yield pa.array(chunk, pa.list_(pa.int64()))
            chunk = []
    if chunk:
        yield pa.array(chunk, pa.list_(pa.int64()))
