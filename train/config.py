"""``TrainConfig``: every option of ``xtrain run``, in sections that each check their fields and build their part.

```
TrainConfig   steps, epochs, seed, output, log_every, log, peak_tflops   (the run itself)
  data        packed, micro_batch_size, global_batch_size, sampler, verify_data,
              allow_new_global_batch                                              → PackedDataset
              category_weight, source_weight                                      → LossWeights (or None)
              prefetch_steps, cache_size, stream_timeout (datasets at URLs)
  model       name (--model), precision, tf32, loss_chunk, compile, init_from     → model (+ its config)
  optimizer   lr, min_lr, warmup, schedule, decay_fraction, weight_decay, beta1, beta2, grad_clip → AdamW + LambdaLR
              max_bad_steps, inject_nonfinite (tests only)                        → Trainer's bad-step rule
  parallel    device, nproc_per_node, dp, cp, cp_mode, ulysses, fsdp, reshard_after_forward,
              activation_checkpointing, reduce_every_micro_batch, dist_timeout    → ParallelDims
  checkpoint  save_every, save_every_minutes, keep, resume, async_save, no_save,  → CheckpointManager
              save_hf, save_hf_every, checkpoint_timeout
  eval        every (--eval-every), bins (--eval-bins), sets (--eval), test (--test) → Validation (or None),
              the named sets and the test set
```
Precedence: dataclass defaults < the run directory's own ``config.json`` (when ``--output`` names a run
that has one: resuming needs no flag repeated, ``xtrain run --output RUN`` alone continues it) <
``--config FILE.json|yaml`` < command-line flags; what the file and the flags change from the run's
config is said on the console. Every field has
one flag and one flat key, the flag's name with underscores (``--micro-batch-size`` ↔
``micro_batch_size``; the model section's ``name`` is ``--model``, the eval section's ``every`` and
``bins`` are ``--eval-every`` and ``--eval-bins``). A config file may be nested
(``{"optimizer": {"lr": 1e-3}}``), flat (``{"lr": 1e-3}``, as config.json was before the sections)
or both. The resolved config is written to the run directory as ``config.json``, nested, and
checked against ``schemas/train.schema.json``.

One module (~650 lines) because it is one contract: every flag's name, default, type check and place in the nested
and flat forms derive from these dataclasses and the tables after them (``FLAT_KEYS``), and the checks name the
flag through the same tables; tests/train/test_train_plan.py holds the sections, the CLI and the schema to each
other. The seam, should it grow, is the files and precedence half (``read_config_file`` to ``config_changes``).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import jsonschema
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from xprep.prep.dataset import DEFAULT_RETRY_S
from xprep.prep.errors import XprepError
from xprep.prep.fs import is_url
from xprep.prep.pack import fetch_pack
from xprep.prep.sources import parse_size
from xprep.train.checkpoint import CheckpointManager, checkpoint_timeout
from xprep.train.cp import CP_MODES, DEFAULT_CP_MODE, HYBRID, ulysses_degree
from xprep.train.data import PackedDataset
from xprep.train.dist import DEVICES, ParallelDims, collective_timeout, materialize
from xprep.train.evaluate import (
    DEFAULT_EVAL_BINS,
    DEFAULT_SET,
    DEFAULT_TEST,
    TEST_KEY,
    Validation,
    eval_rounds,
    open_named_set,
    open_validation,
    parse_named_set,
    spaced_bins,
    validation_entry,
)
from xprep.train.flops import check_peak_tflops
from xprep.train.hf import build_hf_fallback, hf_builtin_config
from xprep.train.hf_weights import read_hf_weights
from xprep.train.loggers import parse_backends
from xprep.train.loss import Channels, auto_loss_chunk
from xprep.train.loss_weights import LossWeights, parse_weights
from xprep.train.model import ModelConfig, Transformer, initial_value, load_model_config
from xprep.train.optim import SCHEDULES, WSD_SCHEDULES, LRSchedule, build_optimizer, build_scheduler
from xprep.train.prefetch import DEFAULT_PREFETCH_STEPS

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "train.schema.json"
SAMPLERS = ("sequential", "random")
PRECISIONS = ("auto", "fp32", "bf16")
NONFINITE_KINDS = ("loss", "grad")  # what ``inject_nonfinite`` (a test hook) makes non-finite


@dataclass
class DataSection:
    """Which pack, how its bins become micro-batches, and what its categories and sources weigh in the loss."""

    SECTION: ClassVar[str] = "data"
    packed: str
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size × DP ranks (or the pack's DP step)
    sampler: str = "sequential"
    verify_data: bool = False
    allow_new_global_batch: bool = False  # resume on another global batch from the checkpoint's consumed samples
    category_weight: dict[str, float] | None = None  # by category name; None: all 1 (xprep.train.loss_weights)
    source_weight: dict[str, float] | None = None  # by blend source name; None: all 1
    prefetch_steps: int = DEFAULT_PREFETCH_STEPS  # datasets at URLs: steps fetched ahead (train/prefetch.py)
    cache_size: str | int = "2GB"  # datasets at URLs: bytes of the local block cache (prep/dataset/stream.py)
    stream_timeout: float = DEFAULT_RETRY_S  # datasets at URLs: seconds a read retries before the run stops

    def __post_init__(self):
        for name in ("category_weight", "source_weight"):  # NAME=W items (the flags) or {name: weight} (a file)
            setattr(self, name, parse_weights(getattr(self, name), _flag(self, name)))
        _check_types(self)
        _check_at_least(self, 1, "micro_batch_size", "global_batch_size")
        _check_at_least(self, 0, "prefetch_steps")
        self.cache_bytes = parse_size(str(self.cache_size), "--cache-size")
        if self.stream_timeout <= 0:
            raise XprepError(f"--stream-timeout {self.stream_timeout}: must be > 0 seconds")
        _check_choice(self, "sampler", SAMPLERS)
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise XprepError(f"--global-batch-size {self.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {self.micro_batch_size}")

    def build(self, cp_size: int, verify_data: bool | None = None, entry: Path | None = None) -> PackedDataset:
        """The pack opened for ``cp_size`` context-parallel ranks (``verify_data`` overrides the field): its
        current entry, or ``entry`` of it (a resume pinned to its checkpoint's entry)."""
        verify = self.verify_data if verify_data is None else verify_data
        return PackedDataset(entry or self.packed, verify_data=verify, cp_size=cp_size, cache_size=self.cache_bytes,
                             stream_timeout=self.stream_timeout)

    def fetched(self) -> DataSection:
        """This section, PACKED at a URL replaced by the local copy of its small files (prep/pack/remote.py)."""
        return replace(self, packed=str(fetch_pack(self.packed))) if is_url(self.packed) else self

    def loss_weights(self, dataset: PackedDataset) -> LossWeights | None:
        """The weights of ``dataset``'s categories and sources in the loss; None: unweighted (all 1)."""
        return LossWeights.build(self.category_weight, self.source_weight, dataset.category_names,
                                 dataset.source_names)


@dataclass
class ModelSection:
    """Which model (a preset, a JSON model config or hf:DIR), the precision it computes in, how its loss
    is computed, whether its blocks are compiled, and the weights it starts from (``init_from``, train/weights.py).

    hf:DIR loads Llama / Qwen2 / Mistral weights into the built-in model; other architectures run as
    the transformers module (train/hf.py)."""

    SECTION: ClassVar[str] = "model"
    name: str = "tiny"
    precision: str = "auto"  # auto = bf16 on a GPU with bf16 tensor cores, else fp32 (xprep.train.dist.param_dtype_for)
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (xprep.train.dist.configure_device)
    loss_chunk: int | None = None  # tokens per chunk of the output layer + loss; 0 = all at once; None: auto
    compile: bool = False  # torch.compile each block
    init_from: str | None = None  # weights only, from a checkpoint (or hf:DIR), when the run has none of its own

    def __post_init__(self):
        _check_types(self)
        _check_choice(self, "precision", PRECISIONS)
        _check_at_least(self, 0, "loss_chunk")

    @property
    def hf_dir(self) -> str | None:
        """The Hugging Face model directory of ``hf:DIR``; None for the built-in model."""
        return self.name[3:] if self.name.startswith("hf:") else None

    def check(self, vocab_size: int) -> dict | None:
        """Fail early (before any process group) on a model that cannot be built; the built-in model's config
        (None: hf:DIR runs as a transformers module)."""
        if self.hf_dir is not None:
            cfg, _ = hf_builtin_config(self.hf_dir, vocab_size)
            if cfg is not None:  # the weights' names and shapes, from the files' headers (nothing read yet)
                read_hf_weights(self.hf_dir, cfg)
            if cfg is None and self.loss_chunk:
                raise XprepError(f"--loss-chunk {self.loss_chunk} needs the built-in model, and --model "
                                 f"{self.name} runs as the transformers module: leave --loss-chunk out")
            return None if cfg is None else {**cfg.to_dict(), "hf": self.hf_dir}
        return load_model_config(self.name, vocab_size).to_dict()

    def chunk_for(self, tokens: int, vocab_size: int, builtin: bool = True) -> int:
        """The loss chunk of micro-batches of ``tokens`` tokens per rank: --loss-chunk as given, else
        ``xprep.train.loss.auto_loss_chunk`` for the built-in model (a transformers module computes whole logits)."""
        if self.loss_chunk is not None:
            return self.loss_chunk
        return auto_loss_chunk(tokens, vocab_size) if builtin else 0

    def build(self, vocab_size: int, seed: int) -> tuple[nn.Module, dict]:
        """The model, initialized from ``seed`` (or loaded from hf:DIR) on the CPU, and its config as a dict."""
        model, config, initial = self.build_meta(vocab_size, seed)
        if initial is not None:
            materialize(model, torch.device("cpu"), initial)
        return model, config

    def build_meta(self, vocab_size: int, seed: int) -> tuple[nn.Module, dict, Callable[[str], torch.Tensor] | None]:
        """The built-in model on the meta device, its config as a dict, and each parameter's initial value by
        name (from ``seed``, or hf:DIR's weights) for ``xprep.train.dist.materialize``. An hf:DIR architecture the
        built-in model cannot compute comes back as the loaded transformers module, with None."""
        torch.manual_seed(seed)
        if self.hf_dir is not None:
            cfg, why = hf_builtin_config(self.hf_dir, vocab_size)
            if cfg is None:
                return *build_hf_fallback(self.hf_dir, vocab_size, why), None
            weights = read_hf_weights(self.hf_dir, cfg)
            with torch.device("meta"):
                model = Transformer(cfg)
            return model, {**cfg.to_dict(), "hf": self.hf_dir}, weights.__getitem__
        cfg = load_model_config(self.name, vocab_size)
        with torch.device("meta"):
            model = Transformer(cfg)
        shapes = {name: p.shape for name, p in model.named_parameters()}
        return model, cfg.to_dict(), functools.partial(_initial_value, cfg, shapes, seed)


def _initial_value(cfg: ModelConfig, shapes: dict[str, torch.Size], seed: int, name: str) -> torch.Tensor:
    return initial_value(cfg, name, shapes[name], seed)


@dataclass
class OptimizerSection:
    """AdamW and its learning-rate schedule; gradient clipping; how many bad steps in a row stop the run.

    A bad step (non-finite loss or gradient norm on any rank) applies no update and does not advance the
    schedule (as Megatron-LM skips an iteration); ``max_bad_steps`` in a row stop the run (train/trainer.py).
    ``inject_nonfinite`` is a test hook: ``KIND:RANK:STEP,...`` makes RANK's loss (KIND ``loss``) or its
    reduced gradients (``grad``) non-finite at STEP."""

    SECTION: ClassVar[str] = "optimizer"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"
    decay_fraction: float | None = None  # wsd/wsd-sqrt: share of the steps that decays; None: 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    max_bad_steps: int = 5  # skipped steps in a row (non-finite loss or gradient norm) that stop the run
    inject_nonfinite: str | None = None  # tests only: "loss|grad:RANK:STEP,..." (``nonfinite_at``)

    def __post_init__(self):
        _check_types(self)
        _check_at_least(self, 0, "warmup")
        _check_at_least(self, 1, "max_bad_steps")
        self.nonfinite_at(0)  # a malformed test hook fails here, before any process starts
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise XprepError(f"{_flag(self, name)} {value} must be a finite number ≥ 0")
        if self.min_lr > self.lr:
            raise XprepError(f"--min-lr {self.min_lr} is above --lr {self.lr}: lower it")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise XprepError(f"{_flag(self, name)} {getattr(self, name)} must be in [0, 1)")
        _check_choice(self, "schedule", SCHEDULES)
        if self.decay_fraction is not None:
            if self.schedule not in WSD_SCHEDULES:
                raise XprepError(f"--decay-fraction {self.decay_fraction} applies to --schedule wsd or wsd-sqrt, "
                                 f"not {self.schedule}: leave it out or change the schedule")
            if not 0 < self.decay_fraction <= 1:
                raise XprepError(f"--decay-fraction {self.decay_fraction} must be in (0, 1]: the share of the "
                                 "steps over which the lr decays to --min-lr (e.g. 0.2)")

    def nonfinite_at(self, rank: int) -> dict[str, frozenset[int]]:
        """The steps at which ``rank`` makes its loss, and its gradients, non-finite (``inject_nonfinite``)."""
        steps: dict[str, set[int]] = {kind: set() for kind in NONFINITE_KINDS}
        for entry in self.inject_nonfinite.split(",") if self.inject_nonfinite is not None else ():
            match = re.fullmatch(r"\s*(\w+):(\d+):(\d+)\s*", entry)
            if match is None or match[1] not in NONFINITE_KINDS or int(match[3]) < 1:
                raise XprepError(f"config key 'inject_nonfinite' {self.inject_nonfinite!r}: {entry.strip()!r} is not "
                                 "KIND:RANK:STEP (KIND loss or grad, STEP ≥ 1), e.g. grad:1:3 (a test hook)")
            if int(match[2]) == rank:
                steps[match[1]].add(int(match[3]))
        return {kind: frozenset(s) for kind, s in steps.items()}

    def hparams(self) -> dict:
        """What a checkpoint records of the optimizer, to say on resume what this config changes."""
        return {"lr": self.lr, "min_lr": self.min_lr, "weight_decay": self.weight_decay, "beta1": self.beta1,
                "beta2": self.beta2}

    def build(self, model: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, LambdaLR]:
        """AdamW over ``model`` and a LambdaLR over ``total_steps`` steps."""
        optimizer = build_optimizer(model, self.lr, self.weight_decay, (self.beta1, self.beta2))
        min_ratio = self.min_lr / self.lr if self.lr > 0 else 0.0
        schedule = LRSchedule(self.schedule, self.warmup, total_steps, min_ratio, self.decay_fraction)
        return optimizer, build_scheduler(optimizer, schedule)


@dataclass
class ParallelSection:
    """How many processes, their dp × cp layout, how attention spans the cp ranks, and how the model is spread
    over them."""

    SECTION: ClassVar[str] = "parallel"
    device: str | None = None  # auto | cpu | cuda; None: $XTRAIN_DEVICE, else auto (xprep.train.dist.resolve_device)
    nproc_per_node: int | None = None  # None: run in this process (or the ranks torchrun started)
    dp: int | None = None  # None: processes / cp
    cp: int = 1
    cp_mode: str = DEFAULT_CP_MODE  # how attention reaches the other CP ranks (xprep.train.cp.CP_MODES)
    ulysses: int | None = None  # hybrid: the head-parallel factor, --cp = ulysses × ring size
    fsdp: bool | None = None  # None: on when there is more than one process
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    reduce_every_micro_batch: bool = True  # FSDP2: reduce-scatter after every micro-batch (False: once per step)
    dist_timeout: float | None = None  # seconds a collective waits for a peer; None: $XTRAIN_DIST_TIMEOUT, else 600

    def __post_init__(self):
        _check_types(self)
        _check_at_least(self, 1, "nproc_per_node", "dp", "cp", "ulysses")
        if self.device is not None:
            _check_choice(self, "device", DEVICES)
        _check_choice(self, "cp_mode", CP_MODES)
        ulysses_degree(self.cp_mode, self.cp, self.ulysses)  # e.g. hybrid without --ulysses: before any process
        self.collective_timeout()  # a bad value (or $XTRAIN_DIST_TIMEOUT) fails here, before any process starts

    def collective_timeout(self) -> timedelta:
        """What ``dist_timeout`` resolves to here (``xprep.train.dist.collective_timeout``)."""
        return collective_timeout(self.dist_timeout)

    def build(self, world: int | None = None) -> ParallelDims:
        """This process's layout (from torchrun's environment), or that of ``world`` processes to launch on this
        machine."""
        if world is None:
            return ParallelDims.from_env(self.dp, self.cp, self.fsdp, self.device, self.cp_mode, self.ulysses)
        return ParallelDims.for_world(world, self.dp, self.cp, self.fsdp, device=self.device, cp_mode=self.cp_mode,
                                      ulysses=self.ulysses)


@dataclass
class CheckpointSection:
    """When checkpoints are written (or none is: ``no_save``), how many are kept, which one a run resumes from;
    whether the model also goes out as a Hugging Face directory (train/weights.py)."""

    SECTION: ClassVar[str] = "checkpoint"
    save_every: int = 0  # 0 = only at the end
    save_every_minutes: float = 0.0  # also when this much time passed since the last save; 0 = off
    keep: int | str = 2  # newest checkpoints kept, or "all"
    resume: str = "auto"  # auto | never | PATH of a checkpoint
    async_save: bool = False
    no_save: bool = False  # write no checkpoint, not even the last (resuming from one still works)
    save_hf: bool = False  # a Hugging Face model directory (train/weights.py) after the last step
    save_hf_every: int = 0  # and every N steps; 0 = at the end only
    checkpoint_timeout: float | None = None  # seconds ranks wait for each other while checkpointing; None:
    # $XTRAIN_CKPT_TIMEOUT, else 4 h (xprep.train.checkpoint.checkpoint_timeout)

    def __post_init__(self):
        _check_types(self)
        checkpoint_timeout(self.checkpoint_timeout)  # a bad value (or $XTRAIN_CKPT_TIMEOUT) fails here
        if isinstance(self.keep, str) and self.keep != "all":  # from the command line (always a string) or a file
            try:
                self.keep = int(self.keep)
            except ValueError:
                raise XprepError(f"--keep {self.keep!r} is neither a number of checkpoints nor 'all'") from None
        if self.keep != "all":
            _check_at_least(self, 1, "keep")
        _check_at_least(self, 0, "save_every", "save_hf_every")
        if not (self.save_every_minutes >= 0 and math.isfinite(self.save_every_minutes)):
            raise XprepError(f"--save-every-minutes {self.save_every_minutes} must be a number of minutes ≥ 0 "
                             "(0: off)")
        if self.save_hf_every and not self.save_hf:
            raise XprepError(f"--save-hf-every {self.save_hf_every} applies to --save-hf: add --save-hf, or leave "
                             "--save-hf-every out")

    def build(self, run_dir: Path, dims: ParallelDims) -> CheckpointManager:
        return CheckpointManager(run_dir, dims, None if self.keep == "all" else self.keep, self.async_save,
                                 self.no_save, checkpoint_timeout(self.checkpoint_timeout))


@dataclass
class EvalSection:
    """Validation on the pack's validation entry (``xprep pack --split``): how often, on how many bins."""

    SECTION: ClassVar[str] = "eval"
    every: int | None = None  # steps; None or 0: only after the last step
    bins: int | str | None = None  # N bins evenly spaced over the entry, or "all"; None: DEFAULT_EVAL_BINS (or all)
    sets: list | None = None  # --eval NAME=PACKED_OR_ENTRY ...: more sets, evaluated with the validation entry
    test: str | None = None  # --test NAME=PACKED_OR_ENTRY: evaluated once after the last step (else the pack's)

    def __post_init__(self):
        _check_types(self)
        _check_at_least(self, 0, "every")
        if any(not isinstance(t, str) for t in self.sets or ()):
            raise XprepError(f"config key 'eval': {self.sets!r} is not a list of NAME=PACKED_OR_ENTRY strings")
        names = [parse_named_set(t, _flag(self, "sets"))[0] for t in self.sets or ()]  # malformed: refused here
        if self.test is not None:
            parse_named_set(self.test, _flag(self, "test"))
        twice = sorted({n for n in names if names.count(n) > 1} | ({DEFAULT_SET} & set(names)))
        if twice:
            raise XprepError(f"{_flag(self, 'sets')} {twice[0]}=...: the name {twice[0]!r} is given twice, or is "
                             f"the pack's own validation entry's ({DEFAULT_SET!r}); give each set its own name")
        if isinstance(self.bins, str):  # from the command line (always a string) or a config file
            if self.bins != "all":
                try:
                    self.bins = int(self.bins)
                except ValueError:
                    raise XprepError(f"--eval-bins {self.bins!r} is neither a number of bins nor 'all'") from None
        if self.bins != "all":
            _check_at_least(self, 1, "bins")

    def build(self, data: DataSection, train: PackedDataset, dims: ParallelDims, micro_batch_size: int,
              verify_data: bool | None = None, entry: Path | None = None) -> Validation | None:
        """The validation this rank runs; None when the pack has none (asking for one is then an error).

        ``entry``: the training entry when it is not the cache's current one (a resume pinned to the entry
        its checkpoint names): the validation entry recorded for it, not the current one's.
        """
        path = validation_entry(data.packed, entry)
        if path is None:
            asked = [f"{_flag(self, n)} {getattr(self, n)}" for n in ("every", "bins") if getattr(self, n) is not None]
            if asked and not self.sets:  # (with --eval sets, they apply to those)
                raise XprepError(f"{' and '.join(asked)}: {data.packed} has no validation entry (no \"validation\" "
                                 f"in {Path(data.packed) / 'manifest.json'}); hold documents out with `xprep pack "
                                 f"... --split 99,1` and give the pack cache directory, or leave the option out")
            return None
        verify = data.verify_data if verify_data is None else verify_data
        dataset = open_validation(path, train, dims.cp, verify)
        if isinstance(self.bins, int) and self.bins > len(dataset):
            raise XprepError(f"{_flag(self, 'bins')} {self.bins}: the validation entry {path} has only "
                             f"{len(dataset):,} bins; lower it, or give 'all'")
        n_bins = self._bins(dataset)
        if n_bins == 0:
            if self.every is None and self.bins is None:  # an empty held-out part (--allow-empty): nothing asked
                print(f"note: validation entry {path} has no bins: training without evaluation", file=sys.stderr)
                return None
            raise XprepError(f"validation entry {path}: has no bins; re-run `xprep pack ... --split` with a larger "
                             "validation share")
        return self._validation(dataset, dims, micro_batch_size, n_bins, DEFAULT_SET)

    def _bins(self, dataset: PackedDataset) -> int:
        """How many of a set's bins are evaluated: ``--eval-bins`` (at most all of them), or all."""
        return len(dataset) if self.bins == "all" else min(self.bins or DEFAULT_EVAL_BINS, len(dataset))

    def _validation(self, dataset: PackedDataset, dims: ParallelDims, micro_batch_size: int, n_bins: int,
                    name: str) -> Validation:
        channels = Channels.of(dataset.category_names, dataset.source_names)
        rounds = eval_rounds(spaced_bins(len(dataset), n_bins), dims.dp_rank, dims.dp, micro_batch_size)
        return Validation(dataset, channels, rounds, n_bins, self.every, name)

    def _named(self, text: str, option: str, train: PackedDataset, dims: ParallelDims, micro_batch_size: int,
               verify: bool) -> Validation:
        name, path = parse_named_set(text, _flag(self, option))
        dataset = open_named_set(name, path, _flag(self, option), train, dims.cp, verify)
        n_bins = self._bins(dataset)
        if n_bins == 0:
            raise XprepError(f"{_flag(self, option)} {text}: its pack has no bins; give a pack with bins")
        return self._validation(dataset, dims, micro_batch_size, n_bins, name)

    def build_sets(self, data: DataSection, train: PackedDataset, dims: ParallelDims, micro_batch_size: int,
                   verify_data: bool | None = None) -> list[Validation]:
        """The named sets of ``--eval``, in the order given (each checked against the training pack)."""
        verify = data.verify_data if verify_data is None else verify_data
        return [self._named(t, "sets", train, dims, micro_batch_size, verify) for t in self.sets or ()]

    def build_test(self, data: DataSection, train: PackedDataset, dims: ParallelDims, micro_batch_size: int,
                   verify_data: bool | None = None, entry: Path | None = None) -> Validation | None:
        """The set evaluated once after the last step: ``--test``'s, else the pack's --split test entry (named
        ``test``; of ``entry`` when the run is pinned to it), else None."""
        verify = data.verify_data if verify_data is None else verify_data
        if self.test is not None:
            return self._named(self.test, "test", train, dims, micro_batch_size, verify)
        path = validation_entry(data.packed, entry, TEST_KEY)
        if path is None:
            return None
        dataset = open_validation(path, train, dims.cp, verify)
        n_bins = self._bins(dataset)
        return self._validation(dataset, dims, micro_batch_size, n_bins, DEFAULT_TEST) if n_bins else None


SECTIONS = {"data": DataSection, "model": ModelSection, "optimizer": OptimizerSection, "parallel": ParallelSection,
            "checkpoint": CheckpointSection, "eval": EvalSection}


@dataclass
class TrainConfig:
    """One training run: its sections and its own fields. ``steps`` and ``epochs`` are exclusive (neither: one
    epoch). ``from_dict`` builds one from the nested or the flat form."""

    SECTION: ClassVar[None] = None  # its own fields are at the top of the nested form
    data: DataSection
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    steps: int | None = None
    epochs: float | None = None
    seed: int = 0  # model init and random sampler
    output: str | None = None  # None: runs/<name of the pack directory>
    log_every: int = 10
    log: str | None = None  # --log tensorboard,wandb: metrics backends besides metrics.jsonl and the console
    peak_tflops: float | None = None  # one GPU's peak that MFU is measured against; None: by the GPU's name

    def __post_init__(self):
        _check_types(self, RUN_FIELDS)
        if self.steps is not None and self.epochs is not None:
            raise XprepError(f"--steps {self.steps} and --epochs {self.epochs} both given: choose one")
        _check_at_least(self, 1, "steps", "log_every")
        parse_backends(self.log)
        check_peak_tflops(self.peak_tflops)
        _check_at_least(self, 0, "seed")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise XprepError(f"--epochs {self.epochs} must be a number > 0")

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> TrainConfig:
        """A config from keys in the nested form, the flat form (one key per flag) or both; ``source`` is how
        errors name where the keys came from."""
        nested = nest(values, source)
        if not nested["data"].get("packed"):
            raise XprepError("no pack given: pass PACKED or set `packed` in --config")
        sections = {name: cls_(**nested.pop(name)) for name, cls_ in SECTIONS.items()}
        return cls(**sections, **nested)

    @property
    def run_dir(self) -> Path:
        return Path(self.output) if self.output else Path("runs") / Path(self.data.packed).resolve().name

    def to_dict(self) -> dict:
        """The nested form (config.json)."""
        return asdict(self)


RUN_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name not in SECTIONS)
# (section, field) whose flat key is not the field's name
_FLAT_NAMES = {("model", "name"): "model", ("eval", "every"): "eval_every", ("eval", "bins"): "eval_bins",
               ("eval", "sets"): "eval"}
