"""Preemption: a signal stops a run at a step boundary, with a checkpoint, and a status a requeue can act on.

Schedulers stop jobs by signal: Slurm sends SIGTERM before a requeue or at the time limit (and SIGUSR1 ahead
of it with ``--signal=USR1@120``), Kubernetes SIGTERM, a terminal SIGINT. While ``xtrain run`` trains,
SIGTERM, SIGINT and SIGUSR1 only note the request (``StopControl``); after the step in progress, every rank
learns whether any rank saw one (one small all-reduce per step, ``poll``), so all stop at the same step,
write a checkpoint there (synchronously, also under ``--async-save``, after flushing a save in flight),
and end with ``stop_status``:

    SIGUSR1 → 0     a stop that was asked for (e.g. ahead of the time limit); the run is resumable
    SIGTERM → 143   (128 + 15, as a process ended by it would report)
    SIGINT  → 130   (128 + 2; Ctrl-C)

Further signals while stopping change nothing: the save in progress completes (SIGKILL ends it, and leaves
no checkpoint that looks complete). Before training starts (checks, data, model) the signals keep their
usual effect: there is nothing to save yet.

The same per-step all-reduce carries ``--save-every-minutes``: a save is due when any rank's clock says so,
so every rank saves at the same step.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from xprep.prep.io import write_json_atomic
from xprep.train.dist import ParallelDims

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_FILE_ENV = "XTRAIN_STOP_FILE"  # set by xprep.train.launch: where rank 0 records a stop (``record_stop``)


def stop_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` (module docstring)."""
    return 0 if signum == signal.SIGUSR1 else 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """The run stopped on a signal (after saving, once training runs); ``exit_code`` is ``stop_status``'s,
    ``said`` whether the message was printed already (by the run's rank 0)."""

    def __init__(self, signum: int, message: str, said: bool = False):
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = stop_status(signum)
        self.said = said


def record_stop(signum: int, message: str) -> None:
    """Tell the launcher of ``--nproc-per-node`` (when there is one) that the run stopped on ``signum``, and
    what rank 0 said: it may not have received the signal itself (one sent to a rank), and SIGUSR1's status
    0 does not tell a stop from the end of the run."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        write_json_atomic(Path(path), {"signal": int(signum), "message": message})


class StopControl:
    """The stop and time-based save decisions of a run's loop, the same on every rank.

    ``arm`` installs the signal handlers (the main thread's; ``disarm`` restores the previous ones);
    ``poll`` is called once per step boundary by every rank and returns (the signal to stop on or 0,
    whether a time-based save is due); ``saved`` restarts the save clock.
    """

    def __init__(self, dims: ParallelDims, device: torch.device, save_every_minutes: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.dims, self.device = dims, device
        self.save_every_s = 60.0 * save_every_minutes
        self.clock = clock
        self.signum = 0  # the first stop signal this process received
        self.signals_seen = 0
        self._last_save = clock()
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def disarm(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        """Only note it (a handler runs between two bytecodes of the main thread: nothing here may block)."""
        self.signals_seen += 1
        if not self.signum:
            self.signum = signum

    def poll(self) -> tuple[int, bool]:
        """(stop signal or 0, save due), agreed over all ranks: the highest signal number any rank saw wins."""
        due = bool(self.save_every_s) and self.clock() - self._last_save >= self.save_every_s
        if not (self.dims.distributed and dist.is_initialized()):
            return self.signum, due
        flags = torch.tensor([self.signum, int(due)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, due = flags.tolist()
        if signum and not self.signum:  # seen by another rank: this one stops as well
            self.signum = signum
        return int(signum), bool(due)

    def saved(self) -> None:
        self._last_save = self.clock()
