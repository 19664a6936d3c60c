"""Hugging Face Llama / Qwen2 / Mistral weights in and out of the built-in model (train/model.py).

```
HF config.json           ─builtin_config─▶ ModelConfig      (None + the reason, for what it cannot express)
HF *.safetensors         ─read_hf_weights─▶ built-in state dict (names mapped, fp32, read lazily)
run checkpoint (DCP)     ─export_run─▶ DIR/model.safetensors + config.json   (AutoModelForCausalLM loads it)
whole built-in state     ─write_hf_model─▶ the same, for export and for --save-hf (train/weights.py)
run → pack → datasets    ─data_tokenizer─▶ DIR/tokenizer.json + tokenizer_config.json   (AutoTokenizer loads it;
                                                                          train/hf_tokenizer.py)
```
The built-in model rotates q/k by the half-split `rotate_half` convention, as Hugging Face does,
so q/k weights map one to one (no Meta-style interleave permutation). Mistral without a sliding
window is Llama; Qwen2 is Llama with q/k/v biases. Exports are written as `LlamaForCausalLM`
(`Qwen2ForCausalLM` when the model has q/k/v biases), in fp32, the trainer's master weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from xprep.prep.errors import XprepError
from xprep.prep.io import fsync_dir, fsync_tree
from xprep.train.checkpoint import CheckpointManager, quiet_dcp
from xprep.train.ckpt_files import damage, find_latest
from xprep.train.hf_tokenizer import (
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    DataTokenizer,
    data_tokenizer,
    read_json_or_empty,
)
from xprep.train.model import ModelConfig, Transformer

SUPPORTED = ("llama", "qwen2", "mistral")

# One table, both directions: Hugging Face name → built-in name ({i}: the layer index).
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry


def name_map(n_layers: int) -> dict[str, str]:
    """Every Hugging Face parameter name the built-in model may have → its built-in name."""
    names = dict(_GLOBAL_NAMES)
    for i in range(n_layers):
        names.update({f"model.layers.{i}.{h}": f"layers.{i}.{b}" for h, b in _LAYER_NAMES.items()})
    return names


# ------------------------------------------------------------------------------------------ in
def builtin_config(hf: dict) -> tuple[ModelConfig | None, str]:
    """The built-in model's config for a Hugging Face config (as `PretrainedConfig.to_dict()`), or None and
    why the built-in model cannot compute what that architecture does."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        return None, f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}"
    if hf.get("hidden_act", "silu") != "silu":
        return None, f"hidden_act {hf['hidden_act']!r} is not silu"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        return None, f"RoPE scaling {rope_type!r} (only plain RoPE is built in)"
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        return None, f"head_dim {head_dim} × {heads} heads ≠ hidden_size {dim}"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        return None, "biases on the attention output or the MLP"
    window = _sliding_window(hf)
    if window:
        return None, f"sliding-window attention ({window})"
    try:
        cfg = ModelConfig(vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
                          n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
                          rope_theta=float(theta), norm_eps=float(hf["rms_norm_eps"]),
                          tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=kind == "qwen2")
    except XprepError as e:
        return None, str(e)
    return cfg, ""


def _sliding_window(hf: dict) -> str:
    """Where sliding-window attention is active, in words; '' when every layer attends fully."""
    if hf.get("model_type") == "qwen2":
        layer_types = hf.get("layer_types") or []
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            return f"use_sliding_window, window {hf.get('sliding_window')}"
        return ""
    if hf.get("sliding_window"):
        return f"sliding_window {hf['sliding_window']}"
    return ""


def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of a Hugging Face model directory (sharded via its index, or one file); [] when none."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / f for f in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise XprepError(f"--model hf:{directory}: cannot read {index.name} (its weight_map: "
                             f"{type(e).__name__}: {e}); re-download the checkpoint") from None
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


@dataclass(frozen=True)
class _Stored:
    """Where one tensor of the built-in model lies in hf:DIR, as the file's header says."""

    path: Path
    hf_name: str
    dtype: str  # safetensors' name: BF16, F16, F32, ...
    shape: tuple[int, ...]


