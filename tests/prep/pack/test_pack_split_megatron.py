"""``xprep pack --split TRAIN,VALID,TEST``: Megatron-LM's split string, three disjoint parts of real data with
Megatron's document counts, each its own entry, shown by ``xprep inspect``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import requires_shared_data
from prepkit import one_line_error, validate
from prepkit import xprep_invoke as run
from trainkit import make_dataset, random_docs
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.pack.config import parse_split
from xprep.prep.pack.entry import PackEntry

N_CONVERSATIONS = 300


def megatron_counts(split: list[float], n: int) -> list[int]:
    """A restatement of megatron.core.datasets.blended_megatron_dataset_builder's get_split_indices (after
    parse_and_normalize_split): the documents of each part."""
    total = sum(split)
    bounds = [0]
    for share in (s / total for s in split):
        bounds.append(bounds[-1] + int(round(share * float(n))))
    bounds[1:] = [b - (bounds[-1] - n) for b in bounds[1:]]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.fixture(scope="module")
def chat(tmp_path_factory, shared_data):
    """The first conversations of the real chat corpus, tokenized with Qwen3."""
    root = tmp_path_factory.mktemp("split3")
    source = root / "chat.jsonl"
    with open(shared_data / "chat" / "chitchat.jsonl", encoding="utf-8") as f:
        source.write_text("".join(next(f) for _ in range(N_CONVERSATIONS)), encoding="utf-8")
    result = run("tokenize", source, "-o", root / "ds", "--tokenizer", shared_data / "tokenizers" / "qwen3")
    assert result.exit_code == 0, result.output
    return root / "ds"


def docs_of(entry: PackEntry) -> set[int]:
    return set(np.asarray(entry.item_doc).tolist())


@requires_shared_data
def test_three_parts_of_real_data_are_disjoint_and_add_up(tmp_path, chat):
    result = run("pack", chat, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 4096,
                 "--split", "90,5,5")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    train, valid, test = (PackEntry.open(tmp_path / "P" / manifest[k]) for k in ("current", "validation", "test"))
    assert len({train.path, valid.path, test.path}) == 3 and set(manifest["entries"]) == {
        e.path.name for e in (train, valid, test)}
    assert manifest["entries"][train.path.name]["test"] == test.path.name
    parts = [docs_of(e) for e in (train, valid, test)]
    assert not parts[0] & parts[1] and not parts[0] & parts[2] and not parts[1] & parts[2]
    n = len(TokenDataset(chat))
    assert sorted(parts[0] | parts[1] | parts[2]) == list(range(n)) and n > 100
    assert [e.meta["split"]["documents"] for e in (train, valid, test)] == megatron_counts([90, 5, 5], n)
    assert [e.meta["split"]["part"] for e in (train, valid, test)] == ["train", "validation", "test"]
    for entry in (train, valid, test):
        validate(entry.meta, "pack")
        assert entry.meta["split"]["entries"] == {"train": train.path.name, "validation": valid.path.name,
                                                  "test": test.path.name}
    assert f"test (--split): {test.meta['split']['documents']:,} documents held out" in result.stdout
    again = run("pack", chat, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 4096,
                "--split", "90,5,5")
    assert again.stdout.startswith("cache hit:")
    text = run("inspect", tmp_path / "P").output
    assert "t = its --split test entry" in text and "--split 90,5,5" in text
    assert any(line.lstrip().startswith("t ") and test.path.name in line for line in text.splitlines())
    html = tmp_path / "P.html"
    assert run("inspect", tmp_path / "P", "--html", html).exit_code == 0
    assert "t its test entry" in html.read_text()


def test_megatron_strings_cut_megatron_counts(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(1003, 2, 9, vocab=128, seed=5), vocab_size=128)
    for text, shares in (("969,30,1", [969, 30, 1]), ("0.9,0.05,0.05", [0.9, 0.05, 0.05]),
                         ("98, 2, 0", [98, 2, 0]), ("90,0,10", [90, 0, 10])):
        out = tmp_path / text.replace(",", "-").replace(" ", "")
        result = run("pack", tmp_path / "ds", "-o", out, "--method", "multipack", "--seq-len", 64, "--split", text)
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        want = megatron_counts(shares, 1003)
        for key, n in zip(("current", "validation", "test"), want, strict=True):
            assert (key in manifest) == bool(n), (text, key)
            if n:
                assert PackEntry.open(out / manifest[key]).meta["split"]["documents"] == n, (text, key)


def test_split_strings_parse():
    assert parse_split("90,5,5") == (90, 5, 5) and parse_split("969,30,1") == (969, 30, 1)
    assert parse_split("99,1") == (99, 1) and all(isinstance(s, int) for s in parse_split("99,1"))
    assert parse_split("0.9,0.05,0.05") == (0.9, 0.05, 0.05)
    assert parse_split("100,0,0") is None  # nothing held out: the plain pack, with its key


def test_no_share_held_out_is_the_plain_pack(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(40, 2, 9, vocab=128, seed=6), vocab_size=128)
    base = ("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64)
    assert run(*base).exit_code == 0
    again = run(*base, "--split", "100,0,0")
    assert again.stdout.startswith("cache hit:"), again.output
    assert set(json.loads((tmp_path / "P" / "manifest.json").read_text())) == {"format", "current", "entries"}


@pytest.mark.parametrize("text", ["90,5,5,1", "-90,5,5", "90,5,-5", "0,0,0", "0,5,5", "90,x,5"])
def test_bad_split_strings_are_one_line(tmp_path, text):
    make_dataset(tmp_path / "ds", random_docs(20, 2, 9, vocab=128), vocab_size=128)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential",
                              "--seq-len", 16, "--split", text))
    assert f"--split {text}" in line and "e.g." in line
    assert not (tmp_path / "P").exists()


def test_a_test_share_that_rounds_to_nothing_is_one_line(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(20, 2, 9, vocab=128), vocab_size=128)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential",
                              "--seq-len", 16, "--split", "969,30,1"))
    assert "--split 969,30,1: its test share rounds to 0 documents" in line
    assert not (tmp_path / "P").exists()


def test_a_blend_splits_every_source_three_ways(tmp_path):
    make_dataset(tmp_path / "a", random_docs(200, 2, 30, vocab=128, seed=1), vocab_size=128)
    make_dataset(tmp_path / "b", random_docs(100, 2, 30, vocab=128, seed=2), vocab_size=128)
    result = run("pack", f"{tmp_path / 'a'}@0.5", f"{tmp_path / 'b'}@0.5", "-o", tmp_path / "P", "--method",
                 "multipack", "--seq-len", 64, "--split", "80,10,10")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    blends = {k: json.loads((tmp_path / "P" / manifest[k] / "blend.json").read_text()) for k in ("validation", "test")}
    assert [s["documents"] for s in blends["validation"]["sources"]] == [20, 10]
    assert [s["documents"] for s in blends["test"]["sources"]] == [20, 10]
    assert "test (--split): 30 documents held out" in result.stdout
