"""Phased mixes in training and re-mixing a run in flight, on real data (State of the Union paragraphs
and raw e-mails, Mistral's tokenizer), in real processes.

What must hold: a run over a phase boundary, SIGKILLed after it and resumed, has the losses of an uninterrupted run;
run.json records the phases with the step each starts at. After the run has passed 30 % of phase 1, a pack whose
later phases changed (phase 2 re-weighted, phase 3 appended) resumes (the console says what changed) and goes on
exactly as a run on the new pack from the start, even with the old entry gone from the cache; its lineage up to
the change is unchanged. A pack whose phase 1 changed is refused, naming the first differing bin.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _train_fault_worker import KILL_AFTER_STEP_ENV
from click.testing import CliRunner
from conftest import SHARED, requires_shared_data
from prepkit import web_and_mail, xprep_invoke
from trainkit import user_error
from xprep.cli import xtrain as cli_xtrain
from xprep.prep.pack.cache import PackConfig, pack
from xprep.train.lineage import seen_report

pytestmark = requires_shared_data
ROOT = Path(__file__).resolve().parents[2]
SEQ = 128
PHASE_1 = {"bins": 24, "weights": {"web": 0.8, "mail": 0.2}}  # steps 1-6 of 4 bins
MIXES = {
    "A": [PHASE_1, {"bins": 24, "weights": {"web": 0.3, "mail": 0.7}}],
    "B": [PHASE_1, {"bins": 24, "weights": {"web": 0.5, "mail": 0.5}}, {"bins": 8, "weights": {"web": 1}}],
    "C": [{"bins": 24, "weights": {"web": 0.6, "mail": 0.4}}, {"bins": 24, "weights": {"web": 0.3, "mail": 0.7}}],
}
COMMON = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--schedule", "constant",
          "--warmup", "0", "--log-every", "100", "--model", "tiny"]  # constant: a run of 3 steps, then 10, is one


def xtrain(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "_train_fault_worker.py"), "run", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def train(*args: str) -> str:
    """`xtrain run ARGS` in this process; its stderr."""
    result = CliRunner().invoke(cli_xtrain, ["run", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stderr


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def pack_mix(data: dict[str, Path], name: str, packed: Path):
    mix = packed.parent / f"mix-{name}.json"
    mix.write_text(json.dumps({"sources": [{"dataset": str(p), "name": n} for n, p in data.items()],
                               "phases": MIXES[name]}))
    return pack([], packed, PackConfig(method="multipack", seq_len=SEQ), mix=str(mix)).entry


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("remix")


@pytest.fixture(scope="module")
def data(root) -> dict[str, Path]:
    return web_and_mail(SHARED, root)


@pytest.fixture(scope="module")
def killed(root, data) -> dict[str, subprocess.Popen]:
    """Two processes on mix A, started side by side (the tests in this process go on meanwhile): uninterrupted for
    10 steps, and SIGKILLed after step 9 (checkpoints every 4 steps: it resumes from step 8, in phase 2)."""
    pack_mix(data, "A", root / "A")
    common = [str(root / "A"), *COMMON, "--steps", "10", "--save-every", "4"]
    return {"reference": xtrain(*common, "--output", str(root / "reference")),
            "killed": xtrain(*common, "--output", str(root / "killed"), env={KILL_AFTER_STEP_ENV: "9"})}


def test_a_remixed_later_phase_resumes_and_a_changed_first_phase_is_refused(root, data, killed):
    """(In this process, beside the ``killed`` runs.) Mix A to step 3 (12 bins: half of phase 1); then B, its phase
    2 re-weighted and a phase 3 appended, made current: the run resumes on it with the old entry gone from the
    cache, and trains as a run on B from the start; then C, its phase 1 changed, is refused."""
    a, b = pack_mix(data, "A", root / "P"), pack_mix(data, "B", root / "B")
    run = root / "remixed"
    train(str(root / "P"), *COMMON, "--steps", "3", "--save-every", "3", "--output", str(run))
    train(str(root / "B"), *COMMON, "--steps", "10", "--output", str(root / "on B"))
    before = seen_report(run, 3)
    b = pack_mix(data, "B", root / "P")  # the same entry as B's, made current in the run's cache
    shutil.rmtree(a.path)  # the entry trained on is gone: the run kept what the check needs
    said = train(str(root / "P"), *COMMON, "--steps", "10", "--output", str(run))
    assert f"re-mixed: resuming on {b.path.name} instead of {a.path.name}, the 12 bins trained on" in said, said
    assert "phase 2 weights web 0.3→0.5, mail 0.7→0.5; phase 3 appended (bins: 8; web 1)" in said, said
    assert losses(run) == losses(root / "on B")  # as if it had trained on B from the start
    after = seen_report(run, 3)
    assert after["key"] == b.key and before["key"] == a.key
    drop = {"pack", "key"}
    assert {k: v for k, v in after.items() if k not in drop} == {k: v for k, v in before.items() if k not in drop}

    c = pack_mix(data, "C", root / "P")  # phase 1 changed: inside the 40 bins trained on
    differ = (b.bin_source[:40] != c.bin_source[:40]) | (b.bin_index[:40] != c.bin_index[:40])
    j = int(np.argmax(differ))
    assert differ[j]
    names = b.source_names
    was = f"bin {int(b.bin_index[j]):,} of source {names[int(b.bin_source[j])]!r}"
    now = f"bin {int(c.bin_index[j]):,} of source {names[int(c.bin_source[j])]!r}"
    line = user_error(str(root / "P"), *COMMON, "--steps", "12", "--output", str(run))
    assert f"at sample {j:,} (step {j // 4 + 1}, blend bin {j:,}) it was {was}, it is now {now}" in line, line
    assert losses(run)[-1][0] == 10  # nothing trained


def test_a_run_killed_after_the_phase_boundary_resumes_exactly(root, killed):
    code, err = finished(killed["reference"])
    assert code == 0, err
    code, err = finished(killed["killed"])
    assert code == -signal.SIGKILL, err
    assert (root / "killed" / "checkpoints" / "latest").read_text().strip() == "step-8"  # in phase 2 (steps 7-12)
    code, err = finished(xtrain(str(root / "A"), *COMMON, "--steps", "10", "--save-every", "4", "--output",
                                str(root / "killed")))
    assert code == 0, err
    assert losses(root / "killed") == losses(root / "reference")
    phases = json.loads((root / "killed" / "run.json").read_text())["pack"]["phases"]
    assert [(p["phase"], p["start_bin"], p["first_step"]) for p in phases] == [(1, 0, 1), (2, 24, 7)]
    assert phases[1]["weights"] == {"web": 0.3, "mail": 0.7} and phases[1]["size"] == "bins: 24"
    said = xprep_invoke("inspect", root / "killed").output  # the run report: where each phase starts, in steps
    assert "phase 2       from step 7 (consumed samples 24), 24 bins, web 30%, mail 70%" in said, said


def test_a_phased_pack_read_in_random_order_says_its_phases_are_shuffled(root, killed, tmp_path):
    said = train(str(root / "A"), *COMMON, "--steps", "1", "--sampler", "random", "--output", str(tmp_path / "run"))
    assert "runs in 2 phases, which --sampler random shuffles together; --sampler sequential follows them" in said
    assert json.loads((tmp_path / "run" / "run.json").read_text())["pack"]["phases"][1]["first_step"] is None
