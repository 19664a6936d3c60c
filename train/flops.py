"""Model FLOPs of a training step, the GPU's peak, and two MFUs = achieved FLOPs/s per GPU / peak.

``mfu``, this project's count, for the built-in model:

- dense: 6 FLOPs per matmul weight per token (2 forward, 4 backward). The matmul weights are every
  ``nn.Linear`` of the blocks plus the output head (dim × vocab, tied or not); the embedding lookup,
  norms and biases do no matmul and are left out.
- attention: QKᵀ and AV cost 2·head_dim FLOPs each per (query, key) pair and query head, so
  4·n_heads·head_dim forward and 12·n_layers·n_heads·head_dim for training, per pair.

The pairs are what the document-masked causal kernel must compute: a document (a pack item) of d
tokens has d(d+1)/2 of them, so a step's count is Σ d(d+1)/2 over its real items (``bin_attention_pairs``).
The padding document and the zigzag padding of context parallelism are work the model does not need:
they lower MFU, as they should.

``mfu_6n``, the convention of PaLM (appendix B) and torchtitan, so that figures compare with theirs:
6·N + 12·L·H·D·T FLOPs per token, N the parameters but the embedding table (norms and biases
included; the output head included, and a table tied to it kept as the head: torchtitan's
``get_nparams_and_active_nparams``, whose older ``get_dense_model_nparams_and_flops`` subtracted a tied
table too), T the sequence length (the pack's bin capacity) whatever the documents: every token is
counted against all T positions, no causal halving, no document masking. On packed rows of short
documents it is well above ``mfu`` (it counts attention work the kernel skips). Both count the real
tokens of the step (those of ``tokens_per_s``), and model FLOPs only: activation checkpointing's
recomputation is in neither.

The peak is a dense (no 2:4 sparsity) tensor-core figure from the vendors' datasheets, found from
``torch.cuda.get_device_name``, of the precision the run computes in: bf16; or for fp32, TF32 where
the GPU has TF32 tensor cores and the run allows them, else the plain fp32 rate. ``--peak-tflops``
overrides it (other GPUs). With neither (a CPU, an unknown GPU, a MIG slice: its name is the whole
GPU's plus "MIG 3g.40gb", and its share of the peak is not in a datasheet) MFU is None: never a guess.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch
from xprep.prep.errors import XprepError
from xprep.train.model import ModelConfig


@dataclass(frozen=True)
class Peak:
    """Dense TFLOPS of one GPU by what its matmuls compute in; None where it has no such unit (pre-Ampere:
    no bf16 or TF32 tensor cores) or no figure is published."""

    bf16: float | None
    tf32: float | None  # fp32 matmuls on TF32 tensor cores (NVIDIA Ampere and later, AMD CDNA3)
    fp32: float | None  # fp32 matmuls without TF32: NVIDIA's CUDA cores, AMD's FP32 matrix cores


# Datasheet figures with sparsity halved (TF32 is half the bf16 rate on every data-center part since the
# A100; GeForce bf16 and TF32 at FP32 accumulate). Matched as case-insensitive whole words of the device
# name ("A100" is not "RTX A1000"), first match wins: the more specific names come first ("H100 NVL"
# before "H100").
PEAK_TFLOPS: tuple[tuple[str, Peak], ...] = (
    ("GB200", Peak(2500.0, 1250.0, 80.0)),
    ("B200", Peak(2250.0, 1125.0, 75.0)),
    ("H200 NVL", Peak(835.0, 417.5, 60.0)),
    ("H200", Peak(989.0, 494.5, 67.0)),
    ("H100 NVL", Peak(835.0, 417.5, 60.0)),
    ("H100 PCIe", Peak(756.0, 378.0, 51.0)),
    ("H100", Peak(989.0, 494.5, 67.0)),  # SXM5 (HBM3), the H100 that reports no form factor
    ("H800 PCIe", Peak(756.0, 378.0, 51.0)),
    ("H800", Peak(989.0, 494.5, 67.0)),
    ("GH200", Peak(989.0, 494.5, 67.0)),
    ("H20", Peak(148.0, 74.0, 44.0)),
    ("A100", Peak(312.0, 156.0, 19.5)),  # SXM4 and PCIe, 40 and 80 GB
    ("A800", Peak(312.0, 156.0, 19.5)),
    ("A10G", Peak(70.0, None, None)),  # AWS's variant of the A10: half its tensor rate; no TF32/FP32 published
    ("A10", Peak(125.0, 62.5, 31.2)),
    ("A30", Peak(165.0, 82.0, 10.3)),
    ("A40", Peak(149.7, 74.8, 37.4)),
    ("RTX A6000", Peak(154.8, 77.4, 38.7)),
    ("L40S", Peak(362.0, 183.0, 91.6)),
    ("L40", Peak(181.0, 90.5, 90.5)),
    ("L4", Peak(121.0, 60.0, 30.3)),
    ("RTX 6000 Ada", Peak(364.2, 182.1, 91.1)),
    ("RTX 4090", Peak(165.2, 82.6, 82.6)),
    ("RTX 3090", Peak(71.0, 35.6, 35.6)),
    ("V100S", Peak(None, None, 16.4)),  # Volta and Turing: fp16 tensor cores only, fp32 at the CUDA-core rate
    ("V100-PCIE", Peak(None, None, 14.0)),
    ("V100", Peak(None, None, 15.7)),  # SXM2
    ("T4", Peak(None, None, 8.1)),
    ("MI325X", Peak(1307.4, 653.7, 163.4)),
    ("MI300X", Peak(1307.4, 653.7, 163.4)),
    ("MI250X", Peak(383.0, None, 95.7)),  # CDNA2: no TF32; fp32 on its FP32 matrix cores
)

PRECISIONS = ("bf16", "fp32")  # what a run computes in (xprep.train.config's --precision, resolved)


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of a model per token (dense) and per attended (query, key) pair, and its parameter
    count N of the 6N convention."""

    matmul_weights: int  # weights each token is multiplied by, output head included
    attention_per_pair: int  # 12 · n_layers · n_heads · head_dim
    non_embedding_params: int | None = None  # N of 6N: all parameters but an untied embedding table

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelFlops:
        kv = cfg.n_kv_heads * cfg.head_dim
        per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim  # wq wo, wk wv, w1 w2 w3
        embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # a tied table is the output head
        return cls(cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size, 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim,
                   cfg.num_params() - embedding)

    @classmethod
    def from_dict(cls, model_config: dict | None) -> ModelFlops | None:
        """From the model config a run records (``Trainer.model_config``); None without one (hf:DIR running as a
        transformers module: its FLOPs are not known, and MFU is then not reported)."""
        if model_config is None:
            return None
        known = {f.name for f in fields(ModelConfig)}
        return cls.of(ModelConfig(**{k: v for k, v in model_config.items() if k in known}))

    @property
    def dense_per_token(self) -> int:
        return 6 * self.matmul_weights

    def step(self, tokens: int, pairs: int) -> float:
        """FLOPs of a step of ``tokens`` real tokens whose documents attend over ``pairs`` (query, key) pairs."""
        return float(self.dense_per_token) * tokens + float(self.attention_per_pair) * pairs

    def per_token(self, seq_len: int) -> float:
        """FLOPs per token of rows that are one causal document of ``seq_len`` tokens: (seq_len+1)/2 pairs each."""
        return self.dense_per_token + self.attention_per_pair * (seq_len + 1) / 2

    def per_token_6n(self, seq_len: int) -> float | None:
        """PaLM's and torchtitan's FLOPs per token at sequence length ``seq_len``: 6·N + 12·L·H·D·T."""
        if self.non_embedding_params is None:
            return None
        return 6.0 * self.non_embedding_params + float(self.attention_per_pair) * seq_len


