"""Seeded randomness that depends on the seed alone, never on the thread count: the permutation every shuffle of
documents, bins and epochs uses, and the draw of the documents ``--split`` holds out.

Both are counter-based (splitmix64 of a seed and an index), so a value is recomputed anywhere from its inputs: a
permutation is the same on any machine and for any numba thread count, and a document's side of a split depends
only on its dataset and its index.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True)
def _mix64(x):
    """splitmix64's finalizer: a bijective 64-bit hash (x is uint64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True)
def _uniform_below(seed, stream, i, n):
    """A uniform integer in [0, n) (n < 2**32) from a counter-based hash of (seed, stream, i)."""
    h = _mix64(_mix64(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(stream))
               + np.uint64(i))
    return np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))


@njit(cache=True, parallel=True)
def shuffled_order(n, seed):
    """A seeded uniformly random permutation of 0..n-1, the same for any thread count.

    Rao–Sandelius: send each index to a random bucket of ~8k slots (sequential write streams),
    then Fisher–Yates inside each bucket (in cache, buckets in parallel). Random numbers come
    from a counter-based hash, so the result depends only on (n, seed). The scatter into buckets
    runs over fixed spans of indices in parallel: each span counts its indices per bucket, and
    writes them after the earlier spans' (a stable scatter, so the spans do not change the order).
    """
    n_buckets = max(1, n // 8192)
    n_spans = max(1, min(64, n // (1 << 16)))  # fixed by n alone: the result never depends on the threads
    span = -(-n // n_spans)
    counts = np.zeros((n_spans, n_buckets), np.int64)
    for t in prange(n_spans):
        for i in range(t * span, min(n, (t + 1) * span)):
            counts[t, _uniform_below(seed, 0, i, n_buckets)] += 1
    starts = np.zeros(n_buckets + 1, np.int64)
    cursor = np.empty((n_spans, n_buckets), np.int64)
    for b in range(n_buckets):
        at = starts[b]
        for t in range(n_spans):
            cursor[t, b] = at
            at += counts[t, b]
        starts[b + 1] = at
    out = np.empty(n, np.int64)
    for t in prange(n_spans):
        for i in range(t * span, min(n, (t + 1) * span)):
            b = _uniform_below(seed, 0, i, n_buckets)
            out[cursor[t, b]] = i
            cursor[t, b] += 1
    for b in prange(n_buckets):
        lo = starts[b]
        for j in range(starts[b + 1] - lo - 1, 0, -1):
            k = _uniform_below(seed, b + 1, j, j + 1)
            out[lo + j], out[lo + k] = out[lo + k], out[lo + j]
    return out


@njit(cache=True, parallel=True)
def held_out(n_docs, base, share):
    """Documents 0..n_docs-1 that go to validation: ``u(base, d) < share``, u uniform in [0, 1).

    ``u`` is splitmix64 of (``base``, d) (``base``: 64 bits of the dataset's content, see
    ``xprep.prep.pack.cache.split_base``), its top 53 bits as a fraction: a document's side depends only on its
    dataset and its index, never on the packing options.
    """
    out = np.empty(n_docs, np.bool_)
    b = _mix64(np.uint64(base))
    for d in prange(n_docs):
        h = _mix64(b + _mix64(np.uint64(d)))
        out[d] = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0) < share
    return out


@njit(cache=True, parallel=True)
def split_draws(n_docs, base):
    """``u(base, d)`` of documents 0..n_docs-1 (float64 in [0, 1)): the draw ``held_out`` compares with the share,
    which a three-share ``--split`` ranks instead (``xprep.prep.pack.cache.split_parts``)."""
    out = np.empty(n_docs, np.float64)
    b = _mix64(np.uint64(base))
    for d in prange(n_docs):
        h = _mix64(b + _mix64(np.uint64(d)))
        out[d] = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
    return out
