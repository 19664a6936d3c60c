"""Find input files and stream their records in batches, in a deterministic global order.

Every format is a reader of the registry (prep/sources/readers/): JSON Lines (``.jsonl``/``.json``, optionally
``.gz``/``.zst``), JSON arrays, Parquet, Arrow IPC files/streams, ``datasets.save_to_disk`` directories, and ``.txt``
(one document per file). This module finds the files, names each one's reader, and reads them in order.

Inputs may be fsspec URLs (``s3://bucket/prefix/*.jsonl.zst``): they are listed, globbed and streamed
the same way (prep/dataset/remote.py); local ``.arrow`` files are memory-mapped, remote ones streamed.

Sharding (``--num-shards N --shard-index i``) splits the concatenated input bytes into N
contiguous ranges; a JSON line belongs to the shard holding its first byte, any other file to
the shard holding its first byte. Shards are therefore contiguous runs of the single-run
order, and concatenating their outputs reproduces a single run. ``xprep tokenize --ray`` plans
its own pieces (prep/sources/shards.py) with the same rule.
"""

from __future__ import annotations

import glob
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.formats import MANIFEST, OUTPUT_FORMATS, declared_format
from xprep.prep.fs import filesystem, is_url, local_path, mtime_ns, url_of
from xprep.prep.sources.readers import (
    ArrowReader,
    Assignment,
    RawBatch,
    Reader,
    ReadSizes,
    SourceFile,
    Unreadable,
    claimants,
    expected_names,
    split_compression,
)


def _reader_by_name(path: Path | str) -> type[Reader] | None:
    """The reader that claims a file by its name (the first one asked, see ``_source``), or None: not read."""
    readers, _ = claimants(str(path))
    return readers[0] if readers else None


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

    def add(self, name: str, relative: str, reader: type[Reader] | None) -> None:
        """Count a file (``relative`` to the directory) as read (by ``reader``) or skipped (None)."""
        extension = _extension(name)
        if reader is None:
            self.skipped[extension] += 1
            return
        self.read[extension] += 1
        if reader.whole_file_documents and name.split(".", 1)[0].lower() in NOTES_LIKE:
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
    stem, compression = split_compression(name)
    dot = stem.rfind(".")
    return (stem[dot:] if dot > 0 else "") + (compression or "") or "no extension"


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
            raise XprepError(f"{spec}: directory holds no {expected_names()} file{held}")
        return found
    if _reader_by_name(path) is None:
        raise XprepError(f"{spec}: unsupported file type; expected {expected_names()}")
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
            if _reader_by_name(inner) is None:
                raise XprepError(f"{spec}: unsupported file type; expected {expected_names()}")
            return [url_of(fs, inner)]
        else:
            raise XprepError(f"{spec}: no such file or directory")
        found = []
        for m in matches:
            if not fs.isdir(m):
                found += [url_of(fs, m)] if _reader_by_name(m) is not None else []
                continue
            for c in sorted(fs.find(m)):
                parts = [part for part in c[len(m):].split("/") if part]
                if any(part.startswith(".") for part in parts):
                    listing.hidden += 1
                    continue
                reader = _reader_by_name(c)
                listing.add(parts[-1] if parts else c, "/".join(parts), reader)
                if reader is not None:
                    found.append(url_of(fs, c))
    except OSError as e:
        raise XprepError(f"{spec}: cannot list it ({e})") from None
    if not found:
        raise XprepError(f"{spec}: holds no {expected_names()} file")
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
        reader = _reader_by_name(p)
        listing.add(p.name, str(p.relative_to(directory)), reader)
        if reader is not None:
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
    """The file and its reader: of the readers that claim its name, the first that recognises its content (an Arrow
    shard of a ``save_to_disk`` directory whatever its name)."""
    readers, compression = claimants(str(path))
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
    candidates = [SourceFile(str(path), reader, size, mtime, compression) for reader in readers or [ArrowReader]]
    return next((src for src in candidates[:-1] if src.reader.recognises(src)), candidates[-1])


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
                 lines_read: list[int] | None = None, sizes: ReadSizes = ReadSizes()
                 ) -> Iterator[RawBatch | Unreadable]:
    """Yield record batches in order; a file that cannot be read (on) yields an ``Unreadable``.

    ``lines_read``, when given, gets one number per assignment read: the lines (blank ones included) of a JSON
    Lines range read to its end, 0 for other kinds and for a file that could not be read to its end. ``sizes``:
    how much each reader takes at a time.
    """
    remaining = limit
    for a in plan:
        src = sources[a.source]
        records, last_line = 0, 0  # handed on from this assignment
        try:
            reader = src.reader.read(a, src, sizes)
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
        except src.reader.errors as e:
            if lines_read is not None:  # one number per assignment, read to its end or not (what it read is lost)
                lines_read.append(0)
            cut = src.compression is not None and (isinstance(e, EOFError) or records > 0)
            yield Unreadable(a.source, 0, f"unreadable file: {e or type(e).__name__}", records, last_line, cut)
