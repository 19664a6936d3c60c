"""``xprep merge``: concatenate token datasets (e.g. shards) into one.

Streams are copied in large slices through ``DatasetWriter``, which rebases the pointers and
recomputes digests and counts, so merging the shards of a run reproduces the single run byte
for byte (categories are remapped to the merged table, which assigns ids in order of first use
exactly as a single run does).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from xprep.prep.dataset.manifest import (
    CategoryTable,
    conversation_counts,
    dataset_tokenizer,
    numeric_category_names,
)
from xprep.prep.dataset.sharded import SAME, joined_sources, open_parts, shard_categories
from xprep.prep.dataset.token_dataset import DatasetWriter, TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.formats import REJECTS, TOKENS_STREAM
from xprep.prep.io import check_output_dir

SLICE_TOKENS = 16 << 20


def merge_datasets(paths: list[str], output: str) -> dict:
    """Merge ``paths`` in order into ``output``; returns the merged manifest. A sharded dataset among them is its
    shards, in order (so merging a sharded dataset alone makes its merged copy)."""
    check_output_dir(output)
    datasets = [ds for p in paths for ds in open_parts(p)]
    _check_shards(datasets)
    first = datasets[0].manifest
    for ds in datasets[1:]:
        for key in SAME:
            if ds.manifest.get(key) != first.get(key):
                raise XprepError(
                    f"{ds.path}: its {key} differs from {datasets[0].path}'s{_difference(key, ds.manifest, first)}; "
                    "only datasets made with the same tokenizer, template and options can be merged"
                )
    categories = CategoryTable(numeric_names=numeric_category_names(first))
    dtype = np.dtype(first["streams"][TOKENS_STREAM]["dtype"])
    # a tokenizer kept inside the datasets (one path for all: checked above) is kept inside the merged one
    kept = dataset_tokenizer(datasets[0].path, first) if not Path(first["tokenizer"]["path"]).is_absolute() else None
    with DatasetWriter(output, first["tokenizer"]["vocab_size"], dtype, tokenizer=kept) as writer:
        for ds in datasets:
            append_dataset(ds, writer, categories)
        manifest = {k: first[k] for k in SAME if k in first}
        manifest["sources"] = joined_sources([ds.manifest for ds in datasets])
        return writer.finish(manifest, categories)


def _difference(key: str, a: dict, b: dict) -> str:
    """Where manifests ``a`` and ``b`` differ at ``key``, told for options: the first option that differs, with
    both values (an option a manifest leaves out is its default); nothing for the other keys."""
    if key != "options":
        return ""
    mine, theirs = a.get(key) or {}, b.get(key) or {}
    name = next(n for n in sorted({*mine, *theirs}) if mine.get(n) != theirs.get(n))
    return f" (at {name}: {_shown(name, mine)} here, {_shown(name, theirs)} there)"


def _shown(name: str, options: dict) -> str:
    return json.dumps(options[name], ensure_ascii=False) if name in options else "absent (the default)"


def _check_shards(datasets: list[TokenDataset]) -> None:
    """Shards of one run must all be there, once each, in index order; refuse anything else."""
    shards = [ds.manifest.get("shard") for ds in datasets]
    if not any(shards):
        return
    count = next(s["count"] for s in shards if s)
    got = [s["index"] if s else None for s in shards]
    if any(s is None or s["count"] != count for s in shards) or got != list(range(count)):
        raise XprepError(
            f"shards given in index order {got} (of --num-shards {count}): pass every shard of the run "
            f"exactly once, in order 0..{count - 1}"
        )


def append_dataset(ds: TokenDataset, writer: DatasetWriter, categories: CategoryTable,
                   line_shift: dict[str, int] | None = None) -> None:
    """Append every document and reject of ``ds`` to ``writer``, its categories remapped into ``categories``.

    ``line_shift`` adds, per source path, a number of lines to its rejects' line numbers (a Ray shard
    numbers the lines of a cut file from its own start; see prep/sources/shards.py).
    """
    _copy(ds, writer, shard_categories(ds.manifest, categories))
    _copy_rejects(ds, writer, line_shift or {})
    writer.add_conversations(conversation_counts(ds.manifest))


def _copy(ds: TokenDataset, writer: DatasetWriter, lut: np.ndarray) -> None:
    """Append all documents of ``ds`` in slices of about SLICE_TOKENS tokens."""
    offsets = ds.tokens.offsets()
    n = len(ds)
    doc = 0
    while doc < n:
        stop = int(np.searchsorted(offsets, offsets[doc] + SLICE_TOKENS, side="right")) - 1
        stop = min(max(stop, doc + 1), n)
        lo, hi = int(offsets[doc]), int(offsets[stop])
        lengths = ds.lengths[doc:stop]
        mask = ds.loss_mask.items[lo:hi] if ds.loss_mask is not None else None
        cats = lut[ds.category_ids.items[lo:hi]] if ds.category_ids is not None else None
        writer.append(ds.tokens.items[lo:hi], lengths, mask, cats)
        doc = stop


def _copy_rejects(ds: TokenDataset, writer: DatasetWriter, line_shift: dict[str, int]) -> None:
    path = Path(ds.path) / REJECTS
    if not path.is_file():
        return
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            number = r["line"] + line_shift.get(r["source"], 0) if r["line"] else r["line"]  # 0: the whole file
            writer.reject(r["source"], number, r["reason"], r.get("record"), r.get("kind"))
