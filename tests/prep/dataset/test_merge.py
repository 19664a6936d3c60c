"""``--num-shards/--shard-index`` plus ``xprep merge``: shards merged equal one run, byte for byte."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SHARED, requires_shared_data
from prepkit import (
    assert_same_files,
    chat_records,
    read_jsonl,
    read_small_batches,
    text_records,
    tokenize,
    validate,
    write_jsonl,
)
from xprep import cli
from xprep.prep.dataset.merge import merge_datasets
from xprep.prep.dataset.token_dataset import TokenDataset


def invoke(*args):
    result = CliRunner().invoke(cli.xprep, [str(a) for a in args])
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    assert escaped is None, repr(escaped)
    return result.exit_code, result.stdout, result.stderr


def mixed_inputs(d, n: int = 60) -> list:
    """Text and chat records (some with categories, some bad), a .txt file, a .gz file, pre-tokenized records."""
    d.mkdir(parents=True, exist_ok=True)
    recs = []
    for i, (t, c) in enumerate(zip(text_records(n), chat_records(n), strict=True)):
        recs.append({**t, "category": "prose"} if i % 5 == 0 else t)
        recs.append({**c, "category": "dialog"} if i % 3 == 1 else c)
        if i % 9 == 4:
            recs.append({"text": ""})  # rejected under --on-error skip
    a = write_jsonl(d / "a.jsonl", recs)
    (d / "b.txt").write_text("A plain text file is one document.\n" * 5)
    (d / "c.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(r) + "\n" for r in text_records(8)).encode()))
    tokens = {"input_ids": [3, 4, 5, 6], "loss_mask": [0, 1, 1, 1], "category_ids": [0, 5, 5, 5]}
    e = write_jsonl(d / "e.jsonl", [tokens, *chat_records(10)])
    return [a, d / "b.txt", d / "c.jsonl.gz", e]


def shard_and_merge(inputs, tmp_path, tokenizer, num_shards, **options):
    parts = []
    for i in range(num_shards):
        m = tokenize(inputs, tmp_path / f"shard{i}", tokenizer, num_shards=num_shards, shard_index=i, **options)
        assert m["shard"] == {"index": i, "count": num_shards}
        validate(m, "dataset")
        parts.append(tmp_path / f"shard{i}")
    return parts, merge_datasets([str(p) for p in parts], str(tmp_path / "merged"))


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_shards_then_merge_equal_a_single_run(tmp_path, tiny_tokenizer, monkeypatch, num_shards):
    read_small_batches(monkeypatch, 16)
    inputs = mixed_inputs(tmp_path / "in")
    single = tokenize(inputs, tmp_path / "single", tiny_tokenizer, on_error="skip")
    assert single["rejects"]["count"] > 0 and "category_ids" in single["streams"]
    parts, merged = shard_and_merge(inputs, tmp_path, tiny_tokenizer, num_shards, on_error="skip")
    assert sum(len(TokenDataset(p)) for p in parts) == single["counts"]["documents"]
    assert merged["fingerprint"] == single["fingerprint"]
    assert_same_files(tmp_path / "merged", tmp_path / "single")
    validate(merged, "dataset")
    tops = [TokenDataset(p).manifest["counts"]["max_token_id"] for p in parts]  # each shard's, the merge the largest
    assert tops == [int(TokenDataset(p).tokens.items.max()) for p in parts]
    assert merged["counts"]["max_token_id"] == max(tops) == int(TokenDataset(tmp_path / "single").tokens.items.max())


def test_more_shards_than_files_leaves_empty_shards_that_merge(tmp_path, tiny_tokenizer):
    d = tmp_path / "in"
    d.mkdir()
    (d / "one.txt").write_text("just one document")
    tokenize([d], tmp_path / "single", tiny_tokenizer)
    parts, merged = shard_and_merge([d], tmp_path, tiny_tokenizer, 3)
    assert sorted(len(TokenDataset(p)) for p in parts) == [0, 0, 1]
    assert_same_files(tmp_path / "merged", tmp_path / "single")


@requires_shared_data
def test_three_shards_and_merge_through_the_cli_on_real_text_and_chat(tmp_path, run_cli):
    """Point 4 on real data: sotu addresses plus chitchat conversations (Qwen3 template), 3 shards, merged."""
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(lines) + "\n", encoding="utf-8")
    inputs = [*sorted((SHARED / "corpora/sotu").glob("*.txt"))[::20], chat]
    common = ["--tokenizer", SHARED / "tokenizers/qwen3", "--on-error", "skip", "--workers", "1"]
    code, _, err = run_cli("tokenize", *inputs, "-o", tmp_path / "single", *common)
    assert code == 0, err
    for i in range(3):
        code, _, err = run_cli("tokenize", *inputs, "-o", tmp_path / f"s{i}", *common, "--num-shards", 3,
                               "--shard-index", i)
        assert code == 0, err
    code, out, err = run_cli("merge", *(tmp_path / f"s{i}" for i in range(3)), "-o", tmp_path / "merged")
    assert code == 0, err
    assert out.startswith(f"merged 3 datasets into {tmp_path / 'merged'}")
    assert all(len(TokenDataset(tmp_path / f"s{i}")) > 0 for i in range(3))
    assert_same_files(tmp_path / "merged", tmp_path / "single")


def test_category_ids_follow_first_use_whatever_the_batch_holds(tmp_path, tiny_tokenizer):
    """A text record with a category followed by a chat record with another, split between two shards.

    The single run and the merge must assign the same ids (first use in input order)."""
    recs = [{"text": "some prose " * 20, "category": "prose"},
            {**chat_records(1)[0], "category": "dialog"}]
    src = write_jsonl(tmp_path / "a.jsonl", recs)
    single = tokenize(src, tmp_path / "single", tiny_tokenizer)
    assert single["categories"] == ["uncategorized", "prose", "dialog"], "ids in order of first use"
    shard_and_merge([src], tmp_path, tiny_tokenizer, 2)
    assert_same_files(tmp_path / "merged", tmp_path / "single")


def test_merge_keeps_order_and_remaps_categories(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha", "category": "x"}, {"text": "beta", "category": "y"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "gamma", "category": "z"}, {"text": "delta", "category": "x"},
                                           {"input_ids": [7, 8], "category_ids": [9, 9]}])
    ma = tokenize(a, tmp_path / "A", tiny_tokenizer)
    mb = tokenize(b, tmp_path / "B", tiny_tokenizer)
    assert ma["categories"] == ["uncategorized", "x", "y"]
    assert mb["categories"][:3] == ["uncategorized", "z", "x"] and mb["categories"][9] == "9"
    merged = merge_datasets([str(tmp_path / "B"), str(tmp_path / "A")], str(tmp_path / "BA"))
    names = merged["categories"]
    assert names[:3] == ["uncategorized", "z", "x"] and names[9] == "9" and "y" in names
    ds = TokenDataset(tmp_path / "BA")
    got = [(ds.tokens[i].tolist(), {names[c] for c in ds.category_ids[i].tolist()}) for i in range(len(ds))]
    A, B = TokenDataset(tmp_path / "A"), TokenDataset(tmp_path / "B")
    want = [(B.tokens[i].tolist(), {mb["categories"][c] for c in B.category_ids[i].tolist()}) for i in range(3)]
    want += [(A.tokens[i].tolist(), {ma["categories"][c] for c in A.category_ids[i].tolist()}) for i in range(2)]
    assert got == want
    assert merged["counts"]["documents"] == 5
    assert merged["counts"]["categories"]["x"]["tokens"] == (
        ma["counts"]["categories"]["x"]["tokens"] + mb["counts"]["categories"]["x"]["tokens"])
    assert [s["path"] for s in merged["sources"]] == [str(b), str(a)]
    assert "shard" not in merged
    validate(merged, "dataset")


def test_merge_concatenates_rejects(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"text": ""}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": 3}, {"text": "y"}])
    tokenize(a, tmp_path / "A", tiny_tokenizer, on_error="skip")
    tokenize(b, tmp_path / "B", tiny_tokenizer, on_error="skip")
    m = merge_datasets([str(tmp_path / "A"), str(tmp_path / "B")], str(tmp_path / "M"))
    assert m["rejects"]["count"] == 2
    rejects = read_jsonl(tmp_path / "M" / "rejects.jsonl")
    assert [(r["source"], r["line"]) for r in rejects] == [(str(a), 2), (str(b), 1)]


def test_merge_mixes_streams(tmp_path, tiny_tokenizer):
    """A text-only dataset (no mask stream) merged with a chat one: defaults are filled in for the text part."""
    tokenize(write_jsonl(tmp_path / "t.jsonl", text_records(3)), tmp_path / "T", tiny_tokenizer)
    tokenize(write_jsonl(tmp_path / "c.jsonl", chat_records(3)), tmp_path / "C", tiny_tokenizer)
    merge_datasets([str(tmp_path / "T"), str(tmp_path / "C")], str(tmp_path / "M"))
    m, t, c = (TokenDataset(tmp_path / n) for n in "MTC")
    assert m.loss_mask is not None and t.loss_mask is None
    for i in range(3):
        assert np.array_equal(m.document(i)["loss_mask"], t.document(i)["loss_mask"])
        assert np.array_equal(m.document(3 + i)["loss_mask"], c.document(i)["loss_mask"])
        assert np.array_equal(m.document(3 + i)["input_ids"], c.document(i)["input_ids"])


def test_merge_refuses_different_tokenizers_or_options(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    tokenize(src, tmp_path / "A", tiny_tokenizer)
    tokenize(src, tmp_path / "B", tiny_tokenizer, append_eod=False)
    code, _, err = invoke("merge", tmp_path / "A", tmp_path / "B", "-o", tmp_path / "M")
    assert code == 2 and "its options differs" in err and str(tmp_path / "B") in err, err
    assert not (tmp_path / "M").exists()


def test_merge_of_something_else_is_a_user_error(tmp_path, tiny_tokenizer):
    tokenize(write_jsonl(tmp_path / "a.jsonl", text_records(3)), tmp_path / "A", tiny_tokenizer)
    (tmp_path / "junk").mkdir()
    code, _, err = invoke("merge", tmp_path / "A", tmp_path / "junk", "-o", tmp_path / "M")
    assert code == 2 and "not a token dataset" in err
    code, _, err = invoke("merge", tmp_path / "A", "-o", tmp_path / "A")
    assert code == 2 and "already exists" in err
