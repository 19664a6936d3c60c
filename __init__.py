"""xprep: offline data preparation for LLM training (tokenize, pack, inspect) plus a thin PyTorch trainer.

The Python API (docs/api.md): what a script or a training loop of one's own needs — tokenize, open a dataset or a
pack, and iterate micro-batches exactly as ``xtrain run`` builds them (sampler, collate, context-parallel shard)::

    import xprep
    xprep.run_tokenize(xprep.TokenizeConfig(inputs=["corpus.jsonl"], output="ds", tokenizer="tokenizer/"))
    xprep.pack(["ds"], "packed", xprep.PackConfig(method="multipack", seq_len=2048))
    dataset = xprep.PackedDataset("packed")
    sampler = xprep.build_sampler("sequential", len(dataset), micro_batch_size=1, dp_rank=0, dp_size=1, seed=0)
    batch = xprep.micro_batch(dataset, sampler.next_micro_batch())

Each name is imported from its home on first use, so ``import xprep`` stays cheap (no torch, no numba): the
command line imports this package first, and ``xprep tokenize`` never needs the trainer's torch. The
repository's top level is this package: ``xprep.prep`` (prep/), ``xprep.train`` (train/), ``xprep.cli``.
"""

from __future__ import annotations

import importlib

# name → the module it is taken from: a stage's package for prep/ (its public surface), a module of train/
_EXPORTS = {
    "TokenizeConfig": "xprep.prep.tokenize",
    "run_tokenize": "xprep.prep.tokenize",
    "TokenDataset": "xprep.prep.dataset",
    "PackConfig": "xprep.prep.pack",
    "pack": "xprep.prep.pack",
    "PackedDataset": "xprep.train.data",
    "BinSampler": "xprep.train.samplers",
    "build_sampler": "xprep.train.samplers",
    "collate": "xprep.train.data",
    "shard_batch": "xprep.train.cp",
    "micro_batch": "xprep.train.data",
    "XprepError": "xprep.prep.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import an API name on first access (PEP 562), then keep it as a plain attribute."""
    home = _EXPORTS.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
