"""Token-normalized cross-entropy and channel loss (per category, per source) over a whole optimizer step.

The loss of a step is Σ CE(target tokens) / N where N counts the target tokens of *every*
micro-batch on *every* rank, known before the forward. Each micro-batch backpropagates
``sum_ce / N``; the data-parallel reduction then *sums* gradients. The gradient is thus the same
for any split of the batch into ranks and micro-batches (a per-micro-batch mean would weight a
token by the size of the micro-batch it landed in). With loss weights (train/loss_weights.py) it is
Σ w·CE / Σ w, Σ w counted and reduced the same way; ``LossSums.weighted`` then holds both sums.

Channel loss keeps the same sums per id of a per-token id stream of the batch, aligned with the
labels: ``category_ids`` (category 0, "uncategorized", left out) and ``source_ids`` (the blend
source a token came from; a batch without it is one source). The channels are laid end to end in
one id space (``Channels``), so one vector holds every sum and one all-reduce adds them over ranks.
Ids without targets are left out.

``chunked_token_ce`` computes the output layer and the cross-entropy a chunk of tokens at a time,
recomputing each chunk's logits in the backward instead of keeping them: the per-token CE (and so
the channel sums) is the same as from whole logits, but no (T, V) logits tensor ever exists.
``auto_loss_chunk`` is the chunk ``--loss-chunk`` defaults to: none while a micro-batch's fp32 logits
take at most 1 GiB, else chunks whose logits take at most 256 MiB. Whole logits cost about three times
their size at the peak (the logits, their log-softmax, its gradient): a 128k vocabulary at 8,192 tokens
is 4 GiB of logits, and a tiny model took 6.7 GiB on a CPU where chunks of 1,024 tokens took 1.6 GiB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100
AUTO_CHUNK_ABOVE = 2**30  # bytes of a micro-batch's fp32 logits (tokens × vocab × 4) above which the loss is chunked
CHUNK_LOGITS = 2**28  # bytes of fp32 logits one chunk may take


def logits_bytes(tokens: int, vocab_size: int) -> int:
    """Bytes of the fp32 logits of ``tokens`` tokens over a ``vocab_size`` vocabulary."""
    return tokens * vocab_size * 4


def auto_loss_chunk(tokens: int, vocab_size: int) -> int:
    """The loss chunk for micro-batches of ``tokens`` tokens (per rank) when --loss-chunk is not given: 0 (whole
    logits) up to ``AUTO_CHUNK_ABOVE`` bytes of logits, else the largest power of two of tokens whose logits fit
    in ``CHUNK_LOGITS`` bytes (512 for a 128k vocabulary, 2,048 for 32k)."""
    if logits_bytes(tokens, vocab_size) <= AUTO_CHUNK_ABOVE:
        return 0
    fit = max(1, CHUNK_LOGITS // logits_bytes(1, vocab_size))
    return 1 << (fit.bit_length() - 1)


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32, 0 where the label is IGNORE. (1, T, V), (1, T) -> (T,)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="none")


def chunked_token_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 0
                     ) -> torch.Tensor:
    """Per-token CE of the logits ``hidden @ weight.T``, ``chunk`` tokens at a time. (T, d), (V, d), (T,) -> (T,) fp32.

    No (T, V) logits ever exist: the forward keeps each token's log-sum-exp only, and the backward
    recomputes one chunk's logits at a time (one more output-layer matmul) to form its gradient.
    ``chunk`` 0, or ≥ T, is the plain computation.
    """
    if chunk <= 0 or chunk >= hidden.shape[0]:
        return token_ce(F.linear(hidden, weight), labels)
    return _ChunkedHeadCE.apply(hidden, weight, labels, chunk)


class _ChunkedHeadCE(torch.autograd.Function):
    """Output layer + per-token CE in chunks of tokens; the gradient of a chunk's logits is softmax − one-hot.

    The matmuls run in the dtype the forward's did (bf16 under autocast or FSDP2's mixed precision);
    softmax, log-sum-exp and the CE are fp32, and the output weight's gradient is summed over the
    chunks in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        ce = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(ce)
        for i in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[i : i + chunk], weight)  # (n, V), autocast's dtype when it is on
            ctx.dtype = logits.dtype
            logits = logits.float()
            y = labels[i : i + chunk]
            lse[i : i + chunk] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, y.clamp(min=0)[:, None])[:, 0]
            ce[i : i + chunk] = torch.where(y != IGNORE, lse[i : i + chunk] - target, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, labels, lse = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] \
            else None
        for i in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[i : i + ctx.chunk].to(ctx.dtype), labels[i : i + ctx.chunk]
            g = torch.where(y != IGNORE, grad_ce[i : i + ctx.chunk].float(), 0.0)[:, None]  # (n, 1)
            d = F.linear(h, w).float().sub_(lse[i : i + ctx.chunk, None]).exp_().mul_(g)  # softmax · g
            d.scatter_add_(1, y.clamp(min=0)[:, None], -g)  # − one-hot · g: the gradient of the logits (n, V)
            d = d.to(ctx.dtype)
            if grad_h is not None:
                grad_h[i : i + ctx.chunk] = d @ w
            if grad_w is not None:
                grad_w += d.t() @ h
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


