"""Datasets at URLs (``s3://``, ``gs://``, any fsspec URL) read in place, never copied whole.

- ``StreamedDataset`` opens a dataset at a URL as ``TokenDataset`` does a local one: the manifest (its fingerprint
  checked against the ``COMPLETE`` marker) and the ``.idx`` files are fetched once into the cache directory, under
  ``datasets/FINGERPRINT/NAME/`` as ``sync_dataset``'s copies are, and checked against the manifest's digests; each
  ``.bin`` is sized from the file system and checked against its index. Token bytes are read by range only:
  ``gather`` returns the ranges a micro-batch needs, side by side, through a ``BlockCache``.
- ``BlockCache`` keeps fixed-size blocks of the ``.bin`` files on local disk, never more than its capacity
  (``--cache-size``): blocks fetched ahead of use (``fetch_ahead``, the trainer's prefetcher) are kept until read,
  others are evicted least recently read first. Every block's byte count is checked against the size its
  stream's index implies.
- Reads retry transient errors (a refused or reset connection, a timeout, a 5xx) with exponential backoff for
  ``Retry.budget_s`` seconds, then raise ``StreamUnavailable``; permanent ones (a missing object, access denied)
  are one ``XprepError`` at once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from xprep.prep.dataset.indexed import implied_bin_size, parse_index
from xprep.prep.dataset.manifest import count
from xprep.prep.dataset.remote import read_complete_manifest, staged_copy
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.formats import CATEGORY_IDS_STREAM, LOSS_MASK_STREAM, MANIFEST, TOKENS_STREAM
from xprep.prep.fs import cache_root, filesystem, is_url
from xprep.prep.io import write_atomic

T = TypeVar("T")

BLOCK_SIZE = 1 << 20  # bytes of a cached block, at most
MIN_BLOCKS = 16  # a cache holds at least this many blocks: a smaller --cache-size gets smaller blocks
DEFAULT_CACHE_SIZE = 2 * 10**9  # --cache-size
DEFAULT_RETRY_S = 120.0  # --stream-timeout
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.2, 5.0
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM}
_NO_STREAM = np.zeros(0, np.uint8)


class StreamUnavailable(XprepError):
    """A URL stayed unreachable (transient errors only) for the whole retry budget."""


@dataclass
class Retry:
    """Transient errors retried with exponential backoff for ``budget_s`` seconds; permanent ones raised at once."""

    budget_s: float = DEFAULT_RETRY_S
    sleep: Callable[[float], None] = time.sleep

    def run(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried; ``what`` names the object in the one-line errors."""
        started, wait, tries = time.monotonic(), FIRST_BACKOFF_S, 0
        while True:
            try:
                return call()
            except Exception as e:  # classified below: permanent, transient, or a bug (raised as it is)
                if is_permanent(e):
                    raise XprepError(f"{what}: {_reason(e)}; check the URL and the credentials for it") from None
                if not is_transient(e):
                    raise
                tries += 1
                if time.monotonic() - started + wait > self.budget_s:
                    tried = f"{tries} tr{'y' if tries == 1 else 'ies'}"
                    raise StreamUnavailable(f"{what}: unreachable for {time.monotonic() - started:.0f} s ({tried}; "
                                            f"last: {type(e).__name__}: {e})") from None
                self.sleep(wait)
                wait = min(2 * wait, MAX_BACKOFF_S)


def is_permanent(e: BaseException) -> bool:
    """A missing object or a refused access: retrying changes nothing (s3fs and gcsfs raise these)."""
    return isinstance(e, (FileNotFoundError, PermissionError)) or (
        isinstance(e, OSError) and e.errno in _PERMANENT_ERRNOS)


def is_transient(e: BaseException) -> bool:
    """A refused or reset connection, a timeout, a server error: worth another try. File systems raise them as
    OSError (s3fs translates botocore's), or as their client library's own exceptions."""
    library = type(e).__module__.split(".")[0]
    return isinstance(e, (OSError, TimeoutError)) or library in ("botocore", "aiobotocore", "aiohttp", "urllib3",
                                                                  "requests", "google", "gcsfs", "s3fs")


