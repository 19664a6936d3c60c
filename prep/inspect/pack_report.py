"""What is in a pack cache entry: ``xprep inspect PACKED`` and the summary ``xprep pack`` prints.

Bin-level figures come from the entry's arrays; per-category token counts combine the input
datasets' manifest counts with the category stream over the tokens packing removed (dropped
documents, truncated tails), so only removed tokens are ever read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from xprep.prep.dataset import Retry, TokenDataset, stream_chunks
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON
from xprep.prep.fs import is_url
from xprep.prep.inspect.remote import moved_to
from xprep.prep.inspect.stats import count_histogram, fill_histogram, length_stats, ratio_histogram
from xprep.prep.pack import (
    MANIFEST,
    PACK_JSON,
    BlendEntry,
    DatasetChanged,
    PackEntry,
    doc_lengths,
    fetch_pack,
    methods_of,
    open_entry,
    range_bincount,
)

DP_STEPS_SHOWN = 48  # steps of a --balance-dp pack whose per-rank Σlen² the report lists in full


def pack_report(path: str | Path, cache_dir: str | None = None) -> dict:
    """JSON-able report on the current entry of a pack cache (or an entry directory), with the list
    of every entry in the cache (``None`` for an entry directory). One at a URL is fetched first (its entry files:
    ``fetch_pack``) into ``cache_dir``, as are the indexes of input datasets at URLs."""
    if is_url(str(path)):
        local = str(fetch_pack(str(path), cache_dir, Retry()))
        return moved_to(pack_report(local, cache_dir), local, str(path).rstrip("/"))
    entries = cache_entries(Path(path))
    entry = open_entry(path)
    if isinstance(entry, BlendEntry):
        return blend_report(entry, entries, cache_dir)
    stats = entry.meta["stats"]
    offsets = np.asarray(entry.bin_offsets)
    per_bin = bin_token_counts(offsets, np.asarray(entry.item_len))
    tokens, n_bins, capacity = int(per_bin.sum()), entry.num_bins, entry.capacity
    lower = -(-tokens // capacity)
    datasets, note = _open_inputs(entry, cache_dir)
    if datasets is not None:
        entry.check_items(doc_lengths(datasets))  # a damaged entry is refused, not reported on
    categories, note = category_tokens(entry, datasets) if datasets is not None else (None, note)
    documents_per_bin = np.diff(offsets)
    return {
        "kind": "packed",
        "path": str(entry.path),
        "key": entry.key,
        "config": entry.config,
        "packing": packing(entry.config, entry.path),
        "layout": entry.meta.get("layout"),
        "eod_id": entry.meta.get("eod_id"),  # --eod-mask-loss: the token never a target
        "datasets": entry.meta["datasets"],
        "bins": n_bins,
        "items": int(offsets[-1]),
        "tokens": tokens,
        "capacity": capacity,
        "fill": tokens / (n_bins * capacity) if n_bins else 0.0,
        "lower_bound_bins": lower,
        "gap_to_lower_bound": (n_bins - lower) / lower if lower else 0.0,
        "padding_tokens": n_bins * capacity - tokens,
        "cp_padding_tokens": stats["cost_tokens"] - stats["tokens"],
        "unused_tokens": n_bins * capacity - stats["cost_tokens"],  # padding beyond the CP rounding
        "documents_per_bin": length_stats(documents_per_bin),
        "tokens_per_bin": length_stats(per_bin),
        "fill_histogram": fill_histogram(per_bin, capacity),
        "documents_per_bin_histogram": count_histogram(documents_per_bin),
        "overlong": {k: stats[k] for k in _OVERLONG_KEYS},
        "no_target": stats.get("no_target"),  # pieces (and documents) dropped for holding no target token
        "target_tokens": stats.get("target_tokens"),
        "documents_in": stats["documents_in"],
        "tokens_in": stats["tokens_in"],
        "empty_documents": stats["empty_documents"],
        "categories": categories,
        "category_shares": category_shares(categories),
        "categories_note": note,
        "dp_balance": stats.get("dp_balance"),
        "dp_steps": dp_steps(offsets, np.asarray(entry.item_len), stats["dp_balance"])
        if stats.get("dp_balance") else None,
        "pack_seconds": entry.meta.get("pack_seconds"),
        "created": entry.meta.get("created"),
        "current": entry.path.name,
        "entries": entries,
    }


def packing(config: dict, where: str | Path) -> dict:
    """What the text and the HTML say of a plain pack's method, from its registry entry (they import nothing of the
    pack stage): its help line, the option that sizes its bins, whether its bins are fixed-length samples. A
    method this xprep does not know is an error naming the entry."""
    method, = methods_of(config["method"], str(where))
    if not method.fixed_length_samples:
        return method.describe()
    return {**method.describe(), "attention": config.get("attention") or "document",  # (none: packed before it)
            "eod_mask_loss": bool(config.get("eod_mask_loss"))}


_OVERLONG_KEYS = ("overlong_documents", "dropped_documents", "dropped_tokens", "truncated_documents",
                  "truncated_tokens", "split_documents", "split_pieces")


def bin_token_counts(offsets: np.ndarray, item_len: np.ndarray) -> np.ndarray:
    """Tokens in each bin (int64), by differences of the cumulative item lengths."""
    csum = np.zeros(len(item_len) + 1, np.int64)
    np.cumsum(item_len, out=csum[1:])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def bin_square_sums(offsets: np.ndarray, item_len: np.ndarray) -> np.ndarray:
    """Σlen² of each bin (the attention work --balance-dp balances), int64, by cumulative sums."""
    csum = np.zeros(len(item_len) + 1, np.int64)
    np.cumsum(item_len.astype(np.int64) ** 2, out=csum[1:])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def dp_steps(offsets: np.ndarray, item_len: np.ndarray, balance: dict) -> dict:
    """Σlen² per rank in each step of a ``--balance-dp`` pack as stored (balanced): of the first steps in full
    (``rank_loads[r][s]``), and the max/mean imbalance of every step as a histogram.

    Position ``j·ranks + r`` of a step is rank r's bin of micro-step j (prep/pack/kernels.py), so the bins of a
    step reshape to (micro-steps, ranks); a short last step is padded with empty bins, which weigh nothing.
    The arrangement before balancing is not stored: pack.json keeps its summary (``dp_balance``).
    """
    ranks, per_rank = balance["ranks"], balance["micro_batches_per_rank"]
    work = bin_square_sums(offsets, item_len)
    work = np.concatenate([work, np.zeros(-len(work) % (ranks * per_rank), np.int64)])
    loads = work.reshape(-1, per_rank, ranks).sum(axis=1)  # (steps, ranks)
    mean = loads.mean(axis=1)
    imbalance = np.divide(loads.max(axis=1), mean, out=np.ones(len(mean)), where=mean > 0)
    return {"ranks": ranks, "micro_batches_per_rank": per_rank, "steps": len(loads),
            "rank_loads": loads[:DP_STEPS_SHOWN].T.tolist(),  # per rank: its Σlen² in each of the first steps
            "imbalance_histogram": ratio_histogram(imbalance)}


def category_shares(categories: dict | None) -> dict | None:
    """Each category's share of the packed tokens."""
    if categories is None:
        return None
    total = sum(categories.values())
    return {name: n / total if total else 0.0 for name, n in categories.items()}


