"""Blends: ``xprep pack DATASET@WEIGHT ...`` or ``--mix FILE``, and reading any pack's bins as items.

A blend packs each source on its own (a plain entry of the same PACKED directory, so every mixture that
uses a dataset with the same options shares it), then orders bins from the sources with Megatron's greedy
rule (``xprep.prep.pack.blend``), weights in tokens. The blend is an entry of its own, made current:

    PACKED/blend-<key16>/
      blend.json        the sources (entry names and keys, weights, requested vs delivered shares, epochs),
                        seed, size; written last, ``"complete": true``
      bin_source.npy    int16[bins]   source of blend bin j
      bin_index.npy     int32[bins]   bin of that source's entry (int64 for sources of ≥ 2**31 bins)

Key = sha256 of canonical JSON over the blend version, the source entries' keys, names and normalized
weights, the seed and the size in tokens. Size: ``--total-tokens N``, or ``--epochs E`` (default 1) of the
source with the largest weight: ``total = E · tokens(that source) / its share``. A bin counts its capacity,
or its tokens for token-aware (then the unit of the greedy rule is the token budget).

Mix file, YAML (needs PyYAML) or JSON (``schemas/mix.schema.json``)::

    sources:
      - dataset: data/web   # a token dataset; a relative path is read from the mix file's directory
        weight: 0.7         # > 0, a share of tokens (normalized over the sources)
        name: web           # optional: the source's name in per-source loss and reports [default: directory name]

``PackBins`` reads a plain entry or a blend as bins of (document, start, length) items over one global
document index, each bin knowing its source: the trainer's dataset and ``xprep inspect --seen`` use it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from xprep.prep.dataset import TokenDataset, canonical_json
from xprep.prep.errors import XprepError
from xprep.prep.formats import (
    BLEND_JSON,
    DATASET_FORMAT,
    LOSS_MASK_STREAM,
    MANIFEST,
    PACK_FORMAT,
    PACK_JSON,
    declared_format,
)
from xprep.prep.fs import is_url
from xprep.prep.io import read_json
from xprep.prep.pack.blend import MAX_SOURCES, Blend, blend_bins, epoch_seed, relabel
from xprep.prep.pack.config import SOURCE_OPTIONS, PackConfig, check_source_option
from xprep.prep.pack.entry import CHECK_BLOCK, DamagedEntry, EntryMeta, PackEntry, load_arrays, open_packed, save_array
from xprep.prep.pack.methods import methods_of, packing_method, packing_methods
from xprep.prep.pack.shuffle import shuffled_order

BLEND_VERSION = 2  # bump when the same sources and options would blend differently (2: cut = random subset)
BLEND_ARRAYS = ("bin_source", "bin_index")
MIX_KEYS = {"dataset", "weight", "name", *SOURCE_OPTIONS}


# -------------------------------------------------------------------------------------------- sources
@dataclass
class Source:
    """One dataset of a blend: where it is, its weight (a share of tokens, not normalized), its name, and the
    packing options it overrides (``method``, ``overlong``; None: the command's, see ``PackConfig.for_source``)."""

    path: Path
    weight: float
    name: str
    method: str | None = None
    overlong: str | None = None


def read_sources(paths: list[str], weights: list[float] | None, mix: str | None,
                 localize: Callable[[str], str] | None = None, options: list[dict] | None = None) -> list[Source]:
    """The sources of a blend: the ``--mix`` file's, then the ``DATASET@WEIGHT[:key=value,...]`` arguments
    (``options``: each argument's keys); all checked (weights, names, options, datasets present, one tokenizer)
    before anything is packed. ``localize`` maps a dataset URL of the mix file to the local copy to pack (the
    CLI syncs it into the cache directory)."""
    sources = read_mix(mix, localize) if mix is not None else []
    options = options or [{} for _ in paths]
    sources += [Source(Path(p), float(w), Path(p).resolve().name, **o)
                for p, w, o in zip(paths, weights or [], options, strict=True)]
    where = f"--mix {mix}" if mix is not None else "the blend"
    if len(sources) > MAX_SOURCES:
        raise XprepError(f"{where}: {len(sources):,} sources, more than {MAX_SOURCES:,}; merge some datasets first")
    seen_names, seen_paths = {}, {}
    for s in sources:
        check_dataset(s, where)
        resolved = str(s.path.resolve())
        if resolved in seen_paths:
            raise XprepError(f"{where}: dataset {s.path} is listed twice ({seen_paths[resolved]} and {s.name}); "
                             "list each dataset once, with the sum of its weights")
        if s.name in seen_names:
            raise XprepError(f"{where}: two sources are named {s.name!r} ({seen_names[s.name]} and {s.path}); "
                             "give them distinct names (`name:` in a mix file)")
        seen_paths[resolved], seen_names[s.name] = s.name, s.path
    check_one_tokenizer(sources)
    return sources


def read_mix(mix: str, localize: Callable[[str], str] | None = None) -> list[Source]:
    """The sources a mix file lists; every mistake is one error naming the file and the source."""
    path = Path(mix)
    data = _load_mix(path)
    listed = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(listed, list) or not listed:
        raise XprepError(f"--mix {mix}: expected a mapping with a non-empty list `sources:` of "
                         "{dataset, weight, name?} (see schemas/mix.schema.json)")
    extra = set(data) - {"sources"}
    if extra:
        raise XprepError(f"--mix {mix}: unknown key {sorted(extra)[0]!r} at the top; only `sources:` is read")
    return [_mix_source(item, i, path, localize) for i, item in enumerate(listed)]


def _load_mix(path: Path):
    if not path.is_file():
        raise XprepError(f"--mix {path}: no such file; give a YAML or JSON mix file")
    if path.suffix.lower() not in (".yaml", ".yml"):
        return read_json(path, "mix file", "fix it, or write it as YAML (.yaml)")
    try:
        import yaml  # optional dependency (the yaml extra): only YAML mix files need it
    except ImportError:
        raise XprepError(f"--mix {path}: reading YAML needs PyYAML, which is not installed: pip install pyyaml "
                         "(or pip install 'xprep[yaml]'), or write the mix file as JSON") from None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise XprepError(f"--mix {path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None


def _mix_source(item, i: int, path: Path, localize: Callable[[str], str] | None = None) -> Source:
    where = f"--mix {path}: source #{i + 1}"
    if not isinstance(item, dict):
        raise XprepError(f"{where}: expected a mapping {{dataset, weight, name?}}, got {item!r}")
    unknown = set(item) - MIX_KEYS
    if unknown:
        raise XprepError(f"{where}: unknown key {sorted(unknown)[0]!r}; a source has dataset, weight, name, "
                         "method and overlong")
    dataset, weight, name = item.get("dataset"), item.get("weight"), item.get("name")
    options = {k: item[k] for k in SOURCE_OPTIONS if k in item}
    for key, value in options.items():
        check_source_option(key, value, f"{where} ({dataset})")
    if not isinstance(dataset, str) or not dataset:
        raise XprepError(f"{where}: `dataset:` must name a token dataset directory")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (0 < weight < math.inf):
        raise XprepError(f"{where} ({dataset}): the weight {weight!r} must be a positive number")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise XprepError(f"{where} ({dataset}): `name:` must be a non-empty string")
    if is_url(dataset):  # an object-store dataset: packed from its local copy, named after the URL
        if localize is None:
            raise XprepError(f"{where}: {dataset} is a URL; give the mix file to `xprep pack --mix`, which copies "
                             "URL datasets into its --cache-dir")
        return Source(Path(localize(dataset)), float(weight), name or dataset.rstrip("/").rsplit("/", 1)[-1],
                      **options)
    full = Path(dataset) if Path(dataset).is_absolute() else path.parent / dataset
    return Source(full, float(weight), name or full.resolve().name, **options)


def check_dataset(source: Source, where: str) -> None:
    """The source is a token dataset, or one error naming it."""
    manifest = source.path / MANIFEST
    if not manifest.is_file():
        raise XprepError(f"{where}: source {source.name!r}: {source.path} is not a token dataset (no {MANIFEST}); "
                         "check the path (a mix file's relative paths are read from its directory)")
    fmt = declared_format(manifest)
    if fmt != DATASET_FORMAT:
        raise XprepError(f"{where}: source {source.name!r}: {source.path} holds a {fmt!r} manifest, not a token "
                         "dataset's; blend token datasets (written by `xprep tokenize`)")


def check_one_tokenizer(sources: list[Source]) -> None:
    """All sources of a blend share a tokenizer: their token ids end up in the same batches."""
    first = None
    for s in sources:
        manifest = read_json(s.path / MANIFEST, "dataset manifest", "re-run `xprep tokenize`")
        sha = (manifest.get("tokenizer") or {}).get("sha256") if isinstance(manifest, dict) else None
        if first is None:
            first = (s, sha)
        elif sha != first[1]:
            raise XprepError(f"blend sources {first[0].name!r} ({first[0].path}) and {s.name!r} ({s.path}) were "
                             "tokenized with different tokenizers (tokenizer.json sha256 differs): blend datasets "
                             "of one tokenizer, or re-tokenize")


def check_blend_config(config: PackConfig) -> None:
    """Options that cannot apply to a blend, refused before any work."""
    if config.balance_dp:
        raise XprepError("--balance-dp does not apply to a blend: the blend interleaves the sources' bins, which "
                         "would break the per-rank steps; drop --balance-dp")
    if config.total_tokens is not None and config.total_tokens < 1:
        raise XprepError(f"--total-tokens {config.total_tokens} must be a positive number of tokens")
    if config.epochs is not None and not 0 < config.epochs < math.inf:
        raise XprepError(f"--epochs {config.epochs} must be a positive number")
    if config.total_tokens is not None and config.epochs is not None:
        raise XprepError("--total-tokens and --epochs both size the blend: give one")


def source_configs(sources: list[Source], config: PackConfig) -> list[PackConfig]:
    """How each source is packed (``PackConfig.for_source``), one epoch each (the blend repeats or cuts), checked
    to blend: bins of one kind and size (methods that ``blends_with_others`` mix freely; the others, e.g. chunk
    and token-aware, only with their own kind)."""
    configs = []
    for s in sources:
        try:
            c = config.for_source(s.method, s.overlong, has_loss_mask(s.path))
        except XprepError as e:
            raise XprepError(f"blend source {s.name!r} ({s.path}): {e}") from None
        configs.append(replace(c, total_tokens=None, epochs=None))
    methods = sorted({c.method for c in configs})
    if len(methods) > 1 and not all(packing_method(m).blends_with_others for m in methods):
        odd = next(m for m in methods if not packing_method(m).blends_with_others)
        mixable = [m.name for m in packing_methods() if m.blends_with_others]
        raise XprepError(f"a blend cannot mix --method {odd} with {', '.join(m for m in methods if m != odd)}: "
                         f"{odd} bins are read differently by the trainer; give every source the same method, or "
                         f"mix only {' and '.join(mixable)} (e.g. text: method={mixable[0]}, overlong=split)")
    return configs


def has_loss_mask(dataset: Path) -> bool:
    """Whether a token dataset has a loss-mask stream (SFT data: some tokens are not targets)."""
    manifest = read_json(dataset / MANIFEST, "dataset manifest", "re-run `xprep tokenize`")
    return LOSS_MASK_STREAM in (manifest.get("streams") or {})


# ------------------------------------------------------------------------------------------- planning
UNIT_TARGETS, UNIT_CAPACITY, UNIT_TOKENS = "target tokens", "capacity", "tokens"


def blend_unit(entries: list[PackEntry]) -> str:
    """What a blend's weights share: target tokens when any source has a loss mask (a chat set's prompts are not
    what it contributes), else bins × capacity (fixed-capacity packs, Megatron's rule on bin counts), or the
    tokens of token-aware bins."""
    if any(e.meta.get("loss_mask") for e in entries):
        return UNIT_TARGETS
    micro_batches = any(m.bin_is_micro_batch for m in methods_of(entries[0].config["method"], entries[0].path))
    return UNIT_TOKENS if micro_batches else UNIT_CAPACITY


def bin_sizes(entry: PackEntry, unit: str) -> np.ndarray | int:
    """Each bin's size in blend units: its target tokens, or its tokens for token-aware; for capacity units every
    bin is worth its capacity, given as the number of bins (``blend_bins`` then blends on counts alone)."""
    if unit == UNIT_TARGETS:
        return _targets(entry)
    return entry.num_bins if unit == UNIT_CAPACITY else bin_tokens(entry)


def _targets(entry: PackEntry) -> np.ndarray:
    if entry.bin_targets is None:
        raise XprepError(f"{entry.path}: made by an older xprep that did not count each bin's target tokens; "
                         "re-run its `xprep pack`")
    return np.asarray(entry.bin_targets)


def bin_tokens(entry: PackEntry) -> np.ndarray:
    """The real (non-padding) tokens of each bin."""
    csum = np.zeros(len(entry.item_len) + 1, np.int64)
    np.cumsum(entry.item_len, out=csum[1:])
    offsets = np.asarray(entry.bin_offsets)
    return (csum[offsets[1:]] - csum[offsets[:-1]]).astype(np.int32)


def blend_units(entry: PackEntry, unit: str) -> int:
    """A source's size in blend units: its target tokens, bins × capacity, or its tokens."""
    if unit == UNIT_TARGETS:
        return int(_targets(entry).sum(dtype=np.int64))
    return entry.num_bins * entry.capacity if unit == UNIT_CAPACITY else int(entry.meta["stats"]["tokens"])


def shares(sources: list[Source]) -> np.ndarray:
    weights = np.array([s.weight for s in sources], np.float64)
    return weights / weights.sum()


def blend_total(config: PackConfig, shares_: np.ndarray, tokens: list[int]) -> tuple[int, str]:
    """The blend's size in tokens, and the option that set it."""
    if config.total_tokens is not None:
        return int(config.total_tokens), f"--total-tokens {config.total_tokens}"
    epochs = 1.0 if config.epochs is None else float(config.epochs)
    big = int(np.argmax(shares_))
    return max(1, round(epochs * tokens[big] / shares_[big])), f"--epochs {epochs:g}"


def blend_key(entries: list[PackEntry], sources: list[Source], shares_: np.ndarray, seed: int, total: int,
              every_bin_once: bool = False) -> str:
    """The blend's cache key. The validation blend of a ``--split`` mixture (``every_bin_once``) holds every
    held-out bin once whatever the weights and seed: its key has neither, so re-weighting a mixture reuses it."""
    if every_bin_once:
        payload = {"blend_version": BLEND_VERSION, "pack_format": PACK_FORMAT, "order": "every bin once",
                   "sources": [{"key": e.key, "name": s.name} for e, s in zip(entries, sources, strict=True)]}
    else:
        payload = {"blend_version": BLEND_VERSION, "pack_format": PACK_FORMAT, "seed": seed, "total_tokens": total,
                   "sources": [{"key": e.key, "name": s.name, "share": float(w)}
                               for e, s, w in zip(entries, sources, shares_, strict=True)]}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def blend_name(key: str) -> str:
    return f"blend-{key[:16]}"


def build_blend(sources: list[Source], entries: list[PackEntry], config: PackConfig, key: str, total: int,
                size_option: str, every_bin_once: bool = False) -> tuple[Blend, dict]:
    """The blend order and its blend.json (``"complete": true``).

    ``every_bin_once``: each source's bins once, interleaved in proportion to the sources' sizes (the
    validation blend of a ``--split`` mixture: evaluation sees every held-out bin exactly once, whatever the
    weights, and any first M bins sample every source).
    """
    for s, e in zip(sources, entries, strict=True):
        if e.num_bins == 0:
            raise XprepError(f"blend source {s.name!r} ({s.path}) packs into 0 bins: nothing to blend from it; "
                             "drop it from the blend or change the pack options")
    unit = blend_unit(entries)
    available = [blend_units(e, unit) for e in entries]
    t0 = time.perf_counter()
    if every_bin_once:  # its shares are the sources' sizes: nothing in it follows the weights or the seed
        shares_ = np.array(available, np.float64) / max(sum(available), 1)
        blend = once_each(entries, unit)
    else:
        shares_ = shares(sources)
        blend = draw_blend([bin_sizes(e, unit) for e in entries], shares_, config.capacity, total, config.seed)
    seconds = time.perf_counter() - t0
    delivered_total = int(blend.tokens.sum())
    per_bin = [bin_tokens(e) for e in entries]  # real tokens of every bin, all sources end to end
    first = np.concatenate([[0], np.cumsum([len(t) for t in per_bin])])
    taken = np.concatenate(per_bin)[first[blend.bin_source] + blend.bin_index]  # one gather, not a mask per source
    real = np.bincount(blend.bin_source, weights=taken, minlength=len(entries)).astype(np.int64).tolist()
    by_source = np.argsort(blend.bin_source, kind="stable")  # each source's bins together (a radix sort of int16)
    ends = np.cumsum(np.bincount(blend.bin_source, minlength=len(entries)))
    rows = [{**_source_row(s, e, float(w), total, blend, i, available[i], delivered_total), "real_tokens": real[i],
             **delivered(e, blend.bin_index[by_source[ends[i] - int(blend.bins[i]):ends[i]]]),
             "drawn": _drawn(int(blend.bins[i]), e.num_bins, None if every_bin_once else config.seed)}
            for i, (s, e, w) in enumerate(zip(sources, entries, shares_, strict=True))]
    if every_bin_once:
        for row in rows:  # the sources' sizes, not the mixture's weights: this blend does not follow them
            row["weight"] = row["requested_share"]
    meta = {"format": PACK_FORMAT, "kind": "blend", "version": BLEND_VERSION, "key": key, "name": blend_name(key),
            "config": blend_config(entries), "seed": None if every_bin_once else config.seed,
            "size": {"option": size_option, "total_tokens": total, "unit": unit},
            "sources": rows,
            "stats": {"bins": len(blend.bin_source), "tokens": delivered_total, "real_tokens": sum(real)},
            "lookahead": any(bool(e.meta.get("lookahead")) for e in entries),  # --method chunk sources
            "blend_seconds": round(seconds, 3),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "complete": True}
    return blend, meta


def draw_blend(sizes: list[np.ndarray | int], shares_: np.ndarray, unit: int, total: int, seed: int) -> Blend:
    """``blend_bins``, where every source that gives fewer bins than it has gives a seeded random subset of them.

    Which sources are cut shows once the blend is made: each is then read through a permutation of its bins
    seeded by (seed, source) (``epoch_seed`` of epoch 0, which no repeated epoch uses). Bins of fixed capacity
    all count alike, so relabelling them changes no choice of the greedy rule; bins of their own sizes (target
    tokens, token-aware) are blended again in the drawn order until no other source turns out cut.
    """
    orders: list[np.ndarray | None] = [None] * len(sizes)
    counts = [int(s) if isinstance(s, int | np.integer) else len(s) for s in sizes]
    uniform = all(isinstance(s, int | np.integer) for s in sizes)
    blend = blend_bins(sizes, shares_, unit, total, seed)
    while True:
        cut = {i for i, n in enumerate(counts) if orders[i] is None and int(blend.bins[i]) < n}
        if not cut:
            return blend
        drawn = [shuffled_order(counts[i], epoch_seed(seed, i, 0)) if i in cut else None for i in range(len(sizes))]
        orders = [o if o is not None else d for o, d in zip(orders, drawn, strict=True)]
        blend = relabel(blend, drawn) if uniform else blend_bins(sizes, shares_, unit, total, seed, orders)


def _drawn(bins: int, available: int, seed: int | None) -> str:
    """How the bins a source gives were chosen (blend.json, reports)."""
    if seed is None:
        return "every held-out bin once"
    if bins < available:
        return f"a seeded random subset: {bins:,} of its {available:,} bins, drawn with --seed {seed}"
    if bins == available:
        return "all its bins once, in the pack's order"
    return f"all its bins, then seeded random orders of them (--seed {seed}) for {bins / available:.2f} epochs"


def delivered(entry: PackEntry, bins: np.ndarray) -> dict:
    """What the blend delivers of a source: the distinct documents with a piece in its bins, and the pieces
    (items) and target tokens over every bin it gives (repeats counted)."""
    offsets, bins = np.asarray(entry.bin_offsets), np.asarray(bins, np.int64)
    taken = np.zeros(entry.num_bins, np.bool_)
    taken[bins] = True  # each bin once, however often it repeats (linear: no sort)
    distinct = np.flatnonzero(taken)
    seen = np.zeros(int(np.max(entry.item_doc, initial=-1)) + 1, np.bool_)
    seen[np.asarray(entry.item_doc)[expand_ranges(offsets[distinct], offsets[distinct + 1])]] = True
    pieces = int((offsets[bins + 1] - offsets[bins]).sum())
    targets = int(np.asarray(entry.bin_targets)[bins].sum(dtype=np.int64)) if entry.bin_targets is not None else None
    return {"documents_delivered": int(seen.sum()), "pieces_delivered": pieces, "target_tokens": targets}


def blend_config(entries: list[PackEntry]) -> dict:
    """The pack options of a blend, as its trainer plans by them: the first source's, with the method and the
    overlong policy of every source where they differ (e.g. ``"sequential+multipack"``)."""
    config = dict(entries[0].config)
    for name in ("method", "overlong"):
        values = list(dict.fromkeys(e.config[name] for e in entries))
        if len(values) > 1:
            config[name] = "+".join(values)
    return config


def _source_row(s: Source, e: PackEntry, share: float, total: int, blend: Blend, i: int, available: int,
                delivered_total: int) -> dict:
    stats = e.meta["stats"]
    return {"name": s.name, "entry": e.path.name, "key": e.key, "datasets": [d["path"] for d in e.meta["datasets"]],
            "weight": s.weight, "requested_share": share,
            "delivered_share": int(blend.tokens[i]) / delivered_total if delivered_total else 0.0,
            "requested_tokens": share * total, "delivered_tokens": int(blend.tokens[i]),
            "tokens_available": available, "bins_available": e.num_bins, "bins": int(blend.bins[i]),
            "epochs": int(blend.bins[i]) / e.num_bins, "epochs_begun": int(blend.epochs[i]),
            "documents": stats["documents_in"],
            "documents_kept": stats["documents_in"] - stats["dropped_documents"] - stats["empty_documents"]
            - (stats.get("no_target") or {}).get("documents", 0),
            "method": e.config["method"], "overlong": e.config["overlong"]}


# ---------------------------------------------------------------------------------------------- entry
@dataclass
class BlendEntry(EntryMeta):
    """One immutable blend: bin j is bin ``bin_index[j]`` of source entry ``bin_source[j]``."""

    path: Path
    meta: dict
    bin_source: np.ndarray
    bin_index: np.ndarray
    sources: list[PackEntry]

    @property
    def num_bins(self) -> int:
        return len(self.bin_source)

    @property
    def source_names(self) -> list[str]:
        return [s["name"] for s in self.meta["sources"]]

    def write_arrays(self, directory: Path) -> None:
        for name in BLEND_ARRAYS:
            save_array(directory / f"{name}.npy", getattr(self, name))

    def manifest_row(self) -> dict:
        """The entry's line in PACKED/manifest.json."""
        return {"key": self.key, "method": "blend", "capacity": self.capacity,
                "datasets": [p for s in self.meta["sources"] for p in s["datasets"]],
                "sources": [s["entry"] for s in self.meta["sources"]], "bins": self.num_bins,
                "documents": sum(s["documents"] for s in self.meta["sources"]), "created": self.meta["created"]}

    @classmethod
    def open(cls, path: str | Path) -> BlendEntry:
        """Open a complete blend and its source entries (siblings in the same PACKED directory)."""
        path = Path(path)
        fix = "re-run its `xprep pack` with --force"
        meta = read_json(path / BLEND_JSON, "blend entry's metadata", fix)
        if not isinstance(meta, dict) or meta.get("kind") != "blend" or not meta.get("complete"):
            raise XprepError(f"{path / BLEND_JSON}: incomplete or foreign blend entry; {fix}")
        arrays = load_arrays(path, BLEND_ARRAYS, fix, damaged=True)
        sources = [_open_source(path, s, fix) for s in meta["sources"]]
        check_blend_arrays(path, arrays, meta["stats"]["bins"], np.array([e.num_bins for e in sources], np.int64))
        return cls(path=path, meta=meta, sources=sources, **arrays)


def check_blend_arrays(path: Path, arrays: dict[str, np.ndarray], bins: int, source_bins: np.ndarray) -> None:
    """A blend's own arrays: integer vectors of the length blend.json gives, bin j a bin that source
    ``bin_source[j]`` has (``source_bins`` of each), block by block; ``DamagedEntry`` names the first that is not."""
    for name, a in arrays.items():
        if a.ndim != 1 or a.dtype.kind not in "iu" or len(a) != bins:
            raise DamagedEntry(path, f"{name}.npy holds {a.dtype}{list(a.shape)}, not the {bins:,} integers of "
                                     f"blend.json's bins")
    for lo in range(0, bins, CHECK_BLOCK):
        source = np.asarray(arrays["bin_source"][lo:lo + CHECK_BLOCK]).astype(np.int64)
        index = np.asarray(arrays["bin_index"][lo:lo + CHECK_BLOCK]).astype(np.int64)
        known = (source >= 0) & (source < len(source_bins))
        bad = ~known | (index < 0) | (index >= source_bins[np.where(known, source, 0)])
        if bad.any():
            k = int(np.argmax(bad))
            raise DamagedEntry(path, f"blend arrays point outside its sources at bin {lo + k:,}: bin {int(index[k]):,} "
                                     f"of source {int(source[k]):,} (sources hold {source_bins.tolist()} bins)")


def _open_source(blend: Path, row: dict, fix: str) -> PackEntry:
    where = blend.parent / row["entry"]
    if not (where / PACK_JSON).is_file():
        raise XprepError(f"{blend}: its source {row['name']!r} ({where}) is missing; {fix}")
    entry = PackEntry.open(where)
    if entry.key != row["key"] or entry.num_bins != row["bins_available"]:
        raise XprepError(f"{blend}: its source {row['name']!r} ({where}) is not the entry it was blended from; {fix}")
    return entry


def open_entry(packed: str | Path) -> PackEntry | BlendEntry:
    """The current entry of a pack cache (or the entry directory given), a plain pack or a blend."""
    packed = Path(packed)
    if (packed / BLEND_JSON).is_file():
        return BlendEntry.open(packed)
    if not (packed / PACK_JSON).is_file() and declared_format(packed / MANIFEST) == PACK_FORMAT:
        manifest = read_json(packed / MANIFEST, "pack cache manifest", "re-run `xprep pack`")
        current = manifest.get("current") if isinstance(manifest, dict) else None
        if isinstance(current, str) and (packed / current / BLEND_JSON).is_file():
            return BlendEntry.open(packed / current)
    return open_packed(packed)


# ----------------------------------------------------------------------------------------------- bins
def _view(a: np.ndarray) -> np.ndarray:
    """A plain ndarray view of a memory map: slicing np.memmap objects is several times slower."""
    return np.asarray(a).view(np.ndarray)


class PackBins:
    """The bins of a plain entry or of a blend, as (document, start, length) items over one global document
    index: the datasets of source 0's entry, then source 1's, and so on. Every bin knows its source (0 for
    a plain pack, whose one source is named after its dataset)."""

    def __init__(self, entry: PackEntry | BlendEntry, verify_data: bool = False):
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
        for s, part in enumerate(self.parts):
            self.part_base.append(sum(len(d) for d in self.datasets))
            opened = part.open_datasets(verify_data)
            part.check_items(doc_lengths(opened))  # every item inside its document: the trainer slices by them
            self.datasets += opened
            self.dataset_source += [s] * len(opened)
            self.part_docs.append(sum(len(d) for d in opened))
        self.doc_base = np.cumsum([0, *(len(d) for d in self.datasets)]).astype(np.int64)
        self._arrays = [tuple(_view(getattr(p, n)) for n in ("bin_offsets", "item_doc", "item_start", "item_len"))
                        for p in self.parts]

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


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concatenate([arange(l, h) for l, h in zip(lo, hi)])``, without the Python loop."""
    lo, counts = np.asarray(lo, np.int64), np.asarray(hi, np.int64) - np.asarray(lo, np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.repeat(lo - starts, counts) + np.arange(total, dtype=np.int64)


def _plain_name(entry: PackEntry) -> str:
    datasets = entry.meta.get("datasets") or []
    return Path(datasets[0]["path"]).name if len(datasets) == 1 else entry.path.name


def once_each(entries: list[PackEntry], unit: str) -> Blend:
    """Every bin of every source exactly once, the sources interleaved in proportion to their sizes (bin j of
    a source of n bins sits at fraction (j + ½)/n of the order), so the first M bins sample every source."""
    counts = np.array([e.num_bins for e in entries], np.int64)
    units = np.array([blend_units(e, unit) for e in entries], np.int64)
    dtype = np.int32 if counts.max() < 2**31 else np.int64
    order = np.argsort(np.concatenate([(np.arange(n) + 0.5) / n for n in counts]), kind="stable")
    return Blend(bin_source=np.repeat(np.arange(len(entries), dtype=np.int16), counts)[order],
                 bin_index=np.concatenate([np.arange(n, dtype=dtype) for n in counts])[order],
                 bins=counts, tokens=units, epochs=np.ones(len(entries), np.int64))
