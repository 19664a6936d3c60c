"""prep.pack.chunk: concat-and-chunk sample boundaries equal megatron-core's build_sample_idx; every token once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xprep.prep.pack.chunk import chunk_items, samples_for


def megatron_sample_idx(lengths, order, seq_len, epochs):
    helpers = pytest.importorskip("megatron.core.datasets.helpers", reason="megatron-core (test extra)")
    return helpers.build_sample_idx(np.asarray(lengths, np.int32), np.asarray(order, np.int32), seq_len, epochs,
                                    int(np.sum(lengths)), True, True)


def reference_items(lengths, seq_len, samples):
    """Slow and obvious: walk every token position and start a new item at each sample or document start."""
    doc_of, offset = [], []
    for d, n in enumerate(lengths):
        doc_of += [d] * n
        offset += list(range(n))
    bins = []
    for k in range(samples):
        items = []
        for p in range(k * seq_len, (k + 1) * seq_len):
            if not items or offset[p] == 0:
                items.append([doc_of[p], offset[p], 0])
            items[-1][2] += 1
        bins.append(items)
    return bins


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(2, 64), st.integers(1, 3),
       st.randoms(use_true_random=False))
def test_sample_boundaries_equal_megatron_build_sample_idx(lengths, seq_len, epochs, rnd):
    lengths = np.array(lengths, np.int64)
    order = np.concatenate([rnd.sample(range(len(lengths)), len(lengths)) for _ in range(epochs)])
    samples, _ = samples_for(None, epochs * int(lengths.sum()), seq_len)
    if samples < 1:
        return
    want = megatron_sample_idx(lengths, order, seq_len, epochs)
    assert len(want) == samples + 1
    offsets, pos, start, length = chunk_items(lengths[order], seq_len, samples)
    firsts = offsets[:-1]
    assert np.array_equal(pos[firsts], want[:-1, 0]) and np.array_equal(start[firsts], want[:-1, 1])
    # the label of the last input position of sample k is Megatron's (k+1)-th start: the next bin's first token
    last = offsets[1:] - 1
    stream_end = np.concatenate([[0], np.cumsum(lengths[order])])[pos[last]] + start[last] + length[last]
    np.testing.assert_array_equal(stream_end, np.arange(1, samples + 1) * seq_len)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=30), st.integers(1, 40))
def test_items_equal_the_slow_reference_and_fill_every_slot(lengths, seq_len):
    lengths = np.array(lengths, np.int64)
    samples = (int(lengths.sum()) - 1) // seq_len
    offsets, pos, start, length = chunk_items(lengths, seq_len, samples)
    got = [[[int(pos[i]), int(start[i]), int(length[i])] for i in range(offsets[b], offsets[b + 1])]
           for b in range(samples)]
    assert got == reference_items(lengths.tolist(), seq_len, samples)
    assert all(np.sum(length[offsets[b]:offsets[b + 1]]) == seq_len for b in range(samples))  # 100 % fill


def test_samples_for_total_tokens_and_epochs():
    assert samples_for(None, 1000, 100) == (9, 1)  # (1000 - 1) // 100: the last label token must exist
    assert samples_for(1000, 1000, 100) == (10, 2)  # 10 samples need 1001 tokens: a second epoch
    assert samples_for(250, 1000, 100) == (3, 1)
    with pytest.raises(ValueError, match="need 1001"):
        chunk_items(np.array([500, 500]), 100, 10)
