"""prep/dataset/remote.py: a dataset at a URL (fsspec's in-memory file system here) synced into the cache directory
that the one cache setting names: ``--cache-dir``, else ``$XPREP_CACHE_DIR``, else the older ``$XPREP_CACHE``."""

from __future__ import annotations

import uuid

import pytest
from prepkit import random_dataset
from xprep.prep.dataset import TokenDataset, sync_dataset, synced_from, upload_dataset


@pytest.fixture
def url(tmp_path):
    """A small dataset uploaded to a fresh in-memory URL."""
    local = random_dataset(tmp_path / "ds", 12, seed=0)
    target = f"memory://xprep-tests/{uuid.uuid4().hex}/ds"
    upload_dataset(local, target)
    return target


def _cache_of(copy, url) -> str:
    """The cache directory a synced copy lies in (CACHE/datasets/FINGERPRINT/NAME)."""
    assert copy.name == "ds" and synced_from(copy) == url
    return str(copy.parents[2])


@pytest.mark.parametrize("env, where", [
    ({"XPREP_CACHE_DIR": "new"}, "new"),
    ({"XPREP_CACHE": "old"}, "old"),  # a machine set up before XPREP_CACHE_DIR named every cache
    ({"XPREP_CACHE_DIR": "new", "XPREP_CACHE": "old"}, "new"),
])
def test_the_sync_cache_is_the_one_cache_setting(tmp_path, url, monkeypatch, env, where):
    for name in ("XPREP_CACHE_DIR", "XPREP_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    copy = sync_dataset(url)
    assert _cache_of(copy, url) == str(tmp_path / where)
    assert len(TokenDataset(copy)) == 12
    explicit = sync_dataset(url, str(tmp_path / "flag"))  # --cache-dir wins over both
    assert _cache_of(explicit, url) == str(tmp_path / "flag")
