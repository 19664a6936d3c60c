"""A Llama-style decoder for packed sequences: RMSNorm, RoPE from position_ids, SwiGLU, GQA.

One file, nanoGPT style: components in dependency order, then the config, then the model.
The model sees one packed row of documents, `(1, T)`, described by `position_ids` (restarting
at 0 per document) and `cu_seqlens` (document boundaries); attention never crosses a document.
No distributed code here: context parallelism arrives as an opaque `cp` object whose
`attention(q, k, v)` replaces the local attention (see train/cp.py).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from xprep.prep.errors import XprepError
from xprep.train.attention import to_device_async, varlen_attention
from xprep.train.loss import chunked_token_ce

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)


class ContextParallel(Protocol):
    """What the model needs from a context-parallel context (xprep.train.cp.CPContext)."""

    size: int

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


# ----------------------------------------------------------------------------- components


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables for the given positions: (T,) -> two (T, head_dim) fp32 tensors.

    Computed from the positions themselves, so there is no maximum length and packed documents
    (positions restarting at 0) get the same rotation they would get alone. Half-split layout
    (`rotate_half`), as in Hugging Face Llama, so its weights map one to one.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )  # (D/2,)
    angles = position_ids.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (T, H, D) by per-token angles cos/sin (T, D); computed in fp32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # (T, H, D)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).type_as(x)


@torch.compiler.disable
def run_attention(attend: AttentionFn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``attend(q, k, v)``, never traced by torch.compile: the kernels read the document boundaries as
    Python ints (a compiled graph would be specialized to, and recompiled for, every batch's layout),
    and context parallelism communicates. A compiled block runs as graphs around this call."""
    return attend(q, k, v)


class Attention(nn.Module):
    """Grouped-query self-attention; the attention kernel itself is passed in per forward."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)  # biased in Qwen2
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: AttentionFn) -> Tensor:
        t = x.shape[0]  # x (T, dim)
        q = self.wq(x).view(t, self.n_heads, self.head_dim)  # (T, H, D)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = run_attention(attend, q, k, v)  # (T, H, D)
        return self.wo(out.reshape(t, -1))  # (T, dim)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm decoder block; the unit FSDP2 wraps."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.qkv_bias)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: AttentionFn) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, attend)
        return x + self.feed_forward(self.ffn_norm(x))


# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    """Shape of the decoder. `ffn_dim=None` derives it Llama-style from dim and `multiple_of`.

    After construction `ffn_dim` is always set, so the config written to a run directory
    rebuilds exactly the same model.
    """

    vocab_size: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    ffn_dim: int | None = None
    multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise XprepError(f"model config: {name}={value!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise XprepError(f"model config: dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise XprepError(f"model config: head dim dim/n_heads={self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise XprepError(
                f"model config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each K/V head between n_heads/n_kv_heads query heads)"
            )
        if self.ffn_dim is None:
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_dim = self.multiple_of * math.ceil(hidden / self.multiple_of)
        if not isinstance(self.ffn_dim, int) or self.ffn_dim < 1:
            raise XprepError(f"model config: ffn_dim={self.ffn_dim!r} must be a positive integer")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise XprepError(f"model config: {name}={value!r} must be a number > 0")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise XprepError(f"model config: {name}={getattr(self, name)!r} must be true or false")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count without building the model (embeddings counted once when tied)."""
        kv = self.n_kv_heads * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim + 2 * self.dim
        per_layer += (self.dim + 2 * kv) if self.qkv_bias else 0
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embeddings + self.dim

    def to_dict(self) -> dict[str, Any]:
        """The fields; those added later are left out at their default, so the model config recorded in
        earlier checkpoints still compares equal on resume (xprep.train.resume.check_same_model)."""
        d = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d


_LATER_FIELDS = {"qkv_bias": False}  # field → default: fields a run directory of an older version lacks


# Every field but vocab_size, which comes from the tokenizer of the data.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, tie_embeddings=False),
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=256, tie_embeddings=True),
    "medium": dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, multiple_of=256, tie_embeddings=True),
    # Llama-3.2-1B shape: 1.24B parameters at vocab 128,256, ~1.0B at 32,000.
    "1b": dict(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
}


