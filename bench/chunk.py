"""Benchmark of ``--method chunk``'s sample index against megatron-core's ``build_sample_idx``, same run.

    python -m bench.chunk            # 1B tokens (about 1M documents), sequence length 4096
    python -m bench.chunk --quick    # 100M tokens

Both cut the same stream (documents in a seeded shuffled order, one epoch) into samples of S + 1 tokens;
ours also produces the pack's items (the document pieces of every sample), Megatron only the sample
starts. The boundaries are checked equal before timing. Target (issue 11): within 2× of
``build_sample_idx``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from xprep.prep.pack.chunk import chunk_items, samples_for


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100M tokens instead of 1B")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    try:
        from megatron.core.datasets.helpers import build_sample_idx
    except ImportError:
        raise SystemExit("needs megatron-core (pip install -e '.[test]')") from None
    target = 100_000_000 if args.quick else 1_000_000_000
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.5, 1.0, size=int(target / 1100) + 1), 1, 200_000).astype(np.int32)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths, dtype=np.int64), target) + 1]
    order = rng.permutation(len(lengths)).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    seq = args.seq_len
    samples, _ = samples_for(None, tokens, seq)
    print(f"{tokens / 1e9:.2f}B tokens in {len(lengths):,} documents, seq {seq}: {samples:,} samples")

    ours = chunk_items(lengths, seq, samples, order)
    theirs = build_sample_idx(lengths, order, seq, 1, tokens, True, True)
    firsts = ours[0][:-1]
    assert np.array_equal(ours[1][firsts], theirs[:-1, 0]) and np.array_equal(ours[2][firsts], theirs[:-1, 1])
    print(f"  boundaries equal to build_sample_idx for all {samples:,} samples; "
          f"{len(ours[1]):,} items ({len(ours[1]) / samples:.2f} per sample)")

    t_ours = best_of(lambda: chunk_items(lengths, seq, samples, order), 3)
    t_mega = best_of(lambda: build_sample_idx(lengths, order, seq, 1, tokens, True, True), 3)
    print(f"  xprep chunk_items       {t_ours:7.3f} s  (sample starts + every item of every sample)")
    print(f"  megatron build_sample_idx {t_mega:7.3f} s  (sample starts only)")
    print(f"  ratio ours / megatron: {t_ours / t_mega:.2f}x  (target <= 2x)")


if __name__ == "__main__":
    main()