@dataclass
class LossSums:
    """Sums of one step on this rank: CE total and target count, and both per channel id (all channels'
    ids end to end, as ``Channels`` lays them out); in a weighted run also Σ w·CE and Σ w
    (train/loss_weights.py)."""

    ce: torch.Tensor  # () float64
    targets: torch.Tensor  # () float64, Σ target tokens
    channel_ce: torch.Tensor  # (K,) float64
    channel_targets: torch.Tensor  # (K,) float64
    weighted: torch.Tensor | None = None  # (2,) float64: Σ w·CE, Σ w over the targets; None: an unweighted run

    @classmethod
    def zeros(cls, num_ids: int, device: torch.device | str = "cpu", weighted: bool = False) -> LossSums:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)
        return cls(z(()), z(()), z(num_ids), z(num_ids), z(2) if weighted else None)

    def add_weighted(self, ce: torch.Tensor, weights: torch.Tensor) -> None:
        """Accumulate a micro-batch's Σ w·CE and Σ w (``weights``: per token, 0 where no target)."""
        w = weights.reshape(-1).double()
        self.weighted += torch.stack([(ce.detach().double() * w).sum(), w.sum()])

    def add(self, ce: torch.Tensor, labels: torch.Tensor, *ids: torch.Tensor) -> None:
        """Accumulate a micro-batch's per-token CE (detached); ``ids``: per channel, each token's id in the
        joint id space (``Channels.ids``; a lone tensor of category ids is clamped to the table)."""
        ce = ce.detach().double()
        target = (labels.reshape(-1) != IGNORE).double()
        self.ce += ce.sum()
        self.targets += target.sum()
        for channel_ids in ids:
            at = channel_ids.reshape(-1).clamp(max=len(self.channel_ce) - 1)
            self.channel_ce.index_add_(0, at, ce)
            self.channel_targets.index_add_(0, at, target)

    def flat(self) -> torch.Tensor:
        """One vector, so that a single all-reduce sums everything over ranks (the weighted sums last)."""
        extra = [] if self.weighted is None else [self.weighted]
        return torch.cat([self.ce.reshape(1), self.targets.reshape(1), self.channel_ce, self.channel_targets, *extra])

    @classmethod
    def from_flat(cls, v: torch.Tensor, weighted: bool = False) -> LossSums:
        v, w = (v[:-2], v[-2:]) if weighted else (v, None)
        c = (len(v) - 2) // 2
        return cls(v[0], v[1], v[2 : 2 + c], v[2 + c :], w)

    @property
    def loss(self) -> float | None:
        """Σ CE / Σ targets; None without targets: a step (or an evaluation) with no target token has no loss,
        and a 0 would pass for the best one."""
        return float(self.ce / self.targets) if float(self.targets) > 0 else None

    @property
    def weighted_loss(self) -> float | None:
        """Σ w·CE / Σ w; None in an unweighted run, or when no target has weight (a step with nothing to learn)."""
        if self.weighted is None or not float(self.weighted[1]) > 0:
            return None
        return float(self.weighted[0] / self.weighted[1])


@dataclass(frozen=True)
class Channel:
    """A per-token id stream of the batch whose loss is also summed per id.

    ``name`` names the metric (``<name>_loss``); ``key`` is the batch key; ``names`` the ids' names;
    ids below ``first`` are not reported (category 0 is "uncategorized").
    """

    name: str
    key: str
    names: tuple[str | None, ...]
    first: int = 0


class Channels:
    """Channels laid end to end in one id space: channel i owns ids ``offsets[i] … offsets[i] + len(names)``."""

    def __init__(self, channels: Sequence[Channel]):
        self.channels = tuple(channels)
        self.offsets = [0]
        for ch in self.channels:
            self.offsets.append(self.offsets[-1] + max(len(ch.names), 1))

    @classmethod
    def of(cls, category_names: Sequence[str | None], source_names: Sequence[str] | None) -> Channels:
        """Categories (0 left out) and sources (one, "all", when the data has no sources)."""
        return cls([Channel("category", "category_ids", tuple(category_names), first=1),
                    Channel("source", "source_ids", tuple(source_names or ("all",)))])

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def zeros(self, device: torch.device | str = "cpu", weighted: bool = False) -> LossSums:
        return LossSums.zeros(self.size, device, weighted)

    def ids(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each channel's ids of a batch, moved into the joint id space; a missing key is id 0 everywhere
        (ids past a channel's table count as its last)."""
        out = []
        for ch, offset in zip(self.channels, self.offsets, strict=False):
            ids = batch.get(ch.key)
            ids = torch.zeros_like(batch["labels"]) if ids is None else ids.clamp(max=max(len(ch.names), 1) - 1)
            out.append(ids + offset)
        return out

    def losses(self, sums: LossSums) -> dict[str, dict[str, float]]:
        """Mean loss per id by name, for each channel by its name (ids without targets left out)."""
        return {ch.name: channel_means(sums.channel_ce[lo:hi], sums.channel_targets[lo:hi], ch.names, ch.first)
                for ch, lo, hi in zip(self.channels, self.offsets, self.offsets[1:], strict=False)}


def channel_means(ce: torch.Tensor, targets: torch.Tensor, names: Sequence[str | None],
                  first: int = 0) -> dict[str, float]:
    """Σ CE / Σ targets of every id from ``first`` on that has targets, by name (its number when unnamed)."""
    out = {}
    counts, totals = targets.tolist(), ce.tolist()
    for i in range(first, len(counts)):
        if counts[i] > 0:
            out[names[i] if i < len(names) and names[i] else str(i)] = totals[i] / counts[i]
    return out


def step_losses(sums: LossSums, category_names: list[str | None]) -> tuple[float | None, dict[str, float]]:
    """Mean loss and the per-category means by name (category 0 and empty ones left out); the categories
    are the first ids of the sums (as ``Channels.of`` lays them out)."""
    n = len(category_names)
    return sums.loss, channel_means(sums.channel_ce[:n], sums.channel_targets[:n], category_names, first=1)
