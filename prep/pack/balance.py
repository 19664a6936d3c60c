"""``--balance-dp``: bins arranged into data-parallel steps whose ranks carry about the same attention work.

A bin's workload is Σ len² over its documents. ``balance_bins`` pads the bins to a multiple of the ranks with
empty ones, then ``balance_dp_steps`` arranges each step (``per_rank`` bins a rank) by Karmarkar–Karp largest
differencing, so that every rank's total over the step, and every micro-step, is balanced; ``step_imbalance``
measures max/mean per step before and after, which pack.json keeps.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from xprep.prep.pack.bins import bin_sums, gather_bins


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


def balance_bins(offsets: np.ndarray, item_len: np.ndarray, n_ranks: int, per_rank: int
                 ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Pad to a multiple of ``n_ranks`` with empty bins, then balance Σlen² over the ranks, ``per_rank`` bins a
    rank per step.

    Returns the new CSR offsets, the item order, and the max/mean imbalance before and after,
    per step (each rank's total over its bins of the step) and per micro-step (one bin a rank).
    """
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

