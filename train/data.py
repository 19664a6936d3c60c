"""Micro-batches from a pack entry: memory-mapped streams sliced by document, one bin a row.

A bin is a list of items (a document range each). ``PackedDataset[b]`` lays the items of bin
``b`` side by side and pads the rest of the capacity with one dummy document; the result is the
micro-batch of that one bin, torch tensors:

    input_ids     int64 (1, capacity)  the tokens
    labels        int64 (1, capacity)  labels[t] = input_ids[t+1] when token t+1 is a target of the
                                       same item, else -100 (an item's last token never predicts the
                                       next item's first; padding never has targets). In a pack whose
                                       pack.json says "lookahead": true (--method chunk), an item that
                                       stops inside its document labels its last token with the
                                       document's next token (if a target): never across documents
    position_ids  int64 (1, capacity)  restart at 0 at every item and at the padding document
    category_ids  int64 (1, capacity)  category of the *target* at t (aligned with labels; 0 elsewhere)
    source_ids    int64 (1, capacity)  the bin's source (a blend's source index, ``source_names``; 0 for a
                                       plain pack), on every position
    cu_seqlens    int32 (n_docs+1,)    document boundaries, padding document included

A chunk pack made with ``--attention causal`` (pack.json's config) trains each bin, one sample, as Megatron's
GPTDataset does by default: one attention span (``cu_seqlens`` [0, S]), positions 0..S-1, and the last token of
each document labelled with the next document's first token (a target in data without a loss mask; data with one
never learns a document's first token). With ``--eod-mask-loss`` no label is the EOD token (pack.json's
``eod_id``, the datasets' ``tokenizer.eod_id``). Context parallelism then zigzags each sample as one document.

``collate`` puts the bins of a micro-batch one after the other in a single row (1, M·capacity)
with ``cu_seqlens`` over all of them: the model sees documents, never bins. ``micro_batch`` is the whole
path a micro-batch takes in ``xtrain run`` (bins → collate → this CP rank's zigzag shard), the trainer's and
the Python API's alike.

A bin is filled by one compiled call (``fill_bin`` → ``fill_items`` + ``pad_bin``, numba, cached on
disk) that copies each item's slice of the streams and writes labels, positions and categories
in the same pass; the slow obvious reference of ``fill_items`` is ``fill_items_reference``
(tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
from xprep.prep.dataset import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_RETRY_S,
    MAX_CATEGORY,
    BlockCache,
    CategoryTable,
    StreamedDataset,
    TokenDataset,
    open_block_cache,
)
from xprep.prep.errors import XprepError
from xprep.prep.pack import PackBins, PackEntry, check_chunk_cp, methods_of, open_entry
from xprep.train.cp import padded_length, shard_batch
from xprep.train.loss import IGNORE

BATCH_KEYS = ("input_ids", "labels", "position_ids", "category_ids", "source_ids", "cu_seqlens")


@dataclass
class _Source:
    """One input dataset of the pack: its streams as flat arrays plus token offsets per document."""

    tokens: np.ndarray
    loss_mask: np.ndarray  # empty when the dataset has no loss mask stream
    category_ids: np.ndarray  # empty when the dataset has no category stream
    offsets: np.ndarray  # int64[n_docs + 1]
    streamed: StreamedDataset | None = None  # a dataset at a URL: the three streams are read through it instead


def pad_token_id(ds: TokenDataset) -> int:
    """The tokenizer's pad id, else its eod id, else 0 (padding is never a target anyway)."""
    tok = ds.manifest.get("tokenizer") or {}
    for key in ("pad_id", "eod_id", "eos_id"):
        if isinstance(tok.get(key), int):
            return tok[key]
    return 0


