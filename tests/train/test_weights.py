"""A run's weights out and in (train/weights.py): `xtrain run --save-hf` and `--init-from`.

One run on 2 ranks (CP 2 over FSDP2, activation checkpointing) is the source of everything: its `--save-hf`
directory must hold the weights of its final checkpoint and load in transformers with the same logits, and
single-process runs on other data start from its checkpoint (a layout it was not saved with) and from its
Hugging Face directory.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xprep.train.trainer as trainer_module
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainkit import cp_pack
from xprep.cli import xtrain
from xprep.train.data import PackedDataset, collate
from xprep.train.hf_weights import builtin_model_config, model_from_checkpoint, name_map
from xprep.train.loss import LossSums, token_ce
from xprep.train.model import Transformer

transformers = pytest.importorskip("transformers")

XTRAIN = Path(sys.executable).with_name("xtrain")
TWO_STEPS = ["--steps", "2", "--micro-batch-size", "1", "--log-every", "100"]


def run(*args: str):
    """`xtrain run ARGS` in this process."""
    return CliRunner().invoke(xtrain, ["run", *args])


def losses(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def from_checkpoint(step_dir: Path) -> Transformer:
    """The built-in model with a checkpoint's weights, read on this one process whatever layout saved it."""
    cfg = builtin_model_config(json.loads((step_dir / "trainer.json").read_text())["model"], step_dir, "test")
    return model_from_checkpoint(step_dir, cfg).eval()


