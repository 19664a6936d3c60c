"""Re-mixing a run in flight: resuming on a blend whose first bins are the ones the run has trained on.

A phased mix may change while its run trains: a later phase re-weighted, a phase appended (``xprep pack --mix``
again, into the same cache, makes the new blend current). A checkpoint names the blend it was trained on
(``pack_key``); resuming on another one is allowed when the bins the run consumed, positions
``0 … consumed_samples−1`` of its sampler's stream, are the same bins in both: the same source entry (by key: the
same datasets packed with the same options) and the same bin of it, position by position. Nothing else decides
what the resumed run trains on next, so the run goes on exactly as a run on the new blend from the start would,
and its lineage (``--seen``) read through the new blend names the same documents for every step before the change.

The check reads the blends' arrays alone (``bin_source``, ``bin_index``: 6 bytes a bin), never token data. The old
blend may have left the cache since, so a run keeps what the check needs: every blend entry it trains on is kept in
``RUN/blends/<entry>/`` (blend.json and its two arrays, hard links of the immutable entry's files where the file
system allows, else copies), written atomically by rank 0 when training starts.

The check applies when PACKED's entry is a blend with phases and the checkpoint's entry was a blend (kept in the run
or still in the cache); otherwise resuming follows the checkpoint's entry as before (``xprep.train.resume``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from xprep.prep.dataset import staged_copy
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON
from xprep.prep.io import read_json
from xprep.prep.pack import BlendEntry, open_entry

KEPT = "blends"  # RUN/blends/<entry name>/: what the prefix check needs of each blend the run trained on
ARRAYS = ("bin_source.npy", "bin_index.npy")
BLOCK = 1 << 20  # positions compared at a time


@dataclass
class Remix:
    """A resume onto another blend than the checkpoint's: the old one's record, and (once checked) what changed."""

    old_key: str
    old_entry: str
    old: Path  # its blend.json and arrays: kept in the run directory, or its entry in the cache
    changes: list[str] = field(default_factory=list)


def keep_blend(run_dir: Path, entry) -> None:
    """Keep the blend entry a run trains on in ``RUN/blends/`` (hard links, else copies; atomic)."""
    if not isinstance(entry, BlendEntry):
        return
    dest = Path(run_dir) / KEPT / entry.path.name
    if (dest / BLEND_JSON).is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_copy(dest, (BLEND_JSON,)) as tmp:
        for name in (*ARRAYS, BLEND_JSON):
            try:
                os.link(entry.path / name, tmp / name)
            except OSError:  # another file system, or no hard links: a copy
                shutil.copy2(entry.path / name, tmp / name)


def find_remix(packed: str | Path, saved: dict, run_dir: Path) -> Remix | None:
    """A ``Remix`` when PACKED's entry is a blend with phases other than the checkpoint's blend (``saved``, its
    trainer state) and the old blend's record is found; None: resume as before."""
    want, name = saved.get("pack_key"), saved.get("pack_entry")
    if not want or not name:
        return None
    with contextlib.suppress(XprepError):
        current = open_entry(packed)
        if not isinstance(current, BlendEntry) or current.key == want or not current.meta.get("phases"):
            return None
        for old in (Path(run_dir) / KEPT / name, current.path.parent / name):
            if _record_key(old) == want:
                return Remix(want, name, old)
    return None


def _record_key(path: Path) -> str | None:
    if not all((path / f).is_file() for f in (*ARRAYS, BLEND_JSON)):
        return None
    meta = read_json(path / BLEND_JSON, "kept blend metadata", "start a new run with another --output")
    return meta.get("key") if isinstance(meta, dict) else None


