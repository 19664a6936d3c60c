"""One writer per run directory: ``RunLock``, an OS lock held for the life of a run.

A second ``xtrain run`` on a run directory a live run is using (a double submission, a requeued job
whose old copy still runs) would train beside it, both writing metrics and checkpoints. So the
process that owns the run — ``xtrain run`` alone, the launcher of ``--nproc-per-node`` ranks, or
rank 0 under torchrun — takes ``fcntl.flock`` on ``RUN_DIR/run.lock`` before anything is written, and
holds it until the run ends. The kernel drops a flock when its holder dies, however it dies, so a
SIGKILLed run never blocks its own resume; the file's contents (pid, host, start time) only name the
holder in the refusal. The file is never deleted: removing it while another process waits to lock it
would let two runs hold locks on two different files of the same name.

Every rank of a distributed run writes into the run directory too (its shards of each checkpoint), so
each also holds a shared flock on ``RUN_DIR/ranks.lock`` (``RanksLock``) for as long as it lives, and
``RunLock`` is refused while any process holds that one: ranks that outlived their launcher (see
train/lifeline.py, which makes that rare) keep a new run out of the directory until they are gone.

The locks are advisory. On a file system shared by several machines they hold across them only where
flock is coherent there (NFSv4, Lustre mounted with ``-o flock``); elsewhere they guard one machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.io import describe_holder, read_holder

LOCK_FILE = "run.lock"
RANKS_LOCK_FILE = "ranks.lock"


class _HeldLock:
    """A flock held on an open file until ``release`` (or the process's end); a context manager."""

    _fd: int | None = None

    def acquire(self) -> _HeldLock:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the lock (the file stays: see the module docstring)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RunLock(_HeldLock):
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
        try:
            _check_no_ranks(self.path.parent / RANKS_LOCK_FILE)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)  # a dead holder's record: replace it with ours
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file, opened without truncating it (a live holder's record must survive a refused run)."""
        return _open_lock(self.path)


class RanksLock(_HeldLock):
    """A shared flock on ``run_dir/ranks.lock``, held by every rank of a distributed run while it lives (the
    kernel drops it when the rank dies, however it dies). Taken once rank 0 holds the ``RunLock``."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / RANKS_LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RanksLock:
        fd = _open_lock(self.path)
        fcntl.flock(fd, fcntl.LOCK_SH)  # shared: it waits only on a RunLock check in progress, for an instant
        self._fd = fd
        return self


def _check_no_ranks(path: Path) -> None:
    """Refuse when ranks of an earlier run still hold ``path`` (a ``RanksLock``)."""
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise XprepError(f"--output {path.parent}: ranks of an earlier run are still alive (they hold {path}; "
                         f"`fuser {path}` lists them): stop them, or choose another --output") from None
    finally:
        os.close(fd)  # closing drops the lock taken for the check


def _open_lock(path: Path) -> int:
    """A lock file, opened (created with its directory when missing) without truncating it."""
    if not path.exists():  # only then is the run directory (and the file) created
        path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
