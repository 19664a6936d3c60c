"""Megatron-LM ``MMIDIDX`` v1 indexed datasets: the one place the ``.idx`` layout is spelled out.

An indexed dataset is a pair ``PREFIX.bin`` (raw items, back to back) and ``PREFIX.idx``:

    magic      9 bytes   b"MMIDIDX\\x00\\x00"
    version    <Q        1
    dtype      <B        code of the item dtype (see ``DTYPE_CODES``)
    seq_count  <Q        number of sequences
    doc_count  <Q        number of entries in ``document_indices`` (documents + 1)
    lengths    int32[seq_count]      items per sequence
    pointers   int64[seq_count]      byte offset of each sequence in ``.bin``
    doc_index  int64[doc_count]      sequence index where each document starts, then seq_count

Byte-compatible with ``megatron.core.datasets.indexed_dataset.IndexedDataset`` (proven by the
test suite with the real library). Both the writer and the reader are built from ``HEADER``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np
from xprep.prep.errors import XprepError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, seq_count, doc_count

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def pointers_from_lengths(lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence: exclusive cumulative sum of ``lengths * itemsize``."""
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    return pointers


def write_index(
    path: str | Path, dtype: np.dtype, lengths: np.ndarray, doc_index: np.ndarray | None = None
) -> bytes:
    """Write an ``.idx`` file for one sequence per document (unless ``doc_index`` is given).

    Returns the sha256 digest of the bytes written.
    """
    dtype = np.dtype(dtype)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    if doc_index is None:
        doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    doc_index = np.ascontiguousarray(doc_index, dtype=np.int64)
    pointers = pointers_from_lengths(lengths, dtype.itemsize)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (
            HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], len(lengths), len(doc_index)),
            lengths.tobytes(),
            pointers.tobytes(),
            doc_index.tobytes(),
        ):
            f.write(part)
            digest.update(part)
    return digest.digest()


class BinWriter:
    """Appends items of one dtype to a ``.bin`` file, hashing what it writes.

    Keeps the per-sequence lengths in memory (4 bytes a document) for the ``.idx``.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._file = open(bin_path(prefix), "wb")
        self._digest = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.items = 0

    def append(self, items: np.ndarray, lengths: np.ndarray) -> None:
        """Append the sequences whose concatenation is ``items`` and whose sizes are ``lengths``."""
        data = np.ascontiguousarray(items, dtype=self.dtype)
        self._file.write(memoryview(data).cast("B"))
        self._digest.update(memoryview(data).cast("B"))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.items += len(data)

    def lengths(self) -> np.ndarray:
        return np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)

    def flushed_fileno(self) -> int:
        """The file descriptor, everything appended so far handed to the OS (for an fdatasync in another thread)."""
        self._file.flush()
        return self._file.fileno()

    def close(self) -> dict[str, str]:
        """Flush the ``.bin``, write the ``.idx``; return both digests (hex)."""
        self._file.close()
        idx_digest = write_index(idx_path(self.prefix), self.dtype, self.lengths())
        return {"bin_sha256": self._digest.hexdigest(), "idx_sha256": idx_digest.hex()}

    def abort(self) -> None:
        self._file.close()


def parse_index(idx_buf: bytes, ipath: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, lengths, pointers, doc_index) of the ``.idx`` bytes ``idx_buf`` (zero-copy views), checked: header,
    size, pointers that follow from the lengths, document indices that partition the sequences. A local reader and
    a reader of a dataset at a URL (prep/dataset/stream.py) both parse an index here."""
    if len(idx_buf) < HEADER.size:
        raise XprepError(f"{ipath}: truncated header ({len(idx_buf)} bytes); re-create the dataset")
    magic, version, code, seq_count, doc_count = HEADER.unpack_from(idx_buf)
    if magic != MAGIC or version != VERSION:
        raise XprepError(f"{ipath}: not an MMIDIDX v1 index (magic {magic!r}, version {version})")
    if code not in DTYPE_CODES:
        raise XprepError(f"{ipath}: unknown dtype code {code}")
    expected = HEADER.size + seq_count * 12 + doc_count * 8
    if len(idx_buf) != expected:
        raise XprepError(
            f"{ipath}: {len(idx_buf)} bytes but its header implies {expected}; re-create the dataset"
        )
    dtype = DTYPE_CODES[code]
    off = HEADER.size
    lengths = np.frombuffer(idx_buf, np.int32, seq_count, off)
    off += seq_count * 4
    pointers = np.frombuffer(idx_buf, np.int64, seq_count, off)
    off += seq_count * 8
    doc_index = np.frombuffer(idx_buf, np.int64, doc_count, off)
    _check_index(ipath, dtype, lengths, pointers, doc_index)
    return dtype, lengths, pointers, doc_index


def _check_index(ipath, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray, d: np.ndarray) -> None:
    """Pointers must follow from the lengths and document indices must be a partition (vectorized)."""
    ok = bool((lengths >= 0).all()) and np.array_equal(pointers, pointers_from_lengths(lengths, dtype.itemsize))
    ok = ok and len(d) > 0 and d[0] == 0 and d[-1] == len(lengths) and bool((np.diff(d) >= 0).all())
    if not ok:
        raise XprepError(f"{ipath}: inconsistent index (pointers, lengths or document indices disagree); "
                         "the dataset is corrupt: re-create it")


def implied_bin_size(dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray) -> int:
    """The size in bytes of the ``.bin`` an index describes."""
    return int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if len(lengths) else 0


class IndexedReader:
    """Zero-copy reader of one ``.bin/.idx`` pair; pickles as its path only.

    Checks the header, the index size, and that the ``.bin`` size equals what the index implies.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise XprepError(f"{p}: missing; the dataset is incomplete, re-run `xprep tokenize`")
        with open(ipath, "rb") as f:
            self.dtype, self.lengths, self.pointers, self.doc_index = parse_index(f.read(), ipath)
        size = os.path.getsize(bpath)
        implied = implied_bin_size(self.dtype, self.lengths, self.pointers)
        if size != implied:
            raise XprepError(
                f"{bpath}: {size} bytes but {ipath} describes {implied}; the file is truncated or "
                "belongs to another index: re-create the dataset"
            )
        if size == 0:
            self._mmap = None
            self.items = np.zeros(0, self.dtype)
        else:
            with open(bpath, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.items = np.frombuffer(self._mmap, self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.items[start : start + int(self.lengths[i])]

    def offsets(self) -> np.ndarray:
        """Item offset of each sequence plus the total: int64[n + 1] (CSR over ``items``)."""
        out = np.empty(len(self.lengths) + 1, np.int64)
        out[0] = 0
        np.cumsum(self.lengths, out=out[1:])
        return out

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()
