"""Checkpoints that are damaged are never loaded, and saves publish as soon as they are written (issue 31).

1. An asynchronous save is published once written, with no later save, flush or finish; a blocking save (a
   preemption's) is published before it returns, even under async_save, and an exception raised while it waits
   (a signal handler's) waits for the publication.
2. Every file is recorded with its size and sha256 in trainer.json: a damaged or incomplete checkpoint is skipped
   by --resume auto (one line naming it and why; the previous one is used), refused by --resume PATH and by
   `xtrain export --step`, and the same for a run directory's latest.
5. keep=None keeps every checkpoint; no_save writes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from xprep.prep.errors import XprepError
from xprep.train import checkpoint
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import FILES, LATEST, TRAINER_JSON, damage
from xprep.train.dist import ParallelDims
from xprep.train.hf_weights import checkpoint_path

PACK = "pack-key"
HANG_GUARD_S = 60  # only so that a broken save fails the test instead of hanging it


def model_and_optimizer(value: float = 0.0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    fill(model, value)
    return model, optimizer


def fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def loaded_value(m: CheckpointManager, path: Path) -> float:
    """The value every parameter of the checkpoint at ``path`` holds (``fill``)."""
    model, optimizer = model_and_optimizer()
    m.load(path, model, optimizer, PACK)
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique()
    assert len(values) == 1, values
    return float(values[0])


def state(step: int) -> dict:
    return {"loss": 1.0 / step, "pack_key": PACK}


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's writes of every save wait for ``release``; ``writing`` is set once one has started."""
    writing, release = threading.Event(), threading.Event()
    real = checkpoint._DigestingWriter.write_data

    def write_data(self, plan, planner):
        writing.set()
        assert release.wait(HANG_GUARD_S), "never released"
        return real(self, plan, planner)
    monkeypatch.setattr(checkpoint._DigestingWriter, "write_data", write_data)
    return writing, release


def wait_for_poll(m: CheckpointManager) -> Path:
    deadline = time.monotonic() + HANG_GUARD_S
    while (done := m.poll()) is None:
        assert time.monotonic() < deadline, "the save never ended"
        time.sleep(0.01)
    return done


# ------------------------------------------------------------------------------------------ 1: publication
def test_an_async_save_is_published_once_written_without_another_save(tmp_path, held_writes):
    writing, release = held_writes
    m = CheckpointManager(tmp_path, ParallelDims(), async_save=True)
    model, optimizer = model_and_optimizer(1.0)
    m.save(1, model, optimizer, state(1))
    fill(model, 2.0)  # training goes on while the checkpoint is written: it holds the state at the save
    assert writing.wait(HANG_GUARD_S)
    assert m.poll() is None and m.latest() is None  # being written: not published
    release.set()
    assert wait_for_poll(m) == m.root / "step-1"
    assert m.latest() == m.root / "step-1" and loaded_value(m, m.latest()) == 1.0  # no save, flush nor finish since

    m.save(2, model, optimizer, state(2))  # the run's last save: published by finish
    m.finish()
    assert m.latest() == m.root / "step-2" and loaded_value(m, m.latest()) == 2.0


def test_a_blocking_save_is_published_before_it_returns(tmp_path):
    m = CheckpointManager(tmp_path, ParallelDims(), keep=None, async_save=True)
    model, optimizer = model_and_optimizer(1.0)
    m.save(1, model, optimizer, state(1))  # in flight
    fill(model, 2.0)
    assert m.save(2, model, optimizer, state(2), blocking=True) == m.root / "step-2"
    assert m.steps() == [1, 2] and m.latest() == m.root / "step-2" and m.poll() is None
    before = (m.root / "step-2" / TRAINER_JSON).stat().st_mtime_ns
    assert m.save(2, model, optimizer, state(2), blocking=True) == m.root / "step-2"  # saved already: not again
    assert (m.root / "step-2" / TRAINER_JSON).stat().st_mtime_ns == before
    assert [loaded_value(m, m.root / f"step-{n}") for n in (1, 2)] == [1.0, 2.0]


