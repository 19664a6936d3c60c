"""What an input format is: a ``Reader`` subclass, registered once in ``READERS``.

A reader says which file names it claims (its suffixes, and the compressions that may follow them), how to tell its
files by content where several readers claim one name (a ``.json`` holding one JSON array rather than JSON lines),
whether shards may cut a file inside (byte ranges, Parquet row groups), how to stream one piece of a file
(``Assignment``) as ``RawBatch``es, locally or from a URL, and what the manifest records of a file. Discovery
(prep/sources/discover.py) and sharding (prep/sources/shards.py) ask the registry; no code outside a reader compares
a format's name. How to add one: a subclass in its own module, decorated with ``@register``.

A batch holds one of three things (``RawBatch.holds``), all that the tokenizer's processor tells apart: JSON lines as
bytes (``LINES``), a whole text file as bytes (``TEXT_FILE``), or decoded records (``ROWS``, dicts). A new format
yields ``ROWS``.
"""

from __future__ import annotations

import zlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import ClassVar

import zstandard
from xprep.prep.errors import XprepError

# What a RawBatch holds (its ``holds``): JSON lines or whole text files as bytes, rows (of a table or a JSON array)
# as values.
LINES, TEXT_FILE, ROWS = "lines", "text", "rows"
# What reading a damaged or unreadable file raises: reported as an unreadable file, never a traceback.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError)


@dataclass(frozen=True)
class ReadSizes:
    """How much a reader takes at a time: a batch ends at ``batch_bytes`` of JSON lines or ``batch_records`` records;
    files are read ``chunk`` bytes at a time (``compressed_chunk`` for a compressed one: a damaged stream loses at
    most one step). Tests pass tiny ones to make every boundary show."""

    batch_bytes: int = 4 << 20
    batch_records: int = 1024
    chunk: int = 8 << 20
    compressed_chunk: int = 256 << 10


@dataclass(frozen=True)
class SourceFile:
    """One input file and the reader of its format."""

    path: str
    reader: type[Reader]
    size: int
    mtime_ns: int
    compression: str | None = None  # ".gz", ".zst": its name ends so, after the reader's suffix

    @property
    def kind(self) -> str:
        """The format's name (``Reader.name``), as shard keys record it."""
        return self.reader.name

    @property
    def splittable(self) -> bool:
        """Whether shards may cut it into byte ranges (``Reader.byte_ranges``)."""
        return self.reader.byte_ranges(self)

    @property
    def sized(self) -> bool:
        """Whether reading it reads ``size`` bytes (an uncompressed line or text file): progress can count them."""
        return self.reader.sized(self)

    def describe(self) -> dict:
        """What the manifest records of it."""
        return self.reader.describe(self)


@dataclass(frozen=True)
class Assignment:
    """Bytes [start, stop) of one source that a shard reads (whole file for unsplittable ones).

    ``row_groups`` (a Parquet file cut by row groups, ``tokenize --ray``) reads only groups [a, b).
    ``first_line`` numbers the piece's records from it (1 for a byte range read alone) instead of
    counting the file's lines before ``start``; for row groups it is the first row's number.
    """

    source: int
    start: int
    stop: int
    row_groups: tuple[int, int] | None = None
    first_line: int | None = None


@dataclass
class RawBatch:
    """Records of one source, in order: JSON lines (bytes), text files (bytes) or table rows (dicts), as ``holds``
    says (``LINES``, ``TEXT_FILE``, ``ROWS``).

    ``lines[j]`` is the 1-based line (or row / file) number of ``items[j]`` for error messages.
    """

    source: int
    items: list
    lines: list[int]
    holds: str


@dataclass(frozen=True)
class Unreadable:
    """An input file that could not be read, or not to its end (damaged, truncated, not permitted): which, why.

    ``line`` is 0: the error belongs to the file, not to one record. The records read before it
    came in earlier batches: ``records`` of them, the last at line (or row) ``last_line``. ``cut_short``: a
    compressed file that ended early (truncated) or broke after records came out of it, so that records were
    lost beyond the point read: an error of the input under any ``--on-error`` (``prep.tokenize.write.CutShort``),
    where a file unreadable from its start is one bad input that ``skip`` sets aside whole.
    """

    source: int
    line: int
    reason: str
    records: int = 0
    last_line: int = 0
    cut_short: bool = False


