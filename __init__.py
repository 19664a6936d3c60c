"""xprep: offline data preparation for LLM training (tokenize, pack, inspect) plus a thin PyTorch trainer.

The repository's top level is this package: ``xprep.prep`` (prep/), ``xprep.train`` (train/), ``xprep.cli``.
"""
