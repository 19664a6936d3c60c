"""The names xprep writes and reads, defined once: record formats, format tags, streams and file names.

Changing one of these changes what is on disk (and most of them the datasets' fingerprints): the
schemas in ``schemas/`` spell the same names.
"""

from __future__ import annotations

import json
from pathlib import Path

# Record formats (``xprep tokenize --format``): "auto" detects text, chat or tokens per record.
AUTO = "auto"
TEXT = "text"
CHAT = "chat"
TOKENS = "tokens"
RECORD_FORMATS = (AUTO, TEXT, CHAT, TOKENS)

# What a pre-tokenized record's ``loss_mask[t] = 1`` means (``xprep tokenize --mask-convention``; the reading rule is
# xprep.prep.tokenize.records.prediction_to_target): TARGET, token t is learned (this project's streams); PREDICTION,
# the prediction made at position t, of token t + 1, is learned (VERL's fsdp_sft_trainer up to 0.5).
TARGET = "target"
PREDICTION = "prediction"
MASK_CONVENTIONS = (TARGET, PREDICTION)

# The ``format`` field of what xprep writes.
DATASET_FORMAT = "xprep-dataset"  # a token dataset's manifest.json
SHARDED_FORMAT = "xprep-sharded-dataset"  # the manifest.json of a token dataset made of shard datasets
PACK_FORMAT = "xprep-packed"  # a pack cache's manifest.json and each entry's pack.json
OUTPUT_FORMATS = (DATASET_FORMAT, SHARDED_FORMAT, PACK_FORMAT)

# Streams of a token dataset: ``<stream>.bin/.idx`` pairs, keys of the manifest's ``streams``.
TOKENS_STREAM = "tokens"
LOSS_MASK_STREAM = "loss_mask"
CATEGORY_IDS_STREAM = "category_ids"

# File names.
MANIFEST = "manifest.json"  # of a token dataset and of a pack cache
REJECTS = "rejects.jsonl"  # records set aside by ``--on-error skip`` (and never-trainable ones)
PACK_JSON = "pack.json"  # of one pack cache entry; written last, it marks the entry complete
BLEND_JSON = "blend.json"  # of one blend entry (a weighted mixture of pack entries); written last, likewise


def declared_format(manifest: str | Path) -> str | None:
    """The ``format`` a manifest.json declares; None when it has none or cannot be read (callers report that)."""
    try:
        data = json.loads(Path(manifest).read_bytes())
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    fmt = data.get("format") if isinstance(data, dict) else None
    return fmt if isinstance(fmt, str) else None
