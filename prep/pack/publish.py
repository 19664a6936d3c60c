"""The pack cache directory: locks, temporary build directories, atomic publication and manifest.json.

What ``xprep pack`` (``xprep.prep.pack.cache``) builds is published here, whatever it is (a pack entry, a blend):

- ``prepare_root``: the directory ``-o`` names, created, or refused when it holds something else;
- ``locked``: an exclusive ``fcntl.flock`` on ``PACKED/.<name>.lock`` (released by the kernel if the process
  dies), so concurrent identical commands build an entry once;
- ``building``: a fresh ``PACKED/.tmp-<name>-<pid>-*`` directory to build in, removed if the build fails
  (and the stale ones of dead builders removed first); ``publish`` renames it into place, a forced-out old
  entry moved aside first, so a crash never leaves a half entry that looks complete;
- ``set_current``: manifest.json's ``"current"`` (and ``"validation"``, ``"test"``) entry, written atomically
  under its lock;
  ``refresh_paths``: an entry found again with its datasets at other paths, pointed at them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, MANIFEST, PACK_FORMAT, PACK_JSON
from xprep.prep.interrupt import temporary
from xprep.prep.io import TempDir, check_output_dir, fsync_dir, read_json, remove_stale_temps, write_json_atomic
from xprep.prep.pack.entry import PackEntry
from xprep.prep.pack.mixture import BlendEntry

VALIDATION = "validation"  # manifest.json's key naming the current entry's --split validation entry
TEST = "test"  # and its --split test entry (a third share)


@contextmanager
def building(root: Path, name: str) -> Iterator[TempDir]:
    """A fresh temporary directory to build entry ``name`` in (the caller holds the entry's lock), removed if the
    build fails. First removed: earlier builds' temporaries whose owner is gone (``xprep.prep.io.owner_gone``: never one
    of another host, where this lock may not reach) and old entries a publisher moved aside and died before
    removing (it removes them under this lock)."""
    remove_stale_temps(root, f".tmp-{name}-*")
    for old in root.glob(f".old-{name}-*"):
        shutil.rmtree(old, ignore_errors=True)
    claim = TempDir(root, f".tmp-{name}-{os.getpid()}-")
    try:
        with temporary(claim.path):
            yield claim
    except BaseException:
        shutil.rmtree(claim.path, ignore_errors=True)
        raise
    finally:
        claim.release()


def remove_if_only_locks(root: Path) -> None:
    """Undo a cache directory this command created and failed to fill, unless another command now uses it.

    A lock another process holds (or waits on) stays, and so does the directory: only free locks are removed.
    """
    with contextlib.suppress(OSError):
        children = list(root.iterdir())
        if not all(p.name.startswith(".") and p.name.endswith(".lock") for p in children):
            return
        for lock in children:
            with open(lock, "rb") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # in use: leave the directory to that command
                lock.unlink()
        root.rmdir()


def prepare_root(root: Path) -> Path:
    """The cache directory: created if needed, refused if it is something else or cannot be made."""
    check_output_dir(root, option="-o", allow_nonempty=True)  # a cache accumulates entries
    manifest = root / MANIFEST
    if manifest.is_file():
        fmt = read_cache_manifest(manifest).get("format")
        if fmt != PACK_FORMAT:
            raise XprepError(f"-o {root}: holds a {fmt!r} manifest, not a pack cache; choose another -o")
    elif root.is_dir() and any(not _ours(p) for p in root.iterdir()):
        raise XprepError(f"-o {root}: exists and is not a pack cache (no {MANIFEST}); choose another -o")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _ours(p: Path) -> bool:
    return p.name.startswith(".") or (p / PACK_JSON).is_file() or (p / BLEND_JSON).is_file()


@contextmanager
def locked(path: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (released by the kernel if the process dies); ``on_wait`` runs
    first when another process holds it."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def publish(tmp: TempDir, final: Path) -> None:
    """Rename the finished directory into place (its owner record gone first), moving a forced-out (or damaged) old
    entry aside first."""
    tmp.release()
    fsync_dir(tmp.path)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp.path, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


def refresh_paths(root: Path, entry: PackEntry, inputs: list[dict]) -> PackEntry:
    """Same data found at other paths (moved or copied): point the entry at the paths given now."""
    def where(d: dict) -> tuple:
        return d["path"], d.get("url")

    if [where(d) for d in entry.meta["datasets"]] == [where(d) for d in inputs]:
        return entry
    with locked(root / f".{entry.path.name}.lock"):
        meta = dict(entry.meta)
        meta["datasets"] = [{**{k: v for k, v in old.items() if k != "url"}, **new} for old, new in
                            zip(entry.meta["datasets"], inputs, strict=True)]
        write_json_atomic(entry.path / PACK_JSON, meta)
    return PackEntry.open(entry.path)


def set_current(root: Path, entry: PackEntry | BlendEntry, validation: PackEntry | BlendEntry | None = None,
                test: PackEntry | BlendEntry | None = None) -> None:
    """Record the entry (and its --split validation and test entries) in ``manifest.json`` and make it the current
    one: ``"current"`` names it, ``"validation"`` and ``"test"`` its held-out entries (each absent without one).
    Atomic, locked."""
    held = {part: e for part, e in ((VALIDATION, validation), (TEST, test)) if e is not None}
    with locked(root / ".manifest.lock"):
        path = root / MANIFEST
        empty = {"format": PACK_FORMAT, "current": None, "entries": {}}
        manifest = read_cache_manifest(path) if path.is_file() else empty
        for e in (entry, *held.values()):
            manifest["entries"][e.path.name] = e.manifest_row()
        for part, e in held.items():  # which held-out entry belongs to it, for a run that resumes on it later
            manifest["entries"][entry.path.name][part] = e.path.name
        manifest["current"] = entry.path.name
        for part in (VALIDATION, TEST):
            if part in held:
                manifest[part] = held[part].path.name
            else:
                manifest.pop(part, None)
        write_json_atomic(path, manifest)


def read_cache_manifest(path: Path) -> dict:
    """The pack cache's manifest.json; one that does not read as a JSON object is corrupt."""
    fix = "delete it (entries are kept) and re-run"
    manifest = read_json(path, "pack cache manifest", fix)
    if not isinstance(manifest, dict):
        raise XprepError(f"{path}: corrupt (not a JSON object); {fix}")
    return manifest
