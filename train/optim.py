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

SCHEDULES = ("cosine", "linear", "constant", "wsd", "wsd-sqrt")
WSD_SCHEDULES = ("wsd", "wsd-sqrt")  # warm-up, stable, decay over the last --decay-fraction of the steps
DEFAULT_DECAY_FRACTION = 0.2  # Hägele et al. (2024): a 20% 1-sqrt cooldown matches a full cosine


class LRSchedule:
    """LR multiplier at 0-based step s (the lr of the (s+1)-th update): warm-up, then a plateau, then a decay.

    - warm-up, s < W: (s+1)/W — the first update already moves (never lr 0), the W-th runs at the peak.
    - decay from step S on, with m = min_ratio (--min-lr / --lr): the multiplier is m + (1−m)·f(p), p the
      progress from the last step at the peak, a = max(S−1, 0) (the last warm-up or plateau step; step 0
      when nothing comes before the decay), to the step *after* the last one, T: p = (s−a)/(T−a). So --min-lr
      is reached once the run is over and every update of the decay trains above it (with --min-lr 0 the
      last one is not wasted at lr 0, and a one-step run trains at --lr). S = W for ``cosine``
      (f = (1+cos πp)/2) and ``linear`` (f = 1−p); S = T−D for ``wsd`` (f = 1−p) and ``wsd-sqrt``
      (f = 1−√p), whose D = round(decay_fraction·T) decay steps (at least 1, at most T−W) follow a plateau
      at the peak; ``constant`` stays at the peak after the warm-up (no --min-lr).

    The shapes are OLMo-core's ``CosWithWarmup``/``LinearWithWarmup``/``WSD``, except that they end at
    --min-lr one update after the last (OLMo-core's last update runs at it); ``wsd-sqrt`` is the "1-sqrt"
    cooldown of Hägele et al. (2024), torchtitan's ``lr_decay_type = "sqrt"``. A plain object (not a
    lambda) so ``LambdaLR.state_dict`` can save it.
    """

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float, decay_fraction: float | None = None):
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, total, min_ratio
        self.decay_fraction = decay_fraction if kind in WSD_SCHEDULES else None
        self.decay_start = warmup
        if kind in WSD_SCHEDULES:
            fraction = DEFAULT_DECAY_FRACTION if decay_fraction is None else decay_fraction
            self.decay_start = total - min(max(0, total - warmup), max(1, round(fraction * total)))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant" or step < self.decay_start:
            return 1.0
        peak = max(self.decay_start - 1, 0)  # the last step at the peak; the decay ends at step `total`
        progress = min(1.0, (step - peak) / max(1, self.total - peak))
        if self.kind == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        elif self.kind == "wsd-sqrt":
            decay = 1 - math.sqrt(progress)
        else:  # linear, wsd
            decay = 1 - progress
        return self.min_ratio + (1 - self.min_ratio) * decay

    def shape(self) -> tuple:
        """What the multipliers depend on: two schedules of the same shape give the same lr at every step."""
        if self.kind == "constant":
            return self.kind, self.warmup
        return self.kind, self.warmup, self.decay_start, self.total, self.min_ratio

    def settings(self) -> dict:
        """The schedule as a checkpoint records it (the base and final lr are in its hparams)."""
        out = {"schedule": self.kind, "warmup": self.warmup, "steps": self.total}
        if self.kind in WSD_SCHEDULES:
            out["decay_fraction"] = self.decay_fraction
        return out


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float]) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and other 1-D parameters; its implementation per ``adamw_implementation``."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device_type = next(model.parameters()).device.type
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **adamw_implementation(device_type))


def adamw_implementation(device_type: str) -> dict[str, bool]:
    """How AdamW updates the parameters: on CUDA one fused kernel for all of them (``fused=True``, as torchtitan
    does: no per-tensor launches, no intermediate tensors); elsewhere the multi-tensor ``foreach`` path (the
    fused CPU kernel is no faster there). Same update either way, up to rounding."""
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


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
    old = {**now, **{k: saved[k] for k in (*now, "decay_fraction") if k in saved}}
    before = LRSchedule(old["schedule"], old["warmup"], old["steps"], schedule.min_ratio, old.get("decay_fraction"))
    if before.shape() == schedule.shape():
        return None
    what = ", ".join(f"{k} {old[k]} → {now[k]}" for k in now if old[k] != now[k])
    note = f"{what}: the learning-rate schedule is recomputed for {schedule.total} steps"
    if step < schedule.total:
        note += f" (step {step + 1} lr {base_lr * schedule(step):.2e} instead of {base_lr * before(step):.2e})"
    return note
