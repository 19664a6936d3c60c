"""Token datasets: aligned ``.bin/.idx`` streams plus ``manifest.json`` (DESIGN §1).

``DatasetWriter`` builds a dataset in a temporary sibling directory and publishes it with one
rename, so a killed run never leaves something that opens as a dataset; one writer at a time holds
an output (``xprep.prep.io.OutputLock``). ``TokenDataset`` opens one, checking that the streams agree with
each other and with the manifest. ``dataset_tokenizer`` is where a dataset's tokenizer lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from xprep.prep.dataset.indexed import BinWriter, IndexedReader, bin_path
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.formats import CATEGORY_IDS_STREAM, DATASET_FORMAT, LOSS_MASK_STREAM, MANIFEST, REJECTS, TOKENS_STREAM
from xprep.prep.io import (
    OutputLock,
    TempDir,
    check_output_dir,
    file_sha256,
    fsync_dir,
    fsync_tree,
    remove_stale_temps,
    write_json_atomic,
)

FORMAT = DATASET_FORMAT  # the name xprep.prep.inspect.options imports it by
WRITE_BEHIND_ITEMS = 64 << 20  # tokens appended between two write-behinds (256 MB of int32)
MAX_SCAN_BLOCK = 64 << 20  # tokens read at a time where a manifest predates counts.max_token_id
FORMAT_VERSION = 1
UNCATEGORIZED = "uncategorized"
MAX_CATEGORY = 65_535  # category ids are stored as uint16 at most
KEPT_TOKENIZER = "tokenizer.json"  # a converted tokenizer, kept inside the dataset (see dataset_tokenizer)
SCRATCH = ".scratch"  # DatasetWriter.scratch, inside the temporary directory; never published
# The shape of a chat dataset's conversations (counts.conversations): how many, their assistant turns, how many
# begin with the assistant (after any system turn), assistant turns with a blank content (trained as little more
# than the end-of-turn marker), and conversations whose last message is not the assistant's (a trailing turn
# nothing is learnt from).
CONVERSATION_COUNTS = ("count", "answers", "assistant_first", "empty_answers", "ends_without_answer")

_REJECT_JSON = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(..., ensure_ascii=False), one encoder


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room for added tokens (vocab < 65,500), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65_500 else np.dtype(np.int32)


def count(n: int, noun: str) -> str:
    """``1 document``, ``2 documents``, ``1,000 documents``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def fingerprint(manifest: dict) -> str:
    """sha256 over what defines the content: format, tokenizer, template, options, categories, streams.

    Source paths, counts and rejects are derived or incidental and stay out, so a dataset
    rebuilt elsewhere (or merged from shards) from the same inputs has the same fingerprint.
    """
    content = {k: manifest.get(k) for k in ("format", "version", "options", "categories", "streams")}
    content["tokenizer"] = {k: v for k, v in manifest["tokenizer"].items() if k != "path"}
    template = manifest.get("chat_template")
    content["chat_template"] = template and template.get("sha256")
    return hashlib.sha256(canonical_json(content)).hexdigest()


class CategoryTable:
    """Category names ↔ ids. Id 0 is "uncategorized"; names get ids ≥ 1 in order of first use.

    Pre-tokenized records carry numeric ids; those are kept verbatim and named by their number.
    """

    def __init__(self, names: list[str | None] | None = None):
        self.names: list[str | None] = list(names) if names else [UNCATEGORIZED]
        self._ids = {n: i for i, n in enumerate(self.names) if n is not None}
        self._free = 1  # no id below this one is free

    def id_of(self, name: str) -> int:
        found = self._ids.get(name)
        if found is not None:
            return found
        while self._free < len(self.names) and self.names[self._free] is not None:
            self._free += 1
        return self._set(self._free, name)

    def use_numeric(self, cid: int) -> None:
        """Reserve a verbatim numeric id from pre-tokenized data (named ``str(cid)``; 0 stays 0)."""
        if cid == 0:
            return
        if cid < len(self.names) and self.names[cid] is not None:
            if self.names[cid] != str(cid):
                raise XprepError(
                    f"category id {cid} of pre-tokenized records is already the id of category "
                    f"{self.names[cid]!r}: tokenize named and numeric categories into separate datasets"
                )
            return
        self._set(cid, str(cid))

    def _set(self, cid: int, name: str) -> int:
        if cid > MAX_CATEGORY:
            raise XprepError(
                f"more than {MAX_CATEGORY:,} categories (at {name!r}): categories are for channel loss; "
                "pick a coarser --category-field"
            )
        if name in self._ids and self._ids[name] != cid:
            raise XprepError(f"category {name!r} would get two ids ({self._ids[name]} and {cid})")
        while len(self.names) <= cid:
            self.names.append(None)
        self.names[cid] = name
        self._ids[name] = cid
        return cid

    def remap(self, keys: Sequence[str | int | None]) -> np.ndarray:
        """Ids in this table of another numbering's categories: ``lut[code]`` is the id of ``keys[code]``.

        The one category remapper (a tokenize batch's local codes, a dataset merged into another, the
        datasets of one pack). A key is a name (new names get the next free ids, in the order of ``keys``:
        pass them in order of first use), an int (a numeric id of pre-tokenized data, kept verbatim) or
        None (uncategorized, id 0).
        """
        lut = np.zeros(max(len(keys), 1), np.uint16)
        for code, key in enumerate(keys):
            if key is None:
                continue
            if isinstance(key, int):
                self.use_numeric(key)
                lut[code] = key
            else:
                lut[code] = self.id_of(key)
        return lut

    def __len__(self) -> int:
        return len(self.names)


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
                 tokenizer: str | Path | None = None):
        self.durable = durable  # False: published without fsync (a Ray shard, verified by its digests on reuse)
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
        if self.durable and self._unsynced >= WRITE_BEHIND_ITEMS:
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


