"""Progress of long work: a live line on a terminal, a plain line every ``interval`` seconds elsewhere.

Logs of batch jobs (Slurm, CI, ``… 2> log``) get one self-contained line per interval, so a long
run is never silent; a terminal gets a line redrawn in place ~4 times a second.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """Documents, tokens, MB/s and (when the total input size is known) percentage and ETA."""

    def __init__(self, label: str, total_bytes: int | None = None, stream=None, interval: float = 30.0,
                 total_parts: int | None = None, part_name: str = "shards"):
        self.label = label
        self.total_bytes = total_bytes
        self.total_parts, self.part_name, self.parts = total_parts, part_name, 0  # pieces of work done / total
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.25 if self.tty else interval  # 0: no lines at all off a terminal
        self.start = self._last = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int = 0, parts: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        self.parts += parts
        now = time.perf_counter()
        if self.interval and (now - self._last >= self.interval or (parts and self.tty)):
            self._last = now
            self._draw(now)

    def line(self, now: float) -> str:
        dt = max(now - self.start, 1e-9)
        done = f" {100 * self.bytes / self.total_bytes:5.1f}%" if self.total_bytes else ""
        if self.total_parts:
            done += f"  {self.parts:,}/{self.total_parts:,} {self.part_name}"
        text = (f"{self.label}{done}  {self.docs:,} docs ({self.docs / dt:,.0f}/s)  "
                f"{self.tokens:,} tokens ({self.tokens / dt / 1e6:,.2f}M/s)  {self.bytes / dt / 1e6:,.1f} MB/s")
        if self.total_bytes and self.bytes:
            text += f"  ETA {_hms(dt * (self.total_bytes - self.bytes) / self.bytes)}"
        return text

    def _draw(self, now: float) -> None:
        if self.tty:
            self.stream.write(f"\r{self.line(now)} ")
        else:
            self.stream.write(f"{self.line(now)}  [{_hms(now - self.start)} elapsed]\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


def _hms(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