class PackedDataset:
    """Map-style dataset over the bins of a pack entry; picklable (workers reopen the files).

    With ``cp_size`` C > 1 a bin's padding document is shortened by the room context parallelism
    needs: every document is padded to a multiple of 2·C when it is sharded (train/cp.py), and
    a pack made with ``--cp-size C`` counted that room in its bins, so once sharded every bin is
    exactly ``capacity`` tokens again. Packs made for another CP size are refused. A chunk pack's
    bins are full samples that CP zigzags whole (``cp_sample_len``): they stay as they are, and
    any C with 2·C dividing the sample length will do.

    Datasets at URLs are read in place (prep/dataset/stream.py): by range, through one block cache of
    ``cache_size`` bytes on local disk (``cache``; None when every dataset is local), retrying transient errors
    for ``stream_timeout`` seconds. train/prefetch.py fetches the ranges of the next steps ahead.
    """

    def __init__(self, packed: str | Path, verify_data: bool = False, cp_size: int = 1,
                 cache_size: int = DEFAULT_CACHE_SIZE, stream_timeout: float = DEFAULT_RETRY_S):
        self.packed = Path(packed)
        self.verify_data = verify_data
        self.cp_size = cp_size
        self.cache_size, self.stream_timeout = cache_size, stream_timeout
        self.entry = open_entry(packed)  # a plain pack entry or a blend of several
        check_cp_size(self.entry, cp_size)
        self.bins = PackBins(self.entry, verify_data, stream=True)  # bin → source and items over one document index
        self.datasets = self.bins.datasets
        if not self.datasets:
            raise XprepError(f"{self.entry.path}/pack.json: lists no input datasets; re-run `xprep pack`")
        self.capacity = self.entry.capacity
        self.lookahead = bool(self.entry.meta.get("lookahead"))  # --method chunk: items cut by sample ends
        self.whole_samples = is_chunk_pack(self.entry)  # bins always full: CP zigzags each bin, not each document
        self.pad_id = pad_token_id(self.datasets[0])
        self.causal = self.whole_samples and self.entry.one_span  # --attention causal: one span per sample
        self.eod_id = masked_eod(self.entry, self.datasets[0])  # --eod-mask-loss: never a label
        self._sources = [_source(ds) for ds in self.datasets]
        self.cache = _stream_cache(self.datasets, cache_size, stream_timeout)
        self._category_names, self._category_maps = merge_categories([ds.category_names for ds in self.datasets])
        counts = np.array([len(ds) for ds in self.datasets], np.int64)
        self._doc_base = np.concatenate([[0], np.cumsum(counts)])

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def category_names(self) -> list[str]:
        """Names by category id (0 = uncategorized), merged over the input datasets."""
        return list(self._category_names)

    @property
    def source_names(self) -> list[str]:
        """Names by source id (``source_ids``): a blend's sources, or the one dataset of a plain pack."""
        return list(self.bins.source_names)

    @property
    def cp_sample_len(self) -> int | None:
        """What ``xprep.train.cp.shard_batch`` zigzags under CP: whole samples of this many tokens (a chunk pack's
        bins), or None: each document."""
        return self.capacity if self.whole_samples else None

    @property
    def vocab_size(self) -> int | None:
        return (self.datasets[0].manifest.get("tokenizer") or {}).get("vocab_size")

    def __len__(self) -> int:
        return self.entry.num_bins

    def bin_tokens(self, bins: list[int]) -> int:
        """Real (non-padding) tokens in these bins."""
        return self.bins.bin_tokens(bins)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        source, docs, starts, lens = self.bins.items(b)
        return self.assemble(docs, starts, lens, source, self.bins.next_doc(b))

    def assemble(self, docs: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 source: int = 0, next_doc: int = -1) -> dict[str, torch.Tensor]:
        """The micro-batch of one bin whose items are (doc, start, len), from ``source``: tensors (1, capacity).
        ``next_doc``: the document after the sample (``PackBins.next_doc``), whose first token labels its end."""
        block = np.empty((5, 1, self.capacity), np.int64)  # the fill kernels write rows 0-3; row 4: source
        out = block.reshape(5, self.capacity)
        out[4] = source
        cu = np.empty(len(docs) + 2, np.int32)
        if len(self._sources) == 1 and self._sources[0].streamed is None:
            src = self._sources[0]
            n = fill_bin(src.tokens, src.loss_mask, src.category_ids, src.offsets, docs, starts, lens,
                         self.pad_id, out, cu, self.lookahead)
        else:
            n = self._fill_from_several(docs, starts, lens, out, cu)
        if n < 0:
            raise XprepError(f"{self.entry.path}: a bin holds {int(np.sum(lens))} tokens, more than its capacity "
                             f"{self.capacity}; the pack is corrupt: re-run `xprep pack --force`")
        if self.causal:
            n = self._one_span(out, cu, docs, starts, lens, next_doc)
        if self.eod_id is not None:
            eod = out[1] == self.eod_id
            out[1, eod], out[3, eod] = IGNORE, 0
        if self.cp_size > 1 and not self.whole_samples:
            block, cu, n = self._make_room_for_cp(block, cu, n, lens)
        ids, labels, pos, cats, sources = torch.from_numpy(block).unbind(0)
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "category_ids": cats,
                "source_ids": sources, "cu_seqlens": torch.from_numpy(cu[:n])}

    def _one_span(self, out: np.ndarray, cu: np.ndarray, docs: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray, next_doc: int) -> int:
        """``--attention causal``: the bin (a chunk sample, always full) becomes one document: positions 0..S-1,
        and the last token of every document in it is labelled with the first token of the next one in the stream
        (the next item's, or ``next_doc``'s at the sample's end; the lookahead labels one cut inside its document).
        Returns the number of ``cu`` entries (2)."""
        lens = lens.astype(np.int64)
        if int(lens.sum()) != self.capacity:
            raise XprepError(f"{self.entry.path}: a chunk sample holds {int(lens.sum())} tokens, not --seq-len "
                             f"{self.capacity}; the pack is corrupt: re-run `xprep pack --force`")
        after = np.cumsum(lens)  # where each item's successor begins in the row (the capacity: next_doc)
        follow = np.arange(1, len(docs) + (next_doc >= 0))  # the items whose first token is a label here
        docs = np.append(docs, max(next_doc, 0))
        starts = np.append(starts.astype(np.int64), 0)
        tokens, learn, cats = self._first_tokens(docs[follow], starts[follow])
        out[1, after[follow - 1] - 1] = np.where(learn, tokens, IGNORE)
        out[3, after[follow - 1] - 1] = np.where(learn, cats, 0)
        out[2] = np.arange(self.capacity)
        cu[:2] = (0, self.capacity)
        return 2

    def _first_tokens(self, docs: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first token of each item (doc, start), whether it is a target and its category: a target in a
        dataset without a loss mask (Megatron's labels: every token of the stream); a dataset with one never learns
        a document's first token (as its manifest counts, and ``xprep.prep.pack.kernels.sample_targets``)."""
        tokens, cats = np.zeros(len(docs), np.int64), np.zeros(len(docs), np.int64)
        learn = np.zeros(len(docs), np.bool_)
        for k, sel, at, _ in self._by_dataset(docs, starts):
            src = self._sources[k]
            streams = src.tokens, src.loss_mask, src.category_ids
            if src.streamed is not None:  # a dataset at a URL: these tokens only, through the block cache
                *streams, at, _ = src.streamed.gather(at, np.ones(len(at), np.int64), _NO_ENDS)
            token_stream, mask_stream, category_stream = streams
            tokens[sel] = token_stream[at]
            learn[sel] = len(mask_stream) == 0
            if len(category_stream) and not len(mask_stream):
                found = category_stream[at].astype(np.int64)
                remap = self._category_maps[k]
                cats[sel] = found if remap is None else remap[found]
        return tokens, learn, cats

    def _make_room_for_cp(self, block: np.ndarray, cu: np.ndarray, n: int, lens: np.ndarray):
        """Shorten the padding document so that the items padded for CP plus it fill the capacity."""
        n_items = len(lens)
        padded = int(padded_length(lens.astype(np.int64), self.cp_size).sum())
        if padded > self.capacity:
            raise XprepError(f"{self.entry.path}: a bin holds {padded} tokens once its documents are padded for "
                             f"--cp {self.cp_size}, more than its capacity {self.capacity}; repack with "
                             f"`xprep pack --cp-size {self.cp_size}`")
        used = int(cu[n_items])
        keep = used + self.capacity - padded  # real tokens + the shortened padding document
        cu = cu.copy()
        cu[n_items + 1] = keep
        return block[:, :, :keep], cu, n_items + 1 + (keep > used)

    def _fill_from_several(self, docs, starts, lens, out, cu) -> int:
        """Items from several datasets: one ``fill_items`` call per dataset, then the padding."""
        lens = lens.astype(np.int64)
        dst = np.cumsum(lens) - lens
        used = int(lens.sum())
        if used > self.capacity:
            return -1
        for k, sel, flat, ends in self._by_dataset(docs, starts):
            src = self._sources[k]
            tokens, mask, cats = src.tokens, src.loss_mask, src.category_ids
            if src.streamed is not None:  # a dataset at a URL: only these items' tokens, through the block cache
                tokens, mask, cats, flat, ends = src.streamed.gather(flat, lens[sel], ends)
            fill_items_upto(tokens, mask, cats, flat, lens[sel], dst[sel], ends, out)
            remap = self._category_maps[k]
            if remap is not None:  # this dataset numbers its categories differently from the first
                at = np.concatenate([np.arange(d, d + n) for d, n in zip(dst[sel].tolist(), lens[sel].tolist(),
                                                                           strict=True)])
                out[3, at] = remap[out[3, at]]
        cu[: len(dst)] = dst
        return pad_bin(out, cu, len(dst), used, self.pad_id)

    def _by_dataset(self, docs: np.ndarray, starts: np.ndarray):
        """Items grouped by dataset: (dataset, selection, flat start in its streams, flat end of each item's
        document when the pack looks ahead, else empty)."""
        which = np.searchsorted(self._doc_base, docs, side="right") - 1
        for k in np.unique(which).tolist():
            sel = which == k
            src = self._sources[k]
            local = docs[sel] - self._doc_base[k]
            yield k, sel, src.offsets[local] + starts[sel], (src.offsets[local + 1] if self.lookahead else _NO_ENDS)

    def stream_ranges(self, bins: list[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(stream id, byte ranges) of ``cache`` that reading ``bins`` takes from datasets at URLs, coalesced: what is
        fetched ahead (train/prefetch.py)."""
        _, docs, starts, lens = self.bins.items_of(np.asarray(bins, np.int64))
        out = []
        for k, sel, flat, ends in self._by_dataset(docs, starts):
            if self._sources[k].streamed is not None:
                out += self._sources[k].streamed.ranges(flat, lens[sel], ends)
        return out

    def close(self) -> None:
        """Remove the block cache (a local pack has none)."""
        if self.cache is not None:
            self.cache.close()

    def __getstate__(self) -> dict:
        return {"packed": self.packed, "verify_data": False, "cp_size": self.cp_size, "cache_size": self.cache_size,
                "stream_timeout": self.stream_timeout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["packed"], state["verify_data"], state.get("cp_size", 1),
                      state.get("cache_size", DEFAULT_CACHE_SIZE), state.get("stream_timeout", DEFAULT_RETRY_S))


def masked_eod(entry, dataset: TokenDataset) -> int | None:
    """The EOD id a pack made with ``--eod-mask-loss`` never labels: its pack.json's ``eod_id`` (a blend's: its
    datasets' ``tokenizer.eod_id``, which the pack read); None for a pack without the option."""
    if not entry.config.get("eod_mask_loss"):
        return None
    eod = entry.meta.get("eod_id", (dataset.manifest.get("tokenizer") or {}).get("eod_id"))
    if not isinstance(eod, int):
        raise XprepError(f"{entry.path}: packed with --eod-mask-loss but no EOD id is recorded (pack.json eod_id, "
                         f"{dataset.path}/manifest.json tokenizer.eod_id); repack with `xprep pack --force`")
    return eod


def is_chunk_pack(entry: PackEntry) -> bool:
    """Whether the entry's bins are fixed-length samples of the document stream (``--method chunk``; a blend's:
    all its sources are), by its method's registry entry."""
    methods = methods_of(entry.config.get("method"), str(entry.path))
    return bool(methods) and all(m.fixed_length_samples for m in methods)


def check_cp_size(entry: PackEntry, cp_size: int) -> None:
    """Refuse context parallelism over C ranks on a pack that has no room for its padding.

    A pack made with ``--cp-size C'`` pads every document to a multiple of 2·C' in its bins;
    that holds the padding of any C dividing C'. A chunk pack needs no room (CP zigzags its
    samples whole, unpadded), whatever --cp-size it was made with, only samples that split into
    2·C equal chunks.
    """
    if cp_size <= 1:
        return
    if is_chunk_pack(entry):
        check_chunk_cp(entry.capacity, cp_size, "--cp", str(entry.path), method=entry.config["method"])
        return
    pack_cp = int(entry.config.get("cp_size") or 1)
    if pack_cp % cp_size or entry.capacity % (2 * cp_size):
        made = f"with --cp-size {pack_cp}" if pack_cp > 1 else "without --cp-size"
        raise XprepError(f"--cp {cp_size}: {entry.path} was packed {made}, so its bins have no room for padding "
                         f"every document to a multiple of 2·cp={2 * cp_size}; repack with "
                         f"`xprep pack ... --cp-size {cp_size}`")


def merge_categories(tables: list[list[str | None]]) -> tuple[list[str], list[np.ndarray | None]]:
    """One category table for several datasets: the first one's ids, then new names appended.

    Returns the merged names and, per dataset, an id → merged id array (None when unchanged).
    """
    merged = CategoryTable(_named(tables[0]) if tables else None)
    maps: list[np.ndarray | None] = [None]
    for table in tables[1:]:
        lut = merged.remap(_named(table))[:len(table)]
        remap = np.zeros(MAX_CATEGORY + 1, np.int64)  # ids outside a dataset's own table are not categories
        remap[:len(lut)] = lut
        maps.append(None if np.array_equal(lut, np.arange(len(lut))) else remap)
    return merged.names, maps


def _named(table: list[str | None]) -> list[str]:
    """A dataset's category names with the unnamed ids named by their number (as merged tables show them)."""
    return [n if n is not None else str(i) for i, n in enumerate(table)]


def _source(ds: TokenDataset) -> _Source:
    if isinstance(ds, StreamedDataset):
        return _Source(_NO_STREAM, _NO_STREAM, _NO_STREAM, ds.tokens.offsets(), streamed=ds)
    return _Source(
        tokens=ds.tokens.items,
        loss_mask=ds.loss_mask.items if ds.loss_mask is not None else _NO_STREAM,
        category_ids=ds.category_ids.items if ds.category_ids is not None else _NO_STREAM,
        offsets=ds.tokens.offsets(),
    )


_NO_STREAM = np.zeros(0, np.uint8)


def _stream_cache(datasets: list[TokenDataset], cache_size: int, retry_s: float) -> BlockCache | None:
    """One block cache for the datasets at URLs (None: there are none), which read through it from then on."""
    streamed = [ds for ds in datasets if isinstance(ds, StreamedDataset)]
    if not streamed:
        return None
    cache = open_block_cache(cache_size, retry_s)
    for ds in streamed:
        ds.retry = cache.retry
        ds.attach(cache)
    return cache
_NO_ENDS = np.zeros(0, np.int64)  # fill_items_upto without lookahead


@numba.njit(cache=True, nogil=True)
def fill_bin(tokens, loss_mask, category_ids, offsets, docs, starts, lens, pad_id, out, cu,
             lookahead=False):  # pragma: no cover
    """Fill one bin from one dataset: items, then padding; returns the number of ``cu`` entries (-1:
    the items overflow ``out``). Item i is tokens ``starts[i]:starts[i]+lens[i]`` of document ``docs[i]``.
    ``lookahead``: the pack says so (--method chunk); see ``fill_items_upto``."""
    n = len(docs)
    src = np.empty(n, np.int64)
    dst = np.empty(n, np.int64)
    ends = np.empty(n if lookahead else 0, np.int64)
    used = 0
    for i in range(n):
        src[i] = offsets[docs[i]] + starts[i]
        dst[i] = used
        cu[i] = used
        used += lens[i]
        if lookahead:
            ends[i] = offsets[docs[i] + 1]
    if used > out.shape[1]:
        return -1
    fill_items_upto(tokens, loss_mask, category_ids, src, lens, dst, ends, out)
    return pad_bin(out, cu, n, used, pad_id)


@numba.njit(cache=True, nogil=True)
def pad_bin(out, cu, n_items, used, pad_id):  # pragma: no cover - compiled
    """Close ``cu`` after ``n_items`` items of ``used`` tokens; the rest of the capacity becomes one
    padding document (pad_id, no targets, positions from 0). Returns the number of ``cu`` entries."""
    cap = out.shape[1]
    cu[n_items] = used
    if used == cap:
        return n_items + 1
    for t in range(used, cap):
        out[0, t] = pad_id
        out[1, t] = -100
        out[2, t] = t - used
        out[3, t] = 0
    cu[n_items + 1] = cap
    return n_items + 2


@numba.njit(cache=True, nogil=True)
def fill_items(tokens, loss_mask, category_ids, src, lens, dst, out):  # pragma: no cover - compiled
    """Copy items into ``out`` rows (input_ids, labels, position_ids, category_ids), one pass.

    Item ``i`` is ``lens[i]`` tokens of the flat streams from ``src[i]``, written at ``dst[i]``.
    labels[t] = token t+1 when t+1 is in the same item and is a target (``loss_mask``; an empty
    mask means every token but an item's first); category_ids[t] is that target's category
    (0 where there is none; an empty stream means 0).
    """
    fill_items_upto(tokens, loss_mask, category_ids, src, lens, dst, np.empty(0, np.int64), out)


@numba.njit(cache=True, nogil=True)
def fill_items_upto(tokens, loss_mask, category_ids, src, lens, dst, ends, out):  # pragma: no cover - compiled
    """``fill_items`` with lookahead: ``ends[i]`` is the flat end of item i's document (empty: none).

    An item that stops before its document's end (``src[i] + lens[i] < ends[i]``) labels its last token with
    the document's next token, when that is a target: the label a --method chunk sample owes its last
    position. Labels still never cross a document.
    """
    has_mask = len(loss_mask) > 0
    has_cats = len(category_ids) > 0
    has_ends = len(ends) > 0
    for i in range(len(src)):
        a, n, d = src[i], lens[i], dst[i]
        for j in range(n):
            out[0, d + j] = tokens[a + j]
            out[2, d + j] = j
        last = n if has_ends and a + n < ends[i] else n - 1  # positions j < last have a next token
        for j in range(last):
            if has_mask and loss_mask[a + j + 1] == 0:
                out[1, d + j] = -100
                out[3, d + j] = 0
            else:
                out[1, d + j] = tokens[a + j + 1]
                out[3, d + j] = category_ids[a + j + 1] if has_cats else 0
        if n > 0 and last < n:
            out[1, d + n - 1] = -100
            out[3, d + n - 1] = 0


def fill_items_reference(tokens, loss_mask, category_ids, src, lens, dst, out, ends=None) -> None:
    """Slow obvious version of ``fill_items`` (``fill_items_upto`` with ``ends``): token by token."""
    for i in range(len(src)):
        a, n, d = int(src[i]), int(lens[i]), int(dst[i])
        more = ends is not None and len(ends) > 0 and a + n < int(ends[i])  # the document goes on after the item
        for j in range(n):
            out[0, d + j] = tokens[a + j]
            out[2, d + j] = j
            nxt = j + 1
            target = (nxt < n or more) and (len(loss_mask) == 0 or loss_mask[a + nxt] != 0)
            out[1, d + j] = tokens[a + nxt] if target else IGNORE
            out[3, d + j] = (category_ids[a + nxt] if len(category_ids) else 0) if target else 0


def collate(bins: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Bins of one micro-batch side by side in one row (1, M·capacity), cu_seqlens over all of them."""
    if len(bins) == 1:
        return dict(bins[0])
    out = {k: torch.cat([b[k] for b in bins], dim=1) for k in BATCH_KEYS if k != "cu_seqlens"}
    shift, parts = 0, [torch.zeros(1, dtype=torch.int32)]
    for b in bins:
        parts.append(b["cu_seqlens"][1:] + shift)
        shift += int(b["cu_seqlens"][-1])
    out["cu_seqlens"] = torch.cat(parts)
    return out


def micro_batch(dataset: PackedDataset, bins: list[int], cp_rank: int = 0, cp_size: int = 1
                ) -> dict[str, torch.Tensor]:
    """The micro-batch of ``bins`` as ``xtrain run`` feeds it to the model on context-parallel rank ``cp_rank`` of
    ``cp_size``, on the CPU: the bins side by side (``collate``), then, under CP, this rank's share (``shard_batch``).

    Under CP every document is padded to a multiple of 2·cp and the rank keeps chunks r and 2cp−1−r of each; in
    a chunk pack, of each whole sample instead (``PackedDataset.cp_sample_len``). ``dataset`` must have been
    opened with the same ``cp_size`` (its bins then leave the room that padding takes), but for a chunk pack's,
    whose samples are sharded unpadded.
    """
    if dataset.cp_size != cp_size and not dataset.whole_samples:
        raise ValueError(f"{dataset.packed} was opened for cp_size {dataset.cp_size}, not {cp_size}")
    batch = collate([dataset[b] for b in bins])
    if cp_size > 1:
        batch = shard_batch(batch, cp_rank, cp_size, dataset.cp_sample_len)
    return batch


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Number of target tokens in a micro-batch (known before the forward)."""
    return int((batch["labels"] != IGNORE).sum())