FLAT_KEYS: dict[str, tuple[str | None, str]] = {  # flat key (= flag with underscores) → (section or None, field)
    **{name: (None, name) for name in RUN_FIELDS},
    **{_FLAT_NAMES.get((s, f.name), f.name): (s, f.name) for s, cls_ in SECTIONS.items() for f in fields(cls_)},
}
_FLAT_KEY_OF = {place: key for key, place in FLAT_KEYS.items()}


def _default(f) -> object:
    return f.default_factory() if f.default_factory is not MISSING else None if f.default is MISSING else f.default


_DEFAULTS = {  # flat key → the value a config without it takes
    _FLAT_KEY_OF[(cls_.SECTION, f.name)]: _default(f)
    for cls_ in (TrainConfig, *SECTIONS.values()) for f in fields(cls_) if (cls_.SECTION, f.name) in _FLAT_KEY_OF}


# ------------------------------------------------------------------------------------------ the two forms
def nest(values: dict, source: str = "config") -> dict:
    """``values`` (nested, flat or both; dashes or underscores) as ``{field: value, section: {field: value}}``.

    An unknown key, or one set twice (flat and nested), is an error naming ``source``. YAML 1.1 reads
    ``1e-3`` (no dot) as a string: a float field takes it as the number it is meant to be.
    """
    out: dict = {name: {} for name in SECTIONS}
    placed: dict[tuple[str | None, str], str] = {}
    for raw, value in values.items():
        key = str(raw).replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            cls_ = SECTIONS[key]
            known = [f.name for f in fields(cls_)]
            for raw_field, v in value.items():
                name = str(raw_field).replace("-", "_")
                if name not in known:
                    _unknown(source, f"{key}.{name}", [f"{key}.{k}" for k in known])
                _place(out, placed, (key, name), f"{key}.{name}", v, source)
        elif key in FLAT_KEYS:
            _place(out, placed, FLAT_KEYS[key], key, value, source)
        elif key in SECTIONS:
            raise XprepError(f"{source}: {key!r} must be an object of {key} keys, e.g. "
                             f"{{{key!r}: {{{fields(SECTIONS[key])[0].name!r}: ...}}}}")
        else:
            _unknown(source, key, [*FLAT_KEYS, *SECTIONS])
    return out


