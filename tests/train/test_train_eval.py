"""Validation in `xtrain run` and the per-source channel loss (issue 11, trainer side).

The validation loss of a dp=2 run and of a cp=2 run equals a plain single-process loop over the same
validation bins with the checkpoint's weights (Σ CE / Σ targets, ≤ 1e-6 relative); the per-source loss
of a step equals a direct per-source computation; the best checkpoint follows the validation loss;
evaluations show on the console and in `xprep inspect`; bad options end in one line, exit 2; a resumed
run evaluates as an uninterrupted one.

The validation entry is what `xprep pack --split` names in PACKED/manifest.json under "validation":
here a second entry, packed from another dataset into the same cache, named there by hand.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from test_train_run import metrics, user_error
from trainkit import category_pack, cp_pack, make_dataset, make_trainer, random_docs
from xprep.cli import xprep, xtrain
from xprep.prep.errors import XprepError
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.entry import MANIFEST, open_packed
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import TRAINER_JSON
from xprep.train.config import (
    DataSection,
    EvalSection,
    ModelSection,
    OptimizerSection,
    TrainConfig,
    validate_against_schema,
)
from xprep.train.data import IGNORE, PackedDataset
from xprep.train.dist import ParallelDims
from xprep.train.evaluate import DEFAULT_EVAL_BINS, EvalProgress, eval_rounds, spaced_bins, validation_entry
from xprep.train.loss import Channels
from xprep.train.samplers import build_sampler
from xprep.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
XTRAIN = [str(Path(sys.executable).with_name("xtrain")), "run"]
TOL = 1e-6
EVAL_BINS = 5  # odd: with dp=2 one rank has a bin less and runs a filler micro-batch


def eval_pack(root: Path, cp_size: int = 2) -> Path:
    """A pack cache (--cp-size 2) whose manifest names a validation entry packed from another dataset."""
    packed = cp_pack(root, cp_size)
    train_entry = open_packed(packed).path.name
    rng = np.random.default_rng(7)
    docs = random_docs(30, 3, 40, vocab=128, seed=7)
    masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs]
    cats = [np.full(len(d), rng.integers(0, 3)) for d in docs]
    make_dataset(root / "vds", docs, vocab_size=128, loss_masks=masks, cats=cats, categories=["b", "a"])
    valid = pack([root / "vds"], packed, PackConfig(method="multipack", seq_len=64, cp_size=cp_size))
    manifest = json.loads((packed / MANIFEST).read_text())
    manifest.update(current=train_entry, validation=valid.entry.path.name)
    (packed / MANIFEST).write_text(json.dumps(manifest))
    return packed


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return eval_pack(tmp_path_factory.mktemp("eval"))


def xtrain_proc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*XTRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def direct_eval(packed: Path, checkpoint: Path, n_bins: int) -> tuple[float, dict[str, float]]:
    """A plain loop over ``n_bins`` validation bins evenly spaced over the entry (bin ⌊i·N/n_bins⌋) with the
    checkpoint's weights, one process: (Σ CE / Σ targets, the same per category)."""
    trainer = make_trainer(packed, 1, 1)
    CheckpointManager(checkpoint.parent.parent, ParallelDims()).load(checkpoint, trainer.model, trainer.optimizer,
                                                                     trainer.dataset.key)
    valid = PackedDataset(validation_entry(packed))
    ce, cats = [], []
    with torch.no_grad():
        for b in (i * len(valid) // n_bins for i in range(n_bins)):
            batch = valid[b]
            logits = trainer.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])[0]
            sel = batch["labels"][0] != IGNORE
            ce.append(F.cross_entropy(logits[sel].double(), batch["labels"][0][sel], reduction="none"))
            cats.append(batch["category_ids"][0][sel])
    ce, cats = torch.cat(ce), torch.cat(cats)
    names = valid.category_names
    per_cat = {names[c]: float(ce[cats == c].mean()) for c in range(1, len(names)) if (cats == c).any()}
    return float(ce.mean()), per_cat


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * abs(b)


