"""A step (or an evaluation) with no target token has no loss (issue 29, point 3).

Such a step was logged as `loss 0.0000`, became the "best" checkpoint that `--keep` kept, and drew the loss
curve down to 0. Its loss is null in metrics.jsonl, "none" on the console, it is never the best checkpoint,
it is left out of the report's first/last/best/trend and counted there as a step without targets; an
evaluation whose bins hold no target likewise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner
from test_train_run import metrics
from trainkit import make_dataset, make_trainer, max_rel_diff, params, random_docs, write_pack
from xprep.cli import xprep, xtrain
from xprep.prep.pack.entry import MANIFEST
from xprep.train.report import run_report


def no_target_pack(root: Path) -> Path:
    """Bins of one document each; document 1 (bin 1: step 2 of a sequential run) has no target token. The
    validation entry is documents 1 and 5, neither with a target."""
    docs = random_docs(6, 20, 40, vocab=128)
    masks = [np.concatenate([[0], np.ones(len(d) - 1, np.int64)]) for d in docs]
    masks[1][:] = 0
    masks[5][:] = 0
    make_dataset(root / "ds", docs, vocab_size=128, loss_masks=masks)
    packed = root / "p"
    write_pack(packed, [root / "ds"], [[(1, 0, len(docs[1]))], [(5, 0, len(docs[5]))]], 64, key="v" * 64)
    write_pack(packed, [root / "ds"], [[(d, 0, len(doc))] for d, doc in enumerate(docs)], 64, key="t" * 64)
    manifest = json.loads((packed / MANIFEST).read_text())
    manifest.update(validation=f"sequential-{'v' * 16}", entries={f"sequential-{c * 16}": {} for c in "tv"})
    (packed / MANIFEST).write_text(json.dumps(manifest))
    return packed


def test_a_step_without_targets_has_no_loss_and_is_never_the_best(tmp_path):
    packed, run = no_target_pack(tmp_path), tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "4", "--save-every", "1", "--keep", "1",
                                         "--log-every", "1", "--lr", "1e-2", "--output", str(run)])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = metrics(run)
    assert [r["target_tokens"] == 0 for r in rows] == [False, True, False, False]
    assert rows[1]["loss"] is None and rows[1]["category_loss"] == {} and rows[1]["source_loss"] == {}
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in rows if r["step"] != 2)
    assert "step 2/4  loss none (no target tokens)" in result.stderr
    # the evaluation after step 4 had two bins and no target: no validation loss either
    assert rows[-1]["eval_loss"] is None and rows[-1]["eval_target_tokens"] == 0 and rows[-1]["eval_bins"] == 2
    assert "eval step 4/4  loss none (no target tokens)" in result.stderr
    state = json.loads((run / "checkpoints" / "step-2" / "trainer.json").read_text()) if (
        run / "checkpoints" / "step-2").is_dir() else None
    assert state is None, state  # --keep 1: the latest and the best by training loss, never the step without one
    best = min((r for r in rows if r["loss"] is not None), key=lambda r: r["loss"])["step"]
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"latest", "step-4", f"step-{best}"}

    report = run_report(run)
    assert report["steps_without_targets"] == 1 and report["evaluations_without_targets"] == 1
    assert report["loss"]["points"] == 3 and report["loss"]["best"] > 0
    assert report["curves"]["loss"][1] is None  # a gap in the curve, not a drop to 0
    assert report["checkpoints"]["best"] == f"step-{best}" and report["checkpoints"]["best_by"] == "loss"
    shown = CliRunner().invoke(xprep, ["inspect", str(run), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["steps_without_targets"] == 1


def test_a_step_without_targets_applies_no_update(tmp_path):
    """Its gradients are zero, but AdamW would still move every weight by its momentum and decay: it does not
    step."""
    trainer = make_trainer(no_target_pack(tmp_path), micro=1, accum=1, lr=1e-2)
    before = []
    for _ in range(3):
        before.append(params(trainer.model))
        m = trainer.train_step()
        assert (m.targets == 0) == (m.step == 2) and not m.skipped
    after = params(trainer.model)
    assert max_rel_diff(before[1], before[0]) > 0 and max_rel_diff(after, before[2]) > 0  # steps 1 and 3 learn
    assert all(torch.equal(before[2][k], before[1][k]) for k in before[1])  # step 2: not one weight moved