def test_a_signal_during_a_blocking_save_waits_for_its_publication(tmp_path, held_writes):
    """A handler that raises (as Python's default SIGINT handler does) while the main thread waits: the
    checkpoint is still written and published, and the exception comes after."""
    writing, release = held_writes
    handled = threading.Event()

    def handler(signum, frame):
        handled.set()
        raise KeyboardInterrupt

    def signal_then_release():
        assert writing.wait(HANG_GUARD_S)
        os.kill(os.getpid(), signal.SIGUSR1)
        handled.wait(HANG_GUARD_S)
        release.set()

    m = CheckpointManager(tmp_path, ParallelDims(), async_save=True)
    model, optimizer = model_and_optimizer(3.0)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        helper = threading.Thread(target=signal_then_release)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            m.save(3, model, optimizer, state(3), blocking=True)
        helper.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handled.is_set() and m.latest() == m.root / "step-3" and damage(m.root / "step-3") is None


class SignalInSubmit(checkpoint.ThreadPoolExecutor):
    """A signal handler's exception raised inside the next ``submit``: once the writer has picked the save up
    (``writing``), or before the save was queued (``queued=False``), as a signal landing there on a busy machine
    does."""

    def __init__(self, writing: threading.Event, queued: bool, **kwargs):
        super().__init__(**kwargs)
        self.writing, self.queued, self.interrupt = writing, queued, True

    def submit(self, *args, **kwargs):
        if not self.interrupt:
            return super().submit(*args, **kwargs)
        self.interrupt = False
        if self.queued:
            super().submit(*args, **kwargs)
            assert self.writing.wait(HANG_GUARD_S)
        raise KeyboardInterrupt


def test_a_signal_inside_the_submission_of_a_blocking_save_waits_for_its_publication(tmp_path, held_writes,
                                                                                    monkeypatch):
    writing, release = held_writes
    monkeypatch.setattr(checkpoint, "ThreadPoolExecutor", lambda **kw: SignalInSubmit(writing, True, **kw))
    m = CheckpointManager(tmp_path, ParallelDims(), async_save=True)
    model, optimizer = model_and_optimizer(3.0)
    threading.Timer(0.5, release.set).start()  # the write ends after the exception was raised
    with pytest.raises(KeyboardInterrupt):
        m.save(3, model, optimizer, state(3), blocking=True)
    assert m.latest() == m.root / "step-3" and damage(m.root / "step-3") is None


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
def test_a_signal_before_the_save_was_queued_leaves_no_save_in_flight(tmp_path, monkeypatch, blocking):
    """The save never reached the writer: nothing waits for it (no hang), and the next save of that step runs."""
    monkeypatch.setattr(checkpoint, "ThreadPoolExecutor", lambda **kw: SignalInSubmit(threading.Event(), False, **kw))
    m = CheckpointManager(tmp_path, ParallelDims(), async_save=True)
    model, optimizer = model_and_optimizer(4.0)
    with pytest.raises(KeyboardInterrupt):
        m.save(4, model, optimizer, state(4), blocking=blocking)
    assert m.poll() is None
    assert m.save(4, model, optimizer, state(4), blocking=True) == m.root / "step-4"
    m.finish()
    assert m.latest() == m.root / "step-4" and loaded_value(m, m.latest()) == 4.0


# ------------------------------------------------------------------------------------------ 2: digests
def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_trainer_json(path: Path) -> None:  # still valid JSON, its numbers changed
    saved = json.loads(path.read_text())
    saved["step"] += 1
    path.write_text(json.dumps(saved))


DAMAGE = {  # what is done to step-2's file, and what the one line says
    "flipped bit in .distcp": ("__0_0.distcp", flip_a_bit, "damaged (__0_0.distcp: its sha256 differs"),
    "truncated .distcp": ("__0_0.distcp", truncate, "damaged (__0_0.distcp is "),
    "missing .metadata": (".metadata", Path.unlink, "incomplete (.metadata is missing)"),
    "garbage rng-0.pt": ("rng-0.pt", lambda p: p.write_bytes(os.urandom(p.stat().st_size)),
                         "damaged (rng-0.pt: its sha256 differs"),
    "corrupt trainer.json": (TRAINER_JSON, truncate, "damaged (trainer.json is unreadable"),
    "edited trainer.json": (TRAINER_JSON, edit_trainer_json, "damaged (trainer.json differs from its recorded digest)"),
}


