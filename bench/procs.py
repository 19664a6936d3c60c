"""Process trees of the benchmarks' commands: their descendants, and the peak of their summed RSS."""

from __future__ import annotations

import os
import threading


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (torchrun starts its ranks in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def rss_mb(pid: int) -> float:
    """VmRSS of `pid` in MB (0 once it is gone)."""
    return _proc_mb(f"/proc/{pid}/status", "VmRSS:")


def pss_mb(pid: int) -> float:
    """Proportional set size of `pid` in MB: its private pages, and each page it shares divided among the processes
    sharing it (summed over processes, what they use together); 0 once it is gone or where the kernel has no
    smaps_rollup."""
    return _proc_mb(f"/proc/{pid}/smaps_rollup", "Pss:")


def _proc_mb(path: str, key: str) -> float:
    """The kB figure of the line starting with `key` in the /proc file `path`, in MB; 0 where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class TreeRss:
    """Samples the summed RSS of `pid` and its descendants every `interval` seconds until stopped; `peak` is the
    largest sum seen, and `peak_pss` the largest sum of their PSS. The kernel's own peak (wait4's ru_maxrss) is that
    of the largest single process of the tree, which says nothing of N workers together; summed RSS counts a page
    that forked workers share with their parent once in each of them, summed PSS once in all."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval, self.peak, self.peak_pss = pid, interval, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            tree = [self.pid, *descendants(self.pid)]
            self.peak = max(self.peak, sum(rss_mb(p) for p in tree))
            self.peak_pss = max(self.peak_pss, sum(pss_mb(p) for p in tree))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak
