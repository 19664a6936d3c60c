"""Parquet (``.parquet``): rows handed on as dicts, read a batch of rows at a time from a file or a URL. ``tokenize
--ray`` cuts a large file into runs of whole row groups, found from its footer alone."""

from __future__ import annotations

from collections.abc import Generator

from xprep.prep.fs import open_binary
from xprep.prep.sources.readers.base import ROWS, Assignment, RawBatch, Reader, ReadSizes, SourceFile


class ParquetReader(Reader):
    name = "parquet"
    suffixes = (".parquet",)

    @classmethod
    def pieces(cls, index: int, src: SourceFile, shard_size: int) -> list[Assignment] | None:
        """Runs of whole row groups of about ``shard_size`` bytes (uncompressed sizes, scaled to the file's)."""
        groups = row_groups(src.path)
        total = sum(b for _, b in groups) or 1
        scale = src.size / total  # footer sizes are uncompressed; cut by the share of the file each group is
        pieces, first, row, acc, first_row = [], 0, 1, 0.0, 1
        for g, (rows, size) in enumerate(groups):
            acc += size * scale
            row += rows
            if acc >= shard_size or g == len(groups) - 1:
                pieces.append(Assignment(index, 0, src.size, row_groups=(first, g + 1), first_line=first_row))
                first, first_row, acc = g + 1, row, 0.0
        return pieces or [Assignment(index, 0, src.size)]

    @classmethod
    def read(cls, a: Assignment, src: SourceFile, sizes: ReadSizes) -> Generator[RawBatch, None, int]:
        """The rows of the assignment's row groups (all of them unless it names some), numbered from its first."""
        import pyarrow.parquet as pq  # deferred: pyarrow takes ~0.2 s to import and only Parquet/Arrow need it

        row = a.first_line or 1
        with open_binary(src.path) as f:
            groups = range(*a.row_groups) if a.row_groups else None
            for rb in pq.ParquetFile(f).iter_batches(batch_size=sizes.batch_records, row_groups=groups):
                rows = rb.to_pylist()
                yield RawBatch(a.source, rows, list(range(row, row + len(rows))), ROWS)
                row += len(rows)
        return 0


def row_groups(path: str) -> list[tuple[int, int]]:
    """(rows, bytes) of each row group of a Parquet file, from its footer alone."""
    import pyarrow.parquet as pq  # deferred: as in ParquetReader.read

    with open_binary(path) as f:
        meta = pq.ParquetFile(f).metadata
        return [(meta.row_group(i).num_rows, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]
