"""A sharded dataset at a URL (moto's S3 server on 127.0.0.1): each shard an ordinary dataset at a URL relative to the
manifest, read in place by ``xprep pack`` (a blend's too), ``xprep inspect`` (of the pack) and ``xtrain run`` as its
local merged copy is read from disk: the same bins, the same report, the same losses."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from motokit import Endpoint, use_endpoint
from trainkit import make_dataset, random_docs
from xprep.cli import xprep, xtrain
from xprep.prep.dataset import upload_dataset, write_sharded
from xprep.prep.pack import open_entry
from xprep.prep.pack.entry import ARRAYS, TARGETS, open_packed

s3fs = pytest.importorskip("s3fs")
PACK = ["--method", "multipack", "--seq-len", "32", "--overlong", "truncate"]  # (truncated tails: inspect reads them)
RUN = ["--steps", "3", "--micro-batch-size", "2", "--sampler", "random", "--save-every", "100"]


def sharded_dataset(root) -> tuple:
    """Three shards (loss masks; categories numbered differently in each) under ``root/sharded``, and the same
    documents as one dataset ``root/merged`` (categories numbered in order of first use, as ``xprep merge`` does)."""
    names, table = [["a", "b"], ["b", "c"], ["c"]], ["a", "b", "c"]
    every: dict[str, list] = {"docs": [], "loss_masks": [], "cats": []}
    for k, categories in enumerate(names):
        rng = np.random.default_rng(k)
        docs = random_docs(15, 4, 40, vocab=128, seed=k)
        masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs]
        cats = [np.full(len(d), rng.integers(0, len(categories) + 1)) for d in docs]
        make_dataset(root / "sharded" / f"shard-{k}", docs, vocab_size=128, loss_masks=masks, cats=cats,
                     categories=categories)
        merged_id = np.array([0, *(table.index(n) + 1 for n in categories)])
        for key, value in (("docs", docs), ("loss_masks", masks), ("cats", [merged_id[c] for c in cats])):
            every[key] += value
    write_sharded([root / "sharded" / f"shard-{k}" for k in range(3)], root / "sharded")
    make_dataset(root / "merged", every["docs"], vocab_size=128, loss_masks=every["loss_masks"], cats=every["cats"],
                 categories=table)
    return root / "sharded", root / "merged"


@pytest.fixture
def endpoint(tmp_path, monkeypatch):
    server = Endpoint(tmp_path).start()
    use_endpoint(monkeypatch, server)
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    s3fs.S3FileSystem().mkdir("shards")
    yield server
    server.kill()


def _invoke(command, *args) -> str:
    result = CliRunner().invoke(command, [*map(str, args)])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_a_sharded_dataset_at_a_url_reads_as_its_merged_copy(endpoint, tmp_path):
    sharded, merged = sharded_dataset(tmp_path)
    upload_dataset(sharded, "s3://shards/sh")
    assert s3fs.S3FileSystem().cat_file("shards/sh/shard-1/COMPLETE")  # each shard an ordinary dataset there
    _invoke(xprep, "pack", "s3://shards/sh", "-o", tmp_path / "Purl", *PACK)
    _invoke(xprep, "pack", merged, "-o", tmp_path / "Pmerged", *PACK)
    there, here = open_packed(tmp_path / "Purl"), open_packed(tmp_path / "Pmerged")
    assert there.meta["datasets"][0]["path"] == "s3://shards/sh"
    for name in (*ARRAYS, TARGETS):
        assert np.array_equal(getattr(there, name), getattr(here, name)), name
    assert there.meta["stats"]["truncated_tokens"]  # (the report below counts the categories of removed tokens)
    reports = [json.loads(_invoke(xprep, "inspect", tmp_path / p, "--json")) for p in ("Purl", "Pmerged")]
    assert reports[0]["categories"] == reports[1]["categories"] and reports[0]["categories_note"] is None
    assert len(reports[0]["categories"]) == 4
    for p in ("Purl", "Pmerged"):
        _invoke(xtrain, "run", tmp_path / p, *RUN, "--output", tmp_path / f"run-{p}")
    assert _losses(tmp_path / "run-Purl") == _losses(tmp_path / "run-Pmerged")


def test_a_blend_reads_a_sharded_dataset_at_a_url_in_place(endpoint, tmp_path):
    sharded, merged = sharded_dataset(tmp_path)
    upload_dataset(sharded, "s3://shards/sh")
    _invoke(xprep, "pack", "s3://shards/sh@1", "-o", tmp_path / "Purl", *PACK, "--cache-dir", tmp_path / "fetched")
    _invoke(xprep, "pack", f"{merged}@1", "-o", tmp_path / "Pmerged", *PACK)
    there, here = open_entry(tmp_path / "Purl"), open_entry(tmp_path / "Pmerged")
    assert [d["path"] for d in there.sources[0].meta["datasets"]] == ["s3://shards/sh"]  # listed by URL
    assert np.array_equal(there.bin_index, here.bin_index)
    for name in (*ARRAYS, TARGETS):
        assert np.array_equal(getattr(there.sources[0], name), getattr(here.sources[0], name)), name
    fetched = tmp_path / "fetched" / "datasets"
    assert sorted(p.name for p in fetched.glob("*/*.index")) == ["shard-0.index", "shard-1.index", "shard-2.index"]
    assert not list(fetched.rglob("*.bin"))  # each shard's manifest and indexes, no stream copied
