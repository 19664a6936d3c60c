"""``TrainConfig``: every option of ``xtrain run``, one field each, built once and checked.

Precedence: dataclass defaults < ``--config FILE.json|yaml`` < command-line flags. The resolved
config is written to the run directory as ``config.json`` and checked against
``schemas/train.schema.json``.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from prep.errors import XprepError

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "train.schema.json"
SAMPLERS = ("sequential", "random")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """One training run. ``steps`` and ``epochs`` are exclusive (neither: one epoch)."""

    packed: str
    model: str = "tiny"
    steps: int | None = None
    epochs: float | None = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size × DP ranks (or the pack's DP step)
    sampler: str = "sequential"
    seed: int = 0
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    precision: str = "auto"  # auto = bf16 autocast on CUDA, fp32 on CPU
    output: str | None = None  # None: runs/<name of the pack directory>
    save_every: int = 0  # 0 = only at the end
    keep: int = 2
    resume: str = "auto"  # auto | never | PATH of a checkpoint
    log_every: int = 10
    verify_data: bool = False
    dp: int | None = None  # None: processes / cp
    cp: int = 1
    fsdp: bool | None = None  # None: on when there is more than one process
    reshard_after_forward: bool = True
    nproc_per_node: int | None = None  # None: run in this process (or the ranks torchrun started)
    activation_checkpointing: bool = False
    async_save: bool = False

    def __post_init__(self):
        _check_type(self)
        if self.steps is not None and self.epochs is not None:
            raise XprepError(f"--steps {self.steps} and --epochs {self.epochs} both given: choose one")
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_every", "keep", "dp", "cp",
                     "nproc_per_node"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise XprepError(f"--{_flag(name)} {value} must be ≥ 1")
        for name in ("warmup", "save_every", "seed"):
            if getattr(self, name) < 0:
                raise XprepError(f"--{_flag(name)} {getattr(self, name)} must be ≥ 0")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise XprepError(f"--epochs {self.epochs} must be a number > 0")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise XprepError(f"--{_flag(name)} {value} must be a finite number ≥ 0")
        if self.min_lr > self.lr:
            raise XprepError(f"--min-lr {self.min_lr} is above --lr {self.lr}: lower it")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise XprepError(f"--{_flag(name)} {getattr(self, name)} must be in [0, 1)")
        _check_choice("sampler", self.sampler, SAMPLERS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("precision", self.precision, PRECISIONS)
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise XprepError(f"--global-batch-size {self.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {self.micro_batch_size}")

    @property
    def run_dir(self) -> Path:
        return Path(self.output) if self.output else Path("runs") / Path(self.packed).resolve().name

    def to_dict(self) -> dict:
        return asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise XprepError(f"--{_flag(name)} {value!r} is not one of {', '.join(choices)}")


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _check_type(cfg: TrainConfig) -> None:
    """Config files are untyped: name the field whose value has the wrong type."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if value is None:
            if "None" in kinds:
                continue
            raise XprepError(f"config key {f.name!r} must be set")
        allowed = tuple(t for k in kinds if k in _TYPES for t in _TYPES[k])
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            want = " or ".join(k for k in kinds if k != "None")
            raise XprepError(f"config key {f.name!r}: {value!r} is not a {want}")


def read_config_file(path: str | Path) -> dict:
    """Read ``--config FILE``: a JSON object, or YAML when PyYAML is installed."""
    path = Path(path)
    if not path.is_file():
        raise XprepError(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise XprepError(f"--config {path}: YAML needs PyYAML (`pip install pyyaml`), "
                             "or write the config as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise XprepError(f"--config {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise XprepError(f"--config {path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise XprepError(f"--config {path}: must hold an object of config keys, not {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve_config(file: str | None, overrides: dict) -> TrainConfig:
    """Defaults < file < overrides (flags left unset are None and do not override)."""
    values = read_config_file(file) if file else {}
    known = {f.name for f in fields(TrainConfig)}
    for key in values:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise XprepError(f"--config {file}: unknown key {key!r}"
                             + (f" (did you mean {hint[0]!r}?)" if hint else f"; keys: {', '.join(sorted(known))}"))
    values = {k: _yaml_float(k, v) for k, v in values.items()}
    for flag, other in (("steps", "epochs"), ("epochs", "steps")):  # a flag's run length replaces the file's
        if overrides.get(flag) is not None:
            values.pop(other, None)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if not values.get("packed"):
        raise XprepError("no pack given: pass PACKED or set `packed` in --config")
    try:
        return TrainConfig(**values)
    except TypeError as e:  # pragma: no cover - unknown keys are caught above
        raise XprepError(f"config: {e}") from None


_FLOAT_FIELDS = {f.name for f in fields(TrainConfig) if "float" in str(f.type)}


def _yaml_float(key: str, value):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: take it as the number it is meant to be."""
    if key in _FLOAT_FIELDS and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def validate_against_schema(config: dict) -> None:
    """Check a resolved config against schemas/train.schema.json (when jsonschema is installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    if not SCHEMA.is_file():
        return
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.path) or "(top level)"
        raise XprepError(f"config {where}: {e.message} (schemas/train.schema.json)")
