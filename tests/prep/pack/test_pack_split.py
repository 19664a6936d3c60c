"""``xprep pack --split TRAIN,VALID``: disjoint parts, a rule that ignores how the data is packed, the share,
the manifest's "validation" key, ``xprep inspect`` and bad input."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from prepkit import one_line_error, schema, validate
from prepkit import xprep_invoke as run
from trainkit import make_dataset, random_docs
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.pack.cache import split_base, split_documents
from xprep.prep.pack.entry import PackEntry, open_packed
from xprep.prep.pack.shuffle import held_out

METHODS = {
    "sequential": ("--method", "sequential", "--seq-len", 64),
    "multipack": ("--method", "multipack", "--seq-len", 64),
    "token-aware": ("--method", "token-aware", "--max-tokens", 128, "--seed", 3),
    "chunk": ("--method", "chunk", "--seq-len", 32, "--shuffle", "--seed", 9, "--total-tokens", 5000),
}


@pytest.fixture
def two_datasets(tmp_path):
    make_dataset(tmp_path / "a", random_docs(150, 1, 40, vocab=128, seed=1), vocab_size=128)
    make_dataset(tmp_path / "b", random_docs(120, 1, 40, vocab=128, seed=2), vocab_size=128)
    return [tmp_path / "a", tmp_path / "b"]


def parts(packed) -> tuple[PackEntry, PackEntry, dict]:
    manifest = json.loads((packed / "manifest.json").read_text())
    return open_packed(packed), PackEntry.open(packed / manifest["validation"]), manifest


def docs_of(entry: PackEntry) -> set[int]:
    return set(np.asarray(entry.item_doc).tolist())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_parts_are_disjoint_and_cover_the_documents(tmp_path, two_datasets, method):
    result = run("pack", *two_datasets, "-o", tmp_path / "P", *METHODS[method], "--split", "80,20")
    assert result.exit_code == 0, result.output
    train, valid, manifest = parts(tmp_path / "P")
    assert f"validation (--split): {valid.meta['split']['documents']:,} documents held out" in result.stdout
    assert manifest["current"] == train.path.name and manifest["validation"] == valid.path.name
    assert set(manifest["entries"]) == {train.path.name, valid.path.name}
    assert docs_of(train).isdisjoint(docs_of(valid)) and docs_of(valid)
    held = np.flatnonzero(split_documents(train.meta["datasets"], (80, 20)))
    assert docs_of(valid) <= set(held.tolist()) and not docs_of(train) & set(held.tolist())
    if method != "chunk":  # every document kept once (chunk cuts the stream's tail or repeats it)
        learnable = {d for d, n in enumerate(np.concatenate([TokenDataset(p).lengths for p in two_datasets])) if n > 1}
        assert docs_of(train) | docs_of(valid) == learnable  # a one-token document has nothing to learn: dropped
    assert train.meta["split"]["part"] == "train" and valid.meta["split"]["part"] == "validation"
    assert train.meta["split"]["entries"] == valid.meta["split"]["entries"] == {
        "train": train.path.name, "validation": valid.path.name}
    assert valid.meta["stats"]["documents_in"] == len(held) == valid.meta["split"]["documents"]
    assert train.meta["stats"]["documents_in"] == 270 - len(held)
    for entry in (train, valid):
        validate(entry.meta, "pack")
    if method == "chunk":  # the validation part is one epoch of its documents, in the pack's shuffled order
        assert valid.meta["stats"]["epochs"] == 1 and valid.config["total_tokens"] is None
        assert train.meta["stats"]["epochs"] > 1


def test_validation_documents_do_not_depend_on_how_the_data_is_packed(tmp_path, two_datasets):
    seen = []
    for i, (method, options) in enumerate(sorted(METHODS.items())):
        for seed in (0, 11):
            out = tmp_path / f"P{i}-{seed}"
            result = run("pack", *two_datasets, "-o", out, *options, "--seed", seed, "--split", "90,10")
            assert result.exit_code == 0, (method, result.output)
            _, valid, _ = parts(out)
            seen.append(valid.meta["split"]["documents"])
            want = set(np.flatnonzero(split_documents(valid.meta["datasets"], (90, 10))).tolist())
            if method != "chunk":
                assert docs_of(valid) == want
            else:
                assert docs_of(valid) <= want
    assert len(set(seen)) == 1


def test_a_document_keeps_its_side_when_other_datasets_join(tmp_path, two_datasets):
    """The rule is per dataset content and index: packing ``b`` alone or after ``a`` holds out the same documents."""
    alone = split_documents([{"fingerprint": TokenDataset(two_datasets[1]).fingerprint, "documents": 120}], (3, 1))
    both = split_documents([{"fingerprint": TokenDataset(p).fingerprint, "documents": len(TokenDataset(p))}
                            for p in two_datasets], (3, 1))
    np.testing.assert_array_equal(both[150:], alone)


def test_share_is_close_to_valid_over_total_on_10k_documents(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(10_000, 1, 4, vocab=128, seed=4), vocab_size=128)
    result = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64,
                 "--split", "95,5")
    assert result.exit_code == 0, result.output
    _, valid, _ = parts(tmp_path / "P")
    n = valid.meta["split"]["documents"]
    assert abs(n - 500) < 4 * np.sqrt(10_000 * 0.05 * 0.95), n  # 4 σ of a binomial
    for share in (0.01, 0.3, 0.5):  # the kernel itself, on another base
        k = int(held_out(10_000, np.uint64(split_base("x" * 64)), share).sum())
        assert abs(k - 10_000 * share) < 4 * np.sqrt(10_000 * share * (1 - share)), (share, k)


def test_manifest_validation_key_follows_the_current_entry(tmp_path, two_datasets):
    base = ("pack", *two_datasets, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64)
    assert run(*base, "--split", "80,20").exit_code == 0
    _, valid, manifest = parts(tmp_path / "P")
    again = run(*base, "--split", "80,20")
    assert again.output.startswith("cache hit:")
    assert json.loads((tmp_path / "P" / "manifest.json").read_text()) == manifest
    assert run(*base).exit_code == 0  # no split: the current entry has no validation entry
    plain = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert "validation" not in plain and plain["current"] not in (manifest["current"], manifest["validation"])
    defs = schema("pack")["$defs"]
    manifest_schema = {**defs["manifest"], "$defs": defs}
    jsonschema.validate(manifest, manifest_schema)
    jsonschema.validate(plain, manifest_schema)


def test_inspect_marks_the_validation_entry(tmp_path, two_datasets):
    assert run("pack", *two_datasets, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64,
               "--split", "80,20").exit_code == 0
    report = json.loads(run("inspect", tmp_path / "P", "--json").output)
    rows = {e["name"]: e for e in report["entries"]}
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert rows[manifest["validation"]]["validation"] and rows[manifest["validation"]]["part"] == "validation"
    assert rows[manifest["current"]]["current"] and not rows[manifest["current"]]["validation"]
    assert "--split 80,20" in rows[manifest["current"]]["options"]
    text = run("inspect", tmp_path / "P").output
    assert "v = its --split validation entry" in text
    assert any(line.lstrip().startswith("v ") and manifest["validation"] in line for line in text.splitlines())


def test_empty_validation_is_one_line_and_publishes_nothing(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(3, 5, 10, vocab=128), vocab_size=128)
    fp = TokenDataset(tmp_path / "ds").fingerprint
    assert not split_documents([{"fingerprint": fp, "documents": 3}], (999, 1)).any()  # none drawn
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential",
                              "--seq-len", 16, "--split", "999,1"))
    assert "--split 999,1: no document was drawn for validation" in line
    assert not (tmp_path / "P").exists()
    allowed = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 16,
                  "--split", "999,1", "--allow-empty")
    assert allowed.exit_code == 0, allowed.output
    _, valid, _ = parts(tmp_path / "P")
    assert valid.num_bins == 0


@pytest.mark.parametrize("text", ["1", "a,b", "1,0", "0,0", "0,0,0", "90,5,5,1", "-1,2", "90,-5,5", "0,5,5", "nan,1"])
def test_malformed_split_is_one_line(tmp_path, text):
    make_dataset(tmp_path / "ds", random_docs(3, 5, 10, vocab=128), vocab_size=128)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential",
                              "--seq-len", 16, "--split", text))
    assert f"--split {text}" in line
    assert not (tmp_path / "P").exists()
