"""Blends: the order in which a mixture takes bins from its sources, and the blend entry that records it.

A blend packs each source on its own (a plain entry of the same PACKED directory, so every mixture that
uses a dataset with the same options shares it), then orders bins from the sources with Megatron's greedy
rule (``xprep.prep.pack.blend``), weights in tokens. The blend is an entry of its own, made current:

    PACKED/blend-<key16>/
      blend.json        the sources (entry names and keys, weights, requested vs delivered shares, epochs),
                        seed, size; written last, ``"complete": true``
      bin_source.npy    int16[bins]   source of blend bin j
      bin_index.npy     int32[bins]   bin of that source's entry (int64 for sources of ≥ 2**31 bins)

Key = sha256 of canonical JSON over the blend version, the source entries' keys, names and normalized
weights, the seed and the size in tokens (and, for a phased mix, each phase's size and normalized weights).
Size: ``--total-tokens N``, or ``--epochs E`` (default 1) of the source with the largest weight:
``total = E · tokens(that source) / its share``. A bin counts its capacity,
or its tokens for a method whose bins are micro-batches (token-aware: then the unit of the greedy rule is the
token budget).

A mix file with ``phases:`` makes one blend whose bins run phase after phase (``blend.phased_blend``; its blend.json
adds ``phases``: each phase's first bin, size, and requested vs delivered shares).

The sources themselves (``--mix`` files, ``DATASET@WEIGHT`` arguments) are read by ``xprep.prep.pack.mixfile``;
any entry, plain or blend, is read as bins of items by ``xprep.prep.pack.reader.PackBins``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from xprep.prep.dataset import canonical_json
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_FORMAT, PACK_JSON, declared_format
from xprep.prep.io import read_json
from xprep.prep.pack.bins import expand_ranges
from xprep.prep.pack.blend import Blend, PhasedBlend, blend_bins, epoch_seed, phased_blend, relabel
from xprep.prep.pack.config import PackConfig
from xprep.prep.pack.entry import CHECK_BLOCK, DamagedEntry, EntryMeta, PackEntry, load_arrays, open_packed, save_array
from xprep.prep.pack.methods import methods_of
from xprep.prep.pack.mixfile import Phase, Source, shares
from xprep.prep.pack.shuffle import shuffled_order

BLEND_VERSION = 2  # bump when the same sources and options would blend differently (2: cut = random subset)
BLEND_ARRAYS = ("bin_source", "bin_index")


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


def blend_total(config: PackConfig, shares_: np.ndarray, tokens: list[int]) -> tuple[int, str]:
    """The blend's size in tokens, and the option that set it."""
    if config.total_tokens is not None:
        return int(config.total_tokens), f"--total-tokens {config.total_tokens}"
    epochs = 1.0 if config.epochs is None else float(config.epochs)
    big = int(np.argmax(shares_))
    return max(1, round(epochs * tokens[big] / shares_[big])), f"--epochs {epochs:g}"


@dataclass(frozen=True)
class PhasePlan:
    """A phased mix resolved against its sources: each phase's weights (normalized, 0 for the sources it leaves
    out), its size in blend units, or in bins (``max_bins``), and its size as the mix file gives it."""

    weights: np.ndarray  # float64[P, k]
    totals: list[int]  # blend units of each phase (a phase of N bins: N · the unit; the bins end it)
    max_bins: list[int | None]
    options: list[str]

    def shares(self) -> np.ndarray:
        """Each source's share of the whole blend, as the phases ask it."""
        asked = (self.weights * np.asarray(self.totals, np.float64)[:, None]).sum(axis=0)
        return asked / asked.sum()

    def key_rows(self, sources: list[Source]) -> list[dict]:
        return [{"size": o, "total_tokens": t, "bins": b,
                 "shares": {s.name: float(w) for s, w in zip(sources, row, strict=True) if w > 0}}
                for row, t, b, o in zip(self.weights, self.totals, self.max_bins, self.options, strict=True)]


def phase_plan(phases: list[Phase], sources: list[Source], available: list[int], unit_size: int) -> PhasePlan:
    """Resolve each phase's size: ``tokens`` as given (blend units), ``bins``, or ``epochs`` E of a source s:
    E · (s's units) / s's share of the phase, as ``--epochs`` sizes a blend by its largest source."""
    names = [s.name for s in sources]
    weights = np.array([[p.weights.get(n, 0.0) for n in names] for p in phases], np.float64)
    weights /= weights.sum(axis=1, keepdims=True)
    totals = []
    for p, row in zip(phases, weights, strict=True):
        if p.epochs is not None:
            i = names.index(p.source)
            totals.append(max(1, round(p.epochs * available[i] / row[i])))
        else:
            totals.append(p.tokens if p.tokens is not None else p.bins * unit_size)
    return PhasePlan(weights, totals, [p.bins for p in phases], [p.size_option for p in phases])


