"""Mixed precision (issue 13): bf16 forward/backward over fp32 master weights, fp32 the exact reference.

Without FSDP2 (one process here) bf16 is ``torch.autocast``; under FSDP2 it is FSDP2's
MixedPrecisionPolicy (tests/test_parallel_equivalence.py runs it on 2 gloo ranks).
"""

from __future__ import annotations

import contextlib
import json

import torch
from click.testing import CliRunner
from trainkit import category_pack, grads, make_trainer, max_rel_diff
from xprep.cli import xtrain
from xprep.train.dist import ParallelDims, param_dtype_for
from xprep.train.loss import LossSums
from xprep.train.trainer import autocast_for

BF16_TOL = 3e-2  # bf16 keeps 8 mantissa bits: ~0.4% per rounding; the gradients differ by ~1% here


def step(packed, precision: str) -> tuple[float, dict, object]:
    trainer = make_trainer(packed, micro=2, accum=2, precision=precision)
    sums, _, _ = trainer.accumulate_gradients()
    return LossSums.from_flat(sums.flat()).loss, grads(trainer.model), trainer


def test_bf16_in_one_process_is_fp32_within_bf16_tolerance(tmp_path):
    packed = category_pack(tmp_path)
    loss32, grads32, _ = step(packed, "fp32")
    loss16, grads16, trainer = step(packed, "bf16")
    assert abs(loss16 - loss32) <= BF16_TOL * loss32
    assert 1e-4 < max_rel_diff(grads16, grads32) <= BF16_TOL  # close, but really computed in bf16
    # master weights, gradients and optimizer state stay fp32
    trainer.optimizer.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point())
    # fp32 is the reference: the same run twice is bit-identical
    loss32b, grads32b, _ = step(packed, "fp32")
    assert loss32b == loss32 and max_rel_diff(grads32b, grads32) == 0


def test_what_precision_means(monkeypatch):
    assert param_dtype_for("auto", "cpu") == torch.float32  # CPU: fp32, the exact reference
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # a GPU with bf16
    assert param_dtype_for("auto", "cuda") == torch.bfloat16  # (pre-Ampere GPUs: tests/test_train_device.py)
    assert param_dtype_for("bf16", "cpu") == param_dtype_for("bf16", "cuda") == torch.bfloat16
    assert param_dtype_for("fp32", "cuda") == torch.float32
    cpu, one, two = torch.device("cpu"), ParallelDims(), ParallelDims.for_world(2, rank=0)
    assert autocast_for(torch.float32, cpu, one) is contextlib.nullcontext
    assert autocast_for(torch.bfloat16, cpu, two) is contextlib.nullcontext  # FSDP2 casts the parameters itself
    with autocast_for(torch.bfloat16, cpu, one)():  # no FSDP2: autocast
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


def test_run_with_the_issue_13_options(tmp_path):
    """`xtrain run --precision bf16 --loss-chunk N --reduce-every-micro-batch` end to end: recorded in
    config.json (schema-checked), and the losses within bf16 tolerance of an fp32 run's."""
    packed = category_pack(tmp_path)
    common = [str(packed), "--steps", "3", "--global-batch-size", "4", "--micro-batch-size", "2", "--log-every",
              "100"]
    runs = {}
    for name, extra in (("fp32", ["--precision", "fp32"]),
                        ("bf16", ["--precision", "bf16", "--loss-chunk", "16", "--reduce-every-micro-batch"])):
        result = CliRunner().invoke(xtrain, ["run", *common, *extra, "--output", str(tmp_path / name)])
        assert result.exit_code == 0, (result.output, result.exception)
        runs[name] = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["model"] | {"name": None} == {"name": None, "precision": "bf16", "tf32": True, "loss_chunk": 16,
                                                "compile": False, "init_from": None}
    assert config["parallel"]["reduce_every_micro_batch"] is True
    assert json.loads((tmp_path / "bf16" / "run.json").read_text())["precision"] == "bf16"
    assert json.loads((tmp_path / "fp32" / "run.json").read_text())["precision"] == "fp32"
    assert len(runs["fp32"]) == 3 and all(abs(a - b) <= BF16_TOL * a for a, b in zip(runs["fp32"], runs["bf16"],
                                                                                      strict=True))
    assert runs["fp32"] != runs["bf16"]
    error = CliRunner().invoke(xtrain, ["run", *common, "--loss-chunk", "-1", "--output", str(tmp_path / "x")])
    assert error.exit_code == 2 and "--loss-chunk -1 must be ≥ 0" in error.stderr
