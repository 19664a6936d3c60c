"""A small disk that fills up, for tests of what commands do when the disk is full.

``small_disk(where, size)`` mounts a tmpfs of ``size`` (``"256k"``, ``"1m"``: mount's syntax) at the directory
``where`` and yields a ``SmallDisk``. It needs ``mount -t tmpfs``, which works:

- as root (``direct``): the mount is seen by every process, this one included, and unmounted afterwards;
- else inside a user and mount namespace (``unshare --user --map-root-user --mount``, where the kernel allows
  unprivileged user namespaces): the mount exists only there, so commands must be run with ``SmallDisk.run``,
  which mounts it afresh for each (empty at each start).

Where neither works, the test is skipped with the reason. Shared by the tests of ``xprep`` (tokenize, pack,
merge, inspect --html) and of ``xtrain run``'s checkpoints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


@dataclass
class SmallDisk:
    path: Path
    size: str
    direct: bool  # mounted for every process (this one too); else only inside run()'s namespace
    left: list[str] | None = None  # what the last run() left on the disk, by name

    def run(self, argv: list, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, **kwargs)`` where ``path`` is the small disk (text output captured by default);
        ``left`` then names what the command left there."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        argv = [str(a) for a in argv]
        if self.direct:
            result = subprocess.run(argv, **kwargs)
            self.left = sorted(os.listdir(self.path))
            return result
        listing = self.path.with_name(f".{self.path.name}.left")
        script = ('mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; d=$2; out=$3; shift 3; "$@"; rc=$?; '
                  'ls -A "$d" > "$out"; exit $rc')
        result = subprocess.run([*UNSHARE, "sh", "-c", script, "sh", self.size, str(self.path), str(listing), *argv],
                                **kwargs)
        self.left = sorted(listing.read_text().split())
        return result


@contextmanager
def small_disk(where: Path, size: str) -> Iterator[SmallDisk]:
    """A tmpfs of ``size`` at ``where`` (created if need be), or ``pytest.skip`` saying why there can be none."""
    where.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command: cannot make a small disk (tmpfs) to fill")
    if os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0:
        try:
            yield SmallDisk(where, size, direct=True)
        finally:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        return
    probe = subprocess.run([*UNSHARE, *mount], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        why = probe.stderr.strip() if probe is not None else "no `unshare` command"
        pytest.skip(f"cannot mount a small tmpfs here (not root, and no user namespace: {why}); the disk-full "
                    "tests need one")
    yield SmallDisk(where, size, direct=False)
