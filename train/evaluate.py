"""Validation: where the validation bins are, and how an evaluation splits them over the ranks.

``xprep pack --split TRAIN,VALID`` writes the held-out documents as an ordinary pack entry (a blend's: a
blend of every source's held-out bins, each once) and names it in PACKED/manifest.json under
``"validation"``, beside ``"current"``. An evaluation reads M bins of it, evenly spaced over the
entry (``spaced_bins``): ``--eval-bins M``, ``all``, or by default ``DEFAULT_EVAL_BINS``. Spaced, not
the first M: a multipack entry is ordered longest bins first and a blend's by source, and the first M
would sample one end of it. DP rank r takes the r-th, (r + dp)-th, … of them in micro-batches of the
training micro-batch size, and the CP ranks of a DP rank read the same bins and keep each its zigzag
share, as in training. Summed over all ranks and divided by the global number of target tokens, the
loss is then exact for any dp × cp. Every rank runs the same number of forwards (FSDP2 gathers
parameters in each, CP gathers keys and values): a rank whose share has run out runs a filler
micro-batch whose sums it does not count.

Named sets: ``xtrain run --eval NAME=PACKED_OR_ENTRY`` (repeatable) adds evaluation sets beside the pack's own
validation entry, which is the set named ``valid`` (``DEFAULT_SET``); each is evaluated when validation is due
and logged under ``eval/NAME/...`` (train/metrics.py). The pack's ``--split`` test entry (``xprep pack --split
TRAIN,VALID,TEST``), or ``--test NAME=PACKED_OR_ENTRY``, is evaluated once, after the last step. Every set is read
as the validation entry is (same bins rule, same rounds), and must have the training pack's tokenizer and
capacity (``check_matches``).

Why 256 bins by default: the validation loss is a mean over bins, whose standard error over 256 of
them (spread over the entry, so nearly independent) is 1/16 of the standard deviation of the per-bin
losses: enough to compare checkpoints and see over-fitting, for the forwards of about
256 / (global batch) training steps, whatever the size of the held-out part. Evaluating every bin of
a large held-out part took 12 silent minutes after a 4-step CPU run; ``--eval-bins all`` still does
that, with progress (``EvalProgress``).
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from xprep.prep.io import read_json
from xprep.train.data import PackedDataset
from xprep.train.loss import Channels

VALIDATION_KEY = "validation"  # of PACKED/manifest.json: the name of the validation entry
TEST_KEY = "test"  # and of the test entry (a three-share --split)
DEFAULT_SET = "valid"  # the name the pack's own validation entry is evaluated and logged under
DEFAULT_TEST = "test"  # the name the pack's own test entry is evaluated under
DEFAULT_EVAL_BINS = 256  # bins an evaluation reads unless --eval-bins says otherwise (see the module docstring)
PROGRESS_EVERY = 30.0  # seconds between progress lines of a long evaluation off a terminal (as xprep's default)


def validation_entry(packed: str | Path, entry: str | Path | None = None, part: str = VALIDATION_KEY) -> Path | None:
    """The validation entry of the training entry a run reads: of the cache's current entry, the one
    PACKED/manifest.json names as ``"validation"``; of another entry of the cache — PACKED given as
    ``PACKED/ENTRY``, or ``entry`` (a resume pinned to the entry its checkpoint names) — the one recorded for
    that entry (``recorded_validation``), never the current one's. None when there is none, or when the
    entry given is not inside a pack cache. ``part``: ``TEST_KEY`` for the test entry instead."""
    packed = Path(packed)
    if entry is None and any((packed / f).is_file() for f in (PACK_JSON, BLEND_JSON)):  # PACKED is an entry
        packed, entry = packed.parent, packed
    if not (packed / MANIFEST).is_file():
        return None
    manifest = read_json(packed / MANIFEST, "pack cache manifest", "re-run `xprep pack`")
    if not isinstance(manifest, dict):
        return None
    if entry is None or Path(entry).name == manifest.get("current"):
        name = manifest.get(part)
    else:
        name = recorded_validation(packed, Path(entry).name, manifest, part)
    if name is None:
        return None
    if not isinstance(name, str) or not any((packed / name / f).is_file() for f in (PACK_JSON, BLEND_JSON)):
        raise XprepError(f"{packed / MANIFEST}: names {part} entry {name!r}, which is missing; re-run the "
                         "`xprep pack ... --split` that wrote it")
    return packed / name


def recorded_validation(packed: Path, name: str, manifest: dict, part: str = VALIDATION_KEY) -> str | None:
    """The validation entry written with entry ``name`` of the cache ``packed`` (its ``--split`` part).

    Its manifest row's ``"validation"`` when the cache records it there; else, for a plain entry, the one
    its pack.json's ``split`` names; for a blend, the blend (of the held-out parts, each bin once) whose
    sources are the validation parts of the blend's own sources. None when the entry was not split. ``part``:
    the same of the test entry (``TEST_KEY``).
    """
    row = (manifest.get("entries") or {}).get(name)
    if isinstance(row, dict) and isinstance(row.get(part), str):
        return row[part]
    meta = _entry_meta(packed / name)
    if meta.get("kind") != "blend":
        split = meta.get("split") or {}
        if split.get("part") in (VALIDATION_KEY, TEST_KEY):
            return None  # a held-out part has none of its own
        return (split.get("entries") or {}).get(part)
    held = [recorded_validation(packed, row.get("entry", ""), manifest, part) for row in meta.get("sources") or []]
    if not held or None in held:
        return None
    for candidate in sorted(packed.glob(f"*/{BLEND_JSON}")):
        other = _entry_meta(candidate.parent)
        if [row.get("entry") for row in other.get("sources") or []] == held:
            return candidate.parent.name
    return None


def _entry_meta(path: Path) -> dict:
    """An entry's pack.json or blend.json; {} when it has neither (or it does not read as an object)."""
    for file in (PACK_JSON, BLEND_JSON):
        if (path / file).is_file():
            meta = read_json(path / file, "pack entry's metadata", "re-run `xprep pack --force`")
            return meta if isinstance(meta, dict) else {}
    return {}


