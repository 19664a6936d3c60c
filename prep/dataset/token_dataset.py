"""Token datasets: aligned ``.bin/.idx`` streams plus ``manifest.json`` (DESIGN §1; the manifest is manifest.py's).

``DatasetWriter`` builds a dataset in a temporary sibling directory and publishes it with one
rename, so a killed run never leaves something that opens as a dataset; one writer at a time holds
an output (``xprep.prep.io.OutputLock``). ``TokenDataset`` opens one, checking that the streams agree with
each other and with the manifest.

The writer and the reader stay one module: they are the two halves of one layout of streams (which streams exist,
their dtypes, and what an absent one means: ``_default_loss_mask``, written by the writer's backfill of a stream
that appears late and filled in by the reader for a dataset without one), kept in one place as the binary format
is in indexed.py.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from xprep.prep.dataset.indexed import BinWriter, IndexedReader, bin_path
from xprep.prep.dataset.manifest import (
    CONVERSATION_COUNTS,
    FORMAT_VERSION,
    KEPT_TOKENIZER,
    CategoryTable,
    count,
    fingerprint,
    read_manifest,
    token_dtype,
)
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.formats import CATEGORY_IDS_STREAM, DATASET_FORMAT, LOSS_MASK_STREAM, MANIFEST, REJECTS, TOKENS_STREAM
from xprep.prep.io import (
    OutputLock,
    TempDir,
    check_output_dir,
    fsync_dir,
    fsync_tree,
    remove_stale_temps,
    write_json_atomic,
)

WRITE_BEHIND_ITEMS = 64 << 20  # tokens appended between two write-behinds by default (256 MB of int32)
MAX_SCAN_BLOCK = 64 << 20  # tokens read at a time where a manifest predates counts.max_token_id
SCRATCH = ".scratch"  # DatasetWriter.scratch, inside the temporary directory; never published

_REJECT_JSON = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(..., ensure_ascii=False), one encoder


@dataclass
class _LazyStream:
    """A stream created on first use, backfilled for the documents written before it existed."""

    name: str
    dtype: np.dtype
    writer: BinWriter | None = None


@dataclass
class Counts:
    """Documents, tokens and target tokens, in total and per category id (tokens, targets)."""

    documents: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    per_category: dict[int, list[int]] = field(default_factory=dict)  # id -> [tokens, targets]
    # CONVERSATION_COUNTS, summed; None once a part of unknown shape was added (a dataset made before they were)
    conversations: np.ndarray | None = field(default_factory=lambda: np.zeros(len(CONVERSATION_COUNTS), np.int64))

    def add_conversations(self, counts: np.ndarray | None) -> None:
        """Add the CONVERSATION_COUNTS of a batch (or a dataset: None where they are unknown, which they stay)."""
        if counts is None or self.conversations is None:
            self.conversations = None
        else:
            self.conversations += counts

    def add(self, lengths: np.ndarray, loss_mask: np.ndarray | None, cats: np.ndarray | None) -> None:
        """Count a batch. Targets are what training uses: a document's first token never counts,
        even where a pre-tokenized record's (verbatim) loss mask marks it."""
        n_tok = int(lengths.sum())
        if loss_mask is not None:
            starts = _starts(lengths)
            if loss_mask[starts].any():
                loss_mask = loss_mask.copy()
                loss_mask[starts] = 0
        self.documents += len(lengths)
        self.tokens += n_tok
        loss = n_tok - int(np.count_nonzero(lengths)) if loss_mask is None else int(np.count_nonzero(loss_mask))
        self.loss_tokens += loss
        if cats is None:
            self._add(0, n_tok, loss)
            return
        size = int(cats.max()) + 1 if len(cats) else 1
        tok = np.bincount(cats, minlength=size)
        if loss_mask is None:
            targets = tok - _first_token_bincount(cats, lengths, size)
        else:
            targets = np.bincount(cats, weights=loss_mask, minlength=size).astype(np.int64)
        for cid in np.flatnonzero(tok):
            self._add(int(cid), int(tok[cid]), int(targets[cid]))

    def _add(self, cid: int, tokens: int, targets: int) -> None:
        entry = self.per_category.setdefault(cid, [0, 0])
        entry[0] += tokens
        entry[1] += targets


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Offset of the first token of each non-empty document in the flat stream."""
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts[lengths > 0]


def _first_token_bincount(cats: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(cats[_starts(lengths)], minlength=size)


class DatasetWriter:
    """Writes a token dataset into ``out`` atomically: a temp sibling dir renamed on ``finish``.

    Use as a context manager; on an exception the temporary directory is removed and nothing
    at ``out`` changes. The output is locked from here to the end (``OutputLock``): a second writer of the
    same ``out`` is refused at its start, naming this one. ``tokenizer``: a tokenizer.json to keep inside the
    dataset (``KEPT_TOKENIZER``; see ``dataset_tokenizer``).
    """

    def __init__(self, out: str | Path, vocab_size: int, dtype: np.dtype | None = None, durable: bool = True,
                 tokenizer: str | Path | None = None, write_behind_items: int = WRITE_BEHIND_ITEMS):
        self.durable = durable  # False: published without fsync (a Ray shard, verified by its digests on reuse)
        self.write_behind_items = write_behind_items  # tokens appended between two write-behinds
        self.out = check_output_dir(out)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(vocab_size)
        with self._writing():
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._lock = OutputLock(self.out).acquire()
            try:
                check_output_dir(self.out)  # again, under the lock: a writer that held it may have published since
                remove_stale_temps(self.out.parent, f".{self.out.name}.tmp-*")  # killed runs' (never a live one's)
                self._claim = TempDir(self.out.parent, f".{self.out.name}.tmp-{os.getpid()}-")
                self.tmp = self._claim.path
                self.tokens = BinWriter(self.tmp / TOKENS_STREAM, self.dtype)
            except BaseException:
                if hasattr(self, "_claim"):
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    self._claim.release()
                self._lock.release()
                raise
        self.keep_tokenizer = Path(tokenizer) if tokenizer is not None else None
        self.vocab_size = vocab_size
        self.loss_mask = _LazyStream(LOSS_MASK_STREAM, np.dtype(np.uint8))
        self.category_ids = _LazyStream(CATEGORY_IDS_STREAM, np.dtype(np.uint8))
        self.counts = Counts()
        self.max_token_id: int | None = None  # the largest id appended (counts.max_token_id)
        self._lengths: list[np.ndarray] = []
        self._rejects = None
        self.reject_count = 0
        self.reject_reasons: dict[str, int] = {}
        self._unsynced = 0  # tokens appended since the last write-behind
        self._syncing: threading.Thread | None = None

    def __enter__(self) -> DatasetWriter:
        return self

    def _writing(self, nbytes: int | None = None):
        """Within: a full disk, a permission or a read-only filesystem is the one-line error naming ``-o`` (the
        temporary directory is then removed by ``__exit__``: nothing is published)."""
        return machine_errors(str(self.out), "-o", nbytes)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        self._lock.release()  # (finish released it already)

    def append(self, tokens: np.ndarray, lengths: np.ndarray, loss_mask: np.ndarray | None = None,
               category_ids: np.ndarray | None = None) -> None:
        """Append documents: flat ``tokens`` split by ``lengths``; optional aligned streams.

        ``loss_mask`` None means every token but each document's first is a target;
        ``category_ids`` None means category 0.
        """
        lengths = np.asarray(lengths, np.int64)
        if len(lengths) == 0:
            return
        lazy = [s.dtype.itemsize for s, given in ((self.loss_mask, loss_mask), (self.category_ids, category_ids))
                if given is not None or s.writer is not None]
        with self._writing(len(tokens) * (self.dtype.itemsize + sum(lazy))):  # (the bytes of every stream's append)
            self._append(tokens, lengths, loss_mask, category_ids)

    def _append(self, tokens: np.ndarray, lengths: np.ndarray, loss_mask: np.ndarray | None,
                category_ids: np.ndarray | None) -> None:
        if len(tokens):  # one pass over the batch in memory: the largest id, which the trainer checks
            top = int(tokens.max())
            if self.dtype == np.uint16 and top > 65535:
                raise XprepError(f"token id {top} does not fit uint16; use --dtype int32")
            self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)
        self.tokens.append(tokens, lengths)
        if loss_mask is not None or self.loss_mask.writer is not None:
            self._append_lazy(self.loss_mask, loss_mask, lengths, _default_loss_mask)
        if category_ids is not None or self.category_ids.writer is not None:
            if category_ids is not None and len(category_ids) and int(category_ids.max()) > 255:
                self._widen_categories()
            self._append_lazy(self.category_ids, category_ids, lengths, _default_categories)
        self.counts.add(lengths, loss_mask, category_ids)
        self._lengths.append(lengths)
        self._unsynced += len(tokens)
        if self.durable and self._unsynced >= self.write_behind_items:
            self._write_behind()

    def _write_behind(self) -> None:
        """Start writing what was appended so far through to the disk in a thread (unless the last one still runs),
        so that it goes to the disk while the work goes on and the fsync of ``finish`` has little left."""
        self._unsynced = 0
        if self._syncing is not None and self._syncing.is_alive():
            return
        fds = [w.flushed_fileno() for w in self._writers()]
        self._syncing = threading.Thread(target=lambda: [os.fdatasync(fd) for fd in fds], name="xprep-write-behind",
                                         daemon=True)  # an error there is the final fsync's to raise
        self._syncing.start()

    def _writers(self) -> list[BinWriter]:
        return [w for w in (self.tokens, self.loss_mask.writer, self.category_ids.writer) if w is not None]

    def _stop_writing_behind(self) -> None:
        """Wait for the write-behind thread: the files it syncs are about to be closed."""
        if self._syncing is not None:
            self._syncing.join()
            self._syncing = None

    def _append_lazy(self, stream: _LazyStream, values, lengths, default) -> None:
        if stream.writer is None:
            stream.writer = BinWriter(self.tmp / stream.name, stream.dtype)
            for old in self._lengths:
                stream.writer.append(default(old), old)
        stream.writer.append(default(lengths) if values is None else values, lengths)

    def _widen_categories(self) -> None:
        """More than 255 categories: rewrite the category stream written so far as uint16."""
        stream = self.category_ids
        if stream.dtype == np.uint16:
            return
        self._stop_writing_behind()  # it may be syncing the file closed here
        old = stream.writer
        stream.dtype = np.dtype(np.uint16)
        stream.writer = None
        if old is None:
            return
        old.close()
        prefix = old.prefix
        data = np.fromfile(bin_path(prefix), np.uint8)
        stream.writer = BinWriter(self.tmp / stream.name, stream.dtype)
        stream.writer.append(data.astype(np.uint16), old.lengths())

    def reject(self, source: str, line: int, reason: str, record: str | None = None, kind: str | None = None
               ) -> None:
        """Record a skipped input record in ``rejects.jsonl`` with its reason.

        ``kind`` is the class of problem the manifest counts rejects by ("unknown role 'bing'",
        "empty conversation", ...); by default the reason up to its first colon.
        """
        kind = kind or reason.split(":")[0]
        entry = {"source": source, "line": line, "kind": kind, "reason": reason}
        if record is not None:
            entry["record"] = record[:500]
        with self._writing():
            if self._rejects is None:
                self._rejects = open(self.tmp / REJECTS, "w")
            self._rejects.write(_REJECT_JSON(entry) + "\n")
        self.reject_count += 1
        self.reject_reasons[kind] = self.reject_reasons.get(kind, 0) + 1

    def scratch(self) -> str:
        """A directory for the run's own temporary files (a worker's results), inside the dataset's temporary
        directory: removed before the dataset is published, and with it if the run fails or is killed."""
        path = self.tmp / SCRATCH
        path.mkdir(exist_ok=True)
        return str(path)

    def add_conversations(self, counts: np.ndarray | None) -> None:
        """Count conversations by shape (``CONVERSATION_COUNTS``; None: of unknown shape, see ``Counts``)."""
        self.counts.add_conversations(counts)

    def finish(self, manifest: dict, categories: CategoryTable) -> dict:
        """Close every stream, write the manifest with counts and fingerprint, publish."""
        with self._writing():
            return self._finish(manifest, categories)

    def _finish(self, manifest: dict, categories: CategoryTable) -> dict:
        self._stop_writing_behind()
        streams = {TOKENS_STREAM: {"dtype": self.dtype.name, **self.tokens.close()}}
        for stream in (self.loss_mask, self.category_ids):
            if stream.writer is not None:
                streams[stream.name] = {"dtype": stream.dtype.name, **stream.writer.close()}
        if self._rejects is not None:
            self._rejects.close()
        names = categories.names
        manifest = dict(manifest)
        manifest.update(
            format=DATASET_FORMAT,
            version=FORMAT_VERSION,
            categories=names,
            streams=streams,
            counts={
                "documents": self.counts.documents,
                "tokens": self.counts.tokens,
                "loss_tokens": self.counts.loss_tokens,
                "max_token_id": self.max_token_id,
                "categories": {
                    (names[c] if c < len(names) and names[c] is not None else str(c)): {
                        "tokens": v[0], "loss_tokens": v[1]}
                    for c, v in sorted(self.counts.per_category.items())
                },
            },
            rejects={"count": self.reject_count, "by_reason": dict(sorted(self.reject_reasons.items())),
                     "file": REJECTS if self.reject_count else None},
        )
        if self.counts.conversations is not None and self.counts.conversations[0]:  # (see conversation_counts)
            manifest["counts"]["conversations"] = dict(zip(CONVERSATION_COUNTS, self.counts.conversations.tolist(),
                                                           strict=True))
        shutil.rmtree(self.tmp / SCRATCH, ignore_errors=True)  # not part of the dataset
        if self.keep_tokenizer is not None:
            shutil.copyfile(self.keep_tokenizer, self.tmp / KEPT_TOKENIZER)
        manifest["fingerprint"] = fingerprint(manifest)
        write_json_atomic(self.tmp / MANIFEST, manifest, durable=False)  # fsync_tree makes all of it durable
        if self.durable:
            fsync_tree(self.tmp)
        self._claim.release()  # the owner record is no part of the dataset
        if self.durable:
            fsync_dir(self.tmp)
        self._publish()
        if self.durable:
            fsync_dir(self.out.parent)
        self._lock.release()
        return manifest

    def _publish(self) -> None:
        """Rename the finished dataset into ``out``: empty or absent, as checked under the lock. Something that wrote
        into it meanwhile without the lock is left as it is, and this dataset is not published."""
        try:
            if self.out.exists():
                self.out.rmdir()
            os.replace(self.tmp, self.out)
        except OSError as e:
            raise XprepError(f"-o {self.out}: something wrote into it while this run was writing ({e.strerror}); "
                             "this run's dataset was not published and what is there was left as it is: remove it "
                             "or choose another -o, and run again") from None

    def abort(self) -> None:
        self._stop_writing_behind()
        for w in self._writers():
            w.abort()
        if self._rejects is not None:
            self._rejects.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._claim.release()
        self._lock.release()


def _default_loss_mask(lengths: np.ndarray) -> np.ndarray:
    mask = np.ones(int(lengths.sum()), np.uint8)
    mask[_starts(lengths)] = 0
    return mask


def _default_categories(lengths: np.ndarray) -> np.ndarray:
    return np.zeros(int(lengths.sum()), np.uint8)


def check_token_ids(datasets: Sequence[TokenDataset], vocab_size: int, model: str) -> None:
    """Refuse datasets holding a token id outside the model's vocabulary of ``vocab_size`` ids (``model`` names
    it): its embedding lookup would fail mid-run (an IndexError on the CPU, a device-side assert on a GPU)."""
    for ds in {str(ds.path): ds for ds in datasets}.values():  # (a validation pack shares the training datasets)
        top = ds.max_token_id
        if top is not None and top >= vocab_size:
            raise XprepError(f"{ds.path}: holds token id {top:,}, but {model} has a vocabulary of {vocab_size:,} ids "
                             f"(0..{vocab_size - 1:,}); re-tokenize with the model's tokenizer, or use a model whose "
                             f"vocab_size is above {top:,}")


class TokenDataset:
    """An opened token dataset: manifest plus zero-copy streams, checked for consistency."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if self.manifest["format"] != DATASET_FORMAT:  # a sharded one: its readers open its shards (sharded.py)
            raise XprepError(f"{self.path}: is a sharded dataset, which this command reads only through its shards "
                             f"(its {MANIFEST} lists them); make one dataset of it: `xprep merge {self.path} -o OUT`")
        self.tokens = IndexedReader(self.path / TOKENS_STREAM)
        self.loss_mask = self._optional(LOSS_MASK_STREAM)
        self.category_ids = self._optional(CATEGORY_IDS_STREAM)
        self._check()

    def _optional(self, name: str) -> IndexedReader | None:
        if name not in self.manifest["streams"]:
            return None
        return IndexedReader(self.path / name)

    def _check(self) -> None:
        for name, reader in ((LOSS_MASK_STREAM, self.loss_mask), (CATEGORY_IDS_STREAM, self.category_ids)):
            if reader is None:
                continue
            if not (np.array_equal(reader.lengths, self.tokens.lengths)
                    and np.array_equal(reader.doc_index, self.tokens.doc_index)):
                raise XprepError(
                    f"{self.path}: stream {name} disagrees with tokens (different document lengths); "
                    "the dataset is corrupt: re-create it"
                )
        counts = self.manifest["counts"]
        if len(self.tokens) != counts["documents"] or self.tokens.items.size != counts["tokens"]:
            raise XprepError(
                f"{self.path}: the tokens stream holds {count(len(self.tokens), 'document')} of "
                f"{count(self.tokens.items.size, 'token')} in all, but the manifest says "
                f"{count(counts['documents'], 'document')} of {count(counts['tokens'], 'token')}; re-create it"
            )

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def max_token_id(self) -> int | None:
        """The largest token id (None: no token): the manifest's ``counts.max_token_id``, or for a dataset made
        before it was recorded, the stream's, read block by block from the memory map (~1 s a few GB)."""
        if "max_token_id" in self.manifest["counts"]:
            return self.manifest["counts"]["max_token_id"]
        items = self.tokens.items
        if not len(items):
            return None
        return max(int(items[lo:lo + MAX_SCAN_BLOCK].max()) for lo in range(0, len(items), MAX_SCAN_BLOCK))

    @property
    def category_names(self) -> list[str | None]:
        return self.manifest["categories"]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        return self.tokens.lengths

    def document(self, i: int) -> dict[str, np.ndarray]:
        """Tokens, loss mask and category ids of document ``i`` (defaults filled in)."""
        tokens = self.tokens[i]
        mask = self.loss_mask[i] if self.loss_mask is not None else _default_loss_mask(
            np.array([len(tokens)]))
        cats = self.category_ids[i] if self.category_ids is not None else np.zeros(len(tokens), np.uint8)
        return {"input_ids": tokens, "loss_mask": mask, "category_ids": cats}

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