def read_manifest(path: str | Path) -> dict:
    """The manifest of the token dataset at ``path``, checked for its format, version and the fields readers use.

    Opens no stream: this is all a pack cache hit reads of its input datasets.
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise XprepError(f"{path}: not a token dataset (no {MANIFEST}); run `xprep tokenize` first")
    try:  # not read_json: "unreadable manifest" is what users and tests know this by
        manifest = json.loads(mpath.read_bytes())
    except (OSError, ValueError) as e:  # cannot read, not UTF-8, not JSON
        raise XprepError(f"{mpath}: unreadable manifest ({e}); re-create the dataset") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT \
            or manifest.get("version") != FORMAT_VERSION:
        raise XprepError(f"{mpath}: not an {DATASET_FORMAT} v{FORMAT_VERSION} manifest")
    missing = [k for k in ("streams", "counts", "categories", "fingerprint", "tokenizer", "rejects")
               if k not in manifest]
    missing += [f"counts.{k}" for k in ("documents", "tokens", "loss_tokens", "categories")
                if k not in manifest.get("counts", {})]
    if missing or TOKENS_STREAM not in manifest["streams"]:
        raise XprepError(f"{mpath}: incomplete manifest (missing {', '.join(missing) or 'streams.tokens'}); "
                         "re-create the dataset")
    return manifest


def verify_streams(path: str | Path, manifest: dict, part: Literal["idx", "bin"],
                   streams: Sequence[str] | None = None) -> None:
    """Refuse stream files whose sha256 is not the one the manifest recorded: the dataset was edited in place.

    ``part`` "idx" re-hashes the indexes (~12 bytes a document, ~0.1 s at 10M: all a pack depends on),
    "bin" the data itself (one full read). ``streams`` defaults to every stream of the manifest.
    """
    fix = "re-create it with `xprep tokenize`, then re-run `xprep pack`"
    file = stream_mismatch(path, manifest, part, fix, streams)
    if file is not None:
        raise XprepError(f"{file}: changed since {Path(path) / MANIFEST} was written (its sha256 differs): the "
                         f"dataset was edited in place; {fix}")


def stream_mismatch(path: str | Path, manifest: dict, part: Literal["idx", "bin"], fix: str,
                    streams: Sequence[str] | None = None) -> Path | None:
    """The first stream file (``part`` of each of ``streams``, default all) whose sha256 is not the manifest's, or
    None; a file that cannot be read is an XprepError ending in ``fix``."""
    for stream in manifest["streams"] if streams is None else streams:
        file = Path(path) / f"{stream}.{part}"
        if file_sha256(file, fix) != (manifest["streams"].get(stream) or {}).get(f"{part}_sha256"):
            return file
    return None


def conversation_counts(manifest: dict) -> np.ndarray | None:
    """The dataset's ``CONVERSATION_COUNTS``; None where they are unknown (a dataset with a loss mask made before they
    were counted). A dataset without conversations has none in its manifest: zeros."""
    shape = manifest["counts"].get("conversations")
    if shape is None:
        return None if LOSS_MASK_STREAM in manifest["streams"] else np.zeros(len(CONVERSATION_COUNTS), np.int64)
    if not all(isinstance(shape.get(k), int) for k in CONVERSATION_COUNTS):
        return None
    return np.array([shape[k] for k in CONVERSATION_COUNTS], np.int64)


def dataset_tokenizer(path: str | Path, manifest: dict | None = None) -> Path:
    """The tokenizer.json the dataset at ``path`` was made with, checked against the sha256 its manifest records.

    The rule: the manifest's ``tokenizer.path``, relative to the dataset directory. A tokenizer converted from GPT-2,
    SentencePiece or tiktoken files is kept inside the dataset (``KEPT_TOKENIZER``, its path relative), so the
    dataset does not depend on the cache it was converted into; a tokenizer.json given as such is named where it
    lay (an absolute path; its tokenizer_config.json, if any, beside it). A file that is gone or differs is an
    XprepError saying so.
    """
    path = Path(path)
    info = (manifest if manifest is not None else read_manifest(path)).get("tokenizer") or {}
    recorded = path / MANIFEST
    if not info.get("path"):
        raise XprepError(f"{recorded}: names no tokenizer (tokenizer.path); re-create the dataset")
    file = path / info["path"]
    if not file.is_file():
        raise XprepError(f"the tokenizer {file} recorded in {recorded} is gone; restore it at that path")
    if info.get("sha256") and file_sha256(file, "restore it") != info["sha256"]:
        raise XprepError(f"{file} is not the tokenizer {path} was made with (its sha256 differs from the one in "
                         f"{recorded}); restore that tokenizer.json")
    return file


class TokenDataset:
    """An opened token dataset: manifest plus zero-copy streams, checked for consistency."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
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
