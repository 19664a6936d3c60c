"""Named evaluation sets and the test pass of `xtrain run` (issue 34, point 1).

The pack's own validation part is the set named ``valid``; ``--eval NAME=PACKED`` adds sets logged apart under
``eval/NAME/...``; the ``--split`` test part (or ``--test``) is evaluated once, after the last step, and kept in
run.json. A SIGKILLed run resumed gives the same eval history as an uninterrupted one, and one test pass.
Sets of another tokenizer or capacity are refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from trainkit import make_dataset, random_docs, user_error
from xprep.cli import xprep, xtrain
from xprep.prep.pack.cache import PackConfig, pack
from xprep.train.loggers import scalars
from xprep.train.metrics import EvalMetrics, StepMetrics

ROOT = Path(__file__).resolve().parents[2]
KILL_AFTER_STEP_ENV = "XTRAIN_TEST_KILL_AFTER_STEP"  # tests/_train_fault_worker.py: SIGKILL itself after that step
COMMON = ["--steps", "5", "--micro-batch-size", "2", "--eval-every", "2", "--eval-bins", "3", "--log-every", "100",
          "--lr", "1e-2", "--schedule", "constant", "--save-every", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """P: a cache split 80,10,10; O: another pack of the same tokenizer and capacity; C and V: of another capacity
    and of another vocabulary."""
    root = tmp_path_factory.mktemp("named")
    make_dataset(root / "ds", random_docs(200, 3, 40, vocab=128, seed=1), vocab_size=128)
    make_dataset(root / "other", random_docs(40, 3, 40, vocab=128, seed=2), vocab_size=128)
    make_dataset(root / "wide", random_docs(40, 3, 40, vocab=256, seed=3), vocab_size=256)
    pack([root / "ds"], root / "P", PackConfig(method="multipack", seq_len=64, split=(80, 10, 10)))
    pack([root / "other"], root / "O", PackConfig(method="multipack", seq_len=64))
    pack([root / "other"], root / "C", PackConfig(method="multipack", seq_len=32))
    pack([root / "wide"], root / "V", PackConfig(method="multipack", seq_len=64))
    return root


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def history(run: Path) -> list[tuple]:
    """(step, set, loss) of every evaluation and test pass logged."""
    return [(r["step"], k.rsplit("/", 1)[0], r[k]) for r in records(run) for k in sorted(r)
            if k.endswith("/loss") and k.startswith(("eval/", "test/"))]


def xtrain_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tests" / "_train_fault_worker.py"), "run", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def run_args(data: Path, run: Path) -> list[str]:
    return [str(data / "P"), *COMMON, "--eval", f"other={data / 'O'}", "--output", str(run)]


@pytest.fixture(scope="module")
def whole(data):
    """An uninterrupted run on P with one more named set, in this process: (run directory, its result)."""
    run = data / "whole"
    result = CliRunner().invoke(xtrain, ["run", *run_args(data, run)])
    assert result.exit_code == 0, (result.output, result.exception)
    return run, result


def test_named_sets_are_logged_apart_and_the_test_part_once(data, whole, tmp_path):
    run, result = whole
    rows = records(run)
    evaluated = {name: [r["step"] for r in rows if f"eval/{name}/loss" in r] for name in ("valid", "other")}
    assert evaluated == {"valid": [2, 4, 5], "other": [2, 4, 5]}
    assert all(r["eval/valid/loss"] == r["eval_loss"] for r in rows if "eval_loss" in r)  # today's keys: valid's
    assert all(r["eval/valid/loss"] != r["eval/other/loss"] for r in rows if "eval/other/loss" in r)
    assert all(r["eval/other/bins"] == 3 and r["eval/other/target_tokens"] > 0 for r in rows if "eval/other/bins" in r)
    tested = [r for r in rows if "test/test/loss" in r]
    assert [r["step"] for r in tested] == [5] and tested[0]["test/test/target_tokens"] > 0
    assert "eval/valid step 2/5" in result.stderr and "eval/other step 2/5" in result.stderr
    assert result.stderr.count("test/test step 5/5") == 1 and "testing 'test' on" in result.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["test"]["test"]["loss"] == tested[0]["test/test/loss"] and info["test"]["test"]["step"] == 5
    assert [s["name"] for s in info["eval_sets"]] == ["other"] and info["test_set"]["name"] == "test"
    again = CliRunner().invoke(xtrain, ["run", *run_args(data, run)])  # finished: nothing to do, no second test
    assert again.exit_code == 0 and "nothing to do" in again.stderr, again.output
    assert len([r for r in records(run) if "test/test/loss" in r]) == 1
    assert json.loads((run / "run.json").read_text())["test"] == info["test"]
    shown = CliRunner().invoke(xprep, ["inspect", str(run)])
    assert shown.exit_code == 0, shown.output
    assert "eval/other" in shown.output and "test/test" in shown.output
    html = tmp_path / "run.html"
    assert CliRunner().invoke(xprep, ["inspect", str(run), "--html", str(html)]).exit_code == 0
    assert "test/test" in html.read_text() and "eval/other" in html.read_text()


def test_sigkill_and_resume_keep_the_eval_history(data, whole, tmp_path):
    run = tmp_path / "killed"
    killed = xtrain_run(*run_args(data, run), env={KILL_AFTER_STEP_ENV: "3"})  # a real process, a real SIGKILL
    assert killed.returncode == -9, killed.stderr  # after step 3; its last checkpoint: step 2
    assert [s for s, *_ in history(run)] == [2, 2]
    resumed = CliRunner().invoke(xtrain, ["run", *run_args(data, run)])
    assert resumed.exit_code == 0 and "resuming at step 2" in resumed.stderr, resumed.output
    a, b = history(whole[0]), history(run)
    assert [(s, n) for s, n, _ in a] == [(s, n) for s, n, _ in b] == [
        (2, "eval/other"), (2, "eval/valid"), (4, "eval/other"), (4, "eval/valid"), (5, "eval/other"),
        (5, "eval/valid"), (5, "test/test")]
    assert [loss for *_, loss in a] == pytest.approx([loss for *_, loss in b], rel=1e-6)


def test_sets_of_another_capacity_or_tokenizer_are_refused(data, tmp_path):
    out = [str(data / "P"), "--steps", "1", "--output", str(tmp_path / "r")]
    line = user_error(*out, "--eval", f"short={data / 'C'}")
    assert f"--eval short={data / 'C'}" in line and "bins of 32 tokens" in line and "64" in line
    line = user_error(*out, "--test", f"wide={data / 'V'}")
    assert f"--test wide={data / 'V'}" in line and "another tokenizer" in line
    assert "expected NAME=PACKED_OR_ENTRY" in user_error(*out, "--eval", str(data / "O"))
    assert "'valid'" in user_error(*out, "--eval", f"valid={data / 'O'}")
    assert "no such pack" in user_error(*out, "--eval", f"gone={data / 'nothing'}")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_tensorboard_and_wandb_get_each_set_by_name():
    """The loggers' scalars (train/loggers.py) of a step that evaluated two sets and the test set."""
    def ev(loss: float) -> EvalMetrics:
        return EvalMetrics(loss, {"code": loss + 1}, {"web": loss + 2, "books": loss + 3}, 10, 3, 0.1)

    m = StepMetrics(4, 2.0, {}, 1.0, 1e-3, 100, 50, 0.5, 8, evals={"valid": ev(1.5), "wiki": ev(2.5)},
                    tests={"held": ev(3.5)})
    m.eval = m.evals["valid"]
    got = scalars(m.record())
    assert got["eval/valid/loss"] == got["eval_loss"] == 1.5 and got["eval/wiki/loss"] == 2.5
    assert got["eval/wiki/category_loss/code"] == 3.5 and got["eval/wiki/source_loss/books"] == 5.5
    assert got["test/held/loss"] == 3.5 and got["test/held/target_tokens"] == 10 and got["eval/wiki/bins"] == 3


