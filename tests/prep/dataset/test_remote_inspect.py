"""``xprep inspect`` of a pack whose dataset is at a URL (fsspec's in-memory file system here) fetches only what its
report needs of the streams: the category ids of the tokens the pack removed, by range (``read_item_ranges``), not
the whole category stream; the report is the one of the same pack on local disk."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from click.testing import CliRunner
from motokit import count_memory_reads
from trainkit import make_dataset, random_docs
from xprep.cli import xprep
from xprep.prep.dataset import StreamedDataset, read_item_ranges, upload_dataset

PACK = ["--method", "multipack", "--seq-len", "24", "--overlong", "truncate"]


@pytest.fixture
def url(tmp_path) -> str:
    """40 documents of 4-39 tokens in three categories, at a fresh in-memory URL (and at tmp_path/ds)."""
    rng = np.random.default_rng(0)
    docs = random_docs(40, 4, 40, vocab=128, seed=0)
    make_dataset(tmp_path / "ds", docs, vocab_size=128, cats=[np.full(len(d), rng.integers(0, 4)) for d in docs],
                 categories=["a", "b", "c"])
    target = f"memory://xprep-tests/{uuid.uuid4().hex}/ds"
    upload_dataset(tmp_path / "ds", target)
    return target


def _inspect(path) -> dict:
    result = CliRunner().invoke(xprep, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_inspect_reads_only_the_removed_tokens_of_a_url_dataset(tmp_path, url, monkeypatch):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    for source, out in ((url, "Purl"), (tmp_path / "ds", "Plocal")):
        result = CliRunner().invoke(xprep, ["pack", str(source), "-o", str(tmp_path / out), *PACK])
        assert result.exit_code == 0, (result.output, result.exception)
    fetched = count_memory_reads(monkeypatch, "category_ids.bin")
    there, here = _inspect(tmp_path / "Purl"), _inspect(tmp_path / "Plocal")
    assert there["categories"] == here["categories"] and there["categories_note"] is None
    removed = there["overlong"]["truncated_tokens"]
    assert removed and sum(fetched) == removed  # one byte a category id: the removed tokens', nothing else
    assert sum(fetched) < StreamedDataset(url).category_ids.nbytes


def test_read_item_ranges_equals_slicing_the_whole_stream(url):
    stream = StreamedDataset(url).tokens
    whole = stream.items
    rng = np.random.default_rng(1)
    lo = np.sort(rng.integers(0, len(whole), 30))
    hi = np.minimum(lo + rng.integers(0, 30, 30), len(whole))
    batches = list(read_item_ranges(stream.url, stream.dtype, lo, hi, batch_bytes=16))
    assert max(b.nbytes for b in batches) <= 32 and len(batches) > 1  # bounded: at most twice the batch size
    expected = np.concatenate([whole[a:b] for a, b in zip(lo, hi, strict=True)])
    assert np.array_equal(np.concatenate(batches), expected)
