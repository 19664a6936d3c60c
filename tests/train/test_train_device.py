"""Where a run computes (issue 30, points 1, 3, 5, 10, 11): ``--device``, precision on GPUs without bf16, the
CUDA process settings, FSDP2's gradient reduction default, fused AdamW, activation checkpointing's RNG.

There is no GPU here: ``torch.cuda`` is replaced by a stand-in machine (how many GPUs, their name and compute
capability), which is all these choices read. The suite itself runs with ``XTRAIN_DEVICE=cpu`` (conftest):
one test shows that a run then stays on the CPU on a machine that has a GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from trainkit import category_pack, make_trainer
from xprep.cli import xtrain
from xprep.prep.errors import XprepError
from xprep.train.config import ParallelSection, TrainConfig
from xprep.train.dist import (
    ALLOC_ENVS,
    DEVICE_ENV,
    ParallelDims,
    apply_activation_checkpointing,
    check_precision,
    configure_device,
    param_dtype_for,
    precision_note,
    resolve_device,
)
from xprep.train.model import ModelConfig, Transformer
from xprep.train.optim import adamw_implementation, build_optimizer
from xprep.train.trainer import Trainer, attention_plan, run


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n, name, capability)``: make torch see ``n`` CUDA devices of that kind (0: none)."""

    def machine(n: int, name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return machine


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)


# ------------------------------------------------------------------------------------------------ --device
def test_auto_is_a_gpu_per_local_rank_or_the_cpu(gpus, no_env):
    gpus(0)
    assert resolve_device("auto", 4) == resolve_device(None, 1) == "cpu"  # no GPU: the CPU, quietly
    gpus(2)
    assert resolve_device("auto", 2) == resolve_device(None, 1) == "cuda"
    assert resolve_device("cpu", 2) == "cpu"  # asked for: the CPU on a GPU machine
    assert ParallelDims.for_world(2, device="auto").device_type == "cuda"
    assert ParallelDims.for_world(2, device="cpu").device_type == "cpu"


def test_fewer_gpus_than_ranks_is_an_error_saying_how_to_run(gpus, no_env):
    gpus(1)
    for choice in ("auto", "cuda", None):
        with pytest.raises(XprepError) as e:
            resolve_device(choice, 2)
        assert "2 ranks on this machine but 1 GPU" in str(e.value)
        assert "--nproc-per-node 1" in str(e.value) and "--device cpu" in str(e.value)
    gpus(0)
    with pytest.raises(XprepError, match="--device cuda: no CUDA device.*--device cpu"):
        resolve_device("cuda", 1)


def test_the_environment_gives_the_default_and_a_flag_wins(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device(None, 2) == "cpu" and resolve_device("cuda", 2) == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(XprepError, match=r"\$XTRAIN_DEVICE 'gpu' is not one of auto, cpu, cuda"):
        resolve_device(None, 1)
    with pytest.raises(XprepError, match="--device 'tpu' is not one of"):
        ParallelSection(device="tpu")


def test_launching_more_ranks_than_gpus_is_one_line_before_any_rank_starts(tmp_path, gpus, no_env):
    """The case of `make demo` (2 ranks) on a one-GPU machine: a one-line error, exit 2, no rank started."""
    gpus(1)
    packed = category_pack(tmp_path)
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "1", "--nproc-per-node", "2",
                                         "--output", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "2 ranks on this machine but 1 GPU" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_the_pinned_suite_trains_on_the_cpu_on_a_gpu_machine(tmp_path, gpus, monkeypatch):
    """With XTRAIN_DEVICE=cpu (as conftest sets it) a run started in this process on a machine with a GPU computes
    on the CPU in fp32, as on a machine without one: it neither moves to cuda:0 nor switches to bf16."""
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    gpus(1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"moved to {device}"))
    seen = []
    train_step = Trainer.train_step

    def step_then_unplug(trainer):  # the checkpoint writer asks torch.cuda itself: the stand-in GPU goes first
        metrics = train_step(trainer)
        seen.extend({p.device.type for p in trainer.model.parameters()} | {trainer.device.type})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", step_then_unplug)
    packed = category_pack(tmp_path)
    config = TrainConfig.from_dict({"packed": str(packed), "steps": 1, "output": str(tmp_path / "run"),
                                    "log_every": 100})
    run(config)
    assert seen == ["cpu"]
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())
    assert recorded["precision"] == "fp32"


