"""What a step measured, and where it goes: ``metrics.jsonl`` (every step) and the console (rank 0 only).

A step with no target token (all its bins are padding or prompts) has no loss: ``loss`` is null on its
record (never 0, which would pass for the best), "none (no target tokens)" on the console, and the run
report counts such steps apart (train/report.py); an evaluation without targets likewise.

A step that evaluated on the validation bins carries its ``EvalMetrics``: they go on the same
metrics.jsonl record (``eval_loss``, ``eval_category_loss``, ``eval_source_loss``, ``eval_target_tokens``,
``eval_bins``) and on a console line of their own, whatever ``log_every`` says. Every evaluation set (the
validation entry is the set named ``valid``; ``xtrain run --eval NAME=...`` adds others) also goes on the record
under ``eval/NAME/`` + ``loss``, ``category_loss``, ``source_loss``, ``target_tokens``, ``bins``; the test set,
evaluated once after the last step, under ``test/NAME/`` on the last step's record. The ``eval_*`` keys stay the
``valid`` set's (what "best" checkpoints follow, and what runs logged before named sets existed hold).

Throughput and memory ride on every record: ``tokens_per_s`` (all ranks' real tokens / step time),
``tflops`` (model TFLOPS achieved per GPU) and ``mfu`` (its fraction of the GPU's peak; null when the
peak or the model's FLOPs are unknown, e.g. on a CPU without ``--peak-tflops``), ``mfu_6n`` (the same in
PaLM's and torchtitan's 6N + 12·L·H·D·T convention, to compare with theirs: train/flops.py),
``peak_mem_bytes`` (CUDA max allocated in the step; null off CUDA) and ``peak_rss_bytes`` (the
process's peak RSS), both the maximum over ranks (train/memory.py). The console line shows both MFUs
(``MFU 38.2% (6N 47.5%)``) and the peak memory of its interval. Extra backends (TensorBoard, W&B:
train/loggers.py) get the same numbers as metrics.jsonl, as flat scalars.

A run with loss weights (train/loss_weights.py) logs as ``loss`` the weighted loss it trains on, Σ w·CE / Σ w,
and the plain token mean as ``token_loss``; ``weightless`` marks a step whose targets all weigh 0 (no loss, no
update). An unweighted run's records have neither key, and its ``loss`` is the token mean as ever. The channel
losses and the validation loss are never weighted.

A bad step (non-finite loss or gradient norm; its update skipped: train/trainer.py) has ``skipped`` true and
``bad_steps``, the bad steps in a row up to it (0 on a good step); its non-finite values are null (JSON has
no NaN), and the console says it on a line of its own, whatever ``log_every`` says.

metrics.jsonl is never truncated: a run that resumes from step S (a killed run may have logged past its
last checkpoint, or ``--resume`` named an earlier one) moves the lines of the steps after S to
``metrics.jsonl.replayed-N`` (N = 1, 2, ... one file per resume that replays steps), unchanged, then
appends; the live file has every step once, and the replayed files are the history of what was redone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xprep.prep.io import fsync_dir
from xprep.train.evaluate import DEFAULT_SET
from xprep.train.loggers import Logger, scalars


@dataclass
class EvalMetrics:
    """Loss over the validation bins: Σ CE / Σ targets over all of them, per category and per source (None
    without targets)."""

    loss: float | None
    category_loss: dict[str, float]
    source_loss: dict[str, float]
    targets: int
    bins: int
    seconds: float

    def record(self) -> dict:
        return {"eval_loss": self.loss, "eval_category_loss": self.category_loss,
                "eval_source_loss": self.source_loss, "eval_target_tokens": self.targets, "eval_bins": self.bins}

    def named_record(self, prefix: str) -> dict:
        """The same under ``prefix/`` (``eval/NAME`` or ``test/NAME``), flat keys as TensorBoard and W&B show them."""
        return {f"{prefix}/loss": finite(self.loss), f"{prefix}/category_loss": finite_values(self.category_loss),
                f"{prefix}/source_loss": finite_values(self.source_loss), f"{prefix}/target_tokens": self.targets,
                f"{prefix}/bins": self.bins}


@dataclass
class StepMetrics:
    """What one optimizer step measured: losses and counts over all ranks, its time, throughput and peak memory."""

    step: int
    loss: float | None  # None: the step had no target token
    category_loss: dict[str, float]
    grad_norm: float
    lr: float
    tokens: int
    targets: int
    seconds: float
    consumed_samples: int
    source_loss: dict[str, float] = field(default_factory=dict)
    eval: EvalMetrics | None = None  # of the set named valid (the pack's validation entry)
    evals: dict[str, EvalMetrics] = field(default_factory=dict)  # every set evaluated after this step, by name
    tests: dict[str, EvalMetrics] = field(default_factory=dict)  # the test set, after the last step only
    tflops: float | None = None  # model TFLOPS achieved per GPU (xprep.train.flops.Throughput)
    mfu: float | None = None  # tflops / the GPU's peak; None when either is unknown
    peak_mem_bytes: int | None = None  # CUDA max allocated during the step, max over ranks; None off CUDA
    peak_rss_bytes: int | None = None  # process peak RSS, max over ranks
    mfu_6n: float | None = None  # MFU in the 6N + 12·L·H·D·T convention (PaLM, torchtitan); None when unknown
    skipped: bool = False  # a bad step: non-finite loss or gradient norm, no update applied
    bad_steps: int = 0  # bad steps in a row up to this one (0: this step was good)
    weighted: bool = False  # --category-weight / --source-weight: ``loss`` is Σ w·CE / Σ w
    token_loss: float | None = None  # a weighted run's plain token mean (Σ CE / Σ targets)
    weightless: bool = False  # weighted, with targets that all weigh 0: no loss, no update applied

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def record(self) -> dict:
        """The metrics.jsonl line of this step (``time`` is added when it is written)."""
        return {"step": self.step, "loss": finite(self.loss), "category_loss": finite_values(self.category_loss),
                "source_loss": finite_values(self.source_loss), "grad_norm": finite(self.grad_norm), "lr": self.lr,
                "skipped": self.skipped, "bad_steps": self.bad_steps, "tokens": self.tokens,
                "target_tokens": self.targets, "tokens_per_s": self.tokens_per_s, "tflops": self.tflops,
                "mfu": self.mfu, "mfu_6n": self.mfu_6n, "peak_mem_bytes": self.peak_mem_bytes,
                "peak_rss_bytes": self.peak_rss_bytes,
                "step_seconds": self.seconds, "consumed_samples": self.consumed_samples,
                **({"token_loss": finite(self.token_loss), "weightless": self.weightless} if self.weighted else {}),
                **(self.eval.record() if self.eval is not None else {}),
                **{k: v for name, e in self.evals.items() for k, v in e.named_record(f"eval/{name}").items()},
                **{k: v for name, e in self.tests.items() for k, v in e.named_record(f"test/{name}").items()}}


class MetricsLog:
    """metrics.jsonl (every step), one console line per interval, and every record to the ``loggers``; rank 0 only."""

    def __init__(self, run_dir: Path, total_steps: int, log_every: int, enabled: bool, stream=None,
                 loggers: Sequence[Logger] = ()):
        self.path = run_dir / "metrics.jsonl"
        self.total, self.every, self.enabled = total_steps, log_every, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.loggers = list(loggers)  # rank 0's TensorBoard / W&B (xprep.train.loggers.build_loggers); closed here
        self._file = None
        self._t0 = time.perf_counter()
        self._first_step: int | None = None
        self._interval = Interval()

    def open(self, resumed_step: int) -> None:
        """Append to metrics.jsonl from the resumed step on; the lines of later steps are set aside first
        (``set_aside``), and said on the console."""
        if not self.enabled:
            return
        aside = set_aside(self.path, resumed_step) if self.path.is_file() else None
        if aside is not None:
            self.stream.write(f"{self.path}: the lines of the steps after {resumed_step}, trained again now, moved "
                              f"to {aside.name}\n")
        self._file = open(self.path, "a")

    def write(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        if self._first_step is None:
            self._first_step, self._t0 = m.step - 1, time.perf_counter() - m.seconds
        record = {**m.record(), "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for logger in self.loggers:
            logger.log(m.step, scalars(record))
        self._interval.add(m)
        if m.skipped:
            self._console_skipped(m)
        if m.weightless:
            self.stream.write(("\r" if self.tty else "") + f"step {m.step}/{self.total}: every target token of the "
                              "step weighs 0 (--category-weight, --source-weight): no loss, no update applied\n")
        interval = m.step % self.every == 0 or m.step == self.total
        if interval or self.tty:
            self._console(m, interval)
        if m.eval is not None and not m.evals:
            self._console_eval(m.step, m.eval)
        for name, e in m.evals.items():
            self._console_eval(m.step, e, "eval" if list(m.evals) == [DEFAULT_SET] else f"eval/{name}")
        for name, e in m.tests.items():
            self._console_eval(m.step, e, f"test/{name}")

    def _console(self, m: StepMetrics, interval: bool) -> None:
        """A line per interval (tokens/s averaged over it); on a terminal also a live line every step."""
        elapsed = time.perf_counter() - self._t0
        done = m.step - self._first_step
        eta = elapsed / done * (self.total - m.step) if done else 0.0
        tokens = f" (token mean {loss_text(m.token_loss)})" if m.weighted else ""
        line = (f"step {m.step}/{self.total}  loss {loss_text(m.loss)}{tokens}  lr {m.lr:.2e}  grad {m.grad_norm:.3f}  "
                f"{self._interval.rate:,.0f} tok/s{self._interval.perf()}  ETA {clock(eta)}")
        self.stream.write(("\r" if self.tty else "") + line + ("\n" if interval else " "))
        self.stream.flush()
        if interval:
            self._interval = Interval()

    def _console_skipped(self, m: StepMetrics) -> None:
        """One line per bad step: what was non-finite, and how many in a row."""
        bad = [f"{name} {value}" for name, value in (("loss", m.loss), ("gradient norm", m.grad_norm))
               if value is not None and not math.isfinite(value)]
        self.stream.write(("\r" if self.tty else "") + f"step {m.step}/{self.total} skipped: non-finite "
                          f"{' and '.join(bad)} (no update, lr schedule held); {m.bad_steps} bad step"
                          f"{'s' * (m.bad_steps > 1)} in a row\n")
        self.stream.flush()

    def _console_eval(self, step: int, e: EvalMetrics, what: str = "eval") -> None:
        """One line per evaluation: the loss, then per category and per source (more than one source); ``what``:
        ``eval``, or ``eval/NAME`` / ``test/NAME`` when the run has more than one set."""
        parts = [f"{what} step {step}/{self.total}  loss {loss_text(e.loss)}"]
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
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()


@dataclass
class Interval:
    """What the console line of a log interval averages: tokens/s and MFU over its time, peak memory over its steps."""

    tokens: int = 0
    seconds: float = 0.0
    mfu_seconds: float = 0.0  # Σ mfu·seconds of the steps that have an MFU (= Σ FLOPs / GPUs / peak)
    timed: float = 0.0  # Σ seconds of those steps
    mfu_6n_seconds: float = 0.0  # the same of mfu_6n
    timed_6n: float = 0.0
    peak_mem: int | None = None
    peak_rss: int | None = None

    def add(self, m: StepMetrics) -> None:
        self.tokens += m.tokens
        self.seconds += m.seconds
        if m.mfu is not None:
            self.mfu_seconds += m.mfu * m.seconds
            self.timed += m.seconds
        if m.mfu_6n is not None:
            self.mfu_6n_seconds += m.mfu_6n * m.seconds
            self.timed_6n += m.seconds
        self.peak_mem = _max(self.peak_mem, m.peak_mem_bytes)
        self.peak_rss = _max(self.peak_rss, m.peak_rss_bytes)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def perf(self) -> str:
        """"  MFU 41.2% (6N 50.3%)  mem 12.3 GiB" (CUDA) or "  rss 1.2 GiB" (CPU): what of it is known."""
        out = f"  MFU {100 * self.mfu_seconds / self.timed:.1f}%" if self.timed else ""
        if self.timed and self.timed_6n:  # an mfu_6n comes with an mfu (it needs the same peak and FLOPs)
            out += f" (6N {100 * self.mfu_6n_seconds / self.timed_6n:.1f}%)"
        if self.peak_mem is not None:
            out += f"  mem {gib(self.peak_mem)}"
        elif self.peak_rss is not None:
            out += f"  rss {gib(self.peak_rss)}"
        return out


REPLAYED = ".replayed-"  # metrics.jsonl.replayed-N: lines of steps trained again after a resume


def set_aside(path: Path, resumed_step: int) -> Path | None:
    """Move the lines of steps after ``resumed_step`` (and any line that is not a record: a killed run's torn
    last line) from ``path`` to the next ``path.replayed-N``, unchanged; None when there are none.

    Streamed into two temporary files, each renamed over its name: the replayed file first, so a crash
    in between leaves the lines in both files, never in neither.
    """
    aside = replayed_path(path)
    tmp_kept, tmp_aside = (p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in (path, aside))
    moved = 0
    try:
        with open(path) as lines, open(tmp_kept, "w") as kept, open(tmp_aside, "w") as later:
            for line in lines:
                line = line if line.endswith("\n") else line + "\n"
                step = line_step(line)
                if step is not None and step <= resumed_step:
                    kept.write(line)
                else:
                    later.write(line)
                    moved += 1
            for f in (kept, later):
                f.flush()
                os.fsync(f.fileno())
        if moved:
            os.replace(tmp_aside, aside)
            os.replace(tmp_kept, path)
            fsync_dir(path.parent)
    finally:
        tmp_kept.unlink(missing_ok=True)
        tmp_aside.unlink(missing_ok=True)
    return aside if moved else None


def replayed_path(path: Path) -> Path:
    """The next free ``path.replayed-N`` (N counts up from 1)."""
    taken = [int(p.name.rpartition("-")[2]) for p in replayed_files(path)]
    return path.with_name(f"{path.name}{REPLAYED}{max(taken, default=0) + 1}")


def replayed_files(path: Path) -> list[Path]:
    """``path``'s replayed files, oldest first."""
    found = [p for p in path.parent.glob(f"{path.name}{REPLAYED}*") if p.name.rpartition("-")[2].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rpartition("-")[2]))


def line_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None when it is not a record (torn, or no step)."""
    with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError, ValueError):
        step = json.loads(line).get("step")
        return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None
    return None


def finite(value: float | None) -> float | None:
    """A metric as metrics.jsonl records it: null when not finite (JSON has no NaN)."""
    return value if value is None or math.isfinite(value) else None


def finite_values(values: dict[str, float]) -> dict[str, float]:
    """A channel's losses without the non-finite ones (a bad step's)."""
    return {k: v for k, v in values.items() if math.isfinite(v)}


def loss_text(loss: float | None) -> str:
    """A loss on the console: four decimals, or what a step without targets has instead."""
    return "none (no target tokens)" if loss is None else f"{loss:.4f}"


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def gib(n: int) -> str:
    """Bytes in GiB, one decimal (``12.3 GiB``)."""
    return f"{n / 2**30:.1f} GiB"


def best_step(states: dict[int, dict]) -> tuple[int, str] | None:
    """Which of several steps' records (trainer.json of checkpoints) is the best, and by which key: the
    lowest ``eval_loss`` where any record has one (validation loss follows generalization), else the
    lowest training ``loss``. None when no record has either. A step without targets has a null loss and
    is never the best."""
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