def test_named_sets_alone_on_a_pack_without_a_split(data, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", str(data / "O"), "--steps", "2", "--eval-every", "1", "--eval-bins",
                                         "2", "--eval", f"p={data / 'P'}", "--test", f"held={data / 'P'}",
                                         "--output", str(run)])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = records(run)
    assert [r["step"] for r in rows if "eval/p/loss" in r] == [1, 2]
    assert not any("eval_loss" in r for r in rows)  # no validation entry of its own
    assert [r["step"] for r in rows if "test/held/loss" in r] == [2] and "test/held step 2/2" in result.stderr
    assert rows[-1]["test/held/loss"] == rows[-1]["eval/p/loss"]  # the same set, the same weights
    assert json.loads((run / "run.json").read_text())["test"]["held"]["loss"] == rows[-1]["test/held/loss"]
    assert "eval/p step 1/2" in result.stderr


def test_a_resume_pinned_to_an_older_entry_finds_its_own_test_part(tmp_path):
    """Once another --split pack is current, a run resumed on its checkpoint's entry tests on that entry's part."""
    from xprep.train.evaluate import validation_entry

    make_dataset(tmp_path / "ds", random_docs(60, 3, 20, vocab=128, seed=4), vocab_size=128)
    first = pack([tmp_path / "ds"], tmp_path / "P", PackConfig(method="multipack", seq_len=64, split=(80, 10, 10)))
    later = pack([tmp_path / "ds"], tmp_path / "P", PackConfig(method="multipack", seq_len=64, split=(60, 20, 20)))
    assert validation_entry(tmp_path / "P", None, "test") == later.test.path
    assert validation_entry(tmp_path / "P", first.entry.path, "test") == first.test.path
    assert validation_entry(tmp_path / "P", first.entry.path) == first.validation.path
    assert validation_entry(first.entry.path, None, "test") == first.test.path  # PACKED given as the entry