def assert_same_model(directory: Path, model: Transformer, packed: Path) -> None:
    """``directory`` holds exactly ``model``'s weights, and transformers' model loaded from it computes ``model``'s
    logits on a packed row of ``packed`` (its documents kept apart by the restarting position ids), in fp32."""
    names = name_map(model.cfg.n_layers)
    saved = {names[k]: v for k, v in load_file(directory / "model.safetensors").items()}
    ours = model.state_dict()
    assert saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k]) for k in ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = collate([PackedDataset(packed)[0]])
    assert len(batch["cu_seqlens"]) > 2  # several documents in the row
    with torch.no_grad():
        expected = model.eval()(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        got = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ --save-hf
def test_save_hf_is_the_trainers_model_at_those_steps(tmp_path):
    """One process: RUN/hf/step-2 and step-3 hold the trainer's model after those steps, and load in transformers
    with its logits; RUN/hf/latest is the last one."""
    packed = cp_pack(tmp_path / "data")
    seen = {}
    trainer_module.STEP_END_CALLBACKS.append(lambda t: seen.__setitem__(t.step, copy.deepcopy(t.model)))
    try:
        result = run(str(packed), *TWO_STEPS, "--steps", "3", "--save-hf", "--save-hf-every", "2",
                     "--output", str(tmp_path / "run"))
    finally:
        trainer_module.STEP_END_CALLBACKS.pop()
    assert result.exit_code == 0, result.output
    hf = tmp_path / "run" / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["latest", "step-2", "step-3"]  # nothing temporary left
    assert (hf / "latest").resolve() == (hf / "step-3").resolve()
    for step in (2, 3):
        assert_same_model(hf / f"step-{step}", seen[step], packed)
    assert result.stderr.count("Hugging Face model written to") == 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, Path]:
    """(pack, run): 2 steps on 2 ranks, CP 2 over FSDP2 with activation checkpointing, with --save-hf."""
    root = tmp_path_factory.mktemp("two_ranks")
    packed = cp_pack(root / "data")
    proc = subprocess.run([str(XTRAIN), "run", str(packed), *TWO_STEPS, "--global-batch-size", "2",
                           "--nproc-per-node", "2", "--cp", "2", "--activation-checkpointing", "--save-hf",
                           "--output", str(root / "run")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return packed, root / "run"


def test_save_hf_gathers_the_shards_of_two_ranks(two_ranks):
    packed, run_dir = two_ranks
    assert_same_model(run_dir / "hf" / "latest", from_checkpoint(run_dir / "checkpoints" / "step-2"), packed)


# ------------------------------------------------------------------------------------------ --init-from
def first_step_loss(model: Transformer, packed: Path) -> float:
    """The loss of the first step of a one-process run with the default batch (one bin, the first) on ``packed``."""
    batch = collate([PackedDataset(packed)[0]])
    sums = LossSums.zeros(1)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    sums.add(token_ce(logits, batch["labels"]), batch["labels"])
    return sums.loss


def test_init_from_a_checkpoint_takes_its_weights_only(two_ranks, tmp_path):
    """On other data, one process from the 2-rank checkpoint: the first loss is that checkpoint's weights evaluated
    on the first batch; AdamW, the schedule and the sampler start fresh, as from the same weights in hf:DIR."""
    _, source = two_ranks
    other = cp_pack(tmp_path / "other", seed=1)
    common = [str(other), *TWO_STEPS, "--save-every", "1"]
    ckpt = run(*common, "--init-from", str(source), "--output", str(tmp_path / "ckpt"))
    assert ckpt.exit_code == 0, ckpt.output
    assert f"weights from checkpoint {source / 'checkpoints' / 'step-2'}" in ckpt.stderr
    direct = first_step_loss(from_checkpoint(source / "checkpoints" / "step-2"), other)
    assert losses(tmp_path / "ckpt")[0][0] == direct

    first = tmp_path / "ckpt" / "checkpoints" / "step-1"
    state = json.loads((first / "trainer.json").read_text())
    assert state["step"] == 1 and state["sampler"]["consumed_samples"] == 1 and state["scheduler"]["last_epoch"] == 1
    assert state["init"] == {"from": "checkpoint", "path": str((source / "checkpoints" / "step-2").resolve()),
                             "step": 2}
    dcp_to_torch_save(first, tmp_path / "step-1.pt")
    adam = torch.load(tmp_path / "step-1.pt", weights_only=True)["optim"]["state"]
    assert {float(s["step"]) for s in adam.values()} == {1.0}  # this run's one update, not the source's two more

    hf = run(*common, "--init-from", f"hf:{source / 'hf' / 'latest'}", "--output", str(tmp_path / "hf"))
    assert hf.exit_code == 0, hf.output
    assert losses(tmp_path / "hf") == losses(tmp_path / "ckpt")  # the same first update: both optimizers fresh
    assert json.loads((tmp_path / "hf" / "run.json").read_text())["init"] == {
        "from": "hf", "path": str((source / "hf" / "step-2").resolve())}


class Requeued(Exception):
    """The job was stopped (after its step-1 checkpoint) and is started again with the same command."""


def stop_after_step_1(trainer) -> None:
    if trainer.step == 1:
        raise Requeued


def test_the_runs_own_checkpoint_then_resume_then_init_from(two_ranks, tmp_path):
    """A requeued job re-running its command resumes (its --init-from may be gone by then); --resume PATH comes
    before --init-from; --resume never over a run with checkpoints is refused, --init-from or not."""
    _, source = two_ranks
    shutil.copytree(source / "checkpoints" / "step-2", tmp_path / "copy" / "step-2")
    job = [*TWO_STEPS, "--save-every", "1", "--init-from", str(tmp_path / "copy" / "step-2"),
           "--output", str(tmp_path / "job")]
    packed = str(two_ranks[0])
    trainer_module.STEP_END_CALLBACKS.append(stop_after_step_1)
    try:
        assert isinstance(run(packed, *job).exception, Requeued)
    finally:
        trainer_module.STEP_END_CALLBACKS.pop()
    shutil.rmtree(tmp_path / "copy")
    again = run(packed, *job)
    assert again.exit_code == 0, again.output
    assert (f"--init-from {tmp_path / 'copy' / 'step-2'} not used: {tmp_path / 'job'} has checkpoints of its own: "
            "resuming from step-1" in again.stderr) and "resuming at step 1" in again.stderr
    assert [r["step"] for r in map(json.loads, (tmp_path / "job" / "metrics.jsonl").read_text().splitlines())] \
        == [1, 2]
    assert json.loads((tmp_path / "job" / "run.json").read_text())["init"]["step"] == 2  # still the source's record

    resumed = run(packed, *TWO_STEPS, "--resume", str(tmp_path / "job" / "checkpoints" / "step-1"),
                  "--init-from", str(source), "--output", str(tmp_path / "resumed"))
    assert resumed.exit_code == 0, resumed.output
    assert "comes first" in resumed.stderr and "resuming at step 1" in resumed.stderr

    never = run(packed, *job, "--resume", "never")
    assert never.exit_code == 2 and "already holds checkpoints and --resume never" in never.stderr, never.stderr


def test_weights_options_are_checked_before_training(two_ranks, tmp_path):
    packed, source = two_ranks

    def error(*args: str) -> str:
        result = run(str(packed), *TWO_STEPS, "--output", str(tmp_path / "run"), *args)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        return lines[0]

    shutil.copytree(source / "checkpoints" / "step-2", tmp_path / "incomplete")
    (tmp_path / "incomplete" / ".metadata").unlink()
    fallback = tmp_path / "mistral"  # sliding-window attention: runs as the transformers module
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(fallback)

    assert "no such directory" in error("--init-from", str(tmp_path / "nothing"))
    assert "not a checkpoint to start from, it is incomplete (.metadata is missing)" in error(
        "--init-from", str(tmp_path / "incomplete"))
    assert "holds another model (dim 64 → 512" in error("--init-from", str(source), "--model", "small")
    assert "--init-from hf:" in error("--init-from", f"hf:{source / 'hf' / 'latest'}", "--model", "small")
    assert "needs the built-in model" in error("--init-from", str(source), "--model", f"hf:{fallback}")
    assert "--save-hf writes the built-in model" in error("--save-hf", "--model", f"hf:{fallback}")
    assert "applies to --save-hf" in error("--save-hf-every", "2")
    assert not (tmp_path / "run").exists()
