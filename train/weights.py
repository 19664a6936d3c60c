"""A run's weights out and in without `xtrain export`: ``--save-hf`` and ``--init-from``.

```
RUN/hf/step-<N>/   model.safetensors + config.json (+ the data's tokenizer, hf:DIR's generation config): what
                   `xtrain export` writes (xprep.train.hf_weights.write_hf_model), at the end of the run and every
                   --save-hf-every N steps, whether DCP checkpoints are saved or not
RUN/hf/latest      a symbolic link to the step-<N> written last: from_pretrained("RUN/hf/latest") loads it
```
Each directory is written under ``.step-<N>.tmp`` and renamed into place (``publishing``); the link is replaced
by renaming a new one over it. The whole state comes from DCP's ``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``: one parameter at a time is all-gathered from the FSDP2 shards on the device and copied to
rank 0's host memory, so while it writes, rank 0 holds the whole model in fp32 on the host (4 bytes × parameters,
the device one parameter more), the others nothing; they wait for it over checkpointing's group.

``--init-from PATH`` takes the model's weights only, from a complete xtrain checkpoint (a step-<N> directory, or a
run or checkpoints directory: the checkpoint ``--resume auto`` would take) or from hf:DIR; optimizer, schedule and
sampler start fresh, at step 0, on this run's data. Precedence, so that a requeued job that re-runs its command
resumes instead of starting over: this run's own checkpoint > ``--resume PATH`` > ``--init-from`` (``plan_init``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from xprep.prep.errors import XprepError
from xprep.prep.io import fsync_dir
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import DCP_METADATA, LATEST, RETIRED_PREFIX, TRAINER_JSON, damage
from xprep.train.dist import ParallelDims
from xprep.train.hf import hf_builtin_config
from xprep.train.hf_weights import ExportExtras, builtin_model_config, publishing, read_hf_weights, write_hf_model
from xprep.train.model import ModelConfig
from xprep.train.resume import check_same_model

HF_DIR = "hf"  # RUN/hf/: the --save-hf directories
_INIT_ONLY = ("multiple_of", "init_std")  # model config fields that shape no computation (ffn_dim is set; the init)


# ------------------------------------------------------------------------------------------ out
def check_exportable(save_hf: bool, model_config: dict | None, model_name: str) -> None:
    """Refuse --save-hf, before any process group, for a model that export cannot write: hf:DIR running as the
    transformers module (``model_config`` None)."""
    if save_hf and model_config is None:
        raise XprepError(f"--save-hf writes the built-in model, and --model {model_name} runs as the transformers "
                         "module (an architecture the built-in model cannot compute): its weights are hf:DIR's "
                         "layout already; leave --save-hf out")


class HFSaver:
    """``--save-hf``: the built-in model's whole weights as a Hugging Face directory ``RUN/hf/step-<N>``, every
    ``every`` steps (unless 0) and after the last. Every rank calls ``save``; rank 0 writes."""

    def __init__(self, run_dir: Path, every: int, model_config: dict, ckpt: CheckpointManager, dims: ParallelDims,
                 out):
        self.run_dir, self.root, self.every = Path(run_dir), Path(run_dir) / HF_DIR, every
        self.cfg = builtin_model_config(model_config, run_dir, "--save-hf")
        self.ckpt, self.dims, self.out = ckpt, dims, out
        self._extras: ExportExtras | None = None  # found at the first save (run.json names the data by then)

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, model: nn.Module, trainer_state: dict) -> Path:
        """Write ``RUN/hf/step-<step>`` (replacing one a resumed run wrote before) and point ``latest`` at it.
        ``trainer_state`` (``Trainer.state_dict``) names the pack and where the weights came from."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # a collective: rank 0 gets it all, the others {}
        final = self.root / f"step-{step}"
        if self.dims.is_main:
            self._write(final, state, trainer_state)
        del state
        self.ckpt.wait_for_main()
        return final

    def _write(self, final: Path, state: dict[str, Tensor], trainer_state: dict) -> None:
        first = self._extras is None
        if first:
            self._extras = ExportExtras.of_run(self.run_dir, trainer_state)
            for stale in self.root.glob(".step-*"):  # what a killed run left
                shutil.rmtree(stale, ignore_errors=True)
        with publishing(final, replace=True) as tmp:
            said = write_hf_model(tmp, state, self.cfg, self._extras, final)
        _point(self.root / LATEST, final.name)
        self.out.write(f"Hugging Face model written to {final} ({self.root / LATEST} links to it)\n")
        if first:
            self.out.write(said + "\n")