# ------------------------------------------------------------------------------------------------ precision
def test_auto_precision_is_bf16_only_where_the_gpu_has_bf16_tensor_cores(gpus):
    gpus(1, "NVIDIA H100 80GB HBM3", (9, 0))
    assert param_dtype_for("auto", "cuda") == torch.bfloat16 and precision_note("auto", "cuda") == "bf16"
    gpus(1, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert param_dtype_for("auto", "cuda") == torch.bfloat16
    for name, capability in (("Tesla V100-SXM2-32GB", (7, 0)), ("Tesla T4", (7, 5))):
        gpus(1, name, capability)
        assert param_dtype_for("auto", "cuda") == torch.float32
        note = precision_note("auto", "cuda")
        assert note.startswith("fp32") and name in note and f"{capability[0]}.{capability[1]} < 8.0" in note
        with pytest.raises(XprepError, match=f"--precision bf16: {name}.*use --precision fp32"):
            check_precision("bf16", "cuda")
        check_precision("fp32", "cuda")
        check_precision("auto", "cuda")
    assert param_dtype_for("auto", "cpu") == torch.float32 and precision_note("bf16", "cpu") == "bf16"
    check_precision("bf16", "cpu")  # the CPU computes bf16 (slowly, but right): allowed


# ------------------------------------------------------------------------------------------------ process settings
@pytest.fixture
def cuda_settings(monkeypatch):
    """The allocator environment and the matmul precision flag, put back after the test."""
    for name in ALLOC_ENVS:
        monkeypatch.delenv(name, raising=False)
    saved = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = saved


def test_cuda_runs_get_tf32_matmuls_and_expandable_segments(cuda_settings, monkeypatch):
    configure_device("cpu")  # nothing on the CPU
    assert ALLOC_ENVS[0] not in os.environ and torch.backends.cuda.matmul.fp32_precision != "tf32"
    configure_device("cuda")
    assert os.environ[ALLOC_ENVS[0]] == "expandable_segments:True"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    configure_device("cuda", tf32=False)  # --no-tf32: full fp32 matmuls
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    for name in ALLOC_ENVS:  # the user's allocator settings, under either name, are kept
        monkeypatch.delenv(ALLOC_ENVS[0], raising=False)
        monkeypatch.setenv(name, "max_split_size_mb:512")
        configure_device("cuda")
        assert os.environ[name] == "max_split_size_mb:512"
        assert name == ALLOC_ENVS[0] or ALLOC_ENVS[0] not in os.environ
        monkeypatch.delenv(name)


def test_the_tf32_flag_is_a_config_key(tmp_path):
    packed = category_pack(tmp_path)
    assert TrainConfig.from_dict({"packed": str(packed)}).model.tf32 is True
    assert TrainConfig.from_dict({"packed": str(packed), "tf32": False}).model.tf32 is False


# ------------------------------------------------------------------------------------------------ small ones
def test_gradients_are_reduced_after_every_micro_batch_by_default(tmp_path):
    """FSDP2 keeps gradients sharded between micro-batches unless --reduce-once-per-step (its memory cost, and
    that both give the same gradients: tests/test_parallel_equivalence.py)."""
    assert ParallelSection().reduce_every_micro_batch is True
    result = CliRunner().invoke(xtrain, ["run", "--help"])
    assert "--reduce-once-per-step" in result.output and "~32 GB at 8B" in " ".join(result.output.split())


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere(tmp_path):
    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("cpu") == {"foreach": True}
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64))
    group = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95)).param_groups[0]
    assert group["foreach"] is True and not group["fused"]


def test_activation_checkpointing_does_not_save_the_rng_state(tmp_path):
    """Nothing in a block draws random numbers: saving and restoring the RNG around each recomputation is waste."""
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64))
    apply_activation_checkpointing(model)
    assert all(block.checkpoint_fn.keywords["preserve_rng_state"] is False for block in model.layers)
    trainer = make_trainer(category_pack(tmp_path), micro=1, accum=1, activation_checkpointing=True)
    trainer.accumulate_gradients()  # the backward recomputes without it
    assert all(p.grad is not None for p in trainer.model.parameters())



def test_the_start_line_says_device_precision_and_attention(tmp_path):
    packed = category_pack(tmp_path)
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "1", "--output", str(tmp_path / "run"),
                                         "--log-every", "100"])
    assert result.exit_code == 0, result.output
    assert "1 DP, cpu, fp32, attention: SDPA per document)" in result.stderr


def test_a_gpu_without_bf16_runs_fp32_off_the_varlen_kernels(tmp_path, gpus):
    """A V100 (compute capability 7.0): auto precision is fp32 and attention is not a varlen kernel (they need
    8.0); the start line's precision says why. An A100 in bf16 takes torch's varlen (flash-attn not installed)."""
    packed = category_pack(tmp_path)
    config = TrainConfig.from_dict({"packed": str(packed)})
    model_config = config.model.check(64)
    gpus(1, "Tesla V100-SXM2-32GB", (7, 0))
    path, _ = attention_plan(config, ParallelDims(device_type="cuda"), model_config)
    assert "varlen" not in path and precision_note("auto", "cuda").startswith("fp32 (auto: Tesla V100")
    gpus(1, "NVIDIA A100-SXM4-80GB", (8, 0))
    path, note = attention_plan(config, ParallelDims(device_type="cuda"), model_config)
    assert path == "varlen (torch)" and note == ""
