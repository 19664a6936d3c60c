"""Fetching the next steps' data ahead when the pack's datasets are at URLs (prep/dataset/stream.py).

The bins every step reads are known in advance: the sampler's order is a function of its consumed samples, so the
exact byte ranges of every document piece a step reads are too (tokens, loss mask, categories), coalesced where a
small gap apart (``xprep.prep.dataset.stream.coalesce_ranges``). ``Prefetcher.stage`` runs in the training loop
before every step: it unpins the ranges of the steps that have run, makes sure the ranges of the step about to run
are in the block cache (fetched now, retried, if the thread has not fetched them yet; ``StreamUnavailable`` past the
retry budget, and the loop then stops with a checkpoint before the step has changed anything), then hands the
ranges of the ``steps_ahead`` steps after it to a thread that fetches them, nearest first, while the step computes.
In steady state the step reads only local bytes: ``BlockCache.demand_reads`` counts the ranges the step had to
fetch itself. The thread's requests are made by a process of its own (``FetchProcess``): a request to object storage
costs the client a few ms of CPU (s3fs: botocore builds, signs and parses it), nearly all of it holding the GIL,
which the training loop needs between its kernels; the thread only waits on a pipe.

Where the steps read in order (a sequential sampler over a pack in document order: each step's ranges start where
the last one's end), the thread reads ahead beyond the window, in one request a stream: as many steps as fit in
``READ_AHEAD_BYTES`` and half of what the cache has beside the window (the next read-ahead is fetched while this one
is still pinned), never past the run's last step: a request costs those few ms of CPU whatever its size, and a
sequential run makes a handful of requests instead of one a step.

A cache smaller than the window (``steps_ahead`` + 1 steps of data) still trains: the thread fetches as many whole
steps ahead as the cache holds (a planned step's ranges are never evicted for a later one's); smaller than one
step, the step reads what does not fit on demand, waiting on the network. ``note`` says so at the start.
"""

from __future__ import annotations

import threading

import numpy as np
from xprep.prep.dataset import COALESCE_GAP, BlockCache, FetchProcess
from xprep.train.data import PackedDataset
from xprep.train.samplers import BinSampler

DEFAULT_PREFETCH_STEPS = 4  # --prefetch-steps
# at most this many bytes read ahead beyond the window in one request where steps read in order: 80 ms at 100 MB/s,
# so the nearest steps of the same request (they come in it) are not held up long
READ_AHEAD_BYTES = 8 << 20

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
        self._horizon = 0  # the first sample of the steps not handed to the thread yet
        self._replan = False  # the thread did not fetch all it was handed: hand the window again
        self._plan: list[tuple[int, StepRanges]] = []  # the next steps (first sample, ranges), nearest first
        self._known: dict[int, StepRanges] = {}  # each step's ranges, by its first sample
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None  # the thread's last error (the step's own read raises it again)
        self._via = FetchProcess()  # makes the thread's requests (module docstring)
        if steps_ahead:
            self._via.start()
        self._thread = threading.Thread(target=self._run, name="xtrain-prefetch", daemon=True)
        self._thread.start()

    def step_bins(self, ahead: int, steps: int = 1) -> list[int]:
        """This rank's bins of ``steps`` steps from the one ``ahead`` steps after the next one (0: the next), as the
        trainer will draw them from the sampler (``BinSampler.next_micro_batch``, ``grad_accum`` times a step),
        without drawing them."""
        s = self.sampler
        first = self.step_start(ahead) + s.dp_rank * s.micro_batch_size
        starts = first + np.arange(self.grad_accum * steps, dtype=np.int64) * s.micro_batch_times_dp
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
        it unpinned; when at most ``steps_ahead - refill`` steps after it have been handed to the thread, the thread
        told to fetch the rest of the window (and to read ahead beyond it where the steps read in order)."""
        done = self.sampler.consumed_samples
        self._known = {k: v for k, v in self._known.items() if k >= done}
        self.cache.release(done)
        self.cache.fetch_ahead([(done, self.step_ranges(0))], wait=True)
        with self._cond:
            if self._replan:
                self._horizon, self._replan = 0, False
        if not self.steps_ahead or self._horizon > self.step_start(self.steps_ahead - self.refill + 1):
            return
        step = self.step_start(1) - done  # samples a step
        first = max(1, -(-(self._horizon - done) // step))
        window = [k for k in range(first, self.steps_ahead + 1) if self._before_end(k)]
        plan = [(self.step_start(k), self.step_ranges(k)) for k in window]
        plan += self._read_ahead(window[-1]) if window else []
        self._horizon = plan[-1][0] + step if plan else done + step
        with self._cond:
            self._plan += plan
            self._cond.notify()

    def _before_end(self, ahead: int) -> bool:
        return self.end is None or self.step_start(ahead) < self.end

    def _read_ahead(self, last: int) -> list[tuple[int, StepRanges]]:
        """The steps after step ``last`` (the window's last) as one plan item (the first sample of the last of them,
        their ranges), when they read on where it stops (one range a stream, within a coalescing gap of its end):
        as many as ``READ_AHEAD_BYTES`` and half the cache beside the window hold (module docstring), none past the
        run's last step. Else nothing: the thread fetches the window only."""
        ranges = self.step_ranges(last)
        step_bytes = max(1, sum(int((hi - lo).sum()) for _, lo, hi in ranges))
        budget = min(READ_AHEAD_BYTES, (self.cache.capacity - (self.steps_ahead + 1) * step_bytes) // 2)
        steps = budget // step_bytes
        if self.end is not None:
            steps = min(steps, (self.end - self.step_start(last + 1)) // (self.step_start(1) - self.step_start(0)))
        if steps < 1 or not _reads_on(ranges, self.step_ranges(last + 1)):
            return []
        for _ in range(2):  # (steps' bytes vary: fewer steps once if these are more than the budget)
            more = self.dataset.stream_ranges(self.step_bins(last + 1, steps))
            size = sum(int((hi - lo).sum()) for _, lo, hi in more)
            if size <= budget:
                return [(self.step_start(last + steps), more)] if _reads_on(ranges, more) else []
            steps = steps * budget // size
        return []

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._plan):
                    self._cond.wait()
                if self._stopping:
                    return
                plan, self._plan = self._plan, []
            done = self.sampler.consumed_samples
            try:
                fetched = self.cache.fetch_ahead([(step, ranges) for step, ranges in plan if step >= done],
                                                 via=self._via)
            except Exception as e:  # the step's own read retries, and raises what the user must see
                self.error, fetched = e, False
            if not fetched:  # (no room yet, or an error: the steps not fetched are handed again)
                with self._cond:
                    self._replan = True

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self._via.close()


def _reads_on(ranges: StepRanges, after: StepRanges) -> bool:
    """Whether ranges ``after`` are one range a stream, each starting within a coalescing gap of where ``ranges`` end
    in its stream (an item that looks ahead overlaps the next step's by a token): the bytes read next, in order."""
    ends = {sid: int(hi[-1]) for sid, _, hi in ranges if len(hi)}
    return all(len(lo) == 1 and sid in ends and abs(int(lo[0]) - ends[sid]) <= COALESCE_GAP for sid, lo, _ in after) \
        and {sid for sid, lo, _ in after if len(lo)} == set(ends)