def _point(link: Path, name: str) -> None:
    """Make ``link`` a symbolic link to ``name`` (beside it), atomically: a new link renamed over the old one."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


# ------------------------------------------------------------------------------------------ in
@dataclass(frozen=True)
class InitFrom:
    """The weights ``--init-from`` starts the model from, checked (complete, the same model) but not read yet."""

    given: str  # as given: PATH or hf:DIR
    path: Path  # the checkpoint's step-<N> directory, or DIR
    cfg: ModelConfig  # this run's model, which they are weights of
    step: int | None  # the checkpoint's step; None for hf:DIR
    note: str = ""  # which checkpoint of a run was taken, when not the one its ``latest`` names, and why

    def record(self) -> dict:
        """Where the weights came from, for run.json and trainer.json (``init``)."""
        if self.step is None:
            return {"from": "hf", "path": str(self.path.resolve())}
        return {"from": "checkpoint", "path": str(self.path.resolve()), "step": self.step}

    def initial(self) -> Callable[[str], Tensor] | None:
        """hf:DIR's tensors by parameter name, each read when ``xprep.train.dist.materialize`` asks for it; None for a
        checkpoint, which DCP loads into the model once it is built (``CheckpointManager.load_model``)."""
        return read_hf_weights(self.path, self.cfg).__getitem__ if self.step is None else None

    def line(self) -> str:
        """The console line of a run that starts from these weights."""
        what = self.given if self.step is None else f"checkpoint {self.path} (--init-from {self.given})"
        return f"weights from {what}: fresh optimizer, schedule and sampler, from step 0"


def init_record(init: InitFrom | None, model_config: dict | None, seed: int) -> dict:
    """Where a run's initial weights came from: --init-from, --model hf:DIR, or the built-in init from ``seed``."""
    if init is not None:
        return init.record()
    if (model_config or {}).get("hf"):  # --model hf:DIR, in the built-in model or as the transformers module
        return {"from": "hf", "path": str(Path(model_config["hf"]).resolve())}
    return {"from": "seed", "seed": seed}


def plan_init(given: str | None, model_config: dict | None, model_name: str, resume_from: Path | None,
              resume: str) -> tuple[InitFrom | None, str]:
    """--init-from as this run takes it, checked before any process group, and a note when it is not used.

    This run's own checkpoint (``--resume auto`` found one: a requeued job re-runs the same command) and
    ``--resume PATH`` come first: then the weights are the resumed ones, --init-from is not read (it may be gone
    since), and the note says so. ``--resume never`` over a run with checkpoints is refused before this, as
    without --init-from.
    """
    if not given:
        return None, ""
    if resume_from is not None:
        why = (f"{resume_from.parent.parent} has checkpoints of its own: resuming from {resume_from.name}"
               if resume == "auto" else f"--resume {resume} comes first")
        return None, (f"note: --init-from {given} not used: {why} (this run's checkpoint > --resume PATH > "
                      "--init-from)")
    if model_config is None:
        raise XprepError(f"--init-from {given}: needs the built-in model, and --model {model_name} runs as the "
                         "transformers module (its weights are that directory's); leave --init-from out")
    cfg = builtin_model_config(model_config, model_name, "--init-from")
    if given.startswith("hf:"):
        return _hf_source(given, cfg, model_config), ""
    return _checkpoint_source(given, cfg, model_config), ""


_FIX = "give the --model it was trained with"


def _hf_source(given: str, cfg: ModelConfig, model_config: dict) -> InitFrom:
    """hf:DIR: its config.json the same model as this run's, its safetensors' names, shapes and dtypes those of
    the built-in model (from the headers: nothing read yet)."""
    directory = given[3:]
    with _naming_init_from(directory):
        hf_cfg, why = hf_builtin_config(directory, cfg.vocab_size)
        if hf_cfg is None:
            raise XprepError(f"--init-from {given}: {why}; its weights do not load into the built-in model")
        computed = lambda d: {k: v for k, v in d.items() if k not in _INIT_ONLY}  # noqa: E731
        check_same_model({"model": computed(hf_cfg.to_dict())}, f"--init-from {given}", computed(model_config), _FIX)
        read_hf_weights(directory, cfg)
    return InitFrom(given, Path(directory), cfg, None)


@contextlib.contextmanager
def _naming_init_from(directory: str) -> Iterator[None]:
    """hf:DIR's checks (xprep.train.hf, xprep.train.hf_weights) name the option --model; here it is --init-from."""
    try:
        yield
    except XprepError as e:
        raise XprepError(str(e).replace(f"--model hf:{directory}", f"--init-from hf:{directory}")) from None


def _checkpoint_source(given: str, cfg: ModelConfig, model_config: dict) -> InitFrom:
    """A complete checkpoint of the same model: PATH itself, or the one ``--resume auto`` takes of a run PATH."""
    path, note = _checkpoint_of(given)
    state = CheckpointManager.read_trainer_state(path)
    saved = state.get("model")
    if saved is not None:
        builtin_model_config(saved, path, "--init-from")
        check_same_model(state, path, model_config, _FIX)
    return InitFrom(given, path, cfg, int(state.get("step", 0)), note)


def _checkpoint_of(given: str) -> tuple[Path, str]:
    """The complete checkpoint --init-from PATH names, and a note when it is not the one ``latest`` names."""
    path = Path(given)
    usage = "give a step-<N> checkpoint directory, a run directory (its newest complete checkpoint) or hf:DIR"
    if not path.is_dir():
        raise XprepError(f"--init-from {given}: no such directory; {usage}")
    if (path / TRAINER_JSON).exists() or (path / DCP_METADATA).exists() or path.name.startswith("step-"):
        problem = "retired (being deleted)" if path.name.startswith(RETIRED_PREFIX) else damage(path)
        if problem is not None:
            raise XprepError(f"--init-from {given}: not a checkpoint to start from, it is {problem}; give another "
                             "step-<N>, or the run directory for its newest complete one")
        return path, ""
    run = path if (path / "checkpoints").is_dir() else path.parent if path.name == "checkpoints" else None
    if run is None:
        raise XprepError(f"--init-from {given}: neither a checkpoint nor a run directory; {usage}")
    manager = CheckpointManager(run, ParallelDims())
    try:
        found = manager.resolve("auto")
    except XprepError as e:
        raise XprepError(f"--init-from {given}: {e}") from None
    if found is None:
        raise XprepError(f"--init-from {given}: {run} has no checkpoint; {usage}")
    return found, f"--init-from {given}: {manager.note}" if manager.note else ""
