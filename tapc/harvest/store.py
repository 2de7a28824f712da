"""Where a harvest in parts goes: a local or shared folder, or object storage through fsspec
(`s3://bucket/acts`, `gs://...`, with `storage_options`), or a pyarrow or fsspec filesystem
given as such.

    store = Store("s3://bucket/acts", {"endpoint_url": ...})
    folder = store.folder("part-000003")     # a local folder to harvest the part in
    store.put(folder, "part-000003")         # object storage: the part's files, its manifest last

Shards are written through to local files (`pwritev` at each column's offset,
tapc/harvest/shardfiles.py), which object storage cannot take. So a part bound for object
storage is harvested in a staging folder on the actor's machine (`TAPC_STAGING_DIR`), the same
one each time for that store and part, so that a part cut short goes on from its last shard
there; whole, it is put into the store, its manifest last: a part whose manifest is in the
store is whole. A local or shared folder takes the part in place.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from tapc import settings
from tapc.errors import TapcError
from tapc.harvest.run import MANIFEST


class Store:
    def __init__(self, where: str | os.PathLike, storage_options: dict | None = None, filesystem=None):
        self.url = os.fspath(where)
        if filesystem is None and "://" not in self.url:
            self.fs, self.root, self.local = None, self.url, Path(self.url)
        else:
            self.fs, self.root = _filesystem(self.url, storage_options, filesystem)
            self.local = None

    def folder(self, name: str) -> Path:
        """The local folder part `name` is harvested in: its place in a local store, else the
        staging folder of this store on this machine."""
        if self.local is not None:
            return self.local / name
        return settings.TAPC_STAGING_DIR / hashlib.sha256(self.url.encode()).hexdigest()[:16] / name

    def read_text(self, name: str) -> str | None:
        """The text of file `name` (a path under the store), or None where there is none."""
        if self.local is not None:
            path = self.local / name
            return path.read_text() if path.is_file() else None
        try:
            return self.fs.cat_file(self._path(name)).decode()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        """File `name`, whole or not at all (a local file is renamed into place; an object is
        one upload)."""
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
            tmp = self.local / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.local / name)
        else:
            self.fs.pipe_file(self._path(name), text.encode())

    def manifests(self) -> dict[str, str]:
        """The manifests of the parts in the store, by part name (`part-*`)."""
        if self.local is not None:
            return {p.parent.name: p.read_text() for p in sorted(self.local.glob(f"part-*/{MANIFEST}"))}
        self.fs.invalidate_cache()   # parts other processes wrote since the last look
        return {p.rstrip("/").split("/")[-2]: self.fs.cat_file(p).decode()
                for p in sorted(self.fs.glob(self._path(f"part-*/{MANIFEST}")))}

    def put(self, folder: Path, name: str) -> None:
        """Object storage: the files of the harvested part in `folder`, its manifest last, as
        `name/...`; then the staging folder goes. A local store holds the part already."""
        if self.local is not None:
            return
        files = sorted((p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and
                        not p.name.endswith((".partial", ".tmp"))), key=str)
        for path in [*files, folder / MANIFEST]:
            self.fs.put_file(str(path), self._path(f"{name}/{path.relative_to(folder).as_posix()}"))
        shutil.rmtree(folder)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"


def _filesystem(url: str, options: dict | None, filesystem):
    """(fsspec filesystem, root path) of `url`, or of `filesystem` (fsspec's or pyarrow's)."""
    try:
        import fsspec
    except ImportError:
        raise TapcError(f"{url}: a harvest to object storage needs fsspec (and s3fs for s3://): "
                        "pip install 'tapc[ray]'") from None
    if filesystem is None:
        try:
            return fsspec.core.url_to_fs(url, **(options or {}))
        except (ImportError, ValueError) as e:   # fsspec names the package a protocol needs, or the protocol it lacks
            raise TapcError(f"{url}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if not isinstance(filesystem, fsspec.AbstractFileSystem):
        import pyarrow.fs

        from fsspec.implementations.arrow import ArrowFSWrapper

        if not isinstance(filesystem, pyarrow.fs.FileSystem):
            raise TapcError(f"filesystem: an fsspec or pyarrow filesystem, not {type(filesystem).__name__}")
        filesystem = ArrowFSWrapper(filesystem)
    return filesystem, filesystem._strip_protocol(url)
