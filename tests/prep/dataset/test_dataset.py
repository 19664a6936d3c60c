"""prep/dataset/token_dataset.py and manifest.py: aligned streams, lazy and widened streams, counts, atomic publish,
consistency checks."""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
from xprep.prep.dataset.indexed import write_index
from xprep.prep.dataset.manifest import CategoryTable, canonical_json, fingerprint, token_dtype
from xprep.prep.dataset.token_dataset import DatasetWriter, TokenDataset
from xprep.prep.errors import XprepError

BASE = {"tokenizer": {"path": "t", "sha256": "0" * 64, "vocab_size": 1000, "eod_id": 1, "pad_id": None},
        "chat_template": None, "options": {"format": "text"}, "sources": []}


def build(out, batches, vocab=1000, categories=None, dtype=None):
    """Write ``batches`` of (docs, masks or None, cats or None) and publish; returns the manifest."""
    with DatasetWriter(out, vocab, dtype) as w:
        for docs, masks, cats in batches:
            w.append(np.concatenate(docs), np.array([len(d) for d in docs]),
                     None if masks is None else np.concatenate(masks).astype(np.uint8),
                     None if cats is None else np.concatenate(cats))
        return w.finish(BASE, categories or CategoryTable())


def test_token_dtype_threshold():
    assert token_dtype(32_000) == np.uint16
    assert token_dtype(65_499) == np.uint16
    assert token_dtype(65_500) == np.int32
    assert token_dtype(151_669) == np.int32


def test_text_only_dataset_has_tokens_stream_and_default_masks(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([8]), np.array([9, 10])]
    m = build(tmp_path / "d", [(docs, None, None)])
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["manifest.json", "tokens.bin", "tokens.idx"]
    assert m["counts"] == {"documents": 3, "tokens": 6, "loss_tokens": 3, "max_token_id": 10,
                           "categories": {"uncategorized": {"tokens": 6, "loss_tokens": 3}}}
    ds = TokenDataset(tmp_path / "d")
    assert ds.document(0)["loss_mask"].tolist() == [0, 1, 1]
    assert ds.document(1)["loss_mask"].tolist() == [0]
    assert ds.document(2)["category_ids"].tolist() == [0, 0]
    assert ds.tokens.dtype == np.uint16 and len(ds) == 3 and ds.lengths.tolist() == [3, 1, 2]


def test_lazy_streams_are_backfilled_for_earlier_documents(tmp_path):
    text = ([np.array([1, 2, 3]), np.array([4, 5])], None, None)
    chat = ([np.array([6, 7, 8, 9])], [np.array([0, 0, 1, 1])], [np.array([0, 0, 2, 2], np.uint16)])
    names = CategoryTable(["uncategorized", "a", "b"])
    m = build(tmp_path / "d", [text, chat, text], categories=names)
    ds = TokenDataset(tmp_path / "d")
    assert [ds.loss_mask[i].tolist() for i in range(5)] == [[0, 1, 1], [0, 1], [0, 0, 1, 1], [0, 1, 1], [0, 1]]
    assert [ds.category_ids[i].tolist() for i in range(5)] == [[0] * 3, [0] * 2, [0, 0, 2, 2], [0] * 3, [0] * 2]
    assert m["counts"]["loss_tokens"] == 2 + 1 + 2 + 2 + 1
    assert m["counts"]["categories"] == {"uncategorized": {"tokens": 12, "loss_tokens": 6},
                                         "b": {"tokens": 2, "loss_tokens": 2}}
    assert set(m["streams"]) == {"tokens", "loss_mask", "category_ids"}
    assert m["streams"]["category_ids"]["dtype"] == "uint8"


def test_more_than_255_categories_widen_the_stream_to_uint16(tmp_path):
    first = ([np.array([1, 2])], None, [np.array([3, 3], np.uint16)])
    wide = ([np.array([4, 5, 6])], None, [np.array([300, 300, 7], np.uint16)])
    table = CategoryTable()
    for cid in (3, 7, 300):
        table.use_numeric(cid)
    m = build(tmp_path / "d", [first, wide, first], categories=table)
    assert m["streams"]["category_ids"]["dtype"] == "uint16"
    ds = TokenDataset(tmp_path / "d")
    assert ds.category_ids.dtype == np.uint16
    assert [ds.category_ids[i].tolist() for i in range(3)] == [[3, 3], [300, 300, 7], [3, 3]]
    assert m["categories"][300] == "300" and m["categories"][1] is None
    assert m["counts"]["categories"]["300"] == {"tokens": 2, "loss_tokens": 1}


