"""``--model hf:DIR``: a local Hugging Face causal LM, in the built-in model when it can be.

Llama, Qwen2 and Mistral checkpoints in safetensors load into the built-in model (train/hf_weights.py),
so context parallelism, FSDP2 and the rest apply; any other architecture runs as the transformers
module behind the trainer's model interface (``HFCausalLM``), with a console note saying why.
transformers is an optional dependency (``pip install 'xprep[hf]'``): it is imported only when
such a model is asked for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from xprep.prep.errors import XprepError
from xprep.train.hf_weights import builtin_config, safetensors_files
from xprep.train.model import ModelConfig


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM fed packed rows (cu_seqlens unused).

    ``use_cache=False`` and no attention mask: only then do restarting position_ids keep packed
    documents apart (with the default ``use_cache=True`` transformers silently ignores the packing).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, input_ids, position_ids, cu_seqlens, cp=None) -> torch.Tensor:
        if cp is not None and cp.size > 1:
            raise XprepError("context parallelism needs the built-in model, not hf:DIR")
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits.float()


def check_hf_model(directory: str) -> None:
    """Fail early (before any process group) unless ``directory`` holds a model transformers can load."""
    if not (Path(directory) / "config.json").is_file():
        raise XprepError(f"--model hf:{directory}: no config.json in {directory}; give a local Hugging Face model "
                         "directory")
    try:
        import transformers  # noqa: F401  # optional dependency
    except ImportError:
        raise XprepError("--model hf:DIR needs transformers: pip install 'xprep[hf]'") from None


def hf_builtin_config(directory: str, vocab_size: int) -> tuple[ModelConfig | None, str]:
    """The built-in model's config for the model in ``directory``, or None and why it runs as a transformers
    module instead. A vocabulary smaller than the data's is an error either way."""
    check_hf_model(directory)
    hf = _read_hf_config(directory)
    if hf.get("vocab_size", vocab_size) < vocab_size:
        raise XprepError(f"--model hf:{directory}: vocabulary of {hf['vocab_size']} ids is smaller than the "
                         f"data's ({vocab_size}); use the model the data was tokenized for")
    cfg, why = builtin_config(hf)
    if cfg is not None and not safetensors_files(directory):
        return None, "no safetensors weights (model.safetensors or its index)"
    return cfg, why


# What config.json must state for the built-in model to be built from the file alone: the rest defaults
# the same in LlamaConfig, Qwen2Config and MistralConfig (silu, no biases, no sliding window in Qwen2).
_STATED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings")


def _read_hf_config(directory: str) -> dict:
    """config.json as transformers reads it. The file itself when it states every field whose default differs
    between architectures (as save_pretrained writes it): importing transformers' config classes costs seconds
    per rank. Otherwise AutoConfig, which knows each architecture's defaults."""
    try:
        raw = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise XprepError(f"--model hf:{directory}: cannot read config.json ({e})") from None
    rope_stated = "rope_theta" in raw or "rope_theta" in (raw.get("rope_parameters") or {})
    window_stated = raw.get("model_type") != "mistral" or "sliding_window" in raw
    if all(k in raw for k in _STATED) and rope_stated and window_stated:
        return raw
    import transformers  # optional dependency

    return transformers.AutoConfig.from_pretrained(directory).to_dict()


def build_hf_fallback(directory: str, vocab_size: int, why: str) -> tuple[HFCausalLM, dict]:
    """The transformers module for an architecture the built-in model cannot compute (``why``), with the
    console note saying so; the built-in path is ``xprep.train.config.ModelSection.build_meta``."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"note: --model hf:{directory}: {why}; running it as the transformers module (no context "
              "parallelism)", file=sys.stderr)
    return build_hf_module(directory, vocab_size)


def build_hf_module(directory: str, vocab_size: int) -> tuple[HFCausalLM, dict]:
    """The model in ``directory`` as the transformers module in fp32, and its scalar config entries."""
    check_hf_model(directory)
    import transformers  # optional dependency

    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"  # renamed in 4.56
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa",
                                                           **{dtype_kw: torch.float32})
    if hf.config.vocab_size < vocab_size:
        raise XprepError(f"--model hf:{directory}: vocabulary of {hf.config.vocab_size} ids is smaller than the "
                         f"data's ({vocab_size}); use the model the data was tokenized for")
    hf.config.use_cache = False
    return HFCausalLM(hf), {"hf": directory, **{k: v for k, v in hf.config.to_dict().items()
                                                if isinstance(v, (int, float, str, bool))}}
