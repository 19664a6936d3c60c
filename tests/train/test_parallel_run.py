"""`xtrain run` on 2 ranks it starts itself (--nproc-per-node): CP and DP runs, resume across layouts, failures.

Issue 5 points 2 (second half), 3 and 4: a 20-step run has the same loss curve on (1,1,1) and
(dp 1, cp 2); a checkpoint written with dp=2 resumes with cp=2, one written with cp=2 (ring) on one process and
on cp=4 (hybrid 2 × 2: issue 33, another mode and another C), the losses and the
data order continuing exactly as in an uninterrupted run; a rank that dies ends the whole job
quickly, non-zero, with its error shown. Issue 35 (elastic resume): a job whose rank is SIGKILLed resumes on
another layout with the same global batch — dp=1 × cp=2 on dp=2, and dp=2 on one process on a pack balanced for
2 ranks — with the losses of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _train_fault_worker import FAIL_RANK_ENV, FAIL_STEP_ENV, KILL_AFTER_STEP_ENV, KILL_RANK_ENV
from click.testing import CliRunner
from trainkit import cp_pack, make_dataset, random_docs
from xprep.cli import xtrain as xtrain_cli
from xprep.prep.pack.cache import PackConfig, pack

ROOT = Path(__file__).resolve().parents[2]
XTRAIN = Path(sys.executable).with_name("xtrain")
TORCHRUN = Path(sys.executable).with_name("torchrun")
FAULT_WORKER = ROOT / "tests" / "_train_fault_worker.py"  # `xtrain run` with the fault the environment names
TOL = 1e-5
# 2 bins per step on every layout: dp=2 × 1, or cp=2 with 2 micro-batches of 1 (and 1 process: 2 × 1).
COMMON = ["--steps", "20", "--micro-batch-size", "1", "--global-batch-size", "2", "--sampler", "random",
          "--seed", "3", "--lr", "2e-3", "--warmup", "2", "--log-every", "100", "--save-every", "10", "--keep", "3"]
DP2 = ["--nproc-per-node", "2", "--dp", "2"]
CP2 = ["--nproc-per-node", "2", "--cp", "2"]


def xtrain(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    """`xtrain run ARGS`; through the fault worker when ``env`` names a fault."""
    cmd = [sys.executable, str(FAULT_WORKER), "run"] if env else [str(XTRAIN), "run"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def same_curve(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= TOL * ra["loss"], (ra, rb)
        assert ra["consumed_samples"] == rb["consumed_samples"] and ra["tokens"] == rb["tokens"]
        assert ra["target_tokens"] == rb["target_tokens"] and ra["lr"] == rb["lr"]
        for name, value in ra["category_loss"].items():
            assert abs(value - rb["category_loss"][name]) <= TOL * value


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The pack, and the uninterrupted single-process run everything is compared with."""
    root = tmp_path_factory.mktemp("runs")
    packed = cp_pack(root, cp_size=4)  # room for --cp 4 (and 2)
    one = xtrain(str(packed), *COMMON, "--output", str(root / "one"))
    assert one.returncode == 0, one.stderr
    return packed, root / "one"


