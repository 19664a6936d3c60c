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
    parallel_kernels_loaded()
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


def parallel_kernels_loaded() -> None:
    """Have numba load (or compile) the parallel permutation kernel in this thread, before a worker calls it beside
    a kernel this thread compiles: loading a parallel kernel registers types with numba's typing, which is not
    thread-safe (on a cold cache, 'RuntimeError: dictionary changed size during iteration' in one thread or the
    other). Called once, it costs a call of an empty permutation."""
    shuffled_order(1, 0)


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
# Each phase is a blend of its own (Megatron's greedy rule over the sources the
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
# How it is built, as fast as a blend without phases: every source's stream is laid out once (``SourceStreams``:
# its bins and their sizes in stream order, the later epochs permuted beside the greedy, in the order the phases
# reach them, ``LaterEpochs``), and each phase runs the greedy kernel over it (``phase_greedy``: the sources the
# phase weighs, each from where its stream stands), writing the phase's bins straight into the whole blend, a long
# phase in two parts at once as a long blend is (``PhaseAhead``).
#
# ``phased_blend`` works on arrays alone (sizes in blend units, weights per phase, each phase's size): the mix file,
# blend.json and the reports are ``xprep.prep.pack.mixture``'s.

MARGIN_BINS = 4  # stream prepared per source and phase past its share, in its largest bins (the greedy runs ≤ 2 ahead)
PARALLEL_MIN_BINS = 1 << 16  # a smaller permutation runs on one thread, even while the greedy waits for it
RUN_WHILE_PERMUTING = 1 << 21  # bins a phase runs between looks at whether the later epochs are all permuted


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
def phase_greedy(weights, active, unit, sizes, size_offsets, own, later, later_offsets, ready, base, total_tokens,
                 max_bins, out_source, out_index, taken, delivered):
    """``greedy_blend`` over one phase: continue it from ``taken``/``delivered`` until ``total_tokens`` are delivered
    (or ``max_bins`` bins written in all); return the bins written in all (``out_*[:n]``), or -1 - j where source
    ``active[j]`` reaches the end of its ``ready`` bins (the caller prepares more and calls again).

    The phase weighs sources ``active`` (``weights``, normalized; ``taken``/``delivered`` are per phase source);
    source ``active[j]`` gives the bins of its stream from position ``base[j]`` on. Position ``t`` of source ``i``'s
    stream is bin ``t`` of its pack where ``t < own[i]`` (a first epoch in the pack's order), else
    ``later[later_offsets[i] + t − own[i]]``; its size is ``sizes[size_offsets[i] + t]`` (``sizes`` empty: every bin
    counts 1, ``unit`` is 1, and the rule runs on bin counts). ``ready[i]``: the positions of source ``i`` whose bins
    and sizes are prepared. The bins are written as the whole blend's (source ids, bin indices of their packs).
    """
    k = len(weights)
    sized = len(sizes) > 0
    n = np.sum(taken)
    total = np.sum(delivered)  # integers below 2**53: exact, in any order of summation
    ready_size = np.ones(k, np.float64)  # the size of each source's next bin, at hand before it is chosen
    for j in range(k):
        if sized and base[j] + taken[j] < ready[active[j]]:
            ready_size[j] = sizes[size_offsets[active[j]] + base[j] + taken[j]]
    while total < total_tokens and n < max_bins:
        best = _most_behind(weights, max(total, unit), delivered)
        i = active[best]
        t = base[best] + taken[best]  # the source's position in its stream
        if t >= ready[i]:
            return -1 - best
        later_bin = later[max(later_offsets[i] + t - own[i], 0)]  # (no branch: as in greedy_blend)
        size = ready_size[best] if sized else 1.0
        out_source[n] = i
        out_index[n] = t if t < own[i] else later_bin
        delivered[best] += size
        total += size
        n += 1
        taken[best] += 1
        if sized and t + 1 < ready[i]:
            ready_size[best] = sizes[size_offsets[i] + t + 1]
    return n


