"""The training loop: ``train_step → forward_backward → model, loss``, plus the ``build_*`` steps.

``run(config)`` is the whole of ``xtrain run``: open the data (every user error surfaces here,
before any process group exists), start the process group, build model, optimizer, schedule,
sampler, resume, loop, save, shut down. With ``--nproc-per-node N`` it first checks the same
things, then starts the N ranks itself (train/launch.py) and waits for them. ``Trainer`` takes
plain objects so tests can build one without a config.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from prep.errors import XprepError
from prep.io import check_output_dir
from prep.packfile import MANIFEST
from train.checkpoint import CheckpointManager, check_same_model, check_same_pack
from train.config import TrainConfig, validate_against_schema
from train.cp import CPContext, shard_batch
from train.data import PackedDataset, collate, count_targets
from train.dist import (
    ParallelDims,
    all_reduce_sum,
    failed_in_collective,
    full_tensor,
    init_distributed,
    parallelize,
    reduce_gradients,
    shutdown,
)
from train.launch import launch, should_launch
from train.loss import LossSums, micro_batch_loss, step_losses
from train.samplers import BinSampler, build_sampler

KILL_AFTER_STEP_ENV = "XTRAIN_TEST_KILL_AFTER_STEP"  # tests: SIGKILL this process after step N
KILL_RANK_ENV = "XTRAIN_TEST_KILL_RANK"  # [default: every rank] only this rank is SIGKILLed
FAIL_RANK_ENV = "XTRAIN_TEST_FAIL_RANK"  # tests: this rank raises at the start of step XTRAIN_TEST_FAIL_STEP
FAIL_STEP_ENV = "XTRAIN_TEST_FAIL_STEP"  # [default 1]
CPU_KEYS = ("cu_seqlens", "cu_seqlens_padded")  # batch keys that stay on the CPU (read as Python ints)
PEER_FAILURE_GRACE_S = 3.0  # a rank whose collective failed waits this long before exiting (see _report_and_exit)


# ---------------------------------------------------------------------------------------- schedule
class LRSchedule:
    """LR multiplier at a step: linear warm-up, then cosine/linear decay to min_lr, or constant.

    A plain object (not a lambda) so ``LambdaLR.state_dict`` can save it.
    """

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float):
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - progress
        return self.min_ratio + (1 - self.min_ratio) * decay

    def shape(self) -> tuple:
        """What the multipliers depend on: two schedules of the same shape give the same lr at every step."""
        if self.kind == "constant":
            return self.kind, self.warmup
        return self.kind, self.warmup, self.total, self.min_ratio


# ---------------------------------------------------------------------------------------- plan
@dataclass
class BatchPlan:
    """How bins become steps: micro-batch, global batch, accumulation, DP grouping, length."""

    micro_batch_size: int
    global_batch_size: int
    grad_accum: int
    group: int
    steps: int


def plan_batches(cfg: TrainConfig, num_bins: int, pack_config: dict, dp: int,
                 saved_global: int | None = None) -> BatchPlan:
    """Check the batch options against the pack and the number of DP ranks.

    ``saved_global`` is the global batch of the checkpoint being resumed: it is the default (the
    micro × dp default would change with the layout), and another explicit one is refused.
    """
    group = int(pack_config.get("balance_dp") or 1)
    micro = cfg.micro_batch_size
    if pack_config.get("method") == "token-aware" and micro != 1:  # a bin is sized to be one micro-batch
        raise XprepError(f"--micro-batch-size {micro}: a token-aware pack's bin is one whole micro-batch "
                         "(its token budget); use --micro-batch-size 1 and raise --global-batch-size "
                         "for more bins per step")
    if group > 1:
        per_rank = int(pack_config.get("dp_micro_batches") or 1)
        default_global = group * per_rank
    else:
        default_global = micro * dp
    if saved_global is not None and cfg.global_batch_size not in (None, saved_global):
        raise XprepError(f"--global-batch-size {cfg.global_batch_size}: the checkpoint being resumed was trained "
                         f"with a global batch of {saved_global} bins; resume with {saved_global} (or leave the "
                         "option out), or start a new run with another --output")
    global_ = cfg.global_batch_size or saved_global or default_global
    if global_ % (micro * dp):
        raise XprepError(
            f"--global-batch-size {global_} is not a multiple of micro-batch {micro} × {dp} DP ranks "
            f"= {micro * dp}: use a multiple such as {micro * dp * max(1, global_ // (micro * dp))}")
    if cfg.steps is not None:
        steps = cfg.steps
    else:
        steps = int((cfg.epochs or 1.0) * num_bins // global_)
        if steps < 1:
            raise XprepError(f"{cfg.epochs or 1} epoch(s) of {num_bins} bins is less than one global batch of "
                             f"{global_}: use --steps, more epochs or a smaller --global-batch-size")
    return BatchPlan(micro, global_, global_ // (micro * dp), group, steps)


# ---------------------------------------------------------------------------------------- model
class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the trainer's model interface (packed rows, cu_seqlens unused).

    ``use_cache=False`` and no attention mask: only then do restarting position_ids keep packed
    documents apart (FACTS.md).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, input_ids, position_ids, cu_seqlens, cp=None) -> torch.Tensor:
        if cp is not None and cp.size > 1:
            raise XprepError("context parallelism needs the built-in model, not hf:DIR")
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()


def build_model(spec: str, vocab_size: int, seed: int) -> tuple[nn.Module, dict]:
    """The model for ``--model`` (preset, JSON file or hf:DIR) and its config as a dict."""
    torch.manual_seed(seed)
    if spec.startswith("hf:"):
        return _build_hf(spec[3:], vocab_size)
    from train.model import Transformer, load_model_config

    cfg = load_model_config(spec, vocab_size)
    model = Transformer(cfg)
    model.init_weights(seed)
    return model, cfg.to_dict()


def check_model_spec(spec: str, vocab_size: int) -> dict | None:
    """Fail early (before any process group) on a model that cannot be built; the built-in model's config."""
    if spec.startswith("hf:"):
        directory = spec[3:]
        if not (Path(directory) / "config.json").is_file():
            raise XprepError(f"--model {spec}: no config.json in {directory}; give a local Hugging Face model "
                             "directory")
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise XprepError("--model hf:DIR needs transformers: pip install 'xprep[hf]'") from None
        return None
    from train.model import load_model_config

    return load_model_config(spec, vocab_size).to_dict()


