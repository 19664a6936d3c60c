"""Tokenizers: a tokenizer.json (or a GPT-2 / SentencePiece / tiktoken file, converted once) → an encoder with the
reference library checked against the fast one. Imports nothing of the other stages.

Modules: files.py (which files --tokenizer names), conversion.py with one module per foreign format
(gpt2_bpe.py, sentencepiece_bpe.py, tiktoken_bpe.py, their shared built.py) and its cache (conversion_cache.py),
info.py (``load_tokenizer_info``: the tokenizer as the manifest records it), memo.py (facts memoized in the cache
directory), cuts.py (clean cuts, spelling), encoder.py (``Encoder``, ``choose_backend``).

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.tokenizer.encoder import Encoder, add_around, choose_backend, csr_offsets
from xprep.prep.tokenizer.info import DOCUMENT_END, TokenizerInfo, load_tokenizer_info, marker_pieces

__all__ = [
    "DOCUMENT_END", "Encoder", "TokenizerInfo", "add_around", "choose_backend", "csr_offsets", "load_tokenizer_info",
    "marker_pieces"
]
