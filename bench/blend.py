"""Benchmark of the blend index (``prep.pack.blend.blend_bins``): 100M bins over 10 sources, against the previous one.

    python -m bench.blend            # 100M bins; every (mixture, implementation) in a fresh process
    python -m bench.blend --quick    # 1M bins
    python -m bench.blend --runs 5   # best of 5 warm runs instead of 3

Target (issue 11): the blend index of 100M bins over 10 sources ≤ 2 s, peak RSS < 2 GB. Two mixtures:
fixed-capacity bins (sequential/multipack/chunk: every bin counts its capacity) with every source holding
enough bins, and token-aware bins (each counts its tokens) where the five smallest sources repeat 4-5 times.

The new implementation uses both cores of the machine: a long blend runs in two parts at once (the second from
a guess of the greedy's state mid-way, taken over where the first meets it; ``xprep.prep.pack.blend.Ahead``), and a
repeated source's later epochs are shuffled beside the first part.

Baseline, measured in the same run on the same mixtures: the previous implementation (one thread), kept below as
``previous_blend_bins`` (its kernels verbatim: a full argmax per bin, in two chains for bin counts, a helper
call for every bin's index, and sizes read by bin id, i.e. at random in a repeated source's later epochs).
With phases: the same mixtures, the same total, in three phases of a third each (the mixture's weights,
then every other source's weight halved and the others' raised by half, then the weights again: an anneal on a
shifted mix, which asks each source about what the blend without phases does; ``blend.phased_blend``), timed
in their own processes beside the blend without phases, with their ratio to it. Target: ≤ 2 s as well.

Each (mixture, implementation) runs in its own process, so its peak RSS is its own; the outputs of both are
compared by digest. Seconds are the best of ``--runs`` warm runs (this machine is shared and noisy); numba's
compile is not in them and is shown apart: the first call in a fresh process (the on-disk cache loaded, or
compiled when there is none), and a compile from scratch of the same kernels without the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402
from xprep.prep.pack import blend  # noqa: E402
from xprep.prep.pack.shuffle import shuffled_order  # noqa: E402

CAPACITY = 8192
SOURCES = 10


def mixture(total_bins: int, kind: str) -> tuple[list[np.ndarray | int], np.ndarray, int]:
    """Bin sizes per source (bin counts for fixed-capacity), weights, total tokens for ``total_bins`` bins."""
    rng = np.random.default_rng(0)
    weights = rng.random(SOURCES) + 0.1
    weights /= weights.sum()
    if kind == "fixed":  # every source holds 1.2× its share: a cut, no repeat
        counts = (weights * total_bins * 1.2).astype(np.int64) + 1
        return [int(n) for n in counts], weights, total_bins * CAPACITY  # bin counts: every bin worth CAPACITY
    # token-aware: bins hold 50-100 % of the budget; the five smallest sources hold a quarter of their share
    counts = (weights * total_bins * np.where(np.argsort(np.argsort(weights)) < 5, 0.25, 1.2)).astype(np.int64) + 1
    sizes = [rng.integers(CAPACITY // 2, CAPACITY + 1, n).astype(np.int32) for n in counts]
    return sizes, weights, int(total_bins * CAPACITY * 0.75)


# ------------------------------------------------------------------ the previous implementation (baseline)
@njit(cache=True)
def _previous_bin_at(source, t, counts, later, later_offsets):
    if t < counts[source]:
        return t
    pos = later_offsets[source] + t - counts[source]
    return later[pos] if pos < later_offsets[source + 1] else -1


@njit(cache=True)
def previous_greedy_blend(weights, unit, sizes, size_offsets, counts, later, later_offsets, total_tokens,
                          out_source, out_index, taken, delivered):
    k = len(weights)
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
        t = taken[best]
        b = _previous_bin_at(best, t, counts, later, later_offsets)
        if b < 0:
            return -1 - best
        size = sizes[size_offsets[best] + b]
        out_source[n] = best
        out_index[n] = b
        taken[best] = t + 1
        delivered[best] += size
        total += size
        n += 1
    return n


@njit(cache=True)
def previous_greedy_blend_counts(weights, counts, later, later_offsets, n_bins, out_source, out_index, taken):
    k = len(weights)
    c = np.zeros(k, np.float64)
    for n in range(n_bins):
        scale = max(float(n), 1.0)
        b0, e0 = 0, weights[0] * scale - c[0]
        b1, e1 = 1, (weights[1] * scale - c[1]) if k > 1 else -np.inf
        for i in range(2, k - 1, 2):
            ea = weights[i] * scale - c[i]
            eb = weights[i + 1] * scale - c[i + 1]
            if ea > e0:
                b0, e0 = i, ea
            if eb > e1:
                b1, e1 = i + 1, eb
        if k > 2 and k % 2 == 1:
            ea = weights[k - 1] * scale - c[k - 1]
            if ea > e0:
                b0, e0 = k - 1, ea
        best = b1 if e1 > e0 or (e1 == e0 and b1 < b0) else b0
        t = taken[best]
        b = _previous_bin_at(best, t, counts, later, later_offsets)
        if b < 0:
            return -1 - best
        out_source[n] = best
        out_index[n] = b
        taken[best] = t + 1
        c[best] += 1.0
    return n_bins


def previous_later_orders(n_bins: int, epochs: int, seed: int, source: int, dtype=np.int32) -> np.ndarray:
    parts = [shuffled_order(n_bins, blend.epoch_seed(seed, source, e)).astype(dtype) for e in range(1, epochs)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def previous_blend_bins(bin_sizes: list[np.ndarray | int], weights: np.ndarray, unit: int, total_tokens: int,
                        seed: int) -> blend.Blend:
    weights = np.asarray(weights, np.float64) / np.sum(weights)
    k = len(bin_sizes)
    uniform = all(isinstance(s, int | np.integer) for s in bin_sizes)
    if not uniform:
        bin_sizes = [np.full(s, unit, np.int32) if isinstance(s, int | np.integer) else s for s in bin_sizes]
    counts = np.array([s if uniform else len(s) for s in bin_sizes], np.int64)
    tokens = counts * unit if uniform else np.array([int(np.sum(s, dtype=np.int64)) for s in bin_sizes], np.int64)
    biggest = unit if uniform else max(int(np.max(s)) for s in bin_sizes)
    smallest = unit if uniform else min(int(np.min(s)) for s in bin_sizes)
    epochs = [max(1, int(np.ceil((w * total_tokens + 2 * biggest) / max(t, 1))))
              for w, t in zip(weights, tokens, strict=True)]
    index_dtype = np.int32 if counts.max() < 2**31 else np.int64
    capacity = int(np.ceil(total_tokens / max(smallest, 1))) + k + 1
    out_source = np.empty(capacity, np.int16)
    out_index = np.empty(capacity, index_dtype)
    while True:
        later = [previous_later_orders(int(counts[i]), epochs[i], seed, i, index_dtype) for i in range(k)]
        later_offsets = np.concatenate([[0], np.cumsum([len(o) for o in later])])
        later = np.concatenate(later).astype(index_dtype)
        taken, delivered = np.zeros(k, np.int64), np.zeros(k, np.float64)
        if uniform:
            n = previous_greedy_blend_counts(weights, counts, later, later_offsets, -(-total_tokens // unit),
                                             out_source, out_index, taken)
            delivered = taken * float(unit)
        else:
            sizes = np.concatenate([np.asarray(s) for s in bin_sizes])
            size_offsets = np.concatenate([[0], np.cumsum(counts)])
            n = previous_greedy_blend(weights, float(unit), sizes, size_offsets, counts, later, later_offsets,
                                      float(total_tokens), out_source, out_index, taken, delivered)
        if n >= 0:
            break
        epochs[-1 - n] *= 2
    return blend.Blend(bin_source=out_source[:n], bin_index=out_index[:n], bins=taken,
                       tokens=delivered.astype(np.int64), epochs=np.maximum(1, -(-taken // counts)))


def phased_blend_bins(bin_sizes: list[np.ndarray | int], weights: np.ndarray, unit: int, total_tokens: int,
                      seed: int) -> blend.Blend:
    """The same mixture and total in three phases of a third each: its weights, shifted, then its weights again."""
    shifted = weights * np.where(np.arange(len(weights)) % 2 == 0, 0.5, 1.5)
    by_phase = np.stack([weights, shifted / shifted.sum(), weights])
    thirds = [total_tokens // 3, total_tokens // 3, total_tokens - 2 * (total_tokens // 3)]
    return blend.phased_blend(bin_sizes, by_phase, thirds, unit, seed).blend


IMPLEMENTATIONS = {"new": (blend.blend_bins, [blend.greedy_blend]),
                   "previous": (previous_blend_bins, [previous_greedy_blend, previous_greedy_blend_counts])}
PHASED = {"3 phases": (phased_blend_bins, [blend.phase_greedy])}


# ------------------------------------------------------------------------------------------- measuring
def compile_seconds(kernels: list) -> float:
    """Seconds to compile these kernels again from scratch (fresh dispatchers, no cache), for the signatures the
    runs used."""
    t0 = time.perf_counter()
    for kernel in kernels:
        fresh = njit(kernel.py_func)
        for signature in kernel.signatures:
            fresh.compile(signature)
    return time.perf_counter() - t0


def child(total_bins: int, kind: str, impl: str, runs: int) -> None:
    """Fresh process: the first (compiling or cache-loading) call on a small blend, then the best of ``runs``
    warm runs of the big one; print one JSON line."""
    sizes, weights, total = mixture(total_bins, kind)
    blend_bins, kernels = {**IMPLEMENTATIONS, **PHASED}[impl]
    small = [min(s, 100) if isinstance(s, int) else s[:100] for s in sizes]
    t0 = time.perf_counter()
    blend_bins(small, weights, CAPACITY, 50 * CAPACITY, seed=0)
    first = time.perf_counter() - t0
    seconds = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        b = blend_bins(sizes, weights, CAPACITY, total, seed=0)
        seconds = min(seconds, time.perf_counter() - t0)
        digest = hashlib.sha1()
        for field in (b.bin_source, b.bin_index, b.bins, b.tokens):
            digest.update(np.ascontiguousarray(field).data)  # no copy: the RSS stays the blend's own
        bins, epochs = len(b.bin_source), int(b.epochs.max())
        del b  # free the outputs before the next run
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    inputs = sum(getattr(s, "nbytes", 0) for s in sizes) / 2**20
    print(json.dumps({"seconds": seconds, "bins": bins, "rss": rss, "inputs": inputs, "epochs": epochs,
                      "first": first, "compile": compile_seconds(kernels), "digest": digest.hexdigest()[:16]}))


def run_child(n: int, kind: str, impl: str, runs: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.blend", "--child", str(n), kind, impl, str(runs)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M bins instead of 100M")
    parser.add_argument("--runs", type=int, default=3, help="warm runs per measurement; the best is shown")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2], int(args.child[3]))
        return
    n = 1_000_000 if args.quick else 100_000_000
    print(f"blend index of {n:,} bins over {SOURCES} sources (target ≤ 2 s, peak RSS < 2,048 MB); "
          f"best of {args.runs} warm runs, each implementation in its own process; load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    identical = True
    for kind in ("fixed", "token-aware"):
        got = {impl: run_child(n, kind, impl, args.runs) for impl in IMPLEMENTATIONS}
        for impl, r in got.items():
            print(f"  {kind:<12} {impl:<9} {r['seconds']:7.3f} s  {r['bins'] / r['seconds'] / 1e6:6.1f} M bins/s  "
                  f"peak RSS {r['rss']:,.0f} MB (bin sizes given: {r['inputs']:,.0f} MB)  first call "
                  f"{r['first']:.2f} s, compile from scratch {r['compile']:.2f} s")
        new, old = got["new"], got["previous"]
        identical &= new["digest"] == old["digest"]
        same = "identical" if new["digest"] == old["digest"] else "DIFFERENT"
        print(f"  {kind:<12} {'ratio':<9} {old['seconds'] / new['seconds']:7.2f} × faster  output {same} "
              f"({new['bins']:,} bins; most epochs of a source {new['epochs']})")
        for impl in PHASED:
            r = run_child(n, kind, impl, args.runs)
            print(f"  {kind:<12} {impl:<9} {r['seconds']:7.3f} s  {r['bins'] / r['seconds'] / 1e6:6.1f} M bins/s  "
                  f"peak RSS {r['rss']:,.0f} MB  {r['seconds'] / new['seconds']:.2f} × the blend without phases "
                  f"({r['bins']:,} bins)")
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    main()
