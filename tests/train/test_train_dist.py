"""Data parallel under torchrun (gloo, 2 processes): same gradient and same run as one process; how long the
ranks' collectives wait for a peer (``--dist-timeout``, ``--checkpoint-timeout``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_fault_worker import SAY_TIMEOUTS_ENV
from trainkit import category_pack, grads, make_trainer, max_rel_diff
from xprep.prep.errors import XprepError
from xprep.train.config import TrainConfig
from xprep.train.dist import DEFAULT_TIMEOUT_S, TIMEOUT_ENV

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
XTRAIN = Path(sys.executable).with_name("xtrain")
FAULT_WORKER = ROOT / "tests" / "_train_fault_worker.py"  # `xtrain run` with the test hook the environment names


def torchrun(nproc: int, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_gradient_same_on_one_and_two_ranks(tmp_path):
    packed = category_pack(tmp_path)
    ref = make_trainer(packed, micro=1, accum=4)
    ref.accumulate_gradients()
    out = tmp_path / "g.pt"
    torchrun(2, str(ROOT / "tests" / "_train_dp_worker.py"), str(packed), str(out), "1", "2")
    two = torch.load(out, weights_only=True)
    assert max_rel_diff(two, grads(ref.model)) <= 1e-6


def test_run_on_two_ranks_matches_one_process(tmp_path):
    packed = category_pack(tmp_path)
    common = ["--steps", "4", "--global-batch-size", "4", "--micro-batch-size", "1", "--log-every", "100",
              "--sampler", "random", "--seed", "3"]
    one = subprocess.run([str(XTRAIN), "run", str(packed), "--output", str(tmp_path / "one"), *common],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr
    torchrun(2, "--no-python", str(XTRAIN), "run", str(packed), "--output", str(tmp_path / "two"), *common)
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6 * ra["loss"]
        assert ra["consumed_samples"] == rb["consumed_samples"]
        for k, v in ra["category_loss"].items():
            assert abs(v - rb["category_loss"][k]) <= 1e-6 * v
    assert (tmp_path / "two" / "checkpoints" / "step-4" / "trainer.json").is_file()


def test_the_timeouts_reach_every_rank_s_process_groups(tmp_path):
    """`--dist-timeout` is the default group's (training's collectives), `--checkpoint-timeout` the checkpoints'
    group's, on each rank the launcher starts (the options travel in the resolved config, not the environment)."""
    packed = category_pack(tmp_path)
    proc = subprocess.run([sys.executable, str(FAULT_WORKER), "run", str(packed), "--steps", "1", "--nproc-per-node",
                           "2", "--dist-timeout", "123", "--checkpoint-timeout", "4567", "--output",
                           str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", SAY_TIMEOUTS_ENV: "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = sorted(line for line in proc.stdout.splitlines() if " timeouts: " in line)
    assert [line.split(" timeouts: ")[0] for line in said] == ["rank 0", "rank 1"], proc.stdout
    for line in said:
        default, *others = line.split(" timeouts: ")[1].split()
        assert default == "123" and "4567" in others, line


def test_the_dist_timeout_defaults_to_its_variable(monkeypatch):
    def timeout(**flags) -> float:
        return TrainConfig.from_dict({"packed": "p", **flags}).parallel.collective_timeout().total_seconds()

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert TrainConfig.from_dict({"packed": "p"}).parallel.dist_timeout is None
    assert timeout() == DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv(TIMEOUT_ENV, "90.5")
    assert timeout() == 90.5 and timeout(dist_timeout=30) == 30
    for bad in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(XprepError, match=rf"\${TIMEOUT_ENV}='{bad}': must be a number of seconds > 0"):
            TrainConfig.from_dict({"packed": "p"})
    monkeypatch.delenv(TIMEOUT_ENV)
    with pytest.raises(XprepError, match="--dist-timeout 0: must be a number of seconds > 0"):
        TrainConfig.from_dict({"packed": "p", "dist_timeout": 0})
