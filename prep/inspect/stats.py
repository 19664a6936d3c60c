"""Numbers about document lengths that several reports show (dataset, pack), computed one way."""

from __future__ import annotations

import numpy as np

PERCENTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)
DEFAULT_OVER = tuple(1024 << k for k in range(8))  # 1,024 … 131,072 tokens
LENGTH_BINS = 24  # rows of a length histogram: a factor of ~1.6 a row over 1 … 100k tokens
COUNT_BINS = 48  # documents per bin: one row per count up to this many distinct counts
FILL_BINS = 40  # fill per bin: slices of 2.5 % of the capacity
RATIO_BINS = 20  # max/mean imbalance per step
BINCOUNT_LIMIT = 1 << 22  # histograms of values below this count per value (32 MB at most): faster than a search


def length_stats(lengths: np.ndarray) -> dict:
    """Count, sum, mean and percentiles of document lengths."""
    if len(lengths) == 0:
        return {"count": 0, "sum": 0}
    pct = np.percentile(lengths, PERCENTILES, method="nearest")
    return {
        "count": int(len(lengths)),
        "sum": int(lengths.sum(dtype=np.int64)),
        "mean": round(float(lengths.mean()), 2),
        "percentiles": {f"p{p}": int(v) for p, v in zip(PERCENTILES, pct, strict=True)},
    }


def histogram(lengths: np.ndarray, bins: int = LENGTH_BINS) -> list[dict]:
    """Log-spaced length histogram (lengths span orders of magnitude); ``hi`` is inclusive."""
    if len(lengths) == 0:
        return []
    return _rows(lengths, log_edges(max(int(lengths.max()), 2), bins))


def count_histogram(values: np.ndarray, bins: int = COUNT_BINS) -> list[dict]:
    """Histogram of small whole numbers (documents per bin): one row per value from the least to the most
    when that fits in ``bins`` rows, else log-spaced rows as ``histogram``."""
    if len(values) == 0:
        return []
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < bins:
        edges = np.arange(lo, hi + 2, dtype=np.int64)
    else:
        edges = log_edges(hi, bins)
        edges = np.concatenate([[0], edges]) if lo == 0 else edges
    return _rows(values, edges)


def fill_histogram(tokens: np.ndarray, capacity: int, bins: int = FILL_BINS) -> list[dict]:
    """Bins' tokens in ``bins`` equal slices of the capacity (``lo``/``hi`` in tokens, ``hi`` inclusive; the
    last slice ends at the capacity): how full the bins are, in whole tokens so the edges are exact."""
    if len(tokens) == 0 or capacity < 1:
        return []
    edges = np.unique(np.round(np.linspace(0, capacity, bins + 1)).astype(np.int64))
    edges[-1] = max(capacity, int(tokens.max())) + 1  # the full bins (and, defensively, any beyond) count last
    return _rows(tokens, edges)


def ratio_histogram(ratios: np.ndarray, bins: int = RATIO_BINS) -> list[dict]:
    """Histogram of ratios ≥ 1 (max/mean imbalance) in ``bins`` equal slices from 1 up to the largest,
    edges rounded to 4 decimals so they read exactly; ``hi`` is the slice's end (the last one inclusive)."""
    if len(ratios) == 0:
        return []
    top = max(np.ceil(float(ratios.max()) * 1e4) / 1e4, 1.001)
    counts, edges = np.histogram(ratios, bins=np.round(np.linspace(1.0, top, bins + 1), 4))
    return [{"lo": float(a), "hi": float(b), "count": int(c)}
            for a, b, c in zip(edges[:-1], edges[1:], counts, strict=True)]


def log_edges(hi: int, bins: int) -> np.ndarray:
    """Distinct integer edges from 1 to ``hi + 1``, spaced evenly on a log scale."""
    return np.unique(np.geomspace(1, hi + 1, bins + 1).astype(np.int64))


def _rows(values: np.ndarray, edges: np.ndarray) -> list[dict]:
    """``{"lo", "hi", "count"}`` per slice ``[edges[k], edges[k+1])`` of whole numbers (``hi`` inclusive),
    counted in vectorized passes however many values there are: a count per value (``np.bincount``) summed
    over each slice where the values are small, else each value's slice found by ``np.searchsorted``."""
    top = int(edges[-1])
    if top <= BINCOUNT_LIMIT and (len(values) == 0 or int(values.min()) >= 0):
        per_value = np.bincount(values, minlength=top)[:top]
        counts = np.add.reduceat(per_value, edges[:-1])
    else:
        slot = np.searchsorted(edges, values, side="right") - 1
        inside = (slot >= 0) & (slot < len(edges) - 1)
        counts = np.bincount(slot[inside], minlength=len(edges) - 1)
    return [{"lo": int(a), "hi": int(b) - 1, "count": int(c)}
            for a, b, c in zip(edges[:-1], edges[1:], counts, strict=True)]


def default_over(lengths: np.ndarray) -> tuple[int, ...]:
    """Powers of two from 1,024 up to the first one no document exceeds."""
    longest = int(lengths.max()) if len(lengths) else 0
    below = sum(1 for t in DEFAULT_OVER if t < longest)
    return DEFAULT_OVER[:below + 1]


def over_counts(lengths: np.ndarray, thresholds: tuple[int, ...]) -> list[dict]:
    """Documents (and their tokens) longer than each threshold: what packing at that capacity cuts."""
    n, total = len(lengths), int(lengths.sum(dtype=np.int64))
    out = []
    for t in thresholds:
        longer = lengths > t
        docs, tokens = int(np.count_nonzero(longer)), int(lengths.sum(dtype=np.int64, where=longer))
        out.append({"length": int(t), "documents": docs, "share": docs / n if n else 0.0,
                    "tokens": tokens, "token_share": tokens / total if total else 0.0})
    return out
