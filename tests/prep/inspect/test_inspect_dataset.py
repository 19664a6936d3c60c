"""``xprep inspect DATASET``: the report (text and --json), and clear refusals of corrupt datasets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import SHARED, requires_shared_data
from prepkit import (
    chat_records,
    conversation_counts,
    read_jsonl,
    shaped_conversations,
    text_records,
    tokenize,
    write_jsonl,
)
from xprep.prep.dataset.indexed import write_index
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.inspect.dataset_report import dataset_report
from xprep.prep.inspect.options import kind_of
from xprep.prep.inspect.stats import histogram, length_stats
from xprep.prep.inspect.text import render


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer):
    """Text, chat and pre-tokenized records with record and message categories, and two rejects."""
    d = tmp_path_factory.mktemp("inspect")
    recs = [{**r, "category": "prose"} for r in text_records(20)]
    chats = chat_records(10)
    for c in chats[::2]:
        c["category"] = "dialog"
        c["messages"][-1]["category"] = "answers"
    recs += chats + [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 0]}, {"text": ""}, {"text": 7}]
    src = write_jsonl(d / "in.jsonl", recs)
    tokenize(src, d / "ds", tiny_tokenizer, on_error="skip")
    return d / "ds"


def test_json_report_counts_equal_the_streams(dataset, run_cli):
    code, out, err = run_cli("inspect", dataset, "--json")
    assert code == 0, err
    r = json.loads(out)
    ds = TokenDataset(dataset)
    names = ds.category_names
    assert r["kind"] == "dataset" and r["path"] == str(dataset)
    assert r["fingerprint"] == ds.fingerprint
    assert r["documents"] == len(ds) == 31
    assert r["tokens"] == int(ds.lengths.sum())
    assert r["loss_tokens"] == int(ds.loss_mask.items.sum())
    assert r["streams"] == ["category_ids", "loss_mask", "tokens"]
    assert r["dtype"] == "uint16" and r["tokenizer"]["vocab_size"] == 600
    cats, mask = ds.category_ids.items, ds.loss_mask.items
    expected = {}
    for cid in np.unique(cats):
        sel = cats == cid
        expected[names[cid]] = {"tokens": int(sel.sum()), "loss_tokens": int(mask[sel].sum())}
    assert r["categories"] == expected
    assert set(expected) == {"uncategorized", "prose", "dialog", "answers"}
    assert expected["answers"]["tokens"] == expected["answers"]["loss_tokens"] > 0  # only targets are 'answers'
    assert r["rejects"] == {"count": 2, "by_reason": {"bad type": 1, "empty text": 1}, "file": "rejects.jsonl"}
    lengths = ds.lengths
    p = r["lengths"]["percentiles"]
    assert p["p0"] == lengths.min() and p["p100"] == lengths.max()
    assert p["p50"] == int(np.percentile(lengths, 50, method="nearest"))
    assert r["lengths"]["count"] == 31 and r["lengths"]["sum"] == r["tokens"]
    assert sum(h["count"] for h in r["histogram"]) == 31
    assert r["sources"] == 1


def test_text_report(dataset, run_cli):
    code, out, err = run_cli("inspect", dataset)
    assert code == 0, err
    r = dataset_report(dataset)
    assert out.startswith(f"dataset {dataset}  (fingerprint {r['fingerprint'][:16]})")
    assert f"documents     {r['documents']:,}" in out
    assert f"tokens        {r['tokens']:,}" in out
    assert f"target tokens {r['loss_tokens']:,}" in out
    assert "chat template tokenizer" in out
    assert "length histogram" in out
    header = next(line for line in out.splitlines() if line.startswith("category"))
    assert "tokens" in header and "target tokens" in header
    rows = {line.split()[0]: line.split() for line in out.splitlines()[out.splitlines().index(header) + 2:]
            if line and not line.startswith(" ") and not line.startswith("rejected")}
    for name, c in r["categories"].items():
        assert rows[name][1] == f"{c['tokens']:,}" and rows[name][2] == f"{c['loss_tokens']:,}", name
    assert "rejected records: 2" in out and "empty text: 1" in out


@requires_shared_data
def test_inspect_real_chat_dataset(tmp_path, run_cli):
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:50]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    m = tokenize(tmp_path / "c.jsonl", tmp_path / "ds", SHARED / "tokenizers/qwen3", on_error="skip")
    code, out, err = run_cli("inspect", tmp_path / "ds", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["categories"] == {"uncategorized": {"tokens": m["counts"]["tokens"],
                                                 "loss_tokens": m["counts"]["loss_tokens"]}}
    assert 0 < r["loss_tokens"] < r["tokens"]
    assert r["rejects"]["by_reason"] == {"no assistant message": m["rejects"]["count"]}


def test_length_stats_and_histogram_units():
    lengths = np.array([1, 2, 3, 4, 100, 1000], np.int32)
    s = length_stats(lengths)
    assert s["count"] == 6 and s["sum"] == 1110 and s["mean"] == 185.0
    assert s["percentiles"]["p0"] == 1 and s["percentiles"]["p100"] == 1000
    hist = histogram(lengths)
    assert sum(h["count"] for h in hist) == 6
    assert all(h["lo"] <= h["hi"] for h in hist)
    assert length_stats(np.zeros(0, np.int32)) == {"count": 0, "sum": 0} and histogram(np.zeros(0)) == []


def test_empty_dataset_report(tmp_path, tiny_tokenizer, run_cli):
    d = tmp_path / "in"
    d.mkdir()
    (d / "x.txt").write_text("one")
    tokenize([d], tmp_path / "ds", tiny_tokenizer, num_shards=2, shard_index=1)
    assert len(TokenDataset(tmp_path / "ds")) == 0
    code, out, err = run_cli("inspect", tmp_path / "ds")
    assert code == 0 and "documents     0" in out, err


# -- 7. corrupt datasets are refused with a clear message ------------------------------------------------------
@pytest.fixture
def copy(dataset, tmp_path):
    target = tmp_path / "ds"
    shutil.copytree(dataset, target)
    return target


def refused(path, run_cli, *needles):
    with pytest.raises(XprepError) as e:
        TokenDataset(path)
    code, out, err = run_cli("inspect", path)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.strip() == f"error: {e.value}"
    for needle in needles:
        assert needle in err, err
    return err


def test_truncated_tokens_bin(copy, run_cli):
    b = copy / "tokens.bin"
    size = b.stat().st_size
    b.write_bytes(b.read_bytes()[:-10])
    refused(copy, run_cli, str(b), f"{size - 10} bytes", f"describes {size}", "truncated")


def test_truncated_loss_mask_bin(copy, run_cli):
    b = copy / "loss_mask.bin"
    with open(b, "r+b") as f:
        f.truncate(b.stat().st_size // 2)
    refused(copy, run_cli, "loss_mask.bin", "truncated")


def test_streams_that_disagree(copy, run_cli):
    ds = TokenDataset(copy)
    lengths = ds.lengths.copy()
    lengths[0] += 1
    lengths[1] -= 1  # same total: each .bin still matches its own .idx
    write_index(copy / "category_ids.idx", ds.category_ids.dtype, lengths)
    refused(copy, run_cli, "stream category_ids disagrees with tokens", "re-create")


def test_stream_from_another_dataset(copy, run_cli, tiny_tokenizer, tmp_path):
    other = write_jsonl(tmp_path / "o.jsonl", chat_records(3))
    tokenize(other, tmp_path / "other", tiny_tokenizer)
    for ext in ("bin", "idx"):
        shutil.copy(tmp_path / "other" / f"loss_mask.{ext}", copy / f"loss_mask.{ext}")
    refused(copy, run_cli, "stream loss_mask disagrees with tokens")


def test_tokens_and_manifest_disagree(copy, run_cli):
    m = json.loads((copy / "manifest.json").read_text())
    m["counts"]["documents"] -= 1
    (copy / "manifest.json").write_text(json.dumps(m))
    refused(copy, run_cli, "the manifest says")


def test_truncated_idx(copy, run_cli):
    i = copy / "tokens.idx"
    i.write_bytes(i.read_bytes()[:-8])
    refused(copy, run_cli, "tokens.idx", "header implies")


def test_missing_stream_file(copy, run_cli):
    (copy / "category_ids.idx").unlink()
    refused(copy, run_cli, "category_ids.idx: missing")


def test_corrupt_manifest_and_non_datasets(copy, tmp_path, run_cli):
    (copy / "manifest.json").write_text("{not json")
    code, _, err = run_cli("inspect", copy)
    assert code == 2 and "not valid JSON" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("inspect", tmp_path / "empty")
    assert code == 2 and "neither a token dataset" in err
    code, _, err = run_cli("inspect", tmp_path / "nope")
    assert code == 2 and "no such file or directory" in err


def test_inspect_path_dispatches_to_dataset(dataset):
    report = dataset_report(dataset)
    assert kind_of(dataset) == report["kind"] == "dataset" and render(report).startswith("dataset ")


@pytest.mark.parametrize("edit", ["only-format", "no-streams", "no-counts-tokens"])
def test_manifest_missing_fields_is_a_clear_error(copy, run_cli, edit):
    m = json.loads((copy / "manifest.json").read_text())
    if edit == "only-format":
        m = {"format": m["format"], "version": m["version"]}
    elif edit == "no-streams":
        del m["streams"]
    else:
        del m["counts"]["tokens"]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XprepError):
        TokenDataset(copy)
    code, out, err = run_cli("inspect", copy)
    assert code == 2 and "Traceback" not in err and "manifest.json" in err, err


# -- issue 29 --------------------------------------------------------------------------------------------------------
def test_a_text_only_dataset_names_no_chat_template(tmp_path, tiny_tokenizer, run_cli):
    """The tiny tokenizer has a chat template, which ``--format auto`` resolves (and the manifest records); a dataset
    of text alone was still shown with "chat template tokenizer"."""
    tokenize(write_jsonl(tmp_path / "t.jsonl", text_records(5)), tmp_path / "ds", tiny_tokenizer)
    assert TokenDataset(tmp_path / "ds").manifest["chat_template"]["name"] == "tokenizer"
    r = dataset_report(tmp_path / "ds")
    assert r["chat_template"] is None and r["conversations"] is None
    code, out, err = run_cli("inspect", tmp_path / "ds")
    assert code == 0 and "chat template" not in out, err


@requires_shared_data
def test_the_report_counts_the_conversations_shape(tmp_path):
    """Issue 29: how many conversations begin with the assistant, end with another turn, and how many answers are
    blank, with their shares (of the conversations; of the answers for the blank ones), from the manifest."""
    records = shaped_conversations(read_jsonl(SHARED / "chat/chitchat.jsonl")[:120])
    tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "ds", SHARED / "tokenizers/qwen3",
             on_error="skip")
    want = conversation_counts(records)
    r = dataset_report(tmp_path / "ds")
    assert r["chat_template"]["name"] == "tokenizer"
    shares = r["conversations"].pop("shares")
    assert r["conversations"] == want
    assert shares == {"assistant_first": want["assistant_first"] / want["count"],
                      "empty_answers": want["empty_answers"] / want["answers"],
                      "ends_without_answer": want["ends_without_answer"] / want["count"]}
