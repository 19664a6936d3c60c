"""JSON Lines (``.jsonl``, ``.json``, ``.ndjson``, optionally ``.gz``/``.zst``): one record per line, the lines handed
on as bytes (the tokenizer parses them, column-wise where it can).

The one format shards cut inside: an uncompressed file is split into byte ranges, and a line belongs to the range
holding its first byte (``--num-shards`` and ``tokenize --ray`` alike), so shards are contiguous runs of the single
run's order.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

from xprep.prep.sources.readers.base import LINES, Assignment, RawBatch, Reader, ReadSizes, SourceFile
from xprep.prep.sources.readers.compressed import DECOMPRESSORS, open_stream


class JsonLinesReader(Reader):
    name = "lines"
    suffixes = (".jsonl", ".json", ".ndjson")
    compressions = tuple(DECOMPRESSORS)

    @classmethod
    def byte_ranges(cls, src: SourceFile) -> bool:
        return src.compression is None  # compressed: sizes are not positions

    @classmethod
    def sized(cls, src: SourceFile) -> bool:
        return src.compression is None

    @classmethod
    def pieces(cls, index: int, src: SourceFile, shard_size: int) -> list[Assignment] | None:
        """Equal byte ranges, each at most ``shard_size`` long, numbered from line 1."""
        if not cls.byte_ranges(src):
            return None
        n = -(-src.size // shard_size)
        bounds = [src.size * k // n for k in range(n + 1)]
        return [Assignment(index, a, b, first_line=1 if a else None)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        """Stream the JSON lines that start in [a.start, a.stop), in batches of about ``sizes.batch_bytes``.

        If the file turns out damaged part-way (a truncated .gz), the complete records read so far
        are yielded before the error propagates.
        """
        items: list[bytes] = []
        lines: list[int] = []
        try:
            with open_stream(src) as f:
                line_no, pos = (1, 0) if a.start == 0 else _seek_line_start(f, a.start, sizes.chunk, a.first_line)
                first = line_no
                stop = a.stop if cls.byte_ranges(src) else float("inf")
                size = 0
                # compressed streams are read in smaller steps: a damaged one loses at most one step
                for line in _iter_lines(f, sizes.chunk if src.compression is None else sizes.compressed_chunk):
                    if pos >= stop:
                        break
                    pos += len(line) + 1
                    if line.strip():
                        items.append(line)
                        lines.append(line_no)
                        size += len(line)
                        if size >= sizes.batch_bytes or len(items) >= sizes.batch_records:
                            yield RawBatch(a.source, items, lines, LINES)
                            items, lines, size = [], [], 0
                    line_no += 1
        except cls.errors:
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


def _seek_line_start(f, start: int, chunk: int, first_line: int | None = None) -> tuple[int, int]:
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
        block = f.read(min(chunk, remaining))
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
