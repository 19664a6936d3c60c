"""``xprep tokenize``: records → token datasets, in parallel and in input order (``ray/``: the same, as shards on a
Ray cluster). Uses sources, tokenizer, chat and dataset.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.tokenize.config import TokenizeConfig
from xprep.prep.tokenize.run import run_tokenize

__all__ = [
    "TokenizeConfig", "run_tokenize"
]
