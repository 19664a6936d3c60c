"""`xtrain run` with a fault injected through the trainer's step-end callbacks (tests only).

    python tests/_train_fault_worker.py run ARGS...      as `xtrain run ARGS`, also under torchrun
    python tests/_train_fault_worker.py rank CONFIG_JSON  one rank started by `--nproc-per-node` (set below)

The faults are read from this environment here, never by xtrain itself (children inherit it):
  XTRAIN_TEST_KILL_AFTER_STEP=N  SIGKILL this process after step N   [only rank XTRAIN_TEST_KILL_RANK if set]
  XTRAIN_TEST_FAIL_RANK=R        rank R raises instead of starting step XTRAIN_TEST_FAIL_STEP (≥ 2) [default 2]
  XTRAIN_TEST_SIGNAL=NAME,N,TO   after step N send signal NAME (TERM, INT, USR1, KILL) to TO: "self" (this process),
                                 "launcher" (rank 0's parent), "rank-R" (rank R only sends it, to itself), or
                                 "pid-P" (rank 0 sends it to process P: a test's server)
  XTRAIN_TEST_SIGNAL_IN_SAVE=NAME  every checkpoint save sends NAME to this process while DCP writes (then goes on)
  XTRAIN_TEST_PARAMS_DIR=DIR     after every step, rank 0 saves the whole parameters to DIR/step-N.pt
  XTRAIN_TEST_KILL_PUBLISHING=step-N  SIGKILL this process inside the publication of step-N: its `latest` written
                                 to the temporary file, not renamed yet
  XTRAIN_TEST_SAY_TIMEOUTS=1     after every step, each rank prints "rank R timeouts: DEFAULT OTHER..." (seconds): its
                                 default process group's timeout, then those of every other group (sorted)
With `run`, ranks that `--nproc-per-node` starts run through this file too (``xprep.train.launch.RANK_ENTRY``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from xprep.cli import xtrain
from xprep.train import launch, trainer
from xprep.train.dist import full_tensor, plain_name

KILL_AFTER_STEP_ENV = "XTRAIN_TEST_KILL_AFTER_STEP"
KILL_RANK_ENV = "XTRAIN_TEST_KILL_RANK"
FAIL_RANK_ENV = "XTRAIN_TEST_FAIL_RANK"
FAIL_STEP_ENV = "XTRAIN_TEST_FAIL_STEP"
SIGNAL_ENV = "XTRAIN_TEST_SIGNAL"
SIGNAL_IN_SAVE_ENV = "XTRAIN_TEST_SIGNAL_IN_SAVE"
PARAMS_DIR_ENV = "XTRAIN_TEST_PARAMS_DIR"
KILL_PUBLISHING_ENV = "XTRAIN_TEST_KILL_PUBLISHING"
SAY_TIMEOUTS_ENV = "XTRAIN_TEST_SAY_TIMEOUTS"


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


def send_after(name: str, step: int, to: str):
    sig = getattr(signal, "SIG" + name)

    def callback(trainer) -> None:
        if trainer.step != step:
            return
        if to == "self" or (to.startswith("rank-") and int(to[5:]) == trainer.dims.rank):
            os.kill(os.getpid(), sig)
        elif to == "launcher" and trainer.dims.rank == 0:
            os.kill(os.getppid(), sig)
        elif to.startswith("pid-") and trainer.dims.rank == 0:
            os.kill(int(to[4:]), sig)
    return callback


def signal_in_save(name: str) -> None:
    """Wrap DCP's writes so that each sends ``name`` to this process midway (a signal during a save)."""
    import torch.distributed.checkpoint as dcp  # xprep.train.checkpoint calls dcp.save / dcp.async_save through it

    sig = getattr(signal, "SIG" + name)
    for fn in ("save", "async_save"):
        original = getattr(dcp, fn)

        def wrapped(*args, _original=original, **kwargs):
            os.kill(os.getpid(), sig)
            return _original(*args, **kwargs)
        setattr(dcp, fn, wrapped)


def save_params(directory: str):
    def callback(trainer) -> None:  # every rank gathers (FSDP2 shards), rank 0 writes
        whole = {plain_name(n): full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        if trainer.dims.is_main:
            torch.save(whole, Path(directory) / f"step-{trainer.step}.pt")
    return callback
def say_timeouts(trainer) -> None:
    """Print how long each of this rank's process groups lets a collective wait (gloo: the CPU backend's options)."""
    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    default = dist.distributed_c10d._get_default_group()
    others = sorted(seconds(g) for g in dist.distributed_c10d._world.pg_map if g is not default)
    line = f"rank {trainer.dims.rank} timeouts: {seconds(default):g} {' '.join(f'{s:g}' for s in others)}\n"
    os.write(sys.stdout.fileno(), line.encode())  # one write: the ranks share the pipe


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
    if SIGNAL_ENV in env:
        name, step, to = env[SIGNAL_ENV].split(",")
        trainer.STEP_END_CALLBACKS.append(send_after(name, int(step), to))
    if SIGNAL_IN_SAVE_ENV in env:
        signal_in_save(env[SIGNAL_IN_SAVE_ENV])
    if PARAMS_DIR_ENV in env:
        trainer.STEP_END_CALLBACKS.append(save_params(env[PARAMS_DIR_ENV]))
    if SAY_TIMEOUTS_ENV in env:
        trainer.STEP_END_CALLBACKS.append(say_timeouts)
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