class Reader:
    """One input format. Subclasses set ``name`` and ``suffixes`` and implement ``read``; the rest has defaults.

    Readers are classes used as they are (never instantiated): a ``SourceFile`` names its reader class, which pickles
    by reference, so worker processes and Ray tasks import the module that defines it.
    """

    name: ClassVar[str]  # recorded in tokenize --ray's shard keys: a built-in one is never renamed
    suffixes: ClassVar[tuple[str, ...]] = ()  # lower-case name endings claimed: (".jsonl", ".ndjson")
    compressions: ClassVar[tuple[str, ...]] = ()  # what may follow them (a key of readers.compressed.DECOMPRESSORS)
    whole_file_documents: ClassVar[bool] = False  # each file is one document: a README among them would be one too
    errors: ClassVar[tuple[type[BaseException], ...]] = READ_ERRORS  # reported as an unreadable file

    @classmethod
    def claims(cls, stem: str, compression: str | None) -> bool:
        """Whether a file named ``stem`` (lower case, ``compression`` removed) is of this format by its name."""
        return stem.endswith(cls.suffixes) and (compression is None or compression in cls.compressions)

    @classmethod
    def recognises(cls, src: SourceFile) -> bool:
        """Whether the content of a file this reader claims by name is of its format: asked only where several
        readers claim the name (the one registered last that says yes reads it). A file that cannot be read says
        no (reported when it is read)."""
        return True

    @classmethod
    def byte_ranges(cls, src: SourceFile) -> bool:
        """Whether shards (``--num-shards``, ``tokenize --ray``) may cut ``src`` into byte ranges; ``read`` then reads
        the records that start in its assignment's range."""
        return False

    @classmethod
    def sized(cls, src: SourceFile) -> bool:
        """Whether reading ``src`` reads ``src.size`` bytes, so that progress can count them."""
        return False

    @classmethod
    def pieces(cls, index: int, src: SourceFile, shard_size: int) -> list[Assignment] | None:
        """How ``tokenize --ray`` cuts a file larger than ``shard_size`` (``index``: its place among the sources), in
        read order; None: it is read whole by one task."""
        return None

    @classmethod
    def describe(cls, src: SourceFile) -> dict:
        """What the manifest records of ``src`` (and what shard keys digest)."""
        return {"path": src.path, "size": src.size, "mtime_ns": src.mtime_ns}

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        """The batches of assignment ``a`` of ``src``, in order; returns the lines it read (blank ones included) where
        a byte-range read needs them to number the next range's records, else 0. Raises one of ``errors`` for a
        damaged file, after yielding the complete records before the damage."""
        raise NotImplementedError


READERS: dict[str, type[Reader]] = {}  # by name, in registration order


def register(reader: type[Reader]) -> type[Reader]:
    """Add an input format (a class decorator): every command that reads inputs then reads its files."""
    name = getattr(reader, "name", None)
    if not isinstance(name, str) or not name or not reader.suffixes:
        raise TypeError(f"{reader.__name__}: a reader needs a name and at least one suffix")
    if READERS.get(name, reader) is not reader:
        raise ValueError(f"{reader.__name__}: input format {name!r} is {READERS[name].__name__}'s already")
    READERS[name] = reader
    return reader


def reader_named(name: str) -> type[Reader]:
    """The registered reader of format ``name``; an unknown one is an error naming those known."""
    if name not in READERS:
        raise XprepError(f"unknown input format {name!r}; known: {', '.join(READERS)}")
    return READERS[name]


def split_compression(name: str) -> tuple[str, str | None]:
    """(lower-case name without its compression suffix, the suffix or None), for the compressions readers accept."""
    name = name.lower()
    compression = next((c for r in READERS.values() for c in r.compressions if name.endswith(c)), None)
    return (name[: -len(compression)] if compression else name), compression


def claimants(name: str) -> tuple[list[type[Reader]], str | None]:
    """The readers that claim a file name (the last registered first), and its compression suffix."""
    stem, compression = split_compression(name.rstrip("/").rsplit("/", 1)[-1])
    return [r for r in reversed(READERS.values()) if r.claims(stem, compression)], compression


def expected_names() -> str:
    """The names read, for messages: ``.jsonl/.json/.ndjson(.gz/.zst), .txt, .parquet or .arrow``."""
    seen: set[str] = set()
    names = []
    for r in READERS.values():
        new = [s for s in r.suffixes if s not in seen]
        seen.update(new)
        if new:
            names.append("/".join(new) + (f"({'/'.join(r.compressions)})" if r.compressions else ""))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
