"""Checkpoints with torch.distributed.checkpoint (DCP): save, publish, retain, load (``CheckpointManager``).

The directory's layout, trainer.json's record of every file and the checks of a checkpoint before it is used are
train/ckpt_files.py's; what a checkpoint must match to be resumed (the pack entry, the model), train/resume.py's.

Writing. A checkpoint is written under ``.step-<N>.tmp`` and renamed into place once whole, so a killed run never
leaves a directory that looks complete; what a killed run left (``.latest.tmp-*`` of a kill inside publishing
included) is deleted by the next run's first save. Each rank writes its rng-<rank>.pt, then its part of the model
and optimizer: sharded, with the global layout in DCP's metadata, so any other number of ranks, or another
dp × cp split of them, loads it back. Inside DCP's collective write each rank hashes the files it wrote
(``digests-<rank>.json``); DCP then gathers every rank's results to rank 0, which writes ``.metadata`` last
(``_DistWrapper.all_reduce``: write on every rank, gather, rank 0's ``finish``). So when rank 0's save returns,
every rank's files and digests are on disk, and rank 0 publishes at once, alone: the digests merged into
trainer.json, fsync, rename, ``latest``. The write and the publication run in a thread of the manager's own.
With ``async_save`` a save returns once the state is copied, and the checkpoint is published as soon as it is
written, whatever training does meanwhile; ``poll`` (after every step) reports that and raises its error. A
synchronous save, or ``save(..., blocking=True)`` (a preemption's: synchronous even with ``async_save``), returns
on every rank once rank 0 has published it. ``flush`` waits for the save in flight, ``finish`` ends the run's
checkpointing.

Reading. A checkpoint is used only whole and undamaged (``xprep.train.ckpt_files.damage``); ``--resume auto`` takes
the checkpoint ``latest`` names, or the newest step-<N> that passes (``find_latest``), saying which and why;
``--resume PATH`` of a damaged checkpoint is refused. Every rank (and the launcher) checks the same files, so all
decide alike.

The other ranks wait for rank 0's publication (fsync, renames) of a synchronous save; that waiting, and
DCP's own collectives, run over a gloo group of the checkpoints' own, whose timeout is the manager's
``timeout`` (``--checkpoint-timeout``, ``checkpoint_timeout``: 4 h by default), not training's
``--dist-timeout`` (600 s): a large save on slow shared storage must not end the job (on GPUs the default
group is nccl, whose watchdog would). The same group carries the asynchronous writes, one save at a time.

``keep`` retention retires the oldest ``step-*`` (none with ``keep=None``, ``--keep all``) but never the one
``latest`` names nor the best: the lowest validation loss among the checkpoints saved at a step that evaluated
(``eval_loss`` in trainer.json), else, when none did, the lowest training loss at save time.
Retiring is a rename to ``.retired-step-<N>-<id>`` (atomic: no ``step-<N>`` is ever half
deleted), and a thread on rank 0 deletes the retired directories while training goes on; the
end of the run (``finish``) waits for it. Retired or temporary directories left by a killed run
are deleted the same way by the next one. ``no_save`` (``--no-save``) writes nothing at all; reading and
resuming work as ever.

This module is the manager alone (~500 lines): its writing thread, the publication, the coordination over its own
group and retention share one state (the save in flight, the last step, the deleter), which splitting would only
pass around.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import queue
import shutil
import threading
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from xprep.prep.errors import XprepError, machine_cause, machine_error
from xprep.prep.io import fsync_tree, read_json, write_atomic, write_json_atomic
from xprep.train.ckpt_files import (
    DCP_METADATA,
    LATEST,
    RANK_DIGESTS,
    RETIRED_PREFIX,
    TRAINER_JSON,
    damage,
    file_digest,
    find_latest,
    latest_name,
    sealed,
    step_numbers,
)
from xprep.train.dist import ParallelDims, timeout_from
from xprep.train.metrics import best_step
from xprep.train.resume import check_same_pack

CKPT_TIMEOUT_ENV = "XTRAIN_CKPT_TIMEOUT"  # the default of --checkpoint-timeout when neither a flag nor a config sets it
DEFAULT_CKPT_TIMEOUT_S = 4 * 3600.0


def checkpoint_timeout(seconds: float | None = None) -> timedelta:
    """How long a rank waits for the others while a checkpoint is written and published: ``seconds``
    (``--checkpoint-timeout``), else ``$XTRAIN_CKPT_TIMEOUT``, else 4 h."""
    return timeout_from(seconds, "--checkpoint-timeout", CKPT_TIMEOUT_ENV, os.environ.get(CKPT_TIMEOUT_ENV),
                        DEFAULT_CKPT_TIMEOUT_S)


class CheckpointManager:
    """Save and load the checkpoints of one run directory; every rank calls every method (``poll`` too, but it
    waits for no other rank). ``timeout``: how long checkpointing's collectives wait for a peer."""

    def __init__(self, run_dir: str | Path, dims: ParallelDims, keep: int | None = 2, async_save: bool = False,
                 no_save: bool = False, timeout: timedelta = timedelta(seconds=DEFAULT_CKPT_TIMEOUT_S)):
        self.root = Path(run_dir) / "checkpoints"
        self.dims = dims
        self.keep = keep  # newest checkpoints kept (+ latest's and the best); None: every one
        self.async_save = async_save
        self.no_save = no_save  # write no checkpoint at all
        self.timeout = timeout
        self._in_flight: _Save | None = None
        self._last_step: int | None = None  # of the last save started
        self._writer: ThreadPoolExecutor | None = None  # the thread that writes and publishes (``_write``)
        self._coordination = None  # the gloo group of checkpointing (``_group``), made on first use
        self._deleter = _Deleter()
        self._cleaned = False
        self.note: str | None = None  # which checkpoints ``latest``/``resolve`` skipped, and why (a line each)

    # ----------------------------------------------------------------------------------- find
    def latest(self) -> Path | None:
        """The checkpoint this run continues from (``--resume auto``; ``find_latest``), its ``note`` kept."""
        path, self.note = find_latest(self.root)
        return path

    def resolve(self, resume: str) -> Path | None:
        """What ``--resume auto|never|PATH`` means for this run directory."""
        if resume == "never":
            if self.root.is_dir() and any(self.steps()):
                raise XprepError(f"{self.root.parent}: already holds checkpoints and --resume never was given: "
                                 "use --resume auto to continue, or another --output")
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path if (path / LATEST).is_file() else None
        if root is not None:  # a run directory, or its checkpoints: the one auto would take there
            found, self.note = find_latest(root)
            if found is None:
                raise XprepError(f"--resume {resume}: holds no checkpoint; give a step-<N> directory, a run "
                                 "directory that saved one, or auto")
            return found
        if path.name.startswith(RETIRED_PREFIX):
            raise XprepError(f"--resume {resume}: a retired checkpoint, being deleted (it may be incomplete already); "
                             "give a step-<N> directory, a run directory, or auto")
        problem = damage(path)
        if problem is not None:
            raise XprepError(f"--resume {resume}: not a complete checkpoint, it is {problem}; give another step-<N> "
                             "directory, a run directory, or auto (the newest complete checkpoint)")
        return path

    def steps(self) -> list[int]:
        return step_numbers(self.root)

    # ----------------------------------------------------------------------------------- save
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             blocking: bool = False) -> Path | None:
        """Write step-<step> from every rank; rank 0 publishes it as soon as it is whole. None with ``no_save``.

        Synchronous, this returns on every rank once the checkpoint is published; with ``async_save``, once this
        rank's state is copied (``poll`` says when it is published). ``blocking`` (a preemption's last save) is
        synchronous whatever ``async_save`` says, and an exception raised in this thread while it waits (a signal
        handler's) is held until the checkpoint is published; it only waits when the last save was of the same step.
        The save in flight, if any, is published first. Checkpoints retired by the publication are deleted in the
        background either way.
        """
        if self.no_save:
            return None
        final = self.root / f"step-{step}"
        if blocking and step == self._last_step:  # (a preemption right after the step's own save)
            self._flush(shielded=True)
            return final
        self._wait(shielded=blocking)  # one save at a time
        tmp = self.root / f".step-{step}.tmp"
        if self.dims.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        tmp.mkdir(parents=True, exist_ok=True)
        writer = _DigestingWriter(tmp, self.dims.rank, _write_rng(tmp, self.dims.rank))  # rng first: see docstring
        background = self.async_save and not blocking
        if background:
            state = writer.stage(state)  # a copy: training changes the model meanwhile
        save = _Save(step, tmp, final, {"step": step, **trainer_state})
        if self._writer is None:  # not a daemon: a process ending normally waits for the save in flight
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        gpu = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        last_step, self._in_flight, self._last_step = self._last_step, save, step
        try:
            self._writer.submit(self._run, save, state, writer, gpu)
            if not background:
                self._flush(shielded=blocking)
        except BaseException:  # raised by a signal handler, maybe inside ``submit``, before the shielded wait
            if save.job.cancel():  # not picked up by the writer: it never will be
                self._in_flight, self._last_step = None, last_step
            elif blocking:
                _wait_for(save.job, shielded=True)
            raise
        return final

    def poll(self) -> Path | None:
        """The checkpoint whose save ended since the last call (on rank 0: published), else None; raises the save's
        error. Cheap and waits for no other rank: the training loop calls it after every step."""
        save = self._in_flight
        if save is None or not save.job.done():
            return None
        self._in_flight = None
        save.job.result()
        return save.final

    def flush(self) -> None:
        """Wait for the save in flight, if any: when this returns, on every rank, rank 0 has published it."""
        self._flush(shielded=False)

    def finish(self) -> None:
        """End the run's checkpointing: ``flush``, then wait for the deletion of retired checkpoints (rank 0).
        Every rank returns when rank 0 is done."""
        self.flush()
        if self.dims.is_main:
            if not self.no_save:
                self._clean_leftovers()
            self._deleter.wait()
        self._barrier()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

    def _flush(self, shielded: bool) -> None:
        self._wait(shielded)
        self._barrier()

    def _wait(self, shielded: bool) -> None:
        """Wait for this rank's part of the save in flight (and, on rank 0, its publication); raise its error."""
        save = self._in_flight
        if save is None:
            return
        try:
            _wait_for(save.job, shielded)
        finally:
            if save.job.done():
                self._in_flight = None

    def _run(self, save: _Save, state: dict, writer: _DigestingWriter, gpu: int | None) -> None:
        """In the writer thread: ``_write`` with its outcome in ``save.job``, a future made before the submission,
        so that a signal handler raising inside ``submit`` cannot leave the caller without the save's future."""
        if not save.job.set_running_or_notify_cancel():
            return
        try:
            self._write(save, state, writer, gpu)
        except BaseException as e:
            save.job.set_exception(e)
        else:
            save.job.set_result(None)

    def _write(self, save: _Save, state: dict, writer: _DigestingWriter, gpu: int | None) -> None:
        """In the writer thread: this rank's part of ``save``, then, on rank 0, its publication (module docstring:
        when rank 0's DCP save returns, every rank's files are written). ``gpu``: the caller's current CUDA
        device, which a new thread does not inherit (it starts on GPU 0): DCP copies a synchronous save's tensors
        to the CPU on the current device's stream, and waits for that stream only."""
        if gpu is not None:
            torch.cuda.set_device(gpu)
        quiet_dcp()
        try:
            dcp.save(state, storage_writer=writer, no_dist=not self.dims.distributed, process_group=self._group())
            if self.dims.is_main:
                self._publish(save)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise _write_error(e, save, _state_bytes(state)) from e

    def _publish(self, save: _Save) -> None:
        """Seal the finished checkpoint (trainer.json with every file's digest), rename it into place and point
        ``latest`` at it.

        Re-saving a step that exists (after resuming from an earlier one) replaces it; ``latest``
        names a complete checkpoint at every instant: when it names the step being replaced, it
        first moves to a hard-linked copy of that step, and back once the new one is in place. Such a
        copy that a run killed meanwhile left ``latest`` naming (and resumed from) goes once ``latest`` moves on.
        """
        tmp, final, previous = save.tmp, save.final, self._latest_name()
        write_json_atomic(tmp / TRAINER_JSON, sealed(save.trainer_state, self._merge_digests(tmp)))
        fsync_tree(tmp)
        if final.exists():
            old = self.root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            if previous == final.name:
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
        if previous is not None and previous.startswith(".step-"):
            self._deleter.retire(self.root / previous)
        self._retain(final.name)

    def _merge_digests(self, tmp: Path) -> dict[str, dict]:
        """Every rank's file digests (their digests-<rank>.json, removed) and that of DCP's .metadata."""
        files = {}
        for rank in range(self.dims.world_size):
            part = tmp / RANK_DIGESTS.format(rank=rank)
            files.update(read_json(part, f"digests of rank {rank}'s checkpoint files",
                                   f"every rank must write {self.root} on storage they share"))
            part.unlink()
        files[DCP_METADATA] = file_digest(tmp / DCP_METADATA)
        return files

    def _latest_name(self) -> str | None:
        return latest_name(self.root)

    def _clean_leftovers(self) -> None:
        """Delete, in the background, what a killed run left (rank 0, once): its temporary directories
        (not one ``latest`` still names), the retired checkpoints it had not deleted yet, and the temporary
        file of a ``latest`` it was writing."""
        if self._cleaned:
            return
        self._cleaned = True
        latest = self._latest_name()
        for stale in sorted(self.root.glob(".step-*")):
            if stale.name != latest:
                self._deleter.retire(stale)
        for retired in sorted(self.root.glob(RETIRED_PREFIX + "*")):
            self._deleter.delete(retired)
        for stray in self.root.glob(f".{LATEST}.tmp-*"):  # write_atomic's temporary name (xprep.prep.io)
            stray.unlink(missing_ok=True)

    def _group(self):
        """The gloo group checkpointing waits on: DCP's collectives, the asynchronous writes, and the barriers
        around rank 0's publication. Its own group, so that its timeout is ``self.timeout`` and not
        training's, and the background writes never race training's collectives (async_save also
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
        """Keep the newest ``keep`` checkpoints (all: ``keep=None``), the one ``latest`` names and the best; retire
        the others."""
        if self.keep is None:
            return
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
        """Restore model, optimizer and this rank's RNG from ``path`` (checked by ``resolve``); return the trainer
        state."""
        state = self.read_trainer_state(path)
        check_same_pack(state, path, pack_key)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        quiet_dcp()
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
        quiet_dcp()
        dcp.load(loaded, checkpoint_id=path, no_dist=not self.dims.distributed, process_group=self._group())
        set_model_state_dict(model, loaded["model"])

    def wait_for_main(self) -> None:
        """Every rank waits here until all are here, over checkpointing's group (``self.timeout``, not training's
        timeout): the others wait for what rank 0 writes alone, however long the storage takes (``--save-hf``)."""
        self._barrier()


def _write_rng(directory: Path, rank: int) -> dict[str, dict]:
    """Write this rank's RNG state (durably) into ``directory``; its digest, as FILES records it."""
    buffer = io.BytesIO()
    torch.save({"torch": torch.get_rng_state()}, buffer)
    data, name = buffer.getvalue(), f"rng-{rank}.pt"
    write_atomic(directory / name, data)
    return {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def _write_error(error: BaseException, save: _Save, nbytes: int) -> BaseException:
    """What to raise when writing ``save`` failed with ``error``: one line when the machine refused (a full disk, a
    permission, a read-only filesystem), else ``error`` itself. A full disk is also recognised by what is left on
    it when the writer lost the error number on the way (torch.save's zip writer reports "unexpected pos")."""
    cause = machine_cause(error)
    if cause is not None:
        return machine_error(cause, str(save.tmp), "--output", nbytes)
    try:
        free = shutil.disk_usage(save.tmp.parent).free
    except OSError:
        return error
    if free >= nbytes:
        return error
    return XprepError(f"no space left on device writing checkpoint {save.tmp}: this rank's part takes "
                      f"{_size(nbytes)}, {_size(free)} left on that filesystem; free space there or choose another "
                      "--output")


def _state_bytes(state) -> int:
    """Bytes of the tensors (this rank's shards of them) in a state dict."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _wait_for(job: Future, shielded: bool) -> None:
    """Wait for ``job`` and raise its error. ``shielded``: an exception raised in this thread meanwhile (by a signal
    handler) does not end the waiting: it is raised once the job is done."""
    interrupted: BaseException | None = None
    while True:
        try:
            job.result()
            break
        except BaseException as e:
            if job.done() or not shielded:
                raise
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


class _DigestingWriter(FileSystemWriter):
    """DCP's file writer that also writes, once this rank's files are written, their sizes and sha256 (with those
    of ``extra``, the files this rank wrote before) to digests-<rank>.json: inside DCP's collective write, so
    before rank 0 writes .metadata. Each rank hashes only its own files, in the writer thread."""

    def __init__(self, path: Path, rank: int, extra: dict[str, dict]):
        super().__init__(path)
        self.digests = Path(path) / RANK_DIGESTS.format(rank=rank)
        self.extra = extra

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        names = sorted({result.storage_data.relative_path for result in future.wait()})
        write_json_atomic(self.digests, {**self.extra, **{n: file_digest(self.digests.parent / n) for n in names}})
        return future


@dataclass
class _Save:
    """A checkpoint being written: where, what rank 0 publishes with it, and the writer thread's job."""

    step: int
    tmp: Path
    final: Path
    trainer_state: dict
    job: Future = field(default_factory=Future)


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


def quiet_dcp() -> None:
    """DCP warns at every save and load without a process group that it "assumes" a single process: that is the
    intent. A filter of the whole process, installed again at each use (test runners reset the filters): the writes
    run in a thread, where ``warnings.catch_warnings`` is not safe."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)
