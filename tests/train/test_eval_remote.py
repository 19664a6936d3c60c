"""An evaluation set whose datasets are at a URL reads them with the run's --cache-size and --stream-timeout (it
opened them with the defaults: a 2 GB cache of its own whatever --cache-size said)."""

from __future__ import annotations

import uuid

from click.testing import CliRunner
from trainkit import make_dataset, random_docs
from xprep.cli import xprep
from xprep.prep.dataset import upload_dataset
from xprep.train.data import PackedDataset
from xprep.train.evaluate import open_named_set, open_validation

PACK = ["--method", "multipack", "--seq-len", "32"]


def test_evaluation_sets_at_urls_take_the_run_s_cache_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    make_dataset(tmp_path / "ds", random_docs(30, 4, 30, vocab=128), vocab_size=128)
    url = f"memory://xprep-tests/{uuid.uuid4().hex}/ds"
    upload_dataset(tmp_path / "ds", url)
    for source, out in ((url, "held"), (tmp_path / "ds", "train")):
        result = CliRunner().invoke(xprep, ["pack", str(source), "-o", str(tmp_path / out), *PACK])
        assert result.exit_code == 0, (result.output, result.exception)
    train = PackedDataset(tmp_path / "train", cache_size=12_345, stream_timeout=7.5)
    for dataset in (open_named_set("held", str(tmp_path / "held"), "--eval", train, 1, False),
                    open_validation(tmp_path / "held", train, 1, False)):
        assert dataset.cache is not None and dataset.cache.capacity == 12_345
        assert dataset.cache.retry.budget_s == 7.5
        assert dataset[0]["input_ids"].numel() > 0  # (read through that cache)
