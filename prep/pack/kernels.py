"""Packing documents into bins: the array-level pipeline (``pack_lengths``) and the kernels only it uses.

Everything here is pure (arrays in, arrays out, no I/O) and takes its options as a ``PackConfig``
(``xprep.prep.pack.config``); ``xprep.prep.pack.cache`` reads the datasets, keys, builds and publishes entries.
Vocabulary:

- *document*: one sequence of a token dataset, indexed globally over the input datasets.
- *item*: a run of tokens of one document placed in a bin (the whole document, its truncated
  head, or one piece of a split document).
- *cost*: an item's length rounded up to a multiple of ``2·cp_size`` (1 without context
  parallelism); the sum of costs in a bin never exceeds the capacity.

The pipeline: documents in visiting order (``document_order``) → items under the overlong policy
(``expand_items``) → items with no target token dropped (``item_targets``) → bins by the method's function
(``bin_items``: the bin-packing kernels of ``xprep.prep.pack.bins``) → optionally balanced over data-parallel
ranks (``xprep.prep.pack.balance``). A method whose bins are fixed-length samples of the document stream
(chunk) takes ``pack_chunks`` instead (``xprep.prep.pack.chunk``).

Its own module apart from the kernels it drives, so that those import no config (the method registry, which
holds the bin-packing ones, is read by the config). Kernels are top-level numba functions with ``cache=True``;
each one has a slow, obvious reference in ``tests/prep/pack/test_packing.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit, prange
from xprep.prep.errors import XprepError
from xprep.prep.pack.balance import balance_bins
from xprep.prep.pack.bins import bin_sums, gather_bins
from xprep.prep.pack.chunk import chunk_items, epoch_seed, samples_for, samples_for_epochs
from xprep.prep.pack.config import CAUSAL, PackConfig
from xprep.prep.pack.methods import BUILT_IN, OVERLONG, packing_method
from xprep.prep.pack.shuffle import shuffled_order

_POLICY_CODE = {policy: code for code, policy in enumerate(OVERLONG)}  # expand_items': 0 drop, 1 truncate, 2 split


@njit(cache=True)
def expand_items(lengths, order, capacity, policy):
    """Items of the documents, visited in ``order`` (empty = identity), under an overlong policy.

    policy 0 drops documents longer than ``capacity``, 1 keeps their first ``capacity`` tokens,
    2 splits them into pieces of ``capacity`` tokens (the last one shorter). Empty documents
    yield no item. Returns (item_doc int64, item_start int32, item_len int32).
    """
    shuffled = len(order) > 0
    visit = lengths[order] if shuffled else lengths  # one random pass, then sequential ones
    count = 0
    for length in visit:
        if length == 0 or (length > capacity and policy == 0):
            continue
        count += (length + capacity - 1) // capacity if (length > capacity and policy == 2) else 1
    item_doc = np.empty(count, np.int64)
    item_start = np.empty(count, np.int32)
    item_len = np.empty(count, np.int32)
    j = 0
    for k in range(len(visit)):
        length = visit[k]
        if length == 0 or (length > capacity and policy == 0):
            continue
        pieces = (length + capacity - 1) // capacity if (length > capacity and policy == 2) else 1
        for p in range(pieces):
            item_doc[j] = order[k] if shuffled else k
            item_start[j] = p * capacity
            item_len[j] = min(capacity, length - p * capacity)
            j += 1
    return item_doc, item_start, item_len


@njit(cache=True, parallel=True)
def item_targets(mask, doc_offsets, doc_lengths, item_doc, item_start, item_len, lookahead):
    """The target tokens of each item: what the trainer will learn from it (int64 per item).

    An item is tokens ``item_start … item_start + item_len`` of its document; its row predicts each token from
    the one before, so its first token is never a target, and token ``t`` of the rest is one where ``mask`` (the
    flat loss-mask stream, ``doc_offsets[d]`` where document ``d`` starts in it) is non-zero; an empty ``mask``
    (no loss-mask stream) makes every such token a target. ``lookahead`` (``--method chunk``): an item that stops
    inside its document also learns the token after it.
    """
    n = len(item_doc)
    out = np.empty(n, np.int64)
    masked = len(mask) > 0
    for i in prange(n):
        d, start, length = item_doc[i], np.int64(item_start[i]), np.int64(item_len[i])
        stop = start + length
        if lookahead and stop < doc_lengths[d]:
            stop += 1
        if not masked:
            out[i] = max(stop - start - 1, 0)
            continue
        base, s = doc_offsets[d], 0
        for t in range(start + 1, stop):
            s += mask[base + t] != 0
        out[i] = s
    return out


@njit(cache=True, parallel=True)
def sample_targets(mask, tokens, doc_offsets, doc_lengths, item_doc, item_start, item_len, opens, eod):
    """The target tokens of each item of a chunk sample trained with ``--attention causal`` or ``--eod-mask-loss``.

    ``item_targets`` with lookahead, but an item's first token is a target too unless ``opens[i]`` (the item
    opens an attention span: the sample's first item under ``causal``, every item under ``document``) or it is
    a document's first token in data with a loss mask (the manifest never counts those); and no token equal to
    ``eod`` is a target (``eod`` ≥ 0: ``--eod-mask-loss``; ``tokens``, the flat token stream, is read only then).
    """
    n = len(item_doc)
    out = np.empty(n, np.int64)
    masked = len(mask) > 0
    for i in prange(n):
        d, start = item_doc[i], np.int64(item_start[i])
        stop = start + np.int64(item_len[i])
        if stop < doc_lengths[d]:
            stop += 1  # the sample's last item: the token after it is the label of its last position
        lo = start + 1 if opens[i] else start
        if not masked and eod < 0:
            out[i] = max(stop - lo, 0)
            continue
        base, s = doc_offsets[d], 0
        for t in range(lo, stop):
            if masked and (t == 0 or mask[base + t] == 0):
                continue
            if eod >= 0 and tokens[base + t] == eod:
                continue
            s += 1
        out[i] = s
    return out


def span_openers(bin_offsets: np.ndarray, n_items: int) -> np.ndarray:
    """Per item, whether it opens its bin (``--attention causal``: the one item whose first token nothing predicts)."""
    opens = np.zeros(n_items, np.bool_)
    opens[bin_offsets[:-1][np.diff(bin_offsets) > 0]] = True
    return opens


@njit(cache=True, parallel=True)
def take_items(items, item_doc, item_start, item_len):
    """The three item arrays reordered by ``items`` (a parallel gather)."""
    doc = np.empty(len(items), item_doc.dtype)
    start = np.empty(len(items), item_start.dtype)
    length = np.empty(len(items), item_len.dtype)
    for k in prange(len(items)):
        i = items[k]
        doc[k] = item_doc[i]
        start[k] = item_start[i]
        length[k] = item_len[i]
    return doc, start, length


@njit(cache=True)
def range_bincount(values, starts, ends, size):
    """Occurrences of each value 0..size-1 in ``values[starts[k]:ends[k]]`` over all k (int64)."""
    out = np.zeros(size, np.int64)
    for k in range(len(starts)):
        for t in range(starts[k], ends[k]):
            out[values[t]] += 1
    return out


# ----------------------------------------------------------------------------------------- pipeline
Targets = Callable[..., np.ndarray]
"""(item_doc, item_start, item_len, lookahead, opens=None, mask_eod=False) → the target tokens of each item:
``item_targets`` over the data, or ``sample_targets`` for a chunk sample given ``opens`` (``span_openers``, under
``--attention causal``) or ``mask_eod`` (``--eod-mask-loss``, with the EOD id the closure was made with)."""


def unmasked_targets(lengths: np.ndarray) -> Targets:
    """``Targets`` of documents with no loss-mask stream: every token of an item but its first (no EOD known)."""
    lengths = np.ascontiguousarray(lengths, np.int64)

    def targets(item_doc, item_start, item_len, lookahead=False, opens=None, mask_eod=False):
        if mask_eod:
            raise ValueError("--eod-mask-loss needs the token streams: count targets with the datasets' Targets")
        if opens is None:
            return item_targets(_NO_MASK, _NO_OFFSETS, lengths, item_doc, item_start, item_len, lookahead)
        return sample_targets(_NO_MASK, _NO_TOKENS, _NO_OFFSETS, lengths, item_doc, item_start, item_len, opens, -1)

    return targets


_NO_MASK, _NO_OFFSETS, _NO_TOKENS = np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int32)


@dataclass
class Packed:
    """The result of packing: CSR bins over items, each bin's target tokens, plus statistics (JSON-able)."""

    bin_offsets: np.ndarray
    item_doc: np.ndarray
    item_start: np.ndarray
    item_len: np.ndarray
    stats: dict
    bin_targets: np.ndarray  # int32[n_bins]: tokens the trainer learns in each bin (never 0)
    bin_next_doc: np.ndarray | None = None  # --attention causal: the document after each sample (-1: none needed)


