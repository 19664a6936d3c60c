"""Model FLOPs of a training step, the GPU's peak, and MFU = achieved FLOPs/s per GPU / peak.

Accounting as in PaLM (appendix B; torchtitan and Megatron-LM count the same 6N), for the built-in model:

- dense: 6 FLOPs per matmul weight per token (2 forward, 4 backward). The matmul weights are every
  ``nn.Linear`` of the blocks plus the output head (dim × vocab, tied or not); the embedding lookup,
  norms and biases do no matmul and are left out.
- attention: QKᵀ and AV cost 2·head_dim FLOPs each per (query, key) pair and query head, so
  4·n_heads·head_dim forward and 12·n_layers·n_heads·head_dim for training, per pair.

The pairs are what the document-masked causal kernel must compute: a document (a pack item) of d
tokens has d(d+1)/2 of them, so a step's count is Σ d(d+1)/2 over its real items (``bin_attention_pairs``).
PaLM's 6N + 12·L·H·Q·T counts every token against all T positions of its row instead, which
overstates the work of a causal packed row two-fold and more (the padding document and the
zigzag padding of context parallelism are work the model does not need: they lower MFU, as they
should). MFU counts model FLOPs only: activation checkpointing's recomputation is not in it.

The peak is a dense (no 2:4 sparsity) bf16 tensor-core figure from the vendors' datasheets, found
from ``torch.cuda.get_device_name``; ``--peak-tflops`` overrides it (other precisions, other GPUs).
With neither (a CPU, an unknown GPU) MFU is None: never a guess.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch

from prep.errors import XprepError
from train.model import ModelConfig

# Dense bf16 tensor TFLOPS per GPU (datasheet figures with sparsity halved; GeForce cards at FP32
# accumulate). Matched as case-insensitive whole words of the device name ("A100" is not "RTX A1000"),
# first match wins: the more specific names come first ("H100 NVL" before "H100").
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM5 (HBM3), the H100 that reports no form factor
    ("H800 PCIe", 756.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),  # SXM4 and PCIe, 40 and 80 GB
    ("A800", 312.0),
    ("A10G", 70.0),  # AWS's variant of the A10: half its tensor rate
    ("A10", 125.0),
    ("A30", 165.0),
    ("A40", 149.7),
    ("RTX A6000", 154.8),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 6000 Ada", 364.2),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
)


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of a model per token (dense) and per attended (query, key) pair."""

    matmul_weights: int  # weights each token is multiplied by, output head included
    attention_per_pair: int  # 12 · n_layers · n_heads · head_dim

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelFlops:
        kv = cfg.n_kv_heads * cfg.head_dim
        per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim  # wq wo, wk wv, w1 w2 w3
        return cls(cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size, 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim)

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


def causal_pairs(lengths: Iterable[int] | np.ndarray) -> int:
    """(query, key) pairs of causal attention within each document: Σ d(d+1)/2."""
    d = np.asarray(lengths, dtype=np.int64)
    return int((d * (d + 1) // 2).sum())


def bin_attention_pairs(dataset, bins: list[int]) -> int:
    """The attended pairs of these bins of a ``PackedDataset``: its real items only (every item is a document
    to attention, positions restarting at 0; the padding document is not counted)."""
    return sum(causal_pairs(dataset.bins.items(b)[3]) for b in bins)


# ----------------------------------------------------------------------------------------- peak and MFU
def table_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (as ``torch.cuda.get_device_name`` says), or None."""
    for key, tflops in PEAK_TFLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", device_name, re.IGNORECASE):
            return tflops
    return None


def check_peak_tflops(value: float | None) -> None:
    """``--peak-tflops`` is a finite number > 0 (or left out)."""
    if value is not None and (isinstance(value, bool) or not (value > 0 and math.isfinite(value))):
        raise XprepError(f"--peak-tflops {value} must be a number > 0: the peak dense TFLOPS of one GPU "
                         "(989 for an H100 SXM in bf16), or leave it out to look the GPU up")


def resolve_peak_tflops(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """The per-GPU peak MFU is measured against, and a line saying which (for the start of a run).

    ``override`` (``--peak-tflops``) wins; else the table, for a CUDA device it knows; else None.
    """
    if override is not None:
        return float(override), f"MFU against --peak-tflops {override:g} per GPU"
    if device.type != "cuda":
        return None, (f"MFU not reported: no peak FLOPS known for {device.type}; "
                      "give --peak-tflops to measure against one")
    name = torch.cuda.get_device_name(device)
    peak = table_peak_tflops(name)
    if peak is None:
        return None, f"MFU not reported: {name} is not in the table of peak FLOPS; give --peak-tflops"
    return peak, f"MFU against {peak:g} TFLOPS per GPU (the bf16 dense peak of {name}; --peak-tflops to change)"


def mfu(flops: float | None, seconds: float, world_size: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization: the step's FLOPs (all ranks) / seconds / GPUs / peak FLOPs/s of one GPU."""
    if flops is None or peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / world_size / (peak_tflops * 1e12)


@dataclass(frozen=True)
class Throughput:
    """What the trainer needs to turn a step's counts and time into achieved TFLOPS per GPU and MFU."""

    flops: ModelFlops | None
    peak_tflops: float | None
    world_size: int = 1

    def measure(self, tokens: int, pairs: int, seconds: float) -> tuple[float | None, float | None]:
        """(model TFLOPS achieved per GPU, MFU); None where the model's FLOPs or the peak are unknown."""
        if self.flops is None or seconds <= 0:
            return None, None
        flops = self.flops.step(tokens, pairs)
        return flops / seconds / self.world_size / 1e12, mfu(flops, seconds, self.world_size, self.peak_tflops)