# ------------------------------------------------------------------------------------- exactness (3b)
@pytest.mark.parametrize("layout", [["--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "4"],
                                    ["--cp", "2", "--micro-batch-size", "1", "--global-batch-size", "2"]],
                         ids=["dp2", "cp2"])
def test_eval_loss_equals_direct_computation(packed, tmp_path, layout):
    run = tmp_path / "run"
    proc = xtrain_proc(str(packed), "--nproc-per-node", "2", *layout, "--steps", "2", "--eval-every", "1",
                       "--eval-bins", str(EVAL_BINS), "--save-every", "1", "--keep", "5", "--lr", "1e-2",
                       "--schedule", "constant", "--output", str(run))  # (a decay reaches lr 0 at step 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(run)
    assert [r["eval_bins"] for r in rows] == [EVAL_BINS, EVAL_BINS]
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"]  # the weights moved: each step is really evaluated
    for row in rows:
        loss, per_cat = direct_eval(packed, run / "checkpoints" / f"step-{row['step']}", EVAL_BINS)
        assert close(row["eval_loss"], loss), (row["eval_loss"], loss)
        assert row["eval_category_loss"].keys() == per_cat.keys() and per_cat
        for name, value in per_cat.items():
            assert close(row["eval_category_loss"][name], value), name
        (source, value), = row["eval_source_loss"].items()  # a plain pack: one source
        assert source in ("vds", "all") and close(value, loss)
    assert proc.stderr.count("eval step 2/2  loss") == 1  # rank 0 speaks


def test_ranks_evaluate_every_bin_once_in_as_many_forwards():
    for n_total, n_bins, dp, micro in ((5, 5, 2, 2), (7, 7, 3, 1), (4, 4, 4, 2), (1, 1, 2, 1), (1000, 7, 2, 2)):
        chosen = spaced_bins(n_total, n_bins)
        assert len(set(chosen)) == n_bins and chosen[0] == 0 and chosen == sorted(chosen)
        rounds = [eval_rounds(chosen, r, dp, micro) for r in range(dp)]
        assert len({len(r) for r in rounds}) == 1
        assert sorted(b for r in rounds for batch in r for b in batch) == chosen
        assert all(len(batch) <= micro for r in rounds for batch in r)
    assert spaced_bins(1000, 4) == [0, 250, 500, 750] and spaced_bins(3, 10) == [0, 1, 2]


# ------------------------------------------------------------------------------------- per source (4)
class Sourced(PackedDataset):
    """The blend interface by hand: two sources, and each token's source id beside its category id."""

    @property
    def source_names(self) -> list[str]:
        return ["web", "code"]

    @source_names.setter
    def source_names(self, _names) -> None:  # whatever train/data.py sets, this test's names stay
        pass

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        batch = super().__getitem__(b)
        batch["source_ids"] = torch.randint(0, 2, batch["labels"].shape, generator=torch.Generator().manual_seed(b))
        return batch


def test_source_loss_equals_direct_computation(tmp_path):
    ds = Sourced(category_pack(tmp_path))
    model, _ = ModelSection("tiny").build(ds.vocab_size, 0)
    opt, sched = OptimizerSection(lr=1e-3).build(model, 10)
    trainer = Trainer(model, opt, sched, ds, build_sampler("sequential", len(ds), 1, 0, 1, 0), ParallelDims(), 4,
                      torch.device("cpu"))
    before = copy.deepcopy(model)
    step = trainer.train_step()
    ce, sources = [], []
    with torch.no_grad():
        for b in range(4):  # the step's bins: micro-batch 1 × 4 accumulation, sequential
            batch = ds[b]
            logits = before(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])[0]
            sel = batch["labels"][0] != IGNORE
            ce.append(F.cross_entropy(logits[sel].double(), batch["labels"][0][sel], reduction="none"))
            sources.append(batch["source_ids"][0][sel])
    ce, sources = torch.cat(ce), torch.cat(sources)
    expected = {name: float(ce[sources == i].mean()) for i, name in enumerate(["web", "code"])}
    assert step.source_loss.keys() == expected.keys()
    for name, value in expected.items():
        assert close(step.source_loss[name], value), name
    assert close(step.loss, float(ce.mean())) and step.category_loss


def test_a_batch_without_source_ids_is_one_source():
    channels = Channels.of(["uncategorized", "a"], None)
    sums = channels.zeros()
    labels = torch.tensor([[5, IGNORE, 7]])
    sums.add(torch.tensor([1.0, 0.0, 3.0]), labels, *channels.ids({"labels": labels,
                                                                  "category_ids": torch.tensor([[1, 0, 0]])}))
    assert channels.losses(sums) == {"category": {"a": 1.0}, "source": {"all": 2.0}}


