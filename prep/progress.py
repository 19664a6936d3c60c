"""A progress line on a terminal (docs/s, tokens/s, MB/s); silent when stderr is not a TTY."""

from __future__ import annotations

import sys
import time


class Progress:
    """Rate display refreshed at most ~4 times a second; ``close`` ends the line."""

    def __init__(self, label: str, total_bytes: int | None = None, stream=None):
        self.label = label
        self.total_bytes = total_bytes
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self._last = time.perf_counter()
        self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - self._last >= 0.25:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        dt = max(now - self.start, 1e-9)
        pct = f" {100 * self.bytes / self.total_bytes:5.1f}%" if self.total_bytes else ""
        self.stream.write(
            f"\r{self.label}{pct}  {self.docs:,} docs ({self.docs / dt:,.0f}/s)  "
            f"{self.tokens:,} tokens ({self.tokens / dt / 1e6:,.2f}M/s)  {self.bytes / dt / 1e6:,.1f} MB/s "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
