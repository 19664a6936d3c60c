"""The manifest of a token dataset (DESIGN §1): its format and version, the category table (names ↔ ids), the
fingerprint over what defines the content, and what readers check against it: the fields (``read_manifest``), the
streams' digests (``verify_streams``), the tokenizer it was made with (``dataset_tokenizer``), the conversations'
shape. The streams themselves are token_dataset.py's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.formats import DATASET_FORMAT, LOSS_MASK_STREAM, MANIFEST, SHARDED_FORMAT, TOKENS_STREAM
from xprep.prep.io import file_sha256

FORMAT_VERSION = 1
UNCATEGORIZED = "uncategorized"
MAX_CATEGORY = 65_535  # category ids are stored as uint16 at most
KEPT_TOKENIZER = "tokenizer.json"  # a converted tokenizer, kept inside the dataset (see dataset_tokenizer)
# The shape of a chat dataset's conversations (counts.conversations): how many, their assistant turns, how many
# begin with the assistant (after any system turn), assistant turns with a blank content (trained as little more
# than the end-of-turn marker), and conversations whose last message is not the assistant's (a trailing turn
# nothing is learnt from).
CONVERSATION_COUNTS = ("count", "answers", "assistant_first", "empty_answers", "ends_without_answer")


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

    Pre-tokenized records carry numeric ids; those are kept verbatim and named by their number, or by
    ``numeric_names`` (``xprep tokenize --category-names``: id → name) where it names them.
    """

    def __init__(self, names: list[str | None] | None = None, max_id: int = MAX_CATEGORY,
                 numeric_names: Mapping[int, str] | None = None):
        self.names: list[str | None] = list(names) if names else [UNCATEGORIZED]
        self.max_id = max_id  # the highest id a category stream stores
        self.numeric_names = dict(numeric_names or {})
        self._ids = {n: i for i, n in enumerate(self.names) if n is not None}
        self._free = 1  # no id below this one is free

    def numeric_name(self, cid: int) -> str:
        """The name a numeric id of pre-tokenized data gets: ``numeric_names``', else its number."""
        return self.numeric_names.get(cid, str(cid))

    def id_of(self, name: str) -> int:
        found = self._ids.get(name)
        if found is not None:
            return found
        while self._free < len(self.names) and self.names[self._free] is not None:
            self._free += 1
        return self._set(self._free, name)

    def use_numeric(self, cid: int) -> None:
        """Reserve a verbatim numeric id from pre-tokenized data (named ``numeric_name(cid)``; 0 stays 0)."""
        if cid == 0:
            return
        if cid < len(self.names) and self.names[cid] is not None:
            if self.names[cid] != self.numeric_name(cid):
                raise XprepError(
                    f"category id {cid} of pre-tokenized records is already the id of category "
                    f"{self.names[cid]!r}: tokenize named and numeric categories into separate datasets"
                )
            return
        self._set(cid, self.numeric_name(cid))

    def _set(self, cid: int, name: str) -> int:
        if cid > self.max_id:
            raise XprepError(
                f"more than {self.max_id:,} categories (at {name!r}): categories are for channel loss; "
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


def numeric_category_names(manifest: dict) -> dict[int, str]:
    """The names a dataset's pre-tokenized numeric category ids were given (its ``options.category_names``, from
    ``xprep tokenize --category-names``), by id; empty for a dataset made without them."""
    names = (manifest.get("options") or {}).get("category_names") or {}
    return {int(cid): name for cid, name in names.items()}


def is_sharded(manifest: dict) -> bool:
    """Whether ``manifest`` is a sharded dataset's (prep/dataset/sharded.py): a list of shard datasets, no streams."""
    return manifest.get("format") == SHARDED_FORMAT


def read_manifest(path: str | Path) -> dict:
    """The manifest of the token dataset at ``path`` (a plain or a sharded one: ``is_sharded``), checked for its
    format, version and the fields readers use.

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
    if not isinstance(manifest, dict) or manifest.get("format") not in (DATASET_FORMAT, SHARDED_FORMAT) \
            or manifest.get("version") != FORMAT_VERSION:
        raise XprepError(f"{mpath}: not an {DATASET_FORMAT} v{FORMAT_VERSION} manifest")
    sharded = is_sharded(manifest)  # (its streams name dtypes only: the digests are each shard's)
    missing = [k for k in ("streams", "counts", "categories", "fingerprint", "tokenizer", "rejects",
                           *(("shards",) if sharded else ())) if k not in manifest]
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