# ------------------------------------------------------------------------------------- best checkpoint
def write_states(root: Path, states: dict[int, dict]) -> CheckpointManager:
    manager = CheckpointManager(root, ParallelDims(), keep=1)
    for step, state in states.items():
        (manager.root / f"step-{step}").mkdir(parents=True)
        (manager.root / f"step-{step}" / TRAINER_JSON).write_text(json.dumps({"step": step, **state}))
    return manager


def test_best_checkpoint_follows_eval_loss(tmp_path):
    manager = write_states(tmp_path / "run", {1: {"loss": 3.0, "eval_loss": 2.0}, 2: {"loss": 2.0, "eval_loss": 1.5},
                                              3: {"loss": 1.0, "eval_loss": 1.8}, 4: {"loss": 0.5, "eval_loss": None}})
    assert manager.best() == "step-2"  # not step-4, the lowest training loss, which did not evaluate
    manager._retain("step-4")
    manager.finish()  # retired checkpoints are deleted in the background
    assert {p.name for p in manager.root.iterdir()} == {"step-2", "step-4"}
    without = write_states(tmp_path / "plain", {1: {"loss": 3.0}, 2: {"loss": 1.0}, 3: {"loss": 2.0}})
    assert without.best() == "step-2"  # no validation: training loss, as before


# ------------------------------------------------------------------------------------- run, console, inspect
def run_in_process(packed: Path, out: Path, *args: str):
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--micro-batch-size", "2", "--schedule", "constant",
                                         "--lr", "1e-2", "--output", str(out), *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_eval_on_console_in_metrics_and_inspect(packed, tmp_path):
    run = tmp_path / "run"
    result = run_in_process(packed, run, "--steps", "4", "--eval-every", "2", "--save-every", "1", "--keep", "1")
    assert "validating on" in result.stderr and "every 2 steps and after the last step" in result.stderr
    assert result.stderr.count("eval step") == 2 and "eval step 4/4  loss" in result.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert all({"source_loss", "category_loss"} <= r.keys() for r in rows)
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    best = min(evals, key=evals.get)
    kept = {p.name for p in (run / "checkpoints").iterdir()}
    assert f"step-{best}" in kept and "step-1" not in kept and "step-3" not in kept
    shown = CliRunner().invoke(xprep, ["inspect", str(run)])
    assert shown.exit_code == 0, shown.output
    assert "validation loss (" in shown.output and "  validation    " in shown.output
    assert f"best step-{best} (validation loss" in shown.output
    report = json.loads(CliRunner().invoke(xprep, ["inspect", str(run), "--json"]).output)
    assert report["eval"]["loss"]["points"] == 2 and report["eval"]["categories"]
    assert report["checkpoints"]["best_by"] == "eval_loss" and report["validation"]["eval_bins"] > EVAL_BINS


def test_evaluates_at_the_end_by_default_and_resumes_exactly(packed, tmp_path):
    whole = tmp_path / "whole"
    run_in_process(packed, whole, "--steps", "4", "--eval-bins", str(EVAL_BINS))
    assert [r["step"] for r in metrics(whole) if "eval_loss" in r] == [4]
    split = tmp_path / "split"
    run_in_process(packed, split, "--steps", "2", "--eval-bins", str(EVAL_BINS))
    run_in_process(packed, split, "--steps", "4", "--eval-bins", str(EVAL_BINS))  # resumes at step 2
    a, b = metrics(whole)[-1], metrics(split)[-1]
    assert a["step"] == b["step"] == 4 and close(b["eval_loss"], a["eval_loss"])


# ------------------------------------------------------------------------------------- bad input
def test_bad_eval_options_are_one_line(packed, tmp_path):
    out = ["--output", str(tmp_path / "r"), "--steps", "1"]
    assert "--eval-every -1 must be ≥ 0" in user_error(str(packed), *out, "--eval-every", "-1")
    assert "--eval-bins 0 must be ≥ 1" in user_error(str(packed), *out, "--eval-bins", "0")
    assert "has only" in user_error(str(packed), *out, "--eval-bins", "1000")
    plain = category_pack(tmp_path / "plain")
    line = user_error(str(plain), *out, "--eval-every", "2")
    assert "--eval-every 2" in line and "no validation entry" in line and "--split" in line
    assert not (tmp_path / "r").exists()


