"""Pack caches at URLs: ``xtrain run s3://bucket/packed`` reads a pack cache uploaded as it is (its ``manifest.json``
and entry directories), or one entry of it.

Every file of a pack cache is small (bytes per bin and per item; the tokens stay in the datasets, which the trainer
reads in place: prep/dataset/stream.py), so they are fetched once into CACHE/packs/DIGEST/ (DIGEST: of the URL):
each entry directory whole, into a temporary sibling renamed into place (entries are immutable: one fetched is
reused), and the manifest again on every open (its current entry changes with every ``xprep pack``). The entry's
own checks (prep/pack/entry.py) then apply to the local copy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from xprep.prep.dataset import Retry, staged_copy
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from xprep.prep.fs import cache_root, filesystem
from xprep.prep.io import write_atomic

ENTRY_MARKERS = (PACK_JSON, BLEND_JSON)  # a directory holding one of these is an entry


def fetch_pack(url: str, cache_dir: str | None = None, retry: Retry | None = None) -> Path:
    """The local copy of the pack cache (or entry) at ``url``: the path to give where a local PACKED goes."""
    retry = retry or Retry()
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    local = cache_root(cache_dir) / "packs" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    names = _listing(fs, inner, url, retry)
    if any(m in names for m in ENTRY_MARKERS):  # the URL names one entry
        return _fetch_entry(fs, inner, local / inner.rsplit("/", 1)[-1], retry)
    if MANIFEST not in names:
        raise XprepError(f"{url}: not a pack cache (no {MANIFEST} there); give the URL of the directory "
                         "`xprep pack -o` wrote, uploaded as it is")
    local.mkdir(parents=True, exist_ok=True)
    for name, kind in names.items():
        if kind == "directory" and not name.startswith("."):
            _fetch_entry(fs, f"{inner}/{name}", local / name, retry)
    write_atomic(local / MANIFEST, retry.run(f"{url}/{MANIFEST}", lambda: fs.cat_file(f"{inner}/{MANIFEST}")),
                 durable=False)
    return local


def _listing(fs, inner: str, url: str, retry: Retry) -> dict[str, str]:
    """{name: "file" | "directory"} of the directory at ``inner``."""
    entries = retry.run(url, lambda: fs.ls(inner, detail=True, refresh=True))
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type", "file") for e in entries}


def _fetch_entry(fs, inner: str, target: Path, retry: Retry) -> Path:
    """One entry directory, fetched whole unless it is here already (its marker, written last, says so)."""
    if any((target / m).is_file() for m in ENTRY_MARKERS):
        return target
    url = fs.unstrip_protocol(inner)
    names = _listing(fs, inner, url, retry)
    if not any(m in names for m in ENTRY_MARKERS):  # an entry still being uploaded, or no entry: skipped
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with staged_copy(target, ENTRY_MARKERS) as tmp:
        for name, kind in names.items():
            if kind == "file":
                data = retry.run(f"{url}/{name}", lambda n=name: fs.cat_file(f"{inner}/{n}"))
                (tmp / name).write_bytes(data)
    return target
