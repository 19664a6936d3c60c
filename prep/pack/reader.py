"""Any pack entry, a plain pack or a blend, read as bins of (document, start, length) items over one global
document index (``PackBins``): what the trainer's dataset and ``xprep inspect --seen`` read.

The global index runs over the datasets of the entry's sources in order (source 0's datasets, then source
1's, ...); every bin knows its source (0 for a plain pack, whose one source is named after its dataset).
Opening checks every item against the documents it names, so the trainer slices only what exists.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from xprep.prep.dataset import TokenDataset
from xprep.prep.pack.bins import expand_ranges
from xprep.prep.pack.entry import PackEntry
from xprep.prep.pack.mixture import BlendEntry


def _view(a: np.ndarray) -> np.ndarray:
    """A plain ndarray view of a memory map: slicing np.memmap objects is several times slower."""
    return np.asarray(a).view(np.ndarray)


class PackBins:
    """The bins of a plain entry or of a blend, as (document, start, length) items over one global document
    index: the datasets of source 0's entry, then source 1's, and so on. Every bin knows its source (0 for
    a plain pack, whose one source is named after its dataset)."""

    def __init__(self, entry: PackEntry | BlendEntry, verify_data: bool = False, stream: bool = False):
        self.entry = entry
        blend = isinstance(entry, BlendEntry)
        self.parts = entry.sources if blend else [entry]
        self.source_names = entry.source_names if blend else [_plain_name(entry)]
        self.bin_source = _view(entry.bin_source) if blend else None
        self.bin_index = _view(entry.bin_index) if blend else None
        self.datasets: list[TokenDataset] = []
        self.dataset_source: list[int] = []  # the source of each dataset
        self.part_base: list[int] = []  # global index of each source's first document
        self.part_docs: list[int] = []  # documents of each source
        self.listed: list[str] = []  # the datasets the sources' pack.json list (a sharded one once), in order
        listed_base: list[int] = []  # global index of each one's first document
        for s, part in enumerate(self.parts):
            self.part_base.append(sum(len(d) for d in self.datasets))
            groups = part.open_listed(verify_data, stream)  # (stream: datasets at URLs read in place)
            opened = [ds for group in groups for ds in group]  # a sharded dataset is its shards
            first = self.part_base[-1]
            for info, group in zip(part.meta.get("datasets", []), groups, strict=True):
                self.listed.append(str(info["path"]))
                listed_base.append(first)
                first += sum(len(d) for d in group)
            part.check_items(doc_lengths(opened))  # every item inside its document: the trainer slices by them
            self.datasets += opened
            self.dataset_source += [s] * len(opened)
            self.part_docs.append(sum(len(d) for d in opened))
        self.doc_base = np.cumsum([0, *(len(d) for d in self.datasets)]).astype(np.int64)
        self.listed_base = np.array(listed_base, np.int64)
        self._arrays = [tuple(_view(getattr(p, n)) for n in ("bin_offsets", "item_doc", "item_start", "item_len"))
                        for p in self.parts]
        self._next = [None if p.bin_next_doc is None else _view(p.bin_next_doc) for p in self.parts]

    @property
    def num_bins(self) -> int:
        return self.entry.num_bins

    def locate(self, b: int) -> tuple[int, int]:
        """(source, bin of that source's entry) of bin ``b``."""
        if self.bin_source is None:
            return 0, b
        return int(self.bin_source[b]), int(self.bin_index[b])

    def items(self, b: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(source, global documents, starts, lengths) of the items of bin ``b``."""
        s, i = self.locate(b)
        offsets, doc, start, length = self._arrays[s]
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        docs = doc[lo:hi] + self.part_base[s] if self.part_base[s] else doc[lo:hi]
        return s, docs, start[lo:hi], length[lo:hi]

    def next_doc(self, b: int) -> int:
        """The global document whose first token follows bin ``b``'s sample in the stream (a chunk pack made with
        ``--attention causal``, the sample ending at a document's end), else -1."""
        s, i = self.locate(b)
        if self._next[s] is None or int(self._next[s][i]) < 0:
            return -1
        return int(self._next[s][i]) + self.part_base[s]

    def name_documents(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(listed dataset: an index into ``listed``, document index inside it) of global documents ``docs``: how a
        report names a document, the same for a sharded dataset and its merged copy."""
        docs = np.asarray(docs, np.int64)
        which = np.searchsorted(self.listed_base, docs, side="right") - 1  # (an empty dataset shares its successor's)
        return which, docs - self.listed_base[which]

    def bin_tokens(self, bins: list[int]) -> int:
        """Real (non-padding) tokens in these bins."""
        return sum(int(self.items(b)[3].sum()) for b in bins)

    def items_of(self, bins: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(source, global document, start, length) of every item of these bins (repeats kept), vectorized."""
        bins = np.asarray(bins, np.int64)
        src = np.zeros(len(bins), np.int64) if self.bin_source is None else self.bin_source[bins].astype(np.int64)
        idx = bins if self.bin_index is None else self.bin_index[bins].astype(np.int64)
        out = [[], [], [], []]
        for s in np.unique(src).tolist():
            offsets, doc, start, length = self._arrays[s]
            sel = idx[src == s]
            items = expand_ranges(offsets[sel], offsets[sel + 1])
            for k, part in enumerate((np.full(len(items), s, np.int64), doc[items] + self.part_base[s],
                                      start[items].astype(np.int64), length[items].astype(np.int64))):
                out[k].append(part)
        return tuple(np.concatenate(o) if o else np.zeros(0, np.int64) for o in out)


def doc_lengths(datasets: list[TokenDataset]) -> np.ndarray:
    """The lengths of the documents of ``datasets``, concatenated: indexed by a pack's global document index."""
    return np.concatenate([ds.lengths for ds in datasets]) if datasets else np.zeros(0, np.int32)


def _plain_name(entry: PackEntry) -> str:
    datasets = entry.meta.get("datasets") or []
    return Path(datasets[0]["path"]).name if len(datasets) == 1 else entry.path.name