def test_a_pack_split_by_xprep_is_evaluated(tmp_path):
    """The real interface: `xprep pack --split 80,20` names the validation entry itself."""
    make_dataset(tmp_path / "ds", random_docs(60, 3, 40, vocab=128), vocab_size=128)
    pack([tmp_path / "ds"], tmp_path / "p", PackConfig(method="multipack", seq_len=64, split=(80, 20)))
    assert validation_entry(tmp_path / "p") is not None
    result = run_in_process(tmp_path / "p", tmp_path / "run", "--steps", "2")
    assert "eval step 2/2  loss" in result.stderr
    assert [r["step"] for r in metrics(tmp_path / "run") if "eval_loss" in r] == [2]


# ------------------------------------------------------------------------------------- how many bins (issue 29, 9)
@pytest.fixture(scope="module")
def many_bins(tmp_path_factory) -> Path:
    """A --split pack whose validation entry has more bins than an evaluation reads by default."""
    root = tmp_path_factory.mktemp("many")
    make_dataset(root / "ds", random_docs(1600, 2, 6, vocab=128), vocab_size=128)
    pack([root / "ds"], root / "p", PackConfig(method="multipack", seq_len=8, split=(50, 50)))
    return root / "p"


def test_an_evaluation_reads_256_spaced_bins_unless_told(many_bins):
    """Every bin by default took 12 silent minutes after 4 CPU steps: 256, evenly spaced over the entry (a multipack
    entry is ordered longest first), unless --eval-bins says a number or all."""
    data, dims = DataSection(str(many_bins)), ParallelDims()
    train = data.build(1)
    total = len(PackedDataset(validation_entry(many_bins)))
    assert total > DEFAULT_EVAL_BINS == 256

    def chosen(section: EvalSection) -> list[int]:
        validation = section.build(data, train, dims, 2)
        bins = [b for batch in validation.rounds for b in batch]
        assert len(bins) == validation.bins
        return bins

    assert chosen(EvalSection()) == [i * total // 256 for i in range(256)]
    assert chosen(EvalSection(bins="all")) == list(range(total))
    assert chosen(EvalSection(bins="10")) == [i * total // 10 for i in range(10)]  # from the command line: a string
    for bad, said in (("ten", "neither a number of bins nor 'all'"), ("0", "must be ≥ 1")):
        with pytest.raises(XprepError, match=said):
            EvalSection(bins=bad)
    cfg = TrainConfig.from_dict({"packed": "p", "eval_bins": "all"})
    validate_against_schema(cfg.to_dict())


def test_a_long_evaluation_shows_progress(many_bins):
    """Off a terminal a line every PROGRESS_EVERY seconds (here: at every micro-batch), on one a line redrawn in
    place and cleared for the result's."""
    trainer = make_trainer(many_bins, 2, 1)
    validation = EvalSection(bins=12).build(DataSection(str(many_bins)), trainer.dataset, trainer.dims, 2)
    log = io.StringIO()
    plain = trainer.evaluate(validation, EvalProgress(4, len(validation.rounds), validation.bins, log, interval=1e-9))
    lines = log.getvalue().splitlines()
    assert len(lines) == len(validation.rounds) - 1 == 5, lines  # the last one is the result's line
    assert lines[0].startswith("evaluating after step 4: 2/12 bins (17%)") and "ETA" in lines[0]
    assert lines[-1].startswith("evaluating after step 4: 10/12 bins (83%)")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    progress = EvalProgress(4, len(validation.rounds), validation.bins, term)
    progress.interval = 1e-9
    assert trainer.evaluate(validation, progress).loss == plain.loss
    out = term.getvalue()
    drawn = out.split("\r")
    assert len(drawn) == 1 + 5 + 2 and "\n" not in out  # five lines drawn in place, then blanked out
    assert drawn[5].startswith("evaluating after step 4: 10/12")
    assert drawn[6] == " " * max(map(len, drawn)) and not drawn[7]
    quiet = io.StringIO()
    trainer.evaluate(validation, EvalProgress(4, len(validation.rounds), validation.bins, quiet))
    assert quiet.getvalue() == ""  # a short evaluation off a terminal says nothing
