"""Datasets at URLs (``s3://``, ``gs://``, any fsspec URL) read in place, never copied whole.

- ``StreamedDataset`` opens a dataset at a URL as ``TokenDataset`` does a local one: the manifest (its fingerprint
  checked against the ``COMPLETE`` marker) and the ``.idx`` files are fetched once into the cache directory, under
  ``datasets/FINGERPRINT/NAME/`` as ``sync_dataset``'s copies are, and checked against the manifest's digests; each
  ``.bin`` is sized from the file system and checked against its index. Token bytes are read by range only:
  ``gather`` returns the ranges a micro-batch needs, side by side, through a ``BlockCache``; ``verify`` re-hashes
  the ``.bin`` files against the manifest by reading each once (``--verify-data``).
- ``BlockCache`` keeps byte ranges of the ``.bin`` files on local disk, never more than its capacity
  (``--cache-size``): the exact ranges the next steps read (``fetch_ahead``, the trainer's prefetcher; neighbours a
  small gap apart fetched as one, ``coalesce_ranges``) are kept until their step has run, others are
  evicted least recently read first. Every fetched range's byte count is checked against the size its stream's
  index implies.
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
from xprep.prep.dataset.remote import FetchProcess, cat_ranges, read_complete_manifest, staged_copy
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.formats import CATEGORY_IDS_STREAM, LOSS_MASK_STREAM, MANIFEST, TOKENS_STREAM
from xprep.prep.fs import cache_root, filesystem, is_url
from xprep.prep.io import write_atomic

T = TypeVar("T")
StepRanges = list[tuple[int, np.ndarray, np.ndarray]]  # (stream id, sorted disjoint byte ranges) a step reads

MAX_IDLE_PIECES = 4096  # pieces no planned step needs, kept for a re-read (a validation pass, the next epoch)
VERIFY_CHUNK = 16 << 20  # bytes of one request while ``--verify-data`` re-hashes a ``.bin``
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


# ------------------------------------------------------------------------------------------- byte ranges
# Byte ranges ``[lo, hi)`` of one file as pairs of int64 arrays, vectorized (each function with a slow obvious
# reference in tests/prep/dataset/test_ranges.py). Sorted disjoint ranges are the normal form: ``merge_ranges`` makes
# it; ``coalesce_ranges`` bridges small gaps so that neighbouring reads become one request; ``subtract_ranges``
# leaves what the cache does not hold yet.

# A gap of at most COALESCE_GAP bytes between two ranges a step reads is fetched along with them, as long as the
# bridged gaps add at most COALESCE_SHARE of the step's bytes. A request to object storage costs ~10-30 ms before its
# first byte, the time ~1 MB takes to arrive at 50-100 MB/s; a 64 KiB gap costs < 1 ms of transfer, so bridging it
# never makes a fetch slower. The share keeps the bytes fetched within 1.1× the bytes read (the goal:
# ≤ 1.2×) where ranges are small and far apart (a random sampler over short documents), where any fixed gap
# would dominate: there, a step costs one concurrent request per range.
COALESCE_GAP = 64 << 10
COALESCE_SHARE = 0.1


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(lo, hi)])``, vectorized."""
    n = (hi - lo).astype(np.int64)
    if not len(n):
        return np.zeros(0, np.int64)
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)


def merge_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of any ranges as sorted disjoint ones: overlapping or touching ranges merged, empty ones dropped."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    keep = hi > lo
    order = np.argsort(lo[keep], kind="stable")
    lo, hi = lo[keep][order], hi[keep][order]
    if not len(lo):
        return lo, hi
    reach = np.maximum.accumulate(hi)  # the furthest end so far: a range starting past it starts a new one
    first = np.flatnonzero(np.concatenate([[True], lo[1:] > reach[:-1]]))
    return lo[first], reach[np.append(first[1:] - 1, len(lo) - 1)]


