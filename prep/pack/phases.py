"""Phased blends: one order of bins whose mix changes phase after phase (a mix file's ``phases:``).

Each phase is a blend of its own (``xprep.prep.pack.blend.blend_bins``: Megatron's greedy rule over the sources the
phase weighs, from a fresh start, so its shares hold after every prefix of the phase exactly as a blend's do), and
the phases follow each other in one order. What carries over from one phase to the next is where each source
stands in its own stream of bins: a source gives its bins as one endless stream (its first epoch in the pack's
order, or in a seeded random order when the whole mix takes less than an epoch of it, then each later epoch in a
fresh permutation seeded by (seed, source, epoch), as a blend's repeats are), and a phase takes each source's next
bins from where the previous phase left it. So no phase serves a source's documents again from the start: a bin
comes back only once its source's stream has gone round a whole epoch, which happens where the phases together
ask more of a source than one epoch holds (then, as in a blend, the next epoch, a new permutation), and within a
phase only where that phase alone asks more of it than it has left in its current epoch.

``phased_blend`` works on arrays alone (sizes in blend units, weights per phase, each phase's size): the mix file,
blend.json and the reports are ``xprep.prep.pack.mixture``'s.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from numba import njit
from xprep.prep.pack.blend import Blend, blend_bins, epoch_seed
from xprep.prep.pack.shuffle import shuffled_order

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
        self.count, self.first, self.seed, self.source = count, first, seed, source
        self._epochs: dict[int, np.ndarray | Future] = {}

    def prepare(self, pool: ThreadPoolExecutor, epochs: int) -> None:
        """Permute epochs 1 … epochs−1 in ``pool``, beside the blend (whose kernel holds no GIL)."""
        for e in range(1, epochs):
            self._epochs.setdefault(e, pool.submit(self._permutation, e))

    def _permutation(self, epoch: int) -> np.ndarray:
        return shuffled_order(self.count, epoch_seed(self.seed, self.source, epoch))

    def in_pack_order(self, start: int, stop: int) -> bool:
        """Whether positions [start, stop) are the pack's bins start … stop−1 (the first epoch in its own order)."""
        return self.first is None and stop <= self.count

    def window(self, start: int, stop: int) -> np.ndarray:
        """The bins at positions [start, stop) of the stream."""
        parts = []
        for epoch in range(start // self.count, (stop - 1) // self.count + 1):
            lo, hi = max(start, epoch * self.count), min(stop, (epoch + 1) * self.count)
            parts.append(self.epoch(epoch)[lo - epoch * self.count:hi - epoch * self.count])
        return np.concatenate(parts).astype(np.int64, copy=False)

    def epoch(self, epoch: int) -> np.ndarray:
        """The bins of one epoch, in the order it gives them (each later epoch permuted once, then kept: the
        memory a blend's prepared later epochs take)."""
        if epoch == 0:
            return np.arange(self.count, dtype=np.int64) if self.first is None else self.first
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
    taken = np.bincount(local_source, minlength=len(active)).astype(np.int64)
    assert np.all(taken <= [b - a for a, b, _ in windows]), "a phase ran a source past its prepared window"
    gathered = np.array([order is not None for _, _, order in windows])
    lookup = [order for _, _, order in windows if order is not None]
    offset = np.zeros(len(active), np.int64)
    offset[gathered] = np.cumsum([0, *(len(w) for w in lookup[:-1])])
    offset[~gathered] = [a for a, _, order in windows if order is None]
    place_phase(local_source, local_index, active.astype(np.int16), offset,
                np.concatenate(lookup) if lookup else np.zeros(1, np.int64), gathered, out_source, out_index)
    if n == len(part.bin_source):
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
