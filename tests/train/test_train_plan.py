"""Batch planning against real `xprep pack` entries, config files, checkpoint paths."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from trainkit import make_dataset, random_docs
from xprep.cli import xtrain
from xprep.prep.errors import XprepError
from xprep.prep.pack.cache import PackConfig, pack
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import LATEST
from xprep.train.config import FLAT_KEYS, TrainConfig, flatten, read_config_file, resolve_config
from xprep.train.data import IGNORE, PackedDataset
from xprep.train.dist import ParallelDims
from xprep.train.samplers import ResumePoint, build_sampler, plan_batches


@pytest.fixture
def dataset(tmp_path):
    docs = random_docs(200, 2, 90, vocab=128, seed=2)
    make_dataset(tmp_path / "ds", docs, vocab_size=128)
    return tmp_path / "ds", docs


@pytest.mark.parametrize("method,opts", [("sequential", {"seq_len": 128}), ("multipack", {"seq_len": 128}),
                                         ("token-aware", {"max_tokens": 128})])
def test_real_packs_keep_every_document_once(dataset, tmp_path, method, opts):
    path, docs = dataset
    pack([path], tmp_path / "p", PackConfig(method=method, **opts))
    ds = PackedDataset(tmp_path / "p")
    seen = []
    for b in range(len(ds)):
        x = ds[b]
        cu = x["cu_seqlens"].tolist()
        lo, hi = int(ds.entry.bin_offsets[b]), int(ds.entry.bin_offsets[b + 1])
        for k, doc in enumerate(ds.entry.item_doc[lo:hi].tolist()):
            s, e = cu[k], cu[k + 1]
            assert x["input_ids"][0, s:e].tolist() == docs[doc].tolist()
            assert x["labels"][0, e - 1] == IGNORE
            seen.append(doc)
    assert sorted(seen) == list(range(len(docs)))


def test_balanced_token_aware_pack_plan(dataset, tmp_path):
    path, _ = dataset
    pack([path], tmp_path / "p", PackConfig(method="token-aware", max_tokens=128, balance_dp=2, dp_micro_batches=3))
    ds = PackedDataset(tmp_path / "p")
    plan = plan_batches(len(ds), ds.entry.config, dp=2, micro_batch_size=1, steps=4)
    assert (plan.group, plan.global_batch_size, plan.grad_accum) == (2, 6, 3)
    ranks = [build_sampler("sequential", len(ds), 1, r, 2, 0, plan.group) for r in range(2)]
    for _ in range(10):
        got = [s.next_micro_batch()[0] for s in ranks]
        assert got[0] % 2 == 0 and got[1] == got[0] + 1  # bin b belongs to rank b % 2 (pack.json layout)
    with pytest.raises(XprepError, match="start the run on 2 ranks"):  # a new run, on 1 rank
        plan_batches(len(ds), ds.entry.config, dp=1, micro_batch_size=1, steps=4)
    resumed = plan_batches(len(ds), ds.entry.config, dp=1, micro_batch_size=1, steps=4, resume=ResumePoint(2, 12, 6))
    assert (resumed.group, resumed.global_batch_size, resumed.grad_accum) == (2, 6, 6)  # the same bins per step
    with pytest.raises(XprepError, match="DP group of 2 bins"):
        plan_batches(len(ds), ds.entry.config, dp=1, micro_batch_size=1, global_batch_size=5, steps=4,
                     resume=ResumePoint(2, 12, 6), allow_new_global=True)


def test_resume_on_a_new_global_batch(dataset, tmp_path):
    """Another global batch than the checkpoint's is refused, or with --allow-new-global-batch continues from its
    consumed samples: one epoch of 20 bins is then the 3 steps of 2 done, and (20 - 6) // 4 steps of 4."""
    at = ResumePoint(step=3, consumed_samples=6, global_batch_size=2)
    with pytest.raises(XprepError, match="--allow-new-global-batch"):
        plan_batches(20, {}, dp=1, micro_batch_size=1, global_batch_size=4, resume=at)
    plan = plan_batches(20, {}, dp=2, micro_batch_size=1, global_batch_size=4, resume=at, allow_new_global=True)
    assert (plan.global_batch_size, plan.grad_accum, plan.steps) == (4, 2, 3 + 3)
    assert plan_batches(20, {}, dp=1, micro_batch_size=1, resume=at).steps == 10  # the same batch: as before
    assert plan_batches(20, {}, dp=1, micro_batch_size=1, global_batch_size=4, steps=9, resume=at,
                        allow_new_global=True).steps == 9


