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

The rule is evaluated exactly as Megatron evaluates it: in float64, one product and one difference per
source (``fl(fl(w_i · scale) − t_i)``, never fused), compared with ``>`` over the sources in index order.
Every count and token total is an integer below 2**53, exact as a float64, so the choices depend on nothing
but the weights and the bins taken so far: the kernel may keep its state however it likes (and resume from
it) as long as it evaluates that expression. There is no shortcut through per-source schedules: merging
"bin c of source i is due at step (c + a) / w_i" parts from the rule within a few bins for a = 0, ½ or 1
(weights decide which lag is largest, not only when a source is due), so every bin takes an argmax.

A source asked for more bins than it has is repeated epoch after epoch: its first epoch in the pack's own
order, each later one in a fresh permutation seeded by (seed, source, epoch). A source asked for less is cut to
a seeded random subset of its bins, never a prefix of its packing (multipack orders bins longest first): the
caller relabels its bins by a permutation (``orders``) and the blend takes the first ones of that order.
A long blend is computed in two parts at once, on two cores, and is the same bin for bin (``Ahead``).

A phased blend (``phased_blend``, at the end of this file) is one blend per phase, end to end, each source going on
in its own stream of bins where the previous phase left it.

The steps: ``blend_bins`` prepares the sources once (``BlendRun``: their bins, shares, and the output the kernel
writes), and ``run_in_parts`` runs the kernel over it, the later epochs of repeated sources prepared beside the
first part (``run_beside_later_epochs``) and a long blend's second part started ahead (``start_ahead``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit
from xprep.prep.pack.shuffle import shuffled_order

MAX_SOURCES = 32_767  # sources are stored as int16, as Megatron stores its dataset index
SPLIT_MIN_BINS = 4_000_000  # a blend of fewer bins runs in one part (see ``Ahead``)
CHECK_EVERY = 1024  # bins between the states the two parts compare
CHECK_POINTS = 1024  # states compared at most: where the parts have not met by then, the first runs the rest
CHECK_STATES = 1 << 22  # ... and no more than this many counts in all (32 MiB: fewer points for many sources)


@dataclass
class Blend:
    """Bin ``j`` of the mixture is bin ``bin_index[j]`` of source ``bin_source[j]``."""

    bin_source: np.ndarray  # int16[n]
    bin_index: np.ndarray  # int32 (int64 for sources of ≥ 2**31 bins)[n]
    bins: np.ndarray  # int64[k]: bins taken from each source
    tokens: np.ndarray  # int64[k]: tokens (in blend units) taken from each source
    epochs: np.ndarray  # int64[k]: epochs of each source begun (1 = not repeated)


@njit(cache=True, inline="always")
def _most_behind(weights, scale, delivered):
    """argmax_i ``weights[i] · scale − delivered[i]``, the lowest index on ties: Megatron's choice, in its float64
    operations (a product, then a difference; a later source wins only when strictly ahead). Inlined into the
    kernel: a call that takes arrays would cost reference counting on every bin."""
    best, best_lag = 0, weights[0] * scale - delivered[0]
    for i in range(1, len(weights)):
        lag = weights[i] * scale - delivered[i]
        if lag > best_lag:
            best, best_lag = i, lag
    return best


@njit(cache=True, nogil=True)
def greedy_blend(weights, unit, sizes, size_offsets, counts, later, later_offsets, total_tokens, max_bins,
                 out_source, out_index, taken, delivered):
    """Continue the greedy blend from ``taken``/``delivered`` until ``total_tokens`` are delivered (or ``max_bins``
    bins written in all); return the bins written in all (``out_*[:n]``).

    Source ``i`` gives its ``counts[i]`` bins in order, then the later epochs' bins
    ``later[later_offsets[i]:later_offsets[i+1]]``; ``sizes[size_offsets[i] + t]`` is the size of the ``t``-th
    bin it gives (sizes in the order they are taken, so each source is read front to back). With ``sizes``
    empty every bin counts 1 and ``unit`` is 1: Megatron's rule on bin counts, ``w_i · max(n, 1) − c_i``.
    ``taken``/``delivered`` are the bins and tokens taken from each source so far (zeros for a new blend),
    updated in place. Returns -1 - i when source ``i`` runs out of prepared bins: the caller prepares more
    epochs and calls again, which resumes where this call stopped. The size of every source's next bin is kept
    at hand, so a choice waits on little but the argmax (one float64 product and difference per source).
    """
    k = len(weights)
    sized = len(sizes) > 0
    n = np.sum(taken)
    total = np.sum(delivered)  # integers below 2**53: exact, in any order of summation
    ready_size = np.ones(k, np.float64)  # the size of each source's next bin, at hand before it is chosen
    for i in range(k):
        if sized and size_offsets[i] + taken[i] < size_offsets[i + 1]:
            ready_size[i] = sizes[size_offsets[i] + taken[i]]
    while total < total_tokens and n < max_bins:
        best = _most_behind(weights, max(total, unit), delivered)
        # the t-th bin a source gives: its own order, then its later epochs' (chosen without a branch: whether a
        # source is in its first epoch follows the choices, which no branch predictor foresees)
        t = taken[best]
        pos = later_offsets[best] + t - counts[best]
        if pos >= later_offsets[best + 1]:
            return -1 - best
        later_bin = later[max(pos, 0)]  # ``later`` holds one element more than its epochs: never empty
        size = ready_size[best] if sized else 1.0  # (a constant keeps the load off the chain of choices)
        out_source[n] = best
        out_index[n] = t if t < counts[best] else later_bin
        delivered[best] += size
        total += size
        n += 1
        taken[best] = t + 1
        if sized and size_offsets[best] + t + 1 < size_offsets[best + 1]:
            ready_size[best] = sizes[size_offsets[best] + t + 1]
    return n


