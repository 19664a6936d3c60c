"""A ``.json`` file (optionally ``.gz``/``.zst``) holding one top-level JSON array of records, told from JSON Lines by
its first non-blank byte, ``[``. Streamed element by element, never loaded whole, and never cut by shards (an
element's place in the file is only known by reading up to it)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Generator

from xprep.prep.sources.readers.base import ROWS, Assignment, RawBatch, Reader, ReadSizes, SourceFile
from xprep.prep.sources.readers.compressed import DECOMPRESSORS, open_stream


class JsonArrayReader(Reader):
    name = "array"
    suffixes = (".json",)
    compressions = tuple(DECOMPRESSORS)

    @classmethod
    def recognises(cls, src: SourceFile) -> bool:
        return _first_byte(src, cls.errors) == b"["

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        """The elements of the array, numbered from 1 in error messages (reported as the "line").

        Elements are decoded one at a time from a sliding text window of ``sizes.chunk`` bytes read at a time.
        """
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")()
        items: list = []
        numbers: list[int] = []
        buf, pos, index, started, done = "", 0, 1, False, False
        with open_stream(src) as f:
            while not done:
                chunk = f.read(sizes.chunk)
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
                        if chunk and len(buf) - pos < sizes.chunk * 4:
                            break  # the element continues in the next chunk
                        if items:
                            yield RawBatch(a.source, items, numbers, ROWS)
                            items, numbers = [], []
                        raise ValueError(f"malformed JSON array at element {index}: {e.msg}; the elements "
                                         "after it were not read") from None
                    items.append(value)
                    numbers.append(index)
                    index += 1
                    pos = end
                    if len(items) >= sizes.batch_records:
                        yield RawBatch(a.source, items, numbers, ROWS)
                        items, numbers = [], []
                if not chunk:
                    break
        if not done:
            if items:
                yield RawBatch(a.source, items, numbers, ROWS)
                items = []
            raise ValueError("truncated JSON array (no closing bracket)")
        if items:
            yield RawBatch(a.source, items, numbers, ROWS)
        return 0


def _first_byte(src: SourceFile, errors: tuple[type[BaseException], ...]) -> bytes:
    """The first non-blank byte of the (decompressed) file; b"" where it has none or cannot be read."""
    try:
        with open_stream(src) as f:
            while block := f.read(4096):
                stripped = block.lstrip()
                if stripped:
                    return stripped[:1]
    except errors:
        pass  # unreadable: reported when read
    return b""
