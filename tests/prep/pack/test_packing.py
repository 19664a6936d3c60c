"""Packing kernels against slow obvious references, and properties of every method (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xprep.prep.errors import XprepError
from xprep.prep.pack.balance import balance_dp_steps, largest_differencing, step_imbalance
from xprep.prep.pack.bins import (
    bin_sums,
    csr_from_bins,
    first_fit_decreasing,
    gather_bins,
    grouped_ffd,
    next_fit,
    repack_underfull,
)
from xprep.prep.pack.cache import PackConfig
from xprep.prep.pack.kernels import document_order, expand_items, pack_lengths, range_bincount, take_items
from xprep.prep.pack.shuffle import shuffled_order

FAST = settings(max_examples=60, deadline=None)
lengths_st = st.lists(st.integers(0, 300), max_size=120)


# ------------------------------------------------------------------------------- slow references
def ref_expand(lengths, order, capacity, policy):
    items = []
    for d in (order if len(order) else range(len(lengths))):
        n = int(lengths[d])
        if n == 0 or (n > capacity and policy == 0):
            continue
        if n > capacity and policy == 1:
            items.append((d, 0, capacity))
            continue
        start = 0
        while start < n:
            items.append((d, start, min(capacity, n - start)))
            start += capacity
    return items


def ref_next_fit(costs, capacity):
    bins = []
    for i, c in enumerate(costs):
        if bins and sum(costs[j] for j in bins[-1]) + c <= capacity:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def ref_ffd(costs, capacity):
    """First-fit-decreasing by scanning every open bin (O(n·bins))."""
    room, bin_of = [], [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        for b, r in enumerate(room):
            if r >= costs[i]:
                room[b] -= costs[i]
                bin_of[i] = b
                break
        else:
            room.append(capacity - costs[i])
            bin_of[i] = len(room) - 1
    return bin_of


def ref_kk(weights, k):
    """Largest differencing with equal counts, as lists of (sum, members) sorted heaviest first."""
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    states = [[(weights[i], [i]) for i in order[s:s + k]] for s in range(0, len(order), k)]
    alive = list(range(len(states)))
    while len(alive) > 1:
        ranked = sorted(alive, key=lambda s: (-(states[s][0][0] - states[s][-1][0]), s))
        a, b = ranked[0], ranked[1]
        merged = [(states[a][r][0] + states[b][k - 1 - r][0], states[a][r][1] + states[b][k - 1 - r][1])
                  for r in range(k)]
        order_r = sorted(range(k), key=lambda r: (-merged[r][0], r))
        states[a] = [merged[r] for r in order_r]
        alive.remove(b)
    return states[alive[0]]


_M64 = (1 << 64) - 1


def ref_mix(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def ref_below(seed, stream, i, n):
    h = ref_mix((ref_mix((seed * 0x9E3779B97F4A7C15 + stream) & _M64) + i) & _M64)
    return ((h >> 32) * n) >> 32


def ref_shuffle(n, seed):
    """Rao–Sandelius with the same counter-based random numbers, in plain Python."""
    buckets = [[] for _ in range(max(1, n // 8192))]
    for i in range(n):
        buckets[ref_below(seed, 0, i, len(buckets))].append(i)
    out = []
    for b, items in enumerate(buckets):
        for j in range(len(items) - 1, 0, -1):
            k = ref_below(seed, b + 1, j, j + 1)
            items[j], items[k] = items[k], items[j]
        out += items
    return out


# ------------------------------------------------------------------------------ kernel vs reference
@pytest.mark.parametrize("n, seed", [(0, 0), (1, 0), (7, 3), (20_000, 11), (200_003, 5)])  # the last: 3 spans
def test_shuffled_order_matches_reference(n, seed):
    assert shuffled_order(n, seed).tolist() == ref_shuffle(n, seed)


def test_shuffled_order_is_a_uniform_permutation():
    n = 50_000
    p = shuffled_order(n, 5)
    assert np.array_equal(np.sort(p), np.arange(n))
    firsts = np.bincount([shuffled_order(4, seed)[0] for seed in range(4000)], minlength=4)
    assert (np.abs(firsts - 1000) < 150).all()
    # indices of the first half spread evenly over positions (no bucket keeps its order)
    assert abs(np.flatnonzero(p < n // 2).mean() - n / 2) < n * 0.01


@FAST
@given(lengths_st, st.integers(1, 100), st.sampled_from([0, 1, 2]), st.booleans())
def test_expand_items_matches_reference(lengths, capacity, policy, shuffled):
    lengths = np.array(lengths, np.int32)
    order = np.random.default_rng(1).permutation(len(lengths)) if shuffled else np.zeros(0, np.int64)
    doc, start, length = expand_items(lengths, order.astype(np.int64), capacity, policy)
    assert list(zip(doc.tolist(), start.tolist(), length.tolist(), strict=True)) == ref_expand(
        lengths, order, capacity, policy)


@FAST
@given(st.lists(st.integers(1, 64), max_size=200), st.integers(64, 200))
def test_next_fit_matches_reference(costs, capacity):
    offsets = next_fit(np.array(costs, np.int32), capacity)
    got = [list(range(offsets[b], offsets[b + 1])) for b in range(len(offsets) - 1)]
    assert got == ref_next_fit(costs, capacity)


@FAST
@given(st.lists(st.integers(1, 100), max_size=200), st.integers(100, 250))
def test_first_fit_decreasing_matches_reference(costs, capacity):
    assert first_fit_decreasing(np.array(costs, np.int32), capacity).tolist() == ref_ffd(costs, capacity)


def test_first_fit_decreasing_argsort_path_matches_reference():
    """Capacity far above the item count takes the argsort branch instead of the counting sort."""
    costs = np.random.default_rng(0).integers(1, 100_000, 300).astype(np.int32)
    assert first_fit_decreasing(costs, 100_000).tolist() == ref_ffd(costs.tolist(), 100_000)


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=300), st.integers(1, 40))
def test_grouped_ffd_is_ffd_per_group_with_offset_bins(costs, group_size):
    offsets, items, load = grouped_ffd(np.array(costs, np.int32), 60, group_size)
    expected = []
    for lo in range(0, len(costs), group_size):
        local = ref_ffd(costs[lo:lo + group_size], 60)
        expected += [[lo + i for i, b in enumerate(local) if b == k] for k in range(max(local) + 1)]
    assert [items[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)] == expected
    assert load.tolist() == [sum(costs[i] for i in b) for b in expected]


def ref_repack_underfull(costs, bins, capacity, min_load):
    under = [b for b in bins if sum(costs[i] for i in b) < min_load]
    if len(under) < 2:
        return bins
    pool = sorted(i for b in under for i in b)
    local = ref_ffd([costs[i] for i in pool], capacity)
    new = [[pool[k] for k in range(len(pool)) if local[k] == j] for j in range(max(local) + 1)]
    if len(new) >= len(under):
        return bins
    return [b for b in bins if sum(costs[i] for i in b) >= min_load] + new


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=300), st.integers(1, 40), st.integers(30, 60))
def test_repack_underfull_matches_reference(costs, group_size, min_load):
    offsets, items, load = grouped_ffd(np.array(costs, np.int32), 60, group_size)
    bins = [items[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)]
    new_offsets, new_items = repack_underfull(np.array(costs, np.int32), offsets, items, load, 60, min_load)
    got = [new_items[new_offsets[b]:new_offsets[b + 1]].tolist() for b in range(len(new_offsets) - 1)]
    assert got == ref_repack_underfull(costs, bins, 60, min_load)


def test_take_items_gathers():
    items = np.array([2, 0, 1], np.int64)
    doc, start, length = take_items(items, np.array([5, 6, 7]), np.array([0, 1, 2], np.int32),
                                    np.array([9, 8, 7], np.int32))
    assert (doc.tolist(), start.tolist(), length.tolist()) == ([7, 5, 6], [2, 0, 1], [7, 9, 8])


@FAST
@given(st.lists(st.integers(0, 9), max_size=100))
def test_csr_from_bins_groups_items_in_order(bins):
    bin_of = np.array(bins, np.int64)
    offsets, items = csr_from_bins(bin_of, 10)
    for b in range(10):
        assert items[offsets[b]:offsets[b + 1]].tolist() == [i for i, x in enumerate(bins) if x == b]


@FAST
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=12).flatmap(
    lambda w: st.tuples(st.just(w), st.sampled_from([k for k in range(1, len(w) + 1) if len(w) % k == 0]))))
def test_largest_differencing_matches_reference(case):
    weights, k = case
    slot = largest_differencing(np.array(weights, np.int64), k)
    expected = ref_kk(weights, k)
    assert np.bincount(slot, minlength=k).tolist() == [len(weights) // k] * k
    got_sums = [sum(weights[i] for i in range(len(weights)) if slot[i] == r) for r in range(k)]
    assert got_sums == [s for s, _ in expected]
    assert [sorted(np.flatnonzero(slot == r).tolist()) for r in range(k)] == [sorted(m) for _, m in expected]


@FAST
@given(st.lists(st.integers(0, 1000), max_size=60), st.integers(1, 4), st.integers(1, 3))
def test_balance_dp_steps_is_a_per_step_permutation_with_equal_counts(work, n_ranks, per_rank):
    work = np.array(work + [0] * (-len(work) % n_ranks), np.int64)
    perm = balance_dp_steps(work, n_ranks, per_rank)
    step = n_ranks * per_rank
    assert sorted(perm.tolist()) == list(range(len(work)))
    for lo in range(0, len(work), step):
        chunk = perm[lo:lo + step]
        assert set(chunk.tolist()) == set(range(lo, min(len(work), lo + step)))
        ranks = [work[chunk[r::n_ranks]] for r in range(n_ranks)]
        assert len({len(r) for r in ranks}) == 1
        expected = sorted(s for s, _ in ref_kk(work[lo:lo + step].tolist(), n_ranks))
        assert sorted(int(r.sum()) for r in ranks) == expected
        micro_steps = work[chunk].reshape(-1, n_ranks)  # heaviest bins first, side by side
        assert (micro_steps.min(axis=1)[:-1] >= micro_steps.max(axis=1)[1:]).all()


def test_step_imbalance_reference():
    work = np.array([4, 0, 2, 2, 1, 1], np.int64)
    assert step_imbalance(work, 2, 1).tolist() == [2.0, 1.0, 1.0]
    assert step_imbalance(work, 2, 3).tolist() == [7 / 5]


@FAST
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 5))
def test_bin_sums_and_gather_bins(sizes, extra):
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    values = np.arange(int(offsets[-1]), dtype=np.int32)
    sums = bin_sums(offsets, values, True)
    assert sums.tolist() == [int((values[offsets[b]:offsets[b + 1]].astype(np.int64) ** 2).sum())
                             for b in range(len(sizes))]
    perm = np.concatenate([np.random.default_rng(0).permutation(len(sizes)), -np.ones(extra, np.int64)])
    new_offsets, items = gather_bins(offsets, perm.astype(np.int64))
    for b, old in enumerate(perm):
        expected = list(range(offsets[old], offsets[old + 1])) if old >= 0 else []
        assert items[new_offsets[b]:new_offsets[b + 1]].tolist() == expected


@FAST
@given(st.lists(st.integers(0, 20), max_size=20), st.integers(0, 2))
def test_range_bincount_matches_reference(starts_lens, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 4, 200).astype(np.uint8)
    starts = np.array(starts_lens, np.int64) * 5
    ends = starts + np.array(starts_lens, np.int64)
    expected = np.bincount(np.concatenate([values[a:b] for a, b in zip(starts, ends, strict=True)] + [
        np.zeros(0, np.uint8)]), minlength=4)
    assert range_bincount(values, starts, ends, 4).tolist() == expected.tolist()


# ------------------------------------------------------------------------------ method properties
config_st = st.fixed_dictionaries({
    "method": st.sampled_from(["sequential", "multipack", "token-aware"]),
    "capacity": st.sampled_from([8, 16, 64, 96]),
    "cp_size": st.sampled_from([1, 2, 4]),
    "overlong": st.sampled_from(["drop", "truncate", "split"]),
    "shuffle": st.booleans(),
    "seed": st.integers(0, 3),
    "group_size": st.integers(1, 50),
    "balance_dp": st.sampled_from([None, 1, 2, 3]),
    "dp_micro_batches": st.integers(1, 3),
})


def make_config(d: dict) -> PackConfig:
    method = d["method"]
    kw = {"max_tokens": d["capacity"]} if method == "token-aware" else {"seq_len": d["capacity"]}
    if method == "multipack":
        kw["group_size"] = d["group_size"]
    if method == "token-aware" and d["balance_dp"]:
        kw.update(balance_dp=d["balance_dp"], dp_micro_batches=d["dp_micro_batches"])
    return PackConfig(method=method, overlong=d["overlong"], cp_size=d["cp_size"], shuffle=d["shuffle"],
                      seed=d["seed"], **kw)


def kept_prefix(length: int, config: PackConfig) -> int:
    if length <= config.capacity or config.overlong == "split":
        return length
    return config.capacity if config.overlong == "truncate" else 0


def check_tokens_accounted(lengths, config, p):
    """Every token of every kept document is in exactly one bin, but for pieces with no target (one token: the
    first token of a row is never learned); the rest is counted as removed."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for d, s, n in zip(p.item_doc.tolist(), p.item_start.tolist(), p.item_len.tolist(), strict=True):
        assert n > 1
        pieces.setdefault(d, []).append((s, s + n))
    untrained = 0
    for d, length in enumerate(lengths):
        kept = kept_prefix(length, config)
        cuts = list(range(0, kept, config.capacity)) + [kept]
        want = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b - a > 1]
        untrained += sum(b - a for a, b in zip(cuts, cuts[1:], strict=False) if b - a == 1)
        assert sorted(pieces.get(d, [])) == want  # contiguous, no overlap, only the untrained pieces left out
    s = p.stats
    assert s["no_target"]["tokens"] == untrained
    assert s["tokens"] + s["dropped_tokens"] + s["truncated_tokens"] + untrained == sum(lengths)
    assert s["tokens"] == int(p.item_len.sum())
    assert s["target_tokens"] == int(p.item_len.sum()) - len(p.item_len) == int(p.bin_targets.sum())
    assert len(p.bin_targets) == s["bins"] and (p.bin_targets[np.diff(p.bin_offsets) > 0] > 0).all()