class HFWeights(Mapping[str, Tensor]):
    """hf:DIR's weights as the built-in model's state dict for ``cfg``, each tensor read from its file (an
    mmap) when asked and returned in fp32, so loading holds one whole tensor at a time, not the model.

    ``xprep.train.dist.materialize`` asks for one parameter at a time and keeps this rank's shard of it: with
    the whole state dict read first, every rank would hold 4 bytes × parameters of host memory besides
    its shard. The headers are read here, eagerly (they cost nothing): every tensor the model needs must
    be there with its shape and a floating-point dtype, and nothing else may be (a tied model may still
    carry ``lm_head.weight``: it is dropped), so a checkpoint the mapping misreads fails before anything
    is built, not silently or mid-load. Holds paths only: a file stays mapped while a tensor read from it lives.
    """

    def __init__(self, directory: str | Path, cfg: ModelConfig):
        self.directory = str(directory)
        shapes = param_shapes(cfg)
        names = name_map(cfg.n_layers)
        self._stored: dict[str, _Stored] = {}
        unexpected = []
        for path, hf_name, dtype, shape in _headers(self.directory):
            if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and cfg.tie_embeddings):
                continue
            name = names.get(hf_name)
            if name not in shapes:
                unexpected.append(hf_name)
            elif name in self._stored:
                raise self._error(f"{hf_name} is in both {self._stored[name].path.name} and {path.name}; "
                                  "keep one copy (the index's weight_map says which)")
            else:
                self._stored[name] = _Stored(path, hf_name, dtype, shape)
        missing = sorted(shapes.keys() - self._stored.keys())
        if missing or unexpected:
            raise self._error(f"weights do not match a {cfg.n_layers}-layer Llama-family model (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}); check the checkpoint")
        for name, stored in self._stored.items():
            if stored.shape != shapes[name]:
                raise self._error(f"{stored.hf_name} in {stored.path.name} has shape {list(stored.shape)}, but "
                                  f"config.json's model needs {list(shapes[name])}; the weights do not belong "
                                  "to this config.json")
            if not stored.dtype.startswith(("F", "BF")):
                raise self._error(f"{stored.hf_name} in {stored.path.name} is {stored.dtype}, not floating point "
                                  "(a quantized checkpoint?); give the checkpoint in bf16, fp16 or fp32")

    def __getitem__(self, name: str) -> Tensor:
        """The whole tensor ``name`` (a built-in parameter name), in fp32; the file is unmapped once the
        caller drops it (an fp32 file's tensor is the mapped one, copy-on-write; another dtype's a copy)."""
        from safetensors import SafetensorError, safe_open  # deferred: only hf:DIR reads safetensors

        stored = self._stored[name]
        try:
            with safe_open(stored.path, framework="pt", device="cpu") as f:
                tensor = f.get_tensor(stored.hf_name)
        except (OSError, SafetensorError) as e:  # safetensors' own: a file changed since its header was read
            raise self._error(f"cannot read {stored.hf_name} from {stored.path} ({type(e).__name__}: {e}); "
                              "check the file (was it changed or removed while the run started?)") from None
        if tuple(tensor.shape) != stored.shape:
            raise self._error(f"{stored.hf_name} in {stored.path} changed while the run started (shape "
                              f"{list(tensor.shape)}, was {list(stored.shape)}); start again once nothing writes it")
        return tensor.to(torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def _error(self, what: str) -> XprepError:
        return XprepError(f"--model hf:{self.directory}: {what}")


def _headers(directory: str) -> Iterator[tuple[Path, str, str, tuple[int, ...]]]:
    """(file, name, dtype, shape) of every tensor in hf:DIR's safetensors files, from their headers alone."""
    from safetensors import SafetensorError, safe_open  # deferred: only hf:DIR runs read safetensors

    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}
                found = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()]
        except (OSError, SafetensorError) as e:  # safetensors' own: not a safetensors file, or truncated
            raise XprepError(f"--model hf:{directory}: cannot read {path} ({type(e).__name__}: {e}); "
                             "re-download the checkpoint") from None
        for name, dtype, shape in found:
            yield path, name, dtype, shape


def read_hf_weights(directory: str | Path, cfg: ModelConfig) -> HFWeights:
    """The safetensors weights of ``directory`` as a state dict of the built-in model for ``cfg``, in fp32,
    each tensor read when asked for (``HFWeights``); its names, shapes and dtypes are checked now."""
    return HFWeights(directory, cfg)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The built-in model's parameter names for ``cfg`` and their shapes, without building it."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}


