"""metrics.jsonl is never truncated (issue 31, point B): a resume sets the lines of the steps it trains again
aside in ``metrics.jsonl.replayed-N``, unchanged, and appends; the live file has every step once, and the
readers (the run report, ``--seen``) keep working and list the replayed files."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner
from trainkit import category_pack
from xprep.cli import xprep, xtrain
from xprep.train.metrics import set_aside


def train(*args: str):
    result = CliRunner().invoke(xtrain, ["run", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in lines(path)]


def test_a_resume_from_an_earlier_checkpoint_keeps_the_replayed_lines(tmp_path):
    packed, run = category_pack(tmp_path), tmp_path / "run"
    live, step3 = run / "metrics.jsonl", str(run / "checkpoints" / "step-3")
    args = [str(packed), "--steps", "6", "--save-every", "3", "--keep", "5", "--log-every", "100", "--output", str(run)]
    train(*args)
    first = lines(live)
    assert steps(live) == [1, 2, 3, 4, 5, 6]

    resumed = train(*args, "--resume", step3)
    assert f"{live}: the lines of the steps after 3, trained again now, moved to metrics.jsonl.replayed-1" \
        in resumed.stderr, resumed.stderr
    assert steps(live) == [1, 2, 3, 4, 5, 6] and lines(live)[:3] == first[:3]
    assert lines(run / "metrics.jsonl.replayed-1") == first[3:]  # unchanged
    again = [json.loads(line) for line in lines(live)[3:]]
    for before, after in zip(map(json.loads, first[3:]), again, strict=True):  # the same batches, trained again
        assert after["consumed_samples"] == before["consumed_samples"] and after["loss"] == before["loss"]

    second = lines(live)
    train(*args, "--resume", step3)  # N counts up; the first replayed file stays as it was
    assert lines(run / "metrics.jsonl.replayed-1") == first[3:]
    assert lines(run / "metrics.jsonl.replayed-2") == second[3:]
    assert steps(live) == [1, 2, 3, 4, 5, 6]

    report = json.loads(CliRunner().invoke(xprep, ["inspect", str(run), "--json"]).output)
    assert report["steps"] == 6 and report["loss"]["points"] == 6
    assert report["replayed"] == [{"file": f"metrics.jsonl.replayed-{n}", "lines": 3, "first_step": 4,
                                   "last_step": 6} for n in (1, 2)]
    text = CliRunner().invoke(xprep, ["inspect", str(run)]).output
    assert "metrics.jsonl.replayed-1 (steps 4–6), metrics.jsonl.replayed-2 (steps 4–6)" in text, text
    seen = json.loads(CliRunner().invoke(xprep, ["inspect", str(run), "--seen", "--step", "5", "--json"]).output)
    assert seen["consumed_samples"] == json.loads(second[4])["consumed_samples"]


def test_a_torn_line_is_set_aside_too_and_nothing_is_left_behind(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"ste')  # killed mid-line after step 3
    assert set_aside(path, 3) == tmp_path / "metrics.jsonl.replayed-1"
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert (tmp_path / "metrics.jsonl.replayed-1").read_text() == '{"ste\n'
    assert set_aside(path, 3) is None and path.read_text().count("\n") == 3  # nothing later: untouched
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.jsonl.replayed-1"]  # no temporary file
