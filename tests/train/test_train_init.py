"""Meta-device init (issue 13): the model is built without storage, then materialized parameter by parameter
with values that depend on (seed, name) only. Layouts of 2 gloo ranks (FSDP2 shards, CP, no FSDP2) are
checked against the whole 1-process init in tests/test_parallel_equivalence.py."""

from __future__ import annotations

import torch
from trainkit import tiny_model
from xprep.train.config import ModelSection
from xprep.train.dist import ParallelDims, materialize, parallelize, plain_name


def test_meta_build_then_materialize_is_the_plain_init():
    model, config, initial = ModelSection("tiny").build_meta(128, seed=0)
    assert all(p.is_meta for p in model.parameters()) and config["vocab_size"] == 128
    model = parallelize(model, ParallelDims(), activation_checkpointing=True)  # wrapped names too
    materialize(model, torch.device("cpu"), initial)
    ref = tiny_model(128)
    got = {plain_name(n): p for n, p in model.named_parameters()}
    assert got.keys() == dict(ref.named_parameters()).keys()
    assert all(torch.equal(got[n], p) for n, p in ref.named_parameters())
    other, _, initial_1 = ModelSection("tiny").build_meta(128, seed=1)
    materialize(other, torch.device("cpu"), initial_1)
    assert not torch.equal(other.layers[0].attention.wq.weight, ref.layers[0].attention.wq.weight)
