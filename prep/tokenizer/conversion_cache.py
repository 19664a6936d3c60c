"""The cache of converted tokenizers: one directory per conversion, ``<cache>/converted-v<N>-<key>/`` holding the
tokenizer.json and ``conversion.json`` (written last: the entry's completion marker, with the tokenizer.json's
sha256). Entries are built in a temporary directory and renamed into place, so an entry that is there is whole; one
that is not (incomplete, edited) is said and made again, never used. The cache directory is the cache setting's
(``prep.fs.cache_root``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.fs import CACHE_ENV
from xprep.prep.io import remove_tree, write_json_atomic

_ENTRY_KEYS = {"named": dict, "named_from": str, "options": dict, "notes": list, "flag_tokens": dict,
               "tokenizer_sha256": str}


def read_entry(entry: Path, say: bool = True) -> dict | None:
    """A complete cache entry's metadata (``conversion.json`` is written last), or None (said when unusable)."""
    meta_path = entry / "conversion.json"
    warn = _warn if say else lambda entry, problem: None
    try:
        meta = json.loads(meta_path.read_bytes())
        sha = hashlib.sha256((entry / "tokenizer.json").read_bytes()).hexdigest()
    except FileNotFoundError:
        if entry.exists():
            warn(entry, "incomplete")
        return None
    except (OSError, ValueError) as e:
        warn(entry, f"cannot read it: {e}")
        return None
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), t) for k, t in _ENTRY_KEYS.items())):
        warn(entry, "not the shape this version of xprep writes")
        return None
    if meta["tokenizer_sha256"] != sha:
        warn(entry, "its tokenizer.json was changed after it was written")
        return None
    return meta


def _warn(entry: Path, problem: str) -> None:
    print(f"xprep: warning: {entry}: unusable converted-tokenizer cache entry ({problem}); converting again",
          file=sys.stderr)


def publish(entry: Path, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """Build an entry in a temporary directory and rename it into place; returns (its directory, its metadata).

    An unwritable cache directory gets a temporary directory instead (said: the conversion runs every time; a
    dataset keeps its converted tokenizer.json inside it anyway, see prep.dataset.token_dataset.dataset_tokenizer).
    """
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        print(f"xprep: note: cannot write the cache in {entry.parent} ({e.strerror}): the converted tokenizer.json "
              f"goes to a temporary directory, converted again every run; pass --cache-dir DIR (or set {CACHE_ENV}) "
              "to a writable directory", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix="xprep-tokenizer-"))
        return tmp, _fill(tmp, build)
    try:
        meta = _fill(tmp, build)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if entry.exists():
        theirs = read_entry(entry, say=False)
        if theirs is not None:  # another run published it meanwhile (and may be reading it): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return entry, theirs
        remove_tree(entry)  # a broken one, said by read_entry
    try:
        os.replace(tmp, entry)
    except OSError:  # another run published it between the two: same content, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        theirs = read_entry(entry, say=False)
        if theirs is not None:
            return entry, theirs
        raise XprepError(f"{entry}: cannot publish the converted tokenizer there; remove that directory and run "
                         "again") from None
    return entry, meta


def _fill(tmp: Path, build: Callable[[Path], dict]) -> dict:
    meta = build(tmp)
    meta["tokenizer_sha256"] = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()
    write_json_atomic(tmp / "conversion.json", meta)  # last: the entry's completion marker
    return meta