def spaced_bins(n_total: int, n: int) -> list[int]:
    """``n`` of bins ``0 … n_total-1``, evenly spaced (bin ⌊i·n_total/n⌋ for i < n): all of them when n ≥ n_total."""
    n = min(n, n_total)
    return [i * n_total // n for i in range(n)]


def eval_rounds(bins: Sequence[int], dp_rank: int, dp: int, micro: int) -> list[list[int]]:
    """DP rank ``dp_rank``'s micro-batches of ``bins`` (its r-th, (r+dp)-th, …), as many on every rank
    (trailing ones empty: the rank only keeps in step with the others)."""
    mine = list(bins[dp_rank::dp])
    rounds = math.ceil(math.ceil(len(bins) / dp) / micro)
    return [mine[i * micro : (i + 1) * micro] for i in range(rounds)]


@dataclass
class Validation:
    """The validation bins this rank evaluates, when, and the channels their loss is summed by."""

    dataset: PackedDataset
    channels: Channels
    rounds: list[list[int]]  # this rank's micro-batches (eval_rounds)
    bins: int  # evaluated by all ranks together
    every: int | None  # steps; None or 0: at the end only
    name: str = DEFAULT_SET  # logged as eval/NAME/... (the test set: test/NAME/...)

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after ``step``: every ``every`` steps, and after the last one."""
        return step == last_step or bool(self.every) and step % self.every == 0


class EvalProgress:
    """Progress of one evaluation, on rank 0: a line redrawn in place on a terminal (~4 times a second), else
    a plain line every ``interval`` seconds (logs of batch jobs), as ``xprep.prep.progress.Progress`` does for
    xprep. A short evaluation shows nothing; ``close`` clears the terminal line for the result's."""

    def __init__(self, step: int, rounds: int, bins: int, stream=None, interval: float = PROGRESS_EVERY):
        self.step, self.rounds, self.bins = step, rounds, bins
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.25 if self.tty else interval
        self.start = self._last = time.perf_counter()
        self._drawn = 0  # width of the terminal line drawn so far, to clear it

    def update(self, done: int) -> None:
        """``done`` of the ``rounds`` micro-batches are evaluated."""
        now = time.perf_counter()
        if self.interval and now - self._last >= self.interval and done < self.rounds:
            self._last = now
            self._draw(self.line(done, now))

    def line(self, done: int, now: float) -> str:
        elapsed = now - self.start
        eta = elapsed / done * (self.rounds - done) if done else 0.0
        share = done / max(self.rounds, 1)
        return (f"evaluating after step {self.step}: {round(self.bins * share):,}/{self.bins:,} bins "
                f"({100 * share:.0f}%)  {elapsed:.0f}s  ETA {eta:.0f}s")

    def _draw(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self._drawn))
            self._drawn = max(self._drawn, len(text))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()


