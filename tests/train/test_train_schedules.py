"""The learning-rate schedules and gradient clipping against references written here, not xtrain's helpers.

Schedules: the lr of every update of a run equals a closed form (update n = 1..T runs at): warm-up
lr·n/W (never 0); cosine/linear decay to --min-lr reached at update T+1, one after the last (so the last
trains above it); wsd/wsd-sqrt at the peak, then linear / 1-sqrt decay over the last round(decay_fraction·T)
updates. Clipping: one ``train_step``
reports the pre-clip global norm and moves the parameters as clip-then-AdamW computed by hand does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from trainkit import category_pack
from xprep.cli import xtrain
from xprep.prep.errors import XprepError
from xprep.train.checkpoint import CheckpointManager
from xprep.train.config import ModelSection, OptimizerSection, TrainConfig, validate_against_schema
from xprep.train.data import PackedDataset
from xprep.train.dist import ParallelDims
from xprep.train.optim import LRSchedule, schedule_change
from xprep.train.samplers import build_sampler
from xprep.train.trainer import Trainer


# ------------------------------------------------------------------------------------------ references
def reference_lr(kind: str, n: int, steps: int, warmup: int, lr: float, min_lr: float,
                 decay_fraction: float = 0.2) -> float:
    """The lr of update n (1-based) of a ``steps``-update run, written from the documented rule."""
    if n <= warmup:
        return lr * n / warmup
    if kind == "constant":
        return lr
    if kind in ("cosine", "linear"):
        first = warmup  # the decay runs over updates warmup+1 .. steps
    else:
        decay_steps = min(steps - warmup, max(1, round(decay_fraction * steps)))
        first = steps - decay_steps
        if n <= first:
            return lr  # the stable plateau
    peak = max(first, 1)  # the last update at the peak (the first update, when nothing comes before the decay)
    p = (n - peak) / (steps + 1 - peak)  # 1 at update steps + 1: --min-lr is reached after the run
    shape = {"cosine": (1 + math.cos(math.pi * p)) / 2, "linear": 1 - p, "wsd": 1 - p, "wsd-sqrt": 1 - math.sqrt(p)}
    return min_lr + (lr - min_lr) * shape[kind]


def xtrain_lrs(section: OptimizerSection, steps: int) -> list[list[float]]:
    """The lr of every param group at each update of a run built by xtrain's config (no gradients needed)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    optimizer, scheduler = section.build(model, steps)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


CASES = [  # steps, warmup, lr, min_lr, decay_fraction
    (1, 0, 1e-3, 0.0, 0.2), (2, 1, 1e-3, 1e-4, 0.5), (10, 0, 3e-4, 0.0, 0.2), (10, 3, 3e-4, 3e-5, 0.3),
    (37, 5, 2e-3, 1e-4, 0.25), (20, 20, 1e-3, 1e-4, 0.1), (25, 4, 1e-3, 1e-3, 1.0), (100, 10, 6e-4, 6e-5, 0.2),
]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd", "wsd-sqrt"])
@pytest.mark.parametrize("steps,warmup,lr,min_lr,fraction", CASES)
def test_every_schedule_matches_its_closed_form(kind, steps, warmup, lr, min_lr, fraction):
    wsd = kind.startswith("wsd")
    section = OptimizerSection(lr=lr, min_lr=min_lr, warmup=warmup, schedule=kind,
                               decay_fraction=fraction if wsd else None)
    got = xtrain_lrs(section, steps)
    for n, groups in enumerate(got, start=1):
        want = reference_lr(kind, n, steps, warmup, lr, min_lr, fraction)
        assert groups == pytest.approx([want] * len(groups), rel=1e-12, abs=1e-18), (kind, n, groups, want)
    if kind != "constant" and min_lr < lr:  # every update of a decay trains above --min-lr, the last one too
        assert all(g[0] > min_lr for g in got[warmup:])


