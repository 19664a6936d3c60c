"""Which bins each rank trains on, with Megatron's semantics and exact resume.

The samplers see an endless stream of *positions*: epoch ``e`` covers positions
``[e·U, (e+1)·U)`` where ``U`` is the number of units (bins, or groups of bins for a pack
balanced across DP ranks). Position ``p`` is unit ``order(e)[p mod U]``: the identity for
``sequential``, a permutation seeded by ``[seed, e]`` for ``random``
(so seed 0's epoch 1 is not seed 1's epoch 0). So every unit is seen
exactly once per epoch, and a global batch may straddle two epochs.

Each step of a rank yields one micro-batch (a list of bin indices), as Megatron's
``MegatronPretrainingSampler`` does: the next ``micro_batch_size × dp`` positions form a
global micro-batch and rank ``r`` takes positions ``[r·M, (r+1)·M)`` of it. Within the first
epoch the sequential order is exactly Megatron's (tests compare with its published code).
``consumed_samples`` counts positions handed out over all ranks; it is the whole state.

Token-aware packs balanced with ``--balance-dp N`` store bins in groups of ``N`` consecutive
bins, bin ``r`` of a group meant for rank ``r``: there a unit is a group, ``micro_batch_size``
must be 1, and the random order permutes groups, never splits them. On ``N`` ranks each rank gets
its bin of every group; a run resumed on other ranks (``plan_batches``) reads the same positions,
so the same bins, only not balanced across its ranks.
(The packer balances Σlen² over a whole step of N × dp_micro_batches bins: that balance holds
exactly in sequential order; token-aware packs are shuffled at pack time already.)

Elastic resume: the stream of positions, hence the bins of global batch ``s`` (positions
``[s·G, (s+1)·G)``), depends on the pack, the seed and the global batch ``G`` only. The data-parallel
size, the micro-batch and the accumulation only decide which rank reads which of them in which
micro-step, so a checkpoint resumes on any layout with the same ``G`` and trains on the same bins.

``plan_batches`` decides, before any sampler exists, how many bins make a micro-batch and a step,
and how many steps the run has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.pack import methods_of


class BinSampler:
    """Micro-batches of bin indices for one data-parallel rank; endless, resumable."""

    kind = "sequential"

    def __init__(self, num_bins: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, group: int = 1, consumed_samples: int = 0):
        if num_bins <= 0:
            raise XprepError("the pack holds no bins: nothing to train on")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        if group > 1 and micro_batch_size != 1:
            raise XprepError(
                f"this pack groups its bins for {group} data-parallel ranks (token-aware, --balance-dp "
                f"{group}): train with --micro-batch-size 1 (got {micro_batch_size})")
        if num_bins % group:
            raise XprepError(f"the pack holds {num_bins} bins, not a multiple of its DP group {group}; "
                             "re-run `xprep pack --force`")
        self.num_bins = num_bins
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.group = group
        self.consumed_samples = consumed_samples
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def num_units(self) -> int:
        return self.num_bins // self.group

    @property
    def micro_batch_times_dp(self) -> int:
        return self.micro_batch_size * self.dp_size

    @property
    def epoch(self) -> float:
        """Epochs done so far, fractional."""
        return self.consumed_samples / self.num_bins

    def order(self, epoch: int) -> np.ndarray:
        """Unit order of an epoch: the identity here, a permutation in ``RandomBinSampler``."""
        return np.arange(self.num_units, dtype=np.int64)

    def bins_at(self, positions: np.ndarray) -> np.ndarray:
        """Bin index of each stream position."""
        if self.group == 1:
            return self._units_at(positions)
        unit = self._units_at(positions // self.group)
        return unit * self.group + positions % self.group

    def _units_at(self, positions: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(positions, self.num_units)
        out = np.empty(len(positions), np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self._order_of(e)[within[sel]]
        return out

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self.order(epoch), epoch
        return self._order

    def next_micro_batch(self) -> list[int]:
        """This rank's next micro-batch; advances ``consumed_samples`` by micro_batch × dp."""
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        bins = self.bins_at(np.arange(start, start + self.micro_batch_size, dtype=np.int64))
        self.consumed_samples += self.micro_batch_times_dp
        return bins.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_micro_batch()

    def state_dict(self) -> dict:
        return {"kind": self.kind, "consumed_samples": self.consumed_samples, "seed": self.seed,
                "num_bins": self.num_bins}

    def load_state_dict(self, state: dict) -> None:
        """Continue where a saved sampler stopped; the data layout must be the same."""
        if state["kind"] == "random" and self.kind == RandomBinSampler.kind:
            raise XprepError(
                "the checkpoint's random sampler is the old order (seeded by seed + epoch), which this "
                "version no longer produces: resuming would change the data order; start a new run "
                "(another --output or --resume never), or resume with the xtrain that wrote it")
        if state["kind"] != self.kind or state["num_bins"] != self.num_bins:
            raise XprepError(
                f"the checkpoint's sampler ({state['kind']} over {state['num_bins']} bins) does not match "
                f"this run ({self.kind} over {self.num_bins} bins): resume with the same pack and --sampler")
        if state["seed"] != self.seed:
            raise XprepError(f"the checkpoint was trained with --seed {state['seed']}, this run has "
                             f"--seed {self.seed}: resume with the same seed")
        self.consumed_samples = int(state["consumed_samples"])


