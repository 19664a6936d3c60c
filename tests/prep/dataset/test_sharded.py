"""Sharded datasets: a manifest over shard datasets reads as one dataset, the merged copy's twin."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SHARED, requires_shared_data
from prepkit import assert_same_files, read_small_batches, tokenize, validate
from test_merge import invoke, mixed_inputs
from xprep.prep.dataset import ShardedDataset, TokenDataset, merge_datasets, write_sharded
from xprep.prep.errors import XprepError
from xprep.prep.inspect.dataset_report import dataset_report
from xprep.prep.inspect.options import InspectOptions
from xprep.prep.pack import PackConfig, pack
from xprep.prep.pack.entry import ARRAYS, TARGETS, open_packed
from xprep.train.data import PackedDataset
from xprep.train.lineage import seen_report


def pack_of(dataset, out, **options):
    return pack([dataset], out, PackConfig(**{"method": "multipack", "seq_len": 256, **options})).entry


def assert_twins(sharded, merged, tmp_path, **options):
    """``sharded`` and ``merged`` pack into the same arrays, batches, lineage names and inspect report."""
    a, b = pack_of(sharded, tmp_path / "Psharded", **options), pack_of(merged, tmp_path / "Pmerged", **options)
    for name in (*ARRAYS, TARGETS):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.meta["stats"] == b.meta["stats"]
    assert a.key != b.key  # the merged copy's fingerprint covers its .bin's sha256 (prep/dataset/sharded.py)
    da, db = PackedDataset(tmp_path / "Psharded"), PackedDataset(tmp_path / "Pmerged")
    assert da.category_names == db.category_names and len(da) == len(db)
    for i in range(len(da)):
        x, y = da[i], db[i]
        assert all(torch.equal(x[k], y[k]) for k in x), i
    seen = [_seen(tmp_path / f"P{kind}", tmp_path / f"run-{kind}") for kind in ("sharded", "merged")]
    names = [[(d["document"], d["tokens"], d["categories"]) for d in s["documents"]] for s in seen]
    assert names[0] == names[1] and names[0]
    assert {d["dataset"] for d in seen[0]["documents"]} == {str(sharded.resolve())}
    assert any("shard" in d for d in seen[0]["documents"]) and not any("shard" in d for d in seen[1]["documents"])
    assert seen[0]["categories"] == seen[1]["categories"]
    reports = [dataset_report(p, InspectOptions(sample=4, seed=1)) for p in (sharded, merged)]
    for r in reports:
        for k in ("kind", "path", "fingerprint", "tokenizer", "streams", "source_files", "shards", "rejects"):
            r.pop(k, None)
    assert reports[0] == reports[1]


def _seen(packed, run) -> dict:
    """The lineage of a run of 2 steps of 3 bins on ``packed`` (its run files written here: no training needed)."""
    entry = open_packed(packed)
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"pack": {"path": str(packed), "key": entry.key},
                                              "plan": {"global_batch_size": 3}}))
    (run / "config.json").write_text(json.dumps({"sampler": "random", "seed": 4}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    return seen_report(run, 2)


def test_a_sharded_dataset_and_its_merged_copy_are_twins(tmp_path, tiny_tokenizer, monkeypatch):
    """Three shards whose category tables number differently (first use differs per shard), a numeric category."""
    read_small_batches(monkeypatch, 16)
    inputs = mixed_inputs(tmp_path / "in")
    shards = [tokenize(inputs, tmp_path / f"s{i}", tiny_tokenizer, num_shards=3, shard_index=i, on_error="skip")
              for i in range(3)]
    assert len({tuple(m["categories"]) for m in shards}) > 1
    manifest = write_sharded([tmp_path / f"s{i}" for i in range(3)], tmp_path / "sharded")
    merged = merge_datasets([str(tmp_path / "sharded")], str(tmp_path / "merged"))  # xprep merge of the sharded one
    merge_datasets([str(tmp_path / f"s{i}") for i in range(3)], str(tmp_path / "merged-shards"))
    assert_same_files(tmp_path / "merged", tmp_path / "merged-shards")
    validate(manifest, "sharded_dataset")
    assert manifest["categories"] == merged["categories"]
    assert {k: v for k, v in manifest["counts"].items()} == {k: v for k, v in merged["counts"].items()}
    assert len(ShardedDataset(tmp_path / "sharded")) == len(TokenDataset(tmp_path / "merged"))
    assert_twins(tmp_path / "sharded", tmp_path / "merged", tmp_path, seq_len=64)


@requires_shared_data
def test_a_hand_made_sharded_dataset_of_real_data_packs_like_its_merged_copy(tmp_path):
    """sotu addresses and chitchat conversations (Qwen3), tokenized separately, listed by `xprep merge --sharded`."""
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:200]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(lines) + "\n", encoding="utf-8")
    parts = [sorted((SHARED / "corpora/sotu").glob("*.txt"))[::30], [chat], sorted((SHARED / "corpora/sotu").glob(
        "*.txt"))[5::40]]
    common = ["--tokenizer", SHARED / "tokenizers/qwen3", "--workers", "1"]
    for i, inputs in enumerate(parts):
        code, _, err = invoke("tokenize", *inputs, "-o", tmp_path / f"s{i}", *common)
        assert code == 0, err
    code, out, err = invoke("merge", "--sharded", *(tmp_path / f"s{i}" for i in range(3)), "-o", tmp_path / "sharded")
    assert code == 0, err
    assert out.startswith(f"listed 3 datasets into {tmp_path / 'sharded'}")
    code, _, err = invoke("merge", tmp_path / "sharded", "-o", tmp_path / "merged")
    assert code == 0, err
    assert not (tmp_path / "sharded" / "tokens.bin").exists()  # nothing copied
    validate(json.loads((tmp_path / "sharded" / "manifest.json").read_text()), "sharded_dataset")
    assert_twins(tmp_path / "sharded", tmp_path / "merged", tmp_path, seq_len=512, overlong="split")
    blends = []  # a blend source too: the sharded dataset blends as its merged copy does, bin for bin
    for kind in ("sharded", "merged"):
        code, _, err = invoke("pack", f"{tmp_path / kind}@0.7", f"{tmp_path / 's1'}@0.3", "-o", tmp_path / f"B{kind}",
                              "--method", "multipack", "--seq-len", "512", "--total-tokens", "20000")
        assert code == 0, err
        blends.append(PackedDataset(tmp_path / f"B{kind}"))
    assert len(blends[0]) == len(blends[1]) > 0
    for i in range(len(blends[0])):
        x, y = blends[0][i], blends[1][i]
        assert all(torch.equal(x[k], y[k]) for k in x), i


def test_a_changed_shard_is_refused(tmp_path, tiny_tokenizer):
    inputs = mixed_inputs(tmp_path / "in", 12)
    for i in range(2):
        tokenize(inputs, tmp_path / f"s{i}", tiny_tokenizer, num_shards=2, shard_index=i, on_error="skip")
    write_sharded([tmp_path / "s0", tmp_path / "s1"], tmp_path / "sharded")
    code, out, _ = invoke("inspect", tmp_path / "sharded", "--json")
    assert code == 0 and json.loads(out)["documents"] == sum(len(TokenDataset(tmp_path / f"s{i}")) for i in range(2))
    assert [s["path"] for s in json.loads(out)["shards"]] == ["../s0", "../s1"]
    code, out, _ = invoke("inspect", tmp_path / "sharded")
    assert code == 0 and "shards        2, read as one dataset" in out
    with pytest.raises(XprepError, match="is a sharded dataset"):
        TokenDataset(tmp_path / "sharded")
    manifest = json.loads((tmp_path / "s1" / "manifest.json").read_text())
    manifest["fingerprint"] = "0" * 64
    (tmp_path / "s1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(XprepError, match=r"shard #1 .* changed since the sharded manifest was written"):
        ShardedDataset(tmp_path / "sharded")
