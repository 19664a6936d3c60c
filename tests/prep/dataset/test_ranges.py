"""Byte ranges (prep/dataset/stream.py: ``coalesce_ranges`` and its helpers) against slow obvious references, and
the block cache of datasets at URLs (``BlockCache``) over fsspec's in-memory file system: exact bytes, exact
ranges fetched, the capacity never exceeded, pinned ranges never evicted.
"""

from __future__ import annotations

import fsspec
import numpy as np
import pytest
from xprep.prep.dataset.stream import BlockCache, coalesce_ranges, expand_ranges, merge_ranges, runs, subtract_ranges


def covered(lo, hi, size: int) -> np.ndarray:
    """Slow reference: which of ``size`` positions the ranges cover."""
    out = np.zeros(size, bool)
    for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
        out[a:b] = True
    return out


def random_ranges(rng, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    lo = rng.integers(0, size, n)
    return lo, np.minimum(lo + rng.integers(0, 40, n), size)


def is_normal(lo, hi) -> bool:
    return bool(np.all(hi > lo) and np.all(lo[1:] > hi[:-1]))


@pytest.mark.parametrize("seed", range(20))
def test_range_arithmetic_matches_the_slow_reference(seed):
    rng = np.random.default_rng(seed)
    size = 500
    lo, hi = random_ranges(rng, int(rng.integers(0, 30)), size)
    m_lo, m_hi = merge_ranges(lo, hi)
    assert is_normal(m_lo, m_hi) and np.array_equal(covered(m_lo, m_hi, size), covered(lo, hi, size))

    c_lo, c_hi = coalesce_ranges(lo, hi, gap=15, share=0.25)
    wanted, fetched = covered(lo, hi, size), covered(c_lo, c_hi, size)
    assert is_normal(c_lo, c_hi) and np.all(fetched[wanted])  # every byte read is fetched ...
    extra = int(fetched.sum() - wanted.sum())
    assert extra <= 0.25 * wanted.sum()  # ... with at most a quarter more, in gaps of at most 15
    assert all(b - a <= 15 for a, b in zip(m_hi[:-1].tolist(), m_lo[1:].tolist(), strict=True)
               if fetched[a:b].all())
    gaps = sorted(b - a for a, b in zip(m_hi[:-1].tolist(), m_lo[1:].tolist(), strict=True))
    assert extra == max((sum(gaps[:k]) for k in range(len(gaps) + 1)
                         if sum(gaps[:k]) <= 0.25 * wanted.sum() and all(g <= 15 for g in gaps[:k])), default=0)

    cut_lo, cut_hi = merge_ranges(*random_ranges(rng, 10, size))
    s_lo, s_hi = subtract_ranges(m_lo, m_hi, cut_lo, cut_hi)
    assert len(s_lo) == 0 or is_normal(s_lo, s_hi)
    assert np.array_equal(covered(s_lo, s_hi, size), covered(m_lo, m_hi, size) & ~covered(cut_lo, cut_hi, size))

    slow = [np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
    assert np.array_equal(expand_ranges(lo, hi), np.concatenate(slow) if slow else [])
    r_lo, r_hi = runs(expand_ranges(lo, hi))
    assert np.array_equal(r_lo, m_lo) and np.array_equal(r_hi, m_hi)


@pytest.fixture
def stored(tmp_path):
    """A file of 100,000 random bytes in fsspec's memory file system, its URL and its bytes."""
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    url = f"memory://{tmp_path.name}/tokens.bin"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    yield url, np.frombuffer(data, np.uint8)
    fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_exact_ranges_fetched_ahead_are_read_without_the_network(stored, tmp_path):
    """A random sampler's steps: each step's ranges fetched ahead (coalesced) are what is fetched, about the bytes the
    steps read, and the reads then fetch nothing; the disk never holds more than the capacity."""
    url, data = stored
    cache = BlockCache(tmp_path / "c", capacity=4_000)
    sid = cache.add_file(url, len(data))
    rng = np.random.default_rng(1)
    needed, peak = 0, 0
    for step in range(30):
        lo, hi = random_ranges(rng, 8, len(data))
        cache.release(step)
        assert cache.fetch_ahead([(step, [(sid, *coalesce_ranges(lo, hi))])])
        got = cache.read(sid, lo, hi)
        assert np.array_equal(got, data[expand_ranges(lo, hi)])
        needed += int(covered(lo, hi, len(data)).sum())
        peak = max(peak, cache.disk_bytes())
    assert cache.demand_reads == 0 and peak <= 4_000
    assert cache.fetched_bytes <= 1.1 * needed  # (random ranges far apart: almost no gap bridged)


def test_pinned_ranges_are_never_evicted_and_a_full_cache_fetches_nothing(stored, tmp_path):
    url, data = stored
    cache = BlockCache(tmp_path / "c", capacity=1_000)
    sid = cache.add_file(url, len(data))
    def step(a: int) -> list:
        return [(sid, np.array([a]), np.array([a + 400]))]

    assert cache.fetch_ahead([(0, step(0)), (1, step(10_000))])
    assert not cache.fetch_ahead([(2, step(20_000))])  # 1,200 bytes pinned: no room, nothing fetched
    assert cache.fetched_bytes == 800 and cache.pinned == 800
    # a read of what no piece holds is fetched on demand, and not kept where only pinned bytes would have to go
    assert np.array_equal(cache.read(sid, *step(30_000)[0][1:]), data[30_000:30_400]) and cache.demand_reads == 1
    assert cache.disk_bytes() == 800
    cache.release(1)  # step 0 has run: its piece may go
    assert cache.fetch_ahead([(2, step(20_000))]) and cache.disk_bytes() == 800
    assert np.array_equal(cache.read(sid, np.array([10_100, 20_050]), np.array([10_300, 20_060])),
                          np.concatenate([data[10_100:10_300], data[20_050:20_060]]))
    assert cache.demand_reads == 1


def test_reads_across_pieces_and_holes(stored, tmp_path):
    """Ranges held partly by several pieces, partly by none: the right bytes, the holes fetched once, exactly."""
    url, data = stored
    cache = BlockCache(tmp_path / "c", capacity=10**6)
    sid = cache.add_file(url, len(data))
    assert cache.fetch_ahead([(0, [(sid, np.array([100, 300]), np.array([200, 400]))])])
    lo, hi = np.array([150, 50, 350]), np.array([350, 120, 360])  # two pieces and the hole between; 50..100
    assert np.array_equal(cache.read(sid, lo, hi), data[expand_ranges(lo, hi)])
    assert cache.fetched_bytes == 200 + 100 + 50 and cache.demand_reads == 2
    assert np.array_equal(cache.read(sid, lo, hi), data[expand_ranges(lo, hi)]) and cache.demand_reads == 2


def test_steps_read_in_order_come_in_one_request_a_stream(stored, tmp_path):
    """A batch of steps whose ranges follow each other (a sequential sampler over an order-preserving pack) is one
    request a stream, pinned until the last of those steps has run."""
    url, data = stored
    cache = BlockCache(tmp_path / "c", capacity=10**6)
    a, b = cache.add_file(url, len(data)), cache.add_file(url, len(data))
    steps = [(s, [(a, np.array([100 * s]), np.array([100 * s + 100])),
                  (b, np.array([50 * s]), np.array([50 * s + 50]))]) for s in range(4)]
    assert cache.fetch_ahead(steps) and cache.requests == 2 and cache.fetched_bytes == 400 + 200
    cache.release(3)
    assert cache.pinned == 600  # (one piece a stream, needed by step 3 still)
    cache.release(4)
    assert cache.pinned == 0 and cache.used == 600
    assert np.array_equal(cache.read(b, np.array([120]), np.array([180])), data[120:180]) and cache.demand_reads == 0
