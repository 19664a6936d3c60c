"""Checkpoints on slow storage (issue 30, point 8): waiting for rank 0 is not under training's collective timeout,
and old checkpoints are deleted off the critical path.

(a) Rank 0 publishes (fsync, renames) and retires checkpoints while the others wait: over a gloo group of the
    checkpoints' own with ``--checkpoint-timeout`` (hours), not the default group's ``--dist-timeout``.
(b) Retiring renames ``step-<N>`` to ``.retired-*`` (atomic) and a thread deletes it: a save returns while the
    deletion is still going on, nothing resolves a retired directory as a checkpoint, the end of a run waits for
    the deletions, and what a killed run left is deleted by the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from xprep.prep.errors import XprepError
from xprep.train.checkpoint import CKPT_TIMEOUT_ENV, DEFAULT_CKPT_TIMEOUT_S, CheckpointManager
from xprep.train.ckpt_files import LATEST, RETIRED_PREFIX, TRAINER_JSON
from xprep.train.config import CheckpointSection
from xprep.train.dist import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def retired(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(RETIRED_PREFIX))


# ------------------------------------------------------------------------------------------ (a) the timeout
def test_a_slow_publication_outlasts_the_collective_timeout(tmp_path):
    """2 gloo ranks whose default group times out after 0.2 s, rank 0's fsync and deletes 0.8 s each: saves
    (synchronous and asynchronous, retiring the step before) complete on both ranks. (The ranks are started
    directly, meeting through a file: no launcher to import torch first.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_ckpt_worker.py"), str(tmp_path), str(r), "2"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        said = [rank.communicate(timeout=150)[0] for rank in ranks]
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"checkpoint worker hung for {e.timeout}s")
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0] and "checkpoints ok" in said[0], "\n".join(said)[-4000:]


def test_the_checkpoint_timeout_is_its_option_else_its_variable(monkeypatch):
    """--checkpoint-timeout, else $XTRAIN_CKPT_TIMEOUT (its documented default), else 4 h; the manager itself reads
    no environment."""
    def timeout(**section) -> float:
        return CheckpointSection(**section).build(Path("run"), ParallelDims()).timeout.total_seconds()

    monkeypatch.delenv(CKPT_TIMEOUT_ENV, raising=False)
    assert timeout() == DEFAULT_CKPT_TIMEOUT_S == 4 * 3600
    monkeypatch.setenv(CKPT_TIMEOUT_ENV, "90.5")
    assert timeout() == 90.5 and timeout(checkpoint_timeout=30) == 30
    assert CheckpointManager("run", ParallelDims()).timeout.total_seconds() == DEFAULT_CKPT_TIMEOUT_S
    for bad in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(CKPT_TIMEOUT_ENV, bad)
        with pytest.raises(XprepError, match=rf"\${CKPT_TIMEOUT_ENV}='{bad}': must be a number of seconds > 0"):
            CheckpointSection()
    monkeypatch.delenv(CKPT_TIMEOUT_ENV)
    with pytest.raises(XprepError, match="--checkpoint-timeout -1: must be a number of seconds > 0"):
        CheckpointSection(checkpoint_timeout=-1)


# ------------------------------------------------------------------------------------------ (b) retiring
@pytest.fixture
def held_deletes(monkeypatch):
    """shutil.rmtree that waits for ``release`` when called off the main thread, and refuses on it (there,
    a delete would be on the critical path)."""
    release, started = threading.Event(), threading.Event()
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            raise AssertionError(f"{path} deleted on the critical path")
        started.set()
        assert release.wait(60), "never released"
        return real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return release, started


def test_a_save_returns_before_the_deletion_it_starts(tmp_path, held_deletes):
    release, started = held_deletes
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    m = CheckpointManager(tmp_path, ParallelDims(), keep=1)
    m.save(1, model, opt, {"loss": 2.0})
    m.save(2, model, opt, {"loss": 1.0})  # retires step-1; its deletion waits for `release`
    assert started.wait(60)
    [gone] = retired(m.root)
    assert gone.startswith(f"{RETIRED_PREFIX}step-1-") and (m.root / gone / TRAINER_JSON).is_file()
    assert m.steps() == [2] and m.best() == "step-2" and m.latest() == m.root / "step-2"
    assert m.resolve("auto") == m.root / "step-2" and m.resolve(str(m.root)) == m.root / "step-2"
    with pytest.raises(XprepError, match="a retired checkpoint, being deleted"):
        m.resolve(str(m.root / gone))
    m.save(3, model, opt, {"loss": 0.5})  # saving goes on while a deletion is under way
    assert m.steps() == [3] and len(retired(m.root)) == 2
    release.set()
    m.finish()  # the end of the run waits for the deletions
    assert sorted(p.name for p in m.root.iterdir()) == ["latest", "step-3"]


def test_what_a_killed_run_left_is_deleted_by_the_next(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    first = CheckpointManager(tmp_path, ParallelDims(), keep=1)
    first.save(2, model, opt, {"loss": 1.0})
    root = first.root
    shutil.copytree(root / "step-2", root / f"{RETIRED_PREFIX}step-1-0a1b2c3d")  # retired, not yet deleted
    (root / f"{RETIRED_PREFIX}step-1-0a1b2c3d" / ".metadata").unlink()  # half deleted: trainer.json is left
    (root / ".step-3.tmp").mkdir()  # a save killed while writing
    (root / ".step-3.tmp" / "__0_0.distcp").write_bytes(b"partial")

    second = CheckpointManager(tmp_path, ParallelDims(), keep=1)  # the next run, resuming
    assert second.steps() == [2] and second.resolve("auto") == root / "step-2" and second.best() == "step-2"
    second.save(3, model, opt, {"loss": 0.5})
    second.finish()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3"]
    assert json.loads((root / "step-3" / TRAINER_JSON).read_text())["loss"] == 0.5


def test_latest_never_names_a_retired_directory(tmp_path):
    m = CheckpointManager(tmp_path, ParallelDims())
    (m.root / f"{RETIRED_PREFIX}step-4-0a1b2c3d").mkdir(parents=True)
    (m.root / f"{RETIRED_PREFIX}step-4-0a1b2c3d" / TRAINER_JSON).write_text("{}")
    (m.root / LATEST).write_text(f"{RETIRED_PREFIX}step-4-0a1b2c3d\n")
    with pytest.raises(XprepError, match=r"which is retired \(being deleted\), and no step-<N>"):
        m.resolve("auto")  # nothing else to resume either: refused
    (m.root / "step-2").mkdir()
    for name in (TRAINER_JSON, ".metadata"):
        (m.root / "step-2" / name).write_text("{}")
    assert m.resolve("auto") == m.root / "step-2" and "using step-2" in m.note


def test_the_copy_latest_names_after_a_killed_resave_goes_once_latest_moves_on(tmp_path):
    """A run killed while re-saving a step left `latest` naming the hard-linked copy of the step being replaced:
    the next run resumes from it, and its first publication deletes it."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    first = CheckpointManager(tmp_path, ParallelDims(), keep=5)
    first.save(2, model, opt, {"loss": 1.0})
    root, copy = first.root, first.root / ".step-2.old-0a1b2c3d"
    shutil.copytree(root / "step-2", copy, copy_function=os.link)
    (root / LATEST).write_text(f"{copy.name}\n")

    second = CheckpointManager(tmp_path, ParallelDims(), keep=5)
    assert second.resolve("auto") == copy and second.note is None
    second.save(3, model, opt, {"loss": 0.5})
    second.finish()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-3"]
