"""Preemption: SIGTERM, SIGINT and SIGUSR1 stop `xtrain run` after the step in progress with a checkpoint
of that step, a documented exit status and the run lock released; the same command then resumes, and the losses of
the two attempts together equal an uninterrupted run's step for step. Ranks die with their launcher.

The signals are real: the fault worker (tests/_train_fault_worker.py) sends them from the trainer's step-end hook,
to the process itself, to one rank only, or to the launcher of `--nproc-per-node`, at a step drawn at random
(seeded); or from inside DCP's write (a second signal during the save). The single-process runs are made once for
the module, two at a time (``one_process``), and each test checks what its runs left.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from _train_fault_worker import KILL_AFTER_STEP_ENV, SIGNAL_ENV, SIGNAL_IN_SAVE_ENV
from trainkit import cp_pack, side_by_side, user_error
from xprep.train.attempts import config_digest
from xprep.train.data import PackedDataset
from xprep.train.dist import ParallelDims
from xprep.train.preempt import StopControl, stop_status

ROOT = Path(__file__).resolve().parents[2]
FAULTY = [sys.executable, str(ROOT / "tests" / "_train_fault_worker.py"), "run"]
STEPS = 7  # of 2 bins, over 13 (``packed``): the last step crosses the random sampler's epoch boundary
COMMON = ["--steps", str(STEPS), "--micro-batch-size", "1", "--global-batch-size", "2", "--sampler", "random",
          "--seed", "5", "--lr", "2e-3", "--warmup", "2", "--log-every", "100"]
TWO_RANKS_CP = ["--nproc-per-node", "2", "--cp", "2"]
STEP = random.Random(31).randint(2, STEPS - 3)  # where the signal comes


def xtrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FAULTY, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def attempt_ends(run: Path) -> list[str]:
    logs = sorted((run / "logs").glob("attempt-*.log"))
    return [next(line for line in p.read_text().splitlines() if line.startswith("ended")) for p in logs]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    packed = cp_pack(tmp_path_factory.mktemp("data"))
    assert STEPS * 2 > len(PackedDataset(packed)), "the runs must go past one epoch (a resume into the next one)"
    return packed


@dataclass
class Attempt:
    """One attempt of a run: what the process gave, and the run's checkpoints just after it."""

    proc: subprocess.CompletedProcess
    reached: int | None  # the last step logged by then
    latest: str | None
    temporaries: list[str]  # temporary checkpoint directories left


def attempt(run: Path, args: list[str], env: dict | None = None) -> Attempt:
    proc = xtrain(*args, "--output", str(run), env=env)
    rows = losses(run) if (run / "metrics.jsonl").is_file() else []
    checkpoints = run / "checkpoints"
    return Attempt(proc, rows[-1][0] if rows else None, latest(run) if (checkpoints / "latest").is_file() else None,
                   sorted(p.name for p in checkpoints.glob(".step-*")))


ONE_PROCESS_STOPS = {"TERM": ([], 143), "USR1": (["--async-save", "--save-every", "3"], 0)}  # extra flags, exit


def one_process_runs(packed: Path) -> dict[str, tuple[list[str], dict, list[str] | None]]:
    """The module's single-process runs by name: the first attempt's arguments and fault (the fault worker's
    environment), and the arguments of the attempt that resumes (None: none does). A stopped run resumes with the
    same command."""
    common = [str(packed), *COMMON]
    runs: dict = {"reference": (common, {}, None)}  # the uninterrupted run
    for sig, (extra, _) in ONE_PROCESS_STOPS.items():
        runs[sig] = ([*common, *extra], {SIGNAL_ENV: f"{sig},{STEP},self"}, [*common, *extra])
    runs["second signal"] = (common, {SIGNAL_ENV: f"TERM,{STEP},self", SIGNAL_IN_SAVE_ENV: "INT"}, None)
    runs["minutes"] = ([*common, "--steps", "4", "--save-every-minutes", "1e-6", "--keep", "10"], {}, None)
    runs["killed"] = ([*common, "--save-every", "2"], {KILL_AFTER_STEP_ENV: "3"}, ["--lr", "1e-3"])  # the run's
    return runs  # config gives the rest


