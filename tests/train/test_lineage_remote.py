"""``xprep inspect RUN --seen`` of a run whose pack lists a dataset at a URL (fsspec's in-memory file system here):
the lineage is the one of the same run on local disk, and the category ids it reads are those of the tokens trained
on, fetched by range in bounded chunks, never the whole category stream."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from click.testing import CliRunner
from motokit import count_memory_reads
from trainkit import make_dataset, random_docs
from xprep.cli import xprep
from xprep.prep.dataset import StreamedDataset, upload_dataset
from xprep.prep.dataset import chunks as chunks_module
from xprep.prep.pack import open_entry
from xprep.train import lineage

PACK = ["--method", "multipack", "--seq-len", "32", "--overlong", "split"]


def _run(root, packed, consumed: int) -> None:
    """A run directory as xtrain writes it, as far as the lineage reads it: random sampler, seed 3, batches of 4."""
    entry = open_entry(packed)
    root.mkdir()
    (root / "run.json").write_text(json.dumps({"pack": {"path": str(entry.path), "key": entry.key},
                                               "plan": {"global_batch_size": 4}}))
    (root / "config.json").write_text(json.dumps({"data": {"sampler": "random"}, "seed": 3}))
    (root / "metrics.jsonl").write_text(json.dumps({"step": consumed // 4, "consumed_samples": consumed}) + "\n")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """The same run over a pack of 60 documents in four categories, once at a URL and once on local disk."""
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    docs = random_docs(60, 4, 50, vocab=128, seed=0)
    cats = [rng.integers(0, 4, len(d)) for d in docs]  # several categories inside a document
    make_dataset(tmp_path / "ds", docs, vocab_size=128, cats=cats, categories=["a", "b", "c"])
    url = f"memory://xprep-tests/{uuid.uuid4().hex}/ds"
    upload_dataset(tmp_path / "ds", url)
    for source, name in ((url, "url"), (tmp_path / "ds", "local")):
        result = CliRunner().invoke(xprep, ["pack", str(source), "-o", str(tmp_path / f"P{name}"), *PACK])
        assert result.exit_code == 0, (result.output, result.exception)
        _run(tmp_path / name, tmp_path / f"P{name}", 24)
    return tmp_path, url


@pytest.mark.parametrize("chunk", [1 << 20, 16])  # one fetch, or many chunks of a few ranges
def test_seen_of_a_url_dataset_reads_only_the_tokens_trained_on(runs, monkeypatch, chunk):
    root, url = runs
    fetched = count_memory_reads(monkeypatch, "category_ids.bin")
    monkeypatch.setattr(lineage, "CATEGORY_CHUNK", chunk)
    chunks = []
    read = chunks_module.read_item_ranges
    monkeypatch.setattr(chunks_module, "read_item_ranges", lambda *a: chunks.append(a) or read(*a))
    there, here = lineage.seen_report(root / "url"), lineage.seen_report(root / "local")
    assert there["tokens"] == here["tokens"] > 0 and there["categories"] == here["categories"]
    assert there["sources"] == here["sources"]
    assert [{**d, "dataset": None} for d in there["documents"]] == [{**d, "dataset": None} for d in here["documents"]]
    assert len({tuple(d["categories"]) for d in here["documents"]}) > 1  # the per-document sets are tested
    # one byte an id; neighbours a small gap apart fetched as one request (at most 10 % more)
    assert there["tokens"] <= sum(fetched) <= 1.1 * there["tokens"] < StreamedDataset(url).category_ids.nbytes
    assert (len(chunks) > 1) == (chunk == 16)
