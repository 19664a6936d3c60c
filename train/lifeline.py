"""A launched rank dies with its launcher: ``die_with_parent``.

The ranks of ``xtrain run --nproc-per-node`` (and of torchrun) are child processes of a launcher. When the
launcher alone is killed — an OOM killer, a scheduler ending the job step's head process with SIGKILL — its
children would live on as orphans: training and checkpointing into the run directory beside the run that the
requeue starts. So a launched rank asks to be ended when its parent ends (``xprep.prep.lifeline``: the kernel's
parent-death signal, or a watchdog thread where that is refused). Both launchers start their ranks from their
main thread, whose end is the process's.

This module imports nothing heavy: the rank entry calls it before torch is imported.
"""

from __future__ import annotations

import os

from xprep.prep import lifeline

PARENT_ENV = "XTRAIN_LAUNCHER_PID"  # set by xprep.train.launch for its ranks: the pid their parent must have


def die_with_parent() -> None:
    """End this process when its launcher ends (the pid ``XTRAIN_LAUNCHER_PID`` names, else the parent now): a
    launcher gone already (this process adopted meanwhile) ends it at once."""
    expected = os.environ.get(PARENT_ENV, "")
    lifeline.die_with_parent(int(expected) if expected.isdigit() else os.getppid(), from_main_thread=True)
