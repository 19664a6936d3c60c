"""Inputs: discover files and URLs, read records of every input kind in a deterministic order, and plan the
shards ``xprep tokenize --ray`` cuts them into. Imports nothing of the other stages.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.sources.discover import (
    LINES,
    ROWS,
    TEXT_FILE,
    Listing,
    RawBatch,
    Unreadable,
    plan_shard,
    read_batches,
    resolve_inputs,
)
from xprep.prep.sources.shards import Shard, parse_size, plan_shards

__all__ = [
    "LINES", "Listing", "ROWS", "RawBatch", "Shard", "TEXT_FILE", "Unreadable", "parse_size", "plan_shard",
    "plan_shards", "read_batches", "resolve_inputs"
]