def pack_lengths(lengths: np.ndarray, config: PackConfig, docs: np.ndarray | None = None,
                 targets: Targets | None = None) -> Packed:
    """Pack documents of the given lengths (global index order) according to ``config``.

    ``docs``: the global ids of the documents to pack (a ``--split`` part), in order; None packs them all.
    Stats then count those documents only. ``targets`` counts each item's target tokens from the loss masks
    (default: ``unmasked_targets``): an item with none (a piece of a long user turn, a 1-token document) is
    dropped and counted, so no bin without a target is ever made.
    """
    lengths = np.ascontiguousarray(lengths, np.int32)
    targets = targets or unmasked_targets(lengths)
    if docs is not None:
        docs = np.asarray(docs, np.int64)
        packed = pack_lengths(lengths[docs], config, targets=lambda d, *rest: targets(docs[d], *rest))
        packed.item_doc = docs[packed.item_doc]
        if packed.bin_next_doc is not None:
            packed.bin_next_doc = np.where(packed.bin_next_doc < 0, -1, docs[packed.bin_next_doc])
        return packed
    if config.spec.fixed_length_samples:
        return pack_chunks(lengths, config, targets)
    order = document_order(len(lengths), config)
    arrays = expand_items(lengths, order, config.capacity, _POLICY_CODE[config.overlong])  # doc, start, len
    stats = overlong_stats(lengths, config.capacity, config.overlong)
    learned = targets(*arrays, False)
    arrays, learned, stats["no_target"] = drop_untrained(arrays, learned)
    costs = item_costs(arrays[2], config.align)
    offsets, items = bin_items(costs, config)
    if items is not None:
        arrays, learned = take_items(items, *arrays), learned[items]
    if config.balance_dp:
        offsets, items, stats["dp_balance"] = balance_bins(offsets, arrays[2], config.balance_dp,
                                                             config.dp_micro_batches)
        arrays, learned = take_items(items, *arrays), learned[items]
    item_doc, item_start, item_len = arrays
    stats.update(bin_stats(offsets, item_len, int(costs.sum(dtype=np.int64)), config.capacity))
    bin_targets = bin_sums(offsets, learned, False).astype(np.int32)
    stats["target_tokens"] = int(bin_targets.sum(dtype=np.int64))
    return Packed(offsets, item_doc, item_start, item_len, stats, bin_targets)


