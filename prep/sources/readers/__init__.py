"""Input formats, one reader class each, registered in ``READERS`` (base.py; to add one: a ``Reader`` subclass in its
own module, decorated with ``@register``). Importing this package registers the built-in ones, in the order below:
where several claim a name, the one registered last that recognises the content reads the file (a ``.json`` holding
an array is JSON Lines' by its name, then the array reader's by its first byte)."""

from xprep.prep.sources.readers.arrow import ArrowReader
from xprep.prep.sources.readers.base import (
    LINES,
    READ_ERRORS,
    READERS,
    ROWS,
    TEXT_FILE,
    Assignment,
    RawBatch,
    Reader,
    ReadSizes,
    SourceFile,
    Unreadable,
    claimants,
    expected_names,
    reader_named,
    register,
    split_compression,
)
from xprep.prep.sources.readers.compressed import DECOMPRESSORS, open_stream
from xprep.prep.sources.readers.json_array import JsonArrayReader
from xprep.prep.sources.readers.jsonl import JsonLinesReader
from xprep.prep.sources.readers.parquet import ParquetReader
from xprep.prep.sources.readers.text import TextFileReader

for _builtin in (JsonLinesReader, JsonArrayReader, TextFileReader, ParquetReader, ArrowReader):
    register(_builtin)

__all__ = [
    "DECOMPRESSORS", "LINES", "READERS", "READ_ERRORS", "ROWS", "TEXT_FILE", "ArrowReader", "Assignment",
    "JsonArrayReader", "JsonLinesReader", "ParquetReader", "RawBatch", "ReadSizes", "Reader", "SourceFile",
    "TextFileReader", "Unreadable", "claimants", "expected_names", "open_stream", "reader_named", "register",
    "split_compression",
]
