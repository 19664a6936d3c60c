"""Ctrl-C (and SIGTERM) during compiled kernels: one line, exit status 130, nothing half-written left behind.

A numba kernel does not return to the interpreter until it is done, so a KeyboardInterrupt raised while it runs
surfaces late, inside numba's own machinery (a ``SystemError`` traceback), or while the interpreter shuts down
beside numba's worker threads (a segmentation fault). ``run_interruptibly`` therefore runs the work in a thread
and waits for it in the main thread, which alone receives signals. On an interrupt it removes the temporary
directories the work registered (``temporary``), says ``interrupted`` and ends the process at once with status
130, without waiting for a kernel to return or letting the interpreter tear down around one. What was published
is whole (entries are renamed into place complete), and locks are file locks the kernel releases.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C

_temporary: set[Path] = set()
_lock = threading.Lock()


@contextmanager
def temporary(path: Path) -> Iterator[Path]:
    """Mark ``path`` (a directory being built) for removal should the command be interrupted while it exists."""
    with _lock:
        _temporary.add(Path(path))
    try:
        yield path
    finally:
        with _lock:
            _temporary.discard(Path(path))


def run_interruptibly(work: Callable[[], T], poll: float = 0.1) -> T:
    """``work()`` in a thread; its result, or its exception re-raised here. Ctrl-C or SIGTERM meanwhile
    (raised as KeyboardInterrupt in this, the main thread) removes the registered temporary directories,
    prints ``interrupted`` and exits with status 130 at once."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            outcome["error"] = e

    thread = threading.Thread(target=target, name="xprep-work", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(poll)
    except KeyboardInterrupt:
        abandon()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def abandon() -> None:
    """Remove what is half-built, say so in one line, and end the process with status 130 (no clean-up that
    could wait on a running kernel)."""
    with _lock:
        paths = list(_temporary)
    for path in paths:
        for _ in range(3):  # the work may still be writing into it; what it adds after the last pass is removed
            shutil.rmtree(path, ignore_errors=True)  # by the next build of that entry (its stale temporaries)
            if not path.exists():
                break
    print("interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(INTERRUPTED)
