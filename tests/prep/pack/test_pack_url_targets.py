"""``xprep pack`` of a dataset at a URL counts each bin's targets from the loss mask (and, with --eod-mask-loss,
the tokens) fetched a bounded chunk at a time, never the whole stream in memory: the entry is the local dataset's,
byte for byte, for every rule of counting targets (plain items, chunk samples with their lookahead, --attention
causal, --eod-mask-loss)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from motokit import count_memory_reads
from trainkit import make_dataset, random_docs
from xprep.prep.dataset import StreamedDataset, upload_dataset
from xprep.prep.dataset import chunks as chunks_module
from xprep.prep.pack.cache import PackConfig, pack

CHUNK = 97  # items a chunk: the 60 documents' masks come in many chunks


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, str]:
    """60 documents with loss masks (a prompt, then targets) and EOD tokens inside, local and at a memory:// URL."""
    root = tmp_path_factory.mktemp("url-targets")
    rng = np.random.default_rng(3)
    docs = random_docs(60, 3, 90, vocab=64, seed=3)
    for d in docs:
        d[rng.random(len(d)) < 0.1] = 1  # the EOD id the manifest records
    masks = [(np.arange(len(d)) >= rng.integers(0, len(d))).astype(np.uint8) for d in docs]
    make_dataset(root / "ds", docs, vocab_size=64, loss_masks=masks)
    url = f"memory://xprep-tests/{uuid.uuid4().hex}/ds"
    upload_dataset(root / "ds", url)
    return str(root / "ds"), url


@pytest.mark.parametrize("config", [
    PackConfig(method="multipack", seq_len=48, overlong="split"),
    PackConfig(method="chunk", seq_len=48),
    PackConfig(method="chunk", seq_len=48, attention="causal"),
    PackConfig(method="chunk", seq_len=48, eod_mask_loss=True),
], ids=["items", "chunk", "causal", "eod-mask-loss"])
def test_targets_counted_a_chunk_at_a_time_equal_the_local_ones(dataset, tmp_path, monkeypatch, config):
    local, url = dataset
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(chunks_module, "CHUNK_ITEMS", CHUNK)
    masks, tokens = count_memory_reads(monkeypatch, "loss_mask.bin"), count_memory_reads(monkeypatch, "tokens.bin")
    there = pack([url], tmp_path / "there", config).entry
    here = pack([local], tmp_path / "here", config).entry
    assert there.path.name == here.path.name  # the same cache key
    assert {f.name: f.read_bytes() for f in there.path.glob("*.npy")} == \
        {f.name: f.read_bytes() for f in here.path.glob("*.npy")}
    assert int(here.bin_targets.sum()) > 0
    stream = StreamedDataset(url)
    assert len(masks) > 1 and max(masks) <= 2 * CHUNK  # many chunks, none holding much more than CHUNK items
    assert sum(masks) <= 1.1 * stream.loss_mask.nbytes  # about once each (the items' next tokens overlap)
    assert bool(tokens) == config.eod_mask_loss  # the tokens only for the EOD rule