def test_cp2_curve_equals_one_process_and_resumes_under_another_mode_and_c(runs, tmp_path):
    """The cp=2 job is SIGKILLed (rank 1, after step 11) and resumed in place on dp=2 after its step-10
    checkpoint has also resumed under cp=4 (hybrid) and on one process: every curve is the one-process run's."""
    packed, one = runs
    killed = xtrain(str(packed), *COMMON, *CP2, "--cp-mode", "ring", "--output", str(tmp_path / "cp2"),
                    env={KILL_AFTER_STEP_ENV: "11", KILL_RANK_ENV: "1"})
    assert killed.returncode not in (0, None), killed.stderr
    assert "1 DP × 2 CP (ring), FSDP2" in killed.stderr
    assert killed.stderr.strip().splitlines()[-1].startswith("error: rank 1 of 2 failed (signal SIGKILL)")
    assert (tmp_path / "cp2" / "checkpoints" / "latest").read_text().strip() == "step-10"
    hybrid = ["--nproc-per-node", "4", "--cp", "4", "--cp-mode", "hybrid", "--ulysses", "2"]
    resumed = xtrain(str(packed), *COMMON, *hybrid, "--output", str(tmp_path / "cp4"),
                     "--resume", str(tmp_path / "cp2" / "checkpoints" / "step-10"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step 10" in resumed.stderr and "1 DP × 4 CP (hybrid: 2 Ulysses × 2 ring)" in resumed.stderr
    same_curve(metrics(one)[10:], metrics(tmp_path / "cp4"))
    alone = xtrain(str(packed), *COMMON, "--output", str(tmp_path / "alone"),  # 2 ranks' shards on 1 process
                   "--resume", str(tmp_path / "cp2" / "checkpoints" / "step-10"))
    assert alone.returncode == 0, alone.stderr
    same_curve(metrics(one)[10:], metrics(tmp_path / "alone"))
    dp2 = xtrain("--output", str(tmp_path / "cp2"), *DP2, "--cp", "1")  # the run's config.json gives the rest
    assert dp2.returncode == 0, dp2.stderr
    assert "resuming at step 10" in dp2.stderr and "1 × 2 DP × 1 accumulation; 2 DP, FSDP2" in dp2.stderr
    assert dp2.stderr.count("step 20/20") == 1  # rank 0 speaks
    same_curve(metrics(one), metrics(tmp_path / "cp2"))  # steps 1-10 on cp=2, 11-20 on dp=2 (step 11 replayed)


def test_dp2_with_async_save_resumes_on_cp2(runs, tmp_path):
    packed, one = runs
    dp2 = xtrain(str(packed), *COMMON, *DP2, "--async-save", "--output", str(tmp_path / "dp2"))
    assert dp2.returncode == 0, dp2.stderr
    same_curve(metrics(one), metrics(tmp_path / "dp2"))
    ckpts = tmp_path / "dp2" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-20" and not list(ckpts.glob(".step-*"))
    assert sorted(p.name for p in (ckpts / "step-10").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = xtrain(str(packed), *COMMON, *CP2, "--activation-checkpointing", "--output", str(tmp_path / "cp2"),
                     "--resume", str(ckpts / "step-10"))
    assert resumed.returncode == 0, resumed.stderr
    same_curve(metrics(one)[10:], metrics(tmp_path / "cp2"))


@pytest.mark.parametrize("launcher", ["nproc-per-node", "torchrun"])
def test_a_dying_rank_ends_the_job(runs, tmp_path, launcher):
    packed, _ = runs
    args = [str(packed), *COMMON, "--cp", "2", "--output", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAIL_RANK_ENV: "1", FAIL_STEP_ENV: "3"}
    if launcher == "torchrun":
        cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(FAULT_WORKER), "run", *args]
    else:
        cmd = [sys.executable, str(FAULT_WORKER), "run", *args, "--nproc-per-node", "2"]
    # a job left waiting on the failed rank would sit until the gloo timeout (600 s): a TimeoutExpired here
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode not in (0, None), proc.stderr
    assert "rank 1 fails at step 3 (test hook)" in proc.stderr  # the failing rank's own error
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    if launcher == "nproc-per-node":  # one closing line names the rank that failed first, and its error
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: rank 1 of 2 failed (exit code 1): RuntimeError: XTRAIN_TEST_FAIL_RANK"), last
    else:
        assert "rank      : 1 (local_rank: 1)" in proc.stderr.split("Root Cause")[-1]


def test_resume_on_one_process_keeps_the_global_batch(tmp_path):
    """The default global batch (micro × dp = 2 on 2 ranks) is the checkpoint's, not 1 × 1 on one process; another
    one is refused in one line, or taken from the consumed bins on with --allow-new-global-batch."""
    packed = cp_pack(tmp_path)
    args = [str(packed), "--micro-batch-size", "1", "--log-every", "100", "--output", str(tmp_path / "run")]
    dp2 = xtrain(*args, *DP2, "--steps", "2")
    assert dp2.returncode == 0, dp2.stderr
    one_process = ["--nproc-per-node", "1", "--dp", "1"]  # else the run's saved config would launch 2 ranks again
    one = CliRunner().invoke(xtrain_cli, ["run", *args, *one_process, "--steps", "4"])  # in this process: 1 DP rank
    assert one.exit_code == 0, one.output
    assert [r["consumed_samples"] for r in metrics(tmp_path / "run")] == [2, 4, 6, 8]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-4" / "trainer.json").read_text())
    assert (state["global_batch_size"], state["micro_batch_size"]) == (2, 1)
    other = CliRunner().invoke(xtrain_cli, ["run", *args, *one_process, "--steps", "6", "--global-batch-size", "4"])
    assert other.exit_code == 2 and "global batch of 2 bins" in other.stderr, other.stderr
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    # --allow-new-global-batch continues from the 8 bins consumed, in steps of 4
    new = CliRunner().invoke(xtrain_cli, ["run", *args, *one_process, "--steps", "6", "--global-batch-size", "4",
                                          "--allow-new-global-batch"])
    assert new.exit_code == 0, new.output
    assert "global batch 2 → 4 bins, from consumed sample 8" in new.stderr, new.stderr
    assert [r["consumed_samples"] for r in metrics(tmp_path / "run")] == [2, 4, 6, 8, 12, 16]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-6" / "trainer.json").read_text())
    assert (state["global_batch_size"], state["sampler"]["consumed_samples"]) == (4, 16)


def test_a_sigkilled_rank_ends_the_job_and_it_resumes_on_one_rank(tmp_path):
    """dp=2 → dp=1 on a token-aware pack balanced for 2 ranks (--balance-dp 2, which starts on 2 ranks
    only): the 2-rank job dies with rank 1 (SIGKILL after step 3), the run resumes on one process from step-2, and
    its losses are the uninterrupted 2-rank run's (the same bins in each global batch of 2)."""
    make_dataset(tmp_path / "ds", random_docs(40, 3, 40, vocab=128, seed=1), vocab_size=128)
    pack([tmp_path / "ds"], tmp_path / "p",
         PackConfig(method="token-aware", max_tokens=64, balance_dp=2, dp_micro_batches=1))  # global batch: 2
    args = [str(tmp_path / "p"), "--steps", "6", "--micro-batch-size", "1", "--sampler", "random", "--seed", "3",
            "--lr", "2e-3", "--warmup", "2", "--log-every", "100", "--save-every", "2", *DP2]
    reference = xtrain(*args, "--output", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr
    # A job left waiting on the dead rank would sit until the gloo timeout (600 s) and fail here as a
    # TimeoutExpired; how long the start-up takes is the machine's business, not this test's.
    proc = xtrain(*args, "--output", str(tmp_path / "run"), env={KILL_AFTER_STEP_ENV: "3", KILL_RANK_ENV: "1"})
    assert proc.returncode not in (0, None), proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 of 2 failed (signal SIGKILL)"), last
    one = xtrain("--output", str(tmp_path / "run"), "--nproc-per-node", "1", "--dp", "1")  # config.json: the rest
    assert one.returncode == 0, one.stderr
    assert "resuming at step 2" in one.stderr and "1 × 1 DP × 2 accumulation" in one.stderr
    same_curve(metrics(tmp_path / "reference"), metrics(tmp_path / "run"))
