"""The on-disk layout of one pack cache entry (DESIGN §2), written and read from one place.

```
packed/
  manifest.json          {"format": "xprep-packed", "current": "<method>-<key16>", "entries": {...}}
  <method>-<key16>/
    pack.json            config, key, dataset paths + fingerprints, stats, "complete": true
    bin_offsets.npy      int64[n_bins+1]  CSR over items
    item_doc.npy         int64[n_items]   document index, global over the input datasets
    item_start.npy       int32|int64      first token taken from that document
    item_len.npy         int32            tokens taken
```
Bin ``b`` holds items ``bin_offsets[b]:bin_offsets[b+1]``; item ``i`` is tokens
``item_start[i] : item_start[i] + item_len[i]`` of global document ``item_doc[i]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prep.dataset import FORMAT as DATASET_FORMAT
from prep.errors import XprepError

PACK_FORMAT = "xprep-packed"
PACK_JSON = "pack.json"
MANIFEST = "manifest.json"
ARRAYS = ("bin_offsets", "item_doc", "item_start", "item_len")


@dataclass
class PackEntry:
    """One immutable pack: CSR arrays (memory-mapped when opened) plus its ``pack.json``."""

    path: Path
    meta: dict
    bin_offsets: np.ndarray
    item_doc: np.ndarray
    item_start: np.ndarray
    item_len: np.ndarray

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def config(self) -> dict:
        return self.meta["config"]

    @property
    def capacity(self) -> int:
        return int(self.meta["config"]["capacity"])

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    @property
    def dataset_paths(self) -> list[Path]:
        return [Path(d["path"]) for d in self.meta["datasets"]]

    def bin_items(self, b: int) -> slice:
        return slice(int(self.bin_offsets[b]), int(self.bin_offsets[b + 1]))

    def write_arrays(self, directory: Path) -> None:
        for name in ARRAYS:
            np.save(directory / f"{name}.npy", getattr(self, name), allow_pickle=False)

    @classmethod
    def open(cls, path: str | Path) -> PackEntry:
        """Open a complete entry; anything missing or inconsistent is a clear error."""
        path = Path(path)
        meta_path = path / PACK_JSON
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise XprepError(f"{path}: not a pack entry (no {PACK_JSON}); re-run `xprep pack`") from None
        except json.JSONDecodeError as e:
            raise XprepError(f"{meta_path}: corrupt ({e}); re-run `xprep pack --force`") from None
        if meta.get("format") != PACK_FORMAT or not meta.get("complete"):
            raise XprepError(f"{meta_path}: incomplete or foreign pack entry; re-run `xprep pack --force`")
        arrays = {}
        for name in ARRAYS:
            try:
                arrays[name] = np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
            except (FileNotFoundError, ValueError) as e:
                raise XprepError(f"{path / name}.npy: {e}; re-run `xprep pack --force`") from None
        n_items = len(arrays["item_doc"])
        if (len(arrays["item_start"]) != n_items or len(arrays["item_len"]) != n_items
                or len(arrays["bin_offsets"]) == 0 or int(arrays["bin_offsets"][-1]) != n_items):
            raise XprepError(f"{path}: pack arrays disagree in size; re-run `xprep pack --force`")
        return cls(path=path, meta=meta, **arrays)


def open_packed(packed: str | Path) -> PackEntry:
    """Open the current entry of a pack cache directory (or an entry directory itself).

    What a user may give instead (a token dataset, a missing or unrelated directory) is named as what it
    is, with the command that makes a pack cache, rather than reported as a missing or corrupt manifest.
    """
    packed = Path(packed)
    if (packed / PACK_JSON).is_file():
        return PackEntry.open(packed)
    _check_pack_cache(packed)
    manifest_path = packed / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        current = manifest["current"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise XprepError(f"{manifest_path}: corrupt ({e}); re-run `xprep pack`") from None
    return PackEntry.open(packed / current)


def _check_pack_cache(path: Path) -> None:
    make = "`xprep pack DATASET -o PACKED --method ...`"
    if not path.exists():
        raise XprepError(f"{path}: no such directory, so not a pack cache; give the directory {make} wrote")
    if not path.is_dir():
        raise XprepError(f"{path}: is a file, not a pack cache directory; give the directory {make} wrote")
    fmt = _manifest_format(path / MANIFEST)
    if fmt == DATASET_FORMAT or (fmt is None and (path / "tokens.idx").is_file()):
        raise XprepError(f"{path}: is a token dataset (written by `xprep tokenize`), not a pack cache; pack it "
                         f"first with `xprep pack {path} -o PACKED --method multipack --seq-len N` (see "
                         "`xprep pack --help` for the other methods), then train with `xtrain run PACKED`")
    if not (path / MANIFEST).is_file():
        raise XprepError(f"{path}: not a pack cache (no {MANIFEST}); give the directory {make} wrote, "
                         "or run that first")
    if fmt not in (None, PACK_FORMAT):
        raise XprepError(f"{path / MANIFEST}: a {fmt!r} manifest, not a pack cache's ({PACK_FORMAT!r}); give "
                         f"the directory {make} wrote")


def _manifest_format(path: Path) -> str | None:
    """The ``format`` a manifest.json declares; None when there is none or it is unreadable (reported later)."""
    try:
        fmt = json.loads(path.read_text()).get("format")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return fmt if isinstance(fmt, str) else None
