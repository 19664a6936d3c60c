"""Opening an input file as one stream of its bytes, decompressed by its name (``.gz``, ``.zst``), local or at a URL.

A truncated compressed file raises ``EOFError`` where its data ends (gzip does; zstandard's own stream reader would
return the truncated data silently, hence ``_ZstdReader``): the readers then report the file as cut short.
"""

from __future__ import annotations

import gzip
import io

import zstandard
from xprep.prep.fs import open_binary
from xprep.prep.sources.readers.base import SourceFile

STREAM_BUFFER = 8 << 20  # bytes a .zst stream buffers for the reads of its reader


def _open_gzip(path: str):
    return gzip.open(open_binary(path), "rb")


def _open_zstd(path: str):
    return io.BufferedReader(_ZstdReader(path), STREAM_BUFFER)


DECOMPRESSORS = {".gz": _open_gzip, ".zst": _open_zstd}  # compression suffix → opener of the decompressed bytes


def open_stream(src: SourceFile):
    """A binary file of ``src``'s bytes, decompressed where its name says so."""
    if src.compression is None:
        return open_binary(src.path)
    return DECOMPRESSORS[src.compression](src.path)


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
