"""Bad steps (issue 31, point A): a non-finite loss or gradient norm skips the step on every rank.

A skipped step applies no update and holds the lr schedule (as Megatron-LM); its batches stay consumed;
it is counted in metrics.jsonl (``skipped``, ``bad_steps``) and said on the console; nothing is saved while
the last step was bad; ``--max-bad-steps K`` in a row stop the run with exit status 3, the last good
checkpoint staying ``latest``. The faults come from the config's test hook ``inject_nonfinite``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _train_fault_worker import PARAMS_DIR_ENV
from click.testing import CliRunner
from trainkit import cp_pack, make_trainer, max_rel_diff, params
from xprep.cli import xprep, xtrain
from xprep.prep.errors import XprepError
from xprep.train.config import OptimizerSection
from xprep.train.trainer import BAD_STEPS_EXIT

ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = ROOT / "tests" / "_train_fault_worker.py"
LR, WARMUP = 2e-3, 10  # the lr rises every step of these short runs: a schedule that moved would show


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def config_file(tmp_path: Path, inject: str) -> str:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"optimizer": {"inject_nonfinite": inject}}))
    return str(path)


def checkpoints(run: Path) -> tuple[str, set[str]]:
    root = run / "checkpoints"
    return (root / "latest").read_text().strip(), {p.name for p in root.glob("step-*")}


def test_a_bad_step_on_one_rank_is_skipped_by_all_and_a_streak_stops_the_run(tmp_path):
    """2 ranks, FSDP2 (gloo): rank 1's gradients are NaN at step 3 (its loss is finite, and rank 0's gradients
    too: only the global decision skips it there), rank 0's loss is NaN at steps 5 and 6 and rank 1's gradients
    at step 7: the third bad step in a row stops the run."""
    packed = cp_pack(tmp_path)
    run, dumps = tmp_path / "run", tmp_path / "params"
    dumps.mkdir()
    args = [str(packed), "--config", config_file(tmp_path, "grad:1:3,loss:0:5,loss:0:6,grad:1:7"), "--steps", "10",
            "--micro-batch-size", "1", "--lr", str(LR), "--warmup", str(WARMUP), "--save-every", "1", "--keep", "10",
            "--max-bad-steps", "3", "--log-every", "100", "--nproc-per-node", "2", "--output", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", PARAMS_DIR_ENV: str(dumps)}  # the worker saves every step's weights
    proc = subprocess.run([sys.executable, str(FAULT_WORKER), "run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == BAD_STEPS_EXIT, proc.stderr

    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, proc.stderr  # rank 0 says it, once
    assert said[0].startswith("error: step 7: 3 bad steps in a row, 5–7 (non-finite loss or gradient norm"), said
    assert "--max-bad-steps 3: run stopped" in said[0], said
    assert f"{run / 'checkpoints' / 'step-4'} stays the latest" in said[0], said
    assert "step 3/10 skipped: non-finite gradient norm nan" in proc.stderr, proc.stderr
    assert "step 5/10 skipped: non-finite loss nan and gradient norm nan" in proc.stderr, proc.stderr

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["skipped"] for r in rows] == [False, False, True, False, True, True, True]
    assert [r["bad_steps"] for r in rows] == [0, 0, 1, 0, 1, 2, 3]
    assert [r["consumed_samples"] for r in rows] == [2 * s for s in range(1, 8)]  # skipped batches stay consumed
    assert [r["grad_norm"] is None for r in rows] == [False, False, True, False, True, True, True]  # JSON: no NaN
    assert [r["loss"] is None for r in rows] == [False] * 4 + [True, True, False]
    lrs = [r["lr"] for r in rows]  # a skipped step holds the schedule: the next one trains at its lr
    assert lrs == pytest.approx([LR * k / WARMUP for k in (1, 2, 3, 3, 4, 4, 4)], rel=1e-12)
    assert checkpoints(run) == ("step-4", {"step-1", "step-2", "step-4"})  # none from a bad step's state

    before, after = (torch.load(dumps / f"step-{n}.pt") for n in (2, 3))
    assert all(torch.equal(before[k], after[k]) for k in before)  # both ranks' shards kept their values
    # step 4 equals one process that consumed step 3's batches without an update; applying it would differ
    skipped, trained = (make_trainer(packed, micro=1, accum=2, lr=LR, warmup=WARMUP) for _ in range(2))
    for step in range(1, 5):
        trained.train_step()
        if step == 3:
            for _ in range(2):
                skipped.sampler.next_micro_batch()
            skipped.step += 1
        else:
            skipped.train_step()
    got = torch.load(dumps / "step-4.pt")
    assert max_rel_diff(got, params(skipped.model)) < 1e-5
    assert max_rel_diff(got, params(trained.model)) > 1e-3


def test_a_bad_last_step_ends_the_run_without_a_checkpoint(tmp_path):
    packed = cp_pack(tmp_path)
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--config", config_file(tmp_path, "grad:0:3"),
                                         "--steps", "3", "--save-every", "1", "--output", str(run)])
    assert result.exit_code == 0, result.output
    assert "step 3/3 skipped: non-finite gradient norm nan (no update, lr schedule held); 1 bad step in a row" \
        in result.stderr, result.stderr
    assert (f"the last step, 3, was bad: no checkpoint at the end; {run / 'checkpoints' / 'step-2'} stays the "
            "latest checkpoint") in result.stderr, result.stderr
    assert checkpoints(run) == ("step-2", {"step-1", "step-2"})
    assert [r["skipped"] for r in metrics(run)] == [False, False, True]
    report = json.loads(CliRunner().invoke(xprep, ["inspect", str(run), "--json"]).output)
    assert (report["skipped_steps"], report["steps_without_targets"], report["loss"]["points"]) == (1, 0, 3)
    assert "skipped       1 step with a non-finite loss or gradient norm" in CliRunner().invoke(
        xprep, ["inspect", str(run)]).output


def test_the_first_bad_step_stops_a_run_with_max_bad_steps_1(tmp_path):
    packed = cp_pack(tmp_path)
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--config", config_file(tmp_path, "loss:0:1"),
                                         "--steps", "3", "--max-bad-steps", "1", "--output", str(run)])
    assert result.exit_code == BAD_STEPS_EXIT, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 1: a bad step (non-finite loss or gradient norm, update skipped), the "
                           "limit of --max-bad-steps 1: run stopped; no checkpoint was written before"), last
    assert not (run / "checkpoints").exists() and len(metrics(run)) == 1


def test_the_test_hook_and_the_limit_are_checked():
    hook = OptimizerSection(inject_nonfinite="grad:1:3, loss:0:5,grad:1:4")
    assert hook.nonfinite_at(1) == {"loss": frozenset(), "grad": frozenset({3, 4})}
    assert hook.nonfinite_at(0) == {"loss": frozenset({5}), "grad": frozenset()}
    assert OptimizerSection().nonfinite_at(0) == {"loss": frozenset(), "grad": frozenset()}
    for bad in ("grad:1", "nan:0:3", "grad:0:0", "grad:0:3,"):
        with pytest.raises(XprepError, match="is not KIND:RANK:STEP"):
            OptimizerSection(inject_nonfinite=bad)
    with pytest.raises(XprepError, match="--max-bad-steps 0 must be ≥ 1"):
        OptimizerSection(max_bad_steps=0)
