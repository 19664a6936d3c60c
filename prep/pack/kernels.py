"""Packing documents into bins: the numba kernels and the array-level pipeline.

Everything here is pure (arrays in, arrays out, no I/O) and takes its options as a ``PackConfig``
(``xprep.prep.pack.config``); ``xprep.prep.pack.cache`` reads the datasets, keys, builds and publishes entries.
Vocabulary:

- *document*: one sequence of a token dataset, indexed globally over the input datasets.
- *item*: a run of tokens of one document placed in a bin (the whole document, its truncated
  head, or one piece of a split document).
- *cost*: an item's length rounded up to a multiple of ``2·cp_size`` (1 without context
  parallelism); the sum of costs in a bin never exceeds the capacity.

Methods: ``sequential`` and ``token-aware`` are ``next_fit`` in visiting order (token-aware
shuffles by default and can balance bins over data-parallel ranks: ``balance_dp_steps``);
``multipack`` is ``grouped_ffd`` (groups in parallel) then ``repack_underfull`` (the groups'
tail bins pooled and packed again, so grouping costs next to nothing against one global FFD).

Kernels are top-level numba functions with ``cache=True``; each one has a slow, obvious
reference in ``tests/test_packing.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit, prange
from xprep.prep.pack.chunk import chunk_items, epoch_seed, samples_for, samples_for_epochs
from xprep.prep.pack.config import OVERLONG, PackConfig

_POLICY_CODE = {policy: code for code, policy in enumerate(OVERLONG)}  # expand_items': 0 drop, 1 truncate, 2 split
UNDERFULL = 0.99  # multipack pools the items of bins filled below this across groups, and repacks them


# ------------------------------------------------------------------------------------------ kernels
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


@njit(cache=True)
def expand_items(lengths, order, capacity, policy):
    """Items of the documents, visited in ``order`` (empty = identity), under an overlong policy.

    policy 0 drops documents longer than ``capacity``, 1 keeps their first ``capacity`` tokens,
    2 splits them into pieces of ``capacity`` tokens (the last one shorter). Empty documents
    yield no item. Returns (item_doc int64, item_start int32, item_len int32).
    """
    shuffled = len(order) > 0
    visit = lengths[order] if shuffled else lengths  # one random pass, then sequential ones
    count = 0
    for length in visit:
        if length == 0 or (length > capacity and policy == 0):
            continue
        count += (length + capacity - 1) // capacity if (length > capacity and policy == 2) else 1
    item_doc = np.empty(count, np.int64)
    item_start = np.empty(count, np.int32)
    item_len = np.empty(count, np.int32)
    j = 0
    for k in range(len(visit)):
        length = visit[k]
        if length == 0 or (length > capacity and policy == 0):
            continue
        pieces = (length + capacity - 1) // capacity if (length > capacity and policy == 2) else 1
        for p in range(pieces):
            item_doc[j] = order[k] if shuffled else k
            item_start[j] = p * capacity
            item_len[j] = min(capacity, length - p * capacity)
            j += 1
    return item_doc, item_start, item_len


@njit(cache=True, parallel=True)
def item_targets(mask, doc_offsets, doc_lengths, item_doc, item_start, item_len, lookahead):
    """The target tokens of each item: what the trainer will learn from it (int64 per item).

    An item is tokens ``item_start … item_start + item_len`` of its document; its row predicts each token from
    the one before, so its first token is never a target, and token ``t`` of the rest is one where ``mask`` (the
    flat loss-mask stream, ``doc_offsets[d]`` where document ``d`` starts in it) is non-zero; an empty ``mask``
    (no loss-mask stream) makes every such token a target. ``lookahead`` (``--method chunk``): an item that stops
    inside its document also learns the token after it.
    """
    n = len(item_doc)
    out = np.empty(n, np.int64)
    masked = len(mask) > 0
    for i in prange(n):
        d, start, length = item_doc[i], np.int64(item_start[i]), np.int64(item_len[i])
        stop = start + length
        if lookahead and stop < doc_lengths[d]:
            stop += 1
        if not masked:
            out[i] = max(stop - start - 1, 0)
            continue
        base, s = doc_offsets[d], 0
        for t in range(start + 1, stop):
            s += mask[base + t] != 0
        out[i] = s
    return out


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


@njit(cache=True, parallel=True)
def take_items(items, item_doc, item_start, item_len):
    """The three item arrays reordered by ``items`` (a parallel gather)."""
    doc = np.empty(len(items), item_doc.dtype)
    start = np.empty(len(items), item_start.dtype)
    length = np.empty(len(items), item_len.dtype)
    for k in prange(len(items)):
        i = items[k]
        doc[k] = item_doc[i]
        start[k] = item_start[i]
        length[k] = item_len[i]
    return doc, start, length


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
def largest_differencing(weights, k):
    """Karmarkar–Karp largest differencing into ``k`` sets of equal count (len(weights) % k == 0).

    Start: items in decreasing weight, each run of k items is a partial partition with one item
    per set. Repeatedly merge the two partitions with the largest spread (max − min set sum; ties
    to the lower index), pairing the heaviest set of one with the lightest of the other. Returns
    the set (0..k-1) of each item; set 0 is the heaviest.
    """
    n = len(weights)
    n_states = n // k
    order = np.argsort(-weights, kind="mergesort")
    state_of = np.empty(n, np.int64)
    slot_of = np.empty(n, np.int64)
    sums = np.zeros((n_states, k), np.int64)
    for pos in range(n):
        i = order[pos]
        state_of[i] = pos // k
        slot_of[i] = pos % k
        sums[pos // k, pos % k] = weights[i]
    alive = np.ones(n_states, np.bool_)
    for _ in range(n_states - 1):
        a, b = _two_widest(sums, alive)
        merged = sums[a] + sums[b][::-1]
        rank = np.argsort(-merged, kind="mergesort")
        new_slot = np.empty(k, np.int64)
        for r in range(k):
            new_slot[rank[r]] = r
        for i in range(n):
            if state_of[i] == b:
                state_of[i] = a
                slot_of[i] = k - 1 - slot_of[i]
            if state_of[i] == a:
                slot_of[i] = new_slot[slot_of[i]]
        sums[a] = merged[rank]
        alive[b] = False
    return slot_of


@njit(cache=True)
def _two_widest(sums, alive):
    """The two live partitions with the largest spread, widest first (ties: lower index)."""
    best, second = -1, -1
    for s in range(len(sums)):
        if not alive[s]:
            continue
        spread = sums[s, 0] - sums[s, -1]
        if best < 0 or spread > sums[best, 0] - sums[best, -1]:
            best, second = s, best
        elif second < 0 or spread > sums[second, 0] - sums[second, -1]:
            second = s
    return best, second


@njit(cache=True, parallel=True)
def balance_dp_steps(workloads, n_ranks, per_rank):
    """Arrange bins into data-parallel steps with balanced Σ workload per rank and per micro-step.

    ``len(workloads)`` is a multiple of ``n_ranks``. Step s holds bins
    ``[s·S, s·S + S)`` with ``S = n_ranks·per_rank`` (the last step may hold fewer, still a
    multiple of n_ranks). Inside a step the bins, heaviest first, form micro-steps of
    ``n_ranks`` consecutive bins (similar workloads side by side), and ``largest_differencing``
    assigns them to ranks so that every rank's total over the step is balanced; it keeps one bin
    of each micro-step per rank. Layout: position ``j·n_ranks + r`` of a step is rank r's bin of
    micro-step j. Returns ``perm``: new position → bin.
    """
    n = len(workloads)
    step = n_ranks * per_rank
    n_steps = (n + step - 1) // step
    perm = np.empty(n, np.int64)
    for s in prange(n_steps):
        lo = s * step
        hi = min(n, lo + step)
        w = workloads[lo:hi]
        rank_of = largest_differencing(w, n_ranks)
        order = np.argsort(-w, kind="mergesort")  # the same order largest_differencing starts from
        for pos in range(len(order)):
            i = order[pos]
            perm[lo + (pos // n_ranks) * n_ranks + rank_of[i]] = lo + i
    return perm


@njit(cache=True)
def step_imbalance(workloads, n_ranks, per_rank):
    """max/mean of the per-rank Σ workload in each step (bin b of a step goes to rank b % n_ranks)."""
    n = len(workloads)
    step = n_ranks * per_rank
    n_steps = (n + step - 1) // step
    out = np.ones(n_steps, np.float64)
    loads = np.zeros(n_ranks, np.float64)
    for s in range(n_steps):
        loads[:] = 0.0
        for i in range(s * step, min(n, s * step + step)):
            loads[(i - s * step) % n_ranks] += workloads[i]
        mean = loads.mean()
        if mean > 0:
            out[s] = loads.max() / mean
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


@njit(cache=True)
def range_bincount(values, starts, ends, size):
    """Occurrences of each value 0..size-1 in ``values[starts[k]:ends[k]]`` over all k (int64)."""
    out = np.zeros(size, np.int64)
    for k in range(len(starts)):
        for t in range(starts[k], ends[k]):
            out[values[t]] += 1
    return out


# ----------------------------------------------------------------------------------------- pipeline
Targets = Callable[[np.ndarray, np.ndarray, np.ndarray, bool], np.ndarray]
"""(item_doc, item_start, item_len, lookahead) → the target tokens of each item (``item_targets`` over the data)."""


def unmasked_targets(lengths: np.ndarray) -> Targets:
    """``Targets`` of documents with no loss-mask stream: every token of an item but its first."""
    lengths = np.ascontiguousarray(lengths, np.int64)

    def targets(item_doc, item_start, item_len, lookahead=False):
        return item_targets(_NO_MASK, _NO_OFFSETS, lengths, item_doc, item_start, item_len, lookahead)

    return targets


_NO_MASK, _NO_OFFSETS = np.zeros(0, np.uint8), np.zeros(0, np.int64)


@dataclass
class Packed:
    """The result of packing: CSR bins over items, each bin's target tokens, plus statistics (JSON-able)."""

    bin_offsets: np.ndarray
    item_doc: np.ndarray
    item_start: np.ndarray
    item_len: np.ndarray
    stats: dict
    bin_targets: np.ndarray  # int32[n_bins]: tokens the trainer learns in each bin (never 0)


