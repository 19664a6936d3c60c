"""prep.blend: the greedy blend index (Megatron's rule, weights in tokens), epochs of repeated sources."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.blend import blend_bins, epoch_orders


def fixed(*counts: int, capacity: int = 8) -> list[np.ndarray]:
    return [np.full(n, capacity, np.int64) for n in counts]


def test_hand_checked_megatron_order():
    """Weights .5/.3/.2, ten bins of equal size: the order worked out by hand from w·max(n,1) − c."""
    b = blend_bins(fixed(100, 100, 100), np.array([0.5, 0.3, 0.2]), unit=8, total_tokens=80, seed=0)
    assert b.bin_source.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert b.bin_index.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]  # each source in its own order
    assert b.bins.tolist() == [5, 3, 2] and b.tokens.tolist() == [40, 24, 16] and b.epochs.tolist() == [1, 1, 1]


def test_equal_to_megatron_build_blending_indices():
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp", reason="megatron-core (test extra)")
    rng = np.random.default_rng(7)
    for k in (2, 3, 5, 10):
        weights = rng.random(k) ** 3 + 1e-3
        weights /= weights.sum()
        size = 5000
        want_source, want_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(want_source, want_index, weights, k, size, False)
        for sizes in ([size] * k, fixed(*([size] * k), capacity=16)):  # bin counts (fast path), or sizes
            got = blend_bins(sizes, weights, unit=16, total_tokens=16 * size, seed=0)
            assert np.array_equal(got.bin_source, want_source), k
            assert np.array_equal(got.bin_index, want_index), k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=8), st.lists(st.integers(1, 40), min_size=8, max_size=8),
       st.integers(1, 400), st.integers(0, 2**32))
def test_no_source_runs_ahead_of_its_weight(weights, counts, total_bins, seed):
    """After every prefix: no source more than one bin ahead of its share; with two sources, none behind by one."""
    k = len(weights)
    w = np.array(weights) / np.sum(weights)
    b = blend_bins(fixed(*counts[:k]), w, unit=8, total_tokens=8 * total_bins, seed=seed)
    assert len(b.bin_source) == total_bins and b.bins.sum() == total_bins
    onehot = np.zeros((total_bins, k))
    onehot[np.arange(total_bins), b.bin_source] = 1
    ahead = np.cumsum(onehot, axis=0) - np.outer(np.arange(1, total_bins + 1), w)
    assert ahead.max() < 1 + 1e-9
    if k == 2:
        assert ahead.min() > -1 - 1e-9
    # every source's bins follow its epoch orders: the first epoch in pack order, later ones permuted
    for i in range(k):
        mine = b.bin_index[b.bin_source == i]
        assert np.array_equal(mine, epoch_orders(counts[i], int(b.epochs[i]), seed, i)[: len(mine)])
    again = blend_bins(fixed(*counts[:k]), w, unit=8, total_tokens=8 * total_bins, seed=seed)
    assert np.array_equal(again.bin_source, b.bin_source) and np.array_equal(again.bin_index, b.bin_index)
    counted = blend_bins(counts[:k], w, unit=8, total_tokens=8 * total_bins, seed=seed)  # the bin-count path
    assert np.array_equal(counted.bin_source, b.bin_source) and np.array_equal(counted.bin_index, b.bin_index)
    assert counted.bins.tolist() == b.bins.tolist() and counted.tokens.tolist() == b.tokens.tolist()
    assert counted.epochs.tolist() == b.epochs.tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=30), min_size=1, max_size=5),
       st.integers(1, 3000))
def test_token_weights_with_variable_bins(sizes, total_tokens):
    """Token-aware bins count their tokens: a source is never a whole capacity ahead of its share of tokens."""
    k = len(sizes)
    w = np.arange(1, k + 1, dtype=np.float64)
    w /= w.sum()
    bins = [np.array(s, np.int64) for s in sizes]
    b = blend_bins(bins, w, unit=64, total_tokens=total_tokens, seed=3)
    got = np.array([bins[s][i] for s, i in zip(b.bin_source, b.bin_index, strict=True)])
    assert got.sum() >= total_tokens and got.sum() - got[-1] < total_tokens  # stops once enough is delivered
    tokens = np.zeros((len(got), k))
    tokens[np.arange(len(got)), b.bin_source] = got
    ahead = np.cumsum(tokens, axis=0) - np.outer(np.cumsum(got), w)
    assert ahead.max() < 64 + 1e-9
    assert b.tokens.tolist() == [int(tokens[:, i].sum()) for i in range(k)]


def test_repeated_sources_are_reshuffled_each_epoch_and_cut_ones_take_a_prefix():
    b = blend_bins(fixed(5, 1000), np.array([0.5, 0.5]), unit=8, total_tokens=8 * 40, seed=11)
    small = b.bin_index[b.bin_source == 0]
    assert len(small) == 20 and b.epochs.tolist() == [4, 1]
    epochs = small.reshape(4, 5)
    assert epochs[0].tolist() == [0, 1, 2, 3, 4]  # the pack's own order first
    assert all(sorted(e) == [0, 1, 2, 3, 4] for e in epochs)  # every epoch takes every bin once
    assert len({tuple(e) for e in epochs[1:]}) > 1  # later epochs in fresh orders
    assert b.bin_index[b.bin_source == 1].tolist() == list(range(20))  # the big source: a prefix, in order
    other = blend_bins(fixed(5, 1000), np.array([0.5, 0.5]), unit=8, total_tokens=8 * 40, seed=12)
    assert not np.array_equal(other.bin_index, b.bin_index)  # the seed changes the repeated epochs
