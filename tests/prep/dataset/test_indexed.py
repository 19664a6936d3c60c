"""prep/dataset/indexed.py: the MMIDIDX v1 layout, written and read, against megatron-core's own code."""

from __future__ import annotations

import pickle
import struct
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xprep.prep.dataset.indexed import (
    CODE_OF_DTYPE,
    DTYPE_CODES,
    HEADER,
    MAGIC,
    BinWriter,
    IndexedReader,
    pointers_from_lengths,
    write_index,
)
from xprep.prep.errors import XprepError


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def write(prefix, docs, dtype) -> dict:
    w = BinWriter(prefix, dtype)
    if docs:
        w.append(np.concatenate(docs), np.array([len(d) for d in docs]))
    return w.close()


def test_header_layout_is_megatron_mmidx_v1(tmp_path):
    docs = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    write(tmp_path / "a", docs, np.uint16)
    raw = (tmp_path / "a.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" == MAGIC
    assert struct.unpack_from("<Q", raw, 9) == (1,)
    assert raw[17] == 8  # uint16
    assert struct.unpack_from("<QQ", raw, 18) == (3, 4)
    off = 34
    assert np.frombuffer(raw, np.int32, 3, off).tolist() == [3, 1, 2]
    assert np.frombuffer(raw, np.int64, 3, off + 12).tolist() == [0, 6, 8]
    assert np.frombuffer(raw, np.int64, 4, off + 36).tolist() == [0, 1, 2, 3]
    assert len(raw) == off + 3 * 12 + 4 * 8 == HEADER.size + 68
    assert (tmp_path / "a.bin").read_bytes() == np.arange(1, 7, dtype=np.uint16).tobytes()


def test_dtype_codes_match_megatron():
    mod = _megatron()
    for code, dtype in DTYPE_CODES.items():
        assert mod.DType.code_from_dtype(dtype.type) == code
        assert CODE_OF_DTYPE[dtype] == code


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_files_are_byte_identical_to_megatron_builder(tmp_path, dtype):
    mod = _megatron()
    import torch

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, size=int(n)).astype(dtype) for n in rng.integers(1, 50, size=40)]
    builder = mod.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "meg.idx"))
    write(tmp_path / "ours", docs, dtype)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "meg.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "meg.idx").read_bytes()


def test_megatron_reads_ours_and_we_read_megatrons(tmp_path):
    mod = _megatron()
    docs = [np.arange(n, dtype=np.int32) * 7 for n in (5, 1, 17, 3)]
    write(tmp_path / "ours", docs, np.int32)
    meg = mod.IndexedDataset(str(tmp_path / "ours"))
    assert len(meg) == 4 and meg.index.dtype == np.int32
    for i, d in enumerate(docs):
        assert np.array_equal(meg[i], d)
    assert meg.document_indices.tolist() == [0, 1, 2, 3, 4]
    reader = IndexedReader(tmp_path / "ours")
    assert np.array_equal(reader.lengths, meg.sequence_lengths)
    assert np.array_equal(reader.pointers, meg.index.sequence_pointers)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 65535), max_size=30), max_size=30),
       st.sampled_from([np.uint16, np.int32, np.int64, np.uint8]))
def test_round_trip_any_documents(tmp_path_factory, docs, dtype):
    dtype = np.dtype(dtype)
    docs = [np.array(d, dtype=np.int64) % min(int(np.iinfo(dtype).max) + 1, 1 << 40) for d in docs]
    prefix = tmp_path_factory.mktemp("rt") / "x"
    digests = write(prefix, [d.astype(dtype) for d in docs], dtype)
    reader = IndexedReader(prefix)
    assert reader.dtype == dtype and len(reader) == len(docs)
    for i, d in enumerate(docs):
        assert reader[i].tolist() == d.tolist()
    assert reader.offsets().tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    import hashlib

    assert digests["bin_sha256"] == hashlib.sha256((prefix.parent / "x.bin").read_bytes()).hexdigest()
    assert digests["idx_sha256"] == hashlib.sha256((prefix.parent / "x.idx").read_bytes()).hexdigest()


def test_appends_in_several_calls_equal_one_call(tmp_path):
    docs = [np.arange(n, dtype=np.int32) for n in (3, 0, 4, 2)]
    w = BinWriter(tmp_path / "a", np.int32)
    for d in docs:
        w.append(d, np.array([len(d)]))
    w.close()
    write(tmp_path / "b", docs, np.int32)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()


def test_pointers_are_exclusive_byte_cumsum():
    assert pointers_from_lengths(np.array([3, 1, 2]), 4).tolist() == [0, 12, 16]
    assert pointers_from_lengths(np.array([5]), 2).tolist() == [0]
    assert pointers_from_lengths(np.array([], np.int32), 2).tolist() == []


def test_empty_dataset_opens(tmp_path):
    write(tmp_path / "e", [], np.uint16)
    r = IndexedReader(tmp_path / "e")
    assert len(r) == 0 and r.items.size == 0 and r.offsets().tolist() == [0]


def test_explicit_document_index(tmp_path):
    mod = _megatron()
    (tmp_path / "s.bin").write_bytes(np.arange(6, dtype=np.uint16).tobytes())
    write_index(tmp_path / "s.idx", np.uint16, np.array([2, 1, 3]), np.array([0, 2, 3]))
    assert IndexedReader(tmp_path / "s").doc_index.tolist() == [0, 2, 3]
    assert mod.IndexedDataset(str(tmp_path / "s")).document_indices.tolist() == [0, 2, 3]


def test_reader_pickles_as_its_path(tmp_path):
    write(tmp_path / "p", [np.arange(1000, dtype=np.int32)], np.int32)
    r = IndexedReader(tmp_path / "p")
    blob = pickle.dumps(r)
    assert len(blob) < 500
    r2 = pickle.loads(blob)
    assert np.array_equal(r2[0], r[0])


# -- corrupt files: every one is an XprepError naming the file ---------------------------------------------
@pytest.fixture
def good(tmp_path):
    write(tmp_path / "g", [np.arange(10, dtype=np.uint16), np.arange(5, dtype=np.uint16)], np.uint16)
    return tmp_path / "g"


def _expect(prefix, *needles):
    with pytest.raises(XprepError) as e:
        IndexedReader(prefix)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_truncated_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    _expect(good, "g.bin", "28 bytes", "30", "truncated")


def test_longer_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes() + b"\0\0")
    _expect(good, "g.bin", "32 bytes")


def test_truncated_idx(good):
    i = good.with_suffix(".idx")
    i.write_bytes(i.read_bytes()[:-1])
    _expect(good, "g.idx", "header implies")


def test_truncated_header(good):
    i = good.with_suffix(".idx")
    i.write_bytes(i.read_bytes()[:20])
    _expect(good, "g.idx", "truncated header")


def test_bad_magic(good):
    i = good.with_suffix(".idx")
    i.write_bytes(b"NOTMMIDX\0" + i.read_bytes()[9:])
    _expect(good, "not an MMIDIDX")


def test_unknown_dtype_code(good):
    i = good.with_suffix(".idx")
    raw = bytearray(i.read_bytes())
    raw[17] = 99
    i.write_bytes(bytes(raw))
    _expect(good, "unknown dtype code 99")


@pytest.mark.parametrize("ext", ["bin", "idx"])
def test_missing_file(good, ext):
    good.with_suffix(f".{ext}").unlink()
    _expect(good, f"g.{ext}", "missing")