def pack_lengths(lengths: np.ndarray, config: PackConfig, docs: np.ndarray | None = None,
                 targets: Targets | None = None) -> Packed:
    """Pack documents of the given lengths (global index order) according to ``config``.

    ``docs``: the global ids of the documents to pack (a ``--split`` part), in order; None packs them all.
    Stats then count those documents only. ``targets`` counts each item's target tokens from the loss masks
    (default: ``unmasked_targets``): an item with none (a piece of a long user turn, a 1-token document) is
    dropped and counted, so no bin without a target is ever made.
    """
    lengths = np.ascontiguousarray(lengths, np.int32)
    targets = targets or unmasked_targets(lengths)
    if docs is not None:
        docs = np.asarray(docs, np.int64)
        packed = pack_lengths(lengths[docs], config, targets=lambda d, *rest: targets(docs[d], *rest))
        packed.item_doc = docs[packed.item_doc]
        return packed
    if config.method == "chunk":
        return pack_chunks(lengths, config, targets)
    order = document_order(len(lengths), config)
    arrays = expand_items(lengths, order, config.capacity, _POLICY_CODE[config.overlong])  # doc, start, len
    stats = overlong_stats(lengths, config.capacity, config.overlong)
    learned = targets(*arrays, False)
    arrays, learned, stats["no_target"] = drop_untrained(arrays, learned)
    costs = item_costs(arrays[2], config.align)
    offsets, items = bin_items(costs, config)
    if items is not None:
        arrays, learned = take_items(items, *arrays), learned[items]
    if config.balance_dp:
        offsets, items, stats["dp_balance"] = balance_bins(offsets, arrays[2], config)
        arrays, learned = take_items(items, *arrays), learned[items]
    item_doc, item_start, item_len = arrays
    stats.update(bin_stats(offsets, item_len, int(costs.sum(dtype=np.int64)), config.capacity))
    bin_targets = bin_sums(offsets, learned, False).astype(np.int32)
    stats["target_tokens"] = int(bin_targets.sum(dtype=np.int64))
    return Packed(offsets, item_doc, item_start, item_len, stats, bin_targets)