def _open_inputs(entry: PackEntry, cache_dir: str | None = None) -> tuple[list[TokenDataset] | None, str | None]:
    """The entry's input datasets, or None and why they cannot be opened (the report goes on without them). One
    packed from a URL whose local copy this machine lacks is read in place (``stream``), never copied whole."""
    try:
        return entry.open_datasets(stream=True, cache_dir=cache_dir), None
    except DatasetChanged as e:
        return None, str(e)
    except XprepError as e:
        return None, f"input dataset unavailable: {e}"


def category_tokens(entry: PackEntry, opened: list[TokenDataset]) -> tuple[dict | None, str | None]:
    """Packed tokens per category name (of the entry's datasets ``opened``): dataset totals minus the categories
    of removed tokens.

    Every overlong policy keeps a prefix of a document (nothing, its head, or all of it), so the
    removed tokens of document d are ``[covered[d], length[d])``.
    """
    firsts = np.cumsum([0, *(len(ds) for ds in opened)])[:-1].tolist()  # (a sharded input is opened as its shards)
    datasets = list(zip(opened, firsts, strict=True))
    n_docs = sum(len(ds) for ds, _ in datasets)
    covered = np.bincount(np.asarray(entry.item_doc), weights=np.asarray(entry.item_len),
                          minlength=n_docs).astype(np.int64)
    totals: dict[str, int] = {}
    for ds, first in datasets:
        _add_dataset_categories(totals, ds, covered[first:first + len(ds)])
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), None