def test_hand_computed_values():
    """A few runs written out by hand: the rules above, not a formula shared with the code."""
    def lrs(**kw) -> list[float]:
        steps = kw.pop("steps")
        return [g[0] for g in xtrain_lrs(OptimizerSection(**kw), steps)]

    cos = lambda p: (1 + math.cos(math.pi * p)) / 2  # noqa: E731
    assert lrs(lr=1.0, warmup=1, schedule="cosine", steps=5) == pytest.approx(
        [1.0, cos(1 / 5), cos(2 / 5), cos(3 / 5), cos(4 / 5)])
    assert lrs(lr=1.0, schedule="cosine", steps=4) == pytest.approx([1.0, cos(1 / 4), cos(2 / 4), cos(3 / 4)])
    assert lrs(lr=1.0, min_lr=0.2, warmup=2, schedule="cosine", steps=4) == pytest.approx([0.5, 1.0, 0.8, 0.4])
    assert lrs(lr=1.0, min_lr=0.1, warmup=2, schedule="linear", steps=5) == pytest.approx(
        [0.5, 1, 0.775, 0.55, 0.325])
    assert lrs(lr=1.0, warmup=4, schedule="constant", steps=6) == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    assert lrs(lr=1.0, min_lr=0.1, warmup=2, schedule="wsd", decay_fraction=0.3, steps=10) == pytest.approx(
        [0.5, 1, 1, 1, 1, 1, 1, 0.775, 0.55, 0.325])
    assert lrs(lr=1.0, schedule="wsd-sqrt", decay_fraction=0.4, steps=10) == pytest.approx(
        [1, 1, 1, 1, 1, 1, 1 - math.sqrt(0.2), 1 - math.sqrt(0.4), 1 - math.sqrt(0.6), 1 - math.sqrt(0.8)])
    # the default fraction is 0.2: 2 of 10 steps decay, both above --min-lr
    assert lrs(lr=1.0, schedule="wsd", steps=10) == pytest.approx([1] * 8 + [2 / 3, 1 / 3])


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "wsd-sqrt"])
def test_no_update_trains_at_min_lr_zero(kind):
    """Issue 29: cosine to --min-lr 0 trained the last update (and the only one of --steps 1) at lr 0."""
    one = xtrain_lrs(OptimizerSection(lr=1e-3, schedule=kind), 1)
    assert one == [[1e-3, 1e-3]]  # a one-step run trains at --lr
    for steps, warmup in ((2, 0), (10, 0), (10, 3), (7, 6)):
        lrs = [g[0] for g in xtrain_lrs(OptimizerSection(lr=1e-3, warmup=warmup, schedule=kind), steps)]
        assert min(lrs) > 0 and lrs[-1] < max(lrs), (steps, warmup, lrs)  # it decays, and never to 0


def test_decay_fraction_is_checked():
    with pytest.raises(XprepError, match=r"--decay-fraction 0.2 applies to --schedule wsd or wsd-sqrt, not cosine"):
        OptimizerSection(schedule="cosine", decay_fraction=0.2)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(XprepError, match=r"--decay-fraction .* must be in \(0, 1\]"):
            OptimizerSection(schedule="wsd", decay_fraction=bad)
    cfg = TrainConfig.from_dict({"packed": "p", "schedule": "wsd-sqrt", "decay_fraction": 0.25})
    validate_against_schema(cfg.to_dict())  # the schema knows the new schedule and field
    assert cfg.to_dict()["optimizer"]["decay_fraction"] == 0.25


def test_a_resume_names_a_changed_decay_fraction():
    """The checkpoint records a wsd schedule's decay fraction; resuming with another says what it does."""
    now = LRSchedule("wsd", 0, 10, 0.0, 0.4)
    assert now.settings() == {"schedule": "wsd", "warmup": 0, "steps": 10, "decay_fraction": 0.4}
    assert LRSchedule("cosine", 0, 10, 0.0).settings() == {"schedule": "cosine", "warmup": 0, "steps": 10}
    note = schedule_change(now, {"schedule": "wsd", "warmup": 0, "steps": 10, "decay_fraction": 0.2}, 6, 1.0)
    assert note == ("decay_fraction 0.2 → 0.4: the learning-rate schedule is recomputed for 10 steps "
                    "(step 7 lr 8.00e-01 instead of 1.00e+00)")
    assert schedule_change(now, now.settings(), 6, 1.0) is None
    # an implicit and an explicit default fraction are the same schedule
    assert schedule_change(LRSchedule("wsd", 0, 10, 0.0, 0.2), {**now.settings(), "decay_fraction": None}, 6, 1) is None


def test_a_run_logs_the_closed_form_lr(tmp_path):
    """End to end (`xtrain run --config`): metrics.jsonl's lr of every step is the closed form's."""
    packed = category_pack(tmp_path)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"optimizer": {"schedule": "wsd", "decay_fraction": 0.5, "warmup": 2,
                                                "lr": 1e-3, "min_lr": 1e-4}}))
    result = CliRunner().invoke(xtrain, ["run", str(packed), "--config", str(config), "--steps", "6",
                                         "-o", str(tmp_path / "run"), "--log-every", "100"])
    assert result.exit_code == 0, result.output
    logged = [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx([reference_lr("wsd", n, 6, 2, 1e-3, 1e-4, 0.5) for n in range(1, 7)], rel=1e-12)
    assert logged == pytest.approx([5e-4, 1e-3, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4], rel=1e-12)


# ------------------------------------------------------------------------------------------ clipping
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8


def constant_lr_trainer(packed, grad_clip: float) -> Trainer:
    """xtrain's Trainer (tiny model, xtrain's AdamW) at a constant lr, 2 micro-batches of 1 bin per step."""
    ds = PackedDataset(packed)
    model, _ = ModelSection("tiny").build(ds.vocab_size, 0)
    optimizer, scheduler = OptimizerSection(lr=LR, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1],
                                            schedule="constant", grad_clip=grad_clip).build(model, 100)
    sampler = build_sampler("sequential", len(ds), 1, 0, 1, 0)
    return Trainer(model, optimizer, scheduler, ds, sampler, ParallelDims(), 2, torch.device("cpu"), grad_clip)


