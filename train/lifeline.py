"""A launched rank dies with its launcher: ``die_with_parent``.

The ranks of ``xtrain run --nproc-per-node`` (and of torchrun) are child processes of a launcher. When the
launcher alone is killed — an OOM killer, a scheduler ending the job step's head process with SIGKILL — its
children would live on as orphans: training and checkpointing into the run directory beside the run that the
requeue starts. So a launched rank asks Linux to send it SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), and, where that call is missing (another OS, a seccomp profile refusing it), a
daemon thread polls the parent's pid and ends the process when it changes.

This module imports nothing heavy: the rank entry calls it before torch is imported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "XTRAIN_LAUNCHER_PID"  # set by train.launch for its ranks: the pid their parent must have
POLL_S = 0.5  # how often the fallback watchdog looks at the parent


def die_with_parent(expected_parent: int | None = None) -> str:
    """Make this process end when its parent does; return how ("prctl" or "watchdog").

    ``expected_parent``: the launcher's pid (``XTRAIN_LAUNCHER_PID`` when None and set). A parent that
    died before this call (this process was re-parented already) ends this process at once.
    """
    if expected_parent is None and os.environ.get(PARENT_ENV, "").isdigit():
        expected_parent = int(os.environ[PARENT_ENV])
    parent = os.getppid() if expected_parent is None else expected_parent
    how = "prctl" if _prctl_pdeathsig(signal.SIGKILL) else "watchdog"
    if os.getppid() != parent:  # it died between our start and the prctl: no signal will come
        os._exit(128 + signal.SIGKILL)
    if how == "watchdog":
        threading.Thread(target=_watch, args=(parent,), name="die-with-parent", daemon=True).start()
    return how


def _prctl_pdeathsig(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent exits (Linux); False where that is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(128 + signal.SIGKILL)
