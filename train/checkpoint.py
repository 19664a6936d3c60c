"""Checkpoints with torch.distributed.checkpoint (DCP): save, retain, find, resume.

```
runs/NAME/checkpoints/
  latest              "step-<N>"  (written atomically, after the directory it names is complete)
  step-<N>/           DCP files for {"model", "optim"} (get_state_dict: sharding-aware)
    trainer.json      step, scheduler (+ schedule shape), sampler, pack key, batch sizes, model, hparams (rank 0)
    rng-<rank>.pt     this rank's torch RNG state                          (each rank)
```
A checkpoint is written under ``.step-<N>.tmp`` and renamed when every rank is done, so a
killed run never leaves a directory that looks complete. The model and optimizer are saved
sharded, each rank its own part, with the global layout in DCP's metadata: any other number of
ranks, or another dp × cp split of them, loads them back (topology-independent). With
``async_save`` the files are written by a background thread (``dcp.async_save``, over a gloo
group of its own so its collectives never interleave with training's); the checkpoint is
published — trainer.json, rename, ``latest`` — only when every rank has finished writing it,
which is waited for before the next save starts and before the run ends (``finish``).

Rank 0 publishes alone (fsync, renames) while the other ranks wait for it; that waiting, and
DCP's own collectives, run over a gloo group of the checkpoints' own, whose timeout is
``XTRAIN_CKPT_TIMEOUT`` seconds (4 h), not training's ``XTRAIN_DIST_TIMEOUT`` (600 s): a large
save on slow shared storage must not end the job (on GPUs the default group is nccl, whose
watchdog would). The same group carries the asynchronous writes, one save at a time.

``keep`` retention retires the oldest ``step-*`` but never the one ``latest`` names nor the
best: the lowest validation loss among the checkpoints saved at a step that evaluated
(``eval_loss`` in trainer.json), else, when none did, the lowest training loss at save time.
Retiring is a rename to ``.retired-step-<N>-<id>`` (atomic: no ``step-<N>`` is ever half
deleted), and a thread on rank 0 deletes the retired directories while training goes on; the
end of the run (``finish``) waits for it. Retired or temporary directories left by a killed run
are deleted the same way by the next one.
A checkpoint names the pack entry it was trained on (``pack_key``, ``pack_entry``): a run resumes on that
entry while the pack cache still holds it, even when another one has become current since (re-running
an older ``xprep pack`` command is a cache hit that makes its entry current) — ``pinned_entry``. Resuming
on other data is refused, saying how to get the entry back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from prep.errors import XprepError
from prep.formats import BLEND_JSON, MANIFEST, PACK_JSON
from prep.io import fsync_tree, read_json, write_atomic, write_json_atomic
from train.dist import ParallelDims
from train.metrics import best_step

LATEST = "latest"
TRAINER_JSON = "trainer.json"
DCP_METADATA = ".metadata"  # DCP's index of a checkpoint's files, written once all of them are
_STEP_DIR = re.compile(r"^step-(\d+)$")
RETIRED_PREFIX = ".retired-"  # a checkpoint (or temporary directory) renamed out of the way, being deleted
CKPT_TIMEOUT_ENV = "XTRAIN_CKPT_TIMEOUT"  # seconds checkpoint coordination may wait for a peer [default 4 h]
DEFAULT_CKPT_TIMEOUT_S = 4 * 3600


def checkpoint_timeout() -> timedelta:
    """How long a rank waits for the others while a checkpoint is written and published (``XTRAIN_CKPT_TIMEOUT``)."""
    raw = os.environ.get(CKPT_TIMEOUT_ENV)
    if raw is None:
        return timedelta(seconds=DEFAULT_CKPT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise XprepError(f"{CKPT_TIMEOUT_ENV}={raw!r}: must be a number of seconds > 0; set it to e.g. "
                         f"{DEFAULT_CKPT_TIMEOUT_S} (the default, 4 h), or unset it")
    return timedelta(seconds=seconds)


class CheckpointManager:
    """Save and load the checkpoints of one run directory; every rank calls every method."""

    def __init__(self, run_dir: str | Path, dims: ParallelDims, keep: int = 2, async_save: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        self.dims = dims
        self.keep = keep
        self.async_save = async_save
        self.timeout = checkpoint_timeout()
        self._pending: _PendingSave | None = None
        self._coordination = None  # the gloo group of checkpointing (``_group``), made on first use
        self._deleter = _Deleter()
        self._cleaned = False
        self.note: str | None = None  # why ``resolve("auto")`` did not take the checkpoint ``latest`` names

    # ----------------------------------------------------------------------------------- find
    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if path.name.startswith(RETIRED_PREFIX) or not (path / TRAINER_JSON).is_file():
            raise XprepError(f"{pointer} names {path.name}, which is missing or incomplete; point it at "
                             "another step-<N> directory or delete it to start over")
        return path

    def resolve(self, resume: str) -> Path | None:
        """What ``--resume auto|never|PATH`` means for this run directory."""
        if resume == "never":
            if self.root.is_dir() and any(self.steps()):
                raise XprepError(f"{self.root.parent}: already holds checkpoints and --resume never was given: "
                                 "use --resume auto to continue, or another --output")
            return None
        if resume == "auto":
            return self._auto()
        path = Path(resume)
        if (path / "checkpoints" / LATEST).is_file():  # a run directory
            path = CheckpointManager(path, self.dims).latest()
        elif (path / LATEST).is_file():  # a checkpoints directory
            path = path / (path / LATEST).read_text().strip()
        if path is not None and path.name.startswith(RETIRED_PREFIX):
            raise XprepError(f"--resume {resume}: a retired checkpoint, being deleted (it may be incomplete already); "
                             "give a step-<N> directory, a run directory, or auto")
        if path is None or not (path / TRAINER_JSON).is_file():
            raise XprepError(f"--resume {resume}: not a complete checkpoint (no {TRAINER_JSON}); give a "
                             "step-<N> directory, a run directory, or auto")
        return path

    def _auto(self) -> Path | None:
        """The checkpoint ``--resume auto`` continues from: the one ``latest`` names, or, when the pointer is missing
        or names no complete checkpoint, the newest complete ``step-<N>`` (said in ``note``), never a silent
        start from scratch over a run's checkpoints. None when the run has none; an error when it has some but
        none is complete."""
        pointer, named, steps = self.root / LATEST, self._latest_name(), self.steps()
        if named is not None and not named.startswith(RETIRED_PREFIX) and _complete(self.root / named):
            return self.root / named
        if named is None and not steps:
            return None
        found = next((self.root / f"step-{n}" for n in reversed(steps) if _complete(self.root / f"step-{n}")), None)
        why = f"{pointer} is missing" if named is None else f"{pointer} names {named}, which is missing or incomplete"
        if found is None:
            raise XprepError(f"{why}, and no step-<N> in {self.root} is a complete checkpoint (with {TRAINER_JSON} "
                             f"and DCP's {DCP_METADATA}): nothing to resume; give --resume PATH of a checkpoint, or "
                             "another --output to start over")
        self.note = f"{why}: resuming from {found.name}, the newest complete checkpoint"
        return found

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))

    # ----------------------------------------------------------------------------------- save
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict) -> Path:
        """Write step-<step> from every rank, then publish it and move ``latest`` (rank 0).

        With ``async_save`` this returns once the state is staged (copied): the write goes on in
        the background and ``finish`` (or the next save) publishes it. Checkpoints retired by the
        publication are deleted in the background either way.
        """
        self._complete_pending()  # the previous asynchronous save first
        final = self.root / f"step-{step}"
        tmp = self.root / f".step-{step}.tmp"
        if self.dims.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        no_dist, group = not self.dims.distributed, self._group()
        with _quiet_single_process():
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=tmp, no_dist=no_dist, process_group=group)
            else:
                dcp.save(state, checkpoint_id=tmp, no_dist=no_dist, process_group=group)
                future = None
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save({"torch": torch.get_rng_state()}, tmp / f"rng-{self.dims.rank}.pt")
        self._pending = _PendingSave(step, tmp, final, {"step": step, **trainer_state}, future)
        if not self.async_save:
            self._complete_pending()
        return final

    def finish(self) -> None:
        """Complete what is in flight, at the end of a run: the pending save (published by rank 0) and the
        deletion of retired checkpoints. Every rank returns when rank 0 is done."""
        self._complete_pending()
        if self.dims.is_main:
            self._clean_leftovers()
            self._deleter.wait()
        self._barrier()

    def _complete_pending(self) -> None:
        """Wait for the pending save on every rank, then publish it (rank 0). No-op when none."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:  # a Future, or an AsyncSaveResponse holding one
            getattr(pending.future, "upload_completion", pending.future).result()
        self._barrier()
        if self.dims.is_main:
            self._publish(pending)
        self._barrier()

    def _publish(self, pending: _PendingSave) -> None:
        """Rename the finished checkpoint into place and point ``latest`` at it.

        Re-saving a step that exists (after resuming from an earlier one) replaces it; ``latest``
        names a complete checkpoint at every instant: when it names the step being replaced, it
        first moves to a hard-linked copy of that step, and back once the new one is in place.
        """
        tmp, final = pending.tmp, pending.final
        write_json_atomic(tmp / TRAINER_JSON, pending.trainer_state)
        fsync_tree(tmp)
        if final.exists():
            old = self.root / f".{final.name}.old"
            self._deleter.retire(old)  # a stale one
            if self._latest_name() == final.name:
                shutil.copytree(final, old, copy_function=_link_or_copy)
                write_atomic(self.root / LATEST, old.name + "\n")
                self._deleter.retire(final)
            else:
                os.replace(final, old)
            os.replace(tmp, final)
            write_atomic(self.root / LATEST, final.name + "\n")
            self._deleter.retire(old)
        else:
            os.replace(tmp, final)
            write_atomic(self.root / LATEST, final.name + "\n")
        self._retain(final.name)

    def _latest_name(self) -> str | None:
        pointer = self.root / LATEST
        return pointer.read_text().strip() if pointer.is_file() else None

    def _clean_leftovers(self) -> None:
        """Delete, in the background, what a killed run left (rank 0, once): its temporary directories
        (not one ``latest`` still names) and the retired checkpoints it had not deleted yet."""
        if self._cleaned:
            return
        self._cleaned = True
        latest = self._latest_name()
        for stale in sorted(self.root.glob(".step-*")):
            if stale.name != latest:
                self._deleter.retire(stale)
        for retired in sorted(self.root.glob(RETIRED_PREFIX + "*")):
            self._deleter.delete(retired)

    def _group(self):
        """The gloo group checkpointing waits on: DCP's collectives, the asynchronous writes, and the barriers
        around rank 0's publication. Its own group, so that its timeout is ``XTRAIN_CKPT_TIMEOUT``'s and
        not training's, and the background writes never race training's collectives (async_save also
        needs a CPU backend, which nccl is not). None on one process."""
        if not (self.dims.distributed and dist.is_initialized()):
            return None
        if self._coordination is None:
            self._coordination = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._coordination

    def _barrier(self) -> None:
        group = self._group()
        if group is not None:
            dist.barrier(group=group)

    def _retain(self, latest: str) -> None:
        """Keep the newest ``keep`` checkpoints, the one ``latest`` names and the best one; retire the others."""
        steps = self.steps()
        kept = {f"step-{n}" for n in steps[-self.keep:]} | {latest}
        best = self.best()
        if best is not None:
            kept.add(best)
        for n in steps:
            if f"step-{n}" not in kept:
                self._deleter.retire(self.root / f"step-{n}")

    def best(self) -> str | None:
        """The best checkpoint's name (``best_step``: by validation loss when any has one, else training loss)."""
        states = {}
        for n in self.steps():
            with contextlib.suppress(OSError, ValueError):
                states[n] = json.loads((self.root / f"step-{n}" / TRAINER_JSON).read_text())
        best = best_step(states)
        return f"step-{best[0]}" if best is not None else None

    # ----------------------------------------------------------------------------------- load
    @staticmethod
    def read_trainer_state(path: Path) -> dict:
        try:
            return json.loads((path / TRAINER_JSON).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise XprepError(f"{path / TRAINER_JSON}: unreadable ({e}); resume from another checkpoint") from None

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, pack_key: str) -> dict:
        """Restore model, optimizer and this rank's RNG from ``path``; return the trainer state."""
        state = self.read_trainer_state(path)
        check_same_pack(state, path, pack_key)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        with _quiet_single_process():
            dcp.load(loaded, checkpoint_id=path, no_dist=not self.dims.distributed, process_group=self._group())
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        rng = path / f"rng-{self.dims.rank}.pt"
        if rng.is_file():  # absent when resuming on more ranks than were saved
            torch.set_rng_state(torch.load(rng, weights_only=True)["torch"])
        return state

    def load_model(self, path: Path, model: nn.Module) -> None:
        """Load the model's weights alone from checkpoint ``path`` (``--init-from``): DCP reads its "model" part only,
        whatever layout saved it, into this layout's shards; optimizer, trainer state and RNG are not read."""
        loaded = {"model": get_model_state_dict(model)}
        with _quiet_single_process():
            dcp.load(loaded, checkpoint_id=path, no_dist=not self.dims.distributed, process_group=self._group())
        set_model_state_dict(model, loaded["model"])

    def wait_for_main(self) -> None:
        """Every rank waits here until all are here, over checkpointing's group (``XTRAIN_CKPT_TIMEOUT``, not training's
        timeout): the others wait for what rank 0 writes alone, however long the storage takes (``--save-hf``)."""
        self._barrier()