def drop_untrained(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], learned: np.ndarray
                   ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray, dict]:
    """The items with at least one target token, and what was dropped: pieces, their tokens, and the documents
    left with no item at all (e.g. a pasted user turn split into pieces before the one holding the answer)."""
    keep = learned > 0
    item_doc, _, item_len = arrays
    gone = ~keep
    if not gone.any():
        return arrays, learned, {"pieces": 0, "tokens": 0, "documents": 0}
    kept_doc = np.zeros(int(item_doc.max()) + 1, np.bool_)
    kept_doc[item_doc[keep]] = True  # linear: no sort of every item
    lost = np.unique(item_doc[gone])
    stats = {"pieces": int(gone.sum()), "tokens": int(item_len[gone].sum(dtype=np.int64)),
             "documents": int(np.count_nonzero(~kept_doc[lost]))}
    return tuple(a[keep] for a in arrays), learned[keep], stats


def pack_chunks(lengths: np.ndarray, config: PackConfig, targets: Targets) -> Packed:
    """A method of ``fixed_length_samples`` (chunk.py): the non-empty documents, epoch after epoch, cut into samples.

    Bin k is sample k. Stats have the keys of the other methods (no document is overlong: the stream cuts
    them) plus ``samples``, ``epochs`` (begun) and ``epoch_tokens``. A sample with no target token (only
    possible with loss masks: one inside a long prompt) is dropped and counted in ``no_target``.
    """
    nonempty = np.flatnonzero(lengths)
    sizes = lengths[nonempty].astype(np.int64)
    epoch_tokens, seq_len = int(sizes.sum()), config.seq_len
    if config.epochs is not None:
        samples, epochs = samples_for_epochs(config.epochs, epoch_tokens, seq_len)
    else:
        samples, epochs = samples_for(config.total_tokens, epoch_tokens, seq_len)
    order = chunk_order(len(sizes), epochs, config)
    offsets, pos, start, length = chunk_items(sizes[order], seq_len, samples)
    item_doc = nonempty[order[pos]]
    item_len = length.astype(np.int32)
    item_start = start.astype(np.int32)
    opens = span_openers(offsets, len(item_doc)) if config.attention == CAUSAL else None
    bin_targets = bin_sums(offsets, targets(item_doc, item_start, item_len, True, opens, config.eod_mask_loss), False)
    next_doc = None
    if config.attention == CAUSAL:
        after = next_positions(offsets, pos, start, length, sizes[order])
        next_doc = np.where(after < 0, -1, nonempty[order[np.maximum(after, 0)]])
        bin_targets += next_doc_targets(next_doc, targets, config.eod_mask_loss)
    stats = overlong_stats(lengths, np.iinfo(np.int64).max, config.overlong)  # counts the empty ones
    stats["no_target"] = {"pieces": 0, "tokens": 0, "documents": 0, "samples": int(np.sum(bin_targets == 0))}
    if stats["no_target"]["samples"]:
        kept = np.flatnonzero(bin_targets)
        stats["no_target"]["tokens"] = int(seq_len) * (len(bin_targets) - len(kept))
        offsets, items = gather_bins(offsets, kept)
        item_doc, item_start, item_len = take_items(items, item_doc, item_start, item_len)
        bin_targets = bin_targets[kept]
        next_doc = None if next_doc is None else next_doc[kept]
    stats.update({"samples": len(bin_targets), "epochs": epochs, "epoch_tokens": epoch_tokens})
    stats.update(bin_stats(offsets, item_len, int(item_len.sum(dtype=np.int64)), seq_len))
    stats["target_tokens"] = int(bin_targets.sum(dtype=np.int64))
    return Packed(offsets, item_doc, item_start, item_len, stats, bin_targets.astype(np.int32), next_doc)


