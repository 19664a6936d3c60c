"""Samplers: Megatron's sequential order, random coverage per epoch, exact resume, DP groups.

``MegatronPretrainingSampler`` is not shipped in the megatron-core wheel (it lives in
Megatron-LM's ``megatron/training/datasets/data_samplers.py``, formerly
``megatron/legacy/data/data_samplers.py``), so ``megatron_reference`` below restates its
``__iter__`` from that published source (NVIDIA/Megatron-LM, Apache-2.0): walk indices from
``consumed_samples`` to ``total_samples``, cut them into groups of micro_batch × dp, and give
rank r the slice [r·micro, (r+1)·micro) of each group; the last partial group is dropped.
"""

from __future__ import annotations

import numpy as np
import pytest
from xprep.prep.errors import XprepError
from xprep.train.samplers import BinSampler, RandomBinSampler, build_sampler


def megatron_reference(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                       data_parallel_size):
    group, out = [], []
    for idx in range(consumed_samples, total_samples):
        group.append(idx)
        if len(group) == micro_batch_size * data_parallel_size:
            start = data_parallel_rank * micro_batch_size
            out.append(group[start : start + micro_batch_size])
            group = []
    return out


@pytest.mark.parametrize("total,micro,dp", [(100, 1, 1), (100, 4, 2), (37, 3, 2), (64, 2, 4), (30, 5, 1)])
@pytest.mark.parametrize("consumed_batches", [0, 1, 3])
def test_sequential_matches_megatron(total, micro, dp, consumed_batches):
    consumed = consumed_batches * micro * dp
    if consumed >= total:
        pytest.skip("nothing left")
    for rank in range(dp):
        ref = megatron_reference(total, consumed, micro, rank, dp)
        s = BinSampler(total, micro, rank, dp, consumed_samples=consumed)
        ours = [s.next_micro_batch() for _ in range(len(ref))]
        assert ours == ref


def test_sequential_wraps_into_the_next_epoch():
    s = BinSampler(5, 2)
    assert [s.next_micro_batch() for _ in range(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]


@pytest.mark.parametrize("dp,micro", [(1, 1), (2, 3), (4, 2)])
def test_random_covers_every_bin_once_per_epoch(dp, micro):
    n = 48
    samplers = [RandomBinSampler(n, micro, r, dp, seed=7) for r in range(dp)]
    seen = []
    for _ in range(n // (micro * dp)):
        for s in samplers:
            seen += s.next_micro_batch()
    assert sorted(seen) == list(range(n))
    assert seen != list(range(n))
    # the next epoch is another permutation of all bins
    nxt = []
    for _ in range(n // (micro * dp)):
        for s in samplers:
            nxt += s.next_micro_batch()
    assert sorted(nxt) == list(range(n)) and nxt != seen


def test_random_depends_on_seed_and_epoch_only():
    a, b = RandomBinSampler(30, 1, seed=1), RandomBinSampler(30, 1, seed=1)
    assert [a.next_micro_batch() for _ in range(45)] == [b.next_micro_batch() for _ in range(45)]
    assert not np.array_equal(RandomBinSampler(30, 1, seed=1).order(0), RandomBinSampler(30, 1, seed=2).order(0))


@pytest.mark.parametrize("kind", ["sequential", "random"])
def test_resume_mid_epoch_continues_exactly(kind):
    full = build_sampler(kind, 23, 2, 1, 2, seed=3)
    ref = [full.next_micro_batch() for _ in range(30)]
    first = build_sampler(kind, 23, 2, 1, 2, seed=3)
    head = [first.next_micro_batch() for _ in range(7)]
    state = first.state_dict()
    resumed = build_sampler(kind, 23, 2, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert head + [resumed.next_micro_batch() for _ in range(23)] == ref


def test_resume_refuses_other_layout():
    s = BinSampler(10, 1)
    with pytest.raises(XprepError, match="does not match"):
        RandomBinSampler(10, 1).load_state_dict(s.state_dict())
    with pytest.raises(XprepError, match="seed"):
        BinSampler(10, 1, seed=1).load_state_dict(s.state_dict())


def test_balanced_groups_keep_rank_assignment():
    """Token-aware --balance-dp 2 packs: bin b belongs to rank b % 2, in both orders."""
    for cls in (BinSampler, RandomBinSampler):
        ranks = [cls(12, 1, r, 2, seed=5, group=2) for r in range(2)]
        for _ in range(12):
            got = [s.next_micro_batch()[0] for s in ranks]
            assert [g % 2 for g in got] == [0, 1] and got[1] == got[0] + 1


def test_balanced_pack_needs_micro_batch_one():
    with pytest.raises(XprepError, match="--micro-batch-size 1"):
        BinSampler(12, 2, 0, 2, group=2)


def global_batches(kind: str, num_bins: int, micro: int, dp: int, global_: int, steps: int, group: int = 1,
                   state: dict | None = None) -> tuple[list[list[int]], dict]:
    """The bins of each of ``steps`` global batches of ``global_`` bins that ``dp`` ranks read in micro-batches of
    ``micro`` (each rank its share, micro-step after micro-step), sorted; the samplers' state after them."""
    ranks = [build_sampler(kind, num_bins, micro, r, dp, seed=4, group=group) for r in range(dp)]
    for s in ranks if state else []:
        s.load_state_dict(state)
    batches = []
    for _ in range(steps):
        bins = [b for _ in range(global_ // (micro * dp)) for s in ranks for b in s.next_micro_batch()]
        batches.append(sorted(bins))
    return batches, ranks[0].state_dict()


@pytest.mark.parametrize("kind", ["sequential", "random"])
def test_global_batches_do_not_depend_on_the_layout(kind):
    """Elastic resume: each global batch holds the same bins whatever the DP size and the micro-batch × accumulation
    split (over 23 bins, so batches straddle epochs), and a state saved on one layout continues on another. This held
    before issue 35 already (the order is a stream of positions, not Megatron's per-rank buckets)."""
    reference, _ = global_batches(kind, 23, 1, 1, 6, 12)
    for micro, dp in [(2, 1), (1, 2), (3, 2), (1, 3), (2, 3), (1, 6)]:
        assert global_batches(kind, 23, micro, dp, 6, 12)[0] == reference, (micro, dp)
    head, state = global_batches(kind, 23, 1, 2, 6, 5)
    assert head + global_batches(kind, 23, 2, 3, 6, 7, state=state)[0] == reference


@pytest.mark.parametrize("kind", ["sequential", "random"])
def test_balanced_pack_resumes_on_other_dp_sizes(kind):
    """A --balance-dp 2 pack's checkpoint continues on 1 or 3 ranks with the same bins in each global batch (refused
    before issue 35); on 2 ranks the order is unchanged (bin b to rank b % 2, as tested above)."""
    reference, _ = global_batches(kind, 24, 1, 2, 6, 10, group=2)
    head, state = global_batches(kind, 24, 1, 2, 6, 3, group=2)
    for dp in (1, 3):
        assert head + global_batches(kind, 24, 1, dp, 6, 7, group=2, state=state)[0] == reference, dp


def test_random_seeds_do_not_collide_across_epochs():
    """Seed 0's epoch 1 is not seed 1's epoch 0 (the order was once seeded by seed + epoch)."""
    assert not np.array_equal(RandomBinSampler(30, 1, seed=0).order(1), RandomBinSampler(30, 1, seed=1).order(0))
    old = {"kind": "random", "consumed_samples": 4, "seed": 0, "num_bins": 30}  # a checkpoint of the old order
    with pytest.raises(XprepError, match="old order"):
        RandomBinSampler(30, 1).load_state_dict(old)