def blend_bins(bin_sizes: list[np.ndarray | int], weights: np.ndarray, unit: int, total_tokens: int, seed: int,
               orders: list[np.ndarray | None] | None = None) -> Blend:
    """The blend of sources with these bin sizes (in tokens) and weights, until ``total_tokens`` are delivered.

    A source given as an int is that many bins each worth ``unit`` (a fixed-capacity pack): with every source
    so, the blend runs on bin counts alone (Megatron's exact rule, no sizes read). ``weights`` need not sum
    to 1 (they are normalized); each must be > 0 and each source must hold a bin. ``orders[i]``, where given,
    is the order in which source ``i`` gives its first epoch (a permutation of its bins; later epochs permute
    that order), instead of its own. Memory: the output, the later epochs' orders, and (bin sizes given) the
    sizes once more, in the order they are taken.
    """
    orders = orders or [None] * len(bin_sizes)
    bin_sizes = [s if o is None or isinstance(s, int | np.integer) else np.asarray(s)[o]
                 for s, o in zip(bin_sizes, orders, strict=True)]
    job = BlendRun.of(bin_sizes, weights, unit, total_tokens, seed)
    epochs = epochs_needed(job.weights, job.tokens, total_tokens, job.biggest)
    taken, delivered = np.zeros(job.k, np.int64), np.zeros(job.k, np.float64)
    n = run_in_parts(job, epochs, taken, delivered)
    while n < 0:
        epochs[-1 - n] *= 2  # rare: that source ran further ahead than prepared for; resume with more epochs
        n = job.run(job.prepared(epochs), taken, delivered)
    return relabel(job.result(n, taken, delivered), orders)


def relabel(blend: Blend, orders: list[np.ndarray | None]) -> Blend:
    """``blend`` with the bins of each source that has an order read through it (bin t of the order → its bin)."""
    which = [i for i, o in enumerate(orders) if o is not None]
    if not which:
        return blend
    base = np.zeros(len(orders), np.int64)
    base[which] = np.cumsum([0, *(len(orders[i]) for i in which[:-1])])
    ordered = np.zeros(len(orders), np.bool_)
    ordered[which] = True
    at = np.flatnonzero(ordered[blend.bin_source])
    lookup = np.concatenate([np.asarray(orders[i], np.int64) for i in which])
    blend.bin_index[at] = lookup[base[blend.bin_source[at]] + blend.bin_index[at]]
    return blend


