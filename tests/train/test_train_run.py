"""`xtrain run` end to end: run directory, exact resume after SIGKILL, retention, refusals, inspect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from _train_fault_worker import KILL_AFTER_STEP_ENV
from click.testing import CliRunner
from trainkit import category_pack, make_dataset, user_error, write_pack
from xprep.cli import xprep, xtrain
from xprep.train.data import PackedDataset, collate
from xprep.train.hf import HFCausalLM

ROOT = Path(__file__).resolve().parents[2]
XTRAIN = [str(Path(sys.executable).with_name("xtrain")), "run"]
FAULTY = [sys.executable, str(ROOT / "tests" / "_train_fault_worker.py"), "run"]  # xtrain run + a fault hook


def xtrain_proc(*args: str, env: dict | None = None, cmd: list[str] = XTRAIN) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return category_pack(tmp_path_factory.mktemp("data"))


def test_exact_resume_after_sigkill(packed, tmp_path):
    args = [str(packed), "--steps", "8", "--save-every", "3", "--sampler", "random", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--warmup", "2", "--log-every", "100"]
    full = xtrain_proc(*args, "--output", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    killed = xtrain_proc(*args, "--output", str(tmp_path / "cut"), env={KILL_AFTER_STEP_ENV: "5"}, cmd=FAULTY)
    assert killed.returncode == -9
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step-3"
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3, 4, 5]
    resumed = xtrain_proc(*args, "--output", str(tmp_path / "cut"), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6 * ra["loss"], (ra, rb)
        assert ra["consumed_samples"] == rb["consumed_samples"] and ra["lr"] == rb["lr"]
    kept = {p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()}
    assert {"latest", "step-6", "step-8"} <= kept and len(kept) <= 4  # + the best by loss


def test_run_directory_and_inspect(packed, tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 3\nmicro-batch-size: 2\nlr: 0.001\nkeep: 1\nsave_every: 1\n")
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--config", str(cfg), "--output", str(run),
                                         "--lr", "0.002"])
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert config["optimizer"]["lr"] == 0.002 and config["steps"] == 3 and config["data"]["micro_batch_size"] == 2
    jsonschema.validate(config, json.loads((ROOT / "schemas" / "train.schema.json").read_text()))
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) >= {"loss", "category_loss", "grad_norm", "lr", "tokens_per_s", "consumed_samples"}
    assert set(rows[0]["category_loss"]) <= {"a", "b", "c"} and rows[0]["category_loss"]
    kept = {p.name for p in (run / "checkpoints").iterdir()}
    assert {"latest", "step-3"} <= kept and len(kept) <= 3  # keep 1, + the best by loss
    shown = CliRunner().invoke(xprep, ["inspect", str(run)])
    assert shown.exit_code == 0 and "best step" in shown.output and "latest step-3" in shown.output
    report = json.loads(CliRunner().invoke(xprep, ["inspect", str(run), "--json"]).output)
    assert report["kind"] == "run" and report["loss"]["points"] == 3 and report["categories"]


def test_resume_on_another_pack_is_refused(packed, tmp_path):
    run = tmp_path / "run"
    assert CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "1", "--output", str(run)]).exit_code == 0
    other = category_pack(tmp_path / "other", n_docs=30, seed=1)
    assert "trained on pack" in user_error(str(other), "--steps", "2", "--output", str(run))
    assert "already holds checkpoints" in user_error(str(packed), "--steps", "2", "--output", str(run),
                                                     "--resume", "never")


def test_user_errors_are_one_line(packed, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stpes": 3}))
    assert "did you mean 'steps'" in user_error(str(packed), "--config", str(bad))
    bad.write_text(json.dumps({"steps": "many"}))
    assert "'steps'" in user_error(str(packed), "--config", str(bad))
    bad.write_text("{not json")
    assert "invalid JSON" in user_error(str(packed), "--config", str(bad))
    assert "no such file" in user_error(str(packed), "--config", str(tmp_path / "none.json"))
    assert "not a pack cache" in user_error(str(tmp_path / "nowhere"))
    assert "unknown model preset" in user_error(str(packed), "--model", "huge", "--output", str(tmp_path / "r"))
    assert "choose one" in user_error(str(packed), "--steps", "2", "--epochs", "1")
    assert "--lr" in user_error(str(packed), "--lr", "-1")
    assert "multiple" in user_error(str(packed), "--global-batch-size", "3", "--micro-batch-size", "2")
    assert "config.json" in user_error(str(packed), "--model", f"hf:{tmp_path}")


def test_deleted_or_edited_dataset(tmp_path):
    make_dataset(tmp_path / "ds", [np.arange(2, 20), np.arange(3, 30)], vocab_size=64)
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 18)], [(1, 0, 27)]], capacity=32)
    shutil.rmtree(tmp_path / "ds")
    assert "is missing" in user_error(str(tmp_path / "p"))
    make_dataset(tmp_path / "ds", [np.arange(2, 20), np.arange(4, 31)], vocab_size=64)
    assert "changed since it was packed" in user_error(str(tmp_path / "p"))


def test_hf_model(packed, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                                         attn_implementation="sdpa")).eval()
    ds = PackedDataset(packed)
    batch = collate([ds[0]])
    cu = batch["cu_seqlens"].tolist()
    with torch.no_grad():
        packed_logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        s, e = cu[1], cu[2]
        alone = model(batch["input_ids"][:, s:e], torch.arange(e - s)[None], None)
    torch.testing.assert_close(packed_logits[0, s:e], alone[0], rtol=1e-4, atol=1e-4)
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--model", f"hf:{tmp_path / 'hf'}", "--steps", "2",
                                         "--output", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert len(metrics(tmp_path / "run")) == 2


def test_resume_applies_the_new_optimizer_settings(packed, tmp_path):
    """The run does what config.json says, not what the checkpoint's optimizer and schedule held."""
    run = tmp_path / "run"
    base = [str(packed), "--schedule", "constant", "--output", str(run), "--log-every", "100"]
    first = CliRunner().invoke(xtrain, ["run", *base, "--steps", "2", "--lr", "1e-3", "--weight-decay", "0.1"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(xtrain, ["run", *base, "--steps", "4", "--lr", "2e-3", "--weight-decay", "0.0"])
    assert again.exit_code == 0, again.output
    assert [r["lr"] for r in metrics(run)] == [1e-3, 1e-3, 2e-3, 2e-3]
    line = [x for x in again.stderr.splitlines() if "other hyperparameters" in x]
    assert len(line) == 1 and "lr 0.001 → 0.002" in line[0] and "weight_decay 0.1 → 0.0" in line[0], again.stderr
    state = json.loads((run / "checkpoints" / "step-4" / "trainer.json").read_text())
    assert state["scheduler"]["base_lrs"][0] == 2e-3 and state["hparams"]["weight_decay"] == 0.0


def test_resume_with_another_model_is_refused(packed, tmp_path):
    run = tmp_path / "run"
    assert CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "1", "--output", str(run)]).exit_code == 0
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192}))
    message = user_error(str(packed), "--steps", "2", "--output", str(run), "--model", str(model))
    assert "another model" in message and "n_layers 2 → 3" in message, message
