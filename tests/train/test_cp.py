"""Context parallelism: padding rule, zigzag shard/inverse, simulated ranks (real processes, every mode:
tests/train/test_cp_modes.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from trainkit import assert_simulated_cp_attention
from xprep.prep.pack.cache import PackConfig
from xprep.prep.pack.kernels import item_costs
from xprep.train.cp import (
    CPContext,
    inverse_permutation,
    pad_documents,
    padded_length,
    shard_batch,
    zigzag_owner,
    zigzag_permutation,
)

REPO = Path(__file__).resolve().parents[2]


def random_lengths(seed: int, n: int = 9, high: int = 50) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, high, (n,), generator=g).tolist()


def cu_from(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def make_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Tokens numbered 1..T (so where each one went is visible), labels = ids + 1000, categories 7."""
    t = sum(lengths)
    ids = torch.arange(1, t + 1)[None]
    return {
        "input_ids": ids,
        "labels": ids + 1000,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "category_ids": torch.full((1, t), 7),
        "cu_seqlens": cu_from(lengths),
    }


# ----------------------------------------------------------------------------- padding rule


def design_cp_rounding(doc_len: int, cp_size: int) -> int:
    """DESIGN.md §2/§3: a length rounded up to a multiple of 2·cp (no rounding without CP)."""
    unit = 2 * cp_size if cp_size > 1 else 1
    return math.ceil(doc_len / unit) * unit


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_padded_length_is_the_pack_rounding_rule(cp_size):
    lengths = np.arange(0, 300, dtype=np.int32)
    expected = [design_cp_rounding(int(n), cp_size) for n in lengths]
    assert [padded_length(int(n), cp_size) for n in lengths] == expected
    assert padded_length(lengths, cp_size).tolist() == expected  # numpy, elementwise
    assert padded_length(torch.from_numpy(lengths), cp_size).tolist() == expected  # torch too
    # The packer's own cost of an item, as `xprep pack --cp-size C` counts it inside a bin.
    pack = PackConfig(method="sequential", seq_len=2 * cp_size * 64, cp_size=cp_size)
    assert item_costs(lengths, pack.align).tolist() == expected


def test_padded_length_rejects_bad_cp_size():
    with pytest.raises(ValueError):
        padded_length(5, 0)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_pad_documents_pads_each_tail(cp_size):
    lengths = [5, 8, 1, 13]
    cu_padded, source, pad_offset = pad_documents(cu_from(lengths), cp_size)
    padded = [design_cp_rounding(n, cp_size) for n in lengths]
    assert cu_padded.dtype == torch.int32 and cu_padded.tolist() == cu_from(padded).tolist()
    starts = cu_from(lengths).tolist()
    for d, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        seg = slice(int(cu_padded[d]), int(cu_padded[d + 1]))
        assert source[seg].tolist() == [starts[d] + min(i, n - 1) for i in range(p)]
        assert pad_offset[seg].tolist() == [max(0, i - n + 1) for i in range(p)]


