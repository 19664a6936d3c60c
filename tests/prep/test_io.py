"""xprep.prep.io: every way an output path can be unusable is one clear XprepError, up front; temporary directories are
removed as stale only when their owner is certainly gone."""

from __future__ import annotations

from pathlib import Path

import pytest
from xprep.prep.errors import XprepError
from xprep.prep.io import check_output_dir


def test_usable_paths_pass(tmp_path):
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert check_output_dir(tmp_path / "full", allow_nonempty=True) == tmp_path / "full"
    assert not [p for p in tmp_path.rglob(".xprep-probe-*")]


@pytest.mark.parametrize(
    ("make", "target", "needle"),
    [
        (lambda d: (d / "afile").write_text(""), "afile", "exists and is a file"),
        (lambda d: (d / "afile").write_text(""), "afile/sub", "is a file, not a directory"),
        (lambda d: ((d / "full").mkdir(), (d / "full" / "x").write_text("x")), "full", "not empty"),
    ],
)
def test_unusable_paths_name_the_problem(tmp_path, make, target, needle):
    make(tmp_path)
    with pytest.raises(XprepError, match=needle) as e:
        check_output_dir(tmp_path / target)
    assert str(tmp_path / target) in str(e.value)


def test_unwritable_location(tmp_path):
    with pytest.raises(XprepError, match="cannot write in /proc"):
        check_output_dir("/proc/forbidden")


# -- temporary directories and their owners (issue 31) ------------------------------------------------------------
def _record(path, **fields) -> None:
    """Overwrite a TempDir's owner record (as another process, host or boot would have written it)."""
    import json

    from xprep.prep.io import OWNER, owner_record

    (path / OWNER).write_text(json.dumps({**owner_record(), **fields}))


def test_a_temp_dir_is_judged_by_its_owners_lock_host_boot_and_start_never_by_a_pid_alone(tmp_path):
    """What ``remove_stale_temps`` deletes: a temporary directory whose owner record names this host and a pid that
    runs no process, a process started at another time (the pid reused) or a process of an earlier boot. Never one
    whose owner still holds its lock, one whose record names another host (whose pids mean nothing here), or one
    without a record."""
    import os
    import socket
    import subprocess
    import sys

    from conftest import REPO_ROOT
    from xprep.prep.io import OWNER, TempDir, owner_gone, remove_stale_temps

    holder = subprocess.Popen(  # a live owner, in another process, holding its lock
        [sys.executable, "-c", "import sys, time; from xprep.prep.io import TempDir; t = TempDir(sys.argv[1], "
         "'.x.tmp-live-'); print(t.path, flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        live = Path(holder.stdout.readline().strip())
        _record(live, pid=999_999_999)  # even with a record that looks dead, the held lock says it lives
        temps = {name: TempDir(tmp_path, f".x.tmp-{name}-") for name in
                 ("dead", "reused", "rebooted", "elsewhere", "elsewhere-dead", "mine", "unrecorded")}
        for t in temps.values():
            t.release()  # (as if their owners had died: no lock held, the record put back below)
        _record(temps["dead"].path, pid=999_999_999)
        _record(temps["reused"].path, pid=os.getppid(), pid_start=1)  # a live pid, but not the process that wrote it
        _record(temps["rebooted"].path, pid=os.getppid(), boot_id="an earlier boot")
        _record(temps["elsewhere"].path, host=socket.gethostname() + "-b", pid=os.getppid())
        _record(temps["elsewhere-dead"].path, host=socket.gethostname() + "-b", pid=999_999_999)
        _record(temps["mine"].path)  # this process, alive
        gone = {name for name, t in temps.items() if owner_gone(t.path)}
        assert gone == {"dead", "reused", "rebooted"} and not owner_gone(live)
        remove_stale_temps(tmp_path, ".x.tmp-*")
        assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == sorted(
            ["live", "elsewhere", "elsewhere", "mine", "unrecorded"])
        assert (live / OWNER).is_file()
    finally:
        holder.kill()
        holder.wait()
    assert owner_gone(live)  # its owner died (the kernel dropped its lock): now it is stale