def reference_step(params: dict, grads: dict, state: dict, step: int, max_norm: float) -> float:
    """clip_grad_norm_ then AdamW by hand, in float64 (decay on ≥ 2-D parameters only); the pre-clip norm."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0  # torch.nn.utils.clip_grad_norm_
    for name, p in params.items():
        g = grads[name].double() * coef
        m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        state[name] = (m, v)
        m_hat, v_hat = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
        decay = WD if p.dim() >= 2 else 0.0
        params[name] = p * (1 - LR * decay) - LR * m_hat / (v_hat.sqrt() + EPS)
    return norm


@pytest.mark.parametrize("max_norm", [0.25, 0.0])
def test_clipped_update_equals_clip_then_adamw_by_hand(tmp_path, max_norm):
    """Three steps: the logged grad_norm is the pre-clip norm and the parameters are clip-then-AdamW's.

    Before each step the reference trainer takes xtrain's parameters and computes the step's gradients
    on the same batch (the loss is tested elsewhere); the clipping and AdamW (with its moments over the
    three steps) are the reference's own. Clipping switched off (or on) in xtrain alone changes the
    parameters from the second step on: AdamW is invariant only to one common scale of all its gradients.
    """
    packed = category_pack(tmp_path)
    run, ref = constant_lr_trainer(packed, max_norm), constant_lr_trainer(packed, max_norm)
    state, clipped = {}, 0
    for step in range(1, 4):
        with torch.no_grad():
            for p, q in zip(ref.model.parameters(), run.model.parameters(), strict=True):
                p.copy_(q)
        ref.accumulate_gradients()
        grads = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}
        ref.optimizer.zero_grad(set_to_none=True)
        params = {n: p.detach().double().clone() for n, p in ref.model.named_parameters()}
        norm = reference_step(params, grads, state, step, max_norm)
        metrics = run.train_step()
        assert metrics.grad_norm == pytest.approx(norm, rel=1e-6), step
        clipped += max_norm > 0 and norm > max_norm
        for n, p in run.model.named_parameters():
            torch.testing.assert_close(p.detach().double(), params[n], rtol=1e-6, atol=1e-8, msg=f"{n} step {step}")
    assert clipped == (3 if max_norm else 0)  # the clipped case really clipped every step


def test_fsdp2_clipped_run_on_two_ranks_equals_the_reference(tmp_path):
    """`xtrain run --nproc-per-node 2` (FSDP2, gloo): each step's grad_norm is the reference's pre-clip norm and
    the parameters after 3 steps are clip-then-AdamW's computed here on one process (float64 parameters; the
    gradients from a trainer set to them, so they drift ~1e-6 from the fp32 run's: looser tolerances)."""
    packed, max_norm, steps = category_pack(tmp_path), 0.25, 3
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("xtrain")), "run", str(packed), "-o", str(run_dir),
                           "--nproc-per-node", "2", "--steps", str(steps), "--micro-batch-size", "1",
                           "--global-batch-size", "2", "--schedule", "constant", "--lr", str(LR), "--weight-decay",
                           str(WD), "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]), "--grad-clip", str(max_norm),
                           "--log-every", "100"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(x)["grad_norm"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    ref = constant_lr_trainer(packed, max_norm)  # 2 micro-batches of 1 bin: the same global batches
    params = {n: p.detach().double().clone() for n, p in ref.model.named_parameters()}
    state, norms = {}, []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for n, p in ref.model.named_parameters():
                p.copy_(params[n])
        ref.accumulate_gradients()
        grads = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}
        ref.optimizer.zero_grad(set_to_none=True)
        norms.append(reference_step(params, grads, state, step, max_norm))
    assert all(norm > max_norm for norm in norms)  # every step clipped
    assert logged == pytest.approx(norms, rel=1e-4)

    saved = constant_lr_trainer(packed, max_norm)
    CheckpointManager(run_dir, ParallelDims()).load(run_dir / "checkpoints" / f"step-{steps}", saved.model,
                                                    saved.optimizer, saved.dataset.key)
    for n, p in saved.model.named_parameters():
        torch.testing.assert_close(p.detach().double(), params[n], rtol=1e-4, atol=2e-5, msg=n)
