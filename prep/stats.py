"""Numbers about document lengths that several reports show (dataset, pack), computed one way."""

from __future__ import annotations

import numpy as np

PERCENTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)
DEFAULT_OVER = tuple(1024 << k for k in range(8))  # 1,024 … 131,072 tokens


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


def histogram(lengths: np.ndarray, bins: int = 12) -> list[dict]:
    """Log-spaced length histogram (lengths span orders of magnitude)."""
    if len(lengths) == 0:
        return []
    hi = max(int(lengths.max()), 2)
    edges = np.unique(np.geomspace(1, hi + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    return [{"lo": int(a), "hi": int(b) - 1, "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts,
                                                                                 strict=True)]


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