def check_prefix(remix: Remix, new: BlendEntry, consumed: int, bins_at: Callable[[int, np.ndarray], np.ndarray],
                 global_batch: int, checkpoint: Path) -> None:
    """Refuse unless positions ``0 … consumed−1`` serve the same bins of the same source entries in the old blend
    and in ``new`` (``bins_at(num_bins, positions)``: the run's sampler over a blend of that many bins); then
    record in ``remix.changes`` what changed."""
    old_meta = read_json(remix.old / BLEND_JSON, "kept blend metadata", "start a new run with another --output")
    old_source, old_index = (np.load(remix.old / a, mmap_mode="r") for a in ARRAYS)
    new_keys = {row["key"]: i for i, row in enumerate(new.meta["sources"])}
    same = np.array([new_keys.get(row["key"], -1) for row in old_meta["sources"]], np.int64)  # old id → new id
    for lo in range(0, consumed, BLOCK):
        positions = np.arange(lo, min(consumed, lo + BLOCK), dtype=np.int64)
        was, now = bins_at(len(old_source), positions), bins_at(new.num_bins, positions)
        was_source, was_index = np.asarray(old_source[was]).astype(np.int64), np.asarray(old_index[was])
        now_source, now_index = np.asarray(new.bin_source[now]).astype(np.int64), np.asarray(new.bin_index[now])
        differ = (same[was_source] != now_source) | (was_index != now_index)
        if differ.any():
            j = int(np.argmax(differ))
            pairs = ((old_meta, was_source[j], was_index[j]), (new.meta, now_source[j], now_index[j]))
            what = [f"bin {int(i):,} of source {meta['sources'][int(s)]['name']!r}" for meta, s, i in pairs]
            position = lo + j
            raise XprepError(
                f"{checkpoint}: this run trained on blend {remix.old_entry} up to sample {consumed:,}, and the blend "
                f"{new.path.name} that PACKED holds now differs inside that part: at sample {position:,} (step "
                f"{position // global_batch + 1}, blend bin {int(now[j]):,}) it was {what[0]}, it is now {what[1]}. "
                "Change only what comes after the samples consumed (later phases' weights, phases appended), or "
                f"start a new run with another --output (or resume on {remix.old_entry} by giving its entry)")
    remix.changes = phase_changes(old_meta.get("phases") or [], new.meta.get("phases") or [])


def phase_changes(old: list[dict], new: list[dict]) -> list[str]:
    """What differs between two blends' phases, phase by phase: weights, sizes, phases appended or removed."""
    changes = []
    for p in range(max(len(old), len(new))):
        if p >= len(old):
            changes.append(f"phase {p + 1} appended ({new[p]['size']}; {_weights_text(new[p])})")
        elif p >= len(new):
            changes.append(f"phase {p + 1} removed")
        else:
            was, now = _weights(old[p]), _weights(new[p])
            moved = [f"{n} {was.get(n, 0):g}→{now.get(n, 0):g}" for n in dict.fromkeys([*was, *now])
                     if round(was.get(n, 0), 6) != round(now.get(n, 0), 6)]
            if moved:
                changes.append(f"phase {p + 1} weights " + ", ".join(moved))
            if old[p]["size"] != new[p]["size"]:
                changes.append(f"phase {p + 1} size {old[p]['size']} → {new[p]['size']}")
    return changes or ["the blend's key (its sources' order or names, or the bins after the samples consumed)"]


def _weights(phase: dict) -> dict[str, float]:
    return {s["name"]: round(float(s["requested_share"]), 6) for s in phase["sources"]}


def _weights_text(phase: dict) -> str:
    return ", ".join(f"{n} {w:g}" for n, w in _weights(phase).items())


def schedule(entry, global_batch: int, sampler: str) -> list[dict] | None:
    """run.json's phases: each phase's first bin (= consumed samples when a sequential run enters it), the step
    that first trains on it, its size and weights; None for an entry without phases."""
    phases = entry.meta.get("phases") if isinstance(entry, BlendEntry) else None
    if not phases:
        return None
    return [{"phase": p["phase"], "size": p["size"], "start_bin": p["start_bin"], "bins": p["bins"],
             "first_step": p["start_bin"] // global_batch + 1 if sampler == "sequential" else None,
             "weights": _weights(p)} for p in phases]


def phase_note(entry, sampler: str) -> str | None:
    """What to say when a blend with phases is read in random order (its phases then mix from the first step)."""
    if sampler == "sequential" or not isinstance(entry, BlendEntry) or not entry.meta.get("phases"):
        return None
    return (f"note: {entry.path.name} runs in {len(entry.meta['phases'])} phases, which --sampler {sampler} shuffles "
            "together; --sampler sequential follows them")