@dataclass
class SourceStreams:
    """Every source's stream of bins over the epochs the phases will read, laid out for ``phase_greedy``: the bins
    past each source's first epoch in pack order (``later``: a first epoch in a random order, then the later
    epochs' permutations) and, where bins have sizes, every position's size in stream order (uint16 where every
    size fits: half the memory to fill and to read). ``ready`` says how far each stream is filled in: the first
    epochs at once, the later ones by ``fill`` (in a thread beside the greedy)."""

    bin_sizes: list[np.ndarray] | None  # each source's bin sizes in pack order (None: every bin counts the unit)
    firsts: list[np.ndarray | None]  # each source's first epoch, where it is not the pack's order
    counts: np.ndarray  # int64[k]: bins of each source (one epoch)
    epochs: list[int]  # epochs of each source laid out
    seed: int
    own: np.ndarray  # int64[k]: positions given in the pack's order (the first epoch, or 0)
    later: np.ndarray  # int32 (int64 for sources of ≥ 2**31 bins), and one element after them: never empty
    later_offsets: np.ndarray  # int64[k + 1]
    sizes: np.ndarray  # empty where every bin counts the unit
    size_offsets: np.ndarray  # int64[k + 1]
    ready: np.ndarray  # int64[k]: the positions filled in
    mean: np.ndarray  # float64[k]: each source's mean bin size, in the units ``phase_greedy`` counts (1 without sizes)

    @classmethod
    def of(cls, bin_sizes: list[np.ndarray] | None, firsts: list[np.ndarray | None], counts: np.ndarray,
           epochs: list[int], seed: int, size_dtype: type) -> SourceStreams:
        """The streams, their first epochs filled in."""
        k = len(counts)
        own = np.array([0 if f is not None else c for f, c in zip(firsts, counts, strict=True)], np.int64)
        spans = counts * np.asarray(epochs, np.int64)
        later_offsets, size_offsets = np.zeros(k + 1, np.int64), np.zeros(k + 1, np.int64)
        np.cumsum(spans - own, out=later_offsets[1:])
        if bin_sizes is not None:
            np.cumsum(spans, out=size_offsets[1:])
        later = np.zeros(later_offsets[-1] + 1, np.int32 if counts.max() < 2**31 else np.int64)
        sizes = np.empty(size_offsets[-1], size_dtype)
        mean = np.ones(k) if bin_sizes is None else np.array([np.sum(s, dtype=np.int64) for s in bin_sizes]) / counts
        streams = cls(bin_sizes, firsts, counts, list(epochs), seed, own, later, later_offsets, sizes, size_offsets,
                      np.zeros(k, np.int64), mean)
        for i in range(k):
            streams.fill(i, 0)
        return streams

    def fill(self, source: int, epoch: int, threads=None) -> None:
        """Lay out one epoch of a source's stream: its bins (a later epoch: permuted now, ``threads()`` threads)
        and their sizes."""
        count, first = int(self.counts[source]), self.firsts[source]
        order = None
        if epoch > 0:
            if threads is not None:  # (numba's setting is per thread; a small permutation only waits for more)
                numba.set_num_threads(threads() if count >= PARALLEL_MIN_BINS else 1)
            order = shuffled_order(count, epoch_seed(self.seed, source, epoch))
        elif first is not None:
            order = first
        if order is not None:
            at = self.later_offsets[source] + epoch * count - self.own[source]
            self.later[at:at + count] = order
        if self.bin_sizes is not None:
            at = self.size_offsets[source] + epoch * count
            own_sizes = self.sizes[self.size_offsets[source]:self.size_offsets[source] + count]
            if order is None:
                self.sizes[at:at + count] = self.bin_sizes[source]
            elif first is None:  # gathered from its first epoch, the pack's sizes ('wrap': in range, checked less)
                np.take(own_sizes, order, out=self.sizes[at:at + count], mode="wrap")
            else:
                self.sizes[at:at + count] = self.bin_sizes[source][order]
        self.ready[source] = (epoch + 1) * count

    def longer(self, source: int) -> SourceStreams:
        """These streams with twice the epochs of ``source``, every epoch filled in at once."""
        epochs = [e * 2 if i == source else e for i, e in enumerate(self.epochs)]
        streams = SourceStreams.of(self.bin_sizes, self.firsts, self.counts, epochs, self.seed, self.sizes.dtype)
        for i, n in enumerate(epochs):
            for epoch in range(1, n):
                streams.fill(i, epoch)
        return streams