def _reason(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == errno.ENOENT:
        return "no such object"
    return f"access denied ({e})"


# ------------------------------------------------------------------------------------------- the cache
class BlockCache:
    """Fixed-size blocks of files at URLs, on local disk under ``directory``, at most ``capacity`` bytes there.

    A block is the file's bytes ``[k·block_size, (k+1)·block_size)`` (the last one shorter). ``read`` returns
    blocks (from disk, else fetched now: a *demand* fetch, which the prefetcher is there to avoid); ``fetch_ahead``
    fetches blocks before they are needed and keeps them until ``read`` (so one prefetch never evicts another's);
    everything else is evicted least recently read first. Thread-safe: the prefetcher's thread and the training
    loop share one cache; the network is used outside the lock.
    """

    def __init__(self, directory: Path, capacity: int, retry: Retry | None = None, block_size: int | None = None):
        self.directory = Path(directory)
        self.capacity = capacity
        self.block_size = block_size or max(8, min(BLOCK_SIZE, capacity // MIN_BLOCKS) // 8 * 8)
        if self.block_size > capacity:
            raise XprepError(f"--cache-size {capacity}: too small to hold a block of {self.block_size} bytes")
        self.retry = retry or Retry()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: list[tuple[object, str, int]] = []  # (file system, path in it, size) by stream id
        self._have: OrderedDict[tuple[int, int], int] = OrderedDict()  # block → bytes, least recently read first
        self._ahead: set[tuple[int, int]] = set()  # fetched ahead, not read yet
        self._inflight: dict[tuple[int, int], threading.Event] = {}  # being fetched ahead, set when done
        self._lock = threading.Lock()
        self.used = 0  # bytes on disk
        self.fetched_bytes = 0  # bytes fetched over the network, ahead or on demand
        self.demand_blocks = 0  # blocks the reader had to fetch itself
        self.demand_s = 0.0  # seconds the reader spent fetching them

    def add_file(self, url: str, size: int) -> int:
        """Register the file at ``url`` (``size`` bytes, from its index); returns its stream id."""
        fs, inner = filesystem(url)
        self._files.append((fs, inner, size))
        return len(self._files) - 1

    def blocks_of(self, sid: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The sorted block numbers covering byte ranges ``[lo, hi)`` of stream ``sid`` (vectorized)."""
        keep = hi > lo
        first, last = lo[keep] // self.block_size, (hi[keep] - 1) // self.block_size + 1
        return np.unique(expand_ranges(first, last))

    def read(self, sid: int, blocks: np.ndarray) -> bytes:
        """The bytes of ``blocks`` (sorted) of stream ``sid``, back to back."""
        keys = [(sid, int(b)) for b in blocks]
        found = self._take(keys)
        missing = [k for k in keys if k not in found]
        if missing and self._wait_for([k for k in missing if k in self._inflight]):  # being fetched ahead: wait
            found.update(self._take(missing))
            missing = [k for k in keys if k not in found]
        if missing:
            started = time.monotonic()
            found.update(self._fetch(missing, ahead=False))
            self.demand_blocks += len(missing)
            self.demand_s += time.monotonic() - started
        return b"".join(found[k] for k in keys)

    def fetch_ahead(self, sid: int, blocks: np.ndarray, wait: bool = False) -> bool:
        """Fetch the blocks not on disk yet and keep them until read; False when the cache has no room for all
        (the reader must consume some first). ``wait``: also wait for those another thread is fetching (and fetch
        them here if it failed). Raises as ``read`` does on errors."""
        while True:
            with self._lock:
                for k in ((sid, int(b)) for b in blocks):
                    if k in self._have:  # here already: kept until read, like the ones fetched now
                        self._ahead.add(k)
                        self._have.move_to_end(k)
                wanted = [(sid, int(b)) for b in blocks if (sid, int(b)) not in self._have]
                theirs = [k for k in wanted if k in self._inflight]
                room = self.capacity - sum(self._have[k] for k in self._ahead)
                keys = [k for k in wanted if k not in self._inflight][:max(0, room // self.block_size)]
                for k in keys:
                    self._inflight[k] = threading.Event()
            try:
                stored = self._fetch(keys, ahead=True) if keys else {}
            finally:
                self._done(keys)
            if not (wait and theirs):
                return len(stored) + len(theirs) == len(wanted)
            self._wait_for(theirs)

    def _wait_for(self, keys: list[tuple[int, int]]) -> bool:
        """Wait until no block of ``keys`` is being fetched any more; whether there were any."""
        events = [e for e in (self._inflight.get(k) for k in keys) if e is not None]
        for e in events:
            e.wait()
        return bool(events)

    def _done(self, keys: list[tuple[int, int]]) -> None:
        with self._lock:
            for k in keys:
                self._inflight.pop(k).set()

    def _take(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        """The blocks of ``keys`` that are on disk, marked as read (most recently)."""
        out = {}
        with self._lock:
            for k in keys:
                if k in self._have:
                    out[k] = self._path(k).read_bytes()
                    self._have.move_to_end(k)
                    self._ahead.discard(k)
        return out

    def _fetch(self, keys: list[tuple[int, int]], ahead: bool) -> dict[tuple[int, int], bytes]:
        """Fetch ``keys`` (one request each, concurrently where the file system can), check their sizes, and
        store as many as there is room for; returns those fetched (``ahead``: only those stored)."""
        sid = keys[0][0]
        fs, inner, size = self._files[sid]
        starts = [k[1] * self.block_size for k in keys]
        ends = [min(s + self.block_size, size) for s in starts]
        data = self.retry.run(fs.unstrip_protocol(inner), lambda: _cat_ranges(fs, inner, starts, ends))
        out = {}
        for k, s, e, d in zip(keys, starts, ends, data, strict=True):
            if len(d) != e - s:
                raise XprepError(f"{fs.unstrip_protocol(inner)}: bytes {s}..{e} came back as {len(d)} bytes, not "
                                 f"{e - s}: the object is shorter than its index says (rewritten?); re-upload it")
            self.fetched_bytes += len(d)
            if self._store(k, d, ahead) or not ahead:
                out[k] = d
        return out

    def _store(self, key: tuple[int, int], data: bytes, ahead: bool) -> bool:
        """Write a block to disk (temp + rename), evicting blocks read least recently; never those fetched ahead
        and not read yet. False when there is no room."""
        with self._lock:
            if key in self._have:
                return True
            while self.used + len(data) > self.capacity:
                victim = next((k for k in self._have if k not in self._ahead), None)
                if victim is None:
                    return False
                self._path(victim).unlink()
                self.used -= self._have.pop(victim)
            write_atomic(self._path(key), data, durable=False)  # (a lost block is fetched again)
            self.used += len(data)
            self._have[key] = len(data)
            if ahead:
                self._ahead.add(key)
            return True

    def _path(self, key: tuple[int, int]) -> Path:
        return self.directory / f"{key[0]}-{key[1]}"

    def disk_bytes(self) -> int:
        """Bytes of the files under the cache directory now (what ``capacity`` bounds)."""
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file())

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _cat_ranges(fs, inner: str, starts: list[int], ends: list[int]) -> list[bytes]:
    """Byte ranges of one file (concurrent requests on async file systems); the first error raised."""
    data = fs.cat_ranges([inner] * len(starts), starts, ends, on_error="return")
    for d in data:
        if isinstance(d, BaseException):
            raise d
    return data


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(lo, hi)])``, vectorized."""
    n = (hi - lo).astype(np.int64)
    if not len(n):
        return np.zeros(0, np.int64)
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)


def open_block_cache(capacity: int = DEFAULT_CACHE_SIZE, retry_s: float = DEFAULT_RETRY_S,
                     cache_dir: str | None = None) -> BlockCache:
    """A fresh block cache of this process under CACHE/blocks/ (``prep.fs.cache_root``), removed by ``close``."""
    root = cache_root(cache_dir) / "blocks"
    root.mkdir(parents=True, exist_ok=True)
    _remove_orphans(root)
    return BlockCache(Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)), capacity, Retry(retry_s))


def _remove_orphans(root: Path) -> None:
    """Remove the block caches of processes that are gone (killed before their ``close``): PID-... directories."""
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


# ------------------------------------------------------------------------------------------ the dataset
class RemoteStream:
    """One ``.bin/.idx`` pair of a dataset at a URL: the index in memory, the ``.bin`` read by range."""

    def __init__(self, prefix: str, idx: bytes, bin_size: int, retry: Retry):
        self.url = f"{prefix}.bin"
        self.dtype, self.lengths, self.pointers, self.doc_index = parse_index(idx, f"{prefix}.idx")
        implied = implied_bin_size(self.dtype, self.lengths, self.pointers)
        if bin_size != implied:
            raise XprepError(f"{self.url}: {bin_size} bytes but its index describes {implied}; the object is "
                             "truncated or belongs to another index: re-upload the dataset")
        self.nbytes = implied
        self.retry = retry
        self._items: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def offsets(self) -> np.ndarray:
        """Item offset of each sequence plus the total: int64[n + 1]."""
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``, fetched now (one request; for readers of a few documents)."""
        lo = int(self.pointers[i])
        return np.frombuffer(self._fetch(lo, lo + int(self.lengths[i]) * self.dtype.itemsize), self.dtype)

    @property
    def items(self) -> np.ndarray:
        """The whole stream, fetched once, in memory: for readers that need all of it (``xprep pack``'s target
        counts read the loss mask, one byte a token; ``xprep inspect``); training reads by range instead."""
        if self._items is None:
            self._items = np.frombuffer(self._fetch(0, self.nbytes), self.dtype)
        return self._items

    def _fetch(self, lo: int, hi: int) -> bytes:
        if hi <= lo:
            return b""
        fs, inner = filesystem(self.url)
        data = self.retry.run(self.url, lambda: fs.cat_file(inner, start=lo, end=hi))
        if len(data) != hi - lo:
            raise XprepError(f"{self.url}: bytes {lo}..{hi} came back as {len(data)} bytes; re-upload it")
        return data


class StreamedDataset(TokenDataset):
    """A token dataset at a URL (module docstring): the manifest and indexes local, token bytes by range.

    Same surface as ``TokenDataset`` for what packing and training read (manifest, fingerprint, lengths,
    category names; ``tokens``/``loss_mask``/``category_ids`` are ``RemoteStream``s); ``gather`` reads the
    tokens of items through the ``BlockCache`` given to ``attach``. Pickles as its URL.
    """

    streamed = True

    def __init__(self, url: str, cache_dir: str | None = None, retry: Retry | None = None):
        self.path = url.rstrip("/")
        self.retry = retry or Retry()
        self.manifest = read_complete_manifest(self.path)
        local = _fetch_indexes(self.path, self.manifest, cache_dir, self.retry)
        fs, inner = filesystem(self.path)
        streams = {}
        for name in self.manifest["streams"]:
            size = self.retry.run(f"{self.path}/{name}.bin", lambda n=name: fs.info(f"{inner}/{n}.bin")["size"])
            streams[name] = RemoteStream(f"{self.path}/{name}", (local / f"{name}.idx").read_bytes(), size,
                                         self.retry)
        self.tokens = streams[TOKENS_STREAM]
        self.loss_mask = streams.get(LOSS_MASK_STREAM)
        self.category_ids = streams.get(CATEGORY_IDS_STREAM)
        self._check_counts()
        self.cache: BlockCache | None = None
        self._ids: list[int] = []

    def _check_counts(self) -> None:
        for stream in (self.loss_mask, self.category_ids):
            if stream is not None and not np.array_equal(stream.lengths, self.tokens.lengths):
                raise XprepError(f"{self.path}: stream {Path(stream.url).stem} disagrees with tokens (different "
                                 "document lengths); the dataset is corrupt: re-create it")
        counts, tokens = self.manifest["counts"], int(self.tokens.lengths.sum(dtype=np.int64))
        if len(self.tokens) != counts["documents"] or tokens != counts["tokens"]:
            raise XprepError(f"{self.path}: the tokens stream holds {count(len(self.tokens), 'document')} of "
                             f"{count(tokens, 'token')} in all, but the manifest says "
                             f"{count(counts['documents'], 'document')} of {count(counts['tokens'], 'token')}")

    def attach(self, cache: BlockCache) -> None:
        """Read the token streams through ``cache`` from now on."""
        self.cache = cache
        self._ids = [cache.add_file(s.url, s.nbytes) for s in self._streams()]

    def _streams(self) -> list[RemoteStream]:
        return [s for s in (self.tokens, self.loss_mask, self.category_ids) if s is not None]

    def blocks(self, flat: np.ndarray, lens: np.ndarray, ends: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(stream id, blocks) that ``gather`` of these items reads: what a prefetcher fetches ahead."""
        lo, hi = _item_ranges(flat, lens, ends)
        return [(sid, self.cache.blocks_of(sid, lo * s.dtype.itemsize, hi * s.dtype.itemsize))
                for sid, s in zip(self._ids, self._streams(), strict=True)]

    def gather(self, flat: np.ndarray, lens: np.ndarray, ends: np.ndarray):
        """The items whose tokens start at flat offsets ``flat`` (``lens`` long; ``ends``: their documents' flat
        ends when the pack looks ahead, else empty), side by side: (tokens, loss mask, categories, starts, ends) as
        ``xprep.train.data.fill_items_upto`` takes them, the two last in the side-by-side coordinates. An item that
        looks ahead brings its document's next token along."""
        lo, hi = _item_ranges(flat, lens, ends)
        starts = np.cumsum(hi - lo) - (hi - lo)
        out = []
        for sid, stream in zip(self._ids, self._streams(), strict=True):
            out.append(self._gather_one(sid, stream, lo, hi))
        tokens = out[0]
        mask = out[1] if self.loss_mask is not None else _NO_STREAM
        cats = out[-1] if self.category_ids is not None else _NO_STREAM
        return tokens, mask, cats, starts, (starts + (ends - flat) if len(ends) else ends)

    def _gather_one(self, sid: int, stream: RemoteStream, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        k = stream.dtype.itemsize
        blocks = self.cache.blocks_of(sid, lo * k, hi * k)
        buf = np.frombuffer(self.cache.read(sid, blocks), np.uint8)
        size = self.cache.block_size
        at = np.searchsorted(blocks, lo * k // size) * size + lo * k % size  # where each range starts in ``buf``
        return buf[expand_ranges(at, at + (hi - lo) * k)].view(stream.dtype)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def _item_ranges(flat: np.ndarray, lens: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat item ranges ``[lo, hi)`` the fill kernel reads: each item, plus its document's next token when the
    pack looks ahead (``ends`` not empty) and the item stops inside its document."""
    lo = np.asarray(flat, np.int64)
    hi = lo + np.asarray(lens, np.int64)
    if len(ends):
        hi = hi + (hi < ends)
    return lo, hi


def _fetch_indexes(url: str, manifest: dict, cache_dir: str | None, retry: Retry) -> Path:
    """The manifest and ``.idx`` files of the dataset at ``url``, fetched once into
    CACHE/datasets/FINGERPRINT/NAME.index/ (checked against the manifest's digests; renamed into place whole)."""
    root = cache_root(cache_dir) / "datasets" / manifest["fingerprint"]
    target = root / f"{url.rsplit('/', 1)[-1] or 'dataset'}.index"
    if (target / MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    fs, inner = filesystem(url)
    with staged_copy(target) as tmp:
        for name, info in manifest["streams"].items():
            data = retry.run(f"{url}/{name}.idx", lambda n=name: fs.cat_file(f"{inner}/{n}.idx"))
            if hashlib.sha256(data).hexdigest() != info.get("idx_sha256"):
                raise XprepError(f"{url}/{name}.idx: differs from its manifest digest (being rewritten?); try again")
            (tmp / f"{name}.idx").write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return target


def open_dataset(path: str | Path) -> TokenDataset:
    """A dataset by path or URL: a URL is a ``StreamedDataset``, read in place."""
    return StreamedDataset(str(path)) if is_url(str(path)) else TokenDataset(path)
