"""Where a served request's results wait for their fetch, and the form they travel in.

A plain `vllm serve` runs one API server process: it admits, collects and answers every
request, so results wait in its memory (`MemoryResults`) and stream from the captures' own
arena memory. With `--api-server-count N`, vLLM runs N API server processes behind one port,
and a client's completion and its `GET /v1/tapc/results/{id}` (or a vector's registration and
the request naming it) may land on different ones. Then results and vectors wait in a folder
all of them share (`FolderResults`: /dev/shm/tapc-serve-<pid of the process that started
them>): the process that served the request writes its result there as one safetensors file,
and whichever process gets the fetch claims the file by renaming it (so once, by one) and
streams it.

Results travel as safetensors (`encode`): each capture under its key, each tensor a block
saved under `saved/<name>/<i>`, the error and the other saved values in the metadata.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import math
import mmap
import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from tapc.errors import RequestError
from tapc.harvest.shardfiles import SAFETENSORS_DTYPES, tensor_bytes, write_tensors
from tapc.wire.arena import shm_directory

CHUNK = 1 << 20   # bytes handed to the transport at a time (it buffers what the socket has not taken)


@dataclass
class Stored:
    """A finished request's results, until fetched."""

    taps: dict
    saved: dict
    error: BaseException | None
    unreached: tuple[int, ...] = ()   # listed positions the request stopped before (session.Taps)
    at: float = field(default_factory=time.monotonic)

    def drop_tensors(self) -> None:
        """Sent or written: whoever still holds this holds no capture chunk (they go back)."""
        self.taps.clear()
        self.saved.clear()


@dataclass
class Reply:
    """A result ready to go out: its size in bytes, the class of the error its request ended
    with ('' if none), and its bytes, in order."""

    size: int
    error_type: str
    chunks: AsyncIterator


class MemoryResults:
    """Results and vectors in this process: the one API server of a plain `vllm serve`.
    `released` is called once a result's captures are dropped (their chunks can go back)."""

    def __init__(self, keep_s: float, released: Callable[[], None]):
        self.keep_s = keep_s       # results not fetched (or lent and not given back) within this long are dropped
        self._released = released
        self._vectors: dict[str, np.ndarray] = {}
        self._running: dict[str, asyncio.Event] = {}
        self._done: dict[str, Stored] = {}
        self._lent: dict[str, Lent] = {}
        atexit.register(self._drop_lent)   # the files of lent tensors copied out of the arena

    def vectors(self) -> dict[str, np.ndarray]:
        return self._vectors

    def add_vector(self, name: str, v: np.ndarray) -> None:
        self._vectors[name] = v

    def begin(self, tid: str) -> None:
        """`tid` was admitted: a fetch waits for it."""
        self._running[tid] = asyncio.Event()

    async def put(self, tid: str, stored: Stored) -> None:
        cutoff = time.monotonic() - self.keep_s
        for old in [t for t, s in self._done.items() if s.at < cutoff]:
            del self._done[old]
        for old in [t for t, lent in self._lent.items() if lent.at < cutoff]:
            self.give_back(old)
        self._done[tid] = stored
        done = self._running.pop(tid, None)
        if done is not None:
            done.set()

    async def _ready(self, tid: str, wait_s: float) -> Stored | None:
        """The result of `tid`, once, waiting up to `wait_s` for a request still running."""
        if tid in self._running:
            try:
                await asyncio.wait_for(asyncio.shield(self._running[tid].wait()), wait_s)
            except asyncio.TimeoutError:
                return None
        return self._done.pop(tid, None)

    async def take(self, tid: str, wait_s: float) -> Reply | None:
        """The result of `tid` (waiting up to `wait_s` for a request still running), once; None:
        unknown (never tapped, fetched already, or dropped after `keep_s`). RequestError: it
        cannot be sent (a block saved a tensor safetensors has no dtype for)."""
        stored = await self._ready(tid, wait_s)
        if stored is None:
            return None
        error_type = _error_type(stored)
        try:
            head, tensors = encode(stored)
        except RequestError:
            stored = None
            self._released()
            raise
        stored = None   # its tensors are in `tensors` now, which the stream empties as it goes
        size = len(head) + sum(t.numel() * t.element_size() for t in tensors)
        return Reply(size, error_type, self._stream(head, tensors))

    async def _stream(self, head: bytes, tensors: list):
        try:
            yield head
            while tensors:
                t = tensors.pop(0)
                # a strided capture is copied in a thread, not on the event loop
                data = tensor_bytes(t) if t.is_contiguous() else await asyncio.to_thread(tensor_bytes, t)
                del t
                for at in range(0, len(data), CHUNK):
                    yield data[at:at + CHUNK]
                del data
        finally:
            tensors.clear()     # the last views of its capture chunks: they go back to the
            self._released()    # workers with the next collect, or on their own soon

    async def lend(self, tid: str, wait_s: float, where: Callable) -> dict | None:
        """The result of `tid`, once, as `take` gives it, for a client on this host: where each
        tensor's bytes are in shared memory, not the bytes. A capture is described where it
        lies, in the engine's arena (`where`: ArenaReader.where); any other tensor (a capture
        joined from several blocks, a block's saved tensor) is copied into one file of its own.
        The memory is held until `give_back(tid)`, or for `keep_s`. JSON: `id`, `error`,
        `error_type`, `saved` (as the safetensors metadata), `keep_s`, and `tensors`: name ->
        {path, offset (bytes, of the first element's storage), dtype (safetensors' name), shape,
        stride, storage_offset (elements)}."""
        stored = await self._ready(tid, wait_s)
        if stored is None:
            return None
        try:
            tensors, meta = parts(stored)
        except RequestError:
            self._released()
            raise
        lent = Lent(stored)
        described, copied = {}, {}
        for name, t in tensors.items():
            at = where(t)
            if at is None:
                copied[name] = t
            else:
                described[name] = _described(t, *at)
        if copied:
            lent.path = os.path.join(shm_directory(), f"tapc-lent-{os.getpid()}-{tid}")
            offsets = await asyncio.to_thread(_write_lent, lent.path, list(copied.values()))
            for (name, t), offset in zip(copied.items(), offsets):
                described[name] = _described_contiguous(lent.path, offset, SAFETENSORS_DTYPES[t.dtype], list(t.shape))
        self._lent[tid] = lent
        return {"id": tid, **meta, "keep_s": self.keep_s, "tensors": described}

    def give_back(self, tid: str) -> bool:
        """The client is done with the memory `lend` described: it goes back (False: nothing is
        lent under `tid`)."""
        lent = self._lent.pop(tid, None)
        if lent is None:
            return False
        lent.stored.drop_tensors()
        if lent.path is not None:
            _remove(lent.path)
        self._released()
        return True

    def _drop_lent(self) -> None:
        for lent in self._lent.values():
            if lent.path is not None:
                _remove(lent.path)


