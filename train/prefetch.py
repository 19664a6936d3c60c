"""Fetching the next steps' data ahead when the pack's datasets are at URLs (prep/dataset/stream.py).

The bins every step reads are known in advance: the sampler's order is a function of its consumed samples, so the
exact byte ranges of every document piece a step reads are too (tokens, loss mask, categories), coalesced where a
small gap apart (``xprep.prep.dataset.stream.coalesce_ranges``). ``Prefetcher.stage`` runs in the training loop
before every step: it unpins the ranges of the steps that have run, makes sure the ranges of the step about to run
are in the block cache (fetched now, retried, if the thread has not fetched them yet; ``StreamUnavailable`` past the
retry budget, and the loop then stops with a checkpoint before the step has changed anything), then hands the
ranges of the ``steps_ahead`` steps after it to a thread that fetches them, nearest first, while the step computes.
In steady state the step reads only local bytes: ``BlockCache.demand_reads`` counts the ranges the step had to
fetch itself.

A cache smaller than the window (``steps_ahead`` + 1 steps of data) still trains: the thread fetches as many whole
steps ahead as the cache holds (a planned step's ranges are never evicted for a later one's); smaller than one
step, the step reads what does not fit on demand, waiting on the network. ``note`` says so at the start.
"""

from __future__ import annotations

import threading

import numpy as np
from xprep.prep.dataset import BlockCache
from xprep.train.data import PackedDataset
from xprep.train.samplers import BinSampler

DEFAULT_PREFETCH_STEPS = 4  # --prefetch-steps

StepRanges = list[tuple[int, np.ndarray, np.ndarray]]  # (stream id, sorted disjoint byte ranges) a step reads


class Prefetcher:
    """Fetches the byte ranges of this rank's next steps ahead, in a thread (module docstring)."""

    def __init__(self, dataset: PackedDataset, sampler: BinSampler, grad_accum: int, steps_ahead: int,
                 steps_left: int | None = None):
        assert dataset.cache is not None, "a prefetcher is for packs with datasets at URLs"
        self.dataset, self.sampler, self.grad_accum, self.steps_ahead = dataset, sampler, grad_accum, steps_ahead
        self.cache: BlockCache = dataset.cache
        # the first sample after the run's last step (``steps_left`` from now): nothing past it is fetched
        self.end = None if steps_left is None else self.step_start(steps_left)
        # the thread tops the window up every ``refill`` steps, ``refill`` steps at a time: steps read in order
        # then come in one request a stream (their ranges touch), and the window never drops below half
        self.refill = max(1, (steps_ahead + 1) // 2)
        self._staged = 0
        self._plan: list[tuple[int, StepRanges]] = []  # the next steps (first sample, ranges), nearest first
        self._known: dict[int, StepRanges] = {}  # each step's ranges, by its first sample
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None  # the thread's last error (the step's own read raises it again)
        self._thread = threading.Thread(target=self._run, name="xtrain-prefetch", daemon=True)
        self._thread.start()

    def step_bins(self, ahead: int) -> list[int]:
        """This rank's bins of the step ``ahead`` steps after the next one (0: the next), as the trainer will draw
        them from the sampler (``BinSampler.next_micro_batch``, ``grad_accum`` times), without drawing them."""
        s = self.sampler
        first = self.step_start(ahead) + s.dp_rank * s.micro_batch_size
        starts = first + np.arange(self.grad_accum, dtype=np.int64) * s.micro_batch_times_dp
        return s.bins_at((starts[:, None] + np.arange(s.micro_batch_size)).reshape(-1)).tolist()

    def step_start(self, ahead: int) -> int:
        """The first sample (global, over every rank) of the step ``ahead`` steps after the next one: its key."""
        return self.sampler.consumed_samples + ahead * self.grad_accum * self.sampler.micro_batch_times_dp

    def step_ranges(self, ahead: int) -> StepRanges:
        """The byte ranges the step ``ahead`` steps after the next one reads: worked out once per step (each is
        planned ``steps_ahead`` times before it runs), and forgotten once it has run."""
        key = self.step_start(ahead)
        if key not in self._known:
            self._known[key] = self.dataset.stream_ranges(self.step_bins(ahead))
        return self._known[key]

    def note(self) -> str | None:
        """A line for the start of the run when ``--cache-size`` holds fewer steps than the window (judged by the
        next step's bytes), saying what that costs; None when it holds them all."""
        step = sum(int((hi - lo).sum()) for _, lo, hi in self.step_ranges(0))
        window = (self.steps_ahead + 1) * step
        if window <= self.cache.capacity:
            return None
        held = self.cache.capacity // max(step, 1)
        cost = ("each step waits on the network for what does not fit" if held == 0 else
                f"only {held - 1} step(s) are fetched ahead, which may not hide the latency")
        return (f"--cache-size {self.cache.capacity:,} bytes holds less than --prefetch-steps {self.steps_ahead} + 1 "
                f"steps of data at URLs ({window:,} bytes; a step reads about {step:,}): {cost}; give it "
                f"--cache-size {window:,} or more")

    def stage(self) -> None:
        """The next step's ranges in the cache (the caller stops on ``StreamUnavailable``), those of the steps before
        it unpinned; every ``refill`` steps, the thread told to fetch the steps after it."""
        done = self.sampler.consumed_samples
        self._known = {k: v for k, v in self._known.items() if k >= done}
        self.cache.release(done)
        self.cache.fetch_ahead([(done, self.step_ranges(0))], wait=True)
        self._staged += 1
        if (self._staged - 1) % self.refill:
            return
        plan = [(self.step_start(k), self.step_ranges(k)) for k in range(1, self.steps_ahead + 1)
                if self.end is None or self.step_start(k) < self.end]
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

    def _fetch(self, plan: list[tuple[int, StepRanges]]) -> None:
        """Fetch the steps of ``plan``, nearest first, as many as the cache holds, in one batch of requests."""
        self.cache.fetch_ahead(plan)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
