"""Data parallel under torchrun (gloo, 2 processes): same gradient and same run as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from trainkit import category_pack, grads, make_trainer, max_rel_diff

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
XTRAIN = Path(sys.executable).with_name("xtrain")


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