def causal_pairs(lengths: Iterable[int] | np.ndarray) -> int:
    """(query, key) pairs of causal attention within each document: Σ d(d+1)/2."""
    d = np.asarray(lengths, dtype=np.int64)
    return int((d * (d + 1) // 2).sum())


def bin_attention_pairs(dataset, bins: list[int]) -> int:
    """The attended pairs of these bins of a ``PackedDataset``: its real items only (every item is a document
    to attention, positions restarting at 0; the padding document is not counted)."""
    return sum(causal_pairs(dataset.bins.items(b)[3]) for b in bins)


# ----------------------------------------------------------------------------------------- peak and MFU
def table_peak(device_name: str) -> Peak | None:
    """The table's row of a GPU named ``device_name`` (as ``torch.cuda.get_device_name`` says), or None."""
    for key, peak in PEAK_TFLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", device_name, re.IGNORECASE):
            return peak
    return None


def peak_for(peak: Peak, precision: str = "bf16", tf32: bool = True) -> tuple[float | None, str]:
    """The figure of ``peak`` that matmuls in ``precision`` run at, and which it is ("bf16", "tf32", "fp32"):
    bf16; for fp32, TF32 when ``tf32`` allows it and the GPU has TF32 tensor cores, else plain fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    if precision == "bf16":
        return peak.bf16, "bf16"
    if tf32 and peak.tf32 is not None:
        return peak.tf32, "tf32"
    return peak.fp32, "fp32"


def table_peak_tflops(device_name: str, precision: str = "bf16", tf32: bool = True) -> float | None:
    """The dense peak of a GPU named ``device_name`` in ``precision`` (``peak_for``), or None."""
    peak = table_peak(device_name)
    return None if peak is None else peak_for(peak, precision, tf32)[0]


def is_mig(device: torch.device) -> bool:
    """Whether a CUDA ``device`` is a MIG slice: CUDA names it after the whole GPU plus " MIG <profile>"
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb"), and CUDA_VISIBLE_DEVICES selects it by a "MIG-<uuid>"."""
    if re.search(r"(?<![a-z0-9])MIG(?![a-z0-9])", torch.cuda.get_device_name(device), re.IGNORECASE):
        return True
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    index = torch.cuda.current_device() if device.index is None else device.index
    return index < len(visible) and visible[index].startswith("MIG-")


def check_peak_tflops(value: float | None) -> None:
    """``--peak-tflops`` is a finite number > 0 (or left out)."""
    if value is not None and (isinstance(value, bool) or not (value > 0 and math.isfinite(value))):
        raise XprepError(f"--peak-tflops {value} must be a number > 0: the peak dense TFLOPS of one GPU "
                         "(989 for an H100 SXM in bf16), or leave it out to look the GPU up")


def resolve_peak_tflops(device: torch.device, override: float | None = None, precision: str = "bf16",
                        tf32: bool = True) -> tuple[float | None, str]:
    """The per-GPU peak MFU is measured against, and a line saying which (for the start of a run).

    ``override`` (``--peak-tflops``) wins; else the table's figure for the precision the run computes in
    (``peak_for``: ``tf32`` says whether fp32 matmuls may use TF32), for a CUDA device it knows and that is not
    a MIG slice; else None.
    """
    if override is not None:
        return float(override), f"MFU against --peak-tflops {override:g} per GPU"
    if device.type != "cuda":
        return None, (f"MFU not reported: no peak FLOPS known for {device.type}; "
                      "give --peak-tflops to measure against one")
    name = torch.cuda.get_device_name(device)
    if is_mig(device):
        return None, (f"MFU not reported: {name} is a MIG slice, whose peak (a share of the whole GPU's) no "
                      "datasheet gives; give --peak-tflops to measure against one")
    row = table_peak(name)
    if row is None:
        return None, f"MFU not reported: {name} is not in the table of peak FLOPS; give --peak-tflops"
    peak, kind = peak_for(row, precision, tf32)
    if peak is None:
        return None, f"MFU not reported: the table has no {kind} figure for {name}; give --peak-tflops"
    label, why = {"bf16": ("bf16 dense", ""), "tf32": ("TF32 dense", ": fp32 matmuls run on its tensor cores"),
                  "fp32": ("plain fp32", ": TF32 is off (--no-tf32)" if row.tf32 is not None
                           else ", which has no TF32 tensor cores")}[kind]
    return peak, f"MFU against {peak:g} TFLOPS per GPU (the {label} peak of {name}{why}; --peak-tflops to change)"


def mfu(flops: float | None, seconds: float, world_size: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization: the step's FLOPs (all ranks) / seconds / GPUs / peak FLOPs/s of one GPU."""
    if flops is None or peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / world_size / (peak_tflops * 1e12)


class Rates(NamedTuple):
    """What ``Throughput.measure`` gives of a step; None where unknown."""

    tflops: float | None  # model TFLOPS achieved per GPU (this project's count)
    mfu: float | None  # tflops / peak
    mfu_6n: float | None  # (6·N + 12·L·H·D·T) · tokens / seconds / GPUs / peak: PaLM's and torchtitan's


@dataclass(frozen=True)
class Throughput:
    """What the trainer needs to turn a step's counts and time into achieved TFLOPS per GPU and both MFUs."""

    flops: ModelFlops | None
    peak_tflops: float | None
    world_size: int = 1
    seq_len: int | None = None  # T of the 6N convention: the pack's bin capacity; None: no mfu_6n

    def measure(self, tokens: int, pairs: int, seconds: float) -> Rates:
        """(model TFLOPS achieved per GPU, MFU, MFU in the 6N convention) of a step of ``tokens`` real tokens
        attending over ``pairs`` pairs; None where the model's FLOPs, the peak or the sequence length are unknown."""
        if self.flops is None or seconds <= 0:
            return Rates(None, None, None)
        flops = self.flops.step(tokens, pairs)
        per_token = self.flops.per_token_6n(self.seq_len) if self.seq_len else None
        flops_6n = None if per_token is None else per_token * tokens
        return Rates(flops / seconds / self.world_size / 1e12, mfu(flops, seconds, self.world_size, self.peak_tflops),
                     mfu(flops_6n, seconds, self.world_size, self.peak_tflops))