def drop_untrained(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], learned: np.ndarray
                   ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray, dict]:
    """The items with at least one target token, and what was dropped: pieces, their tokens, and the documents
    left with no item at all (e.g. a pasted user turn split into pieces before the one holding the answer)."""
    keep = learned > 0
    item_doc, _, item_len = arrays
    gone = ~keep
    if not gone.any():
        return arrays, learned, {"pieces": 0, "tokens": 0, "documents": 0}
    kept_doc = np.zeros(int(item_doc.max()) + 1, np.bool_)
    kept_doc[item_doc[keep]] = True  # linear: no sort of every item
    lost = np.unique(item_doc[gone])
    stats = {"pieces": int(gone.sum()), "tokens": int(item_len[gone].sum(dtype=np.int64)),
             "documents": int(np.count_nonzero(~kept_doc[lost]))}
    return tuple(a[keep] for a in arrays), learned[keep], stats


def pack_chunks(lengths: np.ndarray, config: PackConfig, targets: Targets) -> Packed:
    """``--method chunk`` (prep/pack/chunk.py): the non-empty documents, epoch after epoch, cut into samples.

    Bin k is sample k. Stats have the keys of the other methods (no document is overlong: the stream cuts
    them) plus ``samples``, ``epochs`` (begun) and ``epoch_tokens``. A sample with no target token (only
    possible with loss masks: one inside a long prompt) is dropped and counted in ``no_target``.
    """
    nonempty = np.flatnonzero(lengths)
    sizes = lengths[nonempty].astype(np.int64)
    epoch_tokens, seq_len = int(sizes.sum()), config.seq_len
    if config.epochs is not None:
        samples, epochs = samples_for_epochs(config.epochs, epoch_tokens, seq_len)
    else:
        samples, epochs = samples_for(config.total_tokens, epoch_tokens, seq_len)
    order = chunk_order(len(sizes), epochs, config)
    offsets, pos, start, length = chunk_items(sizes[order], seq_len, samples)
    item_doc = nonempty[order[pos]]
    item_len = length.astype(np.int32)
    item_start = start.astype(np.int32)
    bin_targets = bin_sums(offsets, targets(item_doc, item_start, item_len, True), False)
    stats = overlong_stats(lengths, np.iinfo(np.int64).max, config.overlong)  # counts the empty ones
    stats["no_target"] = {"pieces": 0, "tokens": 0, "documents": 0, "samples": int(np.sum(bin_targets == 0))}
    if stats["no_target"]["samples"]:
        kept = np.flatnonzero(bin_targets)
        stats["no_target"]["tokens"] = int(seq_len) * (len(bin_targets) - len(kept))
        offsets, items = gather_bins(offsets, kept)
        item_doc, item_start, item_len = take_items(items, item_doc, item_start, item_len)
        bin_targets = bin_targets[kept]
    stats.update({"samples": len(bin_targets), "epochs": epochs, "epoch_tokens": epoch_tokens})
    stats.update(bin_stats(offsets, item_len, int(item_len.sum(dtype=np.int64)), seq_len))
    stats["target_tokens"] = int(bin_targets.sum(dtype=np.int64))
    return Packed(offsets, item_doc, item_start, item_len, stats, bin_targets.astype(np.int32))


