"""``xtrain run --nproc-per-node N``: start the N ranks on this machine, watch them, pass signals on.

The CLI calls ``launch`` when ``should_launch`` says so, and ``xprep.train.trainer.run`` otherwise. This process
checks what would fail in every rank once (``prepare_run``), holds the run directory's lock, opens the
rendezvous (a TCPStore on a free local port, which every rank joins as a client, as torchrun's agent store),
and starts each rank as ``python -m xprep.train.launch CONFIG_JSON`` (``RANK_ENTRY``), running the same resolved
config through ``main``. Under torchrun (or any launcher that sets RANK/WORLD_SIZE) nothing is spawned: this
process already is one of the ranks, so plain ``torchrun ... xtrain run`` and multi-node runs need no code
here.

While the ranks run, the launcher
- passes every signal that stops a run (SIGTERM, SIGINT, SIGUSR1: ``xprep.train.preempt``) on to each rank and
  waits for them, however long their checkpoint takes; a second signal is passed on too, and changes nothing.
  The launch then ends with the ranks' status (143 after SIGTERM, 130 after SIGINT, 0 after SIGUSR1);
- ends the job when one rank fails: the others are killed at once (SIGKILL: a SIGTERM would make them
  checkpoint, waiting on the rank that died), and one line names the rank that failed first, how, and its
  error (its traceback is above; each rank records its error in a file of its own, TORCHELASTIC_ERROR_FILE,
  as under torchrun);
- is their lifeline: each rank dies with it (``xprep.train.lifeline``), so a launcher killed alone leaves no rank
  training on without the run lock.

The environment of a rank is the launcher's protocol with it, internal (docs/environment.md lists it; nothing a user
sets): torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (``LAUNCHED_ENV``: a process that has
them is a rank, and launches nothing), ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE`` (the
rendezvous on this launcher's store), ``TORCHELASTIC_ERROR_FILE`` (where the rank records its error), and xtrain's
own ``XTRAIN_LAUNCHER_PID`` (``xprep.train.lifeline.PARENT_ENV``: the parent the rank dies with) and
``XTRAIN_STOP_FILE`` (``xprep.train.preempt.STOP_FILE_ENV``: where rank 0 says why the run stopped on a signal).
torchrun sets the torch ones, and ``TORCHELASTIC_RUN_ID``, by which a rank knows it was launched. ``OMP_NUM_THREADS``
is the user's, set to cores / ranks only when unset.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import TCPStore
from xprep.prep.errors import XprepError
from xprep.train.attempts import Attempt
from xprep.train.config import TrainConfig, validate_against_schema
from xprep.train.lifeline import PARENT_ENV, die_with_parent
from xprep.train.preempt import STOP_FILE_ENV, STOP_SIGNALS, Stopped, signal_name, stop_status
from xprep.train.rundir import RunLock
from xprep.train.trainer import BAD_STEPS_EXIT, DATA_UNREACHABLE_EXIT, prepare_run, run

LAUNCHED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun and by this launcher
# python arguments that start one rank, before its CONFIG_JSON (tests replace them): the rank dies with the
# launcher, and until training starts a stop signal ends it quietly (SIGINT too: no KeyboardInterrupt
# traceback), from its first instructions on, before torch is imported; then xprep.train.preempt takes over
RANK_ENTRY = ["-c", "import signal; signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "from xprep.train.lifeline import die_with_parent; die_with_parent(); "
              f"from {__name__} import main; main()"]
FORWARDED = (*STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT)  # passed on to the ranks as received
POLL_S = 0.05
STOP_STATUSES = tuple(sorted({stop_status(s) for s in STOP_SIGNALS} - {0}))  # 130, 143
# statuses every rank ends with at the same step, rank 0 having said why: a stop on a signal, too many bad steps
TOGETHER = (*STOP_STATUSES, BAD_STEPS_EXIT, DATA_UNREACHABLE_EXIT)
STOP_GRACE_S = 120.0  # a rank that ended so waits this long at most for the others to end as well


class RanksFailed(Exception):
    """A rank of a job this process launched failed; ``exit_code`` is that rank's; ``said``: rank 0 printed why."""

    def __init__(self, message: str, exit_code: int, said: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.said = said


def should_launch(nproc_per_node: int | None) -> bool:
    """Spawn ranks only when asked for more than one and not already one of a launcher's ranks."""
    return bool(nproc_per_node and nproc_per_node > 1) and not any(k in os.environ for k in LAUNCHED_ENV)


def launch(cfg: TrainConfig, notes: Sequence[str] = ()) -> Path:
    """Run ``cfg`` on ``cfg.parallel.nproc_per_node`` local ranks; raise ``RanksFailed`` when one fails and
    ``xprep.train.preempt.Stopped`` when a signal stopped them.

    What would fail in every rank (options, data, run directory, model) is checked here first, once; then
    ``notes`` (how the config was resolved) are said.
    """
    nproc = cfg.parallel.nproc_per_node
    validate_against_schema(cfg.to_dict())
    prepare_run(cfg, cfg.parallel.build(world=nproc), verify_data=False)
    with RunLock(cfg.run_dir):  # held here, for the ranks (they run with lock=False); and the attempt's log
        attempt = Attempt.begin(cfg.run_dir, cfg.to_dict(), notes)
        for note in notes:
            print(note, file=sys.stderr)
        try:
            _launch(cfg, nproc)
        except BaseException as e:
            attempt.end_with(e)
            raise
        attempt.end_with(None)
    return cfg.run_dir


def _launch(cfg: TrainConfig, nproc: int) -> None:
    """Start the ``nproc`` ranks, watch them until they end, and say how the job ended when not well."""
    errors = Path(tempfile.mkdtemp(prefix="xtrain-ranks-"))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # free port: no race for one
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
           PARENT_ENV: str(os.getpid())}
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: N ranks must not each take every core
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    job = _Job([], errors)
    previous = {sig: signal.signal(sig, job.on_signal) for sig in FORWARDED}
    try:
        config = json.dumps(cfg.to_dict())
        for rank in range(nproc):
            job.ranks.append(subprocess.Popen(
                [sys.executable, *RANK_ENTRY, config],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                     "TORCHELASTIC_ERROR_FILE": str(errors / f"rank-{rank}.json"), STOP_FILE_ENV: str(job.stop_file)}))
        if job.signum:  # received while the ranks were being started: the later ones have not had it
            job.on_signal(job.signum, None)
        job.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        job.kill()
        shutil.rmtree(errors, ignore_errors=True)
        del store


