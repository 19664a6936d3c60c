"""xprep.prep.pack.blend: the greedy blend index (Megatron's rule, weights in tokens), epochs of repeated sources."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xprep.prep.pack import blend
from xprep.prep.pack.blend import blend_bins, epoch_orders, epoch_seed, epochs_needed, later_epochs
from xprep.prep.pack.shuffle import shuffled_order


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


def test_repeated_sources_are_reshuffled_each_epoch_and_cut_ones_take_the_head_of_their_order():
    b = blend_bins(fixed(5, 1000), np.array([0.5, 0.5]), unit=8, total_tokens=8 * 40, seed=11)
    small = b.bin_index[b.bin_source == 0]
    assert len(small) == 20 and b.epochs.tolist() == [4, 1]
    epochs = small.reshape(4, 5)
    assert epochs[0].tolist() == [0, 1, 2, 3, 4]  # the pack's own order first
    assert all(sorted(e) == [0, 1, 2, 3, 4] for e in epochs)  # every epoch takes every bin once
    assert len({tuple(e) for e in epochs[1:]}) > 1  # later epochs in fresh orders
    assert b.bin_index[b.bin_source == 1].tolist() == list(range(20))  # the big source: the head of its order
    other = blend_bins(fixed(5, 1000), np.array([0.5, 0.5]), unit=8, total_tokens=8 * 40, seed=12)
    assert not np.array_equal(other.bin_index, b.bin_index)  # the seed changes the repeated epochs
    order = np.random.default_rng(0).permutation(1000)
    drawn = blend_bins(fixed(5, 1000), np.array([0.5, 0.5]), unit=8, total_tokens=8 * 40, seed=11,
                       orders=[None, order])
    assert drawn.bin_index[drawn.bin_source == 1].tolist() == order[:20].tolist()  # the head of the order given
    assert np.array_equal(drawn.bin_source, b.bin_source)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_cut_source_gives_a_seeded_random_subset_the_same_by_counts_and_by_sizes(seed):
    """``draw_blend`` (prep/pack/mixture.py): sources cut below their bins give a seeded random subset of them. Bins of
    one capacity are relabelled after the blend, bins of their own sizes blended again in the drawn order: with
    every size equal, the two paths must give the same blend, bin for bin."""
    from xprep.prep.pack.mixture import draw_blend

    counts, weights = [50, 4000, 700], np.array([0.2, 0.5, 0.3])
    by_counts = draw_blend(counts, weights, 8, 8 * 2000, seed)
    by_sizes = draw_blend(fixed(*counts), weights, 8, 8 * 2000, seed)
    assert np.array_equal(by_counts.bin_source, by_sizes.bin_source)
    assert np.array_equal(by_counts.bin_index, by_sizes.bin_index)
    big = by_counts.bin_index[by_counts.bin_source == 1]
    assert 0 < len(big) < 4000 and len(set(big.tolist())) == len(big)  # cut, each bin once ...
    assert not np.array_equal(np.sort(big), np.arange(len(big)))  # ... not the head of the pack
    assert abs(np.mean(big) / 4000 - 0.5) < 0.05  # spread over the whole pack
    small = by_counts.bin_index[by_counts.bin_source == 0]
    assert small[:50].tolist() == list(range(50))  # a repeated source keeps the pack's order first
    again = draw_blend(counts, weights, 8, 8 * 2000, seed)
    assert np.array_equal(again.bin_index, by_counts.bin_index)
    other = draw_blend(counts, weights, 8, 8 * 2000, seed + 1)
    assert not np.array_equal(np.sort(other.bin_index[other.bin_source == 1]), np.sort(big))


# ------------------------------------------------------------------------------------ against a plain reference
@pytest.fixture(autouse=True, scope="module")
def one_numba_thread():
    """This thread's kernels on one thread: these blends are small and make thousands of calls to a parallel kernel
    (shuffled_order, the reference's too), each of which waits for numba's other thread, which a busy machine
    schedules late (beside one busy process this file took 225 s, 144 s of CPU spinning, instead of 40 s). A
    permutation does not depend on the thread count (prep/pack/shuffle.py); blend's own worker sets its own."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(threads)


def reference_blend(bin_sizes: list, weights: np.ndarray, unit: int, total_tokens: int, seed: int) -> dict:
    """The greedy rule written out plainly, one bin at a time: every source's lag ``w_i · max(T, C) − t_i`` in
    Python floats (float64, a product then a difference), the first largest wins. Bin counts (all sources given
    as ints) use Megatron's ``w_i · max(n, 1) − c_i`` and stop at the bins holding ``total_tokens``. A source
    gives its bins in its epochs' orders, as many epochs as it takes."""
    w = [float(x) for x in np.asarray(weights, np.float64) / np.sum(weights)]
    k = len(bin_sizes)
    counted = all(isinstance(s, int) for s in bin_sizes)
    count = [s if isinstance(s, int) else len(s) for s in bin_sizes]
    size = [[unit] * s if isinstance(s, int) else [int(x) for x in s] for s in bin_sizes]
    taken, delivered, sources, indices, orders = [0] * k, [0] * k, [], [], {}
    n_bins = -(-total_tokens // unit)
    while (len(sources) < n_bins) if counted else (sum(delivered) < total_tokens):
        scale = float(max(len(sources), 1)) if counted else float(max(sum(delivered), unit))
        lags = [w[i] * scale - float(taken[i] if counted else delivered[i]) for i in range(k)]
        best = lags.index(max(lags))
        epoch = taken[best] // count[best]
        if (best, epoch) not in orders:
            # epoch e of a source: the pack's order, then one seeded permutation per later epoch (each drawn
            # alone: asking epoch_orders for epochs 0..e at every new epoch was quadratic in the epochs)
            orders[best, epoch] = (np.arange(count[best]) if epoch == 0
                                   else shuffled_order(count[best], epoch_seed(seed, best, epoch)))
        b = int(orders[best, epoch][taken[best] % count[best]])
        sources.append(best)
        indices.append(b)
        taken[best] += 1
        delivered[best] += size[best][b]
    return {"bin_source": sources, "bin_index": indices, "bins": taken, "tokens": delivered,
            "epochs": [max(1, -(-t // c)) for t, c in zip(taken, count, strict=True)]}


WEIGHT_KINDS = ["random", "ties", "decimal", "far apart"]


def random_case(rng: np.random.Generator, kind: str) -> tuple[list, np.ndarray, int, int]:
    """Sources (bin counts, bin sizes or a mix), weights of one kind, a unit, and a total of a few hundred bins."""
    k = int(rng.integers(1, 7))
    weights = {"random": lambda: rng.random(k) + 1e-3,
               "ties": lambda: rng.integers(1, 3, k).astype(np.float64),  # equal weights: ties every few bins
               "decimal": lambda: rng.choice([0.1, 0.2, 0.3, 0.7], k),  # products that round onto each other
               "far apart": lambda: 10.0 ** rng.uniform(-4, 0, k)}[kind]()
    unit = int(rng.choice([8, 64]))
    sizes = []
    for _ in range(k):
        n = int(rng.integers(1, 30))  # few bins: the heavier sources repeat many times
        form = rng.integers(3)
        sizes.append(n if form == 0 else np.full(n, unit, np.int64) if form == 1
                     else rng.integers(1, unit + 1, n).astype(rng.choice([np.int32, np.int64])))
    if rng.random() < 0.3:
        sizes = [s if isinstance(s, int) else len(s) for s in sizes]  # bin counts only
    return sizes, weights, unit, unit * int(rng.integers(1, 400))


def assert_random_blends_are_the_reference(rng: np.random.Generator, kind: str, cases: int = 40) -> None:
    for case in range(cases):
        sizes, weights, unit, total = random_case(rng, kind)
        got = blend_bins(sizes, weights, unit, total, seed=case)
        want = reference_blend(sizes, weights, unit, total, seed=case)
        for field, value in want.items():
            assert getattr(got, field).tolist() == value, (case, field)


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_equal_to_a_plain_reference_greedy(kind):
    """Bit for bit, ties included, with token-aware bins, mixed sources and weights 10⁴ apart."""
    assert_random_blends_are_the_reference(np.random.default_rng(WEIGHT_KINDS.index(kind)), kind)


@pytest.fixture
def in_two_parts(monkeypatch) -> list[bool]:
    """Blends of a few hundred bins run in two parts (as 4M-bin ones do); yields, per blend, whether they met."""
    monkeypatch.setattr(blend, "SPLIT_MIN_BINS", 20)
    monkeypatch.setattr(blend, "CHECK_EVERY", 3)
    met, join = [], blend.Ahead.join

    def joined(self, n, arrays, taken, delivered):
        reached = n == self.split
        n = join(self, n, arrays, taken, delivered)
        if reached:
            met.append(self.met)
        return n

    monkeypatch.setattr(blend.Ahead, "join", joined)
    return met


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_a_blend_run_in_two_parts_is_the_greedy_bin_for_bin(kind, in_two_parts):
    """The second part starts from a guess of the state at the split; where the parts meet, the rest is the
    second's, else the first runs on: either way the reference greedy's blend, ties and repeats included."""
    assert_random_blends_are_the_reference(np.random.default_rng(100 + WEIGHT_KINDS.index(kind)), kind)
    assert sum(in_two_parts) >= 10  # the parts met in most blends


def test_parts_that_do_not_meet_leave_the_rest_to_the_first(in_two_parts, monkeypatch):
    """A second part started far from the true state, compared at one point only: the first part runs the rest
    over its bins, and the blend is still the greedy's."""
    shares = blend.Ahead.shares

    def far_off(self):
        taken = shares(self)
        taken[0], taken[1] = taken[0] + taken[1], 0  # every bin of source 1 guessed as source 0's
        return taken

    monkeypatch.setattr(blend.Ahead, "shares", far_off)
    monkeypatch.setattr(blend, "CHECK_POINTS", 1)
    monkeypatch.setattr(blend, "CHECK_EVERY", 1)
    sizes = [np.arange(1, 40) % 7 + 1, np.full(300, 8), np.arange(1, 200) % 5 + 4]
    for seed in range(5):
        got = blend_bins(sizes, np.array([0.5, 0.3, 0.2]), 8, 8 * 600, seed=seed)
        want = reference_blend(sizes, np.array([0.5, 0.3, 0.2]), 8, 8 * 600, seed=seed)
        for field, value in want.items():
            assert getattr(got, field).tolist() == value, (seed, field)
    assert in_two_parts and not any(in_two_parts)


def test_a_source_running_out_resumes_where_it_stopped(monkeypatch):
    """The kernel stops when a source has no prepared bin left and carries on from there: at the end of every
    first epoch (the later ones are prepared beside it), and where too few epochs were planned (more are, then)."""
    planned, prepared = [], []

    def one_epoch_short(weights, tokens, total_tokens, biggest):
        epochs = epochs_needed(weights, tokens, total_tokens, biggest)
        planned.append(epochs)
        return [max(1, e - 1) for e in epochs]

    def counted(counts, epochs, seed, dtype, threads=None):
        prepared.append(list(epochs))
        return later_epochs(counts, epochs, seed, dtype, threads)

    monkeypatch.setattr(blend, "epochs_needed", one_epoch_short)
    monkeypatch.setattr(blend, "later_epochs", counted)
    for sizes in ([7, 50, 3], [np.arange(1, 8), np.full(50, 8), np.array([8, 1, 5])]):
        planned.clear()
        prepared.clear()
        got = blend.blend_bins(sizes, np.array([0.5, 0.3, 0.2]), 8, 8 * 120, seed=5)
        want = reference_blend(sizes, np.array([0.5, 0.3, 0.2]), 8, 8 * 120, seed=5)
        assert len(planned) == 1 and max(planned[0]) > 1
        assert len(prepared) == 2 and prepared[1] != prepared[0]  # ran out of the epochs planned: more, then
        for field, value in want.items():
            assert getattr(got, field).tolist() == value, field