def next_positions(offsets: np.ndarray, pos: np.ndarray, start: np.ndarray, length: np.ndarray,
                   visit_lengths: np.ndarray) -> np.ndarray:
    """Per sample, the position (in the visiting order) of the document whose first token follows it in the stream
    when the sample ends at its last document's end, else -1 (the token after it is then that document's next,
    which the trainer's lookahead reads). ``chunk_items`` cut the stream with one more token than its samples
    hold, so that position exists: under ``--attention causal`` its first token is the label of the sample's
    last position, as in Megatron's samples of S + 1 tokens."""
    last = offsets[1:] - 1  # every sample holds at least one item
    ends = start[last] + length[last] == visit_lengths[pos[last]]
    return np.where(ends, pos[last] + 1, -1)


def next_doc_targets(next_doc: np.ndarray, targets: Targets, mask_eod: bool) -> np.ndarray:
    """Per sample, 1 where the first token of ``next_doc`` (≥ 0) is a target, as the label of its last position:
    counted as an empty item at the document's start that does not open a span (``sample_targets``)."""
    out = np.zeros(len(next_doc), np.int64)
    named = np.flatnonzero(next_doc >= 0)
    if len(named):
        none = np.zeros(len(named), np.int64)
        out[named] = targets(next_doc[named], none, none, True, np.zeros(len(named), np.bool_), mask_eod)
    return out