@pytest.fixture(scope="module")
def one_process(packed, tmp_path_factory) -> dict[str, tuple[Path, list[Attempt]]]:
    """Every single-process run of the module (``one_process_runs``), by name: its directory and attempts. The
    first attempts run side by side, then the resuming ones (each run is one process on one thread)."""
    root, runs = tmp_path_factory.mktemp("one_process"), one_process_runs(packed)
    found: dict = {name: (root / name, []) for name in runs}

    def first(name: str) -> None:
        args, env, _ = runs[name]
        found[name][1].append(attempt(root / name, args, env))

    def resume(name: str) -> None:
        found[name][1].append(attempt(root / name, runs[name][2]))

    side_by_side([partial(first, name) for name in runs])
    side_by_side([partial(resume, name) for name, (*_, again) in runs.items() if again is not None])
    return found


@pytest.fixture(scope="module")
def reference(one_process) -> list[tuple[int, float]]:
    """The uninterrupted single-process run's losses."""
    run, (done,) = one_process["reference"]
    assert done.proc.returncode == 0, done.proc.stderr
    return losses(run)


def check_stop_and_resume(run: Path, stopped: Attempt, resumed: Attempt, code: int) -> str:
    """The signal stopped the run (exit ``code``) with a checkpoint of the step reached and no temporary left; the
    same command resumed it; returns what the stopped attempt printed."""
    assert stopped.proc.returncode == code, stopped.proc.stderr
    assert stopped.latest == f"step-{stopped.reached}" and stopped.reached < STEPS, (stopped, stopped.proc.stderr)
    assert not stopped.temporaries, "a temporary checkpoint directory was left"
    assert resumed.proc.returncode == 0, resumed.proc.stderr
    assert f"resuming at step {stopped.reached}" in resumed.proc.stderr
    return stopped.proc.stderr


@pytest.mark.parametrize("sig", list(ONE_PROCESS_STOPS))
def test_one_process_stops_with_a_checkpoint_and_resumes_exactly(one_process, reference, sig):
    code = ONE_PROCESS_STOPS[sig][1]
    run, (stopped, resumed) = one_process[sig]
    said = check_stop_and_resume(run, stopped, resumed, code)
    assert f"stopped by SIG{sig} after step {STEP}/{STEPS}" in said.strip().splitlines()[-1]
    assert losses(run) == reference  # exact, each step once
    ends = attempt_ends(run)
    assert len(ends) == 2 and f"exit {code}: stopped by SIG{sig} after step {STEP}" in ends[0], ends
    assert ends[1].endswith("exit 0: finished")