class RandomBinSampler(BinSampler):
    """Like ``BinSampler`` over a fresh permutation of the units each epoch, seeded by (seed, epoch).

    ``kind`` names the order's version: checkpoints of the old ``random`` order (seeded by
    seed + epoch) are refused rather than resumed on another order.
    """

    kind = "random-v2"

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_units)


def build_sampler(kind: str, num_bins: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  seed: int, group: int = 1) -> BinSampler:
    """The sampler ``--sampler kind`` (sequential or random) gives data-parallel rank ``dp_rank`` of ``dp_size``:
    ``micro_batch_size`` bins per micro-batch. ``group``: a balanced token-aware pack's ``balance_dp`` (its
    pack.json config), whose bins go to the ranks in groups."""
    cls = {"sequential": BinSampler, "random": RandomBinSampler}[kind]
    return cls(num_bins, micro_batch_size, dp_rank, dp_size, seed, group)


@dataclass
class BatchPlan:
    """How bins become steps: micro-batch, global batch, accumulation, DP grouping, length."""

    micro_batch_size: int
    global_batch_size: int
    grad_accum: int
    group: int
    steps: int


@dataclass(frozen=True)
class ResumePoint:
    """Where the checkpoint being resumed stands: its step, the bins all ranks had consumed, its global batch."""

    step: int
    consumed_samples: int
    global_batch_size: int | None  # None: a checkpoint that does not record it

    @classmethod
    def of(cls, state: dict) -> ResumePoint | None:
        """The point a checkpoint's trainer state records; None for no checkpoint (an empty state)."""
        if not state:
            return None
        global_ = state.get("global_batch_size")
        return cls(int(state["step"]), int(state["sampler"]["consumed_samples"]),
                   int(global_) if global_ is not None else None)


def plan_batches(num_bins: int, pack_config: dict, dp: int, micro_batch_size: int,
                 global_batch_size: int | None = None, steps: int | None = None, epochs: float | None = None,
                 resume: ResumePoint | None = None, allow_new_global: bool = False) -> BatchPlan:
    """Check the batch options against the pack and the number of DP ranks.

    ``resume``: the checkpoint being resumed. Its global batch is the default (the micro × dp default would change
    with the layout); another explicit one is refused unless ``allow_new_global`` (--allow-new-global-batch), which
    continues from the checkpoint's consumed samples, as Megatron does. A balanced pack (``--balance-dp N``) starts
    on N ranks only, and resumes on any number. Neither ``steps`` nor ``epochs``: one epoch.
    """
    group = int(pack_config.get("balance_dp") or 1)
    micro = micro_batch_size
    if any(m.bin_is_micro_batch for m in methods_of(pack_config.get("method"))) and micro != 1:  # token-aware
        raise XprepError(f"--micro-batch-size {micro}: a {pack_config['method']} pack's bin is one whole micro-batch "
                         "(its token budget); use --micro-batch-size 1 and raise --global-batch-size "
                         "for more bins per step")
    if group > 1 and dp != group and resume is None:
        raise XprepError(
            f"this pack groups its bins for {group} data-parallel ranks (token-aware, --balance-dp {group}): "
            f"start the run on {group} ranks (got {dp}; a checkpoint of it resumes on any number), or repack "
            f"with --balance-dp {dp}")
    saved_global = resume.global_batch_size if resume is not None else None
    global_ = _global_batch(global_batch_size, saved_global, allow_new_global,
                            group * int(pack_config.get("dp_micro_batches") or 1) if group > 1 else micro * dp)
    if global_ % (micro * dp):
        raise XprepError(
            f"--global-batch-size {global_} is not a multiple of micro-batch {micro} × {dp} DP ranks "
            f"= {micro * dp}: use a multiple such as {micro * dp * max(1, global_ // (micro * dp))}")
    if global_ % group:
        raise XprepError(f"--global-batch-size {global_} is not a multiple of this pack's DP group of {group} bins "
                         f"(--balance-dp {group}): use a multiple such as {group * max(1, global_ // group)}")
    if steps is None:
        steps = _steps_of(num_bins, epochs, global_, resume if saved_global not in (None, global_) else None)
    return BatchPlan(micro, global_, global_ // (micro * dp), group, steps)


def _global_batch(given: int | None, saved: int | None, allow_new: bool, default: int) -> int:
    """The run's global batch: the one given, else the checkpoint's, else the layout's default."""
    if saved is not None and given not in (None, saved) and not allow_new:
        raise XprepError(f"--global-batch-size {given}: the checkpoint being resumed was trained with a global "
                         f"batch of {saved} bins (another one changes which bins make each step); resume with "
                         f"{saved} (or leave the option out), or continue from the bins already consumed with "
                         "--allow-new-global-batch, or start a new run with another --output")
    return given or saved or default


def _steps_of(num_bins: int, epochs: float | None, global_: int, resume: ResumePoint | None) -> int:
    """The steps of ``epochs`` passes over the bins; a run resumed on a new global batch (``resume``) counts the
    bins left after its checkpoint's consumed ones in steps of the new size."""
    total = int((epochs or 1.0) * num_bins)
    steps = total // global_ if resume is None else resume.step + max(0, total - resume.consumed_samples) // global_
    if steps < 1:
        raise XprepError(f"{epochs or 1} epoch(s) of {num_bins} bins is less than one global batch of "
                         f"{global_}: use --steps, more epochs or a smaller --global-batch-size")
    return steps
