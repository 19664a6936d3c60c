"""`xtrain run` with a fault injected through the trainer's step-end callbacks (tests only).

    python tests/_train_fault_worker.py run ARGS...      as `xtrain run ARGS`, also under torchrun
    python tests/_train_fault_worker.py rank CONFIG_JSON  one rank started by `--nproc-per-node` (set below)

The faults are read from this environment here, never by xtrain itself (children inherit it):
  XTRAIN_TEST_KILL_AFTER_STEP=N  SIGKILL this process after step N   [only rank XTRAIN_TEST_KILL_RANK if set]
  XTRAIN_TEST_FAIL_RANK=R        rank R raises instead of starting step XTRAIN_TEST_FAIL_STEP (≥ 2) [default 2]
  XTRAIN_TEST_KILL_PUBLISHING=step-N  SIGKILL this process inside the publication of step-N: its `latest` written
                                 to the temporary file, not renamed yet
With `run`, ranks that `--nproc-per-node` starts run through this file too (``train.launch.RANK_ENTRY``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from cli import xtrain
from train import launch, trainer

KILL_AFTER_STEP_ENV = "XTRAIN_TEST_KILL_AFTER_STEP"
KILL_RANK_ENV = "XTRAIN_TEST_KILL_RANK"
FAIL_RANK_ENV = "XTRAIN_TEST_FAIL_RANK"
FAIL_STEP_ENV = "XTRAIN_TEST_FAIL_STEP"
KILL_PUBLISHING_ENV = "XTRAIN_TEST_KILL_PUBLISHING"


def kill_after(step: int, rank: int | None):
    def callback(trainer) -> None:
        if trainer.step == step and rank in (None, trainer.dims.rank):
            os.kill(os.getpid(), signal.SIGKILL)
    return callback


def fail_at(step: int, rank: int):
    def callback(trainer) -> None:  # at the end of the step before
        if trainer.step + 1 == step and trainer.dims.rank == rank:
            raise RuntimeError(f"{FAIL_RANK_ENV}={rank}: rank {rank} fails at step {step} (test hook)")
    return callback


def kill_publishing(name: str):
    """os.replace that SIGKILLs this process instead of renaming a `latest` naming ``name`` into place."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst).name == "latest" and Path(src).read_text().strip() == name:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst, *args, **kwargs)
    return replace


def install() -> None:
    env = os.environ
    if KILL_AFTER_STEP_ENV in env:
        rank = int(env[KILL_RANK_ENV]) if KILL_RANK_ENV in env else None
        trainer.STEP_END_CALLBACKS.append(kill_after(int(env[KILL_AFTER_STEP_ENV]), rank))
    if FAIL_RANK_ENV in env:
        trainer.STEP_END_CALLBACKS.append(fail_at(int(env.get(FAIL_STEP_ENV, "2")), int(env[FAIL_RANK_ENV])))
    if KILL_PUBLISHING_ENV in env:
        os.replace = kill_publishing(env[KILL_PUBLISHING_ENV])
    launch.RANK_ENTRY = [os.path.abspath(__file__), "rank"]


if __name__ == "__main__":
    install()
    command, args = sys.argv[1], sys.argv[2:]
    if command == "rank":
        launch.main(args)
    else:
        xtrain(["run", *args])