def check_capacity(config, p):
    costs = -(-p.item_len.astype(np.int64) // config.align) * config.align
    for b in range(len(p.bin_offsets) - 1):
        sl = slice(p.bin_offsets[b], p.bin_offsets[b + 1])
        assert costs[sl].sum() <= config.capacity
        assert p.item_len[sl].sum() <= config.capacity  # token-aware: never over max_tokens


def visiting_rank(n_docs: int, config: PackConfig) -> np.ndarray:
    order = document_order(n_docs, config)
    rank = np.empty(n_docs, np.int64)
    rank[order if len(order) else np.arange(n_docs)] = np.arange(n_docs)
    return rank


def check_order(lengths, config, p):
    """sequential/token-aware: items follow the visiting order, within bins (and across bins
    unless DP balancing rearranged whole bins)."""
    if config.method == "multipack":
        return
    key = visiting_rank(len(lengths), config)[p.item_doc] * 10**6 + p.item_start
    if not config.balance_dp:
        assert (np.diff(key) > 0).all()
        return
    for b in range(len(p.bin_offsets) - 1):
        assert (np.diff(key[p.bin_offsets[b]:p.bin_offsets[b + 1]]) > 0).all()


def check_dp_layout(config, p, unbalanced):
    """Balanced token-aware: same bins as without balancing, reordered, padded with empty bins."""
    n = config.balance_dp
    assert (len(p.bin_offsets) - 1) % n == 0
    def bins(q):
        return sorted(tuple(zip(q.item_doc[q.bin_offsets[b]:q.bin_offsets[b + 1]].tolist(),
                                q.item_start[q.bin_offsets[b]:q.bin_offsets[b + 1]].tolist(), strict=True))
                      for b in range(len(q.bin_offsets) - 1))
    padded = bins(unbalanced) + [()] * p.stats["dp_balance"]["empty_bins_added"]
    assert bins(p) == sorted(padded)


@settings(max_examples=150, deadline=None)
@given(lengths_st, config_st)
def test_every_method_packs_every_token_once_within_capacity(lengths, d):
    config = make_config(d)
    lengths_arr = np.array(lengths, np.int32)
    p = pack_lengths(lengths_arr, config)
    offsets = p.bin_offsets
    assert offsets[0] == 0 and offsets[-1] == len(p.item_doc) and (np.diff(offsets) >= 0).all()
    check_tokens_accounted(lengths, config, p)
    check_capacity(config, p)
    check_order(lengths, config, p)
    if config.balance_dp:
        unbalanced = pack_lengths(lengths_arr, make_config({**d, "balance_dp": None}))
        check_dp_layout(config, p, unbalanced)
    else:
        assert (np.diff(offsets) > 0).all()  # no empty bins unless DP padding
    again = pack_lengths(lengths_arr, config)
    for name in ("bin_offsets", "item_doc", "item_start", "item_len"):
        assert np.array_equal(getattr(p, name), getattr(again, name))  # deterministic for a seed


def test_shuffle_permutes_and_seed_matters():
    lengths = np.arange(1, 200, dtype=np.int32)
    a = pack_lengths(lengths, PackConfig(method="token-aware", max_tokens=256, seed=1))
    b = pack_lengths(lengths, PackConfig(method="token-aware", max_tokens=256, seed=2))
    plain = pack_lengths(lengths, PackConfig(method="token-aware", max_tokens=256, shuffle=False))
    assert not np.array_equal(a.item_doc, b.item_doc)
    assert np.array_equal(plain.item_doc, np.arange(1, 199))  # document 0 is one token: nothing to learn, dropped
    assert plain.stats["no_target"] == {"pieces": 1, "tokens": 1, "documents": 1}


def test_overlong_counts():
    lengths = np.array([5, 20, 0, 33, 10], np.int32)
    split = pack_lengths(lengths, PackConfig(method="sequential", seq_len=10)).stats  # default: split
    assert (split["split_documents"], split["split_pieces"], split["dropped_documents"]) == (2, 6, 0)
    drop = pack_lengths(lengths, PackConfig(method="multipack", seq_len=10)).stats  # default: drop
    assert (drop["dropped_documents"], drop["dropped_tokens"], drop["tokens"]) == (2, 53, 15)
    cut = pack_lengths(lengths, PackConfig(method="multipack", seq_len=10, overlong="truncate")).stats
    assert (cut["truncated_documents"], cut["truncated_tokens"], cut["tokens"]) == (2, 33, 35)
    assert drop["empty_documents"] == 1


def test_dp_balancing_reduces_imbalance_on_skewed_lengths():
    lengths = np.random.default_rng(0).lognormal(5, 1.2, 20_000).astype(np.int32).clip(1, 4096)
    s = pack_lengths(lengths, PackConfig(method="token-aware", max_tokens=4096, balance_dp=4)).stats
    b = s["dp_balance"]
    assert b["imbalance_after"]["mean"] < b["imbalance_before"]["mean"]
    assert b["imbalance_after"]["max"] <= b["imbalance_before"]["max"]
    assert b["micro_step_imbalance_after"]["mean"] < b["micro_step_imbalance_before"]["mean"]


def test_multipack_is_near_the_lower_bound_on_lognormal_lengths():
    lengths = np.random.default_rng(0).lognormal(6, 1.0, 50_000).astype(np.int32).clip(1, 8192)
    grouped = pack_lengths(lengths, PackConfig(method="multipack", seq_len=8192, group_size=10_000)).stats
    assert grouped["gap_to_lower_bound"] < 0.002


@pytest.mark.parametrize("kwargs, needle", [
    ({"method": "nope", "seq_len": 8}, "--method 'nope'"),
    ({"method": "multipack"}, "needs --seq-len"),
    ({"method": "token-aware", "seq_len": 8}, "--seq-len does not apply"),
    ({"method": "sequential", "seq_len": 102, "cp_size": 2}, "--seq-len 102 is not a multiple of 2·cp=4"),
    ({"method": "sequential", "seq_len": 0}, "positive"),
    ({"method": "sequential", "seq_len": 8, "group_size": 3}, "--group-size applies only"),
    ({"method": "multipack", "seq_len": 8, "balance_dp": 2}, "--balance-dp applies only"),
    ({"method": "token-aware", "max_tokens": 8, "balance_dp": 0}, "--balance-dp 0"),
    ({"method": "token-aware", "max_tokens": 8, "dp_micro_batches": 2}, "needs --balance-dp"),
    ({"method": "sequential", "seq_len": 8, "overlong": "fold"}, "--overlong 'fold'"),
])
def test_config_errors_name_option_value_and_fix(kwargs, needle):
    with pytest.raises(XprepError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        PackConfig(**kwargs)


def test_key_covers_exactly_what_changes_the_output():
    base = PackConfig(method="sequential", seq_len=64)
    assert base.key_fields() == PackConfig(method="sequential", seq_len=64, seed=7).key_fields()  # no shuffle
    assert base.key_fields() != PackConfig(method="sequential", seq_len=64, cp_size=2).key_fields()
    shuffled = PackConfig(method="sequential", seq_len=64, shuffle=True)
    reseeded = PackConfig(method="sequential", seq_len=64, shuffle=True, seed=1)
    assert shuffled.key_fields() != reseeded.key_fields()
