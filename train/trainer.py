"""The training loop: ``Trainer`` (``train_step → forward_backward → model, loss``) and ``run``.

``run(config)`` is ``xtrain run`` in this process, whether alone or as one of the ranks that
torchrun or train/launch.py started: open the data and the validation bins (every user error
surfaces here, before any process group exists), start the process group, build model,
optimizer, schedule, sampler (each from its config section), resume, loop (step, evaluate when
due, log, save), shut down. ``Trainer.evaluate`` runs the same forward as a training step, without
gradient, over this rank's share of the validation bins (train/evaluate.py). ``Trainer`` takes
plain objects so tests can build one without a config.

After every step (metrics logged, checkpoint saved) the loop calls each of ``STEP_END_CALLBACKS``
with the trainer: tests install fault injection there (tests/_train_fault_worker.py). It stays a module list, not
a parameter: the faults must reach runs started through the real command line and launcher, in child processes.

One module (~700 lines) because it is the training loop read in order: the step (``Trainer``), what a run checks
before its process group exists (``prepare_run``), the loop around the step (``_train``: resume, evaluate, save,
stop on a signal or on bad steps) and what the run says and records as it starts. Each part is small functions
over plain objects; the seams, should it grow, are ``prepare_run`` with ``RunSetup`` (a run's setup) and the start
lines with ``_write_run_config`` (a run's record).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.optim.lr_scheduler import LambdaLR
from xprep.prep.dataset import StreamUnavailable, check_token_ids
from xprep.prep.errors import XprepError, machine_cause, machine_error
from xprep.prep.io import check_output_dir, read_json, write_json_atomic
from xprep.prep.pack import MANIFEST
from xprep.train import attempts
from xprep.train.attention import attention_path, check_head_dim
from xprep.train.checkpoint import CheckpointManager
from xprep.train.config import ModelSection, ParallelSection, TrainConfig, validate_against_schema
from xprep.train.cp import CPGroups, check_cp_heads, cp_attention_path, cp_context
from xprep.train.data import PackedDataset, count_targets, micro_batch
from xprep.train.dist import (
    ParallelDims,
    all_reduce_sum,
    check_precision,
    configure_device,
    failed_in_collective,
    full_tensor,
    init_distributed,
    materialize,
    parallelize,
    param_dtype_for,
    precision_name,
    precision_note,
    reduce_gradients,
    shutdown,
)
from xprep.train.evaluate import DEFAULT_SET, EvalProgress, Validation
from xprep.train.flops import ModelFlops, Throughput, bin_attention_pairs, resolve_peak_tflops
from xprep.train.lifeline import PARENT_ENV, die_with_parent
from xprep.train.loggers import build_loggers, check_backends
from xprep.train.loss import AUTO_CHUNK_ABOVE, Channels, LossSums, logits_bytes, token_ce
from xprep.train.loss_weights import WEIGHTS, LossWeights, weight_changes
from xprep.train.memory import peak_memory, reset_peak_memory
from xprep.train.metrics import EvalMetrics, MetricsLog, StepMetrics
from xprep.train.optim import apply_settings, hparam_changes, optimizer_settings, schedule_change
from xprep.train.preempt import STOP_SIGNALS, StopControl, Stopped, record_stop, signal_name
from xprep.train.prefetch import Prefetcher
from xprep.train.remix import Remix, check_prefix, find_remix, keep_blend, phase_note, schedule
from xprep.train.report import layout_text
from xprep.train.resume import check_same_model, check_same_pack, pinned_entry
from xprep.train.rundir import RanksLock, RunLock
from xprep.train.samplers import BatchPlan, BinSampler, ResumePoint, build_sampler, plan_batches
from xprep.train.weights import HFSaver, InitFrom, check_exportable, init_record, plan_init

BAD_STEPS_EXIT = 3  # exit status of a run that --max-bad-steps stopped (every rank's, and xtrain run's)
DATA_UNREACHABLE_EXIT = 75  # of a run stopped because its data at a URL stayed unreachable (sysexits' EX_TEMPFAIL)
CPU_KEYS = ("cu_seqlens", "cu_seqlens_padded", "cu_units")  # batch keys that stay on the CPU (read as Python ints)
PEER_FAILURE_GRACE_S = 3.0  # a rank whose collective failed waits this long before exiting (see _report_and_exit)
STEP_END_CALLBACKS: list[Callable[[Trainer], None]] = []  # called after every step of ``run``'s loop (tests)


def autocast_for(param_dtype: torch.dtype, device: torch.device, dims: ParallelDims):
    """The context the forward runs in: autocast to ``param_dtype`` when the parameters are not cast
    themselves, i.e. without FSDP2 (one process, or ``--no-fsdp``); nothing in fp32 or under FSDP2,
    whose MixedPrecisionPolicy casts them (xprep.train.dist.apply_fsdp). Weights, gradients and optimizer
    state stay fp32 either way, and the loss is computed in fp32."""
    if param_dtype == torch.float32 or (dims.fsdp and dims.distributed):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=param_dtype)


def build_model(model: ModelSection, parallel: ParallelSection, vocab_size: int, seed: int, dims: ParallelDims,
                device: torch.device, initial: Callable[[str], torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
    """The model spread over the layout: built on the meta device, sharded, then given its initial values
    shard by shard (xprep.train.dist.materialize), so no rank holds it whole (but for a transformers module,
    which is loaded whole and sharded after). ``initial``: the built-in model's values by name instead of its own
    (``--init-from hf:DIR``)."""
    module, config, own = model.build_meta(vocab_size, seed)
    initial = own if initial is None or own is None else initial
    if initial is None:
        module = module.to(device)
    module = parallelize(module, dims, parallel.reshard_after_forward, parallel.activation_checkpointing,
                         param_dtype_for(model.precision, device.type), model.compile)
    if initial is not None:
        materialize(module, device, initial)
    return module, config


# ---------------------------------------------------------------------------------------- trainer
class Trainer:
    """One optimizer step at a time over the micro-batches the sampler hands this rank."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                 dataset: PackedDataset, sampler: BinSampler, dims: ParallelDims, grad_accum: int,
                 device: torch.device, grad_clip: float = 0.0, autocast=contextlib.nullcontext, category_names=None,
                 model_config: dict | None = None, hparams: dict | None = None, loss_chunk: int = 0,
                 reduce_every_micro_batch: bool = False, throughput: Throughput | None = None,
                 init: dict | None = None, nonfinite: dict[str, frozenset[int]] | None = None,
                 loss_weights: LossWeights | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dataset, self.sampler, self.dims = dataset, sampler, dims
        self.grad_accum, self.device, self.grad_clip, self.autocast = grad_accum, device, grad_clip, autocast
        self.loss_chunk = loss_chunk  # > 0: the built-in model computes its loss in chunks of that many tokens
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.category_names = category_names if category_names is not None else dataset.category_names
        self.channels = Channels.of(self.category_names, dataset.source_names)
        self.loss_weights = loss_weights  # None: the loss is the plain token mean (nothing multiplied)
        self._rank_weight = 0.0  # Σ w over this rank's targets of the next step (weighted runs)
        self.model_config, self.hparams = model_config, hparams  # recorded in checkpoints, compared on resume
        self.init = init  # where the run's initial weights came from (xprep.train.weights.init_record), carried on
        self.settings = optimizer_settings(optimizer, scheduler)  # this run's, put back after a checkpoint loads
        # model FLOPs → TFLOPS and MFU of each step (no peak: no MFU; no model FLOPs: neither)
        self.throughput = throughput or Throughput(ModelFlops.from_dict(model_config), None, dims.world_size)
        self._rank_pairs = 0  # attended (query, key) pairs of this rank's bins of the next step
        self.attention_pairs = 0  # the same of the last step, all ranks
        self.step = 0
        self.bad_steps = 0  # bad steps in a row up to the last one (``train_step``); 0: the last step was good
        self.nonfinite = nonfinite or {}  # test hook: {"loss"|"grad": steps at which this rank makes them non-finite}
        self.loss: float | None = None  # of the last step (None: it had no target token)
        self.eval_loss: float | None = None  # of the last step, when it evaluated
        self._cp_groups: CPGroups | None = None  # the CP mode's process groups, made at the first CP batch

    def next_micro_batches(self) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """This rank's micro-batches of the next step, ready for the model; its real tokens and targets.

        Each is ``xprep.train.data.micro_batch`` of the sampler's next bins: under context parallelism this rank's
        zigzag share, so each rank counts and sums only its own targets (padding never is one), and the
        all-reduce over dp×cp adds them up. Targets are counted on the CPU, before the batch moves (no device
        sync in the step).
        """
        batches, tokens, targets, pairs, weight = [], 0, 0, 0, 0.0
        for _ in range(self.grad_accum):
            bins = self.sampler.next_micro_batch()
            if self.dims.cp_rank == 0:  # the CP ranks of a DP rank read the same bins: count them once
                tokens += self.dataset.bin_tokens(bins)
                pairs += bin_attention_pairs(self.dataset, bins)
            batch = micro_batch(self.dataset, bins, self.dims.cp_rank, self.dims.cp)
            targets += count_targets(batch)
            if self.loss_weights is not None:  # each token's weight, and their sum, known before the forward too
                batch[WEIGHTS] = self.loss_weights.token_weights(batch)
                weight += float(batch[WEIGHTS].double().sum())
            batches.append(self.to_device(batch))
        self._rank_pairs, self._rank_weight = pairs, weight
        return batches, tokens, targets

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the model computes with, on the device; the document boundaries stay on the
        CPU, where attention reads them as Python ints once per micro-batch (no device sync)."""
        return {k: v if k in CPU_KEYS else v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def cp_context(self, batch: dict[str, torch.Tensor]):
        """What the model's attention needs to see the other CP ranks' keys and values under --cp-mode (None
        without CP). The mode's process groups are made once, by every rank at its first CP batch."""
        dims = self.dims
        if not dims.cp_enabled:
            return None
        if self._cp_groups is None:
            self._cp_groups = dims.cp_groups()
        return cp_context(batch, dims.cp_mode, dims.cp_rank, dims.cp, dims.ulysses, self._cp_groups)

    @property
    def last_step_bad(self) -> bool:
        """Whether the last step was skipped: nothing may be saved from this state (the loop's save condition)."""
        return self.bad_steps > 0

    def train_step(self) -> StepMetrics:
        """One optimizer step, or a skipped one when it is bad: a non-finite loss or gradient norm on any rank.

        A bad step applies no update and leaves the lr schedule where it was (as Megatron-LM skips an
        iteration: the next step trains at the lr this one would have had); its batches stay consumed, so a
        resumed run sees the batches an uninterrupted one would. Every rank decides alike (``reduce_step``).
        A step without a target token, or whose targets all weigh 0, applies no update either (its gradients are
        zero, and AdamW would still move the weights by momentum and decay); its lr schedule advances.
        """
        reset_peak_memory(self.device)
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        sums, n_tokens, n_targets = self.accumulate_gradients()
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf))
        total, bad = self.reduce_step(sums, grad_norm)
        self.bad_steps = self.bad_steps + 1 if bad else 0
        weightless = total.weighted is not None and total.weighted_loss is None and n_targets > 0
        if not bad:
            if n_targets > 0 and not weightless:  # nothing to learn: no update (AdamW would still move the weights
                self.optimizer.step()             # by its momentum and decay, on zero gradients)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        channel = self.channels.losses(total)
        loss = total.loss if total.weighted is None else total.weighted_loss
        self.loss, self.eval_loss = loss, None
        grad_norm = float(grad_norm)  # waits for the device: the step is done
        seconds = time.perf_counter() - t0
        rates = self.throughput.measure(n_tokens, self.attention_pairs, seconds)
        peak_mem, peak_rss = peak_memory(self.device, self.dims)  # max over ranks
        return StepMetrics(self.step, loss, channel["category"], grad_norm, lr, n_tokens, n_targets, seconds,
                           self.sampler.consumed_samples, channel["source"], tflops=rates.tflops, mfu=rates.mfu,
                           mfu_6n=rates.mfu_6n, peak_mem_bytes=peak_mem, peak_rss_bytes=peak_rss,
                           skipped=bad, bad_steps=self.bad_steps, weighted=total.weighted is not None,
                           token_loss=total.loss, weightless=weightless)

    def reduce_step(self, sums: LossSums, grad_norm: torch.Tensor) -> tuple[LossSums, bool]:
        """The step's loss sums over all ranks, and whether the step is bad, from one all-reduce (the loss's).

        Bad: the loss summed over ranks is non-finite, or some rank's gradient norm is (it rides along as a
        count). Under FSDP2 the norm is global already; without it, each rank's norm is of the gradients
        all-reduced before, so they agree but for a fault on one rank. Both sums are the same on every rank,
        so every rank takes the same decision, and none waits for another to skip.
        """
        flag = (~torch.isfinite(grad_norm)).reshape(1).to(sums.ce)
        flat = all_reduce_sum(torch.cat([sums.flat(), flag]), self.dims)
        total = LossSums.from_flat(flat[:-1], weighted=sums.weighted is not None)
        return total, bool(flat[-1] > 0) or not math.isfinite(float(total.ce))

    def accumulate_gradients(self) -> tuple[LossSums, int, int]:
        """Forward and backward of every micro-batch of the step, gradients summed over ranks.

        Returns this rank's loss sums and the step's global token and target counts.
        """
        batches, tokens, targets = self.next_micro_batches()
        weighted = self.loss_weights is not None
        counts = [targets, tokens, self._rank_pairs] + ([self._rank_weight] if weighted else [])
        counts = torch.tensor(counts, dtype=torch.float64, device=self.device)
        n_targets, n_tokens, n_pairs, *weight = all_reduce_sum(counts, self.dims).tolist()  # before any forward
        self.attention_pairs = int(n_pairs)  # for MFU
        sums = self.channels.zeros(self.device, weighted)
        for i, batch in enumerate(batches):
            if self.dims.fsdp:  # FSDP2 reduce-scatters after the step's last backward (or after each)
                self.model.set_requires_gradient_sync(self.reduce_every_micro_batch or i == len(batches) - 1)
            self.forward_backward(batch, weight[0] if weighted else n_targets, sums)
        reduce_gradients(self.model, self.dims)
        if self.step + 1 in self.nonfinite.get("grad", ()):  # test hook: this rank's reduced gradients
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(math.nan)
        return sums, int(n_tokens), int(n_targets)

    def forward_backward(self, batch: dict[str, torch.Tensor], n_targets: float, sums: LossSums) -> None:
        """Backpropagate Σ CE / (targets of the whole step), or in a weighted run Σ w·CE / (Σ w of the whole
        step: ``n_targets`` is then that); accumulate the channel sums (unweighted) and the weighted ones.

        The weights scale each token's CE, so they reach the chunked loss's backward as its per-token
        gradient (``xprep.train.loss._ChunkedHeadCE``)."""
        ce = self.token_losses(batch)
        if self.step + 1 in self.nonfinite.get("loss", ()):  # test hook: NaN loss, hence NaN gradients
            ce = ce * math.nan
        weights = batch.get(WEIGHTS)
        if weights is None:
            (ce.sum() / max(n_targets, 1)).backward()
        else:  # Σ w may be below 1; 0 only when every weight is 0, and then so is the gradient
            ((ce * weights.reshape(-1)).sum() / (n_targets if n_targets > 0 else 1.0)).backward()
            sums.add_weighted(ce, weights)
        sums.add(ce, batch["labels"], *self.channels.ids(batch))

    def token_losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token cross-entropy (T,) in fp32 of this rank's share of a micro-batch (0 where no target).

        With ``loss_chunk`` the built-in model computes it in chunks (no whole (T, V) logits); else from
        the logits.
        """
        args = (batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        with self.autocast():
            if self.loss_chunk:
                return self.model(*args, cp=self.cp_context(batch), labels=batch["labels"], loss_chunk=self.loss_chunk)
            return token_ce(self.model(*args, cp=self.cp_context(batch)), batch["labels"])

    def evaluate(self, validation: Validation, progress: EvalProgress | None = None) -> EvalMetrics:
        """Loss over the validation bins: Σ CE over every rank's share / their global number of targets.

        No gradient, the model in eval mode (and back in train mode after). Every rank runs as many
        forwards (``Validation.rounds``); a filler micro-batch (an empty round) is not counted.
        ``progress`` (rank 0's) is told of every round done.
        """
        t0 = time.perf_counter()
        channels, dataset = validation.channels, validation.dataset
        sums = channels.zeros(self.device)
        self.model.eval()
        try:
            with torch.no_grad():
                for done, bins in enumerate(validation.rounds, start=1):
                    batch = self.to_device(micro_batch(dataset, bins or [0], self.dims.cp_rank, self.dims.cp))
                    ce = self.token_losses(batch)
                    if bins:
                        sums.add(ce, batch["labels"], *channels.ids(batch))
                    if progress is not None:
                        progress.update(done)
        finally:
            self.model.train()
            if progress is not None:
                progress.close()
        total = LossSums.from_flat(all_reduce_sum(sums.flat(), self.dims))
        channel = channels.losses(total)
        self.eval_loss = total.loss
        return EvalMetrics(total.loss, channel["category"], channel["source"], int(total.targets), validation.bins,
                           time.perf_counter() - t0)

    def state_dict(self) -> dict:
        """Everything a checkpoint records beside the model and optimizer (trainer.json): counters, sampler,
        schedule position and, to check or report a resume against, the pack key, the last loss, the batch
        sizes, the model config, the hparams and the schedule's shape."""
        scheduler = self.scheduler.state_dict()
        scheduler["lr_lambdas"] = [None] * len(scheduler["lr_lambdas"])  # the shape follows the config
        return {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": scheduler,
                "pack_key": self.dataset.key, "pack_entry": self.dataset.entry.path.name, "loss": self.loss,
                "eval_loss": self.eval_loss,
                "global_batch_size": self.grad_accum * self.sampler.micro_batch_times_dp,
                "micro_batch_size": self.sampler.micro_batch_size, "model": self.model_config,
                "hparams": self.hparams, "schedule": self.scheduler.lr_lambdas[0].settings(), "init": self.init,
                "loss_weights": self.loss_weights.record() if self.loss_weights is not None else None}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue from ``state`` (once the checkpoint's model and optimizer are loaded).

        The optimizer settings (lr, weight decay, betas) and the schedule's shape (warm-up, length) are
        not restored: they follow this trainer's config, so a resumed run may e.g. be extended with a
        larger --steps. Returns what differs from the checkpoint's, as "name old → new" items (as
        ``nn.Module.load_state_dict`` returns its mismatches).
        """
        self.step = int(state["step"])
        self.init = state.get("init")  # the run's, not this process's start (None: a checkpoint that predates it)
        self.loss, self.eval_loss = state.get("loss"), state.get("eval_loss")
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        changed, global_ = [], self.grad_accum * self.sampler.micro_batch_times_dp
        if state.get("global_batch_size") not in (None, global_):  # --allow-new-global-batch
            changed.append(f"global batch {state['global_batch_size']} → {global_} bins, from consumed sample "
                           f"{self.sampler.consumed_samples}")
        if self.hparams is not None:  # before the settings go back: an old checkpoint's are read off the optimizer
            changed += hparam_changes(state.get("hparams"), self.hparams, self.optimizer, self.scheduler)
        apply_settings(self.optimizer, self.scheduler, self.settings)
        schedule = schedule_change(self.scheduler.lr_lambdas[0], state.get("schedule"), self.scheduler.last_epoch,
                                   self.scheduler.base_lrs[0])
        return changed + weight_changes(state.get("loss_weights"), self.loss_weights) + ([schedule] if schedule else [])


# ---------------------------------------------------------------------------------------- run
@dataclass
class RunSetup:
    """What a run reads before any process group exists (so every user error surfaces first)."""

    dataset: PackedDataset
    plan: BatchPlan
    sampler: BinSampler
    ckpt: CheckpointManager
    resume_from: Path | None
    validation: Validation | None = None
    evals: list[Validation] = field(default_factory=list)  # --eval's named sets (validation is the one named valid)
    test: Validation | None = None  # evaluated once, after the last step (--test, or the pack's test entry)
    pinned: Path | None = None  # the entry resumed on, when it is not the one PACKED names (pinned_entry)
    loss_chunk: int = 0  # --loss-chunk as given, or as chosen for this pack, model and layout
    attention: str = ""  # the attention path the built-in model's forward takes here (xprep.train.attention)
    attention_note: str = ""  # why it is not the fastest kernel, when the model's head dim is refused by one
    init: InitFrom | None = None  # --init-from, when this run takes it (xprep.train.weights.plan_init)
    init_note: str = ""  # why --init-from is not used (the run resumes)
    loss_weights: LossWeights | None = None  # --category-weight / --source-weight for this pack; None: unweighted
    remix: Remix | None = None  # resuming onto another blend whose consumed bins are the checkpoint's (remix.py)


def prepare_run(cfg: TrainConfig, dims: ParallelDims, verify_data: bool | None = None) -> RunSetup:
    """Check the run directory, find the checkpoint to resume, open the pack for this layout (the entry the
    checkpoint was trained on, while the cache holds it), plan the batches, check the model. The run
    directory may hold an earlier run (resume), but must be one."""
    check_output_dir(cfg.run_dir, option="--output", allow_nonempty=True)
    check_backends(cfg.log)  # --log's packages are installed
    check_precision(cfg.model.precision, dims.device_type)
    ckpt = cfg.checkpoint.build(cfg.run_dir, dims)
    resume_from = ckpt.resolve(cfg.checkpoint.resume)
    saved = ckpt.read_trainer_state(resume_from) if resume_from is not None else {}
    data = cfg.data.fetched()  # PACKED at a URL: its small files fetched (its datasets are read in place)
    remix = find_remix(data.packed, saved, cfg.run_dir) if resume_from is not None else None
    pinned = pinned_entry(data.packed, saved, resume_from) if resume_from is not None and not remix else None
    dataset = data.build(dims.cp, verify_data, entry=pinned)
    if resume_from is not None and not remix:
        check_same_pack(saved, resume_from, dataset.key)
    plan = plan_batches(len(dataset), dataset.entry.config, dims.dp, cfg.data.micro_batch_size,
                        cfg.data.global_batch_size, cfg.steps, cfg.epochs, ResumePoint.of(saved),
                        cfg.data.allow_new_global_batch)
    validation = cfg.eval.build(data, dataset, dims, plan.micro_batch_size, verify_data, entry=pinned)
    evals = cfg.eval.build_sets(data, dataset, dims, plan.micro_batch_size, verify_data)
    test = cfg.eval.build_test(data, dataset, dims, plan.micro_batch_size, verify_data, entry=pinned)
    sampler = build_sampler(cfg.data.sampler, len(dataset), plan.micro_batch_size, dims.dp_rank, dims.dp, cfg.seed,
                            plan.group)
    if remix:  # the bins consumed so far, the same in the new blend, or refused
        check_prefix(remix, dataset.entry, int(saved["sampler"]["consumed_samples"]),
                     lambda n, at: build_sampler(cfg.data.sampler, n, 1, 0, plan.group, cfg.seed, plan.group)
                     .bins_at(at), plan.global_batch_size, resume_from)
    if not dataset.vocab_size:
        raise XprepError(f"{dataset.datasets[0].path}/manifest.json: no tokenizer vocab_size; re-create the dataset")
    model_config = cfg.model.check(dataset.vocab_size)
    # (hf:DIR run as a transformers module: its vocabulary is at least the data's, checked when it is built)
    vocab = model_config["vocab_size"] if model_config is not None else dataset.vocab_size
    check_token_ids([*dataset.datasets, *(ds for v in (validation, *evals, test) if v for ds in v.dataset.datasets)],
                    vocab, f"--model {cfg.model.name}")
    if resume_from is not None and model_config is not None:
        check_same_model(saved, resume_from, model_config)
    if dims.cp_enabled and model_config is None:  # hf:DIR running as a transformers module
        raise XprepError(f"--cp {dims.cp} needs the built-in model (its attention runs over the CP group): "
                         f"use a preset or a JSON model config instead of --model {cfg.model.name}")
    if dims.cp_enabled:  # a head split --cp-mode cannot make: refused before any process group
        check_cp_heads(dims.cp_mode, dims.cp, dims.ulysses, model_config["n_heads"])
    loss_chunk = cfg.model.chunk_for(micro_batch_tokens(dataset, plan, dims), dataset.vocab_size,
                                     builtin=model_config is not None)
    attention, attention_note = attention_plan(cfg, dims, model_config)
    check_exportable(cfg.checkpoint.save_hf, model_config, cfg.model.name)
    init, init_note = plan_init(cfg.model.init_from, model_config, cfg.model.name, resume_from, cfg.checkpoint.resume)
    return RunSetup(dataset, plan, sampler, ckpt, resume_from, validation, evals, test, pinned, loss_chunk,
                    attention, attention_note, init, init_note, cfg.data.loss_weights(dataset), remix)


def attention_plan(cfg: TrainConfig, dims: ParallelDims, model_config: dict | None) -> tuple[str, str]:
    """The built-in model's attention path on this device, precision and layout, and a note when its head dim
    keeps it off a faster kernel (``xprep.train.attention``); an attention that would be wrong here (flash-attn < 2.1
    under context parallelism) is refused now, before any process group."""
    if model_config is None:
        return "", ""
    head_dim = model_config["dim"] // model_config["n_heads"]
    dtype = param_dtype_for(cfg.model.precision, dims.device_type)
    device = torch.device(dims.device_type)
    path = (cp_attention_path(dims.cp_mode, device, dtype, head_dim) if dims.cp_enabled
            else attention_path(device, dtype, head_dim))
    return path, check_head_dim(head_dim, dims.device_type)


def micro_batch_tokens(dataset: PackedDataset, plan: BatchPlan, dims: ParallelDims) -> int:
    """Tokens of one micro-batch on one rank, what its logits are sized by: bins × capacity, / CP ranks."""
    return plan.micro_batch_size * dataset.capacity // dims.cp


def run(cfg: TrainConfig, stream=None, lock: bool = True, notes: Sequence[str] = ()) -> Path:
    """Train per ``cfg`` in this process (one process, or one rank of a launched job); returns the run directory.

    Rank 0 holds the run directory's ``RunLock`` for the whole run; ``lock=False`` for the ranks that
    ``xprep.train.launch`` starts, whose launcher holds it. Every rank of a distributed run also holds the run's
    ranks lock (``xprep.train.rundir.RanksLock``), so that no later run starts while one of them lives. Rank 0
    says ``notes`` (how the config was resolved) once the run has passed its checks. A stop signal ends
    the run after a checkpoint with ``xprep.train.preempt.Stopped`` (one process) or its exit status (a rank).
    """
    validate_against_schema(cfg.to_dict())
    dims = cfg.parallel.build()
    if os.environ.get(PARENT_ENV) or "TORCHELASTIC_RUN_ID" in os.environ:  # a launched rank: die with the launcher
        die_with_parent()
    configure_device(dims.device_type, cfg.model.tf32)  # before anything initializes CUDA
    if dims.distributed:  # until training starts, a stop signal ends a rank at once, quietly (nothing to save)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
    setup = prepare_run(cfg, dims)
    owner = lock and dims.is_main  # this process owns the run directory: its lock and the attempt's log
    with RunLock(cfg.run_dir) if owner else contextlib.nullcontext():
        attempt = attempts.Attempt.begin(cfg.run_dir, cfg.to_dict(), notes) if owner else None
        if dims.is_main:
            for note in notes:
                print(note, file=stream or sys.stderr)
        ranks_lock = None
        try:
            device = init_distributed(dims, cfg.parallel.collective_timeout())
            ranks_lock = RanksLock(cfg.run_dir).acquire() if dims.distributed else None  # after rank 0's RunLock
            _train(cfg, dims, device, setup, stream)
        except BaseException as e:
            if attempt is not None:
                attempt.end_with(e)
            if dims.distributed:  # report, then leave at once: peers may be blocked in a collective
                _report_and_exit(e, dims)
            raise
        finally:
            if ranks_lock is not None:
                ranks_lock.release()
        if attempt is not None:
            attempt.end_with(None)
        shutdown(dims, 0)
    return cfg.run_dir


def _report_and_exit(e: BaseException, dims: ParallelDims) -> None:
    """Print this rank's error, hand it to the launcher, and exit without waiting for the peers.

    A rank whose collective failed most likely lost a peer that failed first: it waits a moment before
    saying anything, so that the launcher sees (and names) the rank that failed first, and stops this one
    before it adds a traceback of the broken connection to that rank's error.
    """
    if isinstance(e, Stopped):  # every rank stopped at the same step, after the checkpoint: nothing to report
        shutdown(dims, e.exit_code, clean=True)
    if isinstance(e, AgreedStop):  # every rank stopped at the same step: no peer to wait for
        if (line := e.line(dims)) is not None:
            print(line, file=sys.stderr)
        shutdown(dims, e.exit_code, clean=True)
    cause = None if isinstance(e, XprepError) else machine_cause(e)
    if cause is not None:  # the machine refused (a full disk, a permission): one line, as a user's mistake is
        e = machine_error(cause)
    if not isinstance(e, XprepError) and failed_in_collective(e):
        sys.stderr.flush()
        time.sleep(PEER_FAILURE_GRACE_S)
    if isinstance(e, XprepError):
        print(f"error: [rank {dims.rank}] {e}", file=sys.stderr)
        code = 2
    else:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):  # the launcher's error file (TORCHELASTIC_ERROR_FILE), if any
        ErrorHandler().record_exception(e)
    shutdown(dims, code)


def _train(cfg: TrainConfig, dims: ParallelDims, device: torch.device, setup: RunSetup, stream) -> None:
    dataset, plan, ckpt, run_dir = setup.dataset, setup.plan, setup.ckpt, cfg.run_dir
    peak, peak_note = resolve_peak_tflops(device, cfg.peak_tflops, _precision(cfg, dims), cfg.model.tf32)
    init = setup.init
    model, model_config = build_model(cfg.model, cfg.parallel, dataset.vocab_size, cfg.seed, dims, device,
                                      init.initial() if init else None)
    if init is not None and init.step is not None:
        ckpt.load_model(init.path, model)
    model.train()
    optimizer, scheduler = cfg.optimizer.build(model, plan.steps)
    trainer = Trainer(model, optimizer, scheduler, dataset, setup.sampler, dims, plan.grad_accum, device,
                      cfg.optimizer.grad_clip, autocast_for(param_dtype_for(cfg.model.precision, device.type),
                                                            device, dims),
                      model_config=model_config, hparams=cfg.optimizer.hparams(), loss_chunk=setup.loss_chunk,
                      reduce_every_micro_batch=cfg.parallel.reduce_every_micro_batch,
                      throughput=Throughput(ModelFlops.from_dict(model_config), peak, dims.world_size,
                                            dataset.capacity), init=init_record(init, model_config, cfg.seed),
                      nonfinite=cfg.optimizer.nonfinite_at(dims.rank), loss_weights=setup.loss_weights)
    out = stream or sys.stderr
    if setup.resume_from is not None:
        _resume(setup, trainer, dims.is_main, out)
        if dims.is_main:
            attempts.note(run_dir, (setup.ckpt.note + "; " if setup.ckpt.note else "")
                          + f"resuming at step {trainer.step} from {setup.resume_from}")
    if dims.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_config(run_dir, cfg, plan, model_config, dataset, dims, setup.validation, setup.loss_chunk,
                          trainer.init, setup)
    loggers = build_loggers(cfg.log, run_dir, cfg.to_dict(), trainer.step) if dims.is_main else []
    log = MetricsLog(run_dir, plan.steps, cfg.log_every, dims.is_main, stream, loggers=loggers)
    log.open(trainer.step)
    if dims.is_main:
        out.write(_pack_line(dataset, setup) + "\n")
        if note := phase_note(dataset.entry, cfg.data.sampler):
            out.write(note + "\n")
        for line in (setup.init_note, init and init.note, init and init.line()):
            if line:
                out.write(line + "\n")
        if setup.validation is not None:
            out.write(_validation_line(setup.validation) + "\n")
        for named in (*setup.evals, *([setup.test] if setup.test else [])):
            out.write(_named_set_line(named, named is setup.test) + "\n")
        out.write(_start_line(cfg, trainer, plan, setup.attention) + f" → {run_dir}\n")
        if setup.attention_note:
            out.write(setup.attention_note + "\n")
        if setup.loss_weights is not None:
            out.write(f"loss weighted ({setup.loss_weights.text()}; others 1): Σ w·CE / Σ w over each step's targets; "
                      "the validation loss stays unweighted\n")
        out.write(peak_note + "\n")
        if cfg.model.loss_chunk is None and setup.loss_chunk:
            out.write(_loss_chunk_line(setup.loss_chunk, micro_batch_tokens(dataset, plan, dims), dataset.vocab_size)
                      + "\n")
    if trainer.step >= plan.steps and dims.is_main:
        out.write(f"{run_dir}: already at step {trainer.step}/{plan.steps}, nothing to do "
                  "(raise --steps to continue)\n")
    save_every = cfg.checkpoint.save_every
    hf = HFSaver(run_dir, cfg.checkpoint.save_hf_every, model_config, ckpt, dims, out) if cfg.checkpoint.save_hf \
        else None
    control = StopControl(dims, device, cfg.checkpoint.save_every_minutes)
    saved_at = trainer.step  # of the newest checkpoint (the one resumed from; 0: the initial state, none needed)
    prefetch = Prefetcher(dataset, trainer.sampler, plan.grad_accum, cfg.data.prefetch_steps,
                          plan.steps - trainer.step) \
        if dataset.cache is not None else None  # datasets at URLs: the next steps' bytes fetched ahead
    if prefetch is not None and dims.is_main and (note := prefetch.note()):
        out.write(note + "\n")
    control.arm()
    try:
        while trainer.step < plan.steps:
            signum, save_due = control.poll()
            if signum:
                _stop(signum, trainer, ckpt, saved_at, plan, run_dir, dims.is_main, out)
            if prefetch is not None:
                _stage(prefetch, trainer, ckpt, saved_at)
            if save_due and saved_at != trainer.step and not trainer.last_step_bad:
                saved_at = _save(ckpt, trainer, control)
            metrics = trainer.train_step()
            _evaluate_due(trainer, metrics, setup, plan.steps, out)  # before the save: "best" follows valid's
            log.write(metrics)
            if metrics.tests and dims.is_main:
                _record_test(run_dir, metrics)
            if trainer.last_step_bad:  # no save (nor weights out) from a state reached through a bad step
                _after_bad_step(trainer, cfg.optimizer.max_bad_steps, plan.steps, ckpt, out)
            else:
                if trainer.step == plan.steps or (save_every and trainer.step % save_every == 0):
                    saved_at = _save(ckpt, trainer, control)
                if hf is not None and hf.due(trainer.step, plan.steps):
                    hf.save(trainer.step, model, trainer.state_dict())
            ckpt.poll()  # an asynchronous save that has ended: its error, if any, raised now
            for callback in STEP_END_CALLBACKS:
                callback(trainer)
        ckpt.finish()  # an asynchronous save still being written: published before the run ends
        if dims.is_main:
            attempts.note(run_dir, f"trained to step {trainer.step}/{plan.steps}")
    finally:
        control.disarm()
        log.close()
        if prefetch is not None:
            prefetch.close()
        dataset.close()


def _evaluate_due(trainer: Trainer, metrics: StepMetrics, setup: RunSetup, last_step: int, out) -> None:
    """Evaluate the sets due after this step into ``metrics``: the validation entry (``valid``) and ``--eval``'s
    sets when validation is due, the test set after the last step only. The loss "best" checkpoints follow stays
    the ``valid`` set's."""
    eval_loss = trainer.eval_loss
    for v in (setup.validation, *setup.evals):
        if v is not None and v.due(trainer.step, last_step):
            metrics.evals[v.name] = trainer.evaluate(v, _progress(trainer, v, out))
    test = setup.test
    if test is not None and trainer.step == last_step:
        metrics.tests[test.name] = trainer.evaluate(test, _progress(trainer, test, out))
    metrics.eval = metrics.evals.get(DEFAULT_SET)
    trainer.eval_loss = metrics.eval.loss if metrics.eval is not None else eval_loss


def _progress(trainer: Trainer, v: Validation, out) -> EvalProgress | None:
    return EvalProgress(trainer.step, len(v.rounds), v.bins, out) if trainer.dims.is_main else None


def _record_test(run_dir: Path, metrics: StepMetrics) -> None:
    """The test pass's result in run.json (``test``, by set name, with the step it followed), atomically."""
    info = read_json(run_dir / "run.json", "run.json", "re-run the same command")
    info["test"] = {name: {**{k.rsplit("/", 1)[1]: v for k, v in e.named_record(f"test/{name}").items()},
                           "step": metrics.step} for name, e in metrics.tests.items()}
    write_json_atomic(run_dir / "run.json", info)


def _save(ckpt: CheckpointManager, trainer: Trainer, control: StopControl | None = None) -> int:
    """Checkpoint the trainer at its step (restarting --save-every-minutes' clock); return that step."""
    ckpt.save(trainer.step, trainer.model, trainer.optimizer, trainer.state_dict())
    if control is not None:
        control.saved()
    return trainer.step


def _stop(signum: int, trainer: Trainer, ckpt: CheckpointManager, saved_at: int, plan: BatchPlan,
          run_dir: Path, is_main: bool, out) -> None:
    """Every rank stops here, after the same step: a checkpoint of it, complete and published (after any save in
    flight) unless the newest one is of this step already, then ``Stopped`` with the status of ``signum``."""
    name = signal_name(signum)
    where = _checkpoint_to_stop(trainer, ckpt, saved_at,
                                f"{name} received: saving a checkpoint of step {trainer.step} before stopping"
                                if is_main else None, out)
    message = (f"stopped by {name} after step {trainer.step}/{plan.steps} ({where}); the same command, or "
               f"`xtrain run -o {run_dir}`, resumes")
    if is_main:
        out.write(message + "\n")
        out.flush()
        attempts.note(run_dir, message)
        record_stop(signum, message)
    raise Stopped(signum, message, said=is_main)


def _checkpoint_to_stop(trainer: Trainer, ckpt: CheckpointManager, saved_at: int, saying: str | None = None,
                        out=None) -> str:
    """Before every rank stops after the same step (a stop signal, or data that stays unreachable): a checkpoint of
    that step, complete and published (after any save in flight), unless the newest one is of this step already or
    the step was bad; ``saying`` is printed before a save. Returns where the run stands, for the stop's line."""
    if ckpt.no_save:
        where = "--no-save: no checkpoint written"
    elif trainer.step == 0:
        where = "nothing trained yet"
    elif saved_at == trainer.step:
        where = f"checkpoint step-{trainer.step} is saved"
    elif trainer.last_step_bad:  # nothing saved from a state reached through a bad step
        where = f"not saved: the step was bad; step-{saved_at} stays the latest"
    else:
        if saying:
            out.write(saying + "\n")
            out.flush()
        ckpt.save(trainer.step, trainer.model, trainer.optimizer, trainer.state_dict(), blocking=True)
        where = f"checkpoint step-{trainer.step} saved"
    ckpt.finish()  # a save in flight, published before any rank goes on
    return where


def _stage(prefetch: Prefetcher, trainer: Trainer, ckpt: CheckpointManager, saved_at: int) -> None:
    """The next step's data fetched (prefetch.py); when its URL stays unreachable past --stream-timeout, the run
    stops before the step, every rank at once (they agree in one small all-reduce), with a checkpoint of the steps
    done (as a stop signal's), and says so in one line."""
    failure = None
    try:
        prefetch.stage()
    except StreamUnavailable as e:
        failure = e
    failed = all_reduce_sum(torch.tensor([int(failure is not None)], device=trainer.device), trainer.dims)
    if not int(failed.item()):
        return
    where = _checkpoint_to_stop(trainer, ckpt, saved_at)
    said = failure or "another rank's data stayed unreachable"
    raise DataUnreachable(f"{said}: stopped after step {trainer.step} ({where}); run the same command again once it "
                          "answers, to resume", own=failure is not None)


class AgreedStop(XprepError):
    """A stop every rank reached at the same step: each leaves with ``exit_code``, printing its ``line``, if any."""

    exit_code: int

    def line(self, dims: ParallelDims) -> str | None:
        raise NotImplementedError


class DataUnreachable(AgreedStop):
    """Data at a URL stayed unreachable past --stream-timeout: every rank stopped before the same step, after a
    checkpoint; exit status 75 (sysexits' EX_TEMPFAIL, "try again later": a scheduler may requeue the same command,
    which resumes). ``own``: this rank's own read failed (it names the URL; the others only follow)."""

    exit_code = DATA_UNREACHABLE_EXIT

    def __init__(self, message: str, own: bool = True):
        super().__init__(message)
        self.own = own

    def line(self, dims: ParallelDims) -> str | None:
        return f"error: [rank {dims.rank}] {self}" if self.own else None


class TooManyBadSteps(AgreedStop):
    """``--max-bad-steps`` bad steps in a row: the run stops (every rank at the same step), exit status 3; rank 0
    says why."""

    exit_code = BAD_STEPS_EXIT

    def line(self, dims: ParallelDims) -> str | None:
        return f"error: {self}" if dims.is_main else None


def _after_bad_step(trainer: Trainer, max_bad_steps: int, total_steps: int, ckpt: CheckpointManager, out) -> None:
    """Stop the run after ``max_bad_steps`` bad steps in a row; say it when the last step of the run was bad.

    Either way nothing is saved: a NaN loss may come from weights broken already (e.g. loaded from a
    damaged checkpoint), so the last checkpoint written before the streak stays ``latest`` (a save still in
    flight is completed first).
    """
    if trainer.bad_steps < max_bad_steps and trainer.step < total_steps:
        return
    ckpt.finish()
    latest = ckpt.latest()
    kept = f"{latest} stays the latest checkpoint" if latest else "no checkpoint was written before"
    n = trainer.bad_steps
    if n >= max_bad_steps:
        streak = f"{n} bad steps in a row, {trainer.step - n + 1}–{trainer.step}" if n > 1 else "a bad step"
        raise TooManyBadSteps(
            f"step {trainer.step}: {streak} (non-finite loss or gradient norm, update{'s' * (n > 1)} skipped), the "
            f"limit of --max-bad-steps {max_bad_steps}: run stopped; {kept}. Find the cause (the batches, --lr, "
            "--precision); a resumed run trains on the same batches (raise --max-bad-steps to skip past them)")
    if trainer.dims.is_main:
        out.write(f"the last step, {trainer.step}, was bad: no checkpoint at the end; {kept}\n")


def _resume(setup: RunSetup, trainer: Trainer, is_main: bool, out) -> None:
    """Load the checkpoint into the trainer; say which of this config's optimizer settings differ from it."""
    path = setup.resume_from
    if setup.ckpt.note and is_main:  # the pointer was missing or damaged: which checkpoint instead, and why
        out.write(setup.ckpt.note + "\n")
    check_same_model(setup.ckpt.read_trainer_state(path), path, trainer.model_config)
    remix = setup.remix
    state = setup.ckpt.load(path, trainer.model, trainer.optimizer, remix.old_key if remix else setup.dataset.key)
    if remix:  # the prefix is checked: the sampler goes on over the new blend's bins
        state["sampler"]["num_bins"] = len(setup.dataset)
        if is_main:
            out.write(f"re-mixed: resuming on {setup.dataset.entry.path.name} instead of {remix.old_entry}, the "
                      f"{state['sampler']['consumed_samples']:,} bins trained on the same in both; changed: "
                      + "; ".join(remix.changes) + "\n")
    changed = trainer.load_state_dict(state)
    if changed and is_main:
        out.write("resuming with other hyperparameters than the checkpoint's: " + ", ".join(changed) + "\n")


def _pack_line(dataset: PackedDataset, setup: RunSetup) -> str:
    """Which pack entry the run reads, and why that one: the cache's current entry, the one given, or the one
    the checkpoint resumed from was trained on (another entry has become current since)."""
    entry = dataset.entry.path
    if setup.pinned is not None:
        cache = entry.parent
        return (f"training on {entry} (entry {entry.name}, the one checkpoint {setup.resume_from.name} was trained "
                f"on, still in the cache; another entry is current in {cache / MANIFEST} now: a new run, with another "
                "--output, would train on that one)")
    origin = "given directly" if entry == dataset.packed else f"current in {dataset.packed / MANIFEST}"
    return f"training on {entry} (entry {entry.name}, {origin})"


def _validation_line(validation: Validation) -> str:
    """Which entry the run evaluates on, on how many bins, and when."""
    entry, when = validation.dataset.entry.path, "after the last step"
    if validation.every:
        when = f"every {validation.every:,} steps and " + when
    bins = f"{validation.bins:,} of {len(validation.dataset):,} bins"
    if validation.bins < len(validation.dataset):
        bins += " evenly spaced (--eval-bins all for every one)"
    return f"validating on {entry} (entry {entry.name}, the validation entry of the one trained on): {bins}, {when}"


def _named_set_line(v: Validation, test: bool) -> str:
    """Which entry a named evaluation set (or the test set) reads, on how many bins, and when."""
    entry = v.dataset.entry.path
    when = "once after the last step" if test else (
        f"every {v.every:,} steps and after the last step" if v.every else "after the last step")
    return (f"{'testing' if test else 'evaluating'} {v.name!r} on {entry} (entry {entry.name}): {v.bins:,} of "
            f"{len(v.dataset):,} bins, {when}")


def _start_line(cfg: TrainConfig, trainer: Trainer, plan: BatchPlan, attention: str = "") -> str:
    """The model, the data, the batch arithmetic and the layout of the run about to start."""
    dims, dataset = trainer.dims, trainer.dataset
    n_params = sum(p.numel() for p in trainer.model.parameters())
    layout = layout_text(dims.dp, dims.cp, dims.cp_mode, dims.ulysses_degree, dims.fsdp)
    layout += f", {dims.device_type}, {precision_note(cfg.model.precision, dims.device_type)}"
    layout += f", attention: {attention}" if attention else ""
    return (f"{cfg.model.name} ({n_params / 1e6:,.1f}M parameters) on {len(dataset):,} bins of "
            f"{dataset.capacity:,} tokens: {plan.steps:,} steps of {plan.global_batch_size} bins (micro-batch "
            f"{plan.micro_batch_size} × {dims.dp} DP × {plan.grad_accum} accumulation; {layout})"
            + (f", resuming at step {trainer.step}" if trainer.step else ""))


def _loss_chunk_line(chunk: int, tokens: int, vocab_size: int) -> str:
    """What --loss-chunk was chosen, and why (``xprep.train.loss.auto_loss_chunk``)."""
    whole = logits_bytes(tokens, vocab_size)
    return (f"loss computed in chunks of {chunk:,} tokens (--loss-chunk auto): a micro-batch's whole logits would take "
            f"{whole / 2**30:.1f} GiB ({tokens:,} tokens × {vocab_size:,} vocabulary × 4 bytes, above "
            f"{AUTO_CHUNK_ABOVE / 2**30:g} GiB); same loss and gradients, one more output-layer matmul; --loss-chunk 0 "
            "computes them whole")


def _precision(cfg: TrainConfig, dims: ParallelDims) -> str:
    """What --precision resolved to on this run's device: bf16 or fp32."""
    return precision_name(cfg.model.precision, dims.device_type)


def _write_run_config(run_dir: Path, cfg: TrainConfig, plan: BatchPlan, model_config: dict,
                      dataset: PackedDataset, dims: ParallelDims, validation: Validation | None = None,
                      loss_chunk: int = 0, init: dict | None = None, setup: RunSetup | None = None) -> None:
    """config.json is the resolved TrainConfig (nested, schema-checked); run.json what it resolved to (with the
    named evaluation sets, and the test result of an earlier attempt that reached the last step, kept)."""
    val = None
    if validation is not None:
        entry = validation.dataset.entry
        val = {"path": str(Path(entry.path).resolve()), "entry": entry.path.name, "key": entry.key,
               "bins": len(validation.dataset), "eval_bins": validation.bins, "every": validation.every}
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    keep_blend(run_dir, dataset.entry)  # what a re-mixed resume checks against (xprep.train.remix)
    write_json_atomic(run_dir / "run.json", {
        "pack": {"path": str(Path(dataset.entry.path).resolve()), "entry": dataset.entry.path.name, "key": dataset.key,
                 "bins": len(dataset), "capacity": dataset.capacity, "method": dataset.entry.config.get("method"),
                 "phases": schedule(dataset.entry, plan.global_batch_size, cfg.data.sampler)},
        "categories": dataset.category_names, "sources": dataset.source_names, "validation": val,
        "plan": asdict(plan), "world_size": dims.world_size, "dp": dims.dp, "cp": dims.cp, "cp_mode": dims.cp_mode,
        "ulysses": dims.ulysses_degree, "fsdp": dims.fsdp,
        "precision": _precision(cfg, dims), "loss_chunk": loss_chunk,
        "code": attempts.code_version(), "config_sha256": attempts.config_digest(cfg.to_dict()),
        "model": model_config, "init": init,
        "loss_weights": setup.loss_weights.record() if setup and setup.loss_weights else None,
        **_eval_sets(run_dir, setup),
    })


def _eval_sets(run_dir: Path, setup: RunSetup | None) -> dict:
    """run.json's ``eval_sets`` (--eval's named sets), ``test_set`` and an earlier attempt's ``test`` result."""
    def described(v: Validation) -> dict:
        entry = v.dataset.entry
        return {"name": v.name, "path": str(Path(entry.path).resolve()), "entry": entry.path.name, "key": entry.key,
                "bins": len(v.dataset), "eval_bins": v.bins}

    if setup is None:
        return {}
    out = {"eval_sets": [described(v) for v in setup.evals], "test_set": setup.test and described(setup.test)}
    earlier = run_dir / "run.json"
    if earlier.is_file():
        with contextlib.suppress(XprepError):
            before = read_json(earlier, "run.json", "")
            if isinstance(before, dict) and before.get("test"):
                out["test"] = before["test"]
    return out
