"""What a checkpoint must match for a run to resume from it (or to start from its weights): the data and the model.

A checkpoint names the pack entry it was trained on (``pack_key``, ``pack_entry``): a run resumes on that
entry while the pack cache still holds it, even when another one has become current since (re-running
an older ``xprep pack`` command is a cache hit that makes its entry current) — ``pinned_entry``. Resuming
on other data is refused, saying how to get the entry back (``check_same_pack``), and so is another model
(``check_same_model``): both before any process group exists, from trainer.json alone.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from xprep.prep.io import read_json


def check_same_pack(state: dict, path: Path, pack_key: str) -> None:
    """Refuse to resume on another pack entry: the data order would silently change."""
    if state.get("pack_key") != pack_key:
        raise XprepError(
            f"{path}: this checkpoint was trained on pack {str(state.get('pack_key'))[:16]}, but this run "
            f"reads pack {pack_key[:16]}; resume with the same pack, or start a new run with another --output")


def pinned_entry(packed: str | Path, state: dict, path: Path) -> Path | None:
    """The entry of the pack cache ``packed`` that checkpoint ``path`` (its trainer ``state``) was trained on,
    when it is not the one ``packed`` names (the cache's current entry); None when it is, or the checkpoint
    records no pack.

    A cache's current entry changes whenever an ``xprep pack`` into it runs, a cache hit of an older command
    included: resuming follows the checkpoint's entry while the cache holds it. When it is gone, or PACKED
    names another entry directly, resuming is refused with what to do.
    """
    want, packed = state.get("pack_key"), Path(packed)
    direct, current = _entry_key(packed), _current_entry(packed)
    if want is None or (direct is None and current is None):  # no pack recorded; PACKED is no pack cache
        return None  # (opening PACKED says what it is, and check_same_pack refuses other data)
    if want == (direct if direct is not None else _entry_key(current)):
        return None
    name = state.get("pack_entry") or f"…-{want[:16]}"
    if direct is not None:
        raise XprepError(f"{path}: this checkpoint was trained on pack entry {name} (key {want[:16]}), and PACKED "
                         f"is entry {packed.name}: give that entry or its pack cache {packed.parent}, or start a new "
                         "run with another --output")
    for entry in [packed / name] + sorted(p for p in packed.iterdir() if p.is_dir()):
        if _entry_key(entry) == want:
            return entry
    raise XprepError(
        f"{path}: this checkpoint was trained on pack entry {name} (key {want[:16]}), which is no longer in "
        f"{packed}" + (f" (its current entry is {current.name})" if current is not None else "")
        + ": re-run the `xprep pack` command that made it (the same datasets and options rebuild the same entry), "
        "then resume; or start a new run on the current entry with another --output")


def _entry_key(entry: Path | None) -> str | None:
    """The key a pack or blend entry's metadata records; None for anything else."""
    for file in (PACK_JSON, BLEND_JSON):
        if entry is not None and (entry / file).is_file():
            with contextlib.suppress(XprepError):
                meta = read_json(entry / file, "pack entry's metadata", "re-run `xprep pack --force`")
                return meta.get("key") if isinstance(meta, dict) else None
    return None


def _current_entry(packed: Path) -> Path | None:
    """The entry PACKED/manifest.json names as current; None without one."""
    if not (packed / MANIFEST).is_file():
        return None
    with contextlib.suppress(XprepError):
        manifest = read_json(packed / MANIFEST, "pack cache manifest", "re-run `xprep pack`")
        current = manifest.get("current") if isinstance(manifest, dict) else None
        return packed / current if isinstance(current, str) else None
    return None


_NOT_MODEL_SHAPE = {"hf", "transformers_version"}  # where a Hugging Face model was read from, not what it is


def check_same_model(state: dict, path: Path | str, model_config: dict,
                     fix: str = "resume with the same --model, or start a new run with another --output") -> None:
    """Refuse to resume (or, ``fix`` saying what to do, initialize from) another model: other shapes would fail inside
    DCP with a traceback."""
    saved = state.get("model")
    if saved is None:  # a checkpoint from before the model config was saved
        return
    differ = sorted(k for k in saved.keys() | model_config.keys()
                    if saved.get(k) != model_config.get(k) and k not in _NOT_MODEL_SHAPE and not k.startswith("_"))
    if differ:
        what = ", ".join(f"{k} {saved.get(k)!r} → {model_config.get(k)!r}" for k in differ)
        raise XprepError(f"{path}: this checkpoint holds another model ({what}); {fix}")