# ----------------------------------------------------------------------------- zigzag


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_zigzag_shard_then_inverse_is_identity(cp_size, seed):
    lengths = random_lengths(seed)
    batch = make_batch(lengths)
    shards = [shard_batch(batch, r, cp_size) for r in range(cp_size)]
    gathered = torch.cat([s["input_ids"][0] for s in shards])  # what the all-gather concatenates
    inverse = shards[0]["cp_inverse"]
    global_order = gathered[inverse]
    _, source, pad_offset = pad_documents(batch["cu_seqlens"], cp_size)
    real = pad_offset == 0
    assert torch.equal(global_order[real], batch["input_ids"][0])  # original sequence back
    assert (global_order[~real] == 0).all()
    assert torch.equal(torch.cat([s["global_index"] for s in shards])[inverse], torch.arange(inverse.numel()))
    for s in shards:  # every rank gets the same number of tokens and the same index info
        assert s["input_ids"].shape == (1, inverse.numel() // cp_size)
        assert torch.equal(s["cp_inverse"], inverse)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zero_length_documents_are_harmless(cp_size):
    lengths = [0, 5, 0, 0, 3, 0]
    batch = make_batch(lengths)
    shards = [shard_batch(batch, r, cp_size) for r in range(cp_size)]
    gathered = torch.cat([s["input_ids"][0] for s in shards])[shards[0]["cp_inverse"]]
    assert gathered[gathered > 0].tolist() == batch["input_ids"][0].tolist()
    assert shards[0]["cu_seqlens_padded"].tolist() == cu_from([padded_length(n, cp_size) for n in lengths]).tolist()


def test_cp_size_one_shard_is_the_batch_itself():
    batch = make_batch([5, 8, 1])
    shard = shard_batch(batch, 0, 1)
    for key, value in batch.items():
        assert torch.equal(shard[key], value), key
    assert torch.equal(shard["global_index"], torch.arange(14))


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_rank_keeps_chunks_r_and_mirror(cp_size):
    lengths = [8 * cp_size, 2 * cp_size, 6 * cp_size]
    cu = cu_from(lengths)
    perm = zigzag_permutation(cu, cp_size)
    for r in range(cp_size):
        expected = []
        for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
            c = n // (2 * cp_size)
            expected += list(range(start + r * c, start + (r + 1) * c))
            mirror = 2 * cp_size - 1 - r
            expected += list(range(start + mirror * c, start + (mirror + 1) * c))
        assert perm[r].tolist() == expected
    assert zigzag_owner(cu, cp_size).bincount().tolist() == [sum(lengths) // cp_size] * cp_size
    assert torch.equal(perm.reshape(-1)[inverse_permutation(perm)], torch.arange(sum(lengths)))


def test_zigzag_permutation_refuses_unpadded_documents():
    with pytest.raises(ValueError, match="pad_documents"):
        zigzag_permutation(cu_from([4, 5]), 2)


def test_shard_batch_keys_and_padding_values():
    lengths = [5, 9, 3]
    shard = shard_batch(make_batch(lengths), cp_rank=1, cp_size=2)
    # Padded lengths 8, 12, 4 -> chunk sizes 2, 3, 1; rank 1 keeps chunks 1 and 2 of each.
    assert shard["global_index"].tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16, 21, 22]
    assert shard["cu_seqlens"].tolist() == [0, 4, 10, 12] and shard["cu_seqlens"].dtype == torch.int32
    assert shard["cu_seqlens_padded"].tolist() == [0, 8, 20, 24]
    assert shard["position_ids"].tolist() == [[2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 1, 2]]  # global, continued
    assert shard["input_ids"].tolist() == [[3, 4, 5, 0, 9, 10, 11, 12, 13, 14, 16, 17]]
    assert shard["labels"][0, 3] == -100 and (shard["labels"][0, [0, 1, 2, 4]] > 1000).all()
    assert shard["category_ids"].tolist() == [[7, 7, 7, 0, 7, 7, 7, 7, 7, 7, 7, 7]]


def test_shard_batch_rejects_mismatched_shapes():
    batch = make_batch([4, 4])
    batch["labels"] = batch["labels"][:, :-1]
    with pytest.raises(ValueError, match="labels"):
        shard_batch(batch, 0, 2)


# ----------------------------------------------------------------------------- simulated ranks


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_cp_attention_with_simulated_ranks_equals_full_attention(cp_size):
    """Each 'rank' runs CPContext.attention with a fake all-gather; outputs and grads match cp=1."""
    batch = make_batch(random_lengths(cp_size, n=6, high=30))
    shards = [shard_batch(batch, r, cp_size) for r in range(cp_size)]
    assert_simulated_cp_attention(shards, torch.diff(shards[0]["cu_seqlens_padded"]).tolist(), cp_size)


def test_cp_context_needs_a_group_or_gather():
    shard = shard_batch(make_batch([4]), 0, 2)
    with pytest.raises(ValueError, match="process group"):
        CPContext.from_shard(shard, None, 0, 2)