def test_epochs_and_global_batch(dataset, tmp_path):
    path, _ = dataset
    pack([path], tmp_path / "p", PackConfig(method="sequential", seq_len=128))
    n = PackedDataset(tmp_path / "p").entry.num_bins
    plan = plan_batches(n, {}, dp=2, micro_batch_size=2, global_batch_size=8, epochs=2)
    assert (plan.steps, plan.grad_accum) == (2 * n // 8, 2)
    with pytest.raises(XprepError, match="not a multiple"):
        plan_batches(n, {}, dp=2, micro_batch_size=2, global_batch_size=6, steps=1)


def test_config_files(tmp_path, monkeypatch):
    (tmp_path / "c.yml").write_text("micro-batch-size: 4\nsampler: random\nlr: 1e-3\n")
    cfg = resolve_config(str(tmp_path / "c.yml"), {"packed": "p", "sampler": None, "seed": 5})
    assert (cfg.data.micro_batch_size, cfg.data.sampler, cfg.seed, cfg.optimizer.lr) == (4, "random", 5, 1e-3)
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(XprepError, match="PyYAML"):
        read_config_file(tmp_path / "c.yml")
    with pytest.raises(XprepError, match="no pack given"):
        resolve_config(None, {"packed": None})
    with pytest.raises(XprepError, match="'sampler'"):
        TrainConfig.from_dict({"packed": "p", "sampler": 3})
    with pytest.raises(XprepError, match="not one of"):
        TrainConfig.from_dict({"packed": "p", "schedule": "exp"})


def test_config_files_nested_flat_or_both(tmp_path):
    """Sections, the flat keys of the flags (config.json before the sections), or a mix; flags win."""
    (tmp_path / "nested.json").write_text(json.dumps({
        "data": {"packed": "p", "micro-batch-size": 2}, "model": {"name": "small"}, "optimizer": {"lr": "1e-3"},
        "parallel": {"cp": 2}, "checkpoint": {"keep": 3}, "steps": 7}))
    (tmp_path / "flat.json").write_text(json.dumps({
        "packed": "p", "micro_batch_size": 2, "model": "small", "lr": 1e-3, "cp": 2, "keep": 3, "steps": 7}))
    (tmp_path / "mixed.yaml").write_text("packed: p\nmicro_batch_size: 2\nmodel: small\noptimizer:\n  lr: 1e-3\n"
                                        "cp: 2\ncheckpoint: {keep: 3}\nsteps: 7\n")
    configs = [resolve_config(str(tmp_path / f), {}) for f in ("nested.json", "flat.json", "mixed.yaml")]
    assert configs[0] == configs[1] == configs[2]
    cfg = configs[0]
    assert (cfg.data.micro_batch_size, cfg.model.name, cfg.optimizer.lr, cfg.parallel.cp, cfg.checkpoint.keep,
            cfg.steps) == (2, "small", 1e-3, 2, 3, 7)
    assert resolve_config(str(tmp_path / "nested.json"), {"lr": 5e-3, "model": "tiny"}).optimizer.lr == 5e-3
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # config.json reads back
    assert TrainConfig.from_dict(flatten(cfg.to_dict())) == cfg and set(flatten(cfg.to_dict())) == set(FLAT_KEYS)
    (tmp_path / "bad.json").write_text(json.dumps({"lr": 1e-3, "optimizer": {"lr": 2e-3}}))
    with pytest.raises(XprepError, match="'lr' and 'optimizer.lr' set the same field"):
        resolve_config(str(tmp_path / "bad.json"), {"packed": "p"})
    (tmp_path / "bad.json").write_text(json.dumps({"optimizer": {"lrr": 2e-3}}))
    with pytest.raises(XprepError, match="did you mean 'optimizer.lr'"):
        resolve_config(str(tmp_path / "bad.json"), {"packed": "p"})
    with pytest.raises(XprepError, match="'model': 3 is not a str"):
        TrainConfig.from_dict({"data": {"packed": "p"}, "model": {"name": 3}})
    with pytest.raises(XprepError, match="--warmup -1 must be ≥ 0"):
        TrainConfig.from_dict({"packed": "p", "warmup": -1})


def test_a_flag_replaces_the_run_length_of_the_config_file(tmp_path):
    (tmp_path / "c.json").write_text('{"epochs": 1, "lr": 0.001}')
    cfg = resolve_config(str(tmp_path / "c.json"), {"packed": "p", "steps": 2})
    assert (cfg.steps, cfg.epochs, cfg.optimizer.lr) == (2, None, 1e-3)
    (tmp_path / "c.json").write_text('{"steps": 5}')
    cfg = resolve_config(str(tmp_path / "c.json"), {"packed": "p", "epochs": 2.0})
    assert (cfg.steps, cfg.epochs) == (None, 2.0)
    with pytest.raises(XprepError, match="choose one"):
        resolve_config(None, {"packed": "p", "steps": 2, "epochs": 1.0})


def test_token_aware_packs_take_one_bin_per_micro_batch(dataset, tmp_path):
    path, _ = dataset
    pack([path], tmp_path / "p", PackConfig(method="token-aware", max_tokens=128))
    ds = PackedDataset(tmp_path / "p")
    assert plan_batches(len(ds), ds.entry.config, dp=1, micro_batch_size=1, steps=1).micro_batch_size == 1
    with pytest.raises(XprepError, match="token-aware"):
        plan_batches(len(ds), ds.entry.config, dp=1, micro_batch_size=2, steps=1)


def test_resume_path_forms(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    (ck / "step-4").mkdir(parents=True)
    (ck / "step-4" / "trainer.json").write_text("{}")  # as saved before trainer.json recorded digests
    (ck / "step-4" / ".metadata").write_text("{}")
    (ck / "latest").write_text("step-4\n")
    m = CheckpointManager(tmp_path / "other", ParallelDims())
    for form in (tmp_path / "run", ck, ck / "step-4"):
        assert m.resolve(str(form)) == ck / "step-4"
    assert m.resolve("auto") is None
    with pytest.raises(XprepError, match="not a complete checkpoint"):
        m.resolve(str(tmp_path))


def test_flags_config_and_schema_agree(repo_root):
    """Every flag is a config field (its flat key) and every field, section by section, is in
    schemas/train.schema.json."""
    nested = TrainConfig.from_dict({"packed": "p"}).to_dict()
    schema = json.loads((repo_root / "schemas" / "train.schema.json").read_text())
    assert set(schema["properties"]) == set(nested)
    for name, value in nested.items():
        if isinstance(value, dict):
            assert set(schema["properties"][name]["properties"]) == set(value), name
    params = {p.name for p in xtrain.commands["run"].params} - {"config_file"}
    assert params == set(FLAT_KEYS)


def test_retention_keeps_newest_latest_and_best(tmp_path):
    m = CheckpointManager(tmp_path, ParallelDims(), keep=2)
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.5), (4, 2.0), (5, 2.2)):
        (m.root / f"step-{step}").mkdir(parents=True)
        (m.root / f"step-{step}" / "trainer.json").write_text(json.dumps({"step": step, "loss": loss}))
    m._retain("step-3")  # e.g. resumed from step-3: latest is not the newest
    assert m.steps() == [2, 3, 4, 5]


