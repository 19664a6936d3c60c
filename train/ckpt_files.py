"""A checkpoint directory on disk: its files, the record trainer.json keeps of them, and whether it is whole.

```
runs/NAME/checkpoints/
  latest              "step-<N>"  (written atomically, after the directory it names is complete)
  step-<N>/           DCP files for {"model", "optim"} (get_state_dict: sharding-aware): *.distcp, .metadata
    rng-<rank>.pt     this rank's torch RNG state                          (each rank)
    trainer.json      step, scheduler (+ schedule shape), sampler, pack key, batch sizes, model, hparams (rank 0);
                      "files": the size and sha256 of every other file; "trainer_sha256": its own, of the rest
```
A checkpoint is used only whole and undamaged (``damage``): trainer.json parses and matches its own digest, and
every file it records is there with its size and sha256 (a flipped bit, a truncated or garbage file, a missing
.metadata). sha256 (hashlib, on the CPU's SHA instructions) hashes ~1.4 GB/s on one core here: a strong hash at
half crc32's speed and twice blake2b's. ``find_latest`` (``--resume auto``) takes the checkpoint ``latest`` names,
or the newest step-<N> that passes, saying which and why in one line per checkpoint skipped. A checkpoint saved
before trainer.json recorded digests (no "files") is taken when trainer.json and .metadata are there.

This is the format and its checks, read by anything that looks at a run (resume, ``--init-from``, export, the
reports) without a process group; writing, publishing and retaining checkpoints is train/checkpoint.py's
``CheckpointManager``, built on it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.io import file_sha256

LATEST = "latest"
TRAINER_JSON = "trainer.json"
DCP_METADATA = ".metadata"  # DCP's index of a checkpoint's files, written once all of them are
FILES = "files"  # trainer.json's record of every other file: {name: {"size": bytes, "sha256": hex}}
TRAINER_DIGEST = "trainer_sha256"  # trainer.json's own digest: of its canonical JSON without this key
RANK_DIGESTS = "digests-{rank}.json"  # a rank's FILES entries, until rank 0 merges them into trainer.json
RETIRED_PREFIX = ".retired-"  # a checkpoint (or temporary directory) renamed out of the way, being deleted
_STEP_DIR = re.compile(r"^step-(\d+)$")


def find_latest(root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint of checkpoints directory ``root`` a run continues from, and what to say about it.

    The one ``latest`` names when it is whole and undamaged (``damage``), else the newest ``step-<N>`` that is,
    said in the note: one line per checkpoint skipped, naming it and why; never a silent start from scratch.
    (None, None) when there is no checkpoint; an error when there are some but none is usable.
    """
    pointer, named, steps = root / LATEST, latest_name(root), step_numbers(root)
    if named is None and not steps:
        return None, None
    why = f"{pointer} is missing"
    if named is not None:
        problem = "retired (being deleted)" if named.startswith(RETIRED_PREFIX) else damage(root / named)
        if problem is None:
            return root / named, None
        why = f"{pointer} names {named}, which is {problem}"
    skipped = []
    for name in (f"step-{n}" for n in reversed(steps) if f"step-{n}" != named):
        problem = damage(root / name)
        if problem is None:
            return root / name, "\n".join([*skipped, f"{why}: using {name}, the newest complete checkpoint"])
        skipped.append(f"skipping {name}: {problem}")
    listed = f" ({'; '.join(line.removeprefix('skipping ') for line in skipped)})" if skipped else ""
    raise XprepError(f"{why}, and no step-<N> in {root} is a complete checkpoint{listed}: nothing to resume; give "
                     "--resume PATH of a checkpoint, or another --output to start over")


def damage(path: Path) -> str | None:
    """Why ``path`` is no whole, undamaged checkpoint ("incomplete (.metadata is missing)", "damaged (...)");
    None when it is one.

    trainer.json must parse and match its own digest; every file it records must be there with its size (checked
    for all first: cheap) and its sha256. A checkpoint from before the digests needs trainer.json and .metadata.
    """
    if not path.is_dir():
        return "missing"
    try:
        state = json.loads((path / TRAINER_JSON).read_bytes())
    except FileNotFoundError:
        return f"incomplete ({TRAINER_JSON} is missing)"
    except (OSError, ValueError) as e:
        return f"damaged ({TRAINER_JSON} is unreadable: {e})"
    if not isinstance(state, dict):
        return f"damaged ({TRAINER_JSON} is not a JSON object)"
    if FILES not in state:  # saved before checkpoints recorded digests
        return None if (path / DCP_METADATA).is_file() else f"incomplete ({DCP_METADATA} is missing)"
    recorded = state.pop(TRAINER_DIGEST, None)
    files = state[FILES]
    if recorded != _json_digest(state) or not _valid_files(files):
        return f"damaged ({TRAINER_JSON} differs from its recorded digest)"
    for name, want in files.items():
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"incomplete ({name} is missing)"
        if size != want["size"]:
            return f"damaged ({name} is {size:,} bytes, {TRAINER_JSON} records {want['size']:,})"
    for name, want in files.items():
        try:
            if file_sha256(path / name, "") != want["sha256"]:
                return f"damaged ({name}: its sha256 differs from the one {TRAINER_JSON} records)"
        except XprepError:
            return f"damaged ({name} is unreadable)"
    return None


def _valid_files(files) -> bool:
    """Whether trainer.json's FILES is what ``sealed`` writes: plain names (no path) with a size and a sha256,
    .metadata among them."""
    return (isinstance(files, dict) and DCP_METADATA in files
            and all(isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
                    and isinstance(want, dict) and isinstance(want.get("size"), int)
                    and isinstance(want.get("sha256"), str) for name, want in files.items()))


def sealed(trainer_state: dict, files: dict[str, dict]) -> dict:
    """trainer.json's content: the trainer state, every file's digest, and its own digest (of the rest, as read
    back from JSON)."""
    state = json.loads(json.dumps({**trainer_state, FILES: dict(sorted(files.items()))}))
    return {**state, TRAINER_DIGEST: _json_digest(state)}


def _json_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_digest(path: Path) -> dict:
    """A file's FILES entry: its size and sha256."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path, "the checkpoint being written is unreadable")}


def latest_name(root: Path) -> str | None:
    """What the ``latest`` pointer of checkpoints directory ``root`` names (None: there is none)."""
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def step_numbers(root: Path) -> list[int]:
    """The steps of the ``step-<N>`` directories in ``root``, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