def _add_dataset_categories(totals: dict[str, int], ds, covered: np.ndarray) -> None:
    lengths = ds.lengths.astype(np.int64)
    cut = np.flatnonzero(covered < lengths)
    names = ds.category_names
    removed = np.zeros(len(names), np.int64)
    if len(cut) and ds.category_ids is None:
        removed[0] = int((lengths[cut] - covered[cut]).sum())
    elif len(cut):
        reader = ds.category_ids
        base = reader.pointers[cut] // reader.dtype.itemsize
        removed = _category_counts(ds, base + covered[cut], base + lengths[cut], len(names))
    for cid, (name, counts) in enumerate(_named_counts(ds)):
        if counts:  # categories with no tokens in the dataset stay out; emptied ones show as 0
            key = name if name is not None else str(cid)
            totals[key] = totals.get(key, 0) + counts - int(removed[cid])


def _category_counts(ds, lo: np.ndarray, hi: np.ndarray, size: int) -> np.ndarray:
    """Occurrences of each category id in items ``[lo[k], hi[k])`` of the dataset's category stream: a local one
    through its memory map, one at a URL fetched a bounded chunk at a time (``stream_chunks``), never whole."""
    counts = np.zeros(size, np.int64)
    for (items,), starts, part in stream_chunks(ds, [ds.category_ids], lo, hi):
        counts += range_bincount(items, starts, starts + (hi[part] - lo[part]), size)
    return counts


def _named_counts(ds) -> list[tuple[str | None, int]]:
    per_name = ds.manifest["counts"]["categories"]
    return [(name, per_name.get(name if name is not None else str(cid), {}).get("tokens", 0))
            for cid, name in enumerate(ds.category_names)]


# ----------------------------------------------------------------------------------------- entries
def cache_entries(root: Path) -> list[dict] | None:
    """Every entry of a pack cache (those in manifest.json and those on disk), oldest first, from their
    pack.json alone; ``current`` marks the one ``xtrain run`` trains on, ``validation`` and ``test`` its ``--split``
    held-out entries (manifest.json's ``"validation"``, ``"test"``). ``None`` if ``root`` is no cache."""
    manifest_path = root / MANIFEST
    if (root / PACK_JSON).is_file() or not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        current, listed = manifest.get("current"), manifest.get("entries") or {}
        validation, test = manifest.get("validation"), manifest.get("test")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise XprepError(f"{manifest_path}: corrupt ({e}); re-run `xprep pack`") from None
    names = set(listed) | {p.name for p in root.iterdir() if not p.name.startswith(".")
                           and ((p / PACK_JSON).is_file() or (p / BLEND_JSON).is_file())}
    rows = [_entry_row(root / name, name == current, name == validation, name == test) for name in names]
    return sorted(rows, key=lambda e: (e.get("created") or "", e["name"]))


def _entry_row(path: Path, current: bool, validation: bool = False, test: bool = False) -> dict:
    row = {"name": path.name, "current": current, "validation": validation, "test": test}
    if (path / BLEND_JSON).is_file():
        return {**row, **blend_row(path)}
    try:
        meta = json.loads((path / PACK_JSON).read_text())
        c, s = meta["config"], meta["stats"]
    except FileNotFoundError:
        problem = "no pack.json: damaged, re-run its `xprep pack` with --force" if path.is_dir() else \
            "listed in manifest.json but its directory is gone"
        return {**row, "status": "missing", "problem": problem}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return {**row, "status": "corrupt", "problem": "unreadable pack.json: re-run its `xprep pack` with --force"}
    try:
        flags = pack_flags(c, path)
    except XprepError as e:  # a method registered by the process that packed it, not by this one
        return {**row, "status": "unknown-method", "problem": str(e)}
    options = {k: c.get(k) for k in ("method", "capacity", "overlong", "cp_size", "shuffle", "seed",
                                     "group_size", "balance_dp", "dp_micro_batches")}
    if all(m.fixed_length_samples for m in methods_of(c["method"], str(path))):  # how a chunk sample is trained
        options.update(attention=c.get("attention") or "document", eod_mask_loss=bool(c.get("eod_mask_loss")))
    return {**row, "status": "ok", **options, "options": flags, "bins": s["bins"], "fill": s["fill"],
            "documents_in": s["documents_in"],
            "documents_kept": s["documents_in"] - s["dropped_documents"] - s["empty_documents"]
            - (s.get("no_target") or {}).get("documents", 0),
            "tokens_in": s["tokens_in"], "tokens": s["tokens"], "created": meta.get("created"),
            "part": (meta.get("split") or {}).get("part"),
            "datasets": [d.get("path") for d in meta.get("datasets", [])]}


