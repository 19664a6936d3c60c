"""``--model hf:DIR``: a local Hugging Face causal LM behind the trainer's model interface.

transformers is an optional dependency (``pip install 'xprep[hf]'``): it is imported only when
such a model is asked for.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from prep.errors import XprepError


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


def build_hf_model(directory: str, vocab_size: int) -> tuple[HFCausalLM, dict]:
    """The model in ``directory`` in fp32 (master weights), and its scalar config entries."""
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