def blend_key(entries: list[PackEntry], sources: list[Source], shares_: np.ndarray, seed: int, total: int,
              every_bin_once: bool = False, plan: PhasePlan | None = None) -> str:
    """The blend's cache key. The validation blend of a ``--split`` mixture (``every_bin_once``) holds every
    held-out bin once whatever the weights and seed: its key has neither, so re-weighting a mixture reuses it."""
    if every_bin_once:
        payload = {"blend_version": BLEND_VERSION, "pack_format": PACK_FORMAT, "order": "every bin once",
                   "sources": [{"key": e.key, "name": s.name} for e, s in zip(entries, sources, strict=True)]}
    else:
        payload = {"blend_version": BLEND_VERSION, "pack_format": PACK_FORMAT, "seed": seed, "total_tokens": total,
                   "sources": [{"key": e.key, "name": s.name, "share": float(w)}
                               for e, s, w in zip(entries, sources, shares_, strict=True)]}
        if plan is not None:  # only then: a blend without phases keeps its key
            payload["phases"] = plan.key_rows(sources)
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def blend_name(key: str) -> str:
    return f"blend-{key[:16]}"


def build_blend(sources: list[Source], entries: list[PackEntry], config: PackConfig, key: str, total: int,
                size_option: str, every_bin_once: bool = False, plan: PhasePlan | None = None
                ) -> tuple[Blend, dict]:
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
    phased = None
    if plan is not None:
        shares_ = plan.shares()
        phased = draw_phased([bin_sizes(e, unit) for e in entries], plan, config.capacity, config.seed)
        blend = phased.blend
    elif every_bin_once:  # its shares are the sources' sizes: nothing in it follows the weights or the seed
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
            **({"phases": phase_rows(phased, plan, sources, taken)} if phased is not None else {}),
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


def draw_phased(sizes: list[np.ndarray | int], plan: PhasePlan, unit: int, seed: int) -> PhasedBlend:
    """``phased_blend``, where every source that the whole mix takes less than an epoch of gives a seeded random
    subset of its bins, as ``draw_blend``'s cut sources do (its stream's first epoch is then that permutation)."""
    counts = [int(s) if isinstance(s, int | np.integer) else len(s) for s in sizes]
    orders: list[np.ndarray | None] = [None] * len(sizes)
    while True:
        phased = phased_blend(sizes, plan.weights, plan.totals, unit, seed, plan.max_bins, orders)
        cut = [i for i, n in enumerate(counts) if orders[i] is None and int(phased.blend.bins[i]) < n]
        if not cut:
            return phased
        for i in cut:
            orders[i] = shuffled_order(counts[i], epoch_seed(seed, i, 0)).astype(np.int64)


def phase_rows(phased: PhasedBlend, plan: PhasePlan, sources: list[Source], real_per_bin: np.ndarray) -> list[dict]:
    """blend.json's ``phases``: each phase's first bin, size, and per source the requested vs delivered share of
    its units, its real tokens, and where in its stream of bins it started and ended."""
    rows = []
    for p, option in enumerate(plan.options):
        lo, hi = int(phased.starts[p]), int(phased.starts[p + 1])
        units = phased.tokens[p]
        real = np.bincount(phased.blend.bin_source[lo:hi], weights=real_per_bin[lo:hi], minlength=len(sources))
        rows.append({"phase": p + 1, "size": option, "start_bin": lo, "bins": hi - lo,
                     "tokens": int(units.sum()), "real_tokens": int(real.sum()),
                     "sources": [{"name": s.name, "requested_share": float(plan.weights[p, i]),
                                  "delivered_share": float(units[i] / max(units.sum(), 1)),
                                  "delivered_tokens": int(units[i]), "real_tokens": int(real[i]),
                                  "bins": int(phased.bins[p, i]), "from_position": int(phased.positions[p, i]),
                                  "to_position": int(phased.positions[p + 1, i])}
                                 for i, s in enumerate(sources) if plan.weights[p, i] > 0]})
    return rows


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