def pack_flags(c: dict, where: str | Path) -> str:
    """The ``xprep pack`` options that made an entry (``where``): re-running with them makes it current (a hit).
    The option that sizes the bins and the method's own options are its registry entry's (a blend's sources share
    the first's capacity option, and show an option only when every one of them takes it)."""
    methods = methods_of(c["method"], str(where))
    shuffle = f"--shuffle --seed {c['seed']}" if c.get("shuffle") else "--no-shuffle"
    flags = [f"--method {c['method']}", f"{methods[0].capacity_option} {c['capacity']}", f"--overlong {c['overlong']}",
             f"--cp-size {c.get('cp_size', 1)}", shuffle]
    if all("group_size" in m.options for m in methods):
        flags.append(f"--group-size {c['group_size']}")
    if c.get("balance_dp"):
        flags.append(f"--balance-dp {c['balance_dp']} --dp-micro-batches {c['dp_micro_batches']}")
    if c.get("total_tokens") is not None:
        flags.append(f"--total-tokens {c['total_tokens']}")
    if c.get("epochs") is not None:
        flags.append(f"--epochs {c['epochs']:g}")
    if c.get("split"):
        flags.append(f"--split {split_text(c['split'])}")
    if all(m.fixed_length_samples for m in methods):  # packs made before --attention: document
        flags.append(f"--attention {c.get('attention') or 'document'}")
    if c.get("eod_mask_loss"):
        flags.append("--eod-mask-loss")
    return " ".join(flags)


# ------------------------------------------------------------------------------------------ blends
def blend_report(entry: BlendEntry, entries: list[dict] | None, cache_dir: str | None = None) -> dict:
    """The report on a blend: its size and, per source, requested vs delivered share and repeat factor."""
    meta = entry.meta
    tokens, documents = blend_bin_counts(entry)
    return {"kind": "packed", "path": str(entry.path), "key": entry.key, "config": entry.config,
            "capacity": entry.capacity, "created": meta.get("created"), "current": entry.path.name,
            "entries": entries, "blend": blend_summary(meta),
            "padding_tokens": len(tokens) * entry.capacity - int(tokens.sum()),
            "tokens_per_bin": length_stats(tokens), "documents_per_bin": length_stats(documents),
            "fill_histogram": fill_histogram(tokens, entry.capacity),
            "documents_per_bin_histogram": count_histogram(documents),
            "source_reports": [pack_report(source.path, cache_dir) for source in entry.sources]}


def blend_bin_counts(entry: BlendEntry) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and documents of each bin of a blend, in blend order: one gather from its sources' bins."""
    offsets = [np.asarray(s.bin_offsets) for s in entry.sources]
    tokens = np.concatenate([bin_token_counts(o, np.asarray(s.item_len)) for o, s in
                             zip(offsets, entry.sources, strict=True)] or [np.zeros(0, np.int64)])
    documents = np.concatenate([np.diff(o) for o in offsets] or [np.zeros(0, np.int64)])
    first = np.concatenate([[0], np.cumsum([len(o) - 1 for o in offsets])])
    at = first[np.asarray(entry.bin_source, np.int64)] + np.asarray(entry.bin_index, np.int64)
    return tokens[at], documents[at]


def blend_summary(meta: dict) -> dict:
    """What a blend's report and ``xprep pack``'s summary show of it (from blend.json alone)."""
    bins, capacity = meta["stats"]["bins"], int(meta["config"]["capacity"])
    real = meta["stats"].get("real_tokens", 0)
    return {"seed": meta["seed"], "size": meta["size"], "bins": bins, "tokens": meta["stats"]["tokens"],
            "real_tokens": real, "fill": real / (bins * capacity) if bins else 0.0, "capacity": capacity,
            "method": meta["config"]["method"], "blend_seconds": meta.get("blend_seconds"),
            "unit": meta["size"].get("unit", "capacity"),
            "sources": [{k: s.get(k) for k in ("name", "entry", "datasets", "weight", "requested_share",
                                               "delivered_share", "requested_tokens", "delivered_tokens",
                                               "tokens_available", "bins_available", "bins", "epochs", "drawn",
                                               "method", "overlong", "documents", "documents_delivered",
                                               "pieces_delivered", "target_tokens", "real_tokens")}
                        for s in meta["sources"]],
            **({"phases": meta["phases"]} if meta.get("phases") else {}),  # a mix with phases
            "warnings": blend_warnings(meta)}


