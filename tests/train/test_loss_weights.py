"""Category and source weights in the loss: ``--category-weight NAME=W``, ``--source-weight NAME=W``.

On real chat data (chitchat conversations of two topics, tokenized with the Qwen3 chat template, each topic its
own category and blend source): the weighted loss of a run, the channel losses of a category at weight 0, what the
run directory records, the resume note, the refusals. On the synthetic category pack: weights of 1 are today's
loss bit for bit, and a step whose targets all weigh 0 applies no update. (The gradients over dp × cp ×
accumulation splits and against a direct computation are in test_parallel_equivalence.py.)
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import requires_shared_data
from trainkit import category_pack, make_dataset, make_trainer, params, random_docs, user_error, write_pack
from xprep.cli import xprep, xtrain
from xprep.train.config import TrainConfig, validate_against_schema
from xprep.train.metrics import MetricsLog

TOPICS = {"hero": "Who is your modern-day hero?", "smell": "What's your favorite smell?"}
CONVERSATIONS = 12  # of each topic


def invoke(group, *args) -> CliRunner:
    result = CliRunner().invoke(group, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture(scope="module")
def chat_pack(tmp_path_factory, shared_data) -> tuple[Path, Path]:
    """A 50/50 blend of two chitchat topics, each tokenized with Qwen3's chat template as its own category
    (``--category``): sources and categories hero and smell. Returns the pack and a small model config for its
    151,669-token vocabulary."""
    root = tmp_path_factory.mktemp("chat")
    picked: dict[str, list[str]] = {name: [] for name in TOPICS}
    with open(shared_data / "chat" / "chitchat.jsonl", encoding="utf-8") as f:
        for line in f:
            for name, topic in TOPICS.items():
                if json.loads(line)["topic"] == topic and len(picked[name]) < CONVERSATIONS:
                    picked[name].append(line)
    for name, lines in picked.items():
        (root / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")
        invoke(xprep, "tokenize", root / f"{name}.jsonl", "-o", root / name, "--tokenizer",
               shared_data / "tokenizers" / "qwen3", "--category", name)
    invoke(xprep, "pack", f"{root / 'hero'}@0.5", f"{root / 'smell'}@0.5", "-o", root / "p", "--method",
           "multipack", "--seq-len", "256", "--overlong", "split")
    model = root / "model.json"
    model.write_text(json.dumps({"vocab_size": 151669, "dim": 32, "n_layers": 1, "n_heads": 2}))
    return root / "p", model


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@requires_shared_data
def test_a_weighted_run_on_real_chat_categories(chat_pack, tmp_path):
    """smell at 0 and the hero source at 2: the loss is hero's mean alone (its tokens hold all the weight), while
    the token mean and the channel losses, smell's included, stay unweighted; run.json, the checkpoint and
    `xprep inspect` record the weights; a resume with other weights says which, and continues. The chunked loss
    (--loss-chunk) carries the weights into its backward."""
    packed, model = chat_pack
    run = tmp_path / "run"
    first = invoke(xtrain, "run", packed, "--model", model, "--steps", "2", "--micro-batch-size", "2",
                   "--loss-chunk", "64", "--category-weight", "smell=0", "--source-weight", "hero=2",
                   "--log-every", "1", "-o", run)
    assert "loss weighted (category smell 0; source hero 2; others 1)" in first.stderr
    rows = metrics(run)
    both = [r for r in rows if set(r["category_loss"]) == {"hero", "smell"}]
    assert both, rows  # a step with targets of both categories
    for r in both:
        assert r["loss"] == pytest.approx(r["category_loss"]["hero"], rel=1e-6)
        assert min(r["category_loss"].values()) < r["token_loss"] < max(r["category_loss"].values())
        assert r["weightless"] is False
    recorded = json.loads((run / "run.json").read_text())["loss_weights"]
    assert recorded == {"category": {"uncategorized": 1.0, "hero": 1.0, "smell": 0.0},
                        "source": {"hero": 2.0, "smell": 1.0}}
    state = json.loads((run / "checkpoints" / "step-2" / "trainer.json").read_text())
    assert state["loss_weights"] == recorded
    report = json.loads(invoke(xprep, "inspect", run, "--json").output)
    assert report["loss_weights"] == recorded and report["token_loss"]["points"] == 2
    assert report["weightless_steps"] == 0
    text = " ".join(invoke(xprep, "inspect", run).output.split())
    assert "loss weights category smell 0, source hero 2 (others 1)" in text

    resumed = invoke(xtrain, "run", "-o", run, "--steps", "3", "--category-weight", "smell=0.5")
    assert "resuming with other hyperparameters than the checkpoint's: --category-weight smell 0 → 0.5" \
        in resumed.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert json.loads((run / "run.json").read_text())["loss_weights"]["category"]["smell"] == 0.5


@requires_shared_data
@pytest.mark.parametrize("args,message", [
    (["--category-weight", "sport=2"], "--category-weight sport=2: the pack has no category 'sport'; its "
                                       "categories: uncategorized, hero, smell"),
    (["--source-weight", "web=2"], "--source-weight web=2: the pack has no source 'web'; its sources: hero, smell"),
    (["--category-weight", "hero=-1"], "--category-weight hero=-1: a weight must be a finite number ≥ 0"),
    (["--source-weight", "hero=inf"], "--source-weight hero=inf: a weight must be a finite number ≥ 0"),
    (["--category-weight", "hero=nan"], "--category-weight hero=nan: a weight must be a finite number ≥ 0"),
    (["--category-weight", "hero"], "--category-weight 'hero' is not NAME=W"),
    (["--source-weight", "hero=2", "--source-weight", "hero=3"], "--source-weight hero given twice (2 and 3)"),
    (["--category-weight", "hero=0", "--category-weight", "smell=0", "--category-weight", "uncategorized=0"],
     "--category-weight: every category of the pack (uncategorized, hero, smell) has weight 0"),
])
def test_bad_weights_are_refused_before_training(chat_pack, tmp_path, args, message):
    packed, model = chat_pack
    line = user_error(str(packed), "--model", str(model), "--steps", "1", "-o", str(tmp_path / "run"), *args)
    assert message in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_weights_in_config_files_and_flags(tmp_path):
    """The flag's NAME=W items and a config file's {name: weight} give the same field, checked by the schema."""
    flags = TrainConfig.from_dict({"packed": "p", "category_weight": ("user=0.1", "system=0"),
                                   "source_weight": ["web=2"]})
    nested = TrainConfig.from_dict({"data": {"packed": "p", "category_weight": {"user": 0.1, "system": 0},
                                             "source_weight": {"web": 2}}})
    assert flags == nested and flags.data.category_weight == {"user": 0.1, "system": 0.0}
    validate_against_schema(flags.to_dict())
    assert TrainConfig.from_dict(flags.to_dict()) == flags  # config.json reads back
    assert TrainConfig.from_dict({"packed": "p"}).data.category_weight is None


def test_weights_of_one_are_todays_loss_exactly(tmp_path):
    """Weights that are all 1 are no weighting: the same losses and updates, bit for bit, as no flag."""
    packed = category_pack(tmp_path)
    plain = make_trainer(packed, micro=2, accum=2)
    ones = make_trainer(packed, micro=2, accum=2, category_weight={"a": 1.0, "uncategorized": 1},
                        source_weight={"ds": 1})
    assert ones.loss_weights is None
    for _ in range(2):
        a, b = plain.train_step(), ones.train_step()
        assert a.loss == b.loss and a.category_loss == b.category_loss and "token_loss" not in a.record()
    after_plain, after_ones = params(plain.model), params(ones.model)
    assert all(torch.equal(after_plain[k], after_ones[k]) for k in after_plain)


def test_a_step_whose_targets_all_weigh_zero_applies_no_update(tmp_path):
    """Bin 1 (step 2) holds only category b, at weight 0: that step has no loss and moves no weight (AdamW's
    momentum would), says so on the console, and still reports b's channel loss; the steps around it train."""
    docs = random_docs(3, 20, 40, vocab=128)
    cats = [np.full(len(d), c) for d, c in zip(docs, (1, 2, 1), strict=True)]
    make_dataset(tmp_path / "ds", docs, vocab_size=128, cats=cats, categories=["a", "b"])
    packed = write_pack(tmp_path / "p", [tmp_path / "ds"], [[(d, 0, len(doc))] for d, doc in enumerate(docs)], 64)
    trainer = make_trainer(packed, micro=1, accum=1, lr=1e-2, category_weight={"b": 0})
    out = io.StringIO()
    log = MetricsLog(tmp_path / "run", 3, 1, True, out)
    (tmp_path / "run").mkdir()
    log.open(0)
    steps, states = [], [params(trainer.model)]
    for _ in range(3):
        steps.append(trainer.train_step())
        log.write(steps[-1])
        states.append(params(trainer.model))
    log.close()
    moved = [not all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(states, states[1:], strict=False)]
    assert moved == [True, False, True]
    assert [m.weightless for m in steps] == [False, True, False]
    assert steps[1].loss is None and steps[1].token_loss > 0 and set(steps[1].category_loss) == {"b"}
    assert steps[1].record()["weightless"] is True and steps[0].loss == pytest.approx(steps[0].token_loss)
    assert "step 2/3: every target token of the step weighs 0" in out.getvalue()
