"""Worker processes that end with the process that started them, however it ends.

A worker of ``xprep tokenize`` waits for its next task on a pipe whose writing end it holds itself (a forked child
inherits both ends), so when the main process is killed (SIGKILL, the OOM killer) no end-of-file ever reaches it:
it would wait forever, holding its tokenizer's memory. ``die_with_parent``, called first thing in a worker, asks
the kernel to SIGKILL it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), or else watches ``os.getppid()``
from a thread.

``PR_SET_PDEATHSIG`` fires when the *thread* that created the child exits, not the process: it is asked for only
where the workers were started from the main thread (``from_main_thread``), whose end is the process's. The
tokenize pool starts every worker from the thread that submits its first tasks (``prep.tokenize.pool._start_pool``:
a fork pool launches all of them at its first task, a spawn pool one per task until all are up).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_SECONDS = 1.0  # how often the fallback watchdog looks at the parent


def die_with_parent(parent: int, from_main_thread: bool) -> None:
    """End this process when process ``parent`` (the one that started it) ends: by the kernel's parent-death
    signal where it can be asked for, else by a watchdog thread. A parent already gone ends it now."""
    if not (from_main_thread and _parent_death_signal(signal.SIGKILL)):
        threading.Thread(target=_watch, args=(parent,), name="xprep-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the request took hold (this process was adopted meanwhile)
        os._exit(1)


def _parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent (thread) exits; whether it was granted."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os._exit(1)