def _build_hf(directory: str, vocab_size: int) -> tuple[nn.Module, dict]:
    import transformers

    check_model_spec(f"hf:{directory}", vocab_size)
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"  # renamed in 4.56; fp32 master weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa",
                                                           **{dtype_kw: torch.float32})
    if hf.config.vocab_size < vocab_size:
        raise XprepError(f"--model hf:{directory}: vocabulary of {hf.config.vocab_size} ids is smaller than the "
                         f"data's ({vocab_size}); use the model the data was tokenized for")
    hf.config.use_cache = False
    return HFCausalLM(hf), {"hf": directory, **{k: v for k, v in hf.config.to_dict().items()
                                                if isinstance(v, (int, float, str, bool))}}


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and other 1-D parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             foreach=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(cfg.schedule, cfg.warmup, total_steps,
                                                                   _min_ratio(cfg)))


def _min_ratio(cfg: TrainConfig) -> float:
    return cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0


def schedule_settings(cfg: TrainConfig, total_steps: int) -> dict:
    """The schedule's shape as a checkpoint records it (the base and final lr are in its hparams)."""
    return {"schedule": cfg.schedule, "warmup": cfg.warmup, "steps": total_steps}


HPARAMS = ("lr", "min_lr", "weight_decay", "beta1", "beta2")


def _hparams(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in HPARAMS}


