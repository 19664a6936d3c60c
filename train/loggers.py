"""Where a run's metrics go besides metrics.jsonl and the console: TensorBoard and Weights & Biases.

``--log tensorboard,wandb`` picks them (optional extras: ``pip install 'xprep[tensorboard]'``,
``'xprep[wandb]'``). ``MetricsLog`` (train/metrics.py), rank 0 only, hands each of them every step's
metrics.jsonl record as flat scalars (``scalars``): ``loss``, ``category_loss/<name>``,
``source_loss/<name>``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``mfu``, ``mfu_6n``, ``peak_mem_bytes``, ...,
``eval_loss`` and ``eval_category_loss/<name>`` on the steps that evaluated, and each named set's
``eval/NAME/loss``, ``eval/NAME/category_loss/<name>``, ... (``test/NAME/...`` after the last step); nulls are
left out.

- TensorBoard: event files in ``RUN/tensorboard/``; a resumed run purges the events after its
  checkpoint's step (a fresh one, all earlier events), as metrics.jsonl moves its lines aside
  (``SummaryWriter(purge_step=)``).
- W&B: the run lives in ``RUN/wandb/`` (``$WANDB_DIR`` wins), project ``$WANDB_PROJECT`` or
  ``xtrain``, named after the run directory; its id is kept in ``RUN/wandb_run_id`` so a resumed run
  continues the same W&B run. ``$WANDB_MODE`` is wandb's own (``offline`` writes only local files, for
  ``wandb sync`` later). wandb does not capture the console (the trainer's lines stay as they are). Closing
  waits until wandb's service has written or sent every record (``wandb.teardown``).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path
from typing import Protocol

from xprep.prep.errors import XprepError
from xprep.prep.io import write_atomic

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
WANDB_PROJECT = "xtrain"  # when $WANDB_PROJECT is not set
NOT_SCALARS = ("step", "time")  # the x axis, and a wall-clock stamp (float32 would round it to minutes)


class Logger(Protocol):
    """A metrics backend: one call per step with that step's scalars, then ``close``."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as flat scalars: nested dicts (``category_loss``) as ``key/name``, nulls, booleans
    and strings left out, ``step`` and ``time`` too."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for name, v in items:
            if isinstance(v, int | float) and not isinstance(v, bool):
                out[key if name is None else f"{key}/{name}"] = v
    return out


# ------------------------------------------------------------------------------------------ choosing them
def parse_backends(spec: str | None) -> tuple[str, ...]:
    """``--log tensorboard,wandb`` as names, in order, once each; unknown names are an error."""
    names = tuple(dict.fromkeys(n.strip() for n in (spec or "").split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise XprepError(f"--log {spec}: unknown backend {unknown[0]!r}; choose from {', '.join(BACKENDS)} "
                         "(comma-separated; metrics.jsonl and the console are always written)")
    return names


def check_backends(spec: str | None) -> tuple[str, ...]:
    """The backends of ``--log``, each of whose packages is installed (without importing it): call before any work."""
    names = parse_backends(spec)
    for name in names:
        module, extra = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise XprepError(missing(name, module, extra))
    return names


def missing(name: str, module: str, extra: str) -> str:
    return (f"--log {name} needs the {module} package, which is not installed: pip install 'xprep[{extra}]' "
            f"(or pip install {module}), or leave {name} out of --log")


def build_loggers(spec: str | None, run_dir: Path, config: dict, resumed_step: int = 0) -> list[Logger]:
    """The loggers ``--log`` names, opened on ``run_dir`` (rank 0 only: the other ranks log nothing)."""
    makers = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}
    return [makers[name](Path(run_dir), config, resumed_step) for name in check_backends(spec)]


# ------------------------------------------------------------------------------------------ backends
class TensorBoardLogger:
    """Scalars into TensorBoard event files in ``RUN/tensorboard/`` (torch's SummaryWriter)."""

    def __init__(self, run_dir: Path, config: dict | None = None, resumed_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional extra: xprep[tensorboard]
        except ImportError:
            raise XprepError(missing("tensorboard", "tensorboard", "tensorboard")) from None
        # purge: readers drop the events of steps after the resumed one (all of them for a fresh run)
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=resumed_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # as metrics.jsonl: a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars into a W&B run (``wandb.log(step=)``), the resolved config as its config."""

    def __init__(self, run_dir: Path, config: dict | None = None, resumed_step: int = 0):
        try:
            import wandb  # optional extra: xprep[wandb]
        except ImportError:
            raise XprepError(missing("wandb", "wandb", "wandb")) from None
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed_step and id_file.is_file() else secrets.token_hex(6)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT, name=run_dir.name,
                                  id=run_id, resume="allow", config=config,
                                  dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                                  settings=wandb.Settings(console="off"))
        except wandb.errors.Error as e:
            raise XprepError(f"--log wandb: wandb.init failed ({e}); run `wandb login`, or set WANDB_MODE=offline "
                             "to write the run locally (and `wandb sync` it later)") from None
        write_atomic(id_file, run_id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finish the run, then wait for wandb's service to have written (offline) or sent it all: ``finish``
        returns before that, and the exit hook that would wait is skipped by a distributed run's ``os._exit``."""
        import wandb  # optional dependency (xprep[wandb])

        self.run.finish()
        wandb.teardown()


BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}  # name → (module, extra)
