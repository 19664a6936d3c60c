"""Token-normalized cross-entropy and channel (per-category) loss over a whole optimizer step.

The loss of a step is Σ CE(target tokens) / N where N counts the target tokens of *every*
micro-batch on *every* rank, known before the forward. Each micro-batch backpropagates
``sum_ce / N``; the data-parallel reduction then *sums* gradients. The gradient is thus the same
for any split of the batch into ranks and micro-batches (a per-micro-batch mean would weight a
token by the size of the micro-batch it landed in).

Channel loss keeps the same sums per category of the target token; category 0
("uncategorized") and categories without targets in the step are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32, 0 where the label is IGNORE. (1, T, V), (1, T) -> (T,)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="none")


@dataclass
class LossSums:
    """Sums of one step on this rank: CE total, and per category CE and target counts."""

    ce: torch.Tensor  # () float64
    targets: torch.Tensor  # () float64, Σ target tokens
    cat_ce: torch.Tensor  # (C,) float64
    cat_targets: torch.Tensor  # (C,) float64

    @classmethod
    def zeros(cls, num_categories: int, device: torch.device | str = "cpu") -> LossSums:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)
        return cls(z(()), z(()), z(num_categories), z(num_categories))

    def add(self, ce: torch.Tensor, labels: torch.Tensor, category_ids: torch.Tensor) -> None:
        """Accumulate a micro-batch's per-token CE (detached) by target category."""
        ce = ce.detach().double()
        target = labels.reshape(-1) != IGNORE
        cats = category_ids.reshape(-1).clamp(max=len(self.cat_ce) - 1)
        self.ce += ce.sum()
        self.targets += target.sum()
        self.cat_ce.index_add_(0, cats, ce)
        self.cat_targets.index_add_(0, cats, target.double())

    def flat(self) -> torch.Tensor:
        """One vector, so that a single all-reduce sums everything over ranks."""
        return torch.cat([self.ce.reshape(1), self.targets.reshape(1), self.cat_ce, self.cat_targets])

    @classmethod
    def from_flat(cls, v: torch.Tensor) -> LossSums:
        c = (len(v) - 2) // 2
        return cls(v[0], v[1], v[2 : 2 + c], v[2 + c :])


def step_losses(sums: LossSums, category_names: list[str | None]) -> tuple[float, dict[str, float]]:
    """Mean loss of the step and the per-category means by name (category 0 and empty ones left out)."""
    loss = float(sums.ce / sums.targets.clamp(min=1))
    per_cat = {}
    counts = sums.cat_targets.tolist()
    totals = sums.cat_ce.tolist()
    for cid in range(1, len(counts)):
        if counts[cid] > 0:
            name = category_names[cid] if cid < len(category_names) and category_names[cid] else str(cid)
            per_cat[name] = totals[cid] / counts[cid]
    return loss, per_cat


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets_global: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(loss to backpropagate = Σ CE / N over the step, per-token CE for the channel sums)."""
    ce = token_ce(logits, labels)
    return ce.sum() / max(num_targets_global, 1), ce
