"""Datasets at URLs (``s3://``, ``gs://``; the file systems are ``prep/fs.py``'s):

- a dataset is written to a URL from a finished local directory (``upload_dataset``), its files first and
  the completion marker ``COMPLETE`` last (``mark_complete``), so a reader that finds the marker finds the whole
  dataset; a sharded dataset goes shard by shard, each an ordinary dataset at a URL relative to its manifest;
- ``read_complete_manifest`` reads a manifest once the marker vouches for it, through the caller's ``Retry``
  (stream.py; ``Retrier`` here): a refused access is one line naming the object, a dropped connection is retried;
- ``sync_dataset`` brings a dataset at a URL into a local cache directory keyed by its fingerprint (files
  checked against the manifest's sizes), for commands that memory-map it: ``datasets/`` of the cache directory
  (``prep.fs.cache_root``: ``--cache-dir``, else ``$XPREP_CACHE_DIR``, ...);
- ``read_item_ranges`` reads scattered items of a stream at a URL by range, in bounded batches;
- ``FetchProcess`` makes ``cat_ranges`` calls in a process of its own, for a thread that fetches while another
  computes (the trainer's prefetcher).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import posixpath
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
from xprep.prep.dataset.manifest import is_sharded, stream_mismatch
from xprep.prep.errors import XprepError
from xprep.prep.formats import MANIFEST
from xprep.prep.fs import cache_root, filesystem

T = TypeVar("T")
RANGE_BATCH = 8 << 20  # bytes a batch of ``read_item_ranges`` (about)
COMPLETE = "COMPLETE"  # written last into a dataset at a URL: its content is the manifest's fingerprint
# What named the sync cache before $XPREP_CACHE_DIR named every cache: still read, after it, so that a machine set up
# with it keeps finding its copies
OLD_SYNC_CACHE_ENV = "XPREP_CACHE"


def check_output_url(url: str, option: str = "-o") -> None:
    """The URL must not hold a dataset already (nothing is overwritten in place)."""
    fs, inner = filesystem(url)
    try:
        taken = fs.exists(f"{inner.rstrip('/')}/{MANIFEST}") or fs.exists(f"{inner.rstrip('/')}/{COMPLETE}")
    except OSError as e:
        raise XprepError(f"{option} {url}: cannot reach it ({e})") from None
    if taken:
        raise XprepError(f"{option} {url}: already holds a dataset; remove it or choose another {option}")


def upload_dataset(local: str | Path, url: str) -> None:
    """Copy a finished dataset directory to ``url``: data files, then the manifest, then the ``COMPLETE`` marker.

    A sharded dataset (prep/dataset/sharded.py) goes shard by shard, each an ordinary dataset at its URL relative to
    the manifest (one named outside its directory, ``../x``, goes to ``shard-NNNNN``), and its own manifest and
    marker last, so that a reader never meets a sharded manifest naming a shard that is not whole."""
    local = Path(local)
    text = (local / MANIFEST).read_bytes()
    manifest = json.loads(text)
    if is_sharded(manifest):
        manifest = _upload_shards(local, manifest, url)
        text = json.dumps(manifest, indent=1).encode()
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    names = sorted(p.name for p in local.iterdir() if p.is_file() and p.name != MANIFEST)
    try:
        for name in names:
            fs.put_file(str(local / name), f"{inner}/{name}")
        fs.pipe_file(f"{inner}/{MANIFEST}", text)
        mark_complete(url, manifest["fingerprint"])
    except OSError as e:  # s3fs, gcsfs: a refused or dropped request is an OSError
        raise XprepError(f"-o {url}: the upload failed ({type(e).__name__}: {e}); no {COMPLETE} marker was "
                         "written, so no reader takes it for a dataset: run the command again") from None


def mark_complete(url: str, fingerprint: str) -> None:
    """Write the ``COMPLETE`` marker of the dataset at ``url`` (its manifest's ``fingerprint``): the last thing written
    there, after which readers take it for a dataset."""
    fs, inner = filesystem(url)
    fs.pipe_file(f"{inner.rstrip('/')}/{COMPLETE}", fingerprint.encode())


def _upload_shards(local: Path, manifest: dict, url: str) -> dict:
    """Upload the shards of the sharded dataset at ``local``; its manifest with the shards' names at ``url``."""
    shards = []
    for k, shard in enumerate(manifest["shards"]):
        name = shard["path"] if not shard["path"].startswith("..") else f"shard-{k:05d}"
        upload_dataset(local / shard["path"], f"{url.rstrip('/')}/{Path(name).as_posix()}")
        shards.append({**shard, "path": Path(name).as_posix()})
    return {**manifest, "shards": shards}


class Retrier(Protocol):
    """What reads at URLs go through: ``Retry`` (stream.py, which imports this module), or ``ONCE``."""

    def run(self, what: str, call: Callable[[], T]) -> T: ...


class _Once:
    """One try, for callers without a ``Retry``: a refused access is still one line naming the object, in
    ``Retry``'s words; anything else is raised as it is."""

    def run(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except PermissionError as e:
            raise XprepError(f"{what}: access denied ({e}); check the URL and the credentials for it") from None


ONCE = _Once()


def read_complete_manifest(url: str, retry: Retrier = ONCE) -> dict:
    """The manifest of the dataset at ``url``, once its ``COMPLETE`` marker says it is whole. Read through ``retry``
    (a ``Retry``: transient errors retried): a refused access is one line naming the object."""
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    marker = retry.run(f"{url}/{COMPLETE}", lambda: _cat_if_there(fs, f"{inner}/{COMPLETE}"))
    if marker is None:
        raise XprepError(f"{url}: no complete dataset there (no {COMPLETE} marker: not written by xprep, or its "
                         "upload has not finished)")
    text = retry.run(f"{url}/{MANIFEST}", lambda: _cat_if_there(fs, f"{inner}/{MANIFEST}"))
    try:
        manifest = json.loads(text) if text is not None else None
    except ValueError as e:
        raise XprepError(f"{url}/{MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict):
        raise XprepError(f"{url}/{MANIFEST}: missing or not a JSON object; re-upload the dataset")
    if manifest.get("fingerprint") != marker.decode().strip():
        raise XprepError(f"{url}: its {MANIFEST} does not match its {COMPLETE} marker (being rewritten?); try again")
    return manifest


def _cat_if_there(fs, path: str) -> bytes | None:
    """The bytes of ``path``, None when there is no such object (other errors raised, for ``Retry`` to sort)."""
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def sync_dataset(url: str, cache_dir: str | None = None, retry: Retrier = ONCE) -> Path:
    """A local copy of the dataset at ``url`` under CACHE/datasets/FINGERPRINT/NAME, made once and reused: CACHE is
    ``cache_dir`` (``--cache-dir``), else ``$XPREP_CACHE_DIR``, else ``$XPREP_CACHE``, else ``~/.cache/xprep``.

    Files are downloaded into a temporary sibling and renamed into place, so a copy that exists is whole. A sharded
    dataset's shards are synced each as a dataset of its own, and the copy's manifest names them where they lie.
    Reads go through ``retry`` (a ``Retry``: transient errors retried); a refused access is one line.
    """
    manifest = read_complete_manifest(url, retry)
    # DIR/datasets/FINGERPRINT/NAME: one copy per content; the URL's last part stays the dataset's name (blends
    # name their sources by it)
    root = cache_root(cache_dir, fallback=os.environ.get(OLD_SYNC_CACHE_ENV)) / "datasets"
    root = root / manifest["fingerprint"]
    target = root / (url.rstrip("/").rsplit("/", 1)[-1] or "dataset")
    if (target / MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    _origin_file(target).write_text(url + "\n")  # read by synced_from: a pack records where its inputs came from
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    with staged_copy(target) as tmp:
        for entry in retry.run(url, lambda: fs.ls(inner, detail=True)):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "file" and name not in (COMPLETE, MANIFEST):
                retry.run(f"{url}/{name}", lambda n=name: fs.get_file(f"{inner}/{n}", str(tmp / n)))
        if is_sharded(manifest):
            manifest = {**manifest, "shards": [_sync_shard(url, k, s, cache_dir, target, retry)
                                               for k, s in enumerate(manifest["shards"])]}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        else:
            retry.run(f"{url}/{MANIFEST}", lambda: fs.get_file(f"{inner}/{MANIFEST}", str(tmp / MANIFEST)))
            _check_digests(tmp, manifest, url)
    return target


def _sync_shard(url: str, k: int, shard: dict, cache_dir: str | None, target: Path, retry: Retrier) -> dict:
    """Shard ``k`` of the sharded dataset at ``url`` synced (a dataset of its own), listed relative to ``target``."""
    local = sync_dataset(shard_url(url, shard["path"]), cache_dir, retry)
    found = json.loads((local / MANIFEST).read_text())["fingerprint"]
    if found != shard["fingerprint"]:
        raise XprepError(f"{url}: its shard #{k} {shard_url(url, shard['path'])} changed since the sharded manifest "
                         f"was written (fingerprint {found[:16]} != {shard['fingerprint'][:16]}); re-create the "
                         "sharded dataset from its shards")
    return {**shard, "path": os.path.relpath(local, target)}


def shard_url(url: str, name: str) -> str:
    """The URL of the shard a sharded dataset at ``url`` names ``name`` (relative, ``..`` allowed)."""
    scheme, _, rest = url.rstrip("/").partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, name))}"


@contextlib.contextmanager
def staged_copy(target: Path, markers: tuple[str, ...] = (MANIFEST,)) -> Iterator[Path]:
    """A temporary sibling of ``target`` to fill, renamed into place as ``target`` when the block ends (so a copy
    that exists is whole); when another process put a whole copy there first (one holding any of ``markers``),
    that one stays. Removed on error."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:  # another process made it first
            if not any((target / m).is_file() for m in markers):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_item_ranges(url: str, dtype: np.dtype, lo: np.ndarray, hi: np.ndarray, retry: Retrier = ONCE,
                     batch_bytes: int = RANGE_BATCH) -> Iterator[np.ndarray]:
    """Items ``[lo[k], hi[k])`` of the ``.bin`` file at ``url`` (items of ``dtype``), fetched by range and yielded in
    order, in batches of about ``batch_bytes`` (at most twice that; a longer range is cut): for readers that need
    scattered parts of a stream in bounded memory (``xprep inspect``'s categories of the tokens a pack removed),
    never the whole stream."""
    size = np.dtype(dtype).itemsize
    step = max(1, batch_bytes // size)  # items a batch
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    pieces = -(-(hi - lo) // step)  # each range cut into pieces of at most ``step`` items
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = np.repeat(lo, pieces) + (np.arange(int(pieces.sum()), dtype=np.int64) - first) * step
    ends = np.minimum(starts + step, np.repeat(hi, pieces))
    batch = (np.cumsum(ends - starts) - (ends - starts)) // step  # a batch starts every ``step`` items
    cuts = np.flatnonzero(np.diff(batch)) + 1
    fs, inner = filesystem(url)
    for s, e in zip(np.split(starts * size, cuts), np.split(ends * size, cuts), strict=True):
        if not len(s):
            continue
        data = retry.run(url, lambda s=s, e=e: cat_ranges(fs, [inner] * len(s), s.tolist(), e.tolist()))
        if sum(map(len, data)) != int((e - s).sum()):
            raise XprepError(f"{url}: a range came back short: the object is shorter than its index says "
                             "(rewritten?); re-upload the dataset")
        yield np.frombuffer(b"".join(data), dtype)


def cat_ranges(fs, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
    """Byte ranges of files of ``fs`` (concurrent requests on async file systems); the first error raised."""
    data = fs.cat_ranges(paths, starts, ends, on_error="return")
    for d in data:
        if isinstance(d, BaseException):
            raise d
    return data


def synced_from(path: str | Path) -> str | None:
    """The URL a dataset at ``path`` was synced from by ``sync_dataset``, if it is such a copy."""
    try:
        return _origin_file(Path(path)).read_text().strip() or None
    except OSError:
        return None


def _origin_file(target: Path) -> Path:
    return target.with_name(f".{target.name}.origin")


def _check_digests(directory: Path, manifest: dict, url: str) -> None:
    """Every stream the manifest lists arrived whole: its .bin and .idx digests are the manifest's."""
    streams = manifest.get("streams", {})
    for part in ("bin", "idx"):
        files = [directory / f"{name}.{part}" for name in streams]
        wrong = next((f for f in files if not f.is_file()), None) or stream_mismatch(directory, manifest, part,
                                                                                      "run again", list(streams))
        if wrong is not None:
            raise XprepError(f"{url}: {wrong.name} is missing or differs from its manifest digest after download; "
                             "run again")


class FetchProcess:
    """``cat_ranges`` of object stores made by a Python process of its own (``serve_fetches``), started at the first
    call, for a thread that fetches while another computes (the trainer's prefetcher).

    A request through fsspec's object stores costs the client a few ms of CPU (s3fs: botocore builds, signs and
    parses it), nearly all of it holding the GIL; made in the trainer's process, that is time the training loop
    waits for the GIL between its kernels. Here the caller pickles the file system (fsspec file systems pickle as
    their class and options: the child makes an equal one) and the ranges, and waits on a pipe, GIL released.
    File systems of this process only (``async_impl`` false: local, ``memory://``), and those whose options do not
    pickle, are read here, as ``cat_ranges`` does. Errors come back as raised (one that does not pickle, as an
    ``OSError`` naming it: ``Retry`` counts it transient); a child that died is a ``ConnectionError``, and the next
    call starts another. One call at a time."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def cat_ranges(self, fs, paths: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        try:
            call = pickle.dumps((fs, paths, starts, ends)) if getattr(fs, "async_impl", False) else None
        except Exception:  # (options that do not pickle: a session object given to the file system)
            call = None
        if call is None:
            return cat_ranges(fs, paths, starts, ends)
        with self._lock:
            try:
                proc = self._started()
                proc.stdin.write(call)
                proc.stdin.flush()
                ok, value = pickle.load(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as e:  # the child died (killed, out of memory)
                self._stop()
                raise ConnectionError(f"the process fetching for this one ended ({type(e).__name__}: {e})") from None
        if not ok:
            raise value
        return value

    def start(self) -> None:
        """Start the child now (its imports take a second or two), rather than at the first call."""
        with self._lock:
            self._started()

    def _started(self) -> subprocess.Popen:
        if self._proc is None:
            code = "from xprep.prep.dataset.remote import serve_fetches; serve_fetches()"
            self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def serve_fetches() -> None:
    """``FetchProcess``'s child: (file system, paths, starts, ends) in on stdin, (True, the bytes) or (False, the
    error) out on stdout, until stdin closes (the caller closed it, or died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (^C is the trainer's to handle: it closes this process)
    calls = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")  # the replies' own descriptor; then nothing written to descriptor 1, by
    os.dup2(2, 1)  # Python or a C library, lands among them: it goes to stderr
    sys.stdout = sys.stderr
    while True:
        try:
            fs, paths, starts, ends = pickle.load(calls)
        except Exception:  # (EOF: the caller closed or died)
            return
        try:
            reply = (True, cat_ranges(fs, paths, starts, ends))
        except Exception as e:  # the caller's to classify (``Retry``)
            reply = (False, e)
        try:
            data = pickle.dumps(reply)
            if not reply[0]:
                pickle.loads(data)
        except Exception:  # an error that does not pickle, or not back
            data = pickle.dumps((False, OSError(f"{type(reply[1]).__name__}: {reply[1]}")))
        replies.write(data)
        replies.flush()
