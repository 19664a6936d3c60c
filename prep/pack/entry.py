"""The on-disk layout of one pack cache entry (pack.json: schemas/pack.schema.json), written and read in one place.

```
packed/
  manifest.json          {"format": "xprep-packed", "current": "<method>-<key16>", "entries": {...}}
  <method>-<key16>/
    pack.json            config, key, dataset paths + fingerprints, stats, "complete": true
    bin_offsets.npy      int64[n_bins+1]  CSR over items
    item_doc.npy         int64[n_items]   document index, global over the input datasets
    item_start.npy       int32|int64      first token taken from that document
    item_len.npy         int32            tokens taken
    bin_targets.npy      int32[n_bins]    target tokens of each bin (what the trainer learns from it)
    bin_next_doc.npy     int64[n_bins]    --attention causal only: the document whose first token follows the
                                          sample in the stream when the sample ends at a document's end, else -1
```
Bin ``b`` holds items ``bin_offsets[b]:bin_offsets[b+1]``; item ``i`` is tokens
``item_start[i] : item_start[i] + item_len[i]`` of global document ``item_doc[i]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from xprep.prep.dataset import (
    Retry,
    TokenDataset,
    idx_path,
    open_parts,
    open_url_parts,
    read_manifest,
    sync_dataset,  # fsspec itself loads only when a URL is read
    verify_streams,
)
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.formats import DATASET_FORMAT, MANIFEST, PACK_FORMAT, PACK_JSON, TOKENS_STREAM, declared_format
from xprep.prep.fs import is_url
from xprep.prep.io import read_json
from xprep.prep.pack.config import CAUSAL

ARRAYS = ("bin_offsets", "item_doc", "item_start", "item_len")
TARGETS = "bin_targets"  # since pack version 2
NEXT = "bin_next_doc"  # chunk packs made with --attention causal: the label of a sample's last position


class EntryMeta:
    """What every cache entry (a pack, or a blend of packs) derives from its metadata ``meta``."""

    meta: dict

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def config(self) -> dict:
        """The pack options (a blend's: those of all its sources): what the trainer plans batches by."""
        return self.meta["config"]

    @property
    def capacity(self) -> int:
        return int(self.meta["config"]["capacity"])

    @property
    def one_span(self) -> bool:
        """Whether each sample trains as one causal attention span across its documents (``--method chunk
        --attention causal``, Megatron's default); packs made before the option keep documents apart."""
        return self.meta["config"].get("attention") == CAUSAL


@dataclass
class PackEntry(EntryMeta):
    """One immutable pack: CSR arrays (memory-mapped when opened) plus its ``pack.json``."""

    path: Path
    meta: dict
    bin_offsets: np.ndarray
    item_doc: np.ndarray
    item_start: np.ndarray
    item_len: np.ndarray
    bin_targets: np.ndarray | None = None  # None: an entry of pack version 1, which did not count them
    bin_next_doc: np.ndarray | None = None  # --attention causal only (NEXT)

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    def manifest_row(self) -> dict:
        """The entry's line in PACKED/manifest.json."""
        stats = self.meta["stats"]
        return {"key": self.key, "method": self.config["method"], "capacity": self.capacity,
                "datasets": [d["path"] for d in self.meta["datasets"]], "bins": stats["bins"],
                "documents": stats["documents_in"], "created": self.meta["created"]}

    @property
    def dataset_paths(self) -> list[Path]:
        return [Path(d["path"]) for d in self.meta["datasets"]]

    def bin_items(self, b: int) -> slice:
        return slice(int(self.bin_offsets[b]), int(self.bin_offsets[b + 1]))

    def open_datasets(self, verify_data: bool = False, stream: bool = False, cache_dir: str | None = None
                      ) -> list[TokenDataset]:
        """Every dataset this entry was packed from, in order (a sharded one as its shards); missing or changed ones
        are refused (``stream``, ``cache_dir``: see ``open_listed``)."""
        return open_fingerprinted(self.meta.get("datasets", []), self.path, verify_data=verify_data, stream=stream,
                                  cache_dir=cache_dir)

    def open_listed(self, verify_data: bool = False, stream: bool = False) -> list[list[TokenDataset]]:
        """``open_datasets`` grouped by the dataset pack.json lists (``open_listed``)."""
        return open_listed(self.meta.get("datasets", []), self.path, verify_data=verify_data, stream=stream)

    def write_arrays(self, directory: Path) -> None:
        for name in (*ARRAYS, TARGETS, NEXT):
            if getattr(self, name) is not None:
                save_array(directory / f"{name}.npy", getattr(self, name))

    @classmethod
    def open(cls, path: str | Path) -> PackEntry:
        """Open a complete entry; anything missing or inconsistent is a clear error."""
        path = Path(path)
        meta_path = path / PACK_JSON
        if not meta_path.is_file():
            raise XprepError(f"{path}: not a pack entry (no {PACK_JSON}); re-run `xprep pack`")
        meta = read_json(meta_path, "pack entry's metadata", "re-run `xprep pack --force`")
        if not isinstance(meta, dict) or meta.get("format") != PACK_FORMAT or not meta.get("complete"):
            raise XprepError(f"{meta_path}: incomplete or foreign pack entry; re-run `xprep pack --force`")
        counted = (path / f"{TARGETS}.npy").exists() or int(meta.get("version", 1)) >= 2
        causal = (meta.get("config") or {}).get("attention") == CAUSAL
        names = (*ARRAYS, *((TARGETS,) if counted else ()), *((NEXT,) if causal else ()))
        arrays = load_arrays(path, names, REBUILD, damaged=True)
        check_arrays(path, arrays)
        return cls(path=path, meta=meta, **arrays)

    def check_items(self, doc_lengths: np.ndarray) -> None:
        """Refuse (``DamagedEntry``) an item outside the documents it names: ``doc_lengths`` holds the lengths of
        the entry's datasets' documents, concatenated in its order (its global document index)."""
        check_items(self.path, self.bin_offsets, self.item_doc, self.item_start, self.item_len, doc_lengths)
        if self.bin_next_doc is not None:
            check_next_docs(self.path, self.bin_next_doc, doc_lengths)


# ------------------------------------------------------------------------------------------ checks
REBUILD = "re-run the `xprep pack` command that made it, which rebuilds a damaged entry (or add --force)"
CHECK_BLOCK = 1 << 22  # items (or bins) checked at a time: the checks of a 100M-item entry stay in ~100 MB


class DamagedEntry(XprepError):
    """A cache entry whose arrays are unreadable or break the layout's invariants (``check_arrays``,
    ``check_items``): refused where it is opened, rebuilt by ``xprep pack`` rather than taken as a hit."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: damaged pack entry: {problem}; {REBUILD}")

    def __reduce__(self):
        return DamagedEntry, (self.path, self.problem)


def check_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The invariants of an entry's arrays alone, vectorized block by block (an entry may hold 100M items):
    integer vectors whose lengths agree; bin offsets that start at 0, never decrease and end at the item count;
    every item at least one token long, from a start ≥ 0 of a document index ≥ 0. ``DamagedEntry`` names the
    first array, bin or item that breaks one."""
    for name, a in arrays.items():
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise DamagedEntry(path, f"{name}.npy holds {a.dtype}{list(a.shape)}, not a vector of integers")
    offsets, n_items = arrays["bin_offsets"], len(arrays["item_doc"])
    for name in ("item_start", "item_len"):
        if len(arrays[name]) != n_items:
            raise DamagedEntry(path, f"{name}.npy holds {len(arrays[name]):,} items, item_doc.npy {n_items:,}")
    if len(offsets) == 0:
        raise DamagedEntry(path, "bin_offsets.npy is empty (it holds one offset more than there are bins)")
    if TARGETS in arrays and len(arrays[TARGETS]) != len(offsets) - 1:
        raise DamagedEntry(path, f"{TARGETS}.npy holds {len(arrays[TARGETS]):,} bins, bin_offsets.npy "
                                 f"{len(offsets) - 1:,}")
    if NEXT in arrays and len(arrays[NEXT]) != len(offsets) - 1:
        raise DamagedEntry(path, f"{NEXT}.npy holds {len(arrays[NEXT]):,} bins, bin_offsets.npy {len(offsets) - 1:,}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_items:
        end = "starts at" if int(offsets[0]) != 0 else "ends at"
        value = int(offsets[0]) if end == "starts at" else int(offsets[-1])
        raise DamagedEntry(path, f"bin_offsets {end} {value:,}, not {0 if end == 'starts at' else n_items:,} "
                                 f"(the item count is {n_items:,})")
    for lo in range(0, len(offsets) - 1, CHECK_BLOCK):
        block = np.asarray(offsets[lo:lo + CHECK_BLOCK + 1])
        down = np.flatnonzero(block[1:] < block[:-1])
        if len(down):
            b = lo + int(down[0])
            raise DamagedEntry(path, f"bin_offsets decrease at bin {b:,} ({int(offsets[b]):,}, then "
                                     f"{int(offsets[b + 1]):,})")
    rules = (("item_len", 1), ("item_start", 0), ("item_doc", 0))  # each value ≥ its bound
    for lo in range(0, n_items, CHECK_BLOCK):
        part = slice(lo, lo + CHECK_BLOCK)
        bad = np.zeros(len(arrays["item_doc"][part]), np.bool_)
        for name, bound in rules:
            bad |= np.asarray(arrays[name][part]) < bound
        if bad.any():
            i = lo + int(np.argmax(bad))
            name, bound = next((n, b) for n, b in rules if int(arrays[n][i]) < b)
            raise DamagedEntry(path, f"item {i:,} (bin {_bin_of(offsets, i):,}) has {name} {int(arrays[name][i]):,}, "
                                     f"which must be ≥ {bound}")


def check_items(path: Path, offsets: np.ndarray, item_doc: np.ndarray, item_start: np.ndarray,
                item_len: np.ndarray, doc_lengths: np.ndarray) -> None:
    """Every item inside the document it names: ``item_doc < len(doc_lengths)`` and ``item_start + item_len ≤``
    that document's length, block by block. ``DamagedEntry`` names the first item (and its bin) that is not."""
    doc_lengths = np.require(doc_lengths, requirements="AC")  # an .idx's lengths lie unaligned: gathers 5x slower
    n_docs = len(doc_lengths)
    for lo in range(0, len(item_doc), CHECK_BLOCK):
        part = slice(lo, lo + CHECK_BLOCK)
        docs = np.asarray(item_doc[part])
        outside = docs >= n_docs
        ends = np.add(item_start[part], item_len[part], dtype=np.int64)
        if outside.any():
            bad = outside | (ends > doc_lengths[np.where(outside, 0, docs)] if n_docs else outside)
        else:  # (the common case: no temporary for the gather's index)
            bad = ends > doc_lengths[docs]
            if not bad.any():
                continue
        k = int(np.argmax(bad))
        i, d = lo + k, int(docs[k])
        where = f"item {i:,} (bin {_bin_of(offsets, i):,})"
        if outside[k]:
            raise DamagedEntry(path, f"{where} names document {d:,}, but the entry's datasets hold {n_docs:,} "
                                     "documents")
        raise DamagedEntry(path, f"{where} takes tokens {int(item_start[i]):,}..{int(ends[k]):,} of document {d:,}, "
                                 f"which has {int(doc_lengths[d]):,}")


def check_next_docs(path: Path, next_doc: np.ndarray, doc_lengths: np.ndarray) -> None:
    """Every ``bin_next_doc`` -1 or a non-empty document of the entry's datasets (whose first token it reads)."""
    next_doc = np.asarray(next_doc)
    named = next_doc != -1
    bad = named & ((next_doc < 0) | (next_doc >= len(doc_lengths)))
    if not bad.any():
        bad = named.copy()
        bad[named] = doc_lengths[next_doc[named]] == 0
    if bad.any():
        b = int(np.argmax(bad))
        raise DamagedEntry(path, f"{NEXT}.npy names document {int(next_doc[b]):,} after bin {b:,}, which is not a "
                                 f"non-empty document of the entry's {len(doc_lengths):,}")


def _bin_of(offsets: np.ndarray, item: int) -> int:
    """The bin holding ``item`` (offsets checked to be non-decreasing first)."""
    return int(np.searchsorted(offsets, item, side="right")) - 1


def save_array(path: Path, array: np.ndarray) -> None:
    """``np.save(path, array)``, byte for byte (a version 1.0 header, then the data), written by plain ``write``: a
    full disk is then an OSError with its errno, which becomes the one-line error naming the file, the bytes and
    ``-o`` (numpy's own ``tofile`` says only "N requested and M written")."""
    array = np.ascontiguousarray(array)
    with machine_errors(str(path), "-o", array.nbytes), open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(memoryview(array.reshape(-1)).cast("B"))


def load_arrays(path: Path, names: tuple[str, ...], fix: str, damaged: bool = False) -> dict[str, np.ndarray]:
    """An entry's ``<name>.npy`` arrays, memory-mapped (never unpickled); a missing or bad one is one clear error
    (a ``DamagedEntry`` of ``path`` where ``damaged``)."""
    arrays = {}
    for name in names:
        try:
            arrays[name] = np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        except (FileNotFoundError, ValueError) as e:
            if damaged:
                problem = "is missing" if isinstance(e, FileNotFoundError) else f"does not load ({e})"
                raise DamagedEntry(path, f"{name}.npy {problem}") from None
            raise XprepError(f"{path / name}.npy: {e}; {fix}") from None
    return arrays


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
    manifest = read_json(manifest_path, "pack cache manifest", "re-run `xprep pack`")
    current = manifest.get("current") if isinstance(manifest, dict) else None
    if not isinstance(current, str):
        raise XprepError(f"{manifest_path}: corrupt (no current entry); re-run `xprep pack`")
    return PackEntry.open(packed / current)


class DatasetChanged(XprepError):
    """A dataset a pack lists is no longer the one it was packed from (another manifest fingerprint)."""


def open_fingerprinted(listed: list[dict], where: str | Path, since: str = "it was packed",
                       verify_data: bool = False, stream: bool = False, cache_dir: str | None = None
                       ) -> list[TokenDataset]:
    """Open the datasets ``listed`` ({"path", "fingerprint"} each, as pack.json lists them), in order, a sharded one
    as its shards: the plain datasets over which a pack's global document index runs (``open_listed``)."""
    return [ds for group in open_listed(listed, where, since, verify_data, stream, cache_dir) for ds in group]


def open_listed(listed: list[dict], where: str | Path, since: str = "it was packed",
                verify_data: bool = False, stream: bool = False, cache_dir: str | None = None
                ) -> list[list[TokenDataset]]:
    """Open the datasets ``listed`` ({"path", "fingerprint"} each, as pack.json lists them), in order: per dataset,
    the plain datasets it is made of (itself, or a sharded one's shards in order).

    The one place a pack's inputs are opened (the pack build, ``xtrain``, ``xprep inspect``): a missing
    dataset is an XprepError, a re-tokenized or re-merged one (another fingerprint) a ``DatasetChanged``.
    ``verify_data`` also re-hashes each ``.bin`` against the manifest, which catches an in-place edit of the
    token files at the cost of reading them once (at a URL: fetching them once, ``StreamedDataset.verify``).
    ``where`` names the pack in messages, ``since`` when the fingerprints were taken. A dataset listed by URL is
    read in place (``StreamedDataset``); so is one packed from a URL whose local copy this machine lacks, when
    ``stream`` (training), else it is synced again. What is fetched goes into ``cache_dir`` (``--cache-dir``; None:
    ``prep.fs.cache_root``'s).
    """
    datasets = []
    for i, info in enumerate(listed):
        path = Path(info["path"])
        if is_url(info["path"]) or (stream and not (path / MANIFEST).is_file() and info.get("url")):
            url = info["path"] if is_url(info["path"]) else info["url"]
            manifest, parts = open_url_parts(url, cache_dir)  # (a sharded one: its shards, each at its URL)
            _check_fingerprint(url, manifest["fingerprint"], info, where, since)
            for streamed in parts if verify_data else ():
                streamed.verify()
            datasets.append(parts)
            continue
        if not (path / MANIFEST).is_file() and info.get("url"):
            path = _sync_again(info["url"], path, cache_dir)
        if not (path / MANIFEST).is_file():
            raise XprepError(f"{where}: input dataset #{i} {path} is missing; restore it or re-run "
                             "`xprep tokenize` and `xprep pack`")
        manifest = read_manifest(path)
        if manifest["fingerprint"] != info["fingerprint"]:
            raise DatasetChanged(f"{where}: dataset {path} changed since {since} (fingerprint "
                                 f"{manifest['fingerprint'][:16]} != {info['fingerprint'][:16]}); re-run `xprep pack`")
        parts = open_parts(path, manifest)  # (a shard is checked against the fingerprint its sharded manifest lists)
        for ds in parts if verify_data else ():
            verify_streams(ds.path, ds.manifest, "bin")
        datasets.append(parts)
    return datasets


def _check_fingerprint(path: str, fingerprint: str, info: dict, where: str | Path, since: str) -> None:
    if fingerprint != info["fingerprint"]:
        raise DatasetChanged(f"{where}: dataset {path} changed since {since} (fingerprint "
                             f"{fingerprint[:16]} != {info['fingerprint'][:16]}); re-run `xprep pack`")


def _sync_again(url: str, path: Path, cache_dir: str | None) -> Path:
    """A dataset packed from a URL, on a machine without the local copy the pack was made from (a training node,
    another user): synced into this machine's cache (``cache_dir``), which the fingerprint check then vouches for."""
    local = sync_dataset(url, cache_dir, Retry())
    print(f"xprep: {path} is not on this machine: synced its dataset from {url} into {local}", file=sys.stderr)
    return local


def _check_pack_cache(path: Path) -> None:
    make = "`xprep pack DATASET -o PACKED --method ...`"
    if not path.exists():
        raise XprepError(f"{path}: no such directory, so not a pack cache; give the directory {make} wrote")
    if not path.is_dir():
        raise XprepError(f"{path}: is a file, not a pack cache directory; give the directory {make} wrote")
    fmt = declared_format(path / MANIFEST)
    if fmt == DATASET_FORMAT or (fmt is None and idx_path(path / TOKENS_STREAM).is_file()):
        raise XprepError(f"{path}: is a token dataset (written by `xprep tokenize`), not a pack cache; pack it "
                         f"first with `xprep pack {path} -o PACKED --method multipack --seq-len N` (see "
                         "`xprep pack --help` for the other methods), then train with `xtrain run PACKED`")
    if not (path / MANIFEST).is_file():
        raise XprepError(f"{path}: not a pack cache (no {MANIFEST}); give the directory {make} wrote, "
                         "or run that first")
    if fmt not in (None, PACK_FORMAT):
        raise XprepError(f"{path / MANIFEST}: a {fmt!r} manifest, not a pack cache's ({PACK_FORMAT!r}); give "
                         f"the directory {make} wrote")