@dataclass
class _PendingSave:
    """A checkpoint being written: where, what rank 0 publishes with it, and the write's future."""

    step: int
    tmp: Path
    final: Path
    trainer_state: dict
    future: object | None


def _complete(path: Path) -> bool:
    """Whether ``path`` holds a whole checkpoint: rank 0's trainer state and DCP's metadata (written last by
    DCP's save, after every rank's data)."""
    return (path / TRAINER_JSON).is_file() and (path / DCP_METADATA).is_file()


class _Deleter:
    """Deletes directories in a thread of its own, so that no rank waits for a slow filesystem's deletes.

    ``retire`` first renames a directory to a ``.retired-*`` name beside it: atomic, so a ``step-<N>``
    is there whole or not at all, and nothing that looks for checkpoints sees it again. A directory
    already retired (left by a killed run) is only deleted. ``wait`` returns when all are gone.
    """

    def __init__(self):
        self._queue: queue.Queue[Path] = queue.Queue()
        self._thread: threading.Thread | None = None

    def retire(self, path: Path) -> None:
        """Rename ``path`` out of the way and delete it in the background; nothing when it does not exist."""
        retired = path.with_name(f"{RETIRED_PREFIX}{path.name.lstrip('.')}-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(path, retired)
        except FileNotFoundError:
            return
        self.delete(retired)

    def delete(self, path: Path) -> None:
        self._queue.put(path)
        if self._thread is None:  # a daemon: a run that dies leaves the rest for the next one to delete
            self._thread = threading.Thread(target=self._run, name="checkpoint-deleter", daemon=True)
            self._thread.start()

    def wait(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            try:
                shutil.rmtree(path, ignore_errors=True)
            except Exception as e:  # the thread must outlive it: ``wait`` waits for the ones queued after
                warnings.warn(f"{path}: not deleted ({e}); delete it by hand", stacklevel=1)
            finally:
                self._queue.task_done()


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


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)
