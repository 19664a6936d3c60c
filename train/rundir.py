"""One writer per run directory: ``RunLock``, an OS lock held for the life of a run.

A second ``xtrain run`` on a run directory a live run is using (a double submission, a requeued job
whose old copy still runs) would train beside it, both writing metrics and checkpoints. So the
process that owns the run — ``xtrain run`` alone, the launcher of ``--nproc-per-node`` ranks, or
rank 0 under torchrun — takes ``fcntl.flock`` on ``RUN_DIR/run.lock`` before anything is written, and
holds it until the run ends. The kernel drops a flock when its holder dies, however it dies, so a
SIGKILLed run never blocks its own resume; the file's contents (pid, host, start time) only name the
holder in the refusal. The file is never deleted: removing it while another process waits to lock it
would let two runs hold locks on two different files of the same name.

The lock is advisory. On a file system shared by several machines it holds across them only where
flock is coherent there (NFSv4, Lustre mounted with ``-o flock``); elsewhere it guards one machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from prep.errors import XprepError
from prep.io import describe_holder, read_holder

LOCK_FILE = "run.lock"


class RunLock:
    """An exclusive, non-blocking flock on ``run_dir/run.lock``; a context manager.

    ``acquire`` creates the run directory if needed, and raises ``XprepError`` naming the holder (pid,
    host, start time) when a live process holds the lock — then it has written nothing.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(read_holder(fd))
            os.close(fd)
            raise XprepError(f"--output {self.path.parent}: in use by another run ({holder}); wait for it to end "
                             "or stop it, or choose another --output") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)  # a dead holder's record: replace it with ours
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: see the module docstring)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        """The lock file, opened without truncating it (a live holder's record must survive a refused run)."""
        if not self.path.exists():  # only then is the run directory (and the file) created
            self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
