"""SIGKILL at any moment of checkpointing never leaves a checkpoint that looks complete and is not (issue 31).

A process saves a small model with CheckpointManager in a loop (every parameter holds the step it was saved
at) and is killed with SIGKILL at a random moment (seeded) of or after one of its saves, ten times, each life
resuming from what ``--resume auto`` finds, as a restarted job would. After every kill that checkpoint must be
the newest one the process had reported published (or the one it was saving), pass verification and hold that
step's parameters, and no checkpoint may have been skipped as damaged or incomplete; after the last life
nothing a killed run left remains (temporary directories, retired ones, ``.latest.tmp-*``). The processes are
forked from this one, which has torch imported already (a fresh interpreter takes seconds to import it).
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

import pytest
import torch
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import damage
from xprep.train.dist import ParallelDims

PACK = "pack-key"
LIVES = 10  # killed ones; one more runs to its end
SAVE_EVERY = 3
HANG_GUARD_S = 120  # only so that a broken save fails the test instead of hanging it


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def saving_loop(run: Path, async_save: bool, conn, until: int | None) -> None:
    """One life of the run (in a forked process): resume, then every step set the parameters to the step and
    save every SAVE_EVERY steps, saying ("saving", step) before a save and ("published", step) once it is known
    published (synchronous: when the save returns; asynchronous: when ``poll`` says, or the next save returns).
    Until step ``until`` (then ``finish``, and ("finished", step)), or forever."""
    torch.set_num_threads(1)  # forked after this process's OpenMP may have started: stay out of it
    model, optimizer = build()
    m = CheckpointManager(run, ParallelDims(), keep=2, async_save=async_save)
    start = m.resolve("auto")
    step = m.load(start, model, optimizer, PACK)["step"] if start is not None else 0
    in_flight = None  # the step of the asynchronous save not known published yet
    while until is None or step < until:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        if step % SAVE_EVERY == 0:
            conn.send(("saving", step))
            m.save(step, model, optimizer, {"loss": 1.0 / step, "pack_key": PACK})
            if in_flight is not None:  # a save publishes the one in flight first
                conn.send(("published", in_flight))
            in_flight = step
        done = m.poll()  # synchronous: None (the save has returned: published)
        if in_flight is not None and (done is not None or not async_save):
            assert done in (None, m.root / f"step-{in_flight}"), done
            conn.send(("published", in_flight))
            in_flight = None
        time.sleep(0.01)  # a step's work: an asynchronous save is often written before the next one
    m.finish()
    conn.send(("finished", step))


def life(run: Path, async_save: bool, rng: random.Random | None, until: int | None = None) -> list[tuple[str, int]]:
    """Start a life; with ``rng``, SIGKILL it at a random moment of or after its 1st to 3rd save. What it said."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=saving_loop, args=(run, async_save, send, until))
    proc.start()
    send.close()
    said, kill_at = [], rng.randint(1, 3) if rng is not None else None
    try:
        while True:
            assert receive.poll(HANG_GUARD_S), f"the saving process went quiet after {said[-3:]}"
            said.append(receive.recv())
            if said[-1][0] == "finished":
                break
            if kill_at is not None and sum(kind == "saving" for kind, _ in said) == kill_at:
                time.sleep(rng.uniform(0, 0.04))
                proc.kill()
                break
        proc.join(HANG_GUARD_S)
        while receive.poll(0):  # what it said before it died
            said.append(receive.recv())
    except EOFError:
        pass
    finally:
        proc.kill()
        proc.join()
    assert proc.exitcode == (-9 if kill_at is not None else 0), (proc.exitcode, said[-3:])
    return said


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_at_random_moments_of_saving(tmp_path, async_save):
    rng = random.Random(31)
    published = saving = 0  # the newest step reported published, and being saved
    for _ in range(LIVES):
        for kind, step in life(tmp_path, async_save, rng):
            if kind == "saving":
                saving = max(saving, step)
            else:
                published = max(published, step)
        m = CheckpointManager(tmp_path, ParallelDims())
        path = m.resolve("auto")
        if m.note is not None:  # killed between the first checkpoint's rename and the first `latest`: no other note
            assert m.note == f"{m.root / 'latest'} is missing: using {path.name}, the newest complete checkpoint"
        if path is None:
            assert published == 0
            continue
        step = m.read_trainer_state(path)["step"]
        assert published <= step <= saving and damage(path) is None, (published, step, saving, path)
        model, optimizer = build()
        m.load(path, model, optimizer, PACK)
        assert all(bool((p == step).all()) for p in model.parameters()), path
    assert published > 0
    said = life(tmp_path, async_save, None, until=saving + 2 * SAVE_EVERY)
    assert said[-1] == ("finished", saving + 2 * SAVE_EVERY)
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # nothing a killed life left
    assert CheckpointManager(tmp_path, ParallelDims()).resolve("auto") == root / f"step-{saving + 2 * SAVE_EVERY}"
