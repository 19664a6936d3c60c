"""Arrow IPC (``.arrow``, the file or the stream format; what ``datasets.save_to_disk`` writes): rows handed on as
dicts, one stored record batch at a time. A local file is memory-mapped, one at a URL streamed."""

from __future__ import annotations

from collections.abc import Generator

from xprep.prep.fs import is_url, open_binary
from xprep.prep.sources.readers.base import ROWS, Assignment, RawBatch, Reader, ReadSizes, SourceFile


class ArrowReader(Reader):
    name = "arrow"
    suffixes = (".arrow",)

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        import pyarrow as pa  # deferred: pyarrow takes ~0.2 s to import and only Parquet/Arrow need it

        row = a.first_line or 1
        with open_binary(src.path) if is_url(src.path) else pa.memory_map(src.path, "r") as f:
            for rb in _record_batches(f, pa):
                rows = rb.to_pylist()
                yield RawBatch(a.source, rows, list(range(row, row + len(rows))), ROWS)
                row += len(rows)
        return 0


def _record_batches(f, pa):
    """The record batches of an Arrow IPC file, else of an Arrow IPC stream."""
    import pyarrow.ipc as ipc  # deferred: as in ArrowReader.read

    try:
        reader = ipc.open_file(f)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    except pa.ArrowInvalid:
        f.seek(0)
        yield from ipc.open_stream(f)
