"""Validation: where the validation bins are, and how an evaluation splits them over the ranks.

``xprep pack --split TRAIN,VALID`` writes the held-out documents as an ordinary pack entry (a blend's: a
blend of every source's held-out bins, each once) and names it in PACKED/manifest.json under
``"validation"``, beside ``"current"``. An evaluation reads the first M
bins of it (``--eval-bins M``; all by default): DP rank r takes bins r, r + dp, r + 2·dp, … in
micro-batches of the training micro-batch size, and the CP ranks of a DP rank read the same bins and
keep each its zigzag share, as in training. Summed over all ranks and divided by the global number of
target tokens, the loss is then exact for any dp × cp. Every rank runs the same number of forwards
(FSDP2 gathers parameters in each, CP gathers keys and values): a rank whose share has run out runs
a filler micro-batch whose sums it does not count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from prep.errors import XprepError
from prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from prep.io import read_json
from train.data import PackedDataset
from train.loss import Channels

VALIDATION_KEY = "validation"  # of PACKED/manifest.json: the name of the validation entry


def validation_entry(packed: str | Path) -> Path | None:
    """The entry PACKED/manifest.json names as validation; None when it names none, or PACKED is an entry."""
    packed = Path(packed)
    if (packed / PACK_JSON).is_file() or not (packed / MANIFEST).is_file():
        return None
    manifest = read_json(packed / MANIFEST, "pack cache manifest", "re-run `xprep pack`")
    name = manifest.get(VALIDATION_KEY) if isinstance(manifest, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or not any((packed / name / f).is_file() for f in (PACK_JSON, BLEND_JSON)):
        raise XprepError(f"{packed / MANIFEST}: names validation entry {name!r}, which is missing; re-run the "
                         "`xprep pack ... --split` that wrote it")
    return packed / name


def eval_rounds(n_bins: int, dp_rank: int, dp: int, micro: int) -> list[list[int]]:
    """DP rank ``dp_rank``'s micro-batches of bins ``0 … n_bins-1``, as many on every rank (trailing ones
    empty: the rank only keeps in step with the others)."""
    mine = list(range(dp_rank, n_bins, dp))
    rounds = math.ceil(math.ceil(n_bins / dp) / micro)
    return [mine[i * micro : (i + 1) * micro] for i in range(rounds)]


@dataclass
class Validation:
    """The validation bins this rank evaluates, when, and the channels their loss is summed by."""

    dataset: PackedDataset
    channels: Channels
    rounds: list[list[int]]  # this rank's micro-batches (eval_rounds)
    bins: int  # evaluated by all ranks together
    every: int | None  # steps; None or 0: at the end only

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate after ``step``: every ``every`` steps, and after the last one."""
        return step == last_step or bool(self.every) and step % self.every == 0


def open_validation(path: Path, train: PackedDataset, cp_size: int, verify_data: bool) -> PackedDataset:
    """The validation entry opened for ``cp_size`` CP ranks; its tokens must be the training pack's."""
    dataset = PackedDataset(path, verify_data=verify_data, cp_size=cp_size)
    if dataset.vocab_size != train.vocab_size:
        raise XprepError(f"validation entry {path}: its datasets have vocabulary size {dataset.vocab_size}, the "
                         f"training pack's {train.vocab_size}; pack both from data of the same tokenizer")
    return dataset