def param_names(cfg: ModelConfig) -> list[str]:
    """The built-in model's parameter names for ``cfg``, without building it."""
    return list(param_shapes(cfg))


# ------------------------------------------------------------------------------------------ out
def hf_config_dict(cfg: ModelConfig, max_position_embeddings: int = 8192) -> dict:
    """config.json for ``cfg``: Llama, or Qwen2 when it has q/k/v biases. RoPE's theta is written both as
    transformers 4 reads it (``rope_theta``) and as 5 does (``rope_parameters``)."""
    qwen2 = cfg.qkv_bias
    out = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if qwen2:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                   layer_types=["full_attention"] * cfg.n_layers)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def builtin_to_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A built-in state dict in Hugging Face names (contiguous, as safetensors wants)."""
    back = {b: h for h, b in name_map(cfg.n_layers).items()}
    return {back[name]: t.detach().contiguous() for name, t in state.items()}


def checkpoint_path(run: str | Path, step: int | None) -> Path:
    """The checkpoint directory of ``run`` at ``step``, whole and undamaged (``xprep.train.ckpt_files.damage``); None:
    the one ``--resume auto`` would take (``find_latest``: the one ``latest`` names, else the newest whole one,
    said on stderr)."""
    root = Path(run) / "checkpoints"
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit()) if root.is_dir() else []
    if not steps:
        raise XprepError(f"{run}: no checkpoint (no {root}/step-<N>); give the directory of a run that saved one")
    if step is None:
        path, note = find_latest(root)
        if note:
            print(note, file=sys.stderr)
        return path
    if step not in steps:
        raise XprepError(f"--step {step}: {run} has no checkpoint at that step; it has step "
                         f"{', '.join(map(str, steps))}")
    path = root / f"step-{step}"
    problem = damage(path)
    if problem is not None:
        raise XprepError(f"{path}: not a complete checkpoint, it is {problem}; give another --step")
    return path


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja")
# Copied from the hf:DIR a run started from, when it is still there: what a user of the export needs besides weights
# (its tokenizer files only when the data's tokenizer cannot be found: the data's is the one the model learned).
_SOURCE_FILES = (*_TOKENIZER_FILES, "generation_config.json")


def export_run(run: str | Path, step: int | None, output: str | Path, dtype: str = "fp32") -> Path:
    """Write the model of ``run``'s checkpoint at ``step`` to ``output`` as model.safetensors + config.json, with
    the tokenizer the run's data was encoded with (``data_tokenizer``), so ``AutoTokenizer`` loads it too.

    The DCP checkpoint is read on this one process (no process group), whatever layout saved it; the
    directory is built beside ``output`` and renamed into place (``publishing``), so a failed export leaves
    nothing. What comes beside the weights is ``ExportExtras``.
    """
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise XprepError(f"-o {output}: exists and is not an empty directory; give a new directory")
    if dtype not in EXPORT_DTYPES:
        raise XprepError(f"--dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    path = checkpoint_path(run, step)
    trainer_state = CheckpointManager.read_trainer_state(path)
    cfg = builtin_model_config(trainer_state.get("model") or {}, path, "export")
    extras = ExportExtras.of_run(run, trainer_state)
    model = model_from_checkpoint(path, cfg)
    with publishing(output) as tmp:
        said = write_hf_model(tmp, model.state_dict(), cfg, extras, output, dtype)
    print(said, file=sys.stderr)
    return output


def model_from_checkpoint(path: Path, cfg: ModelConfig) -> Transformer:
    """The built-in model of ``cfg`` with the weights of checkpoint ``path``, read on this one process (no process
    group) on the CPU, whatever layout saved them."""
    import torch.distributed.checkpoint as dcp  # deferred: only export needs DCP

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    quiet_dcp()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return model


@dataclass(frozen=True)
class ExportExtras:
    """What an export writes beside the weights: the tokenizer the run's data was encoded with (``data_tokenizer``;
    None, and why, when it is not found), and the hf:DIR the run's weights came from (``--model`` or ``--init-from``
    hf:DIR), whose generation config and token ids come along while it exists (and its tokenizer files, when the
    data's are not found). With no tokenizer found anywhere the model is exported alone and a warning says why: the
    weights are the expensive part, and the tokenizer files can be copied in afterwards."""

    tokenizer: DataTokenizer | None
    missing: str  # why ``tokenizer`` is None
    source: Path | None
    source_config: dict  # the source's config.json ({} without one)

    @classmethod
    def of_run(cls, run: str | Path, trainer_state: dict) -> ExportExtras:
        """The extras of ``run``, whose checkpoint (or trainer, during the run) has ``trainer_state``."""
        init = trainer_state.get("init") or {}
        source = (trainer_state.get("model") or {}).get("hf") or (init.get("path") if init.get("from") == "hf" else "")
        source = Path(str(source)) if source else None
        try:
            tokenizer, missing = data_tokenizer(run, trainer_state.get("pack_key")), ""
        except XprepError as e:
            tokenizer, missing = None, str(e)
        return cls(tokenizer, missing, source, read_json_or_empty(source / "config.json") if source else {})


def write_hf_model(out: Path, state: Mapping[str, Tensor], cfg: ModelConfig, extras: ExportExtras, shown: Path,
                   dtype: str = "fp32") -> str:
    """Write the built-in model's ``state`` (its names) into the empty directory ``out`` as model.safetensors (one
    file, ``dtype``) + config.json, with ``extras``; the console line saying which tokenizer came along (``shown``:
    where the directory will be)."""
    from safetensors.torch import save_file  # deferred: only exports write safetensors

    tensors = {k: t.to(EXPORT_DTYPES[dtype]) for k, t in builtin_to_hf(state, cfg).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    del tensors
    _readable_as_umask_allows(out / "model.safetensors")  # safetensors creates it 0600: others could not load it
    source, source_config, tokenizer = extras.source, extras.source_config, extras.tokenizer
    config = hf_config_dict(cfg, source_config.get("max_position_embeddings", 8192))
    config["torch_dtype"] = str(EXPORT_DTYPES[dtype]).removeprefix("torch.")
    for key, value in (tokenizer.token_ids if tokenizer else {}).items():
        config[key] = value
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source_config:
            config[key] = source_config[key]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _SOURCE_FILES if tokenizer is None else set(_SOURCE_FILES) - set(_TOKENIZER_FILES):
        if source is not None and (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return tokenizer.write(out) if tokenizer else _without_tokenizer(out, shown, extras.missing)


def _readable_as_umask_allows(path: Path) -> None:
    """Give ``path`` the mode a plain ``open`` would have given it (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def publishing(output: Path, replace: bool = False) -> Iterator[Path]:
    """A temporary directory beside ``output`` to write it in: renamed to ``output`` (once on disk: fsync'd) when the
    block ends, deleted when it raises, so ``output`` is never seen half written. ``output`` may be an empty
    directory; with ``replace`` a whole one too, renamed aside first and deleted once the new one is in place."""
    tmp, aside = output.with_name(f".{output.name}.tmp"), output.with_name(f".{output.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed writer's
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_tree(tmp)
        if output.exists() and replace:
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(output, aside)
        elif output.exists():
            output.rmdir()
        os.replace(tmp, output)
        fsync_dir(output.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _without_tokenizer(tmp: Path, output: Path, why: str) -> str:
    """The console line of an export without the data's tokenizer: hf:DIR's files, or a warning that it has none."""
    if (tmp / TOKENIZER_JSON).is_file():
        return f"note: no tokenizer of the data found ({why}); the tokenizer files are hf:DIR's"
    return (f"warning: no tokenizer written to {output}: {why}. AutoTokenizer.from_pretrained({output}) fails until "
            "the tokenizer.json and tokenizer_config.json the data was tokenized with are copied into it")


def builtin_model_config(saved: dict, where: Path | str, purpose: str) -> ModelConfig:
    """The built-in model config that a checkpoint's trainer.json records (its ``model``), for ``purpose`` (in
    words: "export", "--init-from")."""
    fields = set(ModelConfig.__dataclass_fields__)
    if "dim" not in saved:
        raise XprepError(f"{where}: this run trained a transformers module (hf:DIR outside the built-in model), "
                         f"not the built-in model: {purpose} is for the built-in model only")
    return ModelConfig(**{k: v for k, v in saved.items() if k in fields})
