"""Prompts for a harvest from files: token ids or text, read lazily.

    read_prompts("prompts.jsonl")                   # strings / token-id lists, one per line
    docs = read_texts("corpus.parquet", "text")     # .jsonl, .txt, .parquet, a `datasets` folder
    windows = pack(docs, tokenizer, context_size=128)   # SAELens-style fixed windows

`pack` does what SAELens's `concat_and_batch_sequences` does with its defaults: each document's
tokens (no special tokens), BOS between documents, cut into windows of `context_size` tokens
that each start with BOS; the tail shorter than a window is dropped. `per_row` keeps one prompt
per document, tokenized as the engine would (with the tokenizer's special tokens). `describe`
says which was done, for the manifest.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tapc.errors import TapcError


def read_prompts(path: str | os.PathLike) -> Iterator:
    """Prompts from a file, lazily: `.jsonl`, one per line as a string, a list of token ids or
    an object with `prompt` (text) or `prompt_token_ids`; any other file, one text per line.
    Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise TapcError(f"{path}: no such prompts file")
    with path.open() as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            yield parse_prompt(line, f"{path}:{n}") if path.suffix == ".jsonl" else line


def parse_prompt(line: str, where: str) -> str | list[int]:
    """One `.jsonl` prompt line: a JSON string, a list of token ids, or an object with `prompt`
    or `prompt_token_ids` (`where` names it in the error)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise TapcError(f"{where}: not JSON ({e.msg})") from None
    if isinstance(item, dict) and set(item) & {"prompt", "prompt_token_ids"}:
        item = item.get("prompt_token_ids", item.get("prompt"))
    if isinstance(item, str) or (isinstance(item, list) and item and all(isinstance(t, int) for t in item)):
        return item
    raise TapcError(f"{where}: a prompt is a string, a list of token ids, or an object "
                    f"with `prompt` or `prompt_token_ids`; got {line[:80]!r}")


def read_texts(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """Documents from `.jsonl` (objects: their `text_field`), `.txt` (one per line), `.parquet`
    (the `text_field` column; needs pyarrow) or a local HF `datasets` folder saved with
    `save_to_disk` (needs datasets). Read lazily, in file order."""
    path = Path(path)
    if path.is_dir():
        if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
            raise TapcError(f"{path}: a folder of text must be a `datasets` folder (save_to_disk: state.json)")
        datasets = _need("datasets", "reading a datasets folder")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise TapcError(f"{path}: a DatasetDict with splits {list(ds)}: name one split's folder")
        _has_field(ds.column_names, text_field, path)
        for row in ds.select_columns([text_field]).iter(batch_size=1024):
            yield from _strings(row[text_field], text_field, path)
        return
    if not path.is_file():
        raise TapcError(f"{path}: no such file")
    if path.suffix == ".parquet":
        pq = _need("pyarrow.parquet", "reading parquet")
        f = pq.ParquetFile(str(path))
        _has_field(f.schema_arrow.names, text_field, path)
        for batch in f.iter_batches(columns=[text_field], batch_size=1024):
            yield from _strings(batch.column(0).to_pylist(), text_field, path)
        return
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line.rstrip("\n")
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise TapcError(f"{path}:{n}: not JSON ({e.msg})") from None
            text = item.get(text_field) if isinstance(item, dict) else None
            if not isinstance(text, str):
                raise TapcError(f"{path}:{n}: no string field {text_field!r} (keys: {list(item)[:8] if isinstance(item, dict) else type(item).__name__})")
            yield text


def pack(docs: Iterable[str], tokenizer, context_size: int, prepend_bos: bool = True) -> Iterator[list[int]]:
    """Fixed windows of `context_size` tokens over the concatenated documents (see module doc)."""
    bos = _bos(tokenizer) if prepend_bos else None
    body = context_size - (1 if prepend_bos else 0)
    if body < 1:
        raise TapcError(f"context_size {context_size} leaves no room for tokens after BOS")
    buf: list[int] = []
    first = True
    for doc in docs:
        toks = tokenizer.encode(doc, add_special_tokens=False)
        if not first and bos is not None:
            buf.append(bos)          # SAELens's sequence_separator_token="bos"
        first = False
        buf += toks
        while len(buf) >= body:
            yield ([bos] if bos is not None else []) + buf[:body]
            buf = buf[body:]


def per_row(docs: Iterable[str], tokenizer) -> Iterator[list[int]]:
    """One prompt per document, as vLLM would tokenize it (special tokens: BOS where the
    tokenizer adds one). Empty documents are skipped (a BOS alone is no document)."""
    for doc in docs:
        toks = tokenizer.encode(doc) if doc else None
        if toks:
            yield toks


def describe(path, text_field: str, tokenizer, context_size: int | None, prepend_bos: bool = True) -> dict:
    """The manifest's `source`: where the prompts came from and how they were cut."""
    out = {"kind": "text", "path": str(path), "text_field": text_field,
           "tokenizer": "the engine's" if tokenizer is None else getattr(tokenizer, "name_or_path",
                                                                          type(tokenizer).__name__),
           "bos_token_id": getattr(tokenizer, "bos_token_id", None)}
    if context_size:
        out.update(packing="windows", context_size=context_size, prepend_bos=prepend_bos,
                   separator="bos" if prepend_bos else None,
                   note="documents concatenated (BOS between them) and cut into windows that start with BOS, "
                        "as SAELens's concat_and_batch_sequences; a window is not one document")
    else:
        out.update(packing="rows", note="one prompt per document, with the tokenizer's special tokens")
    return out


def _bos(tokenizer) -> int:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise TapcError("the tokenizer has no BOS token: pack with prepend_bos=False")
    return bos


def _has_field(names, field: str, path) -> None:
    if field not in names:
        raise TapcError(f"{path}: no column {field!r}; it has {', '.join(names)}")


def _strings(values, field, path) -> Iterator[str]:
    for v in values:
        if not isinstance(v, str):
            raise TapcError(f"{path}: column {field!r} holds {type(v).__name__}, not text")
        yield v


def _need(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TapcError(f"{what} needs {module.split('.')[0]}: pip install 'tapc[data]'") from None
