"""One writer per run directory (train/rundir.py): a live run's directory is refused, a dead run's lock is taken
over, and a run releases its lock when it ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from trainkit import category_pack
from xprep.cli import xtrain
from xprep.train import trainer
from xprep.train.rundir import LOCK_FILE, RunLock

ROOT = Path(__file__).resolve().parents[2]
TRY = "import sys; from xprep.train.rundir import RunLock; RunLock(sys.argv[1]).acquire()"
HOLD = TRY + "; import time; print('held', flush=True); time.sleep(120)"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return category_pack(tmp_path_factory.mktemp("data"))


def holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run directory's lock (as a live `xtrain run` does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def train(packed: Path, run_dir: Path, *args: str):
    return CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "2", "-o", str(run_dir), "--log-every", "100",
                                       *args])


def test_a_live_holder_is_refused_with_one_line(packed, tmp_path):
    run_dir = tmp_path / "run"
    first = train(packed, run_dir)
    assert first.exit_code == 0, first.output
    proc = holder(run_dir)
    try:
        before = snapshot(run_dir)
        result = train(packed, run_dir, "--steps", "4")
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert lines == [f"error: --output {run_dir}: in use by another run (pid {proc.pid} on host "
                         f"{socket.gethostname()}, started {json.loads(before[LOCK_FILE])['started']}); wait for it "
                         "to end or stop it, or choose another --output"], result.stderr
        assert snapshot(run_dir) == before  # nothing written: no metrics, no checkpoint, the holder's record kept
    finally:
        proc.kill()
        proc.wait()


def test_a_sigkilled_holders_lock_is_taken_over_and_released_at_the_end(packed, tmp_path):
    run_dir = tmp_path / "run"
    proc = holder(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid  # its record stays, its lock does not
    result = train(packed, run_dir)
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    with RunLock(run_dir):  # released when the run ended (this process ran it: a stale lock would still be ours)
        assert subprocess.run([sys.executable, "-c", TRY, str(run_dir)], cwd=ROOT).returncode != 0


def test_a_run_holds_its_lock_while_it_trains(packed, tmp_path, monkeypatch):
    """During a real run another process cannot take the lock, and is told this run's pid."""
    run_dir, seen = tmp_path / "run", []

    def try_lock(t) -> None:
        seen.append(subprocess.run([sys.executable, "-c", TRY, str(run_dir)], cwd=ROOT, capture_output=True,
                                   text=True))

    monkeypatch.setattr(trainer, "STEP_END_CALLBACKS", [try_lock])
    result = train(packed, run_dir, "--steps", "1")
    assert result.exit_code == 0, result.output
    assert len(seen) == 1 and seen[0].returncode != 0 and f"pid {os.getpid()} on host" in seen[0].stderr
    subprocess.run([sys.executable, "-c", TRY, str(run_dir)], cwd=ROOT, check=True)  # free after the run
