"""Sharded token datasets: one manifest over N shard datasets, read as one dataset with documents in shard order.

A sharded dataset is a directory whose ``manifest.json`` (format ``xprep-sharded-dataset``) lists its shards: each an
ordinary token dataset (``.bin/.idx`` streams, its own manifest and digests, readable by Megatron), named by a path
relative to the sharded directory and the fingerprint it had when listed. Global document ``g`` is local document
``g - base[k]`` of shard ``k``, where ``base`` is the running sum of the shards' documents: the numbering of the
copy ``xprep merge`` makes of it, whose categories are the same table too (each shard's names remapped in order of
first use, as merge.py does).

Its fingerprint is sha256 over the shards' fingerprints, in order. The merged copy's cannot be computed from the
shards' manifests: it covers the sha256 of the merged ``.bin`` and ``.idx`` files, and a sha256 of a concatenation
is no function of the parts' digests (the merged ``.idx`` moreover holds rebased pointers), so it takes reading
every token byte. A sharded dataset and its merged copy therefore get different pack keys, and identical bins.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from xprep.prep.dataset.manifest import (
    CONVERSATION_COUNTS,
    FORMAT_VERSION,
    CategoryTable,
    canonical_json,
    conversation_counts,
    is_sharded,
    numeric_category_names,
    read_manifest,
    verify_streams,
)
from xprep.prep.dataset.remote import mark_complete, read_complete_manifest, shard_url
from xprep.prep.dataset.stream import Retry, StreamedDataset
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.formats import MANIFEST, SHARDED_FORMAT, TOKENS_STREAM
from xprep.prep.fs import filesystem
from xprep.prep.io import check_output_dir, write_json_atomic

SAME = ("tokenizer", "special_tokens", "chat_template", "options")  # what every shard must share (as merge asks)


def sharded_fingerprint(shard_fingerprints: Sequence[str]) -> str:
    """sha256 over the format and the shards' fingerprints in order: what defines a sharded dataset's content."""
    return hashlib.sha256(canonical_json({"format": SHARDED_FORMAT, "version": FORMAT_VERSION,
                                          "shards": list(shard_fingerprints)})).hexdigest()


def write_sharded(shards: Sequence[str | Path], output: str | Path, extra: dict | None = None) -> dict:
    """Write the manifest of a sharded dataset at ``output`` over the token datasets ``shards`` (in order); returns it.

    Reads only the shards' manifests and token indexes (checked against their digests): no token byte is copied.
    The shards may lie anywhere; each is named relative to ``output``. ``extra``: fields to add (a Ray run's
    ``sources``). The manifest is written atomically, the last thing: a directory without it is no dataset.
    """
    out = Path(output)
    if (out / MANIFEST).exists():
        check_output_dir(out)  # the error that says an output exists and what to do
    manifests = [_shard_manifest(Path(p)) for p in shards]
    if not manifests:
        raise XprepError(f"-o {out}: a sharded dataset needs at least one shard")
    names = [os.path.relpath(Path(p).resolve(), out.resolve()) for p in shards]
    manifest = sharded_manifest(manifests, names, _tokenizer(manifests[0], Path(shards[0]), out), extra,
                                [str(p) for p in shards])
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def publish_sharded_url(url: str, names: list[str], extra: dict | None = None) -> dict:
    """Publish a sharded dataset at ``url`` over the datasets already there at ``url/NAME`` (each whole: its
    ``COMPLETE`` marker written), in order: its manifest uploaded, then its own marker, last (an object store has no
    rename: this order is what keeps a reader from meeting a manifest that names a shard not there yet). ``extra``:
    fields to add (a Ray run's ``sources`` and kept tokenizer). Returns the manifest."""
    url = url.rstrip("/")
    manifests = [read_complete_manifest(shard_url(url, name)) for name in names]
    if not manifests:
        raise XprepError(f"-o {url}: a sharded dataset needs at least one shard")
    manifest = sharded_manifest(manifests, names, dict(manifests[0]["tokenizer"]), extra)
    fs, inner = filesystem(url)
    try:
        fs.pipe_file(f"{inner}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        mark_complete(url, manifest["fingerprint"])
    except OSError as e:  # s3fs, gcsfs: a refused or dropped request is an OSError
        raise XprepError(f"-o {url}: the upload failed ({type(e).__name__}: {e}); no COMPLETE marker was written, so "
                         "no reader takes it for a dataset: run the command again") from None
    return manifest


def sharded_manifest(manifests: list[dict], names: list[str], tokenizer: dict, extra: dict | None = None,
                     shown: list[str] | None = None) -> dict:
    """The manifest of a sharded dataset over shards with these ``manifests``, named ``names`` (paths relative to
    the sharded dataset, ``/``-separated for a URL), in order: what ``write_sharded`` and ``publish_sharded_url``
    write. ``tokenizer``: the entry to record; ``shown``: the shards as messages name them (default: ``names``)."""
    shown = shown or names
    first = manifests[0]
    categories = CategoryTable(numeric_names=numeric_category_names(first))
    for where, m in zip(shown, manifests, strict=True):
        for key in SAME:
            if m.get(key) != first.get(key):
                raise XprepError(f"{where}: its {key} differs from {shown[0]}'s; only datasets made with the same "
                                 "tokenizer, template and options can be shards of one dataset")
        shard_categories(m, categories)
    manifest = {k: first[k] for k in SAME if k in first}
    manifest.update(format=SHARDED_FORMAT, version=FORMAT_VERSION, categories=categories.names)
    manifest["tokenizer"] = tokenizer
    manifest["streams"] = _streams(manifests)
    manifest["shards"] = [{"path": name, "fingerprint": m["fingerprint"], "documents": m["counts"]["documents"],
                           "tokens": m["counts"]["tokens"]} for name, m in zip(names, manifests, strict=True)]
    manifest["counts"] = _counts(manifests)
    manifest["rejects"] = _rejects(manifests)
    manifest["sources"] = joined_sources(manifests)
    manifest.update(extra or {})
    manifest["fingerprint"] = sharded_fingerprint([s["fingerprint"] for s in manifest["shards"]])
    return manifest


def _shard_manifest(path: Path) -> dict:
    manifest = read_manifest(path)
    if is_sharded(manifest):
        raise XprepError(f"{path}: is itself a sharded dataset; list its shards instead (shards do not nest)")
    verify_streams(path, manifest, "idx", [TOKENS_STREAM])
    return manifest


def shard_categories(manifest: dict, categories: CategoryTable) -> np.ndarray:
    """The ids of a dataset's categories in the sharded or merged table ``categories``, which grows by the new
    ones: a name that is its own id (or the name ``--category-names`` gave that id) is a numeric id of
    pre-tokenized data, kept verbatim."""
    keys = [None if cid == 0 or name is None else cid if name == categories.numeric_name(cid) else name
            for cid, name in enumerate(manifest["categories"])]
    return categories.remap(keys)


def _tokenizer(first: dict, shard: Path, out: Path) -> dict:
    """The shards' tokenizer entry; a tokenizer kept inside the first shard is named relative to ``out``."""
    info = dict(first["tokenizer"])
    if info.get("path") and not Path(info["path"]).is_absolute():
        info["path"] = os.path.relpath((shard / info["path"]).resolve(), out.resolve())
    return info


def _streams(manifests: list[dict]) -> dict:
    """The streams some shard has, with the widest dtype among the shards (no digests: those are each shard's)."""
    streams: dict[str, dict] = {}
    for m in manifests:
        for name, s in m["streams"].items():
            dtype = np.dtype(s["dtype"])
            if name not in streams or dtype.itemsize > np.dtype(streams[name]["dtype"]).itemsize:
                streams[name] = {"dtype": dtype.name}
    return streams


def _counts(manifests: list[dict]) -> dict:
    """The shards' counts summed (per category by name)."""
    counts = {k: sum(m["counts"][k] for m in manifests) for k in ("documents", "tokens", "loss_tokens")}
    tops = [m["counts"]["max_token_id"] for m in manifests if m["counts"].get("max_token_id") is not None]
    counts["max_token_id"] = max(tops) if tops else None
    per: dict[str, dict] = {}
    for m in manifests:
        for name, c in m["counts"]["categories"].items():
            entry = per.setdefault(name, {"tokens": 0, "loss_tokens": 0})
            entry["tokens"] += c["tokens"]
            entry["loss_tokens"] += c["loss_tokens"]
    counts["categories"] = per
    shapes = [conversation_counts(m) for m in manifests]
    if all(s is not None for s in shapes) and sum(int(s[0]) for s in shapes):
        counts["conversations"] = dict(zip(CONVERSATION_COUNTS, np.sum(shapes, axis=0).tolist(), strict=True))
    return counts


def _rejects(manifests: list[dict]) -> dict:
    """Rejects counted over the shards; the records themselves stay in each shard's rejects.jsonl."""
    by_reason: dict[str, int] = {}
    for m in manifests:
        for reason, n in (m["rejects"].get("by_reason") or {}).items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    return {"count": sum(m["rejects"]["count"] for m in manifests), "by_reason": dict(sorted(by_reason.items())),
            "file": None}


def joined_sources(manifests: list[dict]) -> list[dict]:
    """The datasets' sources in order, a file cut over consecutive shards listed once (a sharded manifest's and a
    merged one's)."""
    sources: list[dict] = []
    for m in manifests:
        for src in m.get("sources", []):
            if not sources or sources[-1]["path"] != src["path"]:
                sources.append(src)
    return sources


def open_parts(path: str | Path, manifest: dict | None = None) -> list[TokenDataset]:
    """The plain datasets the dataset at ``path`` is made of, in document order: itself, or its shards (each checked
    against the fingerprint the sharded manifest recorded)."""
    path = Path(path)
    manifest = manifest if manifest is not None else read_manifest(path)
    if not is_sharded(manifest):
        return [TokenDataset(path)]
    shards = []
    for k, shard in enumerate(manifest["shards"]):
        where = path / shard["path"]
        if not (where / MANIFEST).is_file():
            raise XprepError(f"{path}: its shard #{k} {where} is missing; restore it, or re-create the sharded "
                             "dataset")
        ds = TokenDataset(where)
        if ds.fingerprint != shard["fingerprint"]:
            raise XprepError(f"{path}: its shard #{k} {where} changed since the sharded manifest was written "
                             f"(fingerprint {ds.fingerprint[:16]} != {shard['fingerprint'][:16]}); re-create the "
                             "sharded dataset from its shards")
        shards.append(ds)
    return shards


def verify_parts(path: str | Path, manifest: dict, part: str, streams: Sequence[str] | None = None) -> None:
    """``verify_streams`` on the dataset at ``path``, or on each of its shards."""
    if not is_sharded(manifest):
        verify_streams(path, manifest, part, streams)
        return
    for shard in manifest["shards"]:
        where = Path(path) / shard["path"]
        verify_streams(where, read_manifest(where), part, streams)


def open_url_parts(url: str, cache_dir: str | None = None, retry: Retry | None = None
                   ) -> tuple[dict, list[StreamedDataset]]:
    """The manifest of the dataset at ``url`` and the plain datasets it is made of, read in place (prep/dataset/
    stream.py): itself, or its shards in order, each an ordinary dataset at its URL relative to the sharded one and
    checked against the fingerprint listed there. What is fetched (manifests, indexes) goes into ``cache_dir``."""
    retry = retry or Retry()
    manifest = read_complete_manifest(url, retry)
    if not is_sharded(manifest):
        return manifest, [StreamedDataset(url, cache_dir, retry)]
    parts = []
    for k, shard in enumerate(manifest["shards"]):
        ds = StreamedDataset(shard_url(url, shard["path"]), cache_dir, retry)
        if ds.fingerprint != shard["fingerprint"]:
            raise XprepError(f"{url}: its shard #{k} {ds.path} changed since the sharded manifest was written "
                             f"(fingerprint {ds.fingerprint[:16]} != {shard['fingerprint'][:16]}); re-create the "
                             "sharded dataset from its shards")
        parts.append(ds)
    return manifest, parts


class ShardedDataset:
    """A sharded dataset opened as one: its manifest, its shards, and documents by global index (what ``xprep
    inspect DATASET`` reads; the packer and the trainer take the shards themselves, ``open_parts``)."""

    def __init__(self, path: str | Path, manifest: dict | None = None, shards: list | None = None):
        """``manifest`` and ``shards`` given: one whose parts are open already (at a URL: ``open_url_parts``)."""
        self.path = Path(path) if manifest is None else path
        self.manifest = read_manifest(self.path) if manifest is None else manifest
        self.shards = open_parts(self.path, self.manifest) if shards is None else shards
        self.streamed = any(getattr(s, "streamed", False) for s in self.shards)
        self.base = np.cumsum([0, *(len(s) for s in self.shards)]).astype(np.int64)
        table = CategoryTable(numeric_names=numeric_category_names(self.manifest))
        self._luts = [shard_categories(s.manifest, table) for s in self.shards]
        self._lengths: np.ndarray | None = None

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def category_names(self) -> list[str | None]:
        return self.manifest["categories"]

    def __len__(self) -> int:
        return int(self.base[-1])

    @property
    def lengths(self) -> np.ndarray:
        """Every document's length, shard after shard (a copy: 4 bytes a document)."""
        if self._lengths is None:
            self._lengths = np.concatenate([s.lengths for s in self.shards]) if self.shards else np.zeros(0, np.int32)
        return self._lengths

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, local index) of global document ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self.base, i, side="right")) - 1
        return k, i - int(self.base[k])

    def document(self, i: int) -> dict[str, np.ndarray]:
        """Global document ``i``, its category ids in this dataset's table."""
        k, local = self.locate(i)
        doc = self.shards[k].document(local)
        return {**doc, "category_ids": self._luts[k][doc["category_ids"]]}


def open_dataset(path: str | Path) -> TokenDataset | ShardedDataset:
    """The token dataset at ``path``, plain or sharded."""
    return ShardedDataset(path) if is_sharded(read_manifest(path)) else TokenDataset(path)
