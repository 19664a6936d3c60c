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
def greedy_blend(weights, unit, sizes, size_offsets, orders, order_offsets, total_tokens, out_source, out_index):
    """Fill ``out_*`` with the greedy blend until ``total_tokens`` are delivered; return the bins written.

    ``sizes[size_offsets[i] + b]`` is the size of bin ``b`` of source ``i``; ``orders[order_offsets[i]:…]``
    the bins of source ``i`` in the order they are taken, over as many epochs as were prepared. Returns -1 - i
    when source ``i`` runs out of prepared bins (the caller prepares more epochs and calls again).
    """
    k = len(weights)
    taken = np.zeros(k, np.int64)
    delivered = np.zeros(k, np.float64)
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
        pos = order_offsets[best] + taken[best]
        if pos >= order_offsets[best + 1]:
            return -1 - best
        b = orders[pos]
        size = sizes[size_offsets[best] + b]
        out_source[n] = best
        out_index[n] = b
        taken[best] += 1
        delivered[best] += size
        total += size
        n += 1
    return n


def blend_bins(bin_sizes: list[np.ndarray], weights: np.ndarray, unit: int, total_tokens: int, seed: int) -> Blend:
    """The blend of sources with these bin sizes (in tokens) and weights, until ``total_tokens`` are delivered.

    ``weights`` need not sum to 1 (they are normalized); each must be > 0 and each source must hold a bin.
    """
    weights = np.asarray(weights, np.float64) / np.sum(weights)
    k = len(bin_sizes)
    counts = np.array([len(s) for s in bin_sizes], np.int64)
    tokens = np.array([int(np.sum(s, dtype=np.int64)) for s in bin_sizes], np.int64)
    sizes = np.concatenate([np.asarray(s, np.float64) for s in bin_sizes])
    size_offsets = np.concatenate([[0], np.cumsum(counts)])
    # Epochs each source needs at its share, plus one: the greedy may run a few bins ahead of the share.
    epochs = [int(np.ceil(w * total_tokens / max(t, 1))) + 1 for w, t in zip(weights, tokens, strict=True)]
    index_dtype = np.int32 if counts.max() < 2**31 else np.int64
    capacity = int(np.ceil(total_tokens / max(min(np.min(s) for s in bin_sizes), 1))) + k + 1
    while True:
        orders = [epoch_orders(int(counts[i]), epochs[i], seed, i, index_dtype) for i in range(k)]
        order_offsets = np.concatenate([[0], np.cumsum([len(o) for o in orders])])
        out_source = np.empty(capacity, np.int16)
        out_index = np.empty(capacity, index_dtype)
        n = greedy_blend(weights, float(unit), sizes, size_offsets, np.concatenate(orders), order_offsets,
                         float(total_tokens), out_source, out_index)
        if n >= 0:
            break
        epochs[-1 - n] *= 2  # rare: that source ran further ahead than prepared for
    out_source, out_index = out_source[:n], out_index[:n]
    taken = np.bincount(out_source, minlength=k).astype(np.int64)
    delivered = np.bincount(out_source, weights=sizes[size_offsets[out_source] + out_index], minlength=k)
    return Blend(bin_source=out_source, bin_index=out_index, bins=taken, tokens=delivered.astype(np.int64),
                 epochs=np.maximum(1, -(-taken // counts)))


def epoch_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32) -> np.ndarray:
    """The bins of one source over ``epochs`` epochs: the pack's order, then seeded permutations."""
    parts = [np.arange(n_bins, dtype=dtype)]
    for epoch in range(1, epochs):
        parts.append(shuffled_order(n_bins, epoch_seed(seed, source, epoch)).astype(dtype))
    return np.concatenate(parts)


def epoch_seed(seed: int, source: int, epoch: int) -> int:
    """A seed per (blend seed, source, epoch), spread over 63 bits."""
    mixed = np.random.SeedSequence([seed, source, epoch]).generate_state(2, np.uint32)
    return int((int(mixed[0]) << 31) ^ int(mixed[1]))
