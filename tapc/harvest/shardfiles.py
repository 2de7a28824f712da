"""Shard files written through, a request's rows at a time, so host memory never holds a shard.

`SafetensorsShard`: the header is written first for `cap` rows per column, and each column's
rows land at their offset (`pwrite`); a shard that ends short of the rows it was opened for (the
last, where the writer could not size it) is rewritten compactly from its own file, never from
memory. `ArrowShard`: the HF `datasets` Arrow layout SAELens
loads (`load_from_disk`): one row per context window, a column per hook of
`Array2D((context, width))`, `token_ids` a fixed-size int32 list, `request` the prompt's index;
record batches are appended as they fill. Both write to `NAME.partial` and rename when done, so a
file under its final name is always whole.
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tapc.errors import TapcError

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                      torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
                      torch.bool: "BOOL"}


@dataclass(frozen=True)
class Column:
    """One column of a shard: `shape` of one row (() for a scalar), `dtype` as stored."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes in row-major order: its own memory when it is contiguous, else a
    copy (a capture that shares its storage rows with others of its group is strided)."""
    t = t.contiguous()
    if t.numel() == 1:   # "contiguous" whatever its stride: view() needs the stride to be 1
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_tensors(fd: int, tensors: list[torch.Tensor], offset: int, observe=None) -> None:
    """The tensors' bytes, one after the other, from `offset`. A tensor whose rows are apart in
    memory (one key of a capture block holding several) is copied contiguous first: a copy is
    one torch call, a row-by-row iovec list a Python object per row. `observe(t)` sees each
    once contiguous: reductions over it then read memory in order (min / max over a strided
    key took 2.4 times as long on the CPU)."""
    views = []
    for t in tensors:
        t = t.contiguous()
        if observe is not None:
            observe(t)
        views.append(tensor_bytes(t))
    _pwritev_all(fd, views, offset)


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    step = os.sysconf("SC_IOV_MAX")
    for i in range(0, len(views), step):
        batch = views[i: i + step]
        n, want = os.pwritev(fd, batch, offset), sum(len(v) for v in batch)
        if n < want:   # a short write (rare): the rest, contiguously
            _pwrite_all(fd, b"".join(bytes(v) for v in batch)[n:], offset + n)
        offset += want


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class SafetensorsShard:
    def __init__(self, path: Path, columns: list[Column], cap: int, metadata: dict[str, str], observe=None,
                 pool: Executor | None = None):
        """`observe(name, rows)`: each piece of a column as it is written (the writer's statistics).
        `pool`: threads that flush the columns side by side (None: one after the other)."""
        self.path, self.columns, self.cap, self.metadata, self.observe = path, columns, cap, metadata, observe
        self.pool = pool
        self.partial = path.with_name(path.name + ".partial")
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.base, self.offsets = self._header(self.fd, cap)
        self.rows = self.flushed = 0
        self.waiting: dict[str, list[torch.Tensor]] = {}

    def _header(self, fd: int, rows: int) -> tuple[int, dict[str, int]]:
        header: dict = {"__metadata__": self.metadata}
        offsets, at = {}, 0
        for c in self.columns:
            offsets[c.name] = at
            n = rows * c.row_bytes
            header[c.name] = {"dtype": SAFETENSORS_DTYPES[c.dtype], "shape": [rows, *c.shape], "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        _pwrite_all(fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(fd, 8 + len(text) + at)
        return 8 + len(text), offsets

    def write(self, cols: dict[str, torch.Tensor]) -> None:
        """Rows after the ones written so far. Held (the caller's tensors) until
        `flush`: a column's rows from many requests then go to the file in one system call."""
        for c in self.columns:
            self.waiting.setdefault(c.name, []).append(cols[c.name])
        self.rows += len(next(iter(cols.values())))

    def flush(self) -> None:
        """Write what `write` holds, each column in one system call; its tensors are free again
        afterwards. With a pool the columns go side by side: a column's copy to contiguous
        memory and its statistics are torch calls that let go of the GIL, and they took most of
        a lone writer thread's time (the file's own lock still orders the writes themselves)."""
        if not self.waiting:
            return

        def flush_column(c: Column) -> None:
            see = None if self.observe is None else (lambda t: self.observe(c.name, t))
            write_tensors(self.fd, self.waiting[c.name], self.base + self.offsets[c.name] + self.flushed * c.row_bytes,
                           see)

        for _ in (map if self.pool is None else self.pool.map)(flush_column, self.columns):
            pass   # (the pool's map raises a column's error here)
        self.waiting, self.flushed = {}, self.rows

    def finish(self) -> None:
        self.flush()
        if self.rows < self.cap:   # the last shard: the same columns, `rows` long, copied file to file
            tmp = self.partial.with_name(self.partial.name + "2")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                base, offsets = self._header(fd, self.rows)
                for c in self.columns:
                    src, dst, left = self.base + self.offsets[c.name], base + offsets[c.name], self.rows * c.row_bytes
                    while left:
                        n = os.copy_file_range(self.fd, fd, left, src, dst)
                        src, dst, left = src + n, dst + n, left - n
            finally:
                os.close(fd)
            os.replace(tmp, self.partial)
        os.close(self.fd)
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        os.close(self.fd)
        self.partial.unlink(missing_ok=True)


class ArrowShard:
    """`columns`: per hook `Column(name, (context, width), dtype)`, then `token_ids` and `request`."""

    BATCH_BYTES = 64 << 20   # a record batch is appended when this much is waiting

    def __init__(self, path: Path, columns: list[Column], cap: int, metadata: dict[str, str], observe=None,
                 pool: Executor | None = None):
        pa = require_arrow()   # (`pool` unused: a record batch is built column by column)
        self.path, self.columns, self.cap, self.observe = path, columns, cap, observe
        self.partial = path.with_name(path.name + ".partial")
        self.schema = arrow_schema(columns)
        self.sink = pa.OSFile(str(self.partial), "wb")
        self.writer = pa.ipc.new_stream(self.sink, self.schema)
        self.waiting: list[dict[str, torch.Tensor]] = []
        self.waiting_bytes = 0
        self.rows = 0
        self.row_bytes = sum(c.row_bytes for c in columns)

    def write(self, cols: dict[str, torch.Tensor]) -> None:
        self.waiting.append(cols)
        n = len(next(iter(cols.values())))
        self.rows += n
        self.waiting_bytes += n * self.row_bytes
        if self.waiting_bytes >= self.BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Append what is waiting as one record batch."""
        import pyarrow as pa

        if not self.waiting:
            return
        arrays = []
        for c, field in zip(self.columns, self.schema):
            if self.observe is not None:
                for w in self.waiting:
                    self.observe(c.name, w[c.name])
            t = torch.cat([w[c.name] for w in self.waiting]).to(c.dtype)
            flat = pa.array(t.contiguous().view(-1).numpy())
            n = len(t)
            if len(c.shape) == 2:      # Array2D: list<list<value>>
                ctx, width = c.shape
                inner = pa.ListArray.from_arrays(pa.array(np.arange(0, n * ctx * width + 1, width, dtype=np.int32)), flat)
                outer = pa.ListArray.from_arrays(pa.array(np.arange(0, n * ctx + 1, ctx, dtype=np.int32)), inner)
                arrays.append(pa.ExtensionArray.from_storage(field.type, outer))
            elif len(c.shape) == 1:    # fixed-size list
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, c.shape[0]))
            else:
                arrays.append(flat)
        self.writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.waiting, self.waiting_bytes = [], 0

    def finish(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        self.writer.close()
        self.sink.close()
        self.partial.unlink(missing_ok=True)


def require_arrow():
    """pyarrow and datasets, or an error naming the extra that brings them."""
    try:
        import datasets  # noqa: F401  (the Array2D extension type and the schema metadata)
        import pyarrow
    except ImportError as e:
        raise TapcError(f"the arrow output format needs pyarrow and datasets ({e.name} is missing): "
                        "pip install 'tapc[data]'") from None
    return pyarrow


def arrow_schema(columns: list[Column]):
    from datasets import Array2D, Features, Sequence, Value

    feats = {}
    for c in columns:
        dtype = str(c.dtype).removeprefix("torch.")
        if len(c.shape) == 2:
            feats[c.name] = Array2D(c.shape, dtype)
        elif len(c.shape) == 1:
            feats[c.name] = Sequence(Value(dtype), length=c.shape[0])
        else:
            feats[c.name] = Value(dtype)
    return Features(feats).arrow_schema


def write_dataset_files(folder: Path, columns: list[Column], files: list[str], fingerprint: str) -> None:
    """`dataset_info.json` and, last (a reader sees a dataset only once it is whole), `state.json`:
    what `datasets.load_from_disk` reads beside the Arrow files."""
    for name, text in dataset_files(columns, files, fingerprint):
        tmp = folder / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, folder / name)


def dataset_files(columns: list[Column], files: list[str], fingerprint: str) -> list[tuple[str, str]]:
    """(name, text) of the files `datasets.load_from_disk` reads beside the Arrow `files` (paths
    relative to the folder), in the order to write them."""
    from datasets import Features

    schema = arrow_schema(columns)
    features = Features.from_arrow_schema(schema)
    info = {"citation": "", "description": "activations harvested by tapc (see tapc_manifest.json)",
            "features": features.to_dict(), "homepage": "", "license": ""}
    state = {"_data_files": [{"filename": f} for f in files], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    return [("dataset_info.json", json.dumps(info, indent=2)), ("state.json", json.dumps(state, indent=2))]