@pytest.fixture(scope="module")
def reference_cp(packed, tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted run on 2 ranks (FSDP2, CP 2)."""
    run = tmp_path_factory.mktemp("ref_cp") / "run"
    done = xtrain(str(packed), *COMMON, *TWO_RANKS_CP, "--output", str(run))
    assert done.returncode == 0, done.stderr
    return losses(run)


@pytest.mark.parametrize(("sig", "to", "extra", "code"), [
    ("TERM", "launcher", ["--async-save", "--save-every", "3"], 143),  # the launcher passes it on
    ("USR1", "rank-1", [], 0),  # seen by one rank only: both stop at the same step
])
def test_two_ranks_stop_together_and_resume_exactly(packed, reference_cp, tmp_path, sig, to, extra, code):
    run, args = tmp_path / "run", [str(packed), *COMMON, *TWO_RANKS_CP, *extra]
    stopped = attempt(run, args, {SIGNAL_ENV: f"{sig},{STEP},{to}"})
    said = check_stop_and_resume(run, stopped, attempt(run, args), code)  # resumed by the same command
    assert said.count(f"stopped by SIG{sig} after step") == 1  # rank 0 says it; nothing else after it
    assert said.strip().splitlines()[-1].startswith(f"stopped by SIG{sig} after step")
    state = json.loads((run / "checkpoints" / latest(run) / "trainer.json").read_text())
    assert losses(run) == reference_cp and state["step"] == int(latest(run)[5:])


def test_a_second_signal_during_the_save_waits_for_it(one_process):
    """Every DCP write sends SIGINT to the process midway: the first save (at the stop) completes anyway."""
    run, (stopped,) = one_process["second signal"]
    assert stopped.proc.returncode == 143, stopped.proc.stderr  # the first signal's status
    assert latest(run) == f"step-{STEP}" and (run / "checkpoints" / f"step-{STEP}" / ".metadata").is_file()


def test_sigkill_of_the_launcher_alone_leaves_no_rank(packed, tmp_path):
    run = tmp_path / "run"
    args = [str(packed), *COMMON, "--nproc-per-node", "2", "--dp", "2", "--save-every", "1", "--output", str(run)]
    killed = xtrain(*args, env={SIGNAL_ENV: "KILL,2,launcher"})
    assert killed.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while (alive := ranks_of(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"ranks {alive} outlived their launcher"
    resumed = xtrain(*args)  # alone: no orphan holds the run's ranks lock
    assert resumed.returncode == 0, resumed.stderr
    assert [step for step, _ in losses(run)][-1] == STEPS


def ranks_of(run: Path) -> list[int]:
    """The pids of processes whose command line names ``run`` (a rank's config holds its output directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(run).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_a_live_rank_of_an_earlier_run_keeps_a_new_run_out(packed, tmp_path):
    """What the ranks lock is for: a process that still holds it (an orphan rank) refuses the run, in one line
    (the run is refused in this process: before anything it would launch)."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)",
                               str(run / "ranks.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert user_error(str(packed), *COMMON, "--output", str(run)) == (  # exit 2, this one line
            f"error: --output {run}: ranks of an earlier run are still alive (they hold {run / 'ranks.lock'}; "
            f"`fuser {run / 'ranks.lock'}` lists them): stop them, or choose another --output")
    finally:
        holder.kill()
        holder.wait()
    with open(run / "ranks.lock") as f:  # and nothing holds it now
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_save_every_minutes(one_process):
    """A time-based save at every step boundary (an interval shorter than a step), and the clock restarts."""
    run, (done,) = one_process["minutes"]
    assert done.proc.returncode == 0, done.proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-1", "step-2", "step-3", "step-4"]
    ticks = iter([0.0, 30.0, 61.0, 62.0, 100.0, 122.5])
    control = StopControl(ParallelDims.for_world(1), None, save_every_minutes=1, clock=lambda: next(ticks))
    assert [control.poll()[1] for _ in range(2)] == [False, True]  # 30 s, 61 s after the start
    control.saved()  # at 62 s
    assert [control.poll()[1] for _ in range(2)] == [False, True]  # 38 s, 60.5 s after it


def test_stop_statuses():
    assert [stop_status(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)] == [143, 130, 0]


def test_attempt_logs(one_process):
    """One log per attempt: what ran (command, code, config hash), what the flags changed from the run's config,
    where it resumed, how it ended. SIGKILL leaves no end line (nothing can write it); the next attempt says so."""
    run, (killed, resumed) = one_process["killed"]
    assert killed.proc.returncode == -signal.SIGKILL
    assert resumed.proc.returncode == 0, resumed.proc.stderr  # `--output RUN --lr 1e-3`: the config gives the rest
    first, second = ((run / "logs" / f"attempt-{n}.log").read_text().splitlines() for n in (1, 2))
    assert first[1].startswith("command   ") and "--save-every 2" in first[1]
    assert first[3].startswith("code      git ") or first[3].startswith("code      xprep ")
    config = json.loads((run / "config.json").read_text())
    run_json = json.loads((run / "run.json").read_text())
    assert second[4] == f"config    sha256 {run_json['config_sha256']} of the resolved config (config.json)"
    assert run_json["config_sha256"] == config_digest(config)
    assert not any(line.startswith("ended") for line in first)
    assert "note      attempt-1.log has no end: that attempt was killed" in "\n".join(second)
    assert any("changed from it: --lr 0.002 → 0.001" in line for line in second)
    assert any(line.startswith("note      resuming at step 2 from ") for line in second)
    assert second[-2] == f"note      trained to step {STEPS}/{STEPS}" and second[-1].endswith("exit 0: finished")
