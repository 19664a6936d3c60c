"""`xprep inspect runs/NAME --seen [--step N]` (issue 11): the documents a run trained on, exactly, after a kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from _train_fault_worker import KILL_AFTER_STEP_ENV
from click.testing import CliRunner
from prepkit import random_dataset as make
from trainkit import side_by_side
from xprep.cli import xprep
from xprep.prep.pack.cache import PackConfig, pack
from xprep.train.data import PackedDataset
from xprep.train.samplers import build_sampler

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--steps", "8", "--micro-batch-size", "1", "--global-batch-size", "3", "--sampler", "random", "--seed",
          "4", "--log-every", "100", "--save-every", "3"]


def xtrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "_train_fault_worker.py"), "run", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lineage")
    make(root / "web", 30, 1)
    make(root / "code", 6, 2)
    pack([root / "web", root / "code"], root / "P", PackConfig(method="multipack", seq_len=64), weights=[0.6, 0.4],
         mix=None)
    whole, killed = side_by_side([  # two single-process runs at once
        partial(xtrain, str(root / "P"), *COMMON, "--output", str(root / "whole")),
        partial(xtrain, str(root / "P"), *COMMON, "--output", str(root / "killed"), env={KILL_AFTER_STEP_ENV: "5"})])
    assert whole.returncode == 0, whole.stderr
    assert killed.returncode != 0  # SIGKILLed after step 5, its last checkpoint at step 3
    resumed = xtrain(str(root / "P"), *COMMON, "--output", str(root / "killed"))
    assert resumed.returncode == 0 and "resuming at step 3" in resumed.stderr, resumed.stderr
    return root


def seen(run: Path, *args: str) -> dict:
    res = CliRunner().invoke(xprep, ["inspect", str(run), "--seen", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def direct(packed: Path, steps: int) -> dict[tuple[str, int], int]:
    """Tokens per (dataset, document) of the first ``steps`` steps, from the trainer's own sampler and dataset."""
    ds = PackedDataset(packed)
    sampler = build_sampler("random", len(ds), 1, 0, 1, 4)
    out: dict[tuple[str, int], int] = {}
    for _ in range(steps * 3):
        for b in sampler.next_micro_batch():
            _, docs, _, lens = ds.bins.items(b)
            for d, n in zip(docs.tolist(), lens.tolist(), strict=True):
                k = int(np.searchsorted(ds.bins.doc_base, d, side="right") - 1)
                key = (str(ds.datasets[k].path), d - int(ds.bins.doc_base[k]))
                out[key] = out.get(key, 0) + n
    return out


@pytest.mark.parametrize("step", [2, 5, 8])
def test_seen_after_a_kill_and_resume_equals_the_uninterrupted_run(runs, step):
    got = seen(runs / "killed", "--step", str(step))
    want = seen(runs / "whole", "--step", str(step))
    assert got["documents"] == want["documents"] and got["consumed_samples"] == 3 * step
    assert {(d["dataset"], d["document"]): d["tokens"] for d in got["documents"]} == direct(runs / "P", step)
    by_source = {s["name"]: s["tokens"] for s in got["sources"]}
    assert sum(by_source.values()) == got["tokens"] == sum(got["categories"].values())
    for name in ("web", "code"):
        assert by_source[name] == sum(d["tokens"] for d in got["documents"] if d["source"] == name)


def test_default_step_is_the_latest_checkpoint(runs):
    report = seen(runs / "killed")
    assert report["step"] == 8 and "checkpoint" in report["step_from"]
    text = CliRunner().invoke(xprep, ["inspect", str(runs / "killed"), "--seen", "--step", "2"]).output
    assert "trained on up to step 2" in text and "web" in text and "code" in text


def test_seen_options_are_checked(runs):
    res = CliRunner().invoke(xprep, ["inspect", str(runs / "P"), "--seen"])
    assert res.exit_code == 2 and "--seen applies only to a run directory" in res.stderr
    res = CliRunner().invoke(xprep, ["inspect", str(runs / "whole"), "--step", "3"])
    assert res.exit_code == 2 and "--step 3 applies only with --seen" in res.stderr
    res = CliRunner().invoke(xprep, ["inspect", str(runs / "whole"), "--seen", "--step", "99"])
    assert res.exit_code == 2 and "has reached step 8" in res.stderr
