"""Tiny ``xtrain run``s as child processes, for a bench that proves the command end to end (bench/gpu.py).

``tiny_pack`` writes a small token dataset and packs it with ``xprep pack``'s own code (no tokenizer: random ids).
``Xtrain`` starts ``xtrain run`` as ``python -c "from xprep import cli; cli.xtrain()" run ...`` from the repository
root, so it works where the project is only a source tree (no console script installed), on the device named by
``XTRAIN_DEVICE``; each run's stdout and stderr go to files beside its run directory, and a run still alive when the
``Xtrain`` closes is killed (a bench that breaks leaves no trainer behind).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter
from xprep.prep.pack.cache import PackConfig, pack

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600.0  # one tiny run; far above what one takes, even on a loaded CPU


def tiny_pack(root: Path, vocab_size: int, capacity: int, n_docs: int = 40, seed: int = 0) -> Path:
    """``n_docs`` random documents (3 to 5/8 of ``capacity`` tokens, ids from 2) in a dataset ``root/ds``, packed
    by multipack into bins of ``capacity`` tokens in ``root/packed``; returns the pack cache."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, max(4, capacity * 5 // 8), n_docs)
    tokens = rng.integers(2, vocab_size, int(lengths.sum()), dtype=np.int64)
    with DatasetWriter(root / "ds", vocab_size) as writer:
        writer.append(tokens, lengths)
        writer.finish({"tokenizer": {"path": "none (random ids)", "vocab_size": vocab_size, "pad_id": 0,
                                     "eod_id": 1}}, CategoryTable())
    pack([root / "ds"], root / "packed", PackConfig(method="multipack", seq_len=capacity))
    return root / "packed"


class Xtrain:
    """``xtrain run`` in child processes on ``device`` ("cpu" or "cuda"); use as a context manager."""

    def __init__(self, device: str):
        path = os.environ.get("PYTHONPATH")
        self.env = {**os.environ, "XTRAIN_DEVICE": device,
                    "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
        self.children: list[subprocess.Popen] = []

    def __enter__(self) -> Xtrain:
        return self

    def __exit__(self, *exc) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()

    def start(self, run_dir: Path, args: list[str]) -> subprocess.Popen:
        """``xtrain run ARGS -o RUN_DIR``; stdout to RUN_DIR.out, stderr to RUN_DIR.err."""
        with open(f"{run_dir}.out", "wb") as out, open(f"{run_dir}.err", "wb") as err:
            child = subprocess.Popen([sys.executable, "-c", "from xprep import cli; cli.xtrain()", "run", *args, "-o",
                                      str(run_dir)], cwd=ROOT, env=self.env, stdout=out, stderr=err)
        self.children.append(child)
        return child


def wait(child: subprocess.Popen) -> int:
    """The exit status of ``child``; killed (status -9) when it runs past ``RUN_TIMEOUT_S``."""
    try:
        return child.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def signal_after_rows(child: subprocess.Popen, run_dir: Path, rows: int, signum: int) -> int:
    """Send ``signum`` to ``child`` once its metrics.jsonl holds ``rows`` rows; return how many it held then
    (0: the child ended first, and got no signal)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while child.poll() is None and time.monotonic() < deadline:
        seen = len(metrics(run_dir))
        if seen >= rows:
            os.kill(child.pid, signum)
            return seen
        time.sleep(0.005)
    return 0


def metrics(run_dir: Path) -> list[dict]:
    """The complete rows of RUN_DIR/metrics.jsonl ([] before it exists); a line being written is left out."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def stderr_lines(run_dir: Path) -> list[str]:
    return Path(f"{run_dir}.err").read_text(errors="replace").splitlines()
