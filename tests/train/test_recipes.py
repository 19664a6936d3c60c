"""The extension recipes of docs/architecture.md, run as written: a loss term and a model.

The code and config blocks are read from the page itself, so a recipe that stops working, or a page that
drifts from the code, fails here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import trainkit
from click.testing import CliRunner
from trainkit import category_pack, make_trainer
from xprep.cli import xtrain
from xprep.train import model as model_module
from xprep.train.data import collate
from xprep.train.loss import IGNORE

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def recipe_section(heading: str) -> str:
    """The text of the page's section ``## heading``, up to the next section."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"{PAGE}: no section '## {heading}'"
    return found.group(1)


def code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, re.M | re.S)


def recipe_code(heading: str, marker: str) -> str:
    """The Python block of a recipe, the one whose first line is ``# recipe: marker``."""
    blocks = [b for b in code_blocks(recipe_section(heading), "python") if b.startswith(f"# recipe: {marker}\n")]
    assert len(blocks) == 1, f"{PAGE}: section '{heading}' has no single '# recipe: {marker}' block"
    return blocks[0]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return category_pack(tmp_path_factory.mktemp("recipes"))


# ---------------------------------------------------------------------------------------------- loss term
def z_loss_trainer(weight: float, monkeypatch, packed: Path):
    """The recipe's ZLossTrainer with ``z_weight = weight``, built as the plain trainer is (trainkit)."""
    namespace: dict = {}
    exec(compile(recipe_code("Recipe: a loss term", "loss-term"), str(PAGE), "exec"), namespace)
    cls = type("Weighted", (namespace["ZLossTrainer"],), {"z_weight": weight})
    monkeypatch.setattr(trainkit, "Trainer", cls)
    return make_trainer(packed, micro=1, accum=2)


def z_sum(trainer, bins: list[int]) -> float:
    """Σ log²Z over the target tokens of ``bins`` (one micro-batch each), from the model's logits."""
    total = 0.0
    with torch.no_grad():
        for b in bins:
            batch = collate([trainer.dataset[b]])
            logits = trainer.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
            log_z = torch.logsumexp(logits.double(), dim=-1).reshape(-1)
            total += float(log_z[batch["labels"].reshape(-1) != IGNORE].square().sum())
    return total


def test_a_loss_term_added_the_recipes_way_adds_its_mean_over_the_steps_targets(packed, monkeypatch):
    plain = make_trainer(packed, micro=1, accum=2)
    expected_z = z_sum(plain, [0, 1])  # the sequential sampler's first step: bins 0 and 1, before any update
    base = plain.train_step()
    weight = 0.01
    with_term = z_loss_trainer(weight, monkeypatch, packed).train_step()
    assert with_term.targets == base.targets > 0
    want = base.loss + weight * expected_z / base.targets
    assert math.isclose(with_term.loss, want, rel_tol=1e-6), (with_term.loss, base.loss, want)
    assert with_term.loss - base.loss > 0.05  # the term is visible, not rounding


def test_a_loss_term_of_weight_zero_leaves_the_loss_and_the_update_unchanged(packed, monkeypatch):
    plain = make_trainer(packed, micro=1, accum=2)
    zero = z_loss_trainer(0.0, monkeypatch, packed)
    for _ in range(2):  # the second step runs on the weights the first update made
        a, b = plain.train_step(), zero.train_step()
        assert math.isclose(a.loss, b.loss, rel_tol=1e-6), (a.loss, b.loss)


# -------------------------------------------------------------------------------------------------- model
def train_two_steps(packed: Path, model: str, run: Path) -> dict:
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--model", model, "--steps", "2", "--no-save",
                                         "--log-every", "1", "--output", str(run)])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    return json.loads((run / "run.json").read_text())["model"]


def test_a_json_model_config_from_the_recipe_trains(packed, tmp_path):
    (block,) = code_blocks(recipe_section("Recipe: a model"), "json")
    fields = json.loads(block)
    (tmp_path / "toy.json").write_text(block)
    model = train_two_steps(packed, str(tmp_path / "toy.json"), tmp_path / "run")
    assert {k: model[k] for k in fields} == fields
    assert model["vocab_size"] == 128  # the data's (category_pack's vocabulary)


def test_a_preset_registered_the_recipes_way_trains(packed, tmp_path, monkeypatch):
    presets = dict(model_module.PRESETS)
    exec(compile(recipe_code("Recipe: a model", "model-preset"), str(PAGE), "exec"), {"PRESETS": presets})
    (name,) = set(presets) - set(model_module.PRESETS)
    monkeypatch.setattr(model_module, "PRESETS", presets)
    model = train_two_steps(packed, name, tmp_path / "run")
    assert {k: model[k] for k in presets[name]} == presets[name]
