"""``xtrain run --nproc-per-node N``: start the N ranks on this machine, as torchrun would.

The CLI calls ``launch`` when ``should_launch`` says so, and ``train.trainer.run`` otherwise. The
ranks are started by torch's elastic launcher (``elastic_launch``, the API behind torchrun,
standalone rendezvous on a free local port), each as ``python -m train.launch CONFIG_JSON``
running the same resolved config through ``main``. The launcher watches them: when one rank
fails, it stops the others at once and the launch fails with that rank's exit code (its error is
on stderr already). Under torchrun (or any launcher that sets RANK/WORLD_SIZE) nothing is
spawned: this process already is one of the ranks, so plain ``torchrun ... xtrain run`` and
multi-node runs need no code here.

Ctrl-C ends a launched job as it ends one process: one line ("interrupted") and exit 130. The launcher's
agent turns the SIGINT into a ``SignalException`` and passes SIGINT on to the ranks (each in a session of
its own, so the terminal's Ctrl-C reaches only the launcher); each rank exits at once, quietly, with 130
(``exit_interrupted``, installed before a rank imports anything heavy, ``RANK_ENTRY``), and the launcher's
own warnings about shutting them down are kept off the console.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from prep.errors import XprepError
from train.config import TrainConfig, validate_against_schema
from train.rundir import RunLock
from train.trainer import BAD_STEPS_EXIT, prepare_run, run

LAUNCHED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun and by elastic_launch
# python arguments that start one rank, before its CONFIG_JSON (tests replace them): a Ctrl-C ends the rank quietly
# from its first instruction on, before torch is imported (``exit_interrupted`` takes over once it is)
RANK_ENTRY = ["-c", "import os, signal; signal.signal(signal.SIGINT, lambda *_: os._exit(130)); "
              f"from {__name__} import main; main()"]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # what the launcher's agent handles


class RanksFailed(Exception):
    """A rank of a job this process launched failed; ``exit_code`` is that rank's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def should_launch(nproc_per_node: int | None) -> bool:
    """Spawn ranks only when asked for more than one and not already one of a launcher's ranks."""
    return bool(nproc_per_node and nproc_per_node > 1) and not any(k in os.environ for k in LAUNCHED_ENV)


def launch(cfg: TrainConfig, notes: Sequence[str] = ()) -> Path:
    """Run ``cfg`` on ``cfg.parallel.nproc_per_node`` local ranks; raise ``RanksFailed`` when one fails.

    What would fail in every rank (options, data, run directory, model) is checked here first, once; then
    ``notes`` (how the config was resolved) are said.
    """
    nproc = cfg.parallel.nproc_per_node
    validate_against_schema(cfg.to_dict())
    prepare_run(cfg, cfg.parallel.build(world=nproc), verify_data=False)
    with RunLock(cfg.run_dir):  # held here, for the ranks (they run with lock=False)
        for note in notes:
            print(note, file=sys.stderr)
        _launch(cfg, nproc)
    return cfg.run_dir


def _launch(cfg: TrainConfig, nproc: int) -> None:
    """Start the ``nproc`` ranks with torch's elastic launcher and wait for them."""
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: N ranks must not each take every core
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    try:
        with _agent_signals(), _quiet_agent():
            elastic_launch(config, sys.executable)(*RANK_ENTRY, json.dumps(cfg.to_dict()))
    except ChildFailedError as e:
        raise _ranks_failed(e, nproc) from None
    except SignalException as e:  # the agent has stopped the ranks with the same signal
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise RanksFailed(f"stopped by {e.sigval.name}; the ranks were stopped", 128 + int(e.sigval)) from None


@contextlib.contextmanager
def _agent_signals():
    """The agent installs its own handlers of ``STOP_SIGNALS`` (raising SignalException) and leaves them:
    put back this process's once the launch is over."""
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _quiet_agent():
    """The agent's warnings (a death signal received, each rank being sent it) off the console while it runs:
    the launch ends in one line of its own. Its errors still show."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _ranks_failed(e: ChildFailedError, nproc: int) -> RanksFailed:
    """One line naming the rank that failed first, how, and its error (its traceback is above)."""
    rank, failure = e.get_first_failure()
    if failure.exitcode == BAD_STEPS_EXIT:  # every rank stopped at the same bad step, and rank 0 said why
        return RanksFailed("", BAD_STEPS_EXIT)
    if failure.exitcode < 0:
        how, code = f"signal {failure.signal_name()}", 1
    else:
        how, code = f"exit code {failure.exitcode}", failure.exitcode or 1
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
    return RanksFailed(f"rank {rank} of {nproc} failed ({how})" + (f": {message.splitlines()[0]}" if message else "")
                       + "; the other ranks were stopped", code)


def main(argv: list[str] | None = None) -> None:
    """One rank started by ``launch``: the resolved config as JSON in argv[0] (sys.argv[1])."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        run(TrainConfig.from_dict(json.loads(argv[0])), lock=False)  # the launcher holds the run's lock
    except XprepError as e:  # before the process group exists (after it, run reports and exits itself)
        print(f"error: [rank {os.environ.get('RANK', '0')}] {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
