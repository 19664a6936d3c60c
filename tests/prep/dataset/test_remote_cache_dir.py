"""``xprep pack --cache-dir DIR`` governs everything fetched for datasets given as URLs (fsspec's in-memory file
system here): the manifests and indexes of a plain pack's, a blend's and a mix file's datasets (all read in place,
none copied whole); nothing lands in ``$XPREP_CACHE_DIR`` then."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from prepkit import random_dataset
from xprep.cli import xprep
from xprep.prep.dataset import upload_dataset


@pytest.fixture
def urls(tmp_path) -> list[str]:
    """Two small datasets uploaded to a fresh in-memory URL."""
    where = f"memory://xprep-tests/{uuid.uuid4().hex}"
    for name, seed in (("ds", 0), ("other", 1)):
        upload_dataset(random_dataset(tmp_path / name, 12, seed=seed), f"{where}/{name}")
    return [f"{where}/ds", f"{where}/other"]


@pytest.mark.parametrize("how", ["plain", "blend", "mix"])
def test_cache_dir_holds_what_a_pack_of_urls_fetches(tmp_path, urls, monkeypatch, how):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "env"))
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"dataset": u, "weight": 1} for u in urls]}))
    given = {"plain": urls, "blend": [f"{u}@1" for u in urls], "mix": ["--mix", str(mix)]}[how]
    flag = tmp_path / "flag"
    for _ in range(2):  # built, then found (a hit opens the datasets again)
        result = CliRunner().invoke(xprep, ["pack", *given, "-o", str(tmp_path / "p"), "--method", "sequential",
                                            "--seq-len", "64", "--cache-dir", str(flag)])
        assert result.exit_code == 0, (result.output, result.exception)
    assert not (tmp_path / "env").exists()
    fetched = sorted(p.name for p in flag.glob("datasets/*/*") if not p.name.startswith("."))
    assert fetched == ["ds.index", "other.index"]
