"""prep/sources/discover.py and readers/: finding inputs, reading every format in order, and byte-range sharding."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prepkit import write_jsonl
from xprep.prep.errors import XprepError
from xprep.prep.sources import LINES, ReadSizes, Unreadable, plan_shard, read_batches, resolve_inputs


def records_of(srcs, num_shards=1, shard_index=0, limit=None, sizes=ReadSizes()):
    """(source index, line, item) of everything read, as JSON-decoded records where possible."""
    out = []
    for b in read_batches(srcs, plan_shard(srcs, num_shards, shard_index), limit, sizes=sizes):
        if isinstance(b, Unreadable):
            out.append(("error", b.source, b.line, b.reason))
            continue
        for item, line in zip(b.items, b.lines, strict=True):
            value = json.loads(item) if b.holds == LINES else item
            out.append((b.source, line, value))
    return out


def test_directory_is_sorted_recursive_and_skips_hidden_and_unknown(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("b/z.jsonl", "a.txt", "c.parquet", "b/a.json.gz", ".hidden.jsonl", "notes.md", "x.jsonl.zst"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "y.jsonl").write_bytes(b"")
    found = resolve_inputs([str(tmp_path)])
    assert [s.path for s in found] == [str(tmp_path / n) for n in ("a.txt", "b/a.json.gz", "b/z.jsonl",
                                                                    "c.parquet", "x.jsonl.zst")]
    assert [(s.kind, s.compression) for s in found] == [("text", None), ("lines", ".gz"), ("lines", None),
                                                        ("parquet", None), ("lines", ".zst")]


def test_globs_files_and_duplicates_keep_first_order(tmp_path):
    for n in ("1.jsonl", "2.jsonl", "3.txt"):
        (tmp_path / n).write_text("")
    found = resolve_inputs([str(tmp_path / "3.txt"), str(tmp_path / "*.jsonl"), str(tmp_path / "1.jsonl"),
                            str(tmp_path)])
    assert [s.path.rsplit("/", 1)[1] for s in found] == ["3.txt", "1.jsonl", "2.jsonl"]


@pytest.mark.parametrize("spec, match", [
    ("missing.jsonl", "no such file or directory"),
    ("*.nothing", "the pattern matches no file"),
    ("data.csv", "unsupported file type"),
    ("emptydir", "holds no .jsonl"),
])
def test_input_mistakes(tmp_path, spec, match):
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(XprepError, match=match):
        resolve_inputs([str(tmp_path / spec)])


def test_datasetdict_directory_asks_for_a_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(XprepError, match="pass one split directory"):
        resolve_inputs([str(tmp_path / "dd")])


def test_jsonl_lines_keep_their_numbers_and_skip_blank_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "one"}\n\n   \n{"text": "two"}\r\n{"text": "three"}')  # no final newline
    got = records_of(resolve_inputs([str(p)]))
    assert got == [(0, 1, {"text": "one"}), (0, 4, {"text": "two"}), (0, 5, {"text": "three"})]


def test_batches_split_by_record_count(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(20)])
    srcs = resolve_inputs([str(p)])
    sizes = [len(b.items) for b in read_batches(srcs, plan_shard(srcs, 1, 0), sizes=ReadSizes(batch_records=7))]
    assert sizes == [7, 7, 6]


def test_small_chunks_do_not_change_lines(tmp_path):
    recs = [{"text": "x" * (i * 7 % 50), "i": i} for i in range(60)]
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    want = records_of(resolve_inputs([str(p)]))
    assert records_of(resolve_inputs([str(p)]), sizes=ReadSizes(chunk=5)) == want
    assert [r[2] for r in want] == recs


FORMATS = ["a.jsonl", "b.jsonl.gz",
           "c.jsonl.zst", "d.parquet", "e.arrow", "f.arrow"]


@pytest.fixture(scope="module")
def same_records(tmp_path_factory):
    """30 records (compressible: 2 kB each) written in every readable format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path_factory.mktemp("formats")
    recs = [{"text": f"document {i} é " + "words " * 300} for i in range(30)]
    raw = write_jsonl(d / "a.jsonl", recs).read_bytes()
    (d / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    table = pa.Table.from_pylist(recs)
    pq.write_table(table, d / "d.parquet", row_group_size=7)
    with pa.OSFile(str(d / "e.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=11)
    with pa.OSFile(str(d / "f.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    return d, recs


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_reads_the_same_records(same_records, name):
    d, recs = same_records
    got = records_of(resolve_inputs([str(d / name)]))
    assert [r[2] for r in got] == recs
    assert [r[1] for r in got] == list(range(1, 31))


def test_save_to_disk_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = [{"text": f"row {i}"} for i in range(25)]
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "hf"), num_shards=3)
    found = resolve_inputs([str(tmp_path / "hf")])
    assert len(found) == 3 and all(s.kind == "arrow" for s in found)
    assert [r[2] for r in records_of(found)] == recs


def test_text_files_are_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_bytes("first\ndocument é".encode())
    (tmp_path / "b.txt").write_bytes(b"second")
    assert records_of(resolve_inputs([str(tmp_path)])) == [(0, 1, "first\ndocument é".encode()), (1, 1, b"second")]


def test_limit_counts_records_across_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"i": i} for i in range(4, 10)])
    got = records_of(resolve_inputs([str(a), str(b)]), limit=6)
    assert [r[2]["i"] for r in got] == list(range(6))


