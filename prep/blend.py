"""Weighted blends of packs: the order in which a mixture takes bins from its sources.

Megatron's greedy rule (``BlendedDataset``'s ``build_blending_indices``), with weights in tokens: the next
bin comes from the source whose delivered tokens lag its share of everything delivered so far the most,

    source = argmax_i  w_i · max(T, C) − t_i          (T tokens delivered in all, t_i from source i,
                                                       C the bin capacity; ties: the lowest index)

A bin of a fixed-capacity pack (sequential, multipack, chunk) counts as C tokens, a token-aware bin as the
tokens it holds. With every bin worth C this is exactly Megatron's rule on bin counts
(``w_i · max(n, 1) − c_i``), bin for bin, which tests check against megatron-core itself. What it
guarantees after every prefix: no source is ever more than one bin ahead of its weight; two sources are
each within one bin of it; with more sources one can fall further behind (a bit under two bins in
practice, fewer than ``k − 1`` in theory) and catches up.

A source asked for more bins than it has is repeated epoch after epoch: its first epoch in the pack's own
order, each later one in a fresh permutation seeded by (seed, source, epoch); a source asked for less is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from prep.packing import shuffled_order

MAX_SOURCES = 32_767  # sources are stored as int16, as Megatron stores its dataset index


@dataclass
class Blend:
    """Bin ``j`` of the mixture is bin ``bin_index[j]`` of source ``bin_source[j]``."""

    bin_source: np.ndarray  # int16[n]
    bin_index: np.ndarray  # int32 (int64 for sources of ≥ 2**31 bins)[n]
    bins: np.ndarray  # int64[k]: bins taken from each source
    tokens: np.ndarray  # int64[k]: tokens (in blend units) taken from each source
    epochs: np.ndarray  # int64[k]: epochs of each source begun (1 = not repeated)


@njit(cache=True)
def _bin_at(source, t, counts, later, later_offsets):
    """The ``t``-th bin a source gives: its own order first, then its prepared later epochs (-1: none left)."""
    if t < counts[source]:
        return t
    pos = later_offsets[source] + t - counts[source]
    return later[pos] if pos < later_offsets[source + 1] else -1


@njit(cache=True)
def greedy_blend(weights, unit, sizes, size_offsets, counts, later, later_offsets, total_tokens, out_source,
                 out_index, taken, delivered):
    """Fill ``out_*`` with the greedy blend until ``total_tokens`` are delivered; return the bins written.

    ``sizes[size_offsets[i] + b]`` is the size of bin ``b`` of source ``i``, which holds ``counts[i]`` bins,
    taken first in order ``0 … counts[i]−1``, then in the orders ``later[later_offsets[i]:later_offsets[i+1]]``
    (the later epochs prepared). ``taken``/``delivered`` (zeros on entry) end as the bins and tokens taken from
    each source. Returns -1 - i when source ``i`` runs out of prepared bins (the caller prepares more epochs and
    calls again).
    """
    k = len(weights)
    total = 0.0
    n = 0
    while total < total_tokens:
        scale = max(total, unit)
        best = 0
        best_error = weights[0] * scale - delivered[0]
        for i in range(1, k):
            error = weights[i] * scale - delivered[i]
            if error > best_error:
                best, best_error = i, error
        t = taken[best]
        b = _bin_at(best, t, counts, later, later_offsets)
        if b < 0:
            return -1 - best
        size = sizes[size_offsets[best] + b]
        out_source[n] = best
        out_index[n] = b
        taken[best] = t + 1
        delivered[best] += size
        total += size
        n += 1
    return n


def blend_bins(bin_sizes: list[np.ndarray | int], weights: np.ndarray, unit: int, total_tokens: int, seed: int
               ) -> Blend:
    """The blend of sources with these bin sizes (in tokens) and weights, until ``total_tokens`` are delivered.

    A source given as an int is that many bins each worth ``unit`` (a fixed-capacity pack): with every source
    so, the blend runs on bin counts alone (Megatron's exact rule, no sizes read). ``weights`` need not sum
    to 1 (they are normalized); each must be > 0 and each source must hold a bin. Memory: the bin sizes once
    (when given), the output, and only the later epochs' orders.
    """
    weights = np.asarray(weights, np.float64) / np.sum(weights)
    k = len(bin_sizes)
    uniform = all(isinstance(s, int | np.integer) for s in bin_sizes)
    if not uniform:
        bin_sizes = [np.full(s, unit, np.int32) if isinstance(s, int | np.integer) else s for s in bin_sizes]
    counts = np.array([s if uniform else len(s) for s in bin_sizes], np.int64)
    tokens = counts * unit if uniform else np.array([int(np.sum(s, dtype=np.int64)) for s in bin_sizes], np.int64)
    biggest = unit if uniform else max(int(np.max(s)) for s in bin_sizes)
    smallest = unit if uniform else min(int(np.min(s)) for s in bin_sizes)
    # Epochs each source needs at its share, with room for the greedy running up to two bins ahead of it.
    epochs = [max(1, int(np.ceil((w * total_tokens + 2 * biggest) / max(t, 1))))
              for w, t in zip(weights, tokens, strict=True)]
    index_dtype = np.int32 if counts.max() < 2**31 else np.int64
    capacity = int(np.ceil(total_tokens / max(smallest, 1))) + k + 1
    out_source = np.empty(capacity, np.int16)
    out_index = np.empty(capacity, index_dtype)
    while True:
        later = [later_orders(int(counts[i]), epochs[i], seed, i, index_dtype) for i in range(k)]
        later_offsets = np.concatenate([[0], np.cumsum([len(o) for o in later])])
        later = np.concatenate(later).astype(index_dtype)
        taken, delivered = np.zeros(k, np.int64), np.zeros(k, np.float64)
        if uniform:
            n = greedy_blend_counts(weights, counts, later, later_offsets, -(-total_tokens // unit), out_source,
                                    out_index, taken)
            delivered = taken * float(unit)
        else:
            sizes = np.concatenate([np.asarray(s) for s in bin_sizes])
            size_offsets = np.concatenate([[0], np.cumsum(counts)])
            n = greedy_blend(weights, float(unit), sizes, size_offsets, counts, later, later_offsets,
                             float(total_tokens), out_source, out_index, taken, delivered)
        if n >= 0:
            break
        epochs[-1 - n] *= 2  # rare: that source ran further ahead than prepared for
    return Blend(bin_source=out_source[:n], bin_index=out_index[:n], bins=taken,
                 tokens=delivered.astype(np.int64), epochs=np.maximum(1, -(-taken // counts)))


@njit(cache=True)
def greedy_blend_counts(weights, counts, later, later_offsets, n_bins, out_source, out_index, taken):
    """``greedy_blend`` when every bin is worth the same: Megatron's ``w_i · max(n, 1) − c_i`` on counts.

    The argmax runs as two independent chains (even and odd sources), merged with ties to the lower index:
    the same choice as one left-to-right scan, with half the dependent compares.
    """
    k = len(weights)
    c = np.zeros(k, np.float64)  # taken, as the float the errors are computed with
    for n in range(n_bins):
        scale = max(float(n), 1.0)
        b0, e0 = 0, weights[0] * scale - c[0]
        b1, e1 = 1, (weights[1] * scale - c[1]) if k > 1 else -np.inf
        for i in range(2, k - 1, 2):
            ea = weights[i] * scale - c[i]
            eb = weights[i + 1] * scale - c[i + 1]
            if ea > e0:
                b0, e0 = i, ea
            if eb > e1:
                b1, e1 = i + 1, eb
        if k > 2 and k % 2 == 1:
            ea = weights[k - 1] * scale - c[k - 1]
            if ea > e0:
                b0, e0 = k - 1, ea
        best = b1 if e1 > e0 or (e1 == e0 and b1 < b0) else b0
        t = taken[best]
        b = _bin_at(best, t, counts, later, later_offsets)
        if b < 0:
            return -1 - best
        out_source[n] = best
        out_index[n] = b
        taken[best] = t + 1
        c[best] += 1.0
    return n_bins


def later_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32) -> np.ndarray:
    """Epochs 1 … epochs−1 of one source (epoch 0 is the pack's own order, never materialized)."""
    parts = [shuffled_order(n_bins, epoch_seed(seed, source, e)).astype(dtype) for e in range(1, epochs)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def epoch_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32) -> np.ndarray:
    """The bins of one source over ``epochs`` epochs: the pack's order, then seeded permutations."""
    return np.concatenate([np.arange(n_bins, dtype=dtype), later_orders(n_bins, epochs, seed, source, dtype)])


def epoch_seed(seed: int, source: int, epoch: int) -> int:
    """A seed per (blend seed, source, epoch), spread over 63 bits."""
    mixed = np.random.SeedSequence([seed, source, epoch]).generate_state(2, np.uint32)
    return int((int(mixed[0]) << 31) ^ int(mixed[1]))