def coalesce_ranges(lo: np.ndarray, hi: np.ndarray, gap: int = COALESCE_GAP,
                    share: float = COALESCE_SHARE) -> tuple[np.ndarray, np.ndarray]:
    """The ranges to fetch for reading ranges ``lo, hi``: merged, then the gaps between neighbours bridged, smallest
    first, while a gap is at most ``gap`` bytes and the bridged ones add at most ``share`` of the bytes read."""
    lo, hi = merge_ranges(lo, hi)
    if len(lo) < 2:
        return lo, hi
    gaps = lo[1:] - hi[:-1]
    order = np.argsort(gaps, kind="stable")
    budget = share * float((hi - lo).sum())
    bridged = np.zeros(len(gaps), np.bool_)
    bridged[order[(gaps[order] <= gap) & (np.cumsum(gaps[order]) <= budget)]] = True
    first = np.flatnonzero(np.concatenate([[True], ~bridged]))
    return lo[first], hi[np.append(first[1:] - 1, len(lo) - 1)]


def subtract_ranges(lo: np.ndarray, hi: np.ndarray, cut_lo: np.ndarray, cut_hi: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The parts of sorted disjoint ranges ``lo, hi`` outside sorted disjoint ranges ``cut_lo, cut_hi``, sorted and
    disjoint (touching parts merged)."""
    if not len(lo) or not len(cut_lo):
        return lo, hi
    edges = np.unique(np.concatenate([lo, hi, cut_lo, cut_hi]))
    a, b = edges[:-1], edges[1:]  # elementary ranges: each wholly inside or outside every range given
    keep = inside(a, lo, hi) & ~inside(a, cut_lo, cut_hi)
    a, b = a[keep], b[keep]
    if not len(a):
        return a, b
    first = np.flatnonzero(np.concatenate([[True], a[1:] != b[:-1]]))
    return a[first], b[np.append(first[1:] - 1, len(a) - 1)]


def inside(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each position of ``x`` lies in one of the sorted disjoint ranges ``lo, hi``."""
    return containing(x, lo, hi) >= 0


def containing(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The index of the sorted disjoint range of ``lo, hi`` holding each position of ``x``; -1 where none does."""
    if not len(lo):
        return np.full(len(x), -1, np.int64)
    k = np.searchsorted(lo, x, "right") - 1
    return np.where((k >= 0) & (x < hi[np.maximum(k, 0)]), k, -1)


def runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions ``x`` (any order, repeats allowed) as sorted disjoint ranges of consecutive positions."""
    x = np.unique(x)
    if not len(x):
        return x, x
    first = np.flatnonzero(np.concatenate([[True], np.diff(x) != 1]))
    return x[first], x[np.append(first[1:] - 1, len(x) - 1)] + 1


# ------------------------------------------------------------------------------------------- the cache
@dataclass(slots=True)
class _Piece:
    """Bytes ``[lo, hi)`` of one file: on disk, or being fetched (``fetching`` is set when that ends)."""

    lo: int
    hi: int
    fetching: threading.Event | None = None
    until: int | None = None  # kept (pinned) until the step that starts at this sample has run; None: evictable

    @property
    def size(self) -> int:
        return self.hi - self.lo


class _Pieces:
    """The disjoint pieces of one file the cache holds or is fetching, by start, and their starts and ends as sorted
    arrays for vectorized look-ups, kept in step one insertion or deletion at a time (no Python loop over the
    pieces: a cache holds thousands)."""

    def __init__(self):
        self.by_lo: dict[int, _Piece] = {}
        self._lo = np.zeros(0, np.int64)
        self._hi = np.zeros(0, np.int64)

    def add(self, p: _Piece) -> None:
        assert p.lo not in self.by_lo, "pieces of a file are disjoint"
        self.by_lo[p.lo] = p
        i = int(np.searchsorted(self._lo, p.lo))
        self._lo, self._hi = np.insert(self._lo, i, p.lo), np.insert(self._hi, i, p.hi)

    def remove(self, p: _Piece) -> None:
        if self.by_lo.get(p.lo) is p:
            del self.by_lo[p.lo]
            i = int(np.searchsorted(self._lo, p.lo))
            self._lo, self._hi = np.delete(self._lo, i), np.delete(self._hi, i)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self._lo, self._hi

    def at(self, i: int) -> _Piece:
        return self.by_lo[int(self._lo[i])]


class BlockCache:
    """Byte ranges of files at URLs, on local disk under ``directory``, at most ``capacity`` bytes there.

    The cache holds *pieces*: disjoint byte ranges of each file, one file on disk each, fetched in one request each.
    ``fetch_ahead`` fetches the ranges planned steps read (``StreamedDataset.ranges``: coalesced), a batch of steps
    in one set of concurrent requests, and pins every piece each step touches until it has run (``release``), so
    one prefetch never evicts another's; it fetches nothing of a step whose pieces would no longer fit. ``read``
    returns any ranges, from disk, waiting for pieces being fetched, and fetching what no piece holds itself (a
    *demand* fetch, which the prefetcher is there to avoid; kept if there is room). Pieces no step pins are evicted
    least recently read first, and beyond ``MAX_IDLE_PIECES`` of them. Every fetched range's byte count is checked
    against the size its stream's index implies. Thread-safe: the prefetcher's thread and the training loop share
    one cache; the network is used outside the lock.
    """

    def __init__(self, directory: Path, capacity: int, retry: Retry | None = None):
        if capacity < 1:
            raise XprepError(f"--cache-size {capacity}: must be at least 1 byte")
        self.directory = Path(directory)
        self.capacity = capacity
        self.retry = retry or Retry()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: list[tuple[object, str, int]] = []  # (file system, path in it, size) by stream id
        self._pieces: list[_Pieces] = []  # by stream id
        self._idle: OrderedDict[tuple[int, int], _Piece] = OrderedDict()  # on disk, unpinned; least recent first
        self._pins: dict[int, list[tuple[int, int]]] = {}  # step → the pieces pinned until it (some moved on since)
        self._fetching: dict[tuple[int, int], _Piece] = {}
        self._lock = threading.Lock()
        self.used = 0  # bytes on disk
        self.pinned = 0  # bytes of the pieces pinned, on disk or being fetched: never above capacity
        self.fetched_bytes = 0  # bytes fetched over the network, ahead or on demand
        self.requests = 0  # ranges fetched (one request each)
        self.demand_reads = 0  # ranges the reader had to fetch itself
        self.demand_s = 0.0  # seconds the reader spent fetching them
        self.waited_s = 0.0  # seconds ``fetch_ahead(wait=True)`` waited for pieces another thread was fetching

    def add_file(self, url: str, size: int) -> int:
        """Register the file at ``url`` (``size`` bytes, from its index); returns its stream id."""
        fs, inner = filesystem(url)
        self._files.append((fs, inner, size))
        self._pieces.append(_Pieces())
        return len(self._files) - 1

    # ------------------------------------------------------------------------------ fetching ahead
    def fetch_ahead(self, steps: list[tuple[int, StepRanges]], wait: bool = False,
                    via: FetchProcess | None = None) -> bool:
        """Fetch what no piece holds of the byte ranges of ``steps`` — (step, [(stream id, sorted disjoint ranges lo,
        hi)]), nearest first; a step is its first sample — in one batch of concurrent requests (one a range; a
        step's range touching the one before merged with it), and pin every piece each step touches until that
        step has run (``release``). Stops at the first step whose pieces and the pinned ones would not fit in the
        capacity, pinning nothing of it (the reader must consume some first): False. ``wait``: also wait for the
        pieces another thread is fetching (and fetch those here if that failed). ``via``: the requests made by that
        process (the prefetcher's: the GIL stays with the training loop). Raises as ``read`` does."""
        while True:
            with self._lock:
                new, theirs, fits = [], [], True
                for until, ranges in steps:
                    planned = self._plan(until, ranges)
                    if planned is None:
                        fits = False
                        break
                    new += planned[0]
                    theirs += planned[1]
                new = self._merge_touching(new)
            self._fetch(new, via)
            if not (wait and theirs):
                return fits
            started = time.monotonic()
            for event in theirs:
                event.wait()
            self.waited_s += time.monotonic() - started

    def _plan(self, until: int, ranges: StepRanges):
        """Register and pin the pieces one step needs: (new pieces, events of the pieces others fetch), or None
        when they do not fit (nothing done)."""
        touched, gaps, more = [], [], 0
        for sid, lo, hi in ranges:
            if not len(lo):
                continue
            pieces = self._pieces[sid]
            plo, phi = pieces.arrays()
            a, b = np.searchsorted(phi, lo[0], "right"), np.searchsorted(plo, hi[-1], "left")  # pieces in reach
            near = np.arange(a, b)
            j = np.searchsorted(lo, phi[near], "left") - 1  # the last range starting before each piece ends
            touched += [(sid, pieces.at(i)) for i in near[hi[j] > plo[near]].tolist()]
            new_lo, new_hi = subtract_ranges(lo, hi, plo[a:b], phi[a:b])
            gaps += [(sid, _Piece(x, y, threading.Event())) for x, y in zip(new_lo.tolist(), new_hi.tolist(),
                                                                            strict=True)]
            more += int((new_hi - new_lo).sum())
        more += sum(p.size for _, p in touched if p.until is None)
        if self.pinned + more > self.capacity:
            return None
        for sid, p in gaps:
            self._pieces[sid].add(p)
            self._fetching[(sid, p.lo)] = p
        for sid, p in (*touched, *gaps):
            self._pin(sid, p, until)
        return gaps, [p.fetching for _, p in touched if p.fetching is not None]

    def _merge_touching(self, new: list[tuple[int, _Piece]]) -> list[tuple[int, _Piece]]:
        """New pieces of one file that touch (the steps of a batch read in order) as one piece, pinned until the
        last step that needs it: one request instead of one a step."""
        new = sorted(new, key=lambda sp: (sp[0], sp[1].lo))
        out: list[tuple[int, _Piece]] = []
        for sid, p in new:
            if out and out[-1][0] == sid and out[-1][1].hi == p.lo:
                q = out[-1][1]
                for r in (q, p):
                    self._pieces[sid].remove(r)
                    self._fetching.pop((sid, r.lo))
                merged = _Piece(q.lo, p.hi, threading.Event(), max(q.until, p.until))
                self._pins.setdefault(merged.until, []).append((sid, merged.lo))
                self._pieces[sid].add(merged)
                self._fetching[(sid, merged.lo)] = merged
                q.fetching.set()  # (no one waits on a piece registered in this batch: the lock was held)
                p.fetching.set()
                out[-1] = (sid, merged)
            else:
                out.append((sid, p))
        return out

    def _pin(self, sid: int, p: _Piece, until: int) -> None:
        if p.until is None:
            self.pinned += p.size
            self._idle.pop((sid, p.lo), None)
        elif p.until >= until:
            return
        p.until = until
        self._pins.setdefault(until, []).append((sid, p.lo))

    def release(self, done: int) -> None:
        """Unpin the pieces of the steps before the one starting at sample ``done``: evictable from now on."""
        with self._lock:
            for step in [s for s in self._pins if s < done]:
                for sid, lo in self._pins.pop(step):
                    p = self._pieces[sid].by_lo.get(lo)
                    if p is not None and p.until == step:
                        self._unpin(sid, p)
            self._trim(0)

    def _unpin(self, sid: int, p: _Piece) -> None:
        p.until = None
        self.pinned -= p.size
        if p.fetching is None:
            self._idle[(sid, p.lo)] = p

    # ----------------------------------------------------------------------------------- reading
    def read(self, sid: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The bytes of ranges ``lo, hi`` of stream ``sid``, back to back (uint8)."""
        pos = expand_ranges(lo, hi)
        out = np.empty(len(pos), np.uint8)
        todo = np.arange(len(pos))  # the positions of ``out`` not filled yet
        while len(todo):
            with self._lock:
                pieces = self._pieces[sid]
                k = containing(pos[todo], *pieces.arrays())
                filled, waits = self._copy(sid, k, pos[todo], out, todo)
                missing = runs(pos[todo[k < 0]])
                demand = [_Piece(int(x), int(y), threading.Event()) for x, y in zip(*missing, strict=True)]
                for p in demand:
                    pieces.add(p)
                    self._fetching[(sid, p.lo)] = p
            todo = todo[~filled]
            if demand:
                started = time.monotonic()
                data = self._fetch([(sid, p) for p in demand])
                self.demand_reads += len(demand)
                self.demand_s += time.monotonic() - started
                k = containing(pos[todo], *missing)
                at = np.flatnonzero(k >= 0)
                buf = np.frombuffer(b"".join(data), np.uint8)
                out[todo[at]] = buf[np.cumsum([0, *(p.size for p in demand[:-1])])[k[at]] + pos[todo[at]] -
                                    missing[0][k[at]]]
                todo = np.delete(todo, at)
            for event in waits:
                event.wait()
        return out

    def _copy(self, sid: int, k: np.ndarray, pos: np.ndarray, out: np.ndarray, into: np.ndarray):
        """Copy the positions ``pos`` that pieces on disk hold (``k``: their piece, -1: none) into ``out[into]``;
        returns which were copied, and the events of the pieces being fetched that hold others."""
        filled = np.zeros(len(pos), np.bool_)
        waits = []
        order = np.argsort(k, kind="stable")
        ks, first = np.unique(k[order], return_index=True)
        bounds = np.append(first, len(order))
        for i, piece_index in enumerate(ks.tolist()):
            if piece_index < 0:
                continue
            p = self._pieces[sid].at(piece_index)
            if p.fetching is not None:
                waits.append(p.fetching)
                continue
            sel = order[bounds[i]:bounds[i + 1]]
            a, b = int(pos[sel].min()), int(pos[sel].max()) + 1
            with open(self._path(sid, p), "rb") as f:
                f.seek(a - p.lo)
                buf = np.frombuffer(f.read(b - a), np.uint8)
            out[into[sel]] = buf[pos[sel] - a]
            filled[sel] = True
            if (sid, p.lo) in self._idle:
                self._idle.move_to_end((sid, p.lo))
        return filled, waits

    # ---------------------------------------------------------------------------------- the network
    def _fetch(self, pieces: list[tuple[int, _Piece]], via: FetchProcess | None = None) -> list[bytes]:
        """Fetch registered ``pieces`` (one request each, concurrently where the file system can), check their sizes,
        store those that fit; returns their bytes. Then none of them is being fetched any more (dropped unless
        stored)."""
        try:
            data: list[bytes] = [b""] * len(pieces)
            for group in _by_file_system(self._files, pieces):
                for i, d in zip(group, self._fetch_group([pieces[i] for i in group], via), strict=True):
                    data[i] = d
            for (sid, p), d in zip(pieces, data, strict=True):
                self._store(sid, p, d)
            return data
        finally:
            with self._lock:
                for sid, p in pieces:
                    if p.fetching is not None:  # (an error came first)
                        self._settle(sid, p, stored=False)

    def _fetch_group(self, pieces: list[tuple[int, _Piece]], via: FetchProcess | None) -> list[bytes]:
        """The bytes of ``pieces`` of files of one file system: one batch of concurrent requests, retried whole."""
        fs = self._files[pieces[0][0]][0]
        paths = [self._files[sid][1] for sid, _ in pieces]
        starts, ends = [p.lo for _, p in pieces], [p.hi for _, p in pieces]
        what = fs.unstrip_protocol(paths[0]) if len(set(paths)) == 1 else \
            f"{fs.unstrip_protocol(paths[0])} (and {len(set(paths)) - 1} more)"
        fetch = cat_ranges if via is None else via.cat_ranges
        data = self.retry.run(what, lambda: fetch(fs, paths, starts, ends))
        for path, (_, p), d in zip(paths, pieces, data, strict=True):
            if len(d) != p.size:
                raise XprepError(f"{fs.unstrip_protocol(path)}: bytes {p.lo}..{p.hi} came back as {len(d)} bytes, "
                                 f"not {p.size}: the object is shorter than its index says (rewritten?); re-upload it")
        self.fetched_bytes += sum(len(d) for d in data)
        self.requests += len(data)
        return data

    def _settle(self, sid: int, p: _Piece, stored: bool) -> None:
        """A fetch of ``p`` ended: on disk (idle unless pinned), else forgotten (a reader fetches it again)."""
        self._fetching.pop((sid, p.lo), None)
        event, p.fetching = p.fetching, None
        if stored:
            if p.until is None:
                self._idle[(sid, p.lo)] = p
        else:
            self._pieces[sid].remove(p)
            if p.until is not None:
                p.until = None
                self.pinned -= p.size
        event.set()

    def _store(self, sid: int, p: _Piece, data: bytes) -> None:
        """Write a fetched piece to disk (temp + rename), evicting idle pieces read least recently, with room kept
        for the pinned pieces still being fetched; dropped when there is no room."""
        with self._lock:
            coming = sum(q.size for q in self._fetching.values() if q.until is not None and q is not p)
            stored = self._trim(len(data) + coming)
            if stored:
                write_atomic(self._path(sid, p), data, durable=False)  # (a lost piece is fetched again)
                self.used += len(data)
            self._settle(sid, p, stored)

    def _trim(self, room: int) -> bool:
        """Evict idle pieces, least recently read first, until ``room`` bytes more fit (and at most
        ``MAX_IDLE_PIECES`` stay idle); whether they fit."""
        while self._idle and (self.used + room > self.capacity or len(self._idle) > MAX_IDLE_PIECES):
            (sid, _), victim = self._idle.popitem(last=False)
            self._path(sid, victim).unlink()
            self.used -= victim.size
            self._pieces[sid].remove(victim)
        return self.used + room <= self.capacity

    def _path(self, sid: int, p: _Piece) -> Path:
        return self.directory / f"{sid}-{p.lo}"

    def disk_bytes(self) -> int:
        """Bytes of the files under the cache directory now (what ``capacity`` bounds)."""
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file())

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _by_file_system(files: list[tuple[object, str, int]], pieces: list[tuple[int, _Piece]]) -> list[list[int]]:
    """The indexes of ``pieces`` (stream id, piece) grouped by the file system of their stream (one batch each)."""
    groups: dict[int, list[int]] = {}
    for i, (sid, _) in enumerate(pieces):
        groups.setdefault(id(files[sid][0]), []).append(i)
    return list(groups.values())


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
    tokens of items through the ``BlockCache`` given to ``attach``. Pickles as its URL and cache directory.
    """

    streamed = True

    def __init__(self, url: str, cache_dir: str | None = None, retry: Retry | None = None):
        self.path = url.rstrip("/")
        self.retry = retry or Retry()
        self.manifest = read_complete_manifest(self.path, self.retry)
        self.cache_dir = cache_dir
        local = _fetch_indexes(self.path, self.manifest, cache_dir, self.retry)
        fs, inner = filesystem(self.path)
        streams = {}
        for name in self.manifest["streams"]:
            size = self.retry.run(f"{self.path}/{name}.bin", lambda n=name: fs.info(f"{inner}/{n}.bin")["size"])
            streams[name] = RemoteStream(f"{self.path}/{name}", (local / f"{name}.idx").read_bytes(), size,
                                         self.retry)
        self._by_name = streams
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

    def ranges(self, flat: np.ndarray, lens: np.ndarray, ends: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(stream id, byte ranges) that ``gather`` of these items reads, coalesced (``coalesce_ranges``): what a
        prefetcher fetches ahead."""
        lo, hi = _item_ranges(flat, lens, ends)
        return [(sid, *coalesce_ranges(lo * s.dtype.itemsize, hi * s.dtype.itemsize))
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
        return self.cache.read(sid, lo * k, hi * k).view(stream.dtype)

    def verify(self) -> None:
        """Refuse ``.bin`` objects whose sha256 is not the one the manifest recorded (``--verify-data``, as
        ``verify_streams`` does locally): each is read once, in order, ``VERIFY_CHUNK`` bytes a request, hashed as
        it arrives (nothing written, constant memory)."""
        for name, stream in self._by_name.items():
            digest = hashlib.sha256()
            for lo in range(0, stream.nbytes, VERIFY_CHUNK):
                digest.update(stream._fetch(lo, min(lo + VERIFY_CHUNK, stream.nbytes)))
            if digest.hexdigest() != (self.manifest["streams"][name] or {}).get("bin_sha256"):
                raise XprepError(f"{stream.url}: changed since {self.path}/{MANIFEST} was written (its sha256 "
                                 "differs): the object was rewritten in place; write the dataset there again, "
                                 "then re-run `xprep pack`")

    def __getstate__(self) -> dict:
        return {"path": self.path, "cache_dir": self.cache_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state.get("cache_dir"))


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