@dataclass
class Lent:
    """A result lent to a client on this host: its tensors (held, so their arena blocks stay
    the client's) and the file of those copied out of the arena, if any."""

    stored: Stored
    path: str | None = None
    at: float = field(default_factory=time.monotonic)


def _described(t, path: str, offset: int) -> dict:
    return {"path": path, "offset": offset, "dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
            "stride": list(t.stride()), "storage_offset": t.storage_offset()}


def _described_contiguous(path: str, offset: int, dtype: str, shape: list[int]) -> dict:
    """`_described` of a row-major tensor at `offset` of `path` (dtype by its safetensors name)."""
    return {"path": path, "offset": offset, "dtype": dtype, "shape": shape,
            "stride": [math.prod(shape[i + 1:]) for i in range(len(shape))], "storage_offset": 0}


def _write_lent(path: str, tensors: list) -> list[int]:
    """The tensors' bytes, row-major, one after the other into a new file only this user can
    read; their offsets."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_tensors(fd, tensors, 0)
    finally:
        os.close(fd)
    return [sum(sizes[:i]) for i in range(len(sizes))]


class FolderResults:
    """Results and vectors in a folder the API server processes of one `vllm serve` share:
    `<tid>.running` while a request runs, then `<tid>.safetensors` (or `<tid>.error`, the
    reason it cannot be sent), claimed by the process that gets its fetch; `vectors/<name as
    hex>.npy`. Writing a result copies it once into the folder (RAM under /dev/shm); its
    capture chunks go back as soon as it is written."""

    POLL_S = 0.01   # how often a fetch looks for a result another process is finishing

    def __init__(self, folder: str, keep_s: float, released: Callable[[], None]):
        self.folder = folder
        self.keep_s = keep_s
        self._released = released
        self._vdir = os.path.join(folder, "vectors")
        os.makedirs(self._vdir, exist_ok=True)
        self._cache: dict[str, tuple[int, np.ndarray]] = {}   # vector name -> (mtime_ns, values)
        self._local: dict[str, asyncio.Event] = {}            # this process's running requests
        self._written: dict[str, float] = {}                  # results this process wrote, when (kept keep_s)
        self._swept = 0.0
        # the server going down drops results nobody fetched, as one process's memory would
        atexit.register(self._drop_written)

    # ------------------------------------------------------------------ vectors

    def vectors(self) -> dict[str, np.ndarray]:
        out = {}
        with os.scandir(self._vdir) as entries:
            for entry in entries:
                if not entry.name.endswith(".npy"):
                    continue
                name, stamp = bytes.fromhex(entry.name[:-4]).decode(), entry.stat().st_mtime_ns
                cached = self._cache.get(name)
                if cached is None or cached[0] != stamp:
                    try:
                        cached = self._cache[name] = (stamp, np.load(entry.path))
                    except FileNotFoundError:   # replaced while listed: the next look sees the new one
                        continue
                out[name] = cached[1]
        return out

    def add_vector(self, name: str, v: np.ndarray) -> None:
        path = os.path.join(self._vdir, name.encode().hex() + ".npy")
        _write_atomic(path, lambda f: np.save(f, v))

    # ------------------------------------------------------------------ results

    def begin(self, tid: str) -> None:
        open(self._path(tid, ".running"), "wb").close()
        self._local[tid] = asyncio.Event()

    async def put(self, tid: str, stored: Stored) -> None:
        now = time.time()
        self._written[tid] = now   # kept here, on the event loop: the writes run in threads side by side
        sweep = now - self._swept >= 1.0
        if sweep:
            self._swept = now
            self._written = {t: at for t, at in self._written.items() if at >= now - self.keep_s}
        try:
            await asyncio.to_thread(self._write, tid, stored, sweep)
        finally:
            _remove(self._path(tid, ".running"))
            done = self._local.pop(tid, None)
            if done is not None:
                done.set()
        self._released()

    def _write(self, tid: str, stored: Stored, sweep: bool = False) -> None:
        try:
            head, tensors = encode(stored)
        except RequestError as e:
            why = str(e).encode()
            _write_atomic(self._path(tid, ".error"), lambda f: f.write(why))
        else:
            def write(f):
                f.write(head)
                for t in tensors:
                    f.write(tensor_bytes(t))
            try:
                _write_atomic(self._path(tid, ".safetensors"), write)
            except OSError as e:   # e.g. a container's small /dev/shm: the fetch says so
                why = (f"its results could not be written to {self.folder}, which the API server processes "
                       f"share: {e}").encode()
                _write_atomic(self._path(tid, ".error"), lambda f: f.write(why))
            tensors.clear()
        stored.drop_tensors()
        if sweep:
            self._sweep()

    async def take(self, tid: str, wait_s: float) -> Reply | None:
        """As `MemoryResults.take`, whichever API server process served `tid`."""
        mine = await self._claimed(tid, wait_s, self._path(tid, f".taken-{os.getpid()}"))
        if mine is None:
            return None
        with open(mine, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        os.unlink(mine)   # the mapping keeps its pages until closed
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        return Reply(size, meta.get("error_type", ""), _stream_mapped(data))

    async def lend(self, tid: str, wait_s: float, where: Callable | None = None) -> dict | None:
        """As `MemoryResults.lend`, whichever API server process served `tid`: its safetensors file
        in the shared folder is the memory (`where` is not needed), claimed as `<tid>.lent`, so
        that whichever process gets the give-back removes it; the sweep drops it after `keep_s`."""
        path = await self._claimed(tid, wait_s, self._path(tid, ".lent"))
        if path is None:
            return None
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", {})
        tensors = {name: _described_contiguous(path, 8 + n + d["data_offsets"][0], d["dtype"], d["shape"])
                   for name, d in header.items()}
        return {"id": tid, **meta, "keep_s": self.keep_s, "tensors": tensors}

    def give_back(self, tid: str) -> bool:
        """As `MemoryResults.give_back`, whichever process lent it."""
        if not re.fullmatch(r"[0-9a-f]{32}", tid):
            return False
        try:
            os.unlink(self._path(tid, ".lent"))
        except FileNotFoundError:
            return False
        return True

    async def _claimed(self, tid: str, wait_s: float, mine: str) -> str | None:
        """The result file of `tid`, renamed to `mine` by this process alone (one claim wins),
        waiting up to `wait_s` for a request still running; None: unknown. RequestError: its
        result could not be written or sent (the error's file says why)."""
        if not re.fullmatch(r"[0-9a-f]{32}", tid):   # tapc ids are uuid4 hex: nothing else names a file here
            return None
        deadline = time.monotonic() + wait_s
        while True:
            if self._claim(tid, mine):
                return mine
            if not os.path.exists(self._path(tid, ".running")):
                # written between the claim and this look, or unknown
                return mine if self._claim(tid, mine) else None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            local = self._local.get(tid)
            if local is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(local.wait()), left)
                except asyncio.TimeoutError:
                    return None
            else:
                await asyncio.sleep(min(self.POLL_S, left))

    def _claim(self, tid: str, mine: str) -> bool:
        try:
            os.rename(self._path(tid, ".safetensors"), mine)
        except FileNotFoundError:
            try:
                os.rename(self._path(tid, ".error"), mine)
            except FileNotFoundError:
                return False
            with open(mine, "rb") as f:
                why = f.read().decode()
            os.unlink(mine)
            raise RequestError(why)
        return True

    def _drop_written(self) -> None:
        for tid in self._written:
            for suffix in (".safetensors", ".error", ".lent"):
                _remove(self._path(tid, suffix))

    def _sweep(self) -> None:
        """Drop results, errors and markers older than `keep_s` (a fetch that never came, a
        process that died mid-request); `put` asks for it at most once a second."""
        cutoff = time.time() - self.keep_s
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    old = entry.is_file() and entry.stat().st_mtime < cutoff
                except FileNotFoundError:   # claimed or swept by another process meanwhile
                    continue
                if old:
                    _remove(entry.path)

    def _path(self, tid: str, suffix: str) -> str:
        return os.path.join(self.folder, tid + suffix)


