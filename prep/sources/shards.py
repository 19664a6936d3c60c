"""The pieces ``xprep tokenize --ray`` cuts its inputs into, and the key that names each one's result.

A shard is a contiguous run of the single-run read order (so merging the shards' datasets in
shard order reproduces the single run byte for byte):

- a file larger than ``shard_size`` is cut as its reader says (``Reader.pieces``): an uncompressed JSON Lines
  file into equal byte ranges, a line belonging to the range holding its first byte (the same rule as
  ``--num-shards``), each range numbering its lines from 1 (the merge shifts rejects by the lines of the ranges
  before it); a Parquet file into runs of whole row groups;
- every other file is read whole, and consecutive small files share a shard up to ``shard_size``.

The key of a shard covers what its bytes depend on: the input pieces (path, size, mtime, range)
and the head of the manifest (tokenizer and template digests, special tokens, options), so a
rerun of the same command finds the shards it already finished, and a changed input or option
never reuses a stale one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from xprep.prep.errors import XprepError
from xprep.prep.sources.readers import Assignment, SourceFile

KEY_VERSION = 1
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str = "--shard-size") -> int:
    """'256MB', '1.5GiB', '4096' → bytes; anything else is one clear error."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).upper()
    if not m or unit not in SIZE_UNITS:
        raise XprepError(f"{option} {text}: expected a size such as 256MB, 1GB or 64MiB")
    size = int(float(m.group(1)) * SIZE_UNITS[unit])
    if size < 1:
        raise XprepError(f"{option} {text}: must be at least one byte")
    return size


@dataclass(frozen=True)
class Shard:
    """One task's input: pieces of the global read order, in order."""

    index: int
    pieces: tuple[Assignment, ...]

    def key(self, sources: list[SourceFile], head: dict) -> str:
        """The name of this shard's result: a digest of its inputs and of everything that shapes its output."""
        pieces = [{**sources[p.source].describe(), "kind": sources[p.source].kind, "start": p.start,
                   "stop": p.stop, "row_groups": p.row_groups, "first_line": p.first_line} for p in self.pieces]
        blob = json.dumps({"version": KEY_VERSION, "pieces": pieces, "head": head}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def describe(self, sources: list[SourceFile]) -> str:
        """What the shard reads, for messages: ``file [bytes a–b)`` or a list of files."""
        parts = []
        for p in self.pieces:
            path = sources[p.source].path
            if p.row_groups:
                parts.append(f"{path} [row groups {p.row_groups[0]}–{p.row_groups[1] - 1}]")
            elif p.start or p.stop < sources[p.source].size:
                parts.append(f"{path} [bytes {p.start:,}–{p.stop:,})")
            else:
                parts.append(path)
        return ", ".join(parts) if len(parts) <= 3 else f"{', '.join(parts[:2])} … {parts[-1]} ({len(parts)} files)"


def plan_shards(sources: list[SourceFile], shard_size: int) -> list[Shard]:
    """Cut the inputs into shards of about ``shard_size`` bytes, in the single run's order."""
    shards: list[list[Assignment]] = []
    group: list[Assignment] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            shards.append(group)
        group, group_bytes = [], 0

    for i, src in enumerate(sources):
        cut = src.reader.pieces(i, src, shard_size) if src.size > shard_size else None
        if cut is not None:
            flush()
            shards.extend([piece] for piece in cut)
            continue
        group.append(Assignment(i, 0, src.size))
        group_bytes += src.size
        if group_bytes >= shard_size:
            flush()
    flush()
    return [Shard(k, tuple(pieces)) for k, pieces in enumerate(shards)]
