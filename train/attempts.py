"""What ran in a run directory: ``logs/attempt-<N>.log``, one per ``xtrain run`` on it.

A run on a shared cluster is many attempts: started, preempted, requeued, resumed with an option changed,
crashed, resumed again. Each attempt leaves a short text log, written by the process that holds the run's
lock (``xtrain run`` alone, the launcher of ``--nproc-per-node`` ranks, or rank 0 under torchrun)::

    attempt 3 of RUN
    command   xtrain run packed --steps 2000 -o RUN
    started   2026-11-27T19:04:11+0000 on node17, pid 4242
    code      git 67a3415 (uncommitted changes)          or: xprep 0.1.0 (installed)
    config    sha256 3f9a… of the resolved config (config.json)
    note      defaults from the run's config RUN/config.json; changed from it: --lr 0.0003 → 0.0001
    note      resuming from step-1200 (checkpoint RUN/checkpoints/step-1200)
    note      stopped by SIGTERM after step 1500/2000 (checkpoint step-1500 saved); ...
    ended     2026-11-27T20:13:52+0000, exit 143: stopped by SIGTERM

An attempt that was killed (SIGKILL, the OOM killer, a lost node) has no ``ended`` line; the next attempt
says so. Rank 0 of a launched job adds its notes (``note``) to the newest log, which its launcher began.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from xprep.prep.errors import XprepError

LOGS = "logs"
_ATTEMPT = re.compile(r"^attempt-(\d+)\.log$")
_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the checkout (or site-packages) this code runs from


def config_digest(config: dict) -> str:
    """sha256 of the resolved config's canonical JSON: equal digests, equal configs."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_version() -> str:
    """The code that runs: the git commit of the checkout (and whether it has uncommitted changes), else the
    installed distribution's version."""
    try:
        head = subprocess.run(["git", "-C", str(_SOURCE_ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and (_SOURCE_ROOT / "train").resolve() == Path(__file__).resolve().parent:
            dirty = subprocess.run(["git", "-C", str(_SOURCE_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return f"git {head.stdout.strip()}" + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return f"xprep {metadata.version('xprep')} (installed)"
    except metadata.PackageNotFoundError:
        return "unknown (neither a git checkout nor an installed distribution)"


class Attempt:
    """The log of the attempt this process owns (``begin``); ``note`` and ``end`` append to it."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def begin(cls, run_dir: Path, config: dict, notes: Sequence[str] = ()) -> Attempt:
        """Create ``logs/attempt-<N>.log`` (N one more than the newest) with what is about to run."""
        logs = Path(run_dir) / LOGS
        logs.mkdir(parents=True, exist_ok=True)
        previous = newest_attempt(run_dir)
        number = 1 if previous is None else int(_ATTEMPT.match(previous.name).group(1)) + 1
        path = logs / f"attempt-{number}.log"
        lines = [f"attempt {number} of {Path(run_dir).resolve()}",
                 f"command   {shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}",
                 f"started   {_now()} on {socket.gethostname()}, pid {os.getpid()}",
                 f"code      {code_version()}",
                 f"config    sha256 {config_digest(config)} of the resolved config (config.json)"]
        if previous is not None and not _ended(previous):
            lines.append(f"note      {previous.name} has no end: that attempt was killed (SIGKILL, out of memory, "
                         "a lost node) or its machine went down")
        lines += [f"note      {n}" for n in notes]
        try:
            with open(path, "x", encoding="utf-8") as f:  # "x": two attempts never share a number
                f.write("\n".join(lines) + "\n")
        except FileExistsError:
            raise XprepError(f"{path}: exists already: another xtrain run started on {run_dir} at the same "
                             "moment; run one at a time") from None
        return cls(path)

    def note(self, text: str) -> None:
        _append(self.path, f"note      {text}")

    def end(self, code: int, reason: str) -> None:
        _append(self.path, f"ended     {_now()}, exit {code}: {reason}")

    def end_with(self, error: BaseException | None) -> None:
        """The end line of an attempt that returned (``error`` None) or raised ``error``."""
        self.end(*exit_of(error))


def exit_of(error: BaseException | None) -> tuple[int, str]:
    """The exit status and reason the CLI gives for a run that ended with ``error`` (None: finished)."""
    if error is None:
        return 0, "finished"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, XprepError):
        return error.exit_code, f"error: {first}"
    code = getattr(error, "exit_code", None)
    if code is not None:  # xprep.train.preempt.Stopped, xprep.train.launch.RanksFailed
        return int(code), first
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(error, SystemExit):
        return (error.code if isinstance(error.code, int) else 1), "exit"
    return 1, f"{type(error).__name__}: {first}"


def newest_attempt(run_dir: Path) -> Path | None:
    logs = Path(run_dir) / LOGS
    found = [(int(m.group(1)), p) for p in logs.iterdir() if (m := _ATTEMPT.match(p.name))] if logs.is_dir() else []
    return max(found)[1] if found else None


def note(run_dir: Path, text: str) -> None:
    """Add a line to the run's newest attempt log (rank 0 of a launched job: its launcher began it)."""
    path = newest_attempt(run_dir)
    if path is not None:
        _append(path, f"note      {text}")


def _ended(path: Path) -> bool:
    try:
        return any(line.startswith("ended ") for line in path.read_text(encoding="utf-8").splitlines())
    except OSError:
        return True  # unreadable: say nothing about it


def _append(path: Path, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