@pytest.fixture
def two_steps(tmp_path) -> CheckpointManager:
    """A run with step-1 and step-2 saved (their parameters hold 1.0 and 2.0), latest naming step-2."""
    m = CheckpointManager(tmp_path / "run", ParallelDims(), keep=None)
    model, optimizer = model_and_optimizer()
    for step in (1, 2):
        fill(model, float(step))
        m.save(step, model, optimizer, state(step))
    m.finish()
    assert set(json.loads((m.root / "step-2" / TRAINER_JSON).read_text())[FILES]) == {
        "__0_0.distcp", ".metadata", "rng-0.pt"}
    return m


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_is_skipped_or_refused_in_one_line(two_steps, kind):
    m, (name, spoil, said) = two_steps, DAMAGE[kind]
    spoil(m.root / "step-2" / name)
    run = m.root.parent
    fresh = CheckpointManager(run, ParallelDims())
    assert fresh.resolve("auto") == m.root / "step-1" and loaded_value(fresh, m.root / "step-1") == 1.0
    assert fresh.note.startswith(f"{m.root / LATEST} names step-2, which is {said}"), fresh.note
    assert fresh.note.endswith(": using step-1, the newest complete checkpoint") and "\n" not in fresh.note
    assert fresh.resolve(str(run)) == m.root / "step-1" and fresh.latest() == m.root / "step-1"  # a run directory
    for refused in (lambda: fresh.resolve(str(m.root / "step-2")), lambda: checkpoint_path(run, 2)):
        with pytest.raises(XprepError) as error:
            refused()
        assert "not a complete checkpoint, it is " + said in str(error.value) and "\n" not in str(error.value)
    assert checkpoint_path(run, None) == m.root / "step-1"  # xtrain export's default: the one resume would take


def test_every_checkpoint_damaged_is_refused_naming_each(two_steps):
    m = two_steps
    truncate(m.root / "step-2" / "__0_0.distcp")
    (m.root / "step-1" / "rng-0.pt").unlink()
    (m.root / LATEST).unlink()
    with pytest.raises(XprepError) as error:
        CheckpointManager(m.root.parent, ParallelDims()).resolve("auto")
    said = str(error.value)
    assert said.startswith(f"{m.root / LATEST} is missing, and no step-<N> in {m.root} is a complete checkpoint ("), \
        said
    assert "step-2: damaged (__0_0.distcp is " in said and "step-1: incomplete (rng-0.pt is missing)" in said
    assert "\n" not in said


def test_several_skipped_checkpoints_each_get_a_line(two_steps):
    m = two_steps
    model, optimizer = model_and_optimizer(3.0)
    m.save(3, model, optimizer, state(3))
    (m.root / "step-3" / ".metadata").unlink()
    flip_a_bit(m.root / "step-2" / "__0_0.distcp")
    fresh = CheckpointManager(m.root.parent, ParallelDims())
    assert fresh.resolve("auto") == m.root / "step-1"
    assert fresh.note.splitlines() == [
        "skipping step-2: damaged (__0_0.distcp: its sha256 differs from the one trainer.json records)",
        f"{m.root / LATEST} names step-3, which is incomplete (.metadata is missing): using step-1, the newest "
        "complete checkpoint"]


# ------------------------------------------------------------------------------------------ 5: keep all, no save
def test_keep_none_keeps_every_checkpoint_and_no_save_writes_nothing(tmp_path):
    model, optimizer = model_and_optimizer()
    every = CheckpointManager(tmp_path / "all", ParallelDims(), keep=None)
    for step in range(1, 6):
        every.save(step, model, optimizer, {"loss": float(step), "pack_key": PACK})  # step-1 is the best
    every.finish()
    assert every.steps() == [1, 2, 3, 4, 5]
    none = CheckpointManager(tmp_path / "none", ParallelDims(), no_save=True, async_save=True)
    assert none.save(1, model, optimizer, state(1)) is None
    assert none.save(2, model, optimizer, state(2), blocking=True) is None
    none.finish()
    assert not (tmp_path / "none").exists()
    assert none.resolve(str(every.root / "step-3")) == every.root / "step-3"  # reading still works