@dataclass
class BlendRun:
    """One blend being computed: its sources, prepared once, and the output the kernel writes into.

    ``sizes`` is None when every bin counts ``unit`` (``uniform``: the blend runs on bin counts); else each
    source's bin sizes in the order it gives its first epoch. The greedy's state (``taken``, ``delivered``) is
    not held here: the two parts of a long blend (``Ahead``) each keep their own.
    """

    weights: np.ndarray  # float64[k], normalized
    unit: int
    total_tokens: int
    seed: int
    sizes: list[np.ndarray] | None
    counts: np.ndarray  # int64[k]: bins of each source (one epoch)
    tokens: np.ndarray  # int64[k]: tokens (blend units) of each source's epoch
    biggest: int  # the largest bin, and the smallest (in blend units)
    smallest: int
    index_dtype: type
    capacity: int  # bins the output has room for: more than the blend can take
    out_source: np.ndarray
    out_index: np.ndarray

    @classmethod
    def of(cls, bin_sizes: list[np.ndarray | int], weights: np.ndarray, unit: int, total_tokens: int, seed: int
           ) -> BlendRun:
        k = len(bin_sizes)
        sizes = None
        if not all(isinstance(s, int | np.integer) for s in bin_sizes):
            sizes = [np.full(s, unit, np.int32) if isinstance(s, int | np.integer) else s for s in bin_sizes]
        counts = np.array(list(bin_sizes) if sizes is None else [len(s) for s in sizes], np.int64)
        tokens = counts * unit if sizes is None else np.array([int(np.sum(s, dtype=np.int64)) for s in sizes],
                                                              np.int64)
        biggest = unit if sizes is None else max(int(np.max(s)) for s in sizes)
        smallest = unit if sizes is None else min(int(np.min(s)) for s in sizes)
        index_dtype = np.int32 if counts.max() < 2**31 else np.int64
        capacity = int(np.ceil(total_tokens / max(smallest, 1))) + k + 1
        return cls(np.asarray(weights, np.float64) / np.sum(weights), unit, total_tokens, seed, sizes, counts,
                   tokens, biggest, smallest, index_dtype, capacity, np.empty(capacity, np.int16),
                   np.empty(capacity, index_dtype))

    @property
    def k(self) -> int:
        return len(self.counts)

    @property
    def uniform(self) -> bool:
        return self.sizes is None

    def expected_bins(self) -> int:
        """About how many bins the blend will take: the tokens over each source's mean bin size, by weight."""
        return int(self.total_tokens * float(np.sum(self.weights / self.mean)))

    @property
    def mean(self) -> np.ndarray:
        """Each source's mean bin size."""
        return self.tokens / self.counts

    def first_epochs(self, epochs: list[int]) -> tuple:
        """What the kernel needs before any source has given its first epoch (the sizes: room for them all)."""
        sizes = (np.zeros(0, np.uint16), np.zeros(self.k + 1, np.int64)) if self.uniform else taken_sizes(
            self.sizes, self.counts, epochs, self.biggest)
        return (np.zeros(1, self.index_dtype), np.zeros(self.k + 1, np.int64), *sizes)

    def later_on(self, first: tuple, epochs: list[int], threads=None) -> tuple:
        """``first`` with the later epochs: their orders, and their sizes filled into its room."""
        _, _, sizes, size_offsets = first
        later, later_offsets = later_epochs(self.counts, epochs, self.seed, self.index_dtype, threads)
        if not self.uniform:
            later_sizes(sizes, size_offsets, self.counts, later, later_offsets)
        return later, later_offsets, sizes, size_offsets

    def prepared(self, epochs: list[int]) -> tuple:
        """Every epoch's orders and sizes at once."""
        return self.later_on(self.first_epochs(epochs), epochs)

    def run(self, arrays: tuple, taken: np.ndarray, delivered: np.ndarray, max_bins: int | None = None) -> int:
        """``greedy_blend`` from the state (``taken``, ``delivered``) over the ``arrays`` prepared, to ``max_bins``
        bins in all (default: the end of the blend)."""
        later, later_offsets, sizes, size_offsets = arrays
        max_bins = self.capacity if max_bins is None else max_bins
        if self.uniform:  # every bin counts 1; the blend ends at the bins that hold total_tokens
            return greedy_blend(self.weights, 1.0, sizes, size_offsets, self.counts, later, later_offsets,
                                float(-(-self.total_tokens // self.unit)), max_bins, self.out_source, self.out_index,
                                taken, delivered)
        return greedy_blend(self.weights, float(self.unit), sizes, size_offsets, self.counts, later, later_offsets,
                            float(self.total_tokens), max_bins, self.out_source, self.out_index, taken, delivered)

    def result(self, n: int, taken: np.ndarray, delivered: np.ndarray) -> Blend:
        """The blend of ``n`` bins, with the state it ended in."""
        return Blend(bin_source=self.out_source[:n], bin_index=self.out_index[:n], bins=taken,
                     tokens=taken * self.unit if self.uniform else delivered.astype(np.int64),
                     epochs=np.maximum(1, -(-taken // self.counts)))


def run_in_parts(job: BlendRun, epochs: list[int], taken: np.ndarray, delivered: np.ndarray) -> int:
    """Run the blend, a long one in two parts at once (the second from a guess of the state where it starts,
    ``Ahead``): from the middle, or, when some source repeats, from where the first part stops to wait for the
    later epochs (then the middle of the rest). Returns what ``greedy_blend`` does (negative: a source ran out)."""
    expected = job.expected_bins()
    split = expected // 2 if expected >= SPLIT_MIN_BINS else job.capacity
    with ThreadPoolExecutor(1, thread_name_prefix="xprep-blend") as pool:
        if max(epochs) > 1:
            n, arrays, ahead = run_beside_later_epochs(job, epochs, pool, split, taken, delivered)
        else:
            arrays = job.prepared(epochs)
            ahead = start_ahead(job, pool, arrays, split) if split < job.capacity else None
            n = job.run(arrays, taken, delivered, split)
        if ahead is not None:
            n = ahead.join(n, arrays, taken, delivered)
    return n


def run_beside_later_epochs(job: BlendRun, epochs: list[int], pool: ThreadPoolExecutor, split: int,
                            taken: np.ndarray, delivered: np.ndarray) -> tuple[int, tuple, Ahead | None]:
    """Start the blend on the first epochs while the later epochs' orders and sizes are prepared in ``pool``
    beside it; then go on over all of them, in two parts where enough is left. Returns (bins or a negative
    ``greedy_blend`` code, the arrays, the second part if one runs).

    The kernel holds no GIL; it reads no size of a later epoch before they are ready, nor uses one it reads
    there early: it stops when a source has given its first epoch, and resumes on them. The permutations run on
    one core beside the kernel (a loop split over every core would wait at each barrier on its share on the
    kernel's core), on every core once the kernel waits for them.
    """
    waiting = threading.Event()
    arrays = job.first_epochs(epochs)
    coming = pool.submit(job.later_on, arrays, epochs,
                         lambda: numba.config.NUMBA_NUM_THREADS if waiting.is_set() else 1)
    n = job.run(arrays, taken, delivered, split)
    waiting.set()
    arrays = coming.result()
    ahead = None
    if n < 0 or n == split:  # not at the end yet: the rest in two parts, where enough is left
        now = int(taken.sum())
        split = now + (job.expected_bins() - now) // 2 if split < job.capacity else job.capacity
        ahead = start_ahead(job, pool, arrays, split) if split < job.capacity and split - now >= SPLIT_MIN_BINS // 2 \
            else None
        n = job.run(arrays, taken, delivered, split if ahead is not None else job.capacity)
    return n, arrays, ahead


def start_ahead(job: BlendRun, pool: ThreadPoolExecutor, arrays: tuple, split: int) -> Ahead:
    """The second part of the blend, from bin ``split``, started in ``pool``."""
    points = max(1, min(CHECK_POINTS, CHECK_STATES // job.k))
    ahead = Ahead(job.run, job.weights, job.counts, job.mean, split, CHECK_EVERY, points)
    ahead.future = pool.submit(ahead.run, arrays)
    return ahead


class Ahead:
    """The second part of a long blend, run beside the first from a guess of the state at the split.

    The greedy's state after ``n`` bins is the bins taken from each source: the tokens delivered are their sizes'
    sum, exact in float64, and every later choice depends on nothing else. So a run from a guessed state that
    at some point has taken, source for source, the bins the true run has taken at that point goes on exactly as
    the true run does. The greedy pulls every source to within a bin or two of its share, and runs from nearby
    states meet soon (within about a thousand bins from the shares rounded, on the benchmark's mixtures). This
    part records its state every ``every`` bins over ``points`` points past the split; the first part, once at
    the split, carries on to the first point where its state equals the one recorded there, and the rest is
    this part's. Where they do not meet (or this part runs out of prepared bins) the first part runs the rest
    itself, over this one's bins.
    """

    def __init__(self, run, weights: np.ndarray, counts: np.ndarray, mean: np.ndarray, split: int, every: int,
                 points: int):
        self._run, self.weights, self.counts, self.mean = run, weights, counts, mean
        self.split, self.every = split, every
        self.states = np.zeros((points, len(weights)), np.int64)
        self.recorded = 0
        self.past = threading.Event()  # set once this part is past its points, or stopped
        self.end, self.taken, self.delivered = -1, None, None  # where it ended, and its state there
        self.met = False  # whether the first part met this one's bins (then the rest is this one's)
        self.future: Future | None = None

    def shares(self) -> np.ndarray:
        """Each source's share of ``split`` bins (its weight over its mean bin size), by largest remainders."""
        share = self.split * (self.weights / self.mean) / np.sum(self.weights / self.mean)
        taken = np.floor(share).astype(np.int64)
        taken[np.argsort(taken - share, kind="stable")[: self.split - int(taken.sum())]] += 1
        return taken

    def guess(self, arrays: tuple) -> tuple[np.ndarray, np.ndarray] | None:
        """The state at the split: ``shares``, and the tokens those bins hold (None: more than is prepared)."""
        later, later_offsets, sizes, size_offsets = arrays
        taken = self.shares()
        if np.any(taken > self.counts + np.diff(later_offsets)):
            return None  # more than is prepared: no guess
        if len(sizes) == 0:
            return taken, taken.astype(np.float64)
        return taken, np.array([float(np.sum(sizes[a:a + t], dtype=np.int64))
                                for a, t in zip(size_offsets[:-1], taken, strict=True)])

    def run(self, arrays: tuple) -> None:
        try:
            state = self.guess(arrays)
            if state is None:
                return
            taken, delivered = state
            for j in range(len(self.states)):
                stop = self.split + (j + 1) * self.every
                n = self._run(arrays, taken, delivered, stop)
                if n < 0:
                    return
                self.states[j] = taken
                self.recorded = j + 1
                if n < stop:  # the blend ended
                    break
            self.past.set()
            n = self._run(arrays, taken, delivered)
            if n >= 0:
                self.end, self.taken, self.delivered = n, taken, delivered
        finally:
            self.past.set()

    def join(self, n: int, arrays: tuple, taken: np.ndarray, delivered: np.ndarray) -> int:
        """The first part stopped at ``n`` (the split, unless the blend ended before it or a source ran out):
        carry it on to where the parts meet; return the blend's bins (negative as ``greedy_blend``) with
        ``taken``/``delivered`` its state at the end."""
        if n != self.split:
            self.future.result()  # nothing more is written beside the caller
            return n
        self.past.wait()  # this part is past the points: the first writes its bins before them, never beside
        for j in range(self.recorded):
            stop = self.split + (j + 1) * self.every
            n = self._run(arrays, taken, delivered, stop)
            if n < stop:  # the blend ended, or a source ran out (n < 0)
                self.future.result()
                return n
            if np.array_equal(taken, self.states[j]):  # met: from here on the same bins
                self.future.result()
                if self.end < 0:
                    break
                taken[:], delivered[:] = self.taken, self.delivered
                self.met = True
                return self.end
        self.future.result()
        return self._run(arrays, taken, delivered)


def epochs_needed(weights: np.ndarray, tokens: np.ndarray, total_tokens: int, biggest: int) -> list[int]:
    """Epochs each source needs at its share, with room for the greedy running up to two bins ahead of it."""
    return [max(1, int(np.ceil((w * total_tokens + 2 * biggest) / max(t, 1))))
            for w, t in zip(weights, tokens, strict=True)]


def later_epochs(counts: np.ndarray, epochs: list[int], seed: int, dtype, threads=None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Every source's later epochs (``later_orders``) in one array (and one element after them), and where each
    source starts. ``threads()``, where given, says how many threads each permutation may use."""
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum([int(c) * (e - 1) for c, e in zip(counts, epochs, strict=True)], out=offsets[1:])
    later = np.zeros(offsets[-1] + 1, dtype)  # one more: the kernel reads it without a branch, never empty
    for i, (c, e) in enumerate(zip(counts, epochs, strict=True)):
        later_orders(int(c), e, seed, i, dtype, out=later[offsets[i]:offsets[i + 1]], threads=threads)
    return later, offsets


def taken_sizes(bin_sizes: list[np.ndarray], counts: np.ndarray, epochs: list[int], biggest: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Room for each source's bin sizes in the order the blend takes them (its own order, then its later
    epochs'), all sources in one array, with the first epochs' sizes in place; and where each source starts.
    Stored as uint16 when every size fits (bins of up to 64Ki tokens): half the memory to fill and to read."""
    offsets = np.zeros(len(bin_sizes) + 1, np.int64)
    np.cumsum([int(c) * e for c, e in zip(counts, epochs, strict=True)], out=offsets[1:])
    sizes = np.empty(offsets[-1], np.uint16 if biggest < 2**16 else np.int64)
    for i, s in enumerate(bin_sizes):
        sizes[offsets[i]:offsets[i] + len(s)] = s
    return sizes, offsets


def later_sizes(sizes: np.ndarray, offsets: np.ndarray, counts: np.ndarray, later: np.ndarray,
                later_offsets: np.ndarray) -> None:
    """Fill the later epochs' part of ``taken_sizes``: gathered from each source's first epoch ('wrap': the
    indices are in range, and numpy checks them more slowly)."""
    for i in range(len(counts)):
        start, mid = offsets[i], offsets[i] + counts[i]
        np.take(sizes[start:mid], later[later_offsets[i]:later_offsets[i + 1]], out=sizes[mid:offsets[i + 1]],
                mode="wrap")


def later_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32, out: np.ndarray | None = None,
                 threads=None) -> np.ndarray:
    """Epochs 1 … epochs−1 of one source (epoch 0 is the pack's own order, never materialized)."""
    out = np.empty(n_bins * (epochs - 1), dtype) if out is None else out
    for e in range(1, epochs):
        if threads is not None:
            numba.set_num_threads(threads())  # numba's setting is per thread
        out[(e - 1) * n_bins:e * n_bins] = shuffled_order(n_bins, epoch_seed(seed, source, e))
    return out


def epoch_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32) -> np.ndarray:
    """The bins of one source over ``epochs`` epochs: the pack's order, then seeded permutations."""
    return np.concatenate([np.arange(n_bins, dtype=dtype), later_orders(n_bins, epochs, seed, source, dtype)])


def epoch_seed(seed: int, source: int, epoch: int) -> int:
    """A seed per (blend seed, source, epoch), spread over 63 bits."""
    mixed = np.random.SeedSequence([seed, source, epoch]).generate_state(2, np.uint32)
    return int((int(mixed[0]) << 31) ^ int(mixed[1]))


# ------------------------------------------------------------------------------------------------ phases
# Phased blends: one order of bins whose mix changes phase after phase (a mix file's ``phases:``).
#
# Each phase is a blend of its own (``blend_bins``: Megatron's greedy rule over the sources the
# phase weighs, from a fresh start, so its shares hold after every prefix of the phase exactly as a blend's do), and
# the phases follow each other in one order. What carries over from one phase to the next is where each source
# stands in its own stream of bins: a source gives its bins as one endless stream (its first epoch in the pack's
# order, or in a seeded random order when the whole mix takes less than an epoch of it, then each later epoch in a
# fresh permutation seeded by (seed, source, epoch), as a blend's repeats are), and a phase takes each source's next
# bins from where the previous phase left it. So no phase serves a source's documents again from the start: a bin
# comes back only once its source's stream has gone round a whole epoch, which happens where the phases together
# ask more of a source than one epoch holds (then, as in a blend, the next epoch, a new permutation), and within a
# phase only where that phase alone asks more of it than it has left in its current epoch.
#
# ``phased_blend`` works on arrays alone (sizes in blend units, weights per phase, each phase's size): the mix file,
# blend.json and the reports are ``xprep.prep.pack.mixture``'s.

MARGIN_BINS = 4  # each phase prepares this many of a source's largest bins past its share (the greedy runs ≤ 2 ahead)


@dataclass
class PhasedBlend:
    """A blend in phases: the whole order (``blend``, its counts over every phase), where each phase starts, and
    what each phase took from each source."""

    blend: Blend
    starts: np.ndarray  # int64[P + 1]: the first bin of each phase, then the end of the blend
    bins: np.ndarray  # int64[P, k]: bins of each source in each phase
    tokens: np.ndarray  # int64[P, k]: blend units of each source in each phase
    positions: np.ndarray  # int64[P + 1, k]: where each source's stream stands as each phase starts, then at the end


@njit(cache=True, nogil=True)
def place_phase(local_source, local_index, active, offset, lookup, gathered, out_source, out_index):
    """Write one phase's bins, blended over its own sources and their stream windows (``local_*``), as bins of the
    whole blend: source ``active[s]``, bin ``offset[s] + t`` of its pack where its window runs in the pack's own
    order, else ``lookup[offset[s] + t]`` (``gathered[s]``: the window read through a permutation)."""
    for j in range(len(local_source)):
        s = local_source[j]
        t = offset[s] + local_index[j]
        out_source[j] = active[s]
        out_index[j] = lookup[t] if gathered[s] else t


class SourceStream:
    """One source's endless stream of bins: its first epoch (``first``, None: the pack's own order), then seeded
    permutations; windows of it are read by position."""

    def __init__(self, count: int, first: np.ndarray | None, seed: int, source: int):
        self.count, self.seed, self.source = count, seed, source
        self.dtype = np.int32 if count < 2**31 else np.int64  # as a blend's bin indices
        self.first = None if first is None else np.asarray(first, self.dtype)
        self._epochs: dict[int, np.ndarray | Future] = {}

    def prepare(self, pool: ThreadPoolExecutor, epochs: int) -> None:
        """Permute epochs 1 … epochs−1 in ``pool``, beside the blend (whose kernel holds no GIL)."""
        for e in range(1, epochs):
            self._epochs.setdefault(e, pool.submit(self._permutation, e))

    def _permutation(self, epoch: int) -> np.ndarray:
        return shuffled_order(self.count, epoch_seed(self.seed, self.source, epoch)).astype(self.dtype)

    def forget_before(self, position: int) -> None:
        """Drop the epochs wholly before ``position``: no later window reads them."""
        for epoch in [e for e, o in self._epochs.items() if not isinstance(o, Future)
                      and (e + 1) * self.count <= position]:  # (read, so permuted: not one still in the pool)
            del self._epochs[epoch]

    def in_pack_order(self, start: int, stop: int) -> bool:
        """Whether positions [start, stop) are the pack's bins start … stop−1 (the first epoch in its own order)."""
        return self.first is None and stop <= self.count

    def window(self, start: int, stop: int) -> np.ndarray:
        """The bins at positions [start, stop) of the stream."""
        parts = []
        for epoch in range(start // self.count, (stop - 1) // self.count + 1):
            lo, hi = max(start, epoch * self.count), min(stop, (epoch + 1) * self.count)
            parts.append(self.epoch(epoch)[lo - epoch * self.count:hi - epoch * self.count])
        return np.concatenate(parts)

    def epoch(self, epoch: int) -> np.ndarray:
        """The bins of one epoch, in the order it gives them (each later epoch permuted once, then kept: the
        memory a blend's prepared later epochs take)."""
        if epoch == 0:
            return np.arange(self.count, dtype=self.dtype) if self.first is None else self.first
        if epoch not in self._epochs:
            self._epochs[epoch] = self._permutation(epoch)
        elif isinstance(self._epochs[epoch], Future):
            self._epochs[epoch] = self._epochs[epoch].result()
        return self._epochs[epoch]


def phased_blend(bin_sizes: list[np.ndarray | int], weights: np.ndarray, totals: list[int], unit: int, seed: int,
                 max_bins: list[int | None] | None = None, orders: list[np.ndarray | None] | None = None
                 ) -> PhasedBlend:
    """The blend whose phase ``p`` follows ``weights[p]`` (over the sources; 0: none from it) until ``totals[p]``
    blend units are delivered, or ``max_bins[p]`` bins where given; phase after phase, each source continuing its
    stream where the previous phase left it. ``bin_sizes`` and ``unit`` as ``blend_bins`` takes them;
    ``orders[i]``: source ``i``'s first epoch, where it is not the pack's order (a cut source's random subset)."""
    k = len(bin_sizes)
    uniform = all(isinstance(s, int | np.integer) for s in bin_sizes)
    counts = np.array([int(s) if isinstance(s, int | np.integer) else len(s) for s in bin_sizes], np.int64)
    biggest = unit if uniform else max(int(np.max(s)) for s in bin_sizes)
    smallest = unit if uniform else min(int(np.min(s)) for s in bin_sizes)
    streams = [SourceStream(int(n), (orders or [None] * k)[i], seed, i) for i, n in enumerate(counts)]
    with ThreadPoolExecutor(1, thread_name_prefix="xprep-phases") as pool:
        _prepare_epochs(streams, pool, bin_sizes, weights, totals, unit, biggest)
        return _run_phases(streams, bin_sizes, weights, totals, unit, seed, max_bins, counts, uniform, biggest,
                           smallest)


def _prepare_epochs(streams: list[SourceStream], pool: ThreadPoolExecutor, bin_sizes: list, weights: np.ndarray,
                    totals: list[int], unit: int, biggest: int) -> None:
    """Start permuting the later epochs the phases will read (their shares over every phase, and the margins),
    earliest first, beside the blend."""
    share = weights / weights.sum(axis=1, keepdims=True)
    want = (share * np.asarray(totals, np.float64)[:, None]).sum(axis=0) + len(totals) * MARGIN_BINS * biggest
    epochs = [int(np.ceil(w / _epoch_units(s, unit))) for w, s in zip(want, bin_sizes, strict=True)]
    for epoch in range(1, max(epochs)):  # epoch by epoch over the sources: the earliest needed first
        for stream, needed in zip(streams, epochs, strict=True):
            if epoch < needed:
                stream.prepare(pool, epoch + 1)


def _epoch_units(sizes, unit: int) -> int:
    return int(sizes) * unit if isinstance(sizes, int | np.integer) else max(1, int(np.sum(sizes, dtype=np.int64)))


def _run_phases(streams: list[SourceStream], bin_sizes: list, weights: np.ndarray, totals: list[int], unit: int,
                seed: int, max_bins: list[int | None] | None, counts: np.ndarray, uniform: bool, biggest: int,
                smallest: int) -> PhasedBlend:
    k, phases = len(bin_sizes), len(totals)
    room = sum(int(-(-t // smallest)) + k + 1 for t in totals)
    out_source = np.empty(room, np.int16)
    out_index = np.empty(room, np.int32 if counts.max() < 2**31 else np.int64)
    starts, positions = np.zeros(phases + 1, np.int64), np.zeros((phases + 1, k), np.int64)
    bins, tokens = np.zeros((phases, k), np.int64), np.zeros((phases, k), np.int64)
    for p in range(phases):
        cap = (max_bins or [None] * phases)[p]
        total = totals[p] if cap is None else cap * biggest  # a phase of N bins: cut to N below
        n, bins[p], tokens[p] = _one_phase(streams, bin_sizes, weights[p], total, unit, biggest, uniform, seed,
                                           positions[p], out_source[starts[p]:], out_index[starts[p]:], cap)
        starts[p + 1] = starts[p] + n
        positions[p + 1] = positions[p] + bins[p]
        for stream, at in zip(streams, positions[p + 1], strict=True):
            stream.forget_before(int(at))
    done = positions[-1]
    blend = Blend(bin_source=out_source[:starts[-1]], bin_index=out_index[:starts[-1]], bins=done,
                  tokens=tokens.sum(axis=0), epochs=np.maximum(1, -(-done // counts)))
    return PhasedBlend(blend, starts, bins, tokens, positions)


def _one_phase(streams: list[SourceStream], bin_sizes: list, weights: np.ndarray, total: int, unit: int,
               biggest: int, uniform: bool, seed: int, at: np.ndarray, out_source: np.ndarray,
               out_index: np.ndarray, cap: int | None) -> tuple[int, np.ndarray, np.ndarray]:
    """Blend one phase into ``out_*`` from the stream positions ``at``; (bins written, bins and units per source).

    Each source the phase weighs is given as a window of its stream long enough for its share and a margin
    (the greedy never runs a source more than two bins past its share), so the phase blends as a blend of its own
    and its bins are read back through the windows."""
    active = np.flatnonzero(weights > 0)
    share = weights[active] / weights[active].sum()
    found = [_window(streams[i], bin_sizes[i], w * total, unit, biggest, uniform, int(at[i]))
             for i, w in zip(active, share, strict=True)]
    windows, sizes = [w[:3] for w in found], [w[3] for w in found]
    part = blend_bins(sizes, share, unit, total, seed)
    n = len(part.bin_source) if cap is None else min(cap, len(part.bin_source))
    local_source, local_index = part.bin_source[:n], part.bin_index[:n]
    whole = n == len(part.bin_source)  # (a phase of N bins is cut to N below what it blended)
    taken = part.bins.copy() if whole else np.bincount(local_source, minlength=len(active)).astype(np.int64)
    assert np.all(taken <= [b - a for a, b, _ in windows]), "a phase ran a source past its prepared window"
    gathered = np.array([order is not None for _, _, order in windows])
    lookup = [order for _, _, order in windows if order is not None]
    offset = np.zeros(len(active), np.int64)
    offset[gathered] = np.cumsum([0, *(len(w) for w in lookup[:-1])])
    offset[~gathered] = [a for a, _, order in windows if order is None]
    place_phase(local_source, local_index, active.astype(np.int16), offset,
                np.concatenate(lookup) if lookup else np.zeros(1, out_index.dtype), gathered, out_source, out_index)
    if whole:
        units = part.tokens
    else:  # a phase of N bins, cut short of what it blended
        units = taken * unit if uniform else _units(sizes, local_source, local_index, len(active))
    bins, tokens = np.zeros(len(weights), np.int64), np.zeros(len(weights), np.int64)
    bins[active], tokens[active] = taken, units
    return n, bins, tokens


def _window(stream: SourceStream, sizes, want: float, unit: int, biggest: int, uniform: bool, at: int
            ) -> tuple[int, int, np.ndarray | None, np.ndarray | int]:
    """The window of a source's stream a phase may take from (from position ``at``: ``want`` units and the
    margin): its start and stop, its bins (None where they are the pack's bins start … stop−1), and their sizes
    as ``blend_bins`` takes them (a count for bins that all count ``unit``)."""
    need = want + MARGIN_BINS * biggest
    if uniform:
        stop = at + int(np.ceil(need / unit))
        return at, stop, None if stream.in_pack_order(at, stop) else stream.window(at, stop), stop - at
    sizes = np.asarray(sizes)
    length = int(np.ceil(need / max(float(sizes.mean()), 1.0))) + MARGIN_BINS
    while True:  # the window's sizes vary: grow it until they hold what the phase may take
        stop = at + length
        order = None if stream.in_pack_order(at, stop) else stream.window(at, stop)
        held = sizes[at:stop] if order is None else sizes[order]
        if held.sum(dtype=np.int64) >= need:
            return at, stop, order, held
        length *= 2


def _units(sizes: list[np.ndarray], local_source: np.ndarray, local_index: np.ndarray, k: int) -> np.ndarray:
    """Blend units each source gave in a phase (its first bins' sizes, in window order)."""
    return np.array([int(np.asarray(sizes[s])[local_index[local_source == s]].sum(dtype=np.int64))
                     for s in range(k)], np.int64)
