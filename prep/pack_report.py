"""What is in a pack cache entry: ``xprep inspect PACKED`` and the summary ``xprep pack`` prints.

Bin-level figures come from the entry's arrays; per-category token counts combine the input
datasets' manifest counts with the category stream over the tokens packing removed (dropped
documents, truncated tails), so only removed tokens are ever read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prep.errors import XprepError
from prep.inspect import length_stats, table
from prep.packfile import MANIFEST, PACK_JSON, PackEntry, open_packed


def pack_report(path: str | Path) -> dict:
    """JSON-able report on the current entry of a pack cache (or an entry directory), with the list
    of every entry in the cache (``None`` for an entry directory)."""
    entries = cache_entries(Path(path))
    entry = open_packed(path)
    stats = entry.meta["stats"]
    offsets = np.asarray(entry.bin_offsets)
    per_bin = bin_token_counts(offsets, np.asarray(entry.item_len))
    tokens, n_bins, capacity = int(per_bin.sum()), entry.num_bins, entry.capacity
    lower = -(-tokens // capacity)
    categories, note = category_tokens(entry)
    return {
        "kind": "packed",
        "path": str(entry.path),
        "key": entry.key,
        "config": entry.config,
        "layout": entry.meta.get("layout"),
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
        "documents_per_bin": length_stats(np.diff(offsets)),
        "tokens_per_bin": length_stats(per_bin),
        "overlong": {k: stats[k] for k in _OVERLONG_KEYS},
        "documents_in": stats["documents_in"],
        "tokens_in": stats["tokens_in"],
        "empty_documents": stats["empty_documents"],
        "categories": categories,
        "categories_note": note,
        "dp_balance": stats.get("dp_balance"),
        "pack_seconds": entry.meta.get("pack_seconds"),
        "created": entry.meta.get("created"),
        "current": entry.path.name,
        "entries": entries,
    }


_OVERLONG_KEYS = ("overlong_documents", "dropped_documents", "dropped_tokens", "truncated_documents",
                  "truncated_tokens", "split_documents", "split_pieces")


def bin_token_counts(offsets: np.ndarray, item_len: np.ndarray) -> np.ndarray:
    """Tokens in each bin (int64), by differences of the cumulative item lengths."""
    csum = np.zeros(len(item_len) + 1, np.int64)
    np.cumsum(item_len, out=csum[1:])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def category_tokens(entry: PackEntry) -> tuple[dict | None, str | None]:
    """Packed tokens per category name: dataset totals minus the categories of removed tokens.

    Every overlong policy keeps a prefix of a document (nothing, its head, or all of it), so the
    removed tokens of document d are ``[covered[d], length[d])``.
    """
    from prep.dataset import TokenDataset

    datasets = []
    for d in entry.meta["datasets"]:
        try:
            ds = TokenDataset(d["path"])
        except XprepError as e:
            return None, f"input dataset unavailable: {e}"
        if ds.fingerprint != d["fingerprint"]:
            return None, f"{d['path']}: changed since packing (fingerprint differs)"
        datasets.append((ds, d["first_document"]))
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
        from prep.packing import range_bincount

        reader = ds.category_ids
        base = reader.pointers[cut] // reader.dtype.itemsize
        removed = range_bincount(reader.items, base + covered[cut], base + lengths[cut], len(names))
    for cid, (name, counts) in enumerate(_named_counts(ds)):
        if counts:  # categories with no tokens in the dataset stay out; emptied ones show as 0
            key = name if name is not None else str(cid)
            totals[key] = totals.get(key, 0) + counts - int(removed[cid])


def _named_counts(ds) -> list[tuple[str | None, int]]:
    per_name = ds.manifest["counts"]["categories"]
    return [(name, per_name.get(name if name is not None else str(cid), {}).get("tokens", 0))
            for cid, name in enumerate(ds.category_names)]


# ----------------------------------------------------------------------------------------- entries
def cache_entries(root: Path) -> list[dict] | None:
    """Every entry of a pack cache (those in manifest.json and those on disk), oldest first, from their
    pack.json alone; ``current`` marks the one ``xtrain run`` trains on. ``None`` if ``root`` is no cache."""
    manifest_path = root / MANIFEST
    if (root / PACK_JSON).is_file() or not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        current, listed = manifest.get("current"), manifest.get("entries") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise XprepError(f"{manifest_path}: corrupt ({e}); re-run `xprep pack`") from None
    names = set(listed) | {p.name for p in root.iterdir() if not p.name.startswith(".") and (p / PACK_JSON).is_file()}
    rows = [_entry_row(root / name, name == current) for name in names]
    return sorted(rows, key=lambda e: (e.get("created") or "", e["name"]))


def _entry_row(path: Path, current: bool) -> dict:
    row = {"name": path.name, "current": current}
    try:
        meta = json.loads((path / PACK_JSON).read_text())
        c, s = meta["config"], meta["stats"]
    except FileNotFoundError:
        problem = "no pack.json: damaged, re-run its `xprep pack` with --force" if path.is_dir() else \
            "listed in manifest.json but its directory is gone"
        return {**row, "status": "missing", "problem": problem}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return {**row, "status": "corrupt", "problem": "unreadable pack.json: re-run its `xprep pack` with --force"}
    options = {k: c.get(k) for k in ("method", "capacity", "overlong", "cp_size", "shuffle", "seed",
                                     "group_size", "balance_dp", "dp_micro_batches")}
    return {**row, "status": "ok", **options, "options": pack_flags(c), "bins": s["bins"], "fill": s["fill"],
            "documents_in": s["documents_in"],
            "documents_kept": s["documents_in"] - s["dropped_documents"] - s["empty_documents"],
            "tokens_in": s["tokens_in"], "tokens": s["tokens"], "created": meta.get("created"),
            "datasets": [d.get("path") for d in meta.get("datasets", [])]}


def pack_flags(c: dict) -> str:
    """The ``xprep pack`` options that made an entry: re-running with them makes it current (a hit)."""
    capacity = "--max-tokens" if c["method"] == "token-aware" else "--seq-len"
    shuffle = f"--shuffle --seed {c['seed']}" if c.get("shuffle") else "--no-shuffle"
    flags = [f"--method {c['method']}", f"{capacity} {c['capacity']}", f"--overlong {c['overlong']}",
             f"--cp-size {c.get('cp_size', 1)}", shuffle]
    if c["method"] == "multipack":
        flags.append(f"--group-size {c['group_size']}")
    if c.get("balance_dp"):
        flags.append(f"--balance-dp {c['balance_dp']} --dp-micro-batches {c['dp_micro_batches']}")
    return " ".join(flags)


def render_entries(r: dict) -> list[str]:
    entries = r.get("entries")
    if not entries:
        return []
    rows = [["*" if e["current"] else "", e["name"], "-", "-", "-", "-", e["problem"]] if e["status"] != "ok" else
            ["*" if e["current"] else "", e["name"], e["bins"], f"{e['fill']:.2%}",
             f"{e['documents_kept']:,}/{e['documents_in']:,}", e["created"] or "-", e["options"]]
            for e in entries]
    head = (f"pack cache {Path(r['path']).parent}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}; "
            "* = current, the one `xtrain run` trains on (re-run an entry's `xprep pack` options to make it current)")
    lines = table(["", "entry", "bins", "fill", "documents kept", "created", "options"], rows, align="llrrrll")
    return [head, *(line.rstrip() for line in lines), ""]


# ------------------------------------------------------------------------------------------ render
def render_pack(r: dict) -> str:
    c = r["config"]
    lines = [*render_entries(r),
        f"pack {r['path']}  (key {r['key'][:16]}, {c['method']}, capacity {r['capacity']:,}"
        + (f", cp {c['cp_size']}" if c.get("cp_size", 1) > 1 else "") + ")",
        f"  layout        {r['layout']}",
        f"  input         {r['documents_in']:,} documents, {r['tokens_in']:,} tokens "
        f"from {len(r['datasets'])} dataset(s)",
        f"  bins          {r['bins']:,}  holding {r['items']:,} documents/pieces, {r['tokens']:,} tokens",
        f"  fill          {r['fill']:.4%}   padding {r['padding_tokens']:,} tokens"
        + (f" (of which CP rounding {r['cp_padding_tokens']:,})" if r["cp_padding_tokens"] else ""),
        f"  lower bound   {r['lower_bound_bins']:,} bins (⌈tokens/capacity⌉), "
        f"gap +{r['gap_to_lower_bound']:.3%}",
        "  " + overlong_line(r["overlong"], r["capacity"], c["overlong"]),
    ]
    if r["empty_documents"]:
        lines.append(f"  empty         {r['empty_documents']:,} documents with no tokens (skipped)")
    if r["dp_balance"]:
        lines.append("  " + dp_line(r["dp_balance"]))
    lines += ["", *_percentile_table(r)]
    lines.append("")
    if r["categories"] is None:
        lines.append(f"categories: {r['categories_note']}")
    else:
        total = sum(r["categories"].values()) or 1
        lines += table(["category", "packed tokens", "share"],
                       [[k, v, f"{v / total:.1%}"] for k, v in r["categories"].items()])
    return "\n".join(lines)


def _percentile_table(r: dict) -> list[str]:
    keys = ("p0", "p10", "p50", "p90", "p99", "p100")
    rows = []
    for label, s in (("documents per bin", r["documents_per_bin"]), ("tokens per bin", r["tokens_per_bin"])):
        if s["count"]:
            rows.append([label, s["mean"], *(s["percentiles"][k] for k in keys)])
    return table(["", "mean", *keys], rows) if rows else []


def overlong_line(s: dict, capacity: int, policy: str) -> str:
    return (f"overlong      {s['overlong_documents']:,} documents > {capacity:,} tokens ({policy}): "
            f"dropped {s['dropped_documents']:,} ({s['dropped_tokens']:,} tokens), "
            f"truncated {s['truncated_documents']:,} ({s['truncated_tokens']:,} tokens cut), "
            f"split {s['split_documents']:,} (into {s['split_pieces']:,} pieces)")


def dp_line(b: dict) -> str:
    def change(name: str) -> str:
        before, after = b[f"{name}_before"], b[f"{name}_after"]
        return f"{before['mean']:.3f} → {after['mean']:.3f} (worst {before['max']:.3f} → {after['max']:.3f})"

    return (f"dp balance    {b['ranks']} ranks × {b['micro_batches_per_rank']} bins per step, {b['steps']:,} "
            f"steps; Σlen² max/mean per step {change('imbalance')}, per micro-step "
            f"{change('micro_step_imbalance')}; {b['empty_bins_added']} empty bins added")


def summary_lines(outcome) -> list[str]:
    """What ``xprep pack`` prints on stdout: hit or build with documents kept vs removed, then the
    figures a user checks first. Warnings go to stderr: see ``warning_lines``."""
    entry = outcome.entry
    s = entry.meta["stats"]
    kept = kept_phrase(s, entry.capacity)
    if outcome.hit:
        head = (f"cache hit: {entry.path} (no packing done, {outcome.seconds:.2f} s): {kept} in {s['bins']:,} bins "
                f"of {entry.capacity:,}")
    else:
        head = (f"packed {kept} into {s['bins']:,} bins of {entry.capacity:,} in {entry.meta['pack_seconds']:.2f} s "
                f"→ {entry.path}")
    lines = [head,
             f"  fill {s['fill']:.4%}, lower bound {s['lower_bound_bins']:,} bins "
             f"(gap +{s['gap_to_lower_bound']:.3%}), padding {s['padding_tokens']:,} tokens",
             "  " + overlong_line(s, entry.capacity, entry.config["overlong"])]
    if s.get("dp_balance"):
        lines.append("  " + dp_line(s["dp_balance"]))
    return lines


def kept_phrase(s: dict, capacity: int) -> str:
    """'412 of 500 documents (54,004 of 78,448 tokens; dropped 88 documents (24,444 tokens) longer than 256)'."""
    n_in, tokens_in, tokens = s["documents_in"], s["tokens_in"], s["tokens"]
    kept = n_in - s["dropped_documents"] - s["empty_documents"]
    docs = f"all {_docs(n_in)}" if kept == n_in and n_in else f"{kept:,} of {_docs(n_in)}"
    toks = f"{tokens:,} tokens" if tokens == tokens_in else f"{tokens:,} of {tokens_in:,} tokens"
    notes = []
    if s["dropped_documents"]:
        notes.append(f"dropped {_docs(s['dropped_documents'])} ({s['dropped_tokens']:,} tokens) "
                     f"longer than {capacity:,}")
    if s["truncated_documents"]:
        notes.append(f"truncated {_docs(s['truncated_documents'])} ({s['truncated_tokens']:,} tokens cut)")
    if s["split_documents"]:
        notes.append(f"split {_docs(s['split_documents'])} longer than {capacity:,} "
                     f"into {s['split_pieces']:,} pieces")
    if s["empty_documents"]:
        notes.append(f"skipped {s['empty_documents']:,} empty")
    return f"{docs} ({'; '.join([toks, *notes])})"


def _docs(n: int) -> str:
    return f"{n:,} document" if n == 1 else f"{n:,} documents"


LOUD_TOKEN_SHARE = 0.01  # removing more than this share of the tokens earns a warning


def warning_lines(entry) -> list[str]:
    """What ``xprep pack`` prints on stderr: an empty pack, or more than 1 % of the tokens removed."""
    s, config = entry.meta["stats"], entry.config
    if s["bins"] == 0:
        return ["warning: the pack has 0 bins (--allow-empty): there is nothing to train on"]
    removed = s["tokens_in"] - s["tokens"]
    if not s["tokens_in"] or removed / s["tokens_in"] <= LOUD_TOKEN_SHARE:
        return []
    option = "--max-tokens" if config["method"] == "token-aware" else "--seq-len"
    if config["overlong"] == "drop":
        how, fix = "dropped as overlong", f"raise {option} or use --overlong split|truncate"
    else:
        how, fix = "cut by --overlong truncate", f"raise {option} or use --overlong split"
    return [f"warning: {100 * removed / s['tokens_in']:.1f} % of tokens ({removed:,} of {s['tokens_in']:,}) "
            f"{how}: {fix}"]
