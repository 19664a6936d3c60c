"""Plain text (``.txt``): each file is one document, handed on as its bytes (decoded by the tokenizer)."""

from __future__ import annotations

from collections.abc import Generator

from xprep.prep.fs import open_binary
from xprep.prep.sources.readers.base import TEXT_FILE, Assignment, RawBatch, Reader, ReadSizes, SourceFile


class TextFileReader(Reader):
    name = "text"
    suffixes = (".txt",)
    whole_file_documents = True

    @classmethod
    def sized(cls, src: SourceFile) -> bool:
        return True

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        with open_binary(src.path) as f:
            yield RawBatch(a.source, [f.read()], [1], TEXT_FILE)
        return 0
