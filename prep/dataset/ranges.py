"""Byte ranges ``[lo, hi)`` of one file as pairs of int64 arrays, vectorized: what a streamed read fetches.

Pure functions over arrays (no I/O), each with a slow obvious reference in tests/prep/dataset/test_ranges.py.
Sorted disjoint ranges are the normal form: ``merge_ranges`` makes it; ``coalesce_ranges`` bridges small gaps so that
neighbouring reads become one request; ``subtract_ranges`` leaves what a cache does not hold yet.
"""

from __future__ import annotations

import numpy as np

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
