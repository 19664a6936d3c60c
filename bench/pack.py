"""Benchmark of ``xprep pack``: speed, density and memory against baselines measured in the same run.

    python bench/pack.py            # 1M and 10M documents (a few minutes on 2 cores)
    python bench/pack.py --quick    # small smoke run

Lengths are sampled from real SFT lengths (chitchat, Qwen3 template, tokenized by ``xprep
tokenize``) when ../shared/data is present, else from a lognormal fit of them. Baseline: axolotl's
multipack as described in its sampler (first-fit in sampler order over groups of 100,000, at
most 200 items per bin, one group per task on 2 processes), numba-compiled like ours.
Targets (issue 3): multipack ≤ 0.5 s at 1M and ≤ 5 s at 10M, ≥ 5× the baseline at equal or better
density, peak RSS < 1.5 GB at 10M; sequential and token-aware ≥ 10M documents/s; a cache hit on a
10M-document pack < 1 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py would shadow the standard library's `tokenize` (sys.path[0] is this folder).
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter, TokenDataset  # noqa: E402
from xprep.prep.pack.cache import PackConfig, pack  # noqa: E402
from xprep.prep.pack.kernels import pack_lengths  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
CAPACITY = 8192
AXOLOTL_GROUP = 100_000
AXOLOTL_BIN_ITEMS = 200


# ------------------------------------------------------------------------------------------ lengths
def real_lengths() -> np.ndarray | None:
    chat, tok = DATA / "chat" / "chitchat.jsonl", DATA / "tokenizers" / "qwen3"
    if not chat.is_file():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ds"
        run = subprocess.run([sys.executable, "-c", "from xprep import cli; cli.xprep()", "tokenize", str(chat), "-o",
                              str(out), "--tokenizer", str(tok)], cwd=ROOT, capture_output=True, text=True)
        if run.returncode:
            print(f"(tokenize failed, using a lognormal fit: {run.stderr.strip()[-200:]})")
            return None
        return np.array(TokenDataset(out).lengths)


def sample_lengths(n: int, source: np.ndarray | None, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if source is not None:
        return rng.choice(source, n).astype(np.int32)
    return np.clip(rng.lognormal(6.0, 1.3, n), 16, 30_000).astype(np.int32)  # fit of chitchat/Qwen3


# ----------------------------------------------------------------------------------------- baseline
@njit(cache=True)
def axolotl_first_fit(lengths, capacity, max_items):
    """axolotl ``pack_group``: first fit in the given order, scanning bins from the first."""
    remaining = np.empty(len(lengths), np.int64)
    count = np.empty(len(lengths), np.int64)
    n_bins = 0
    for i in range(len(lengths)):
        size = lengths[i]
        placed = False
        for b in range(n_bins):
            if remaining[b] >= size and count[b] < max_items:
                remaining[b] -= size
                count[b] += 1
                placed = True
                break
        if not placed:
            remaining[n_bins] = capacity - size
            count[n_bins] = 1
            n_bins += 1
    return n_bins


def _axolotl_task(group: np.ndarray) -> int:
    return axolotl_first_fit(group, CAPACITY, AXOLOTL_BIN_ITEMS)


def _warm(_=None) -> int:
    return axolotl_first_fit(np.array([1, 2], np.int32), CAPACITY, AXOLOTL_BIN_ITEMS)


def axolotl_baseline(lengths: np.ndarray, pool) -> tuple[float, int]:
    """(seconds, bins) for 2 processes over groups of 100,000 in sampler order (overlong dropped)."""
    kept = lengths[lengths <= CAPACITY]
    groups = [kept[i:i + AXOLOTL_GROUP] for i in range(0, len(kept), AXOLOTL_GROUP)]
    t0 = time.perf_counter()
    bins = sum(pool.map(_axolotl_task, groups, chunksize=1))
    return time.perf_counter() - t0, bins


# ------------------------------------------------------------------------------------------ ours
def timed_pack(lengths: np.ndarray, config: PackConfig, repeat: int) -> tuple[float, dict]:
    best, stats = float("inf"), {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        stats = pack_lengths(lengths, config).stats
        best = min(best, time.perf_counter() - t0)
    return best, stats


def warm_up() -> None:
    small = np.random.default_rng(1).integers(1, 9000, 5000).astype(np.int32)
    for config in (PackConfig(method="multipack", seq_len=CAPACITY), PackConfig(method="sequential", seq_len=CAPACITY),
                   PackConfig(method="token-aware", max_tokens=CAPACITY, balance_dp=2)):
        pack_lengths(small, config)


def peak_rss_child(n: int, source_path: str) -> None:
    """Child mode: multipack n documents, print seconds and peak RSS (MB)."""
    source = np.load(source_path) if source_path else None
    lengths = sample_lengths(n, source if source is not None and len(source) else None)
    warm_up()
    t0 = time.perf_counter()
    stats = pack_lengths(lengths, PackConfig(method="multipack", seq_len=CAPACITY)).stats
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{seconds:.4f} {rss:.1f} {stats['fill']:.6f}")


def measure_peak_rss(n: int, source: np.ndarray | None) -> tuple[float, float]:
    with tempfile.NamedTemporaryFile(suffix=".npy") as f:
        np.save(f.name, source if source is not None else np.zeros(0, np.int32))
        out = subprocess.run([sys.executable, __file__, "--rss-child", str(n), f.name], capture_output=True,
                             text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def cache_hit_seconds(n: int) -> tuple[float, float]:
    """A real n-document dataset (short documents) packed once; then a hit in-process and via the CLI."""
    with tempfile.TemporaryDirectory() as tmp:
        ds = Path(tmp) / "ds"
        lengths = np.random.default_rng(0).integers(1, 9, n)
        with DatasetWriter(ds, vocab_size=1000) as w:
            w.append(np.zeros(int(lengths.sum()), np.uint16), lengths)
            w.finish({"tokenizer": {"path": "bench", "vocab_size": 1000}}, CategoryTable())
        config = PackConfig(method="multipack", seq_len=CAPACITY)
        pack([ds], Path(tmp) / "P", config)
        t0 = time.perf_counter()
        assert pack([ds], Path(tmp) / "P", config).hit
        in_process = time.perf_counter() - t0
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", "from xprep import cli; cli.xprep()", "pack", str(ds), "-o",
                              str(Path(tmp) / "P"), "--method", "multipack", "--seq-len", str(CAPACITY)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        cli_seconds = time.perf_counter() - t0
        assert run.stdout.startswith("cache hit"), run.stdout
        return in_process, cli_seconds


# ------------------------------------------------------------------------------------------- report
def bench_size(n: int, source: np.ndarray | None, pool, repeat: int) -> None:
    lengths = sample_lengths(n, source)
    ours, s = timed_pack(lengths, PackConfig(method="multipack", seq_len=CAPACITY), repeat)
    base, base_bins = axolotl_baseline(lengths, pool)
    lower = s["lower_bound_bins"]
    print(f"\n{n:,} documents, capacity {CAPACITY}")
    print(f"  multipack (ours)    {ours:7.3f} s  {n / ours / 1e6:6.1f} M docs/s  bins {s['bins']:,} "
          f"fill {s['fill']:.4%}  gap +{s['gap_to_lower_bound']:.4%}")
    print(f"  axolotl reference   {base:7.3f} s  {n / base / 1e6:6.1f} M docs/s  bins {base_bins:,} "
          f"fill {s['tokens'] / (base_bins * CAPACITY):.4%}  gap +{(base_bins - lower) / lower:.4%}")
    print(f"  speed-up            {base / ours:7.1f} x   (target ≥ 5x; density {'≥' if s['bins'] <= base_bins else '<'}"
          f" reference)")
    for method, config in (("sequential", PackConfig(method="sequential", seq_len=CAPACITY)),
                           ("token-aware", PackConfig(method="token-aware", max_tokens=CAPACITY)),
                           ("token-aware dp8", PackConfig(method="token-aware", max_tokens=CAPACITY, balance_dp=8))):
        t, st = timed_pack(lengths, config, repeat)
        extra = ""
        if "dp_balance" in st:
            b = st["dp_balance"]
            extra = (f"  Σlen² max/mean per step {b['imbalance_before']['mean']:.3f} → "
                     f"{b['imbalance_after']['mean']:.3f}, per micro-step "
                     f"{b['micro_step_imbalance_before']['mean']:.3f} → {b['micro_step_imbalance_after']['mean']:.3f}")
        print(f"  {method:<19} {t:7.3f} s  {n / t / 1e6:6.1f} M docs/s  fill {st['fill']:.4%}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        peak_rss_child(int(args.rss_child[0]), args.rss_child[1])
        return
    source = real_lengths()
    what = f"chitchat (Qwen3 template), {len(source):,} documents" if source is not None else "lognormal fit"
    print(f"lengths sampled from: {what}")
    warm_up()
    sizes = [100_000] if args.quick else [1_000_000, 10_000_000]
    with mp.get_context("fork").Pool(2, initializer=_warm) as pool:
        pool.map(_warm, range(2))  # wait until both workers have loaded the baseline: it must not time us
        for n in sizes:
            bench_size(n, source, pool, repeat=2 if n > 1_000_000 else 3)
    n_big = sizes[-1]
    seconds, rss = measure_peak_rss(n_big, source)
    print(f"\nmultipack {n_big:,} in a fresh process: {seconds:.3f} s, peak RSS {rss:,.0f} MB (target < 1,500 MB)")
    in_process, cli_seconds = cache_hit_seconds(n_big)
    print(f"cache hit on a {n_big:,}-document pack: {in_process:.3f} s in-process, {cli_seconds:.3f} s "
          "for the whole `xprep pack` command (target < 1 s)")


if __name__ == "__main__":
    main()
