"""Bin-packing kernels over item costs, and the CSR operations on bins the pipeline shares.

Items arrive as costs in visiting order (each ≤ the capacity); a bin is a run ``offsets[b]:offsets[b+1]`` of an
item order. ``next_fit`` keeps the items in order (sequential, token-aware); ``grouped_ffd`` packs consecutive
groups by first-fit-decreasing in parallel and ``repack_underfull`` pools the groups' tail bins and packs them
again (multipack), so grouping costs next to nothing against one global FFD. Which method uses which is the
registry's business (``xprep.prep.pack.methods``); these are pure numba functions over arrays and ints, each
with a slow, obvious reference in tests/prep/pack/test_packing.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

UNDERFULL = 0.99  # multipack pools the items of bins filled below this across groups, and repacks them


@njit(cache=True)
def next_fit(costs, capacity):
    """Order-preserving greedy: close the bin when the next item does not fit. CSR offsets, O(n)."""
    n = len(costs)
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    n_bins = 0
    fill = 0
    for i in range(n):
        c = costs[i]
        if i > 0 and fill + c > capacity:
            n_bins += 1
            offsets[n_bins] = i
            fill = 0
        fill += c
    if n:
        n_bins += 1
        offsets[n_bins] = n
    return offsets[: n_bins + 1].copy()


@njit(cache=True)
def _descending_order(costs, capacity):
    """Indices sorting ``costs`` (each in 1..capacity) by decreasing cost, ties by index."""
    n = len(costs)
    if capacity > 4 * n + 1024:
        return np.argsort(-costs.astype(np.int64), kind="mergesort")
    starts = np.zeros(capacity + 2, np.int64)
    for i in range(n):
        starts[capacity - costs[i] + 1] += 1
    for v in range(1, capacity + 2):
        starts[v] += starts[v - 1]
    order = np.empty(n, np.int64)
    for i in range(n):
        slot = capacity - costs[i]
        order[starts[slot]] = i
        starts[slot] += 1
    return order


@njit(cache=True)
def first_fit_decreasing(costs, capacity):
    """Bin index of each item under first-fit-decreasing; bins numbered in opening order.

    Items go in decreasing cost (ties by index) into the lowest-numbered bin with room, found
    in O(log bins) by descending a max-segment-tree over the bins' remaining capacities
    (unopened bins have full capacity, so the leftmost fit is an open bin or the next new one).
    First fit leaves at most one bin half empty, so ``2·Σcost/capacity + 2`` leaves suffice.
    """
    n = len(costs)
    bin_of = np.empty(n, np.int64)
    if n == 0:
        return bin_of
    total = 0
    for c in costs:
        total += c
    size = 1
    while size < min(n, 2 * total // capacity + 2):
        size *= 2
    tree = np.full(2 * size, capacity, np.int64)
    for i in _descending_order(costs, capacity):
        c = costs[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= c else 2 * node + 1
        bin_of[i] = node - size
        tree[node] -= c
        node //= 2
        while node >= 1:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2
    return bin_of


@njit(cache=True)
def csr_from_bins(bin_of, n_bins):
    """Group items by bin, keeping item order inside a bin: (offsets int64[n_bins+1], items)."""
    offsets = np.zeros(n_bins + 1, np.int64)
    for b in bin_of:
        offsets[b + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    items = np.empty(len(bin_of), np.int64)
    for i in range(len(bin_of)):
        b = bin_of[i]
        items[cursor[b]] = i
        cursor[b] += 1
    return offsets, items


@njit(cache=True, parallel=True)
def grouped_ffd(costs, capacity, group_size):
    """First-fit-decreasing over consecutive groups of ``group_size`` items, groups in parallel.

    Returns CSR bins (offsets, items) and each bin's total cost: group g's bins follow those of
    groups < g, and the items of a bin are in index order.
    """
    n = len(costs)
    n_groups = (n + group_size - 1) // group_size
    bin_of = np.empty(n, np.int64)
    bins_in = np.zeros(n_groups + 1, np.int64)
    for g in prange(n_groups):
        lo, hi = g * group_size, min(n, (g + 1) * group_size)
        local = first_fit_decreasing(costs[lo:hi], capacity)
        bin_of[lo:hi] = local
        bins_in[g + 1] = local.max() + 1
    base = np.cumsum(bins_in)
    offsets = np.empty(base[-1] + 1, np.int64)
    offsets[-1] = n
    items = np.empty(n, np.int64)
    load = np.zeros(base[-1], np.int64)
    for g in prange(n_groups):
        lo, hi = g * group_size, min(n, (g + 1) * group_size)
        local_offsets, local_items = csr_from_bins(bin_of[lo:hi], bins_in[g + 1])
        offsets[base[g]:base[g + 1]] = local_offsets[:-1] + lo
        items[lo:hi] = local_items + lo
        for i in range(lo, hi):
            load[base[g] + bin_of[i]] += costs[i]
    return offsets, items, load


@njit(cache=True)
def repack_underfull(costs, offsets, items, load, capacity, min_load):
    """Pool the items of the bins loaded below ``min_load`` (the tails of all groups) and pack
    them again by first-fit-decreasing; keep that only if it needs fewer bins.

    Kept bins stay in order; the repacked ones follow. Returns (offsets, items).
    """
    under = load < min_load
    n_under = np.count_nonzero(under)
    if n_under < 2:
        return offsets, items
    sizes = offsets[1:] - offsets[:-1]
    pool = np.empty(sizes[under].sum(), np.int64)
    j = 0
    for b in np.flatnonzero(under):
        for k in range(offsets[b], offsets[b + 1]):
            pool[j] = items[k]
            j += 1
    pool.sort()
    local = first_fit_decreasing(costs[pool], capacity)
    n_new = local.max() + 1
    if n_new >= n_under:
        return offsets, items
    pool_offsets, pool_items = csr_from_bins(local, n_new)
    n_kept = len(load) - n_under
    new_offsets = np.empty(n_kept + n_new + 1, np.int64)
    new_items = np.empty(len(items), np.int64)
    nb, j = 0, 0
    for b in np.flatnonzero(~under):
        new_offsets[nb] = j
        for k in range(offsets[b], offsets[b + 1]):
            new_items[j] = items[k]
            j += 1
        nb += 1
    for b in range(n_new):
        new_offsets[nb + b] = j + pool_offsets[b]
    new_items[j:] = pool[pool_items]
    new_offsets[-1] = len(items)
    return new_offsets, new_items


@njit(cache=True)
def bin_sums(offsets, values, squared):
    """Per-bin sum of ``values`` (of their squares when ``squared``), int64."""
    n_bins = len(offsets) - 1
    out = np.zeros(n_bins, np.int64)
    for b in range(n_bins):
        s = 0
        for i in range(offsets[b], offsets[b + 1]):
            v = np.int64(values[i])
            s += v * v if squared else v
        out[b] = s
    return out


@njit(cache=True)
def gather_bins(offsets, perm):
    """CSR after reordering bins by ``perm`` (new → old; −1 is a new empty bin): (offsets, items)."""
    n_bins = len(perm)
    new_offsets = np.zeros(n_bins + 1, np.int64)
    for b in range(n_bins):
        old = perm[b]
        size = offsets[old + 1] - offsets[old] if old >= 0 else 0
        new_offsets[b + 1] = new_offsets[b] + size
    items = np.empty(new_offsets[-1], np.int64)
    for b in range(n_bins):
        old = perm[b]
        if old >= 0:
            for k in range(offsets[old + 1] - offsets[old]):
                items[new_offsets[b] + k] = offsets[old] + k
    return new_offsets, items


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(l, h) for l, h in zip(lo, hi)])``, without the Python loop."""
    lo, counts = np.asarray(lo, np.int64), np.asarray(hi, np.int64) - np.asarray(lo, np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.repeat(lo - starts, counts) + np.arange(total, dtype=np.int64)