CUT_WARN_BELOW = 0.5  # a source cut below this share of its bins is said on the console


def blend_warnings(meta: dict) -> list[str]:
    """What a user should hear about a blend: sources it uses only a small part of (their size was set by the
    largest weight's, ``--epochs 1`` by default), each with the options that use more."""
    if meta.get("seed") is None:  # the validation blend holds every held-out bin once
        return []
    out = []
    more = "larger phases in the mix file" if meta.get("phases") else "--total-tokens or --epochs"
    for s in meta["sources"]:
        fraction = s["bins"] / s["bins_available"] if s["bins_available"] else 1.0
        if fraction < CUT_WARN_BELOW:
            out.append(f"source {s['name']!r} is cut to {100 * fraction:.1f} % of its bins ({s['bins']:,} of "
                       f"{s['bins_available']:,}, a seeded random subset): the blend's size is "
                       f"{meta['size']['option']}; {more} to use more")
    return out


def blend_row(path: Path) -> dict:
    """A blend's line in the table of entries."""
    try:
        meta = json.loads((path / BLEND_JSON).read_text())
        summary = blend_summary(meta)
        sources = meta["sources"]
        if meta["seed"] is None:  # the validation blend of a --split mixture
            mix = " ".join(s["name"] for s in sources)
            options = f"blend {mix}: every held-out bin once; each {pack_flags(meta['config'], path)}"
        else:
            mix = " ".join(s["name"] if s["weight"] is None else f"{s['name']}@{s['weight']:g}" for s in sources)
            options = (f"blend {mix} {meta['size']['option']} --seed {meta['seed']}; each "
                       f"{pack_flags(meta['config'], path)}")
        docs = sum(s["documents"] for s in sources)
        kept = sum(s.get("documents_delivered", s["documents_kept"]) for s in sources)  # what the blend delivers
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return {"status": "corrupt", "problem": "unreadable blend.json: re-run its `xprep pack` with --force"}
    except XprepError as e:  # a source packed by a method registered by the process that packed it, not this one
        return {"status": "unknown-method", "problem": str(e)}
    return {"status": "ok", "method": "blend", "capacity": summary["capacity"], "options": options,
            "bins": summary["bins"], "fill": summary["fill"], "documents_in": docs, "documents_kept": kept,
            "tokens": summary["real_tokens"], "created": meta.get("created"),
            "datasets": [p for s in sources for p in s["datasets"]], "sources": [s["entry"] for s in sources]}


def outcome_report(outcome) -> dict:
    """What ``xprep pack`` reports about the entry it built or found (``xprep.prep.inspect.text.summary_lines``)."""
    entry = outcome.entry
    if isinstance(entry, BlendEntry):
        return {"kind": "pack-outcome", "path": str(entry.path), "hit": outcome.hit, "seconds": outcome.seconds,
                "capacity": entry.capacity, "config": entry.config, "blend": blend_summary(entry.meta),
                "sources": [outcome_report(o) for o in outcome.sources or []],
                **{part: _held_out(getattr(outcome, part)) for part in ("validation", "test")}}
    return {"kind": "pack-outcome", "path": str(entry.path), "hit": outcome.hit, "seconds": outcome.seconds,
            "capacity": entry.capacity, "config": entry.config, "packing": packing(entry.config, entry.path),
            "stats": entry.meta["stats"],
            "pack_seconds": entry.meta.get("pack_seconds"),
            **{part: _held_out(getattr(outcome, part)) for part in ("validation", "test")}}


def _held_out(e) -> dict | None:
    """A --split validation or test entry (a blend's: of every source's held-out bins) as the outcome shows it."""
    if e is None:
        return None
    if isinstance(e, BlendEntry):
        return {"path": str(e.path), "bins": e.num_bins, "documents": sum(s["documents"] for s in e.meta["sources"])}
    return {"path": str(e.path), "bins": e.meta["stats"]["bins"], "documents": e.meta["split"]["documents"]}


def split_text(split: list) -> str:
    """--split's shares as given: ``99,1``, ``969,30,1``, ``0.9,0.05,0.05``."""
    return ",".join(str(s) if isinstance(s, int) else f"{s:g}" for s in split)