async def _stream_mapped(data: mmap.mmap):
    try:
        for at in range(0, len(data), CHUNK):
            yield data[at:at + CHUNK]
    finally:
        data.close()


def shared_folder(root: str | None = None) -> str:
    """The folder the API server processes of this `vllm serve` share: named for their parent
    (the process that started them, the same for all), under /dev/shm where there is one.
    Folders of servers that are gone are removed on the way."""
    if root is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(root):
        m = re.fullmatch(r"tapc-serve-(\d+)", name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    folder = os.path.join(root, f"tapc-serve-{os.getppid()}")
    os.makedirs(folder, exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's: alive
        return True
    return True


def _write_atomic(path: str, write: Callable) -> None:
    """Write through a temporary file renamed into place: a reader sees all of it or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
    except BaseException:
        _remove(tmp)
        raise
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _error_type(stored: Stored) -> str:
    return "" if stored.error is None else type(stored.error).__name__


def parts(stored: Stored) -> tuple[dict, dict]:
    """What a result sends: its tensors by name (each capture under its key, each saved tensor
    under `saved/<name>/<i>`) and its metadata: `error` (and `error_type`, its class), the
    saved values that are not tensors (JSON) and `unreached`, the listed positions the request
    stopped before (JSON). RequestError: a tensor safetensors has no dtype for."""
    import torch

    tensors = dict(stored.taps)
    other = {}
    for name, values in stored.saved.items():
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                tensors[f"saved/{name}/{i}"] = v.detach().cpu()
            else:
                other.setdefault(name, {})[str(i)] = v
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise RequestError(f"{name}: dtype {t.dtype} has no safetensors name")
    meta = {"error": "" if stored.error is None else str(stored.error), "error_type": _error_type(stored),
            "saved": json.dumps(other, default=repr), "unreached": json.dumps(list(stored.unreached))}
    return tensors, meta


def encode(stored: Stored) -> tuple[bytes, list]:
    """A request's results in the safetensors format (`parts`), as its header and the tensors
    whose bytes follow it in that order. The bytes go out as the tensors' own (`tensor_bytes`):
    a capture of every layer over a long prompt is gigabytes, which one `bytes` would hold
    twice and copy on the server's event loop."""
    tensors, meta = parts(stored)
    header, offset = {"__metadata__": meta}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the format's alignment of the data that follows
    return len(text).to_bytes(8, "little") + text, list(tensors.values())


def safetensors_bytes(stored: Stored) -> bytes:
    """A small result as one safetensors `bytes` (the inline form; large ones stream)."""
    head, tensors = encode(stored)
    return head + b"".join(tensor_bytes(t) for t in tensors)