@pytest.mark.parametrize("latest_is_resaved", [True, False])
def test_resaving_a_step_keeps_latest_loadable(tmp_path, monkeypatch, latest_is_resaved):
    """Re-saving step-N (after resuming from an earlier step): `latest` names a complete checkpoint
    after every rename, copy and delete of the publication."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    m = CheckpointManager(tmp_path, ParallelDims(), keep=5)
    m.save(1, model, opt, {"loss": 1.0})
    m.save(2, model, opt, {"loss": 1.0})
    if not latest_is_resaved:
        (m.root / LATEST).write_text("step-1\n")  # resumed from step-1 with step-2 ahead of it

    def check():
        path = m.latest()
        assert path is not None and (path / ".metadata").is_file() and (path / "trainer.json").is_file()

    seen = []
    for mod, name in ((os, "replace"), (shutil, "rmtree")):
        real = getattr(mod, name)

        def wrapped(*a, _real=real, **k):
            check()
            out = _real(*a, **k)
            check()
            seen.append(1)
            return out
        monkeypatch.setattr(mod, name, wrapped)
    with torch.no_grad():
        model.weight.add_(1.0)
    m.save(2, model, opt, {"loss": 0.5})
    monkeypatch.undo()
    m.finish()  # the replaced step's directory is deleted in the background (xprep.train.checkpoint)
    assert seen and m.latest().name == "step-2" and m.read_trainer_state(m.latest())["loss"] == 0.5
    assert sorted(p.name for p in m.root.iterdir()) == ["latest", "step-1", "step-2"]
