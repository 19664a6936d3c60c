"""What a step measured, and where it goes: ``metrics.jsonl`` (every step) and the console (rank 0 only).

A step that evaluated on the validation bins carries its ``EvalMetrics``: they go on the same
metrics.jsonl record (``eval_loss``, ``eval_category_loss``, ``eval_source_loss``, ``eval_target_tokens``,
``eval_bins``) and on a console line of their own, whatever ``log_every`` says.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prep.io import write_atomic


@dataclass
class EvalMetrics:
    """Loss over the validation bins: Σ CE / Σ targets over all of them, per category and per source."""

    loss: float
    category_loss: dict[str, float]
    source_loss: dict[str, float]
    targets: int
    bins: int
    seconds: float

    def record(self) -> dict:
        return {"eval_loss": self.loss, "eval_category_loss": self.category_loss,
                "eval_source_loss": self.source_loss, "eval_target_tokens": self.targets, "eval_bins": self.bins}


@dataclass
class StepMetrics:
    step: int
    loss: float
    category_loss: dict[str, float]
    grad_norm: float
    lr: float
    tokens: int
    targets: int
    seconds: float
    consumed_samples: int
    source_loss: dict[str, float] = field(default_factory=dict)
    eval: EvalMetrics | None = None


class MetricsLog:
    """metrics.jsonl (every step) and one console line per interval; rank 0 only."""

    def __init__(self, run_dir: Path, total_steps: int, log_every: int, enabled: bool, stream=None):
        self.path = run_dir / "metrics.jsonl"
        self.total, self.every, self.enabled = total_steps, log_every, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._file = None
        self._t0 = time.perf_counter()
        self._first_step: int | None = None
        self._tokens, self._seconds = 0, 0.0

    def open(self, resumed_step: int) -> None:
        """Keep the lines of steps ≤ the resumed step (a killed run may have logged more)."""
        if not self.enabled:
            return
        kept = []
        if resumed_step and self.path.is_file():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    if json.loads(line).get("step", 0) <= resumed_step:
                        kept.append(line)
        write_atomic(self.path, "".join(k + "\n" for k in kept))
        self._file = open(self.path, "a")

    def write(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._t0 = m.step - 1, time.perf_counter() - m.seconds
        record = {"step": m.step, "loss": m.loss, "category_loss": m.category_loss, "source_loss": m.source_loss,
                  "grad_norm": m.grad_norm, "lr": m.lr, "tokens": m.tokens, "target_tokens": m.targets,
                  "tokens_per_s": m.tokens / m.seconds if m.seconds > 0 else None,
                  "step_seconds": m.seconds, "consumed_samples": m.consumed_samples, "time": time.time(),
                  **(m.eval.record() if m.eval is not None else {})}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._tokens += m.tokens
        self._seconds += m.seconds
        interval = m.step % self.every == 0 or m.step == self.total
        if interval or self.tty:
            self._console(m, interval)
        if m.eval is not None:
            self._console_eval(m.step, m.eval)

    def _console(self, m: StepMetrics, interval: bool) -> None:
        """A line per interval (tokens/s averaged over it); on a terminal also a live line every step."""
        elapsed = time.perf_counter() - self._t0
        done = m.step - self._first_step
        eta = elapsed / done * (self.total - m.step) if done else 0.0
        rate = self._tokens / self._seconds if self._seconds else 0.0
        line = (f"step {m.step}/{self.total}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad {m.grad_norm:.3f}  "
                f"{rate:,.0f} tok/s  ETA {clock(eta)}")
        self.stream.write(("\r" if self.tty else "") + line + ("\n" if interval else " "))
        self.stream.flush()
        if interval:
            self._tokens, self._seconds = 0, 0.0

    def _console_eval(self, step: int, e: EvalMetrics) -> None:
        """One line per evaluation: the loss, then per category and per source (more than one source)."""
        parts = [f"eval step {step}/{self.total}  loss {e.loss:.4f}"]
        if e.category_loss:
            parts.append("categories " + ", ".join(f"{k} {v:.4f}" for k, v in e.category_loss.items()))
        if len(e.source_loss) > 1:
            parts.append("sources " + ", ".join(f"{k} {v:.4f}" for k, v in e.source_loss.items()))
        parts.append(f"({e.bins:,} bins, {e.targets:,} targets, {e.seconds:.1f}s)")
        self.stream.write(("\r" if self.tty else "") + "  ".join(parts) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def best_step(states: dict[int, dict]) -> tuple[int, str] | None:
    """Which of several steps' records (trainer.json of checkpoints) is the best, and by which key: the
    lowest ``eval_loss`` where any record has one (validation loss follows generalization), else the
    lowest training ``loss``. None when no record has either."""
    for key in ("eval_loss", "loss"):
        losses = {step: float(s[key]) for step, s in states.items()
                  if isinstance(s.get(key), int | float) and not isinstance(s.get(key), bool)}
        if losses:
            return min(losses, key=losses.get), key
    return None


def clock(seconds: float) -> str:
    """Seconds as a clock, H:MM:SS (0:01:05)."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
