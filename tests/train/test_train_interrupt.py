"""Ctrl-C ends every launch the same way: a checkpoint of the step reached, what was done said once, and exit
status 130 (issue 29, point 11; issue 31 added the checkpoint: tests/test_preemption.py has the rest).

With `--nproc-per-node 2` it printed ~100 lines of tracebacks from the launcher and both ranks. The test
sends SIGINT to the process group of `xtrain run` (what a terminal's Ctrl-C does) once training is under
way, and reads what the command wrote to stderr from then on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainkit import category_pack

ROOT = Path(__file__).resolve().parents[2]
XTRAIN = str(Path(sys.executable).with_name("xtrain"))
HANG_GUARD_S = 180  # only so that a broken launch fails the test instead of hanging it


def wait_for_steps(run: Path, proc: subprocess.Popen, steps: int) -> None:
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + HANG_GUARD_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, f"xtrain ended early ({proc.returncode})"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """Leave nothing running: SIGTERM first (the launcher's agent stops its ranks), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass


def test_ctrl_c_on_two_ranks_saves_says_it_once_and_exits_130(tmp_path):
    """Rank 0 says it; the launcher and the other rank say nothing."""
    packed, run, err = category_pack(tmp_path), tmp_path / "run", tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([XTRAIN, "run", str(packed), "--steps", "100000", "--log-every", "100000",
                                 "--output", str(run), "--nproc-per-node", "2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for_steps(run, proc, 2)
        before = len(err.read_text())
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=HANG_GUARD_S)
    finally:
        stop(proc)
    said = err.read_text()[before:].splitlines()
    assert code == 130, (code, said)
    step = int(said[-1].split("after step ")[1].split("/")[0])
    assert said == [f"SIGINT received: saving a checkpoint of step {step} before stopping",
                    f"stopped by SIGINT after step {step}/100000 (checkpoint step-{step} saved); the same command, "
                    f"or `xtrain run -o {run}`, resumes"], said
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
