"""`xtrain run` for a new user (issue 9): an unusable --output, a token dataset given as the pack, which pack
entry a run trains on, and a resume that changes the length of the learning-rate schedule; --version."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_train_run import metrics, user_error
from trainkit import category_pack
from xprep import cli
from xprep.cli import xprep, xtrain
from xprep.train.ckpt_files import FILES, TRAINER_DIGEST


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A pack cache (root/p) of the token dataset root/ds."""
    return category_pack(tmp_path_factory.mktemp("data"))


def train(*args: str):
    result = CliRunner().invoke(xtrain, ["run", *args, "--log-every", "100"])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["one-process", "nproc-2"])
def test_output_in_the_way_is_one_line_before_any_work(packed, tmp_path, launch):
    """A file where the run directory (or one of its parents) should be: exit 2, one line, nothing launched."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for out, problem in ((afile, "exists and is a file"), (afile / "sub", f"{afile} is a file")):
        line = user_error(str(packed), "--steps", "1", "-o", str(out), *launch)
        assert f"--output {out}:" in line and problem in line, line
    assert afile.read_text() == "not a directory" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_token_dataset_is_not_a_pack(packed, tmp_path):
    """`xtrain run DATASET_DIR` says what the directory is and which command makes a pack of it."""
    dataset = packed.parent / "ds"
    assert (dataset / "tokens.idx").is_file() and "fingerprint" in json.loads((dataset / "manifest.json").read_text())
    line = user_error(str(dataset), "--steps", "1", "-o", str(tmp_path / "run"))
    assert "corrupt" not in line and "is a token dataset" in line and "not a pack cache" in line, line
    assert f"`xprep pack {dataset} -o PACKED --method " in line and "`xtrain run PACKED`" in line, line
    (tmp_path / "empty").mkdir()
    line = user_error(str(tmp_path / "empty"), "--steps", "1", "-o", str(tmp_path / "run"))
    assert "not a pack cache (no manifest.json)" in line and "xprep pack" in line, line
    line = user_error(str(tmp_path / "nowhere"), "--steps", "1", "-o", str(tmp_path / "run"))
    assert "no such directory" in line and "not a pack cache" in line, line
    assert not (tmp_path / "run").exists()


def test_the_pack_entry_is_shown_and_recorded(packed, tmp_path):
    result = train(str(packed), "--steps", "1", "-o", str(tmp_path / "run"))
    shown = [x for x in result.stderr.splitlines() if x.startswith("training on ")]
    assert len(shown) == 1, result.stderr
    m = re.fullmatch(r"training on (\S+) \(entry (\S+), current in (\S+)\)", shown[0])
    assert m, shown[0]
    entries = [p.name for p in packed.iterdir() if p.is_dir()]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [m[2]] == entries == [run["pack"]["entry"]] and m[1] == run["pack"]["path"] == str(packed / entries[0])
    assert m[3] == str(packed / "manifest.json") and run["pack"]["key"].startswith(entries[0].split("-")[-1])
    direct = train(str(packed / entries[0]), "--steps", "1", "-o", str(tmp_path / "direct"))
    assert f"training on {packed / entries[0]} (entry {entries[0]}, given directly)" in direct.stderr


def test_resume_with_other_steps_says_the_schedule_changes(packed, tmp_path):
    """8 steps, then from step 4 again with 12: step 5's lr differs from the first run's, and the console says
    by how much; a checkpoint from before the schedule was saved still resumes (without the note)."""
    run, base = tmp_path / "run", [str(packed), "--warmup", "2", "-o", str(tmp_path / "run")]
    first = train(*base, "--steps", "8", "--save-every", "4")
    assert "schedule" not in first.stderr
    old_lr = metrics(run)[4]["lr"]
    state = json.loads((run / "checkpoints" / "step-4" / "trainer.json").read_text())
    assert state["schedule"] == {"steps": 8, "warmup": 2, "schedule": "cosine"}
    resumed = train(*base, "--steps", "12", "--save-every", "4", "--resume", str(run / "checkpoints" / "step-4"))
    new_lr = metrics(run)[4]["lr"]
    assert new_lr != old_lr
    note = [x for x in resumed.stderr.splitlines() if "other hyperparameters" in x]
    assert note == ["resuming with other hyperparameters than the checkpoint's: steps 8 → 12: the learning-rate "
                    f"schedule is recomputed for 12 steps (step 5 lr {new_lr:.2e} instead of {old_lr:.2e})"], \
        resumed.stderr
    same = train(*base, "--steps", "12", "--resume", str(run / "checkpoints" / "step-8"))
    assert "other hyperparameters" not in same.stderr
    trainer_json = run / "checkpoints" / "step-12" / "trainer.json"
    state = json.loads(trainer_json.read_text())
    for key in ("schedule", FILES, TRAINER_DIGEST):  # as written before the schedule (and the digests) were saved
        del state[key]
    trainer_json.write_text(json.dumps(state))
    older = train(*base, "--steps", "14")
    assert "resuming at step 12" in older.stderr and "other hyperparameters" not in older.stderr
    assert [r["step"] for r in metrics(run)] == list(range(1, 15))


def test_version(monkeypatch):
    """Issue 29, point 23: `xprep --version` and `xtrain --version` print the installed distribution's version; a
    source tree that is not installed gives pyproject.toml's."""
    installed = metadata.version("xprep")
    for group, prog in ((xprep, "xprep"), (xtrain, "xtrain")):
        result = CliRunner().invoke(group, ["--version"])
        assert result.exit_code == 0 and result.output == f"{prog} {installed}\n", result.output

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli.metadata, "version", not_installed)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((Path(cli.__file__).parent / "pyproject.toml").read_text())["project"]["version"]
    assert CliRunner().invoke(xtrain, ["--version"]).output == f"xtrain {declared}\n"