def test_uint16_refuses_large_ids(tmp_path):
    with pytest.raises(XprepError, match="does not fit uint16"):
        build(tmp_path / "d", [([np.array([1, 70_000])], None, None)], dtype=np.uint16)
    assert not (tmp_path / "d").exists()
    assert not list(tmp_path.iterdir()), "the temporary directory must be removed"


def test_exception_inside_the_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), DatasetWriter(tmp_path / "d", 100) as w:
        w.append(np.array([1, 2, 3]), np.array([3]))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_nothing_is_visible_until_finish(tmp_path):
    w = DatasetWriter(tmp_path / "d", 100)
    w.append(np.array([1, 2, 3]), np.array([3]))
    assert not (tmp_path / "d").exists()
    assert w.tmp.name.startswith(".d.tmp-")
    w.finish(BASE, CategoryTable())
    assert TokenDataset(tmp_path / "d").tokens[0].tolist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_existing_output_is_refused_unless_empty(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(XprepError, match="already exists and is not empty"):
        DatasetWriter(tmp_path / "full", 100)
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    (tmp_path / "file").write_text("")  # an empty file is still not a directory
    with pytest.raises(XprepError, match="exists and is a file, not a directory"):
        DatasetWriter(tmp_path / "file", 100)
    (tmp_path / "empty").mkdir()
    build(tmp_path / "empty", [([np.array([1])], None, None)])
    assert TokenDataset(tmp_path / "empty").lengths.tolist() == [1]


def test_stale_temp_of_a_dead_process_is_removed_live_one_kept(tmp_path):
    """A writer removes earlier runs' temporary directories whose owner is gone (prep.io.owner_gone: tests/test_io.py),
    and no other: one of another host, a live one, one without an owner record."""
    from xprep.prep.io import OWNER

    def temp(name: str, record: dict | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "tokens.bin").write_bytes(b"x")
        if record is not None:
            (path / OWNER).write_text(json.dumps(record))
        return path

    here = socket.gethostname()
    dead = temp(".d.tmp-999999999-a", {"host": here, "pid": 999_999_999})
    elsewhere = temp(".d.tmp-999999999-b", {"host": here + "-other", "pid": 999_999_999})
    live = temp(f".d.tmp-{os.getppid()}-c", {"host": here, "pid": os.getppid()})
    unrecorded = temp(".d.tmp-999999999", None)
    build(tmp_path / "d", [([np.array([1])], None, None)])
    assert not dead.exists() and elsewhere.exists() and live.exists() and unrecorded.exists()
    assert not (tmp_path / "d" / OWNER).exists()


def test_rejects_are_written_and_counted(tmp_path):
    with DatasetWriter(tmp_path / "d", 100) as w:
        w.append(np.array([1, 2]), np.array([2]))
        w.reject("a.jsonl", 3, "malformed JSON: Expecting value", "{bad")
        w.reject("a.jsonl", 9, "empty text", "x" * 2000)
        m = w.finish(BASE, CategoryTable())
    assert m["rejects"] == {"count": 2, "by_reason": {"empty text": 1, "malformed JSON": 1}, "file": "rejects.jsonl"}
    lines = [json.loads(s) for s in (tmp_path / "d" / "rejects.jsonl").read_text().splitlines()]
    assert lines[0] == {"source": "a.jsonl", "line": 3, "kind": "malformed JSON",
                        "reason": "malformed JSON: Expecting value", "record": "{bad"}
    assert len(lines[1]["record"]) == 500


def test_category_table_ids():
    t = CategoryTable()
    assert t.names == ["uncategorized"]
    assert t.id_of("code") == 1 and t.id_of("chat") == 2 and t.id_of("code") == 1
    t.use_numeric(5)
    assert t.names == ["uncategorized", "code", "chat", None, None, "5"]
    assert t.id_of("math") == 3  # fills the first free id
    assert len(t) == 6


def test_fingerprint_covers_content_not_paths_or_counts():
    m = {"format": "xprep-dataset", "version": 1, "tokenizer": {"sha256": "a"}, "chat_template": None,
         "options": {"format": "text"}, "categories": ["uncategorized"], "streams": {"tokens": {"bin_sha256": "b"}},
         "sources": [{"path": "/x"}], "counts": {"documents": 1}, "rejects": {"count": 0}}
    fp = fingerprint(m)
    assert fp == fingerprint({**m, "sources": [{"path": "/elsewhere"}], "counts": {}, "rejects": {}})
    for key, value in [("tokenizer", {"sha256": "c"}), ("options", {"format": "chat"}),
                       ("streams", {"tokens": {"bin_sha256": "c"}}), ("categories", ["uncategorized", "x"]),
                       ("chat_template", {"sha256": "t"})]:
        assert fingerprint({**m, key: value}) != fp, key
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()


def test_manifest_fingerprint_matches_recomputation(tmp_path):
    m = build(tmp_path / "d", [([np.array([1, 2])], None, None)])
    on_disk = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert on_disk == m
    assert fingerprint(on_disk) == on_disk["fingerprint"] == TokenDataset(tmp_path / "d").fingerprint


# -- opening checks ----------------------------------------------------------------------------------------
@pytest.fixture
def chat_ds(tmp_path):
    docs = [np.array([1, 2, 3, 4]), np.array([5, 6])]
    build(tmp_path / "d", [(docs, [np.array([0, 0, 1, 1]), np.array([0, 1])],
                            [np.array([0, 1, 1, 1], np.uint16), np.array([1, 1], np.uint16)])],
          categories=CategoryTable(["uncategorized", "c"]))
    return tmp_path / "d"


def test_streams_with_other_lengths_are_refused(chat_ds):
    # Same total size (so each .bin matches its own .idx) but other document boundaries.
    write_index(chat_ds / "loss_mask.idx", np.uint8, np.array([3, 3]))
    with pytest.raises(XprepError, match="stream loss_mask disagrees with tokens"):
        TokenDataset(chat_ds)


def test_stream_with_fewer_documents_is_refused(chat_ds):
    (chat_ds / "category_ids.bin").write_bytes(np.ones(4, np.uint8).tobytes())
    write_index(chat_ds / "category_ids.idx", np.uint8, np.array([4]))
    with pytest.raises(XprepError, match="category_ids disagrees"):
        TokenDataset(chat_ds)


def test_manifest_counts_must_match_streams(chat_ds):
    m = json.loads((chat_ds / "manifest.json").read_text())
    m["counts"]["tokens"] += 1
    (chat_ds / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XprepError, match="manifest says"):
        TokenDataset(chat_ds)


def test_missing_stream_listed_in_manifest_is_refused(chat_ds):
    (chat_ds / "loss_mask.bin").unlink()
    with pytest.raises(XprepError, match="loss_mask.bin: missing"):
        TokenDataset(chat_ds)


@pytest.mark.parametrize("content, match", [(None, "not a token dataset"), ("{oops", "unreadable manifest"),
                                            ('{"format": "other"}', "not an xprep-dataset v1")])
def test_bad_manifest(chat_ds, content, match):
    if content is None:
        (chat_ds / "manifest.json").unlink()
    else:
        (chat_ds / "manifest.json").write_text(content)
    with pytest.raises(XprepError, match=match):
        TokenDataset(chat_ds)


def test_dataset_pickles_as_its_path(chat_ds):
    ds = TokenDataset(chat_ds)
    blob = pickle.dumps(ds)
    assert len(blob) < 500
    again = pickle.loads(blob)
    assert again.document(0)["category_ids"].tolist() == [0, 1, 1, 1]
    assert again.document(1)["loss_mask"].tolist() == [0, 1]


def test_write_behind_syncs_while_writing_and_changes_no_byte(tmp_path, monkeypatch):
    """A durable writer hands what it appended to the disk in a thread every WRITE_BEHIND_ITEMS tokens (so the fsync
    at the end has little left): through streams created late and the category stream widened to uint16 midway,
    the dataset is byte for byte the one written without it."""
    rng = np.random.default_rng(0)
    batches = []
    for k in range(12):
        lengths = rng.integers(1, 40, 8)
        n = int(lengths.sum())
        mask = rng.integers(0, 2, n).astype(np.uint8) if k >= 3 else None  # the loss mask stream begins at batch 3
        cats = np.full(n, 300 if k == 7 else k % 3, np.int64) if k >= 5 else None  # widened to uint16 at batch 7
        batches.append((rng.integers(0, 1000, n), lengths, mask, cats))

    def write(out, durable):
        table = CategoryTable()
        with DatasetWriter(out, 1000, durable=durable, write_behind_items=100) as w:
            for tokens, lengths, mask, cats in batches:
                w.append(tokens, lengths, mask, cats)
            return w.finish(BASE, table)

    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd) or real(fd))
    with_it = write(tmp_path / "a", durable=True)
    assert len(synced) >= 3  # syncs ran, on more than one stream
    without = write(tmp_path / "b", durable=False)
    assert with_it == without
    for name in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