def load_model_config(spec: str, vocab_size: int) -> ModelConfig:
    """Build a ModelConfig from a preset name or a JSON file path, for a tokenizer of `vocab_size` ids.

    A JSON file may leave out `vocab_size` (the data's is used) or set a larger one (padded
    embedding table); a smaller one could not embed the data's ids and is refused.
    """
    if spec in PRESETS:
        return ModelConfig(vocab_size=vocab_size, **PRESETS[spec])
    path = Path(spec)
    if not path.suffix == ".json" and not path.exists():
        raise XprepError(
            f"--model {spec!r}: unknown model preset; choose one of {', '.join(PRESETS)}, or give a JSON config file"
        )
    if not path.is_file():
        raise XprepError(f"--model {spec!r}: model config file not found")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise XprepError(f"{path}: cannot read model config as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise XprepError(f"{path}: a model config must be a JSON object of ModelConfig fields")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise XprepError(f"{path}: unknown model config field(s) {unknown}; valid fields: {sorted(known)}")
    raw.setdefault("vocab_size", vocab_size)
    if isinstance(raw["vocab_size"], int) and raw["vocab_size"] < vocab_size:
        raise XprepError(
            f"{path}: vocab_size={raw['vocab_size']} is smaller than the data's vocabulary ({vocab_size}): "
            "raise it or leave it out"
        )
    try:
        return ModelConfig(**raw)
    except XprepError as e:
        raise XprepError(f"{path}: {e}") from e


def initial_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int) -> Tensor:
    """The initial value of the model's parameter ``name`` (fp32, CPU): N(0, init_std), residual projections
    scaled by 1/sqrt(2·n_layers), norms 1, biases 0.

    Drawn from a CPU generator seeded by (seed, name) alone, so it does not depend on device, build
    order, which parameters exist, or how the model is sharded (xprep.train.dist.materialize cuts each
    rank's shard out of it).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    scale = 1 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, cfg.init_std * scale, generator=gen)


# ----------------------------------------------------------------------------- model


class Transformer(nn.Module):
    """Decoder-only LM over one packed row; `.layers` are the blocks FSDP2 shards one by one."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init of plain (unsharded, materialized) parameters: each is its ``initial_value``."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.cfg, name, p.shape, seed))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cu_seqlens: Tensor,
        cp: ContextParallel | None = None,
        max_seqlen: int | None = None,
        labels: Tensor | None = None,
        loss_chunk: int = 0,
    ) -> Tensor:
        """Logits (1, T, V) in fp32 for input_ids/position_ids (1, T) and int32 cu_seqlens [n_docs+1];
        with `labels` (1, T), the per-token cross-entropy (T,) in fp32 instead (0 where IGNORE).

        With `cp` of size > 1 the row holds this rank's zigzag shard (xprep.train.cp.shard_batch):
        position_ids are global positions and attention runs through `cp.attention`.
        `max_seqlen` is only a hint for the flash kernel; computed from cu_seqlens when left out.
        `loss_chunk` > 0 computes the output layer and the loss `loss_chunk` tokens at a time, never
        holding the whole (T, V) logits (xprep.train.loss.chunked_token_ce).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be one packed row (1, T), got {tuple(input_ids.shape)}")
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} != input_ids {tuple(input_ids.shape)}")
        cos, sin = rope_cos_sin(position_ids[0], self.cfg.head_dim, self.cfg.rope_theta)  # (T, D)
        attend = self._attention_fn(cu_seqlens, cp, max_seqlen, input_ids.device)
        h = self.tok_embeddings(input_ids[0])  # (T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin, attend)
        h = self.norm(h)[None]  # (1, T, dim): logits come out (1, T, V) without a view (FSDP warns on views)
        if labels is not None:  # the root owns the output weight (tied: the embedding's)
            weight = self.tok_embeddings.weight if self.output is None else self.output.weight
            return chunked_token_ce(h[0], weight, labels[0], loss_chunk)  # (T,)
        # Untied: call the module (FSDP hooks see it); tied: the root owns the embedding weight.
        logits = F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)
        return logits.float()  # (1, T, V)

    @staticmethod
    def _attention_fn(cu_seqlens: Tensor, cp: ContextParallel | None, max_seqlen: int | None,
                      device: torch.device) -> AttentionFn:
        """The attention kernel every layer of this forward uses (decided once, not per layer).

        The document bounds are read to Python ints, and cu_seqlens moved to the device, once
        per forward: the trainer keeps cu_seqlens on the CPU, so neither waits for the device.
        """
        if cp is not None and cp.size > 1:
            return cp.attention
        bounds = cu_seqlens.tolist()  # one host read per forward (none when cu_seqlens is on the CPU)
        if max_seqlen is None:
            max_seqlen = max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)), default=0)
        cu = cu_seqlens.to(torch.int32)
        cu = to_device_async(cu, device) if cu.device.type == "cpu" else cu.to(device)  # pinned: no wait
        return lambda q, k, v: varlen_attention(q, k, v, cu, max_seqlen, bounds=bounds)