def test_unreadable_file_is_reported_not_raised(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(b"this is not gzip")
    good = write_jsonl(tmp_path / "b.jsonl", [{"i": 1}])
    got = records_of(resolve_inputs([str(tmp_path / "a.jsonl.gz"), str(good)]))
    assert got[0][:3] == ("error", 0, 0) and "unreadable file" in got[0][3]
    assert got[1] == (1, 1, {"i": 1})


def test_truncated_gzip_keeps_what_was_read_and_reports_the_rest(tmp_path):
    raw = write_jsonl(tmp_path / "a.jsonl", [{"i": i, "pad": "x" * 100} for i in range(200)]).read_bytes()
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(raw)[:-40])
    got = records_of(resolve_inputs([str(tmp_path / "t.jsonl.gz")]))
    assert got[-1][0] == "error" and "unreadable file" in got[-1][3]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=4),
       kinds=st.lists(st.sampled_from(["jsonl", "gz", "txt"]), min_size=4, max_size=4),
       num_shards=st.integers(1, 6), final_newline=st.booleans(), crlf=st.booleans())
def test_shards_partition_the_records_in_order(tmp_path_factory, sizes, kinds, num_shards, final_newline, crlf):
    """For any files and shard count, concatenating the shards' records gives the single run, exactly once.

    Records of length 0 are written as blank lines (skipped, but counted in line numbers)."""
    d = tmp_path_factory.mktemp("shards")
    eol = "\r\n" if crlf else "\n"
    for f, lengths in enumerate(sizes):
        kind = kinds[f]
        if kind == "txt":
            (d / f"{f}.txt").write_text("t" * (sum(lengths) + 1))
            continue
        raw = eol.join(json.dumps({"f": f, "i": i, "p": "x" * n}) if n else "" for i, n in enumerate(lengths))
        raw = (raw + eol if final_newline and lengths else raw).encode()
        if kind == "gz":
            (d / f"{f}.jsonl.gz").write_bytes(gzip.compress(raw))
        else:
            (d / f"{f}.jsonl").write_bytes(raw)
    srcs = resolve_inputs([str(d)])
    single = records_of(srcs)
    tiny = ReadSizes(chunk=7)  # many partial reads while seeking to a shard's first line
    assert [r for i in range(num_shards) for r in records_of(srcs, num_shards, i, sizes=tiny)] == single


def test_shard_plan_is_contiguous_byte_ranges(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(100)])
    srcs = resolve_inputs([str(p)])
    plans = [plan_shard(srcs, 4, i) for i in range(4)]
    assert [(a.start, a.stop) for plan in plans for a in plan] == [
        (srcs[0].size * i // 4, srcs[0].size * (i + 1) // 4) for i in range(4)]
    counts = [len(records_of(srcs, 4, i)) for i in range(4)]
    assert sum(counts) == 100 and min(counts) >= 20


def test_more_shards_than_records(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"i": 0}, {"i": 1}])
    srcs = resolve_inputs([str(p)])
    per_shard = [records_of(srcs, 16, i) for i in range(16)]
    assert [r[2]["i"] for s in per_shard for r in s] == [0, 1]
    assert sum(1 for s in per_shard if not s) == 14


def test_source_description(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "x"}\n')
    (src,) = resolve_inputs([str(p)])
    assert src.describe() == {"path": str(p), "size": 14, "mtime_ns": p.stat().st_mtime_ns}
    assert src.splittable and not resolve_inputs([str(p)])[0].compression
    assert np.int64(src.size) == 14


@pytest.mark.parametrize("compress", [False, True])
def test_a_json_array_file_streams_the_same_records_as_json_lines(tmp_path, compress):
    """A .json holding one top-level array is read element by element (tiny chunks force elements
    to straddle chunk boundaries, multi-byte characters included) and never split across shards."""
    tiny = ReadSizes(chunk=37)
    recs = [{"text": f"élément {i} " * (i % 5 + 1), "n": [i, {"k": "]"}]} for i in range(200)]
    text = json.dumps(recs, indent=1, ensure_ascii=False).encode()
    path = tmp_path / ("a.json.gz" if compress else "a.json")
    path.write_bytes(gzip.compress(text) if compress else text)
    srcs = resolve_inputs([str(path)])
    assert srcs[0].kind == "array" and not srcs[0].splittable
    assert [item for _, _, item in records_of(srcs, sizes=tiny)] == recs
    shards = [records_of(srcs, 3, i, sizes=tiny) for i in range(3)]
    assert sorted(len(s) for s in shards) == [0, 0, 200]


@pytest.mark.parametrize("body", [b'[{"text": "a"}, {"text": ', b'[{"text": "a"} {"text": "b"}', b"[1, }"])
def test_a_broken_json_array_is_an_unreadable_file(tmp_path, body):
    path = tmp_path / "bad.json"
    path.write_bytes(body)
    out = list(read_batches(resolve_inputs([str(path)]), plan_shard(resolve_inputs([str(path)]), 1, 0)))
    assert isinstance(out[-1], Unreadable) and "JSON array" in out[-1].reason
