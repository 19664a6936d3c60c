"""Ctrl-C during `xprep pack` (issue 29): at whatever moment it comes, in imports, reading or a numba kernel, the
command ends with exit status 130 and the one line `interrupted`, and leaves no temporary entry behind."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter

DOCUMENTS = 600_000  # short documents: packing them keeps the kernels busy for about a second
FEW = 2_000  # the warm-up's: the same arrays' types, so the same kernels compiled (numba caches them by type)


def write_data(path: Path, documents: int) -> Path:
    """A dataset and a copy of it (another name, same data: a second source, so that a blend is built too)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 24, documents)
    tokens = rng.integers(3, 200, int(lengths.sum())).astype(np.uint16)
    with DatasetWriter(path, 256) as w:
        w.append(tokens, lengths)
        w.finish({"tokenizer": {"path": "t", "vocab_size": 256, "pad_id": 0, "eod_id": 1, "sha256": "a" * 64}},
                 CategoryTable())
    shutil.copytree(path, f"{path}_copy")
    return path


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("interrupt") / "data", DOCUMENTS)


def default_sigint() -> None:
    """In the child, before exec: SIGINT as a terminal gives it. A test run started in the background (``make test
    &``, nohup) ignores SIGINT, and an ignored signal stays ignored across exec: Python would then never see Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pack_command(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", "from xprep import cli; cli.xprep()", "pack", f"{data}@0.5", f"{data}_copy@0.5",
            "-o", str(out), "--method", "multipack", "--seq-len", "256", "--split", "95,5", "--force"]


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(many, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = tmp_path / "P"
    # the first compiles the kernels where numba's cache is cold (on a few documents: compiling is the same work);
    # the second is what a run takes
    for data in (write_data(tmp_path / "few", FEW), many):
        started = time.perf_counter()
        done = subprocess.run(pack_command(data, out), capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
    whole = time.perf_counter() - started
    rng = random.Random(0)
    outcomes = []
    for k in range(12):  # 6 moments at least; more while fewer than 3 landed (a machine whose load fell is faster)
        if k >= 6 and outcomes.count(130) >= 3:
            break
        proc = subprocess.Popen(pack_command(many, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True, preexec_fn=default_sigint)
        delay = rng.uniform(0.6, max(0.7, whole * 0.95))  # past the interpreter's start, before the end
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole process group
        out_text, err = proc.communicate(timeout=120)
        outcomes.append(proc.returncode)
        if proc.returncode == 0 or (proc.returncode == -signal.SIGINT and "blended" in out_text and not err):
            whole = min(whole, delay)  # it finished first (or was stopped as the interpreter exited, its work done
            continue  # and said): later moments are drawn within the time a run takes now
        assert proc.returncode == 130, (k, proc.returncode, err)
        assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err and "Error" not in err, err
        assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")], k
    assert outcomes.count(130) >= 3, outcomes


SPIN = '''
import sys, tempfile
from pathlib import Path
from numba import njit
from xprep.prep.interrupt import run_interruptibly, temporary

@njit(nogil=True)
def spin(n):  # a kernel that does not return to the interpreter for a long while
    x = 0
    for i in range(n):
        x = (x * 6364136223846793005 + i) & 0xFFFFFFFF
    return x

spin(10)  # compiled before the test signals
tmp = Path(sys.argv[1])
tmp.mkdir()

def work():
    with temporary(tmp):
        (tmp / "half-written").write_bytes(b"x")
        print("ready", flush=True)
        return spin(1 << 40)

run_interruptibly(work)
'''


def test_an_interrupt_inside_a_kernel_ends_the_command_at_once(tmp_path):
    """A numba kernel holds the interpreter until it returns (here: hours); the interrupt still ends the command at
    once, with the one line and 130, and the directory being built is removed."""
    tmp = tmp_path / ".tmp-entry"
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True,
                            preexec_fn=default_sigint)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # a kernel that held the interrupt would run for hours
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err)
    assert not tmp.exists()