def _place(out: dict, placed: dict, where: tuple[str | None, str], shown: str, value, source: str) -> None:
    if where in placed:
        raise XprepError(f"{source}: {placed[where]!r} and {shown!r} set the same field; keep one")
    placed[where] = shown
    section, name = where
    if isinstance(value, str) and name in _FLOAT_FIELDS:
        try:
            value = float(value)
        except ValueError:
            pass
    (out if section is None else out[section])[name] = value


def _unknown(source: str, key: str, known: list[str]) -> None:
    hint = difflib.get_close_matches(key, known, n=1)
    raise XprepError(f"{source}: unknown key {key!r}"
                     + (f" (did you mean {hint[0]!r}?)" if hint else f"; keys: {', '.join(sorted(known))}"))


def flatten(config: dict) -> dict:
    """A config dict (nested, flat or both) with one key per flag, e.g. to show a run's config.json of any age."""
    out = {}
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update({_FLAT_KEY_OF.get((key, k), k): v for k, v in value.items()})
        else:
            out[key] = value
    return out


_FLOAT_FIELDS = {f.name for cls_ in (TrainConfig, *SECTIONS.values()) for f in fields(cls_) if "float" in str(f.type)}


# ------------------------------------------------------------------------------------------ files
def read_config_file(path: str | Path) -> dict:
    """Read ``--config FILE``: a JSON object, or YAML when PyYAML is installed."""
    path = Path(path)
    if not path.is_file():
        raise XprepError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # optional dependency
        except ImportError:
            raise XprepError(f"--config {path}: YAML needs PyYAML (`pip install pyyaml`), "
                             "or write the config as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise XprepError(f"--config {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise XprepError(f"--config {path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise XprepError(f"--config {path}: must hold an object of config keys, not {type(data).__name__}")
    return data


RUN_CONFIG = "config.json"  # of a run directory: the resolved config it was started (or last resumed) with
NOT_INHERITED = ("output", "resume")  # of a run's config.json: where the run is, and which checkpoint it resumed


def resolve_config(file: str | None, flags: dict, log: Callable[[str], None] | None = None) -> TrainConfig:
    """Defaults < the run directory's config.json < file < ``flags`` (flat keys; those left unset are None and
    do not override). ``log`` is told which run config gave the defaults and what the file and flags change."""
    layers = [nest(read_config_file(file), f"--config {file}") if file else nest({}),
              nest({k: v for k, v in flags.items() if v is not None}, "the command line")]
    run_dir = _run_dir_of(layers)
    saved = read_run_config(run_dir) if run_dir is not None else None
    values = nest({})
    for layer in ([saved] if saved is not None else []) + layers:
        for flag, other in (("steps", "epochs"), ("epochs", "steps")):  # a later run length replaces an earlier
            if flag in layer:
                values.pop(other, None)
        if layer["parallel"].get("cp_mode", HYBRID) != HYBRID and "ulysses" not in layer["parallel"]:
            values["parallel"].pop("ulysses", None)  # hybrid's factor leaves with it (a resume may switch modes)
        _merge(values, layer)
    config = TrainConfig.from_dict(values)
    if saved is not None and log is not None:
        changes = config_changes(saved, config)
        log(f"defaults from the run's config {run_dir / RUN_CONFIG}"
            + (f"; changed from it: {', '.join(changes)}" if changes else " (nothing changed)"))
    return config


def _merge(values: dict, layer: dict) -> None:
    """Set every field of ``layer`` (nested form) in ``values``."""
    for key, value in layer.items():
        if key in SECTIONS:
            values[key].update(value)
        else:
            values[key] = value


def _run_dir_of(layers: list[dict]) -> Path | None:
    """The run directory the layers (nested) name: the last --output given, else runs/<name of the pack>."""
    output = packed = None
    for layer in layers:
        output = layer.get("output", output)
        packed = layer["data"].get("packed", packed)
    if output:
        return Path(output)
    return Path("runs") / Path(packed).resolve().name if packed else None


def read_run_config(run_dir: Path) -> dict | None:
    """A run directory's config.json in the nested form, less ``NOT_INHERITED``; None when it has none."""
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise XprepError(f"{path}: unreadable as the run's config ({e}); fix it, or delete it to give every "
                         "option again") from None
    if not isinstance(data, dict):
        raise XprepError(f"{path}: not a config (a JSON object); delete it to give every option again")
    saved = nest(data, str(path))
    for key in NOT_INHERITED:
        section, name = FLAT_KEYS[key]
        (saved if section is None else saved[section]).pop(name, None)
    return saved


def config_changes(saved: dict, config: TrainConfig) -> list[str]:
    """"--flag old → new" for every field of ``config`` that differs from the run's ``saved`` config (nested)."""
    now = flatten(config.to_dict())
    before = flatten(saved)
    out = []
    for key, value in now.items():
        if key in NOT_INHERITED or before.get(key, _DEFAULTS.get(key)) == value:
            continue
        flag = "PACKED" if key == "packed" else "--" + key.replace("_", "-")
        out.append(f"{flag} {_shown(before.get(key, _DEFAULTS.get(key)))} → {_shown(value)}")
    return out


def _shown(value) -> str:
    return "unset" if value is None else ("on" if value else "off") if isinstance(value, bool) else str(value)


def validate_against_schema(config: dict) -> None:
    """Check a resolved config (nested) against schemas/train.schema.json (installed with the package: a missing
    schema is a broken installation, never a silent skip of the check)."""
    if not SCHEMA.is_file():
        raise XprepError(f"{SCHEMA}: the config schema is missing from this installation; reinstall xprep")
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.path) or "(top level)"
        raise XprepError(f"config {where}: {e.message} (schemas/train.schema.json)")


# ------------------------------------------------------------------------------------------ checks
def _flag(obj, name: str) -> str:
    return "--" + _FLAT_KEY_OF[(obj.SECTION, name)].replace("_", "-")


def _check_at_least(obj, low: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            raise XprepError(f"{_flag(obj, name)} {value} must be ≥ {low}")


def _check_choice(obj, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise XprepError(f"{_flag(obj, name)} {value!r} is not one of {', '.join(choices)}")


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "dict[str, float]": (dict,),
          "list": (list,)}


def _check_types(obj, names: tuple[str, ...] | None = None) -> None:
    """Config files are untyped: name the key (the flat one, as the flag) whose value has the wrong type."""
    for f in fields(obj):
        if names is not None and f.name not in names:
            continue
        value, key = getattr(obj, f.name), _FLAT_KEY_OF[(obj.SECTION, f.name)]
        kinds = [k.strip() for k in str(f.type).split("|")]
        if value is None:
            if "None" in kinds:
                continue
            raise XprepError(f"config key {key!r} must be set")
        allowed = tuple(t for k in kinds if k in _TYPES for t in _TYPES[k])
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            want = " or ".join(k for k in kinds if k != "None")
            raise XprepError(f"config key {key!r}: {value!r} is not a {want}")
