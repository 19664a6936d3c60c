"""Find input files and stream their records in batches, in a deterministic global order.

Supported: JSON Lines (``.jsonl``/``.json``, optionally ``.gz``/``.zst``), Parquet, Arrow IPC
files/streams, ``datasets.save_to_disk`` directories, and ``.txt`` (one document per file).

Inputs may be fsspec URLs (``s3://bucket/prefix/*.jsonl.zst``): they are listed, globbed and streamed
the same way (prep/dataset/remote.py); local ``.arrow`` files are memory-mapped, remote ones streamed.

Sharding (``--num-shards N --shard-index i``) splits the concatenated input bytes into N
contiguous ranges; a JSON line belongs to the shard holding its first byte, any other file to
the shard holding its first byte. Shards are therefore contiguous runs of the single-run
order, and concatenating their outputs reproduces a single run. ``xprep tokenize --ray`` plans
its own pieces (prep/sources/shards.py) with the same rule.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import zstandard
from xprep.prep.errors import XprepError
from xprep.prep.formats import MANIFEST, OUTPUT_FORMATS, declared_format
from xprep.prep.fs import filesystem, is_url, local_path, mtime_ns, open_binary, url_of

LINE_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = (".gz", ".zst")
TEXT_SUFFIXES = (".txt",)
TABLE_SUFFIXES = (".parquet", ".arrow")
# What reading a damaged or unreadable file raises: reported as an unreadable file, never a traceback.
READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError)
BATCH_BYTES = 4 << 20
BATCH_RECORDS = 1024
CHUNK = 8 << 20
COMPRESSED_CHUNK = 256 << 10
# What a RawBatch holds (its ``kind``): JSON lines or whole text files as bytes, rows (of a table or a JSON array)
# as values.
LINES = "lines"
TEXT_FILE = "text"
ROWS = "rows"


@dataclass(frozen=True)
class SourceFile:
    """One input file and how to read it."""

    path: str
    kind: str  # "lines", "array" (a .json holding one JSON array), "text", "parquet", "arrow"
    size: int
    mtime_ns: int
    compression: str | None = None

    @property
    def splittable(self) -> bool:
        return self.kind == "lines" and self.compression is None

    @property
    def sized(self) -> bool:
        """Whether reading it reads ``size`` bytes (an uncompressed line or text file): progress can count them."""
        return self.kind in ("lines", "text") and self.compression is None

    def describe(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass
class RawBatch:
    """Records of one source, in order: JSON lines (bytes), text files (bytes) or table rows (dicts).

    ``lines[j]`` is the 1-based line (or row / file) number of ``items[j]`` for error messages.
    """

    source: int
    items: list
    lines: list[int]
    kind: str


@dataclass(frozen=True)
class Unreadable:
    """An input file that could not be read, or not to its end (damaged, truncated, not permitted): which, why.

    ``line`` is 0: the error belongs to the file, not to one record. The records read before it
    came in earlier batches: ``records`` of them, the last at line (or row) ``last_line``. ``cut_short``: a
    compressed file that ended early (truncated) or broke after records came out of it, so that records were
    lost beyond the point read: an error of the input under any ``--on-error`` (``prep.tokenize.processor.CutShort``),
    where a file unreadable from its start is one bad input that ``skip`` sets aside whole.
    """

    source: int
    line: int
    reason: str
    records: int = 0
    last_line: int = 0
    cut_short: bool = False


def _kind_of(path: Path | str) -> tuple[str, str | None] | None:
    name = str(path).rstrip("/").rsplit("/", 1)[-1].lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    if compression:
        name = name[: -len(compression)]
    if name.endswith(LINE_SUFFIXES):
        return "lines", compression
    if compression:
        return None
    if name.endswith(TEXT_SUFFIXES):
        return "text", None
    if name.endswith(".parquet"):
        return "parquet", None
    if name.endswith(".arrow"):
        return "arrow", None
    return None


# Text files named like notes about a corpus rather than part of it (by their name before the first dot)
NOTES_LIKE = frozenset({"readme", "read_me", "notes", "note", "license", "licence", "copying", "changelog", "changes",
                        "history", "authors", "contributors", "contributing", "todo", "install", "notice", "manifest"})


@dataclass
class Listing:
    """What a directory input held (or the directories a glob matched): the files read and those left out, counted
    by extension, so that ``xprep tokenize`` can say what it took and what it did not."""

    spec: str
    read: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)  # files of no format read, by extension
    hidden: int = 0  # under a hidden name, or inside an xprep dataset or pack cache: never corpus
    notes_like: list[str] = field(default_factory=list)  # text files read whose name says README, NOTES, LICENSE...

    def add(self, name: str, relative: str, kind: tuple[str, str | None] | None) -> None:
        """Count a file (``relative`` to the directory) as read (``kind``) or skipped (None)."""
        extension = _extension(name)
        if kind is None:
            self.skipped[extension] += 1
            return
        self.read[extension] += 1
        if kind[0] == "text" and name.split(".", 1)[0].lower() in NOTES_LIKE:
            self.notes_like.append(relative)

    def lines(self) -> list[str]:
        """What to say: the files read and skipped by extension, then a warning for notes read as documents."""
        said = f"{self.spec}: reading {_by_extension(self.read, 'file')}"
        if self.skipped:
            said += f"; skipped {_by_extension(self.skipped, 'file')}: not a format read"
        if self.hidden:
            said += f"; left out {self.hidden:,} hidden or inside xprep outputs"
        lines = [said]
        if self.notes_like:
            one = len(self.notes_like) == 1
            names = ", ".join(self.notes_like[:5]) + ("" if len(self.notes_like) <= 5 else
                                                      f" and {len(self.notes_like) - 5:,} more")
            lines.append(f"warning: {self.spec}: {names} look{'s' if one else ''} like notes about the corpus rather "
                         f"than part of it, and {'is read as a document' if one else 'each is read as a document'}; "
                         f"move {'it' if one else 'them'} out, or name the files to read (a glob)")
        return lines


def _extension(name: str) -> str:
    """``.txt``, ``.jsonl.gz``; ``no extension``."""
    name = name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    stem = name[: len(name) - len(compression)]
    dot = stem.rfind(".")
    return (stem[dot:] if dot > 0 else "") + compression or "no extension"


def _by_extension(counts: Counter, noun: str) -> str:
    """``12 files (10 .txt, 2 .jsonl)``: most first."""
    total = sum(counts.values())
    parts = ", ".join(f"{n:,} {ext}" for ext, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total:,} {noun}{'' if total == 1 else 's'} ({parts})"


def resolve_inputs(inputs: list[str], listings: list[Listing] | None = None) -> list[SourceFile]:
    """Expand files, directories and globs into an ordered, de-duplicated list of sources.

    ``listings``, when given, gets a ``Listing`` of each directory input (and of the directories a glob matched)."""
    files: list[SourceFile] = []
    seen: set[str] = set()
    for spec in inputs:
        spec = local_path(spec)
        remote = is_url(spec)
        listing = Listing(spec)
        expanded = _expand_url(spec, listing) if remote else _expand(spec, listing)
        if listings is not None and (listing.read or listing.skipped or listing.hidden):
            listings.append(listing)
        for path in expanded:
            key = path if remote else str(Path(path).resolve())
            if key in seen:
                continue
            seen.add(key)
            files.append(_source(path))
    if not files:
        raise XprepError(f"no input files found in {' '.join(inputs)}")
    return files


def _expand(spec: str, listing: Listing) -> list[Path]:
    path = Path(spec)
    if any(ch in spec for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(spec, recursive=True))
        if not matches:
            raise XprepError(f"{spec}: the pattern matches no file")
        return [p for m in matches for p in (_dir_files(m, listing) if m.is_dir() else [m])]
    if not path.exists():
        raise XprepError(f"{spec}: no such file or directory")
    if path.is_dir():
        found = _dir_files(path, listing)
        if not found:
            held = f" (it holds {_by_extension(listing.skipped, 'file')})" if listing.skipped else ""
            raise XprepError(f"{spec}: directory holds no .jsonl/.json/.parquet/.arrow/.txt file{held}")
        return found
    if _kind_of(path) is None:
        raise XprepError(
            f"{spec}: unsupported file type; expected .jsonl/.json(.gz/.zst), .parquet, .arrow or .txt"
        )
    return [path]


def _expand_url(spec: str, listing: Listing) -> list[str]:
    """Files, directories and globs at a URL, as URLs, in sorted order (as ``_expand`` does locally)."""
    fs, inner = filesystem(spec)
    try:
        if any(ch in inner for ch in "*?["):
            matches = sorted(fs.glob(inner))
            if not matches:
                raise XprepError(f"{spec}: the pattern matches no file")
        elif fs.isdir(inner):
            matches = [inner]
        elif fs.exists(inner):
            if _kind_of(inner) is None:
                raise XprepError(f"{spec}: unsupported file type; expected .jsonl/.json(.gz/.zst), .parquet, "
                                 ".arrow or .txt")
            return [url_of(fs, inner)]
        else:
            raise XprepError(f"{spec}: no such file or directory")
        found = []
        for m in matches:
            if not fs.isdir(m):
                found += [url_of(fs, m)] if _kind_of(m) is not None else []
                continue
            for c in sorted(fs.find(m)):
                parts = [part for part in c[len(m):].split("/") if part]
                if any(part.startswith(".") for part in parts):
                    listing.hidden += 1
                    continue
                listing.add(parts[-1] if parts else c, "/".join(parts), _kind_of(c))
                if _kind_of(c) is not None:
                    found.append(url_of(fs, c))
    except OSError as e:
        raise XprepError(f"{spec}: cannot list it ({e})") from None
    if not found:
        raise XprepError(f"{spec}: holds no .jsonl/.json/.parquet/.arrow/.txt file")
    return found


def _dir_files(directory: Path, listing: Listing) -> list[Path]:
    """The files of a directory input, in order (a ``datasets.save_to_disk`` directory's shards, or every file of a
    format read below it, but hidden ones and xprep outputs), each counted in ``listing``."""
    state = directory / "state.json"
    if state.is_file() and (directory / "dataset_info.json").is_file():
        return _hf_disk_files(directory, state)
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
        raise XprepError(
            f"{directory}: a DatasetDict with splits {splits}; pass one split directory, "
            f"e.g. {directory / (splits[0] if splits else 'train')}"
        )
    outputs = {m.parent for m in directory.rglob(MANIFEST) if _is_xprep_output(m)}
    found = []
    for p in sorted(directory.rglob("*")):
        if not p.is_file():
            continue
        parts = p.relative_to(directory).parts
        if any(part.startswith(".") for part in parts) or any(parent in outputs for parent in p.parents):
            listing.hidden += 1
            continue
        kind = _kind_of(p)
        listing.add(p.name, str(p.relative_to(directory)), kind)
        if kind is not None:
            found.append(p)
    return found


def _is_xprep_output(manifest: Path) -> bool:
    """A dataset or pack cache written by xprep (its manifest and rejects are not corpus)."""
    return declared_format(manifest) in OUTPUT_FORMATS


def _hf_disk_files(directory: Path, state: Path) -> list[Path]:
    """Arrow shards of a ``datasets.Dataset.save_to_disk`` directory, in their stored order."""
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise XprepError(f"{state}: not a datasets state file ({e})") from None
    return [directory / n for n in names]


def _source(path: Path | str) -> SourceFile:
    kind, compression = _kind_of(path) or ("lines", None)
    try:
        if is_url(path):
            fs, inner = filesystem(str(path))
            info = fs.info(inner)
            size, mtime = int(info["size"]), mtime_ns(info)
        else:
            st = Path(path).stat()
            size, mtime = st.st_size, st.st_mtime_ns
    except OSError as e:
        raise XprepError(f"{path}: cannot read ({e.strerror or e})") from None
    source = SourceFile(str(path), kind, size, mtime, compression)
    if kind == "lines" and _first_byte(source) == b"[":
        source = SourceFile(str(path), "array", size, mtime, compression)
    return source


def _first_byte(src: SourceFile) -> bytes:
    """The first non-blank byte: ``[`` marks a JSON array file rather than JSON Lines."""
    try:
        with _open_lines(src) as f:
            while block := f.read(4096):
                stripped = block.lstrip()
                if stripped:
                    return stripped[:1]
    except READ_ERRORS:
        pass  # unreadable: reported when read
    return b""


@dataclass(frozen=True)
class Assignment:
    """What one shard reads of one source: a byte range for plain JSONL, a range of row groups of a
    Parquet file, else the whole file.

    ``first_line`` is the number given to the first line read when ``start`` > 0; None counts the
    newlines before ``start`` (one read of the file's head). ``xprep tokenize --ray`` numbers a piece from
    1 instead and shifts the numbers when it merges, by the lines the pieces before it read.
    """

    source: int
    start: int  # byte where records start (line files), 0 otherwise
    stop: int  # records must start before this byte
    row_groups: tuple[int, int] | None = None  # Parquet: [first, last) row group; rows numbered from first_line
    first_line: int | None = None


def plan_shard(sources: list[SourceFile], num_shards: int, shard_index: int) -> list[Assignment]:
    """The contiguous slice of the global byte order that shard ``shard_index`` reads."""
    total = sum(s.size for s in sources)
    lo = total * shard_index // num_shards
    hi = total * (shard_index + 1) // num_shards
    plan = []
    offset = 0
    for i, src in enumerate(sources):
        begin, end = offset, offset + src.size
        offset = end
        if src.splittable:
            a, b = max(lo, begin) - begin, min(hi, end) - begin
            if a < b:
                plan.append(Assignment(i, a, b))
        elif lo <= begin < hi or (src.size == 0 and begin == hi == total and shard_index == num_shards - 1):
            plan.append(Assignment(i, 0, src.size))
    return plan


def read_batches(sources: list[SourceFile], plan: list[Assignment], limit: int | None = None,
                 lines_read: list[int] | None = None) -> Iterator[RawBatch | Unreadable]:
    """Yield record batches in order; a file that cannot be read (on) yields an ``Unreadable``.

    ``lines_read``, when given, gets one number per assignment read: the lines (blank ones included) of a JSON
    Lines range read to its end, 0 for other kinds and for a file that could not be read to its end.
    """
    remaining = limit
    for a in plan:
        src = sources[a.source]
        records, last_line = 0, 0  # handed on from this assignment
        try:
            reader = _read_source(a, src)
            while True:
                try:
                    batch = next(reader)
                except StopIteration as done:
                    if lines_read is not None:
                        lines_read.append(done.value or 0)
                    break
                if remaining is not None:
                    if remaining <= 0:
                        return
                    if len(batch.items) > remaining:
                        batch.items, batch.lines = batch.items[:remaining], batch.lines[:remaining]
                    remaining -= len(batch.items)
                if batch.lines:
                    records, last_line = records + len(batch.lines), batch.lines[-1]
                yield batch
        except READ_ERRORS as e:
            if lines_read is not None:  # one number per assignment, read to its end or not (what it read is lost)
                lines_read.append(0)
            cut = src.compression is not None and (isinstance(e, EOFError) or records > 0)
            yield Unreadable(a.source, 0, f"unreadable file: {e or type(e).__name__}", records, last_line, cut)


def _read_source(a: Assignment, src: SourceFile) -> Iterator[RawBatch]:
    """The batches of one assignment; returns the number of lines read (JSON Lines) or 0."""
    if src.kind == "lines":
        return (yield from _read_lines(a, src))
    if src.kind == "array":
        yield from _read_array(a.source, src)
    elif src.kind == "text":
        with open_binary(src.path) as f:
            yield RawBatch(a.source, [f.read()], [1], TEXT_FILE)
    else:
        yield from _read_table(a, src)
    return 0


def _open_lines(src: SourceFile):
    if src.compression == ".gz":
        return gzip.open(open_binary(src.path), "rb")
    if src.compression == ".zst":
        return io.BufferedReader(_ZstdReader(src.path), CHUNK)
    return open_binary(src.path)


class _ZstdReader(io.RawIOBase):
    """Decompress a .zst file frame after frame; a file that ends inside a frame raises EOFError
    (zstandard's stream_reader would silently return the truncated data)."""

    def __init__(self, path: str):
        self._raw = open_binary(path)
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            data = self._raw.read(1 << 20)
            if not data:
                if self._started and not self._frame.eof:
                    raise EOFError("truncated .zst file (it ends inside a frame)")
                return 0
            while data:
                if self._frame.eof:  # concatenated frames: start the next one
                    self._frame = zstandard.ZstdDecompressor().decompressobj()
                self._started = True
                self._pending += self._frame.decompress(data)
                data = self._frame.unused_data if self._frame.eof else b""
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _read_lines(a: Assignment, src: SourceFile) -> Iterator[RawBatch]:
    """Stream the JSON lines that start in [a.start, a.stop), in batches of about BATCH_BYTES.

    If the file turns out damaged part-way (a truncated .gz), the complete records read so far
    are yielded before the error propagates.
    """
    items: list[bytes] = []
    lines: list[int] = []
    try:
        with _open_lines(src) as f:
            line_no, pos = (1, 0) if a.start == 0 else _seek_line_start(f, a.start, a.first_line)
            first = line_no
            stop = a.stop if src.splittable else float("inf")  # compressed: sizes are not positions
            size = 0
            # compressed streams are read in smaller steps: a damaged one loses at most one step
            for line in _iter_lines(f, CHUNK if src.compression is None else COMPRESSED_CHUNK):
                if pos >= stop:
                    break
                pos += len(line) + 1
                if line.strip():
                    items.append(line)
                    lines.append(line_no)
                    size += len(line)
                    if size >= BATCH_BYTES or len(items) >= BATCH_RECORDS:
                        yield RawBatch(a.source, items, lines, LINES)
                        items, lines, size = [], [], 0
                line_no += 1
    except READ_ERRORS:
        if items:
            yield RawBatch(a.source, items[:-1], lines[:-1], LINES)  # the last line may be cut short
        raise
    if items:
        yield RawBatch(a.source, items, lines, LINES)
    return line_no - first


def _iter_lines(f, chunk_size: int) -> Iterator[bytes]:
    """Lines of a binary stream without their newline, read in large chunks."""
    carry = b""
    while chunk := f.read(chunk_size):
        parts = (carry + chunk).split(b"\n")
        carry = parts.pop()
        yield from parts
    if carry:
        yield carry


def _read_array(source: int, src: SourceFile) -> Iterator[RawBatch]:
    """Stream the elements of a top-level JSON array (``[{...}, {...}]``) without loading it whole.

    Elements are decoded one at a time from a sliding text window; they are numbered from 1 in
    error messages (reported as the "line").
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    items: list = []
    numbers: list[int] = []
    buf, pos, index, started, done = "", 0, 1, False, False
    with _open_lines(src) as f:
        while not done:
            chunk = f.read(CHUNK)
            buf = buf[pos:] + utf8.decode(chunk, final=not chunk)
            pos = 0
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if not started and pos < len(buf):
                    if buf[pos] != "[":
                        raise ValueError("not a JSON array")
                    started, pos = True, pos + 1
                    continue
                if pos < len(buf) and buf[pos] == "]":
                    done = True
                    break
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if chunk and len(buf) - pos < CHUNK * 4:
                        break  # the element continues in the next chunk
                    if items:
                        yield RawBatch(source, items, numbers, ROWS)
                        items, numbers = [], []
                    raise ValueError(f"malformed JSON array at element {index}: {e.msg}; the elements "
                                     "after it were not read") from None
                items.append(value)
                numbers.append(index)
                index += 1
                pos = end
                if len(items) >= BATCH_RECORDS:
                    yield RawBatch(source, items, numbers, ROWS)
                    items, numbers = [], []
            if not chunk:
                break
    if not done:
        if items:
            yield RawBatch(source, items, numbers, ROWS)
            items = []
        raise ValueError("truncated JSON array (no closing bracket)")
    if items:
        yield RawBatch(source, items, numbers, ROWS)


def _seek_line_start(f, start: int, first_line: int | None = None) -> tuple[int, int]:
    """Position ``f`` at the first line starting at or after byte ``start``.

    Returns (line number, byte position). Counts newlines before it for error messages, unless
    ``first_line`` gives the number (then it seeks straight there).
    """
    newlines = 0
    remaining = start - 1  # the byte before `start` tells whether a line starts at `start`
    if first_line is not None:
        f.seek(remaining)
        newlines, remaining = first_line - 2, 0
    while remaining > 0:
        block = f.read(min(CHUNK, remaining))
        if not block:
            break
        newlines += block.count(b"\n")
        remaining -= len(block)
    prev = f.read(1)
    pos = start
    if prev == b"\n":
        return newlines + 2, pos
    rest = f.readline()  # finish the partial line that belongs to the previous shard
    pos += len(rest)
    return newlines + 2, pos


def _read_table(a: Assignment, src: SourceFile) -> Iterator[RawBatch]:
    # deferred: pyarrow takes ~0.2 s to import and only Parquet/Arrow input needs it
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = a.first_line or 1
    with open_binary(src.path) if is_url(src.path) or src.kind == "parquet" else nullcontext() as f:
        # (a local Arrow file is memory-mapped by path instead)
        if src.kind == "parquet":
            groups = range(*a.row_groups) if a.row_groups else None
            batches = pq.ParquetFile(f).iter_batches(batch_size=1024, row_groups=groups)
        else:
            batches = _arrow_batches(f or src.path, pa)
        for rb in batches:
            rows = rb.to_pylist()
            yield RawBatch(a.source, rows, list(range(row, row + len(rows))), ROWS)
            row += len(rows)


def parquet_row_groups(path: str) -> list[tuple[int, int]]:
    """(rows, bytes) of each row group of a Parquet file, from its footer alone."""
    import pyarrow.parquet as pq  # deferred: as in _read_table

    with open_binary(path) as f:
        meta = pq.ParquetFile(f).metadata
        return [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]


def _arrow_batches(file, pa):
    import pyarrow.ipc as ipc  # deferred: as in _read_table

    with pa.memory_map(file, "r") if isinstance(file, str) else file as mm:
        try:
            reader = ipc.open_file(mm)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        except pa.ArrowInvalid:
            mm.seek(0)
            yield from ipc.open_stream(mm)

