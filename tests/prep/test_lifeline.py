"""``xprep.prep.lifeline.die_with_parent``: a process ends when the one that started it is killed, by the kernel's
parent-death signal or, where that is not asked for (workers started from another thread), by its watchdog."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT

CHILD = ("import os, sys, time\n"
         "from xprep.prep.lifeline import die_with_parent\n"
         "die_with_parent(os.getppid(), from_main_thread=sys.argv[1] == 'main')\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n")
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdout=sys.stdout)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(600)\n")


@pytest.mark.parametrize("how", ["main", "watchdog"])
def test_a_child_ends_with_its_killed_parent(how):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, how], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while _running(child):
            assert time.monotonic() < deadline, f"the child ({how}) outlived its parent"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)  # (what is left of the group, if the test failed)
        parent.wait()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
