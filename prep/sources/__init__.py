"""Inputs: discover files and URLs, read records of every input format in a deterministic order, and plan the
shards ``xprep tokenize --ray`` cuts them into. Imports nothing of the other stages.

An input format is a reader class registered in ``READERS`` (prep/sources/readers/); a new one subclasses ``Reader``
and is decorated with ``@register``.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.sources.discover import Listing, plan_shard, read_batches, resolve_inputs
from xprep.prep.sources.readers import (
    LINES,
    READERS,
    ROWS,
    TEXT_FILE,
    Assignment,
    RawBatch,
    Reader,
    ReadSizes,
    SourceFile,
    Unreadable,
    register,
)
from xprep.prep.sources.shards import Shard, parse_size, plan_shards

__all__ = [
    "LINES", "Listing", "READERS", "ROWS", "RawBatch", "ReadSizes", "Reader", "Assignment", "Shard", "SourceFile",
    "TEXT_FILE", "Unreadable", "parse_size", "plan_shard", "plan_shards", "read_batches", "register", "resolve_inputs"
]