@dataclass
class _Job:
    """The ranks of one launch, and the signal that is stopping them (0: none)."""

    ranks: list[subprocess.Popen]
    errors: Path
    signum: int = 0

    def on_signal(self, signum: int, frame) -> None:
        """Pass it on to every rank still running; the first stop signal decides the job's status."""
        if not self.signum:
            self.signum = signum
        for proc in self.ranks:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait(self) -> None:
        """Until every rank has ended; raise when the job did not end well.

        A rank that ends with a stop status (143, 130: xprep.train.preempt) stopped in step with the others, after
        their checkpoint: they end within ``STOP_GRACE_S``, or the job is failed.
        """
        stopping_since = None
        while True:
            codes = [proc.poll() for proc in self.ranks]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0, *self._stop_codes())]
            if stopping_since is None and any(code in TOGETHER for code in codes):
                stopping_since = time.monotonic()
            if not failed and stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
                failed = [r for r, code in enumerate(codes) if code is None]
            if failed:
                self.kill()
                raise self._failure(failed)
            if all(code is not None for code in codes):
                break
            time.sleep(POLL_S)
        if BAD_STEPS_EXIT in codes:  # every rank stopped at the same bad step, and rank 0 said why
            raise RanksFailed("too many bad steps in a row (--max-bad-steps)", BAD_STEPS_EXIT, said=True)
        if DATA_UNREACHABLE_EXIT in codes:  # every rank stopped at the same step; those whose reads failed said why
            raise RanksFailed("data at a URL stayed unreachable", DATA_UNREACHABLE_EXIT, said=True)
        if self.stop_file.is_file():  # rank 0 stopped the run on a signal (to it, the launcher or a rank)
            stop = json.loads(self.stop_file.read_text())
            raise Stopped(stop["signal"], stop["message"], said=True)
        if self.signum:
            name = signal_name(self.signum)
            if self.signum not in STOP_SIGNALS:
                raise RanksFailed(f"stopped by {name}; the ranks were stopped", 128 + self.signum)
            if any(code == -self.signum for code in codes):  # ended by it before training began
                raise Stopped(self.signum, "interrupted" if self.signum == signal.SIGINT else
                              f"stopped by {name} before training began: nothing to save")

    @property
    def stop_file(self) -> Path:
        """Where rank 0 says why and where the run stopped on a signal (``STOP_FILE_ENV``)."""
        return self.errors / "stopped.json"

    def _stop_codes(self) -> tuple[int, ...]:
        """What a rank may end with, other than 0, without failing: a stop status (after its checkpoint), and
        death by the signal passed on before training began (nothing to save yet)."""
        return (*TOGETHER, -self.signum) if self.signum else TOGETHER

    def kill(self) -> None:
        for proc in self.ranks:
            if proc.poll() is None:
                proc.kill()
        for proc in self.ranks:
            proc.wait()

    def _failure(self, failed: list[int]) -> RanksFailed:
        """One line naming the rank that failed first (the earliest error recorded; else the first seen), how,
        and its error."""
        recorded = []  # (when, rank, message)
        for r in failed:
            found = self._recorded_error(r)
            if found is not None:
                recorded.append((found[0], r, found[1]))
        rank, message = min(recorded)[1:] if recorded else (failed[0], "")
        code = self.ranks[rank].returncode
        if code < 0:
            how, code = f"signal {signal_name(-code)}", 1
        else:
            how = f"exit code {code}"
        return RanksFailed(f"rank {rank} of {len(self.ranks)} failed ({how})"
                           + (f": {message.splitlines()[0]}" if message else "") + "; the other ranks were stopped",
                           code)

    def _recorded_error(self, rank: int) -> tuple[float, str] | None:
        """(when, message) of the error ``rank`` recorded in its TORCHELASTIC_ERROR_FILE (torch's ErrorHandler
        format); None when it recorded none, or the file is incomplete (the rank was killed while writing it)."""
        try:
            data = json.loads((self.errors / f"rank-{rank}.json").read_text())
            error = data["message"]
            if isinstance(error, str):
                return float(data.get("timestamp", 0)), error
            message = str(error["message"]).removeprefix(f"{XprepError.__name__}: ")  # the rank said it so
            return float(error["extraInfo"]["timestamp"]), message
        except (OSError, ValueError, KeyError, TypeError):
            return None


def main(argv: list[str] | None = None) -> None:
    """One rank started by ``launch``: the resolved config as JSON in argv[0] (sys.argv[1])."""
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    try:
        run(TrainConfig.from_dict(json.loads(argv[0])), lock=False)  # the launcher holds the run's lock
    except XprepError as e:  # before the process group exists (after it, run reports and exits itself)
        print(f"error: [rank {os.environ.get('RANK', '0')}] {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