def open_validation(path: Path, train: PackedDataset, cp_size: int, verify_data: bool) -> PackedDataset:
    """The validation entry opened for ``cp_size`` CP ranks; its tokens must be the training pack's."""
    dataset = PackedDataset(path, verify_data=verify_data, cp_size=cp_size, **_streaming(train))
    if dataset.vocab_size != train.vocab_size:
        raise XprepError(f"validation entry {path}: its datasets have vocabulary size {dataset.vocab_size}, the "
                         f"training pack's {train.vocab_size}; pack both from data of the same tokenizer")
    return dataset


def parse_named_set(text: str, flag: str) -> tuple[str, str]:
    """``NAME=PACKED_OR_ENTRY`` → (NAME, path): NAME of letters, digits, ``_.-`` (it is a metrics key)."""
    name, sep, path = text.partition("=")
    if not sep or not path or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise XprepError(f"{flag} {text!r}: expected NAME=PACKED_OR_ENTRY, NAME of letters, digits, '_', '.' or "
                         f"'-', e.g. {flag} wiki=packed/wiki")
    return name, path


def open_named_set(name: str, path: str, flag: str, train: PackedDataset, cp_size: int,
                   verify_data: bool) -> PackedDataset:
    """Evaluation set ``name``: a pack cache (its current entry) or an entry, opened for ``cp_size`` CP ranks, and
    refused unless it was tokenized as the training pack was and packed at its capacity."""
    if not Path(path).exists():
        raise XprepError(f"{flag} {name}={path}: no such pack cache or entry; pack it with `xprep pack` first")
    dataset = PackedDataset(path, verify_data=verify_data, cp_size=cp_size, **_streaming(train))
    check_matches(name, flag, dataset, train)
    return dataset


def _streaming(train: PackedDataset) -> dict:
    """The training pack's --cache-size and --stream-timeout, for an evaluation set's datasets at URLs (each set
    has a cache of its own, read on demand: no prefetcher)."""
    return {"cache_size": train.cache_size, "stream_timeout": train.stream_timeout}


def _tokenizers(dataset: PackedDataset) -> set:
    return {(ds.manifest.get("tokenizer") or {}).get("sha256") for ds in dataset.datasets}


def check_matches(name: str, flag: str, dataset: PackedDataset, train: PackedDataset) -> None:
    """An evaluation set must hold token ids of the run's tokenizer, in bins of the run's capacity."""
    where = f"{flag} {name}={dataset.packed}"
    if _tokenizers(dataset) != _tokenizers(train) or dataset.vocab_size != train.vocab_size:
        raise XprepError(f"{where}: tokenized with another tokenizer than the training pack {train.packed} (tokenizer."
                         "json sha256 or vocabulary size differ); tokenize it with the run's tokenizer and pack it")
    if dataset.capacity != train.capacity:
        raise XprepError(f"{where}: bins of {dataset.capacity:,} tokens, the training pack's of {train.capacity:,}; "
                         f"pack it at the run's capacity ({train.entry.config.get('method')} pack, "
                         f"{train.capacity:,} tokens)")