class LaterEpochs:
    """The later epochs of every stream, permuted and filled in one after the other in ``pool``, beside the greedy
    (whose kernel holds no GIL), in the order the phases are expected to reach them. The permutations run on one
    core beside the kernel, on every core while the kernel waits for one."""

    def __init__(self, streams: SourceStreams, pool: ThreadPoolExecutor, due: list[tuple[int, int]]):
        self.waiting = threading.Event()
        self.coming: dict[int, list[Future]] = {}
        for source, epoch in due:
            self.coming.setdefault(source, []).append(pool.submit(streams.fill, source, epoch, self._threads))

    def _threads(self) -> int:
        return numba.config.NUMBA_NUM_THREADS if self.waiting.is_set() else 1

    @property
    def done(self) -> bool:
        return all(f.done() for fs in self.coming.values() for f in fs)

    def wait_for(self, source: int) -> bool:
        """Wait for the next epoch of ``source`` to be filled in; False where none is coming."""
        coming = [f for f in self.coming.get(source, []) if not f.done()]
        if not coming:
            return False
        self.waiting.set()
        try:
            coming[0].result()
        finally:
            self.waiting.clear()
        return True

    def finish(self) -> None:
        for fs in self.coming.values():
            for f in fs:
                f.result()


@dataclass
class PhaseRun:
    """One phase being blended: the sources it weighs (``active``) and their weights (normalized as a blend's), where
    each stands in its stream as the phase starts, its size, and the part of the output from its first bin on."""

    streams: SourceStreams
    weights: np.ndarray  # float64[a]
    active: np.ndarray  # int64[a]: the phase's sources
    base: np.ndarray  # int64[a]: their stream positions as the phase starts
    unit: float  # as ``phase_greedy`` counts: the blend unit, or 1 where bins have no sizes
    total_tokens: float
    max_bins: int
    out_source: np.ndarray
    out_index: np.ndarray

    def run(self, arrays: None, taken: np.ndarray, delivered: np.ndarray, max_bins: int | None = None) -> int:
        """``phase_greedy`` from the state (``taken``, ``delivered``) to ``max_bins`` bins of the phase in all
        (default: its end), over the streams as far as they are filled in. (``arrays``: as ``Ahead`` calls it.)"""
        s = self.streams
        stop = self.max_bins if max_bins is None else min(max_bins, self.max_bins)
        return phase_greedy(self.weights, self.active, self.unit, s.sizes, s.size_offsets, s.own, s.later,
                            s.later_offsets, s.ready.copy(), self.base, self.total_tokens, stop, self.out_source,
                            self.out_index, taken, delivered)

    def ended(self, taken: np.ndarray, delivered: np.ndarray) -> bool:
        return int(taken.sum()) >= self.max_bins or float(delivered.sum()) >= self.total_tokens

    def expected_bins(self) -> int:
        """About how many bins the phase will take (its size over its sources' mean bin sizes, by weight)."""
        return min(self.max_bins, int(self.total_tokens * float(np.sum(self.weights / self.streams.mean[self.active]))))

    def state_at(self, taken: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The state after the phase took ``taken`` bins of each source (None: more than is filled in)."""
        s, at = self.streams, self.base + taken
        if np.any(at > s.ready[self.active]):
            return None
        if len(s.sizes) == 0:
            return taken, taken.astype(np.float64)
        return taken, np.array([float(np.sum(s.sizes[s.size_offsets[i] + b:s.size_offsets[i] + e], dtype=np.int64))
                                for i, b, e in zip(self.active, self.base, at, strict=True)])


class PhaseAhead(Ahead):
    """The second part of a long phase (``Ahead``), its guess read from the phase's streams."""

    def __init__(self, job: PhaseRun, split: int):
        points = max(1, min(CHECK_POINTS, CHECK_STATES // len(job.active)))
        super().__init__(job.run, job.weights, job.streams.counts[job.active], job.streams.mean[job.active], split,
                         CHECK_EVERY, points)
        self.job = job

    def guess(self, arrays: None) -> tuple[np.ndarray, np.ndarray] | None:
        return self.job.state_at(self.shares())


def phased_blend(bin_sizes: list[np.ndarray | int], weights: np.ndarray, totals: list[int], unit: int, seed: int,
                 max_bins: list[int | None] | None = None, orders: list[np.ndarray | None] | None = None
                 ) -> PhasedBlend:
    """The blend whose phase ``p`` follows ``weights[p]`` (over the sources; 0: none from it) until ``totals[p]``
    blend units are delivered, or ``max_bins[p]`` bins where given; phase after phase, each source continuing its
    stream where the previous phase left it. ``bin_sizes`` and ``unit`` as ``blend_bins`` takes them;
    ``orders[i]``: source ``i``'s first epoch, where it is not the pack's order (a cut source's random subset)."""
    k, phases = len(bin_sizes), len(totals)
    max_bins = max_bins or [None] * phases
    uniform = all(isinstance(s, int | np.integer) for s in bin_sizes)
    counts = np.array([int(s) if isinstance(s, int | np.integer) else len(s) for s in bin_sizes], np.int64)
    sizes = None if uniform else [np.full(s, unit, np.int32) if isinstance(s, int | np.integer) else np.asarray(s)
                                  for s in bin_sizes]
    biggest = unit if uniform else max(int(np.max(s)) for s in sizes)
    smallest = unit if uniform else min(int(np.min(s)) for s in sizes)
    shares = weights / weights.sum(axis=1, keepdims=True)
    epoch_units = counts * unit if uniform else np.array([np.sum(s, dtype=np.int64) for s in sizes], np.int64)
    epochs = _epochs_wanted(shares, totals, epoch_units, biggest)
    firsts = [None if o is None else np.asarray(o) for o in (orders or [None] * k)]
    streams = SourceStreams.of(sizes, firsts, counts, epochs, seed, np.uint16 if biggest < 2**16 else np.int64)
    room = [cap if cap is not None else int(-(-t // smallest)) + k + 1 for t, cap in zip(totals, max_bins, strict=True)]
    out_source = np.empty(sum(room), np.int16)
    out_index = np.empty(sum(room), streams.later.dtype)
    starts, positions = np.zeros(phases + 1, np.int64), np.zeros((phases + 1, k), np.int64)
    bins, tokens = np.zeros((phases, k), np.int64), np.zeros((phases, k), np.int64)
    parallel_kernels_loaded()
    with ThreadPoolExecutor(1, thread_name_prefix="xprep-phases") as pool:
        later = LaterEpochs(streams, pool, _due(shares, totals, epoch_units, epochs))
        for p in range(phases):
            total = totals[p] if max_bins[p] is None else max_bins[p] * biggest  # a phase of N bins: N ends it
            job = _phase_run(streams, weights[p], total, unit, uniform, room[p], positions[p],
                             out_source[starts[p]:], out_index[starts[p]:])
            taken, delivered = np.zeros(len(job.active), np.int64), np.zeros(len(job.active), np.float64)
            streams = _run_phase(job, pool, later, taken, delivered)
            starts[p + 1] = starts[p] + taken.sum()
            bins[p, job.active] = taken
            tokens[p, job.active] = taken * unit if uniform else delivered.astype(np.int64)
            positions[p + 1] = positions[p] + bins[p]
        later.finish()
    done = positions[-1]
    blend = Blend(bin_source=out_source[:starts[-1]], bin_index=out_index[:starts[-1]], bins=done,
                  tokens=tokens.sum(axis=0), epochs=np.maximum(1, -(-done // counts)))
    return PhasedBlend(blend, starts, bins, tokens, positions)


def _phase_run(streams: SourceStreams, weights: np.ndarray, total: int, unit: int, uniform: bool, room: int,
               at: np.ndarray, out_source: np.ndarray, out_index: np.ndarray) -> PhaseRun:
    """One phase over the sources it weighs, from the stream positions ``at``: weighted as a blend of them alone
    (``blend_bins`` normalizes the phase's shares once more), and counted in bins where bins have no sizes."""
    active = np.flatnonzero(weights > 0)
    share = weights[active] / weights[active].sum()
    share = np.asarray(share, np.float64) / np.sum(share)
    if uniform:
        return PhaseRun(streams, share, active, at[active], 1.0, float(-(-total // unit)), room, out_source,
                        out_index)
    return PhaseRun(streams, share, active, at[active], float(unit), float(total), room, out_source, out_index)


def _run_phase(job: PhaseRun, pool: ThreadPoolExecutor, later: LaterEpochs, taken: np.ndarray,
               delivered: np.ndarray) -> SourceStreams:
    """Run one phase to its end; return the streams it ends with (laid out again, longer, in the rare case that a
    source needs more epochs than planned).

    While later epochs are being permuted the phase runs on one core, in stretches, and waits where a source
    reaches the end of what is filled in; once they all are, the rest of a long phase runs in two parts at once."""
    while True:
        n = int(taken.sum())
        if later.done and job.expected_bins() - n >= SPLIT_MIN_BINS:
            ahead = PhaseAhead(job, n + (job.expected_bins() - n) // 2)
            ahead.future = pool.submit(ahead.run, None)
            n = ahead.join(job.run(None, taken, delivered, ahead.split), None, taken, delivered)
        else:
            n = job.run(None, taken, delivered, None if later.done else n + RUN_WHILE_PERMUTING)
        if n >= 0 and job.ended(taken, delivered):
            return job.streams
        if n < 0 and not later.wait_for(int(job.active[-1 - n])):
            later.finish()  # rare: the source needs more epochs than planned; lay its stream out longer
            job.streams = job.streams.longer(int(job.active[-1 - n]))


def _epochs_wanted(shares: np.ndarray, totals: list[int], epoch_units: np.ndarray, biggest: int) -> list[int]:
    """Epochs of each source the phases will read: its shares of them and a margin per phase."""
    want = (shares * np.asarray(totals, np.float64)[:, None]).sum(axis=0) + len(totals) * MARGIN_BINS * biggest
    return [max(1, int(np.ceil(w / max(int(u), 1)))) for w, u in zip(want, epoch_units, strict=True)]


def _due(shares: np.ndarray, totals: list[int], epoch_units: np.ndarray, epochs: list[int]) -> list[tuple[int, int]]:
    """Every later epoch (source, epoch) laid out, in the order the phases are expected to reach it: where the
    source's share of the phases delivered so far crosses the epoch's start."""
    sizes = np.asarray(totals, np.float64)
    taken = np.vstack([np.zeros(shares.shape[1]), np.cumsum(shares * sizes[:, None], axis=0)])  # [P + 1, k]
    reached = np.concatenate([[0.0], np.cumsum(sizes)])
    due = []
    for i, n in enumerate(epochs):
        for epoch in range(1, n):
            x = epoch * float(epoch_units[i])
            p = min(int(np.searchsorted(taken[1:, i], x)), len(totals) - 1)
            span = taken[p + 1, i] - taken[p, i]
            due.append((reached[p] + sizes[p] * ((x - taken[p, i]) / span if span > 0 else 1.0), i, epoch))
    return [(i, epoch) for _, i, epoch in sorted(due)]
