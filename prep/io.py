"""File-system plumbing shared by every command, written once.

- ``check_output_dir``: an output path that cannot be used is one clear error before any work;
- ``write_atomic`` / ``write_json_atomic``: a file appears whole or not at all (temp in the same
  directory, fsync, rename, fsync of the directory), so a crash never leaves half a file;
- ``fsync_tree`` / ``fsync_dir``: make a directory built in a temp place durable before it is renamed;
- ``read_json``: a JSON file, or one clear error naming the file, the problem and the fix;
- ``file_sha256``: the digest of a file of any size, or one clear error naming it;
- ``OutputLock``: one writer at a time for an output path (a second is one clear error naming the first);
- ``TempDir`` / ``remove_stale_temps``: a temporary directory that records its owner (host, pid, boot, process
  start) under a lock, and the clean-up of those whose owner is gone, which never judges another host's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from xprep.prep.errors import XprepError


def check_output_dir(path: str | Path, *, option: str = "-o", allow_nonempty: bool = False) -> Path:
    """Fail early, with one message naming the path and the problem, unless a directory can be made at ``path``.

    Checked before any work so a long run never ends in a traceback at publish time: ``path`` must not be a
    file, must be empty unless ``allow_nonempty``, and the nearest existing ancestor must be a directory in
    which this process can really create one (probed with a throw-away directory: permission bits alone do
    not tell, e.g. root in /proc).
    """
    out = Path(path)
    shown = f"{option} {path}"
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise XprepError(f"{shown}: exists and is a file, not a directory; remove it or choose another {option}")
    if out.is_dir():
        if not allow_nonempty and any(out.iterdir()):
            raise XprepError(f"{shown}: already exists and is not empty; remove it or choose another {option}")
        _probe(out, shown, option)
        return out
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise XprepError(f"{shown}: cannot create it, {ancestor} is a file, not a directory; choose another {option}")
    _probe(ancestor, shown, option)
    return out


def _probe(directory: Path, shown: str, option: str) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".xprep-probe-", dir=directory))
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise XprepError(f"{shown}: cannot write in {directory} ({reason}); choose another {option}") from None


def check_output_file(path: str | Path, option: str, what: str, example: str) -> Path:
    """Fail early, with one message, unless a file can be written at ``path`` (``option`` names the flag in
    messages; ``what`` the kind of file and ``example`` its name, suggested when ``path`` is a directory): not a
    directory, in an existing
    directory in which this process can really create a file (permission bits alone do not tell: root,
    read-only mounts)."""
    out, shown = Path(path), f"{option} {path}"
    if out.is_dir():
        raise XprepError(f"{shown}: is a directory; name the {what} file, e.g. {option} {out / example}")
    parent = out.parent
    if not parent.exists():
        raise XprepError(f"{shown}: directory {parent} does not exist; create it or choose another {option}")
    if not parent.is_dir():
        raise XprepError(f"{shown}: {parent} is not a directory; choose another {option}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".xprep-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise XprepError(f"{shown}: cannot write in {parent} ({e.strerror}); choose another {option}") from None
    return out


def write_atomic(path: str | Path, data: str | bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename: readers see the old file or the new.

    ``durable`` fsyncs the file before the rename and the directory after it (the rename survives a crash);
    without it only the rename is atomic (for files rewritten often whose loss costs little).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj, durable: bool = True) -> None:
    """``obj`` as indented UTF-8 JSON (one trailing newline), written by ``write_atomic``."""
    write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n", durable)


def remove_tree(path: str | Path) -> None:
    """Remove a directory without a moment in which a reader (or a rename onto it) finds part of it: renamed away
    whole, under a hidden name beside it, then deleted. Gone already is fine."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.removing-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, aside)
    except OSError:  # gone already (another process moved it), or not ours to move: left to the caller's next step
        return
    shutil.rmtree(aside, ignore_errors=True)


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (names created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file below ``path``, then every directory (deepest first): all of it is on disk."""
    path = Path(path)
    directories = [path]
    for root, dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        directories += [Path(root) / d for d in dirs]
    for directory in reversed(directories):
        fsync_dir(directory)


def read_json(path: str | Path, what: str, fix: str):
    """The JSON value in ``path``; a missing, unreadable or malformed file is one XprepError naming it.

    ``what`` says what the file is ("pack manifest"), ``fix`` what to do ("re-run `xprep pack`").
    """
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise XprepError(f"{path}: no such file (the {what}); {fix}") from None
    except OSError as e:
        raise XprepError(f"{path}: cannot read the {what} ({e.strerror}); {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XprepError(f"{path}: the {what} is not valid JSON ({e}); {fix}") from None


def file_sha256(path: str | Path, fix: str) -> str:
    """Hex sha256 of the file at ``path``, read in 16 MiB blocks (a file of any size, in little memory).

    An unreadable file is one XprepError naming it, ending in ``fix``.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                digest.update(block)
    except OSError as e:
        raise XprepError(f"{path}: cannot read ({e.strerror}); {fix}") from None
    return digest.hexdigest()


class OutputLock:
    """One writer at a time for an output path: an exclusive, non-blocking ``fcntl.flock`` on ``.NAME.lock`` beside it,
    held from before anything is written until the output is published (or given up).

    Two commands writing the same output would each build their own temporary directory, and the second to publish
    would find the first's there (``OSError: Directory not empty``) after all its work. With the lock the second stops
    at the start, with one error naming the first (pid, host, start time, command); nothing of the first's is touched.
    The kernel drops a flock when its holder dies, however it dies, so a killed run never blocks the next. The file is
    removed on release, while still locked; a process that opened it just before then finds, once it holds the lock,
    that the name no longer leads to the file it locked, and starts again on the new one.
    """

    def __init__(self, out: str | Path, option: str = "-o"):
        out = Path(out)
        self.path = out.with_name(f".{out.name}.lock")
        self.shown = f"{option} {out}"
        self.option = option
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(read_holder(fd))
                os.close(fd)
                raise XprepError(f"{self.shown}: another process is writing it ({holder}; lock file {self.path}); "
                                 f"wait for it to end, or choose another {self.option}") from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # released and removed by its holder between our open and our lock: the name is free again
        os.ftruncate(fd, 0)  # a dead holder's record: replace it with ours
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": _command_line()}
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (the removal first, while this process still holds it)."""
        if self._fd is None:
            return
        if _same_file(self._fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # (closing drops the flock)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _command_line(limit: int = 160) -> str:
    """This process's command line (the program by its name), cut to ``limit`` characters: to name it to another."""
    line = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def read_holder(fd: int) -> dict:
    """The record (pid, host, start, command) a lock's holder wrote into its lock file; {} when unreadable."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def describe_holder(record: dict) -> str:
    """A lock holder's record as words, to name it to whoever is refused the lock."""
    if not record.get("pid"):
        return "its holder is not recorded yet"
    command = f", command: {record['command']}" if record.get("command") else ""
    return f"pid {record['pid']} on host {record.get('host', '?')}, started {record.get('started', '?')}{command}"


# ------------------------------------------------------------------------------------------- temporaries
OWNER = ".owner"  # inside a TempDir: its owner's record, locked by the owner for as long as it lives


class TempDir:
    """A temporary directory this process builds, created under a fresh name ``PREFIX<random>`` with its owner
    recorded inside it (``.owner``: host, pid, boot id, the process's start time) and an exclusive ``flock`` held on
    that record until ``release`` (or the process's death: the kernel drops the lock).

    What another process may delete as stale is decided by ``owner_gone`` from the lock and the record, never by a
    pid alone: pids are per host (and per container), and are reused. ``release`` removes the record before the
    directory is published (renamed into place) or after it was removed; it is no part of the output.
    """

    def __init__(self, parent: str | Path, prefix: str):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._fd: int | None = os.open(self.path / OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else can hold it
        os.pwrite(self._fd, (json.dumps(owner_record()) + "\n").encode(), 0)

    def release(self) -> None:
        """Remove the owner record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / OWNER)
        os.close(self._fd)
        self._fd = None


def owner_record() -> dict:
    """Who this process is, for a TempDir's record: host, pid, and what tells this pid apart from a later process
    given the same one (the boot, and the process's start time since boot), where the system says (Linux)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(), "pid_start": _process_start(pid),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def owner_gone(path: str | Path) -> bool:
    """Whether the owner of TempDir ``path`` has certainly ended, so that the directory may be deleted.

    Alive (False) while its owner holds the lock on its record. A record naming another host is never judged here
    (False): on a shared filesystem, only the owner's host can tell whether it lives (a lock may not reach across
    hosts). On this host the owner is gone if this machine booted since, if its pid runs no process, or if it runs
    a process started at another time (the pid was reused). A directory without a record (one being created this
    instant, or left by an xprep that did not write them) is not judged either.
    """
    try:
        fd = os.open(Path(path) / OWNER, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        record = read_holder(fd)
    finally:
        os.close(fd)  # (drops the lock just taken)
    return _dead_here(record)


def _dead_here(record: dict) -> bool:
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    boot = _boot_id()
    if record.get("boot_id") and boot and record["boot_id"] != boot:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    start = record.get("pid_start")
    return start is not None and _process_start(pid) not in (None, start)


def remove_stale_temps(parent: str | Path, pattern: str) -> None:
    """Delete the TempDirs matching ``pattern`` in ``parent`` whose owner is gone (``owner_gone``)."""
    for tmp in Path(parent).glob(pattern):
        if tmp.is_dir() and owner_gone(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat); None where unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