def chunk_order(n_docs: int, epochs: int, config: PackConfig) -> np.ndarray:
    """Positions 0..n_docs-1 visited epoch after epoch: in order, or epoch e permuted with ``epoch_seed(seed, e)``."""
    if not config.shuffle:
        return np.tile(np.arange(n_docs, dtype=np.int64), epochs)
    parts = [shuffled_order(n_docs, epoch_seed(config.seed, e)) for e in range(epochs)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def document_order(n_docs: int, config: PackConfig) -> np.ndarray:
    """The visiting order of documents: a seeded permutation, or empty (= identity)."""
    if not config.shuffle:
        return np.zeros(0, np.int64)
    return shuffled_order(n_docs, config.seed)


def item_costs(item_len: np.ndarray, align: int) -> np.ndarray:
    if align == 1:
        return item_len
    return ((item_len + (align - 1)) // align * align).astype(np.int32)


def bin_items(costs: np.ndarray, config: PackConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """CSR offsets and the item order (None when items stay in order) by the configured method's ``bins`` function.

    The method is looked up in the registry here, whatever checked the config before: a name it does not hold
    (a config edited since, a method unregistered) is an error, never another method's packing.
    """
    spec = packing_method(config.method)
    if spec.bins is None:
        raise XprepError(f"--method {config.method} cuts the document stream into samples (pack_chunks); it has no "
                         "bins function to pack items with")
    offsets, items = spec.bins(costs, config.capacity, spec.option_values(config))
    if spec.name not in BUILT_IN:  # (the built-in ones are tested against slow references: tests/prep/pack)
        check_bins(spec.name, costs, config.capacity, offsets, items)
    return offsets, items


def check_bins(name: str, costs: np.ndarray, capacity: int, offsets: np.ndarray, items: np.ndarray | None) -> None:
    """Refuse what a registered method's ``bins`` returned unless it keeps the ``BinFunction`` contract: CSR offsets
    over every item, no bin empty, the items a permutation, no bin over ``capacity``. A broken plugin is a
    programmer's error (ValueError), caught before it publishes bins the trainer would overflow."""
    n = len(costs)
    offsets = np.asarray(offsets)
    order = np.arange(n) if items is None else np.asarray(items)
    problem = None
    if offsets.ndim != 1 or len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != n:
        problem = f"offsets must run from 0 to the {n:,} items"
    elif np.any(np.diff(offsets) <= 0):
        problem = "a bin is empty (offsets must increase)"
    elif len(order) != n or np.any(np.bincount(order, minlength=n) != 1):
        problem = "items must be a permutation of the items (each exactly once)"
    elif n and np.max(np.add.reduceat(np.asarray(costs, np.int64)[order], offsets[:-1])) > capacity:
        problem = f"a bin holds more than the capacity {capacity:,}"
    if problem:
        raise ValueError(f"packing method {name!r}: its bins function broke its contract: {problem}")


def overlong_stats(lengths: np.ndarray, capacity: int, overlong: str) -> dict:
    """Documents and tokens in, and what the overlong policy did to documents over capacity."""
    lengths64 = lengths.astype(np.int64, copy=False)
    over = lengths64[lengths64 > capacity]
    docs, toks = int(len(over)), int(over.sum())
    return {
        "documents_in": int(len(lengths)),
        "tokens_in": int(lengths64.sum()),
        "empty_documents": int(np.count_nonzero(lengths == 0)),
        "overlong_documents": docs,
        "dropped_documents": docs if overlong == "drop" else 0,
        "dropped_tokens": toks if overlong == "drop" else 0,
        "truncated_documents": docs if overlong == "truncate" else 0,
        "truncated_tokens": int((over - capacity).sum()) if overlong == "truncate" else 0,
        "split_documents": docs if overlong == "split" else 0,
        "split_pieces": int(((over + capacity - 1) // capacity).sum()) if overlong == "split" else 0,
    }


def bin_stats(offsets: np.ndarray, item_len: np.ndarray, cost_tokens: int, capacity: int) -> dict:
    """Bins, tokens kept, fill efficiency and the gap to the lower bound ⌈tokens/capacity⌉."""
    n_bins = len(offsets) - 1
    tokens = int(item_len.sum(dtype=np.int64))
    lower = -(-tokens // capacity)
    return {
        "bins": n_bins,
        "items": int(len(item_len)),
        "tokens": tokens,
        "cost_tokens": cost_tokens,
        "padding_tokens": n_bins * capacity - tokens,
        "fill": tokens / (n_bins * capacity) if n_bins else 0.0,
        "lower_bound_bins": lower,
        "gap_to_lower_bound": (n_bins - lower) / lower if lower else 0.0,
    }

