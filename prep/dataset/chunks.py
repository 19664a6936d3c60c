"""Scattered parts of a dataset's streams in bounded memory, for readers that visit many documents once: ``xprep
pack``'s target counts (the loss mask, with ``--eod-mask-loss`` the tokens too), ``xprep inspect``'s categories of
what a pack removed, a run's lineage.

A local dataset's stream is its memory map, whole, at once: the OS pages in what is read. A dataset at a URL
(``StreamedDataset``) is fetched by range, about ``budget`` items at a time, neighbouring ranges as one request
(``coalesce_ranges``): a pack of a multi-terabyte dataset holds a few megabytes of its loss mask at any time, never
the whole stream (one byte a token: as big as the memory of the machine for a dataset of a trillion tokens).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from xprep.prep.dataset.remote import read_item_ranges
from xprep.prep.dataset.stream import COALESCE_GAP, coalesce_ranges, containing

CHUNK_ITEMS = 8 << 20  # items of the ranges asked for held at a time, per stream (about)


def stream_chunks(ds, streams: list, lo: np.ndarray, hi: np.ndarray, budget: int | None = None
                  ) -> Iterator[tuple[list[np.ndarray], np.ndarray, slice]]:
    """``(items, starts, part)`` for consecutive slices ``part`` of the ranges ``[lo[k], hi[k])`` (in items of the
    ``streams`` of ``ds``, which index alike: the loss mask, categories and tokens of one dataset): ``items[s]``
    holds stream ``s``, range ``part.start + j`` at ``items[s][starts[j]:starts[j] + hi - lo]``, the same offsets in
    every stream. Ranges in any order; the fewer a slice's gaps, the fewer its requests. ``budget``: items a slice
    holds (about; default ``CHUNK_ITEMS``)."""
    budget = budget or CHUNK_ITEMS
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if not getattr(ds, "streamed", False):
        yield [s.items for s in streams], lo, slice(0, len(lo))
        return
    n = np.maximum(hi - lo, 0)
    chunk = (np.cumsum(n) - n) // budget  # the chunk each range starts in
    bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(n)]
    widest = max(s.dtype.itemsize for s in streams)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        span_lo, span_hi = coalesce_ranges(lo[a:b], hi[a:b], COALESCE_GAP // widest)  # in items: alike in all
        items = [np.concatenate([np.zeros(0, s.dtype), *read_item_ranges(s.url, s.dtype, span_lo, span_hi, s.retry,
                                                                          budget * s.dtype.itemsize)])
                 for s in streams]
        k = containing(lo[a:b], span_lo, span_hi)  # -1: an empty range (read nowhere)
        base = np.cumsum(span_hi - span_lo) - (span_hi - span_lo)
        safe = np.maximum(k, 0)
        yield items, np.where(k >= 0, base[safe] + lo[a:b] - span_lo[safe] if len(span_lo) else 0, 0), slice(a, b)