def optimizer_settings(optimizer: torch.optim.Optimizer, scheduler) -> list[dict]:
    """Per param group, what the config set: base lr, weight decay, betas (taken before a checkpoint loads)."""
    return [{"initial_lr": base, "weight_decay": g["weight_decay"], "betas": tuple(g["betas"])}
            for g, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True)]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, scheduler, wanted: list[dict],
                               saved: dict | None, cfg: TrainConfig) -> list[str]:
    """Put the config's settings back after a checkpoint loaded its own; name those that differed.

    Loading restores the checkpoint's weight decay and betas (optimizer state) and base lrs
    (scheduler state); the run must do what its config.json says. Returns "name old → new" items.
    """
    if saved is None:  # a checkpoint from before hparams were saved: read them off the optimizer
        g = optimizer.param_groups[0]
        saved = {"lr": scheduler.base_lrs[0], "weight_decay": g["weight_decay"], "beta1": g["betas"][0],
                 "beta2": g["betas"][1]}
    for i, (group, want) in enumerate(zip(optimizer.param_groups, wanted, strict=True)):
        group.update(want)
        scheduler.base_lrs[i] = want["initial_lr"]
        group["lr"] = want["initial_lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return [f"{k} {saved[k]} → {getattr(cfg, k)}" for k in HPARAMS if k in saved and saved[k] != getattr(cfg, k)]


def schedule_change(scheduler, saved: dict | None, cfg: TrainConfig, total_steps: int) -> str | None:
    """Say how this config's schedule differs from the checkpoint's, and what that does to the next step's lr.

    The schedule follows the config (``Trainer.state_dict``): resuming with another --steps, --warmup or
    --schedule silently bends the lr curve from the next step on. Both lrs shown use this config's --lr and
    --min-lr (a change of those is named apart). None when nothing changes any lr (e.g. a constant schedule
    made longer) or the checkpoint predates recording the schedule.
    """
    if not saved:
        return None
    now = schedule_settings(cfg, total_steps)
    old = {**now, **{k: saved[k] for k in now if k in saved}}
    before = LRSchedule(old["schedule"], old["warmup"], old["steps"], _min_ratio(cfg))
    after = scheduler.lr_lambdas[0]
    if before.shape() == after.shape():
        return None
    what = ", ".join(f"{k} {old[k]} → {now[k]}" for k in now if old[k] != now[k])
    note = f"{what}: the learning-rate schedule is recomputed for {total_steps} steps"
    step = scheduler.last_epoch
    if step < total_steps:
        base = scheduler.base_lrs[0]
        note += f" (step {step + 1} lr {base * after(step):.2e} instead of {base * before(step):.2e})"
    return note


def autocast_for(precision: str, device: torch.device):
    """bf16 autocast on CUDA (auto) or when asked; fp32 otherwise."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------- trainer
@dataclass
class StepMetrics:
    step: int
    loss: float
    category_loss: dict[str, float]
    grad_norm: float
    lr: float
    tokens: int
    targets: int
    seconds: float
    consumed_samples: int


class Trainer:
    """One optimizer step at a time over the micro-batches the sampler hands this rank."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, dataset: PackedDataset,
                 sampler: BinSampler, dims: ParallelDims, grad_accum: int, device: torch.device,
                 grad_clip: float = 0.0, autocast=contextlib.nullcontext, category_names=None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dataset, self.sampler, self.dims = dataset, sampler, dims
        self.grad_accum, self.device, self.grad_clip, self.autocast = grad_accum, device, grad_clip, autocast
        self.category_names = category_names if category_names is not None else dataset.category_names
        self.step = 0

    def next_micro_batches(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """This rank's micro-batches of the next step, ready for the model; its real tokens and targets.

        Targets are counted on the CPU, before the batch moves (no device sync in the step).
        """
        batches, tokens, targets = [], 0, 0
        for _ in range(self.grad_accum):
            bins = self.sampler.next_micro_batch()
            if self.dims.cp_rank == 0:  # the CP ranks of a DP rank read the same bins: count them once
                tokens += self.dataset.bin_tokens(bins)
            batch = self.shard_batch(collate([self.dataset[b] for b in bins]))
            targets += count_targets(batch)
            batches.append(self.to_device(batch))
        return batches, tokens, targets

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's share of a micro-batch (on the CPU).

        Under context parallelism every document is padded to a multiple of 2·cp and this rank
        keeps chunks r and 2cp−1−r of each (train/cp.py). Each rank then counts and sums only
        its own targets (padding never is one), and the all-reduce over dp×cp adds them up.
        """
        if self.dims.cp_enabled:
            batch = shard_batch(batch, self.dims.cp_rank, self.dims.cp)
        return batch

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the model computes with, on the device; the document boundaries stay on the
        CPU, where attention reads them as Python ints once per micro-batch (no device sync)."""
        return {k: v if k in CPU_KEYS else v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def cp_context(self, batch: dict[str, torch.Tensor]) -> CPContext | None:
        """What the model's attention needs to see the other CP ranks' keys and values (None without CP)."""
        if not self.dims.cp_enabled:
            return None
        return CPContext.from_shard(batch, self.dims.cp_group(), self.dims.cp_rank, self.dims.cp)

    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        sums, n_tokens, n_targets = self.accumulate_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        total = LossSums.from_flat(all_reduce_sum(sums.flat(), self.dims))
        loss, per_cat = step_losses(total, self.category_names)
        return StepMetrics(self.step, loss, per_cat, float(full_tensor(grad_norm)), lr, n_tokens, n_targets,
                           time.perf_counter() - t0, self.sampler.consumed_samples)

    def accumulate_gradients(self) -> tuple[LossSums, int, int]:
        """Forward and backward of every micro-batch of the step, gradients summed over ranks.

        Returns this rank's loss sums and the step's global token and target counts.
        """
        batches, tokens, targets = self.next_micro_batches()
        counts = torch.tensor([targets, tokens], dtype=torch.float64, device=self.device)
        n_targets, n_tokens = all_reduce_sum(counts, self.dims).tolist()  # before any forward
        sums = LossSums.zeros(len(self.category_names), self.device)
        for i, batch in enumerate(batches):
            if self.dims.fsdp:  # FSDP2 reduce-scatters once, after the step's last backward
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            self.forward_backward(batch, n_targets, sums)
        reduce_gradients(self.model, self.dims)
        return sums, int(n_tokens), int(n_targets)

    def forward_backward(self, batch: dict[str, torch.Tensor], n_targets: float, sums: LossSums) -> None:
        """Backpropagate Σ CE / (targets of the whole step); accumulate the channel sums."""
        with self.autocast():
            logits = self.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"],
                                cp=self.cp_context(batch))
        loss, ce = micro_batch_loss(logits, batch["labels"], n_targets)
        loss.backward()
        sums.add(ce, batch["labels"], batch["category_ids"])

    def state_dict(self) -> dict:
        """Counters, sampler and schedule position. The schedule's shape (warm-up, length) is not
        restored: it follows the config, so a resumed run may be extended with a larger --steps (the
        checkpoint records it apart, ``schedule_settings``, so that a resume can say what changed)."""
        scheduler = self.scheduler.state_dict()
        scheduler["lr_lambdas"] = [None] * len(scheduler["lr_lambdas"])
        return {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": scheduler}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The next step's lr from the schedule of *this* config (same value when it is unchanged).
        sched = self.scheduler
        for group, base, fn in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)


# ---------------------------------------------------------------------------------------- logging
class MetricsLog:
    """metrics.jsonl (every step) and one console line per interval; rank 0 only."""

    def __init__(self, run_dir: Path, total_steps: int, log_every: int, enabled: bool, stream=None):
        self.path = run_dir / "metrics.jsonl"
        self.total, self.every, self.enabled = total_steps, log_every, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._file = None
        self._t0 = time.perf_counter()
        self._first_step: int | None = None
        self._tokens, self._seconds = 0, 0.0

    def open(self, resumed_step: int) -> None:
        """Keep the lines of steps ≤ the resumed step (a killed run may have logged more)."""
        if not self.enabled:
            return
        kept = []
        if resumed_step and self.path.is_file():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    if json.loads(line).get("step", 0) <= resumed_step:
                        kept.append(line)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def write(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._t0 = m.step - 1, time.perf_counter() - m.seconds
        record = {"step": m.step, "loss": m.loss, "category_loss": m.category_loss, "grad_norm": m.grad_norm,
                  "lr": m.lr, "tokens": m.tokens, "target_tokens": m.targets,
                  "tokens_per_s": m.tokens / m.seconds if m.seconds > 0 else None,
                  "step_seconds": m.seconds, "consumed_samples": m.consumed_samples, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._tokens += m.tokens
        self._seconds += m.seconds
        interval = m.step % self.every == 0 or m.step == self.total
        if interval or self.tty:
            self._console(m, interval)

    def _console(self, m: StepMetrics, interval: bool) -> None:
        """A line per interval (tokens/s averaged over it); on a terminal also a live line every step."""
        elapsed = time.perf_counter() - self._t0
        done = m.step - self._first_step
        eta = elapsed / done * (self.total - m.step) if done else 0.0
        rate = self._tokens / self._seconds if self._seconds else 0.0
        line = (f"step {m.step}/{self.total}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad {m.grad_norm:.3f}  "
                f"{rate:,.0f} tok/s  ETA {_hms(eta)}")
        self.stream.write(("\r" if self.tty else "") + line + ("\n" if interval else " "))
        self.stream.flush()
        if interval:
            self._tokens, self._seconds = 0, 0.0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# ---------------------------------------------------------------------------------------- run
@dataclass
class RunSetup:
    """What a run reads before any process group exists (so every user error surfaces first)."""

    dataset: PackedDataset
    plan: BatchPlan
    sampler: BinSampler
    ckpt: CheckpointManager
    resume_from: Path | None


def prepare_run(cfg: TrainConfig, dims: ParallelDims, verify_data: bool | None = None) -> RunSetup:
    """Check the run directory, open the pack for this layout, plan the batches, find the checkpoint to
    resume, check the model. The run directory may hold an earlier run (resume), but must be one."""
    check_output_dir(cfg.run_dir, option="--output", allow_nonempty=True)
    dataset = PackedDataset(cfg.packed, verify_data=cfg.verify_data if verify_data is None else verify_data,
                            cp_size=dims.cp)
    ckpt = CheckpointManager(cfg.run_dir, dims, cfg.keep, cfg.async_save)
    resume_from = ckpt.resolve(cfg.resume)
    saved = ckpt.read_trainer_state(resume_from) if resume_from is not None else {}
    if resume_from is not None:
        check_same_pack(saved, resume_from, dataset.key)
    plan = plan_batches(cfg, len(dataset), dataset.entry.config, dims.dp, saved.get("global_batch_size"))
    sampler = build_sampler(cfg.sampler, len(dataset), plan.micro_batch_size, dims.dp_rank, dims.dp, cfg.seed,
                            plan.group)
    if not dataset.vocab_size:
        raise XprepError(f"{dataset.datasets[0].path}/manifest.json: no tokenizer vocab_size; re-create the dataset")
    model_config = check_model_spec(cfg.model, dataset.vocab_size)
    if resume_from is not None and model_config is not None:
        check_same_model(saved, resume_from, model_config)
    if dims.cp_enabled and cfg.model.startswith("hf:"):
        raise XprepError(f"--cp {dims.cp} needs the built-in model (its attention runs over the CP group): "
                         f"use a preset or a JSON model config instead of --model {cfg.model}")
    return RunSetup(dataset, plan, sampler, ckpt, resume_from)


def run(cfg: TrainConfig, stream=None) -> Path:
    """``xtrain run``: train per ``cfg``; returns the run directory."""
    validate_against_schema(cfg.to_dict())
    if should_launch(cfg):  # check here what would fail in every rank, then start the ranks
        prepare_run(cfg, ParallelDims.for_world(cfg.nproc_per_node, cfg.dp, cfg.cp, cfg.fsdp), verify_data=False)
        launch(cfg)
        return cfg.run_dir
    dims = ParallelDims.from_env(cfg.dp, cfg.cp, cfg.fsdp)
    setup = prepare_run(cfg, dims)
    device = init_distributed(dims)
    try:
        _train(cfg, dims, device, setup, stream)
    except BaseException as e:
        if dims.distributed:  # report, then leave at once: peers may be blocked in a collective
            _report_and_exit(e, dims)
        raise
    shutdown(dims, 0)
    return cfg.run_dir


def _report_and_exit(e: BaseException, dims: ParallelDims) -> None:
    """Print this rank's error, hand it to the launcher, and exit without waiting for the peers.

    A rank whose collective failed most likely lost a peer that failed first: it waits a moment,
    so that the launcher sees (and names) the rank that failed first, and stops this one itself.
    """
    import traceback

    if isinstance(e, XprepError):
        print(f"error: [rank {dims.rank}] {e}", file=sys.stderr)
        code = 2
    else:
        traceback.print_exc()
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    with contextlib.suppress(Exception):  # the launcher's error file (TORCHELASTIC_ERROR_FILE), if any
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
    if failed_in_collective(e):
        sys.stderr.flush()
        time.sleep(PEER_FAILURE_GRACE_S)
    shutdown(dims, code)


def _train(cfg: TrainConfig, dims: ParallelDims, device: torch.device, setup: RunSetup, stream) -> None:
    dataset, plan, ckpt, run_dir = setup.dataset, setup.plan, setup.ckpt, cfg.run_dir
    model, model_config = build_model(cfg.model, dataset.vocab_size, cfg.seed)
    model = parallelize(model.to(device), dims, cfg.reshard_after_forward, cfg.activation_checkpointing)
    model.train()
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, plan.steps)
    trainer = Trainer(model, optimizer, scheduler, dataset, setup.sampler, dims, plan.grad_accum, device,
                      cfg.grad_clip, autocast_for(cfg.precision, device))
    if setup.resume_from is not None:
        _resume(cfg, setup, trainer, model_config, dims.is_main, stream or sys.stderr)
    if dims.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_config(run_dir, cfg, plan, model_config, dataset, dims)
    log = MetricsLog(run_dir, plan.steps, cfg.log_every, dims.is_main, stream)
    log.open(trainer.step)
    out = stream or sys.stderr
    if dims.is_main:
        out.write(_pack_line(dataset) + "\n")
        n_params = sum(p.numel() for p in model.parameters())
        layout = f"{dims.dp} DP" + (f" × {dims.cp} CP" if dims.cp_enabled else "") + (", FSDP2" if dims.fsdp else "")
        out.write(
            f"{cfg.model} ({n_params / 1e6:,.1f}M parameters) on {len(dataset):,} bins of {dataset.capacity:,} tokens: "
            f"{plan.steps:,} steps of {plan.global_batch_size} bins (micro-batch {plan.micro_batch_size} × "
            f"{dims.dp} DP × {plan.grad_accum} accumulation; {layout})"
            + (f", resuming at step {trainer.step}" if trainer.step else "") + f" → {run_dir}\n")
    kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0"))
    if os.environ.get(KILL_RANK_ENV, str(dims.rank)) != str(dims.rank):
        kill_after = 0
    fail_rank, fail_step = int(os.environ.get(FAIL_RANK_ENV, "-1")), int(os.environ.get(FAIL_STEP_ENV, "1"))
    if trainer.step >= plan.steps and dims.is_main:
        out.write(f"{run_dir}: already at step {trainer.step}/{plan.steps}, nothing to do "
                  "(raise --steps to continue)\n")
    try:
        while trainer.step < plan.steps:
            if dims.rank == fail_rank and trainer.step + 1 == fail_step:
                raise RuntimeError(f"{FAIL_RANK_ENV}={fail_rank}: rank {dims.rank} fails at step {fail_step} "
                                   "(test hook)")
            metrics = trainer.train_step()
            log.write(metrics)
            last = trainer.step == plan.steps
            if last or (cfg.save_every and trainer.step % cfg.save_every == 0):
                ckpt.save(trainer.step, model, optimizer,
                          {**trainer.state_dict(), "pack_key": dataset.key, "loss": metrics.loss,
                           "global_batch_size": plan.global_batch_size, "micro_batch_size": plan.micro_batch_size,
                           "model": model_config, "hparams": _hparams(cfg),
                           "schedule": schedule_settings(cfg, plan.steps)})
            if trainer.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.finish()  # an asynchronous save still being written
    finally:
        log.close()


def _resume(cfg: TrainConfig, setup: RunSetup, trainer: Trainer, model_config: dict, is_main: bool, out) -> None:
    """Load the checkpoint into the trainer, then re-apply this config's optimizer settings (and say which differ)."""
    path = setup.resume_from
    check_same_model(setup.ckpt.read_trainer_state(path), path, model_config)
    wanted = optimizer_settings(trainer.optimizer, trainer.scheduler)  # what this config asks for
    state = setup.ckpt.load(path, trainer.model, trainer.optimizer, setup.dataset.key)
    trainer.load_state_dict(state)
    changed = restore_optimizer_settings(trainer.optimizer, trainer.scheduler, wanted, state.get("hparams"), cfg)
    schedule = schedule_change(trainer.scheduler, state.get("schedule"), cfg, setup.plan.steps)
    changed += [schedule] if schedule else []
    if changed and is_main:
        out.write("resuming with other hyperparameters than the checkpoint's: " + ", ".join(changed) + "\n")


def _pack_line(dataset: PackedDataset) -> str:
    """Which pack entry the run reads, and why that one: the cache's current entry, or the one given."""
    entry = dataset.entry.path
    origin = "given directly" if entry == dataset.packed else f"current in {dataset.packed / MANIFEST}"
    return f"training on {entry} (entry {entry.name}, {origin})"


def _write_run_config(run_dir: Path, cfg: TrainConfig, plan: BatchPlan, model_config: dict,
                      dataset: PackedDataset, dims: ParallelDims) -> None:
    """config.json is the resolved TrainConfig (schema-checked); run.json what it resolved to."""
    from prep.dataset import write_json_atomic

    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    write_json_atomic(run_dir / "run.json", {
        "pack": {"path": str(dataset.entry.path), "entry": dataset.entry.path.name, "key": dataset.key,
                 "bins": len(dataset), "capacity": dataset.capacity, "method": dataset.entry.config.get("method")},
        "categories": dataset.category_names,
        "plan": plan.__dict__, "world_size": dims.world_size, "dp": dims.dp, "cp": dims.cp, "fsdp": dims.fsdp,
        "model": model_config,
    })
