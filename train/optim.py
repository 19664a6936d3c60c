"""AdamW, the learning-rate schedule, and what a resume does to them.

Loading a checkpoint restores its optimizer's weight decay and betas and its scheduler's base
lrs; a resumed run must do what its own config says instead. So the settings are taken when the
optimizer is built (``optimizer_settings``), put back after a load (``apply_settings``), and the
differences are said on the console (``hparam_changes``, ``schedule_change``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


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

    def settings(self) -> dict:
        """The schedule as a checkpoint records it (the base and final lr are in its hparams)."""
        return {"schedule": self.kind, "warmup": self.warmup, "steps": self.total}


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and other 1-D parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=True)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> LambdaLR:
    """The scheduler applying ``schedule`` to every param group."""
    return LambdaLR(optimizer, schedule)


def optimizer_settings(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> list[dict]:
    """Per param group, what the config set: base lr, weight decay, betas (taken before a checkpoint loads)."""
    return [{"initial_lr": base, "weight_decay": g["weight_decay"], "betas": tuple(g["betas"])}
            for g, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True)]


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, settings: list[dict]) -> None:
    """Give each param group ``settings`` (``optimizer_settings``) and its lr at the schedule's current step."""
    for i, (group, want) in enumerate(zip(optimizer.param_groups, settings, strict=True)):
        group.update(want)
        scheduler.base_lrs[i] = want["initial_lr"]
        group["lr"] = want["initial_lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)


def hparam_changes(saved: dict | None, wanted: dict, optimizer: torch.optim.Optimizer,
                   scheduler: LambdaLR) -> list[str]:
    """"name old → new" for each of ``wanted`` (lr, min_lr, weight_decay, betas) that the checkpoint set otherwise.

    ``saved`` is the checkpoint's hparams; None for a checkpoint from before they were saved, whose
    values are then read off the optimizer and scheduler it was just loaded into.
    """
    if saved is None:
        g = optimizer.param_groups[0]
        saved = {"lr": scheduler.base_lrs[0], "weight_decay": g["weight_decay"], "beta1": g["betas"][0],
                 "beta2": g["betas"][1]}
    return [f"{k} {saved[k]} → {v}" for k, v in wanted.items() if k in saved and saved[k] != v]


def schedule_change(schedule: LRSchedule, saved: dict | None, step: int, base_lr: float) -> str | None:
    """Say how ``schedule`` differs from the checkpoint's, and what that does to the next step's lr.

    The schedule follows the config (``Trainer.state_dict``): resuming with another --steps, --warmup or
    --schedule silently bends the lr curve from the next step on. Both lrs shown use this config's --lr and
    --min-lr (a change of those is named apart). None when nothing changes any lr (e.g. a constant schedule
    made longer) or the checkpoint predates recording the schedule.
    """
    if not saved:
        return None
    now = schedule.settings()
    old = {**now, **{k: saved[k] for k in now if k in saved}}
    before = LRSchedule(old["schedule"], old["warmup"], old["steps"], schedule.min_ratio)
    if before.shape() == schedule.shape():
        return None
    what = ", ".join(f"{k} {old[k]} → {now[k]}" for k in now if old[k] != now[k])
    note = f"{what}: the learning-rate schedule is recomputed for {schedule.total} steps"
    if step < schedule.total:
        note += f" (step {step + 1} lr {base_lr * schedule(step):.2e} instead of {base_lr * before(step):.2e})"
    return note
