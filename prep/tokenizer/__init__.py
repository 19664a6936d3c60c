"""Tokenizers: a tokenizer.json (or a GPT-2 / SentencePiece / tiktoken file, converted once) → an encoder with the
reference library checked against the fast one. Imports nothing of the other stages.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.tokenizer.encoder import (
    DOCUMENT_END,
    Encoder,
    TokenizerInfo,
    add_around,
    choose_backend,
    csr_offsets,
    load_tokenizer_info,
    marker_pieces,
)

__all__ = [
    "DOCUMENT_END", "Encoder", "TokenizerInfo", "add_around", "choose_backend", "csr_offsets", "load_tokenizer_info",
    "marker_pieces"
]