def chunk_order(n_docs: int, epochs: int, config: PackConfig) -> np.ndarray:
    """Positions 0..n_docs-1 visited epoch after epoch: in order, or epoch e permuted with ``epoch_seed(seed, e)``."""
    if not config.shuffle:
        return np.tile(np.arange(n_docs, dtype=np.int64), epochs)
    parts = [shuffled_order(n_docs, epoch_seed(config.seed, e)) for e in range(epochs)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def document_order(n_docs: int, config: PackConfig) -> np.ndarray:
    """The visiting order of documents: a seeded permutation, or empty (= identity)."""
    if not config.shuffle:
        return np.zeros(0, np.int64)
    return shuffled_order(n_docs, config.seed)


def item_costs(item_len: np.ndarray, align: int) -> np.ndarray:
    if align == 1:
        return item_len
    return ((item_len + (align - 1)) // align * align).astype(np.int32)


def bin_items(costs: np.ndarray, config: PackConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """CSR offsets and the item order (None when items stay in order) for the configured method."""
    if config.method != "multipack":
        return next_fit(costs, config.capacity), None
    offsets, items, load = grouped_ffd(costs, config.capacity, config.group_size)
    return repack_underfull(costs, offsets, items, load, config.capacity, math.ceil(UNDERFULL * config.capacity))


def balance_bins(offsets: np.ndarray, item_len: np.ndarray, config: PackConfig
                 ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Pad to a multiple of balance_dp with empty bins, then balance Σlen² over the ranks.

    Returns the new CSR offsets, the item order, and the max/mean imbalance before and after,
    per step (each rank's total over its bins of the step) and per micro-step (one bin a rank).
    """
    n_ranks, per_rank = config.balance_dp, config.dp_micro_batches
    work = bin_sums(offsets, item_len, True)
    pad = -len(work) % n_ranks
    work = np.concatenate([work, np.zeros(pad, np.int64)])
    perm = balance_dp_steps(work, n_ranks, per_rank)
    stats = {"ranks": n_ranks, "micro_batches_per_rank": per_rank,
             "steps": -(-len(work) // (n_ranks * per_rank)), "empty_bins_added": pad}
    for name, arranged in (("before", work), ("after", work[perm])):
        stats[f"imbalance_{name}"] = _imbalance_summary(step_imbalance(arranged, n_ranks, per_rank))
        stats[f"micro_step_imbalance_{name}"] = _imbalance_summary(step_imbalance(arranged, n_ranks, 1))
    perm[perm >= len(offsets) - 1] = -1
    new_offsets, items = gather_bins(offsets, perm)
    return new_offsets, items, stats


def _imbalance_summary(per_step: np.ndarray) -> dict:
    if len(per_step) == 0:
        return {"mean": 1.0, "max": 1.0}
    return {"mean": round(float(per_step.mean()), 6), "max": round(float(per_step.max()), 6)}


def overlong_stats(lengths: np.ndarray, capacity: int, overlong: str) -> dict:
    """Documents and tokens in, and what the overlong policy did to documents over capacity."""
    lengths64 = lengths.astype(np.int64, copy=False)
    over = lengths64[lengths64 > capacity]
    docs, toks = int(len(over)), int(over.sum())
    return {
        "documents_in": int(len(lengths)),
        "tokens_in": int(lengths64.sum()),
        "empty_documents": int(np.count_nonzero(lengths == 0)),
        "overlong_documents": docs,
        "dropped_documents": docs if overlong == "drop" else 0,
        "dropped_tokens": toks if overlong == "drop" else 0,
        "truncated_documents": docs if overlong == "truncate" else 0,
        "truncated_tokens": int((over - capacity).sum()) if overlong == "truncate" else 0,
        "split_documents": docs if overlong == "split" else 0,
        "split_pieces": int(((over + capacity - 1) // capacity).sum()) if overlong == "split" else 0,
    }


def bin_stats(offsets: np.ndarray, item_len: np.ndarray, cost_tokens: int, capacity: int) -> dict:
    """Bins, tokens kept, fill efficiency and the gap to the lower bound ⌈tokens/capacity⌉."""
    n_bins = len(offsets) - 1
    tokens = int(item_len.sum(dtype=np.int64))
    lower = -(-tokens // capacity)
    return {
        "bins": n_bins,
        "items": int(len(item_len)),
        "tokens": tokens,
        "cost_tokens": cost_tokens,
        "padding_tokens": n_bins * capacity - tokens,
        "fill": tokens / (n_bins * capacity) if n_bins else 0.0,
        "lower_bound_bins": lower,
        "gap_to_lower_bound": (n_bins - lower) / lower if lower else 0.0,
    }

