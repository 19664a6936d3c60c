"""Resuming a run (issue 29, points 7 and 8).

7. The pack a run trains on can change under it: any `xprep pack` into the cache (a cache hit of an older
   command too) makes its entry current. A run resumes on the entry its checkpoint names while the cache
   holds it, says so, and evaluates on that entry's validation part; `PACKED/ENTRY` evaluates on the
   validation part recorded for that entry, not the current one's. When the entry is gone, the refusal
   says how to get it back.
8. `xtrain run --output RUN` on a run directory takes the run's config.json as the defaults (PACKED too):
   no flag needs repeating, and the flags given are listed as changes.

Issue 31: --resume auto never starts over a run's checkpoints silently nor loads a damaged one (a flipped bit is
caught by the digests; the checkpoint before it resumes exactly); a kill inside an asynchronous save's publication
leaves nothing that stays; --keep all and --no-save.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _train_fault_worker import KILL_PUBLISHING_ENV
from click.testing import CliRunner
from test_train_run import FAULTY, metrics, user_error, xtrain_proc
from trainkit import category_pack, make_dataset, random_docs
from xprep.cli import xtrain
from xprep.prep.pack.cache import PackConfig, pack
from xprep.train.ckpt_files import damage
from xprep.train.config import resolve_config
from xprep.train.evaluate import validation_entry


def train(*args: str):
    result = CliRunner().invoke(xtrain, ["run", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def split_pack(root: Path, seq_len: int, packed: Path | None = None, seed: int = 0):
    """`xprep pack --method multipack --split 80,20` of one dataset of 60 documents (made once)."""
    if not (root / "ds").exists():
        make_dataset(root / "ds", random_docs(60, 3, 40, vocab=128), vocab_size=128)
    return pack([root / "ds"], packed or root / "p", PackConfig(method="multipack", seq_len=seq_len, split=(80, 20),
                                                                seed=seed))


# ------------------------------------------------------------------------------------------ 7: the pinned entry
def test_a_run_resumes_on_its_entry_after_another_became_current(tmp_path):
    first = split_pack(tmp_path, 64)
    packed, run = tmp_path / "p", tmp_path / "run"
    train(str(packed), "--steps", "2", "--save-every", "1", "--output", str(run))
    second = split_pack(tmp_path, 32)  # e.g. re-running an older `xprep pack`: another entry is current now
    assert second.entry.path != first.entry.path and second.validation.path != first.validation.path
    assert validation_entry(packed) == second.validation.path

    resumed = train(str(packed), "--steps", "4", "--output", str(run))
    said = resumed.stderr
    assert f"training on {first.entry.path} (entry {first.entry.path.name}, the one checkpoint step-2" in said, said
    assert f"validating on {first.validation.path} " in said, said
    info = json.loads((run / "run.json").read_text())
    assert info["pack"]["entry"] == first.entry.path.name and info["validation"]["entry"] == first.validation.path.name
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "eval_loss" in rows[-1]

    shutil.rmtree(first.entry.path)  # gone: refused, with what to do
    line = user_error(str(packed), "--steps", "6", "--output", str(run))
    assert f"trained on pack entry {first.entry.path.name}" in line and "no longer in" in line, line
    assert "re-run the `xprep pack` command that made it" in line and "another --output" in line, line


def test_an_entry_given_directly_is_evaluated_on_its_own_validation_part(tmp_path):
    first = split_pack(tmp_path, 64)
    second = split_pack(tmp_path, 32)
    packed = tmp_path / "p"
    assert validation_entry(first.entry.path) == first.validation.path  # not the current entry's
    assert validation_entry(packed, first.entry.path) == first.validation.path
    assert validation_entry(second.entry.path) == second.validation.path == validation_entry(packed)
    assert validation_entry(first.validation.path) is None  # a validation part has none of its own
    result = train(str(first.entry.path), "--steps", "1", "--output", str(tmp_path / "run"))
    assert f"validating on {first.validation.path} " in result.stderr, result.stderr


def test_a_blend_entry_finds_its_validation_blend(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        make_dataset(tmp_path / name, random_docs(60, 3, 40, vocab=128, seed=seed), vocab_size=128)
    packed = tmp_path / "p"
    blends = [pack([tmp_path / "a", tmp_path / "b"], packed, PackConfig(method="multipack", seq_len=n, split=(80, 20)),
                   weights=[0.7, 0.3]) for n in (64, 32)]
    assert blends[0].validation.path != blends[1].validation.path
    for blend in blends:
        assert validation_entry(packed, blend.entry.path) == blend.validation.path
        assert validation_entry(blend.entry.path) == blend.validation.path


# ------------------------------------------------------------------------------------------ 8: the run's config
def test_output_alone_resumes_with_the_runs_config(tmp_path):
    split_pack(tmp_path, 64)
    packed, run = tmp_path / "p", tmp_path / "run"
    flags = ["--sampler", "random", "--micro-batch-size", "2", "--lr", "1e-3", "--warmup", "1", "--seed", "3"]
    train(str(packed), *flags, "--steps", "2", "--eval-bins", "3", "--output", str(run))
    before = json.loads((run / "config.json").read_text())

    resumed = train("--output", str(run), "--steps", "3")  # no PACKED, no flag repeated
    assert "resuming at step 2" in resumed.stderr
    assert f"defaults from the run's config {run / 'config.json'}; changed from it: --steps 2 → 3" in resumed.stderr
    after = json.loads((run / "config.json").read_text())
    assert after == {**before, "steps": 3}  # the random sampler, lr, seed, ... and the pack kept
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval_bins"] == 3

    again = train("--output", str(run), "--steps", "4", "--lr", "5e-4", "--eval-bins", "all")
    assert "changed from it: --lr 0.001 → 0.0005, --eval-bins 3 → all, --steps 3 → 4" in again.stderr, again.stderr
    assert "other hyperparameters than the checkpoint's: lr 0.001 → 0.0005" in again.stderr


def test_the_run_config_is_below_the_config_file_and_the_flags(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"data": {"packed": "p", "sampler": "random"},
                                                 "optimizer": {"lr": 1e-3, "warmup": 5}, "steps": 8,
                                                 "output": "elsewhere", "checkpoint": {"resume": "never"}}))
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"warmup": 2, "epochs": 1.5}))
    said: list[str] = []
    cfg = resolve_config(str(file), {"output": str(run), "lr": 2e-3, "packed": None}, log=said.append)
    assert (cfg.data.packed, cfg.data.sampler, cfg.optimizer.lr, cfg.optimizer.warmup) == ("p", "random", 2e-3, 2)
    assert (cfg.steps, cfg.epochs) == (None, 1.5)  # the file's run length replaces the run's
    assert cfg.output == str(run) and cfg.checkpoint.resume == "auto"  # where the run is and what to resume: never
    assert said == [f"defaults from the run's config {run / 'config.json'}; changed from it: --lr 0.001 → 0.002, "
                    "--warmup 5 → 2, --steps 8 → unset, --epochs unset → 1.5"]
    plain = resolve_config(None, {"output": str(tmp_path / "new"), "packed": "q"}, log=said.append)
    assert plain.data.sampler == "sequential" and len(said) == 1  # a new run directory: no defaults from anywhere
    (run / "config.json").write_text("{broken")
    with pytest.raises(Exception, match="config.json: unreadable as the run's config"):
        resolve_config(None, {"output": str(run)})


def test_resume_auto_without_a_usable_latest_takes_the_newest_complete_checkpoint(tmp_path):
    """Issue 31 (part): with ``checkpoints/latest`` gone (a crash between two writes, a tidy-up, an rsync that
    skipped it) --resume auto continued from step 0 over the run's checkpoints; with it naming a damaged one it
    stopped. Now it takes the newest complete step-<N>, says which and why, and the run goes on from there."""
    packed, run = category_pack(tmp_path / "data"), tmp_path / "run"
    common = [str(packed), "--output", str(run), "--save-every", "1", "--keep", "5", "--log-every", "100"]
    train(*common, "--steps", "3")
    ckpts = run / "checkpoints"
    (ckpts / "latest").unlink()
    result = train(*common, "--steps", "4")
    assert f"{ckpts / 'latest'} is missing: using step-3, the newest complete checkpoint" in result.stderr
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]
    (ckpts / "step-4" / ".metadata").unlink()  # the checkpoint latest names is damaged: the one before it
    result = train(*common, "--steps", "5")
    assert "names step-4, which is incomplete (.metadata is missing): using step-3" in result.stderr
    assert json.loads((ckpts / "step-5" / "trainer.json").read_text())["step"] == 5
    for step in (3, 4, 5):  # none complete (step-4 was saved again on the way): refused, never a start from scratch
        (ckpts / f"step-{step}" / ".metadata").unlink()
    for step in (1, 2):
        (ckpts / f"step-{step}" / "trainer.json").unlink()
    error = user_error(*common, "--steps", "6")
    assert "no step-<N> in" in error and "is a complete checkpoint" in error


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run)}


def assert_same_losses(a: dict[int, float], b: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(a[step] - b[step]) <= 1e-6 * a[step], (step, a[step], b[step])


def test_a_flipped_bit_is_caught_and_the_checkpoint_before_it_resumes_exactly(tmp_path):
    """Issue 31: a bit flipped in a .distcp loaded silently (and trained to NaN). Its sha256 no longer matches:
    --resume auto says so in one line and resumes from step-2, whose next steps are those of the first pass."""
    packed, run = category_pack(tmp_path / "data"), tmp_path / "run"
    common = [str(packed), "--output", str(run), "--save-every", "2", "--steps", "4", "--log-every", "100"]
    train(*common)
    first = losses(run)
    distcp = run / "checkpoints" / "step-4" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x40
    distcp.write_bytes(bytes(data))
    result = train(*common)
    assert (f"{run / 'checkpoints' / 'latest'} names step-4, which is damaged (__0_0.distcp: its sha256 differs from "
            "the one trainer.json records): using step-2, the newest complete checkpoint\n") in result.stderr
    assert "resuming at step 2" in result.stderr
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert_same_losses(first, losses(run), [3, 4])
    assert damage(run / "checkpoints" / "step-4") is None  # saved again


def test_a_kill_inside_an_async_publication_leaves_nothing_that_stays(tmp_path):
    """SIGKILL with step-4's `latest` written to its temporary file (.latest.tmp-PID), not renamed: the run resumes
    from step-2, which `latest` still names, and its first save deletes the stray file."""
    packed, run = category_pack(tmp_path / "data"), tmp_path / "run"
    common = [str(packed), "--output", str(run), "--save-every", "2", "--steps", "6", "--log-every", "100",
              "--async-save"]
    killed = xtrain_proc(*common, env={KILL_PUBLISHING_ENV: "step-4"}, cmd=FAULTY)
    ckpts = run / "checkpoints"
    assert killed.returncode == -9, killed.stderr
    assert (ckpts / "latest").read_text() == "step-2\n" and damage(ckpts / "step-4") is None
    assert len(list(ckpts.glob(".latest.tmp-*"))) == 1  # what the kill left
    first = losses(run)
    resumed = train(*common)
    assert "resuming at step 2" in resumed.stderr
    assert sorted(losses(run)) == list(range(1, 7)) and not list(ckpts.glob(".latest.tmp-*"))
    assert_same_losses(first, losses(run), [3, 4])
    assert (ckpts / "latest").read_text() == "step-6\n" and damage(ckpts / "step-6") is None


def test_keep_all_keeps_every_checkpoint_and_no_save_writes_none(tmp_path):
    packed, kept, other = category_pack(tmp_path / "data"), tmp_path / "kept", tmp_path / "other"
    train(str(packed), "--output", str(kept), "--steps", "4", "--save-every", "1", "--keep", "all",
          "--log-every", "100")
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["latest", "step-1", "step-2", "step-3",
                                                                       "step-4"]
    assert json.loads((kept / "config.json").read_text())["checkpoint"]["keep"] == "all"
    result = train(str(packed), "--output", str(other), "--steps", "3", "--save-every", "1", "--no-save",
                   "--resume", str(kept / "checkpoints" / "step-2"), "--log-every", "100")
    assert "resuming at step 2" in result.stderr and sorted(losses(other)) == [3]
    assert not (other / "checkpoints").exists()
    assert_same_losses(losses(kept), losses(other), [3])
    assert "--keep 'some'" in user_error(str(packed), "--output", str(other), "--keep", "some")
