"""Fetching the next steps' data ahead when the pack's datasets are at URLs (prep/dataset/stream.py).

The bins every step reads are known in advance: the sampler's order is a function of its consumed samples.
``Prefetcher.stage`` runs in the training loop before every step: it makes sure the blocks of the step about to
run are in the block cache (fetched now, retried, if the thread has not fetched them yet; ``StreamUnavailable``
past the retry budget, and the loop then stops with a checkpoint before the step has changed anything), then
hands the blocks of the ``steps_ahead`` steps after it to a thread that fetches them while the step computes.
In steady state the step reads only local blocks: ``BlockCache.demand_blocks`` counts the blocks the step had to
fetch itself.
"""

from __future__ import annotations

import threading

import numpy as np
from xprep.train.data import PackedDataset
from xprep.train.samplers import BinSampler

DEFAULT_PREFETCH_STEPS = 4  # --prefetch-steps


class Prefetcher:
    """Fetches the blocks of this rank's next steps ahead, in a thread (module docstring)."""

    def __init__(self, dataset: PackedDataset, sampler: BinSampler, grad_accum: int, steps_ahead: int):
        assert dataset.cache is not None, "a prefetcher is for packs with datasets at URLs"
        self.dataset, self.sampler, self.grad_accum, self.steps_ahead = dataset, sampler, grad_accum, steps_ahead
        self.cache = dataset.cache
        self._plan: list[list[tuple[int, np.ndarray]]] = []  # the next steps' blocks, nearest first (the thread's)
        self._known: dict[int, list[tuple[int, np.ndarray]]] = {}  # each step's blocks, by its first sample
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None  # the thread's last error (the step's own read raises it again)
        self._thread = threading.Thread(target=self._run, name="xtrain-prefetch", daemon=True)
        self._thread.start()

    def step_bins(self, ahead: int) -> list[int]:
        """This rank's bins of the step ``ahead`` steps after the next one (0: the next), as the trainer will draw
        them from the sampler (``BinSampler.next_micro_batch``, ``grad_accum`` times), without drawing them."""
        s = self.sampler
        first = s.consumed_samples + ahead * self.grad_accum * s.micro_batch_times_dp + s.dp_rank * s.micro_batch_size
        starts = first + np.arange(self.grad_accum, dtype=np.int64) * s.micro_batch_times_dp
        return s.bins_at((starts[:, None] + np.arange(s.micro_batch_size)).reshape(-1)).tolist()

    def step_blocks(self, ahead: int) -> list[tuple[int, np.ndarray]]:
        """(stream id, blocks) the step ``ahead`` steps after the next one reads: worked out once per step (each
        is planned ``steps_ahead`` times before it runs), and forgotten once it has run."""
        key = self.sampler.consumed_samples + ahead * self.grad_accum * self.sampler.micro_batch_times_dp
        if key not in self._known:
            self._known[key] = self.dataset.stream_blocks(self.step_bins(ahead))
        return self._known[key]

    def stage(self) -> None:
        """The next step's blocks in the cache (the caller stops on ``StreamUnavailable``); the thread told to
        fetch the steps after it."""
        done = self.sampler.consumed_samples
        self._known = {k: v for k, v in self._known.items() if k >= done}
        for sid, blocks in self.step_blocks(0):
            self.cache.fetch_ahead(sid, blocks, wait=True)
        plan = [self.step_blocks(k) for k in range(1, self.steps_ahead + 1)]
        with self._cond:
            self._plan = plan
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._plan):
                    self._cond.wait()
                if self._stopping:
                    return
                plan, self._plan = self._plan, []
            try:
                self._fetch(plan)
            except Exception as e:  # the step's own read retries, and raises what the user must see
                self.error = e

    def _fetch(self, plan: list[list[tuple[int, np.ndarray]]]) -> None:
        """Fetch the steps of ``plan`` in order, until the cache is full or a newer plan arrives."""
        for step in plan:
            for sid, blocks in step:
                if not self.cache.fetch_ahead(sid, blocks):
                    return  # full of blocks not read yet: the next stage, a step later, goes on
            with self._cond:
                if self._plan or self._stopping:
                    return

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
