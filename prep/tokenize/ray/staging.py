"""The staging area of ``xprep tokenize --ray``: where shard datasets wait for the merge.

Layout of ``OUT.xprep-shards`` (a directory, or a URL beside an object-store output):
``shards/KEY/`` a finished shard dataset, ``shards/KEY.done`` its completion marker (written last),
``tmp/`` scratch of running tasks.

Shards on a filesystem are published without fsync: the merge reads them back at once (from the page cache),
and only the merged dataset is made durable, so the data is not forced onto the disk twice. What that risks
is a shard cut short by a machine crash; a shard left by an earlier run is therefore reused only after its
files match the digests and counts of its manifest (``reusable``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from xprep.prep.dataset import read_manifest, verify_streams
from xprep.prep.errors import XprepError
from xprep.prep.formats import REJECTS
from xprep.prep.fs import filesystem, is_url, join
from xprep.prep.io import remove_tree, write_json_atomic

STAGING_SUFFIX = ".xprep-shards"


@dataclass(frozen=True)
class ShardDone:
    """What a finished shard reports (and its marker holds): sizes for progress, lines for renumbering."""

    documents: int
    tokens: int
    bytes: int
    lines_read: tuple[int, ...]  # per piece, see xprep.prep.sources.discover.read_batches

    def to_json(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
                "lines_read": list(self.lines_read)}

    @classmethod
    def from_json(cls, d: dict) -> ShardDone:
        return cls(d["documents"], d["tokens"], d["bytes"], tuple(d["lines_read"]))


@dataclass(frozen=True)
class ShardOutcome:
    """A task's result: done, or the fatal bad record it stopped at (line counted from its piece's start)."""

    done: ShardDone | None = None
    bad: tuple[str, int, str] | None = None  # (path, line, reason)


class Staging:
    """The shards' staging area: a local directory (on storage every node sees) or a URL."""

    def __init__(self, root: str):
        self.remote = is_url(root)
        self.root = root if self.remote else os.path.abspath(root)

    @classmethod
    def beside(cls, output: str) -> Staging:
        """The staging area of the dataset ``output``: ``OUT.xprep-shards``."""
        return cls(output.rstrip("/") + STAGING_SUFFIX)

    def _path(self, *parts: str) -> str:
        return join(self.root, *parts) if self.remote else os.path.join(self.root, *parts)

    def shard_url(self, key: str) -> str:
        """Where the finished shard ``key`` lies (a URL, or a directory)."""
        return self._path("shards", key)

    def marker(self, key: str) -> str:
        return self._path("shards", f"{key}.done")

    def finished(self, key: str) -> ShardDone | None:
        """The marker of a finished shard, or None."""
        try:
            if self.remote:
                fs, inner = filesystem(self.marker(key))
                return ShardDone.from_json(json.loads(fs.cat_file(inner)))
            with open(self.marker(key)) as f:
                return ShardDone.from_json(json.load(f))
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def reusable(self, key: str, pieces: int) -> ShardDone | None:
        """The marker of a shard of ``pieces`` pieces an earlier run finished, if the shard is whole and its marker
        counts lines for each piece; anything else is removed."""
        done = self.finished(key)
        if done is None:
            return None
        if len(done.lines_read) == pieces and (self.remote or _intact(self._path("shards", key))):
            return done  # an object store's uploads are whole or absent: nothing to check there
        if self.remote:  # the marker first, as below
            fs, inner = filesystem(self.marker(key))
            fs.rm(inner)
            shard = filesystem(self._path("shards", key))[1]
            if fs.exists(shard):
                fs.rm(shard, recursive=True)
            return None
        with contextlib.suppress(FileNotFoundError):  # the marker first: no marker ever names a half-removed shard
            os.remove(self.marker(key))
        shutil.rmtree(self._path("shards", key), ignore_errors=True)
        return None

    def publish(self, local_dataset: str, key: str, done: ShardDone) -> None:
        """Move (or upload) a finished shard dataset into place, then write its marker: the marker comes last."""
        target = self._path("shards", key)
        if self.remote:
            fs, inner = filesystem(target)
            for name in sorted(os.listdir(local_dataset)):
                fs.put_file(os.path.join(local_dataset, name), f"{inner}/{name}")
            fs.pipe_file(filesystem(self.marker(key))[1], json.dumps(done.to_json()).encode())
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(local_dataset, target)
        except OSError:  # the target is there: another attempt's
            if self.finished(key) is not None:  # published, and maybe being merged: it stands, this copy goes
                shutil.rmtree(local_dataset, ignore_errors=True)
                return
            remove_tree(target)  # an attempt that died between its rename and its marker
            os.replace(local_dataset, target)
        write_json_atomic(self.marker(key), done.to_json(), durable=False)

    def fetch(self, key: str, into: str) -> str:
        """A local directory holding the shard's dataset (downloaded into ``into`` for a URL)."""
        if not self.remote:
            return self._path("shards", key)
        fs, inner = filesystem(self._path("shards", key))
        os.makedirs(into, exist_ok=True)
        for entry in fs.ls(inner, detail=False):
            fs.get_file(entry, os.path.join(into, entry.rstrip("/").rsplit("/", 1)[-1]))
        return into

    def scratch(self) -> str:
        """Where a task builds its shard before publishing: beside the shards (a rename away), or local."""
        if self.remote:
            return tempfile.mkdtemp(prefix=".xprep-shard-")
        directory = self._path("tmp")
        os.makedirs(directory, exist_ok=True)
        return tempfile.mkdtemp(prefix="shard-", dir=directory)

    def prune(self, keep: set[str]) -> None:
        """Drop what earlier runs left that this one cannot use: shards of other inputs or options, scratch."""
        if self.remote:
            fs, inner = filesystem(self._path("shards"))
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(inner, detail=False)] if fs.exists(inner) else []
            for name in names:
                if name.removesuffix(".done") not in keep:
                    fs.rm(f"{inner}/{name}", recursive=True)
            return
        shards = self._path("shards")
        for name in os.listdir(shards) if os.path.isdir(shards) else []:
            if name.removesuffix(".done") not in keep:
                path = os.path.join(shards, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        shutil.rmtree(self._path("tmp"), ignore_errors=True)

    def remove(self) -> None:
        if self.remote:
            fs, inner = filesystem(self.root)
            if fs.exists(inner):
                fs.rm(inner, recursive=True)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def _intact(dataset: str) -> bool:
    """Whether a shard dataset's streams have the sha256 its manifest records and its rejects file the records
    it counts (what a machine crash before the kernel wrote the files back would break)."""
    try:
        manifest = read_manifest(dataset)
        for part in ("idx", "bin"):  # the small files first
            verify_streams(dataset, manifest, part)
        rejects = manifest["rejects"]["count"]
        if rejects:
            with open(os.path.join(dataset, REJECTS), encoding="utf-8") as f:
                if sum(1 for line in f if json.loads(line)) != rejects:
                    return False
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError, XprepError):
        return False
