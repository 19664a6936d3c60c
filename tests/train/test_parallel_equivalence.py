"""FSDP2 × context parallel × accumulation: one global batch gives the same loss and gradients.

Issue 5, point 2 (first half): layouts (dp, cp, grad-accum) ∈ {(1,1,1), (2,1,1), (1,2,1),
(1,1,2), (2,1,2)} with FSDP2 on agree to 1e-5 (fp32), plus CP with activation checkpointing,
CP without FSDP, and FSDP2 without resharding after forward. (One process has nothing to
shard: (1,1,1) and (1,1,2) run without FSDP2, as `xtrain run` does.) Issue 13: reduce-scattering after
every micro-batch gives the same gradients with one reduce-scatter per micro-batch; the chunked loss
under FSDP2 × CP the same loss and gradients; bf16 (FSDP2's MixedPrecisionPolicy, autocast without
FSDP2) agrees within bf16 tolerance; the meta-device init gives every layout the 1-process weights
exactly. Issue 33: every --cp-mode (ring, the default, in every CP layout without a mode; ulysses and allgather at
C = 2; ring, ulysses, hybrid 2 × 2 and allgather at C = 4, with and without FSDP2 and activation checkpointing).
Issue 36: with --category-weight (one category at 0), FSDP2 × accumulation and CP × accumulation with the chunked
loss give the gradients of Σ w·CE / Σ w computed directly in plain torch on one whole model.
Also the data side of CP: bins of a pack made with --cp-size fill exactly their capacity once sharded, and packs
without room for the padding are refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from trainkit import CATEGORY_WEIGHTS, category_pack, cp_pack, grads, make_trainer, max_rel_diff, tiny_model
from xprep.cli import xtrain
from xprep.prep.errors import XprepError
from xprep.train.cp import padded_length, shard_batch
from xprep.train.data import IGNORE, PackedDataset, collate
from xprep.train.dist import ParallelDims, all_reduce_sum
from xprep.train.loss import LossSums, step_losses

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
GLOBAL_BATCH = 4  # bins: divisible by every dp × accum below
TOL = 1e-5
BF16_TOL = 3e-2  # bf16 keeps 8 mantissa bits: ~0.4% per rounding; the gradients differ by ~1% here


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return cp_pack(tmp_path_factory.mktemp("cp"))


def one_process(packed: Path, accum: int, precision: str = "fp32", category_weight: dict | None = None) -> dict:
    trainer = make_trainer(packed, micro=GLOBAL_BATCH // accum, accum=accum, precision=precision,
                           category_weight=category_weight)
    sums, _, _ = trainer.accumulate_gradients()
    total = LossSums.from_flat(all_reduce_sum(sums.flat(), trainer.dims), weighted=category_weight is not None)
    loss, categories = step_losses(total, trainer.category_names)
    return {"loss": loss, "grads": grads(trainer.model), "weighted_loss": total.weighted_loss,
            "categories": categories}


def direct_weighted_step(packed: Path, weights: dict[str, float]) -> dict:
    """Σ w·CE / Σ w over the first global batch in plain torch, on one whole model (the tiny preset's initial
    weights): w by each target's category, the tokens of weight 0 left out of both sums altogether."""
    ds = PackedDataset(packed)
    model = tiny_model(ds.vocab_size)
    batch = collate([ds[b] for b in range(GLOBAL_BATCH)])
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])[0]  # (T, V)
    labels = batch["labels"][0]
    w = torch.tensor([weights.get(name, 1.0) for name in ds.category_names])[batch["category_ids"][0]]
    kept = (labels != IGNORE) & (w > 0)
    loss = (w[kept] * F.cross_entropy(logits[kept], labels[kept], reduction="none")).sum() / w[kept].sum()
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {name: p.grad for name, p in model.named_parameters()}}


def run_layouts(packed: Path, nproc: int, layouts: list[str], tmp_path: Path) -> dict:
    """tests/_train_parallel_worker.py on `nproc` gloo ranks over `layouts`: {layout: its results}."""
    out = tmp_path / "layouts.pt"
    worker = ROOT / "tests" / "_train_parallel_worker.py"
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(worker), str(packed), str(out),
           str(GLOBAL_BATCH), *layouts]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def test_loss_and_gradients_agree_across_layouts(packed, tmp_path):
    layouts = ["2,1,1", "1,2,1", "2,1,2,once", "1,2,2,ac,once", "1,2,1,nofsdp", "2,1,2,keep,once", "2,1,2",
               "1,2,2,chunk,once", "2,1,2,bf16,once", "1,2,1,ac,bf16,chunk", "2,1,1,nofsdp,bf16",
               "1,2,2,ulysses,ac,once", "1,2,1,ulysses,nofsdp", "1,2,1,allgather", "2,1,2,weighted",
               "1,2,2,weighted,chunk"]
    results = run_layouts(packed, 2, layouts, tmp_path)
    weighted = {layout: results.pop(layout) for layout in layouts if "weighted" in layout}
    results["1,1,1"] = ref = one_process(packed, accum=1)
    results["1,1,2"] = one_process(packed, accum=2)
    results["1,1,2,bf16"] = one_process(packed, accum=2, precision="bf16")
    init = tiny_model(PackedDataset(packed).vocab_size)  # a whole model, materialized, then init_weights(0)
    assert len(ref["grads"]) == len(list(init.parameters()))
    for layout, got in results.items():
        tol = BF16_TOL if "bf16" in layout else TOL
        assert abs(got["loss"] - ref["loss"]) <= tol * ref["loss"], layout
        assert max_rel_diff(got["grads"], ref["grads"]) <= tol, layout
        if "bf16" in layout:  # it did compute in bf16
            assert max_rel_diff(got["grads"], ref["grads"]) > 1e-4, layout
        if "init" in got:  # any layout starts from the weights of a whole model initialized in one process
            assert got["init"].keys() == dict(init.named_parameters()).keys(), layout
            assert all(torch.equal(got["init"][n], p) for n, p in init.named_parameters()), layout
    # FSDP2 reduce-scatters after every micro-batch by default, so no rank holds unsharded gradients between two ...
    once = results["2,1,1"]["reduce_scatters"]
    assert once > 0 and results["2,1,2"]["reduce_scatters"] == 2 * once
    assert results["1,2,1,ac,bf16,chunk"]["reduce_scatters"] == once
    assert results["2,1,2"]["held_grad_bytes"] == 0
    # ... and once per step with --reduce-once-per-step (after the last micro-batch), each rank then holding the
    # whole model's gradients in fp32 between micro-batches
    assert results["2,1,2,once"]["reduce_scatters"] == results["2,1,2,keep,once"]["reduce_scatters"] == once
    assert results["1,2,2,ac,once"]["reduce_scatters"] == results["1,2,1"]["reduce_scatters"] == once
    assert results["1,2,2,chunk,once"]["reduce_scatters"] == results["2,1,2,bf16,once"]["reduce_scatters"] == once
    whole_model_fp32 = 4 * sum(p.numel() for p in init.parameters())
    assert results["2,1,2,once"]["held_grad_bytes"] == results["2,1,2,bf16,once"]["held_grad_bytes"] == whole_model_fp32
    # --category-weight: every split of the batch gives Σ w·CE / Σ w of one process, computed directly (category b,
    # weight 0, left out of it: its tokens add nothing to the gradient); the token mean and the channel losses
    # stay unweighted, b's included
    weighted["1,1,2"] = one_process(packed, accum=2, category_weight=CATEGORY_WEIGHTS)
    direct = direct_weighted_step(packed, CATEGORY_WEIGHTS)
    assert max_rel_diff(direct["grads"], ref["grads"]) > 0.05  # the weights do change the gradients
    for layout, got in weighted.items():
        assert abs(got["weighted_loss"] - direct["loss"]) <= TOL * direct["loss"], layout
        assert max_rel_diff(got["grads"], direct["grads"]) <= TOL, layout
        assert abs(got["loss"] - ref["loss"]) <= TOL * ref["loss"], layout
    unweighted = one_process(packed, accum=2)
    assert "b" in weighted["1,1,2"]["categories"]
    assert weighted["1,1,2"]["categories"] == pytest.approx(unweighted["categories"], rel=TOL)


def test_every_cp_mode_on_four_ranks_equals_one_process(tmp_path):
    """C = 4 under each --cp-mode through the trainer: FSDP2 or not, activation checkpointing, accumulation;
    loss and every gradient equal one process's (the default mode, ring, is also every layout above)."""
    packed4 = cp_pack(tmp_path / "cp4", cp_size=4)
    layouts = ["1,4,1,ring,ac", "1,4,2,ulysses,once", "1,4,1,hybrid,u2,ac", "1,4,2,hybrid,u2,nofsdp",
               "2,2,1,ulysses", "1,4,1,allgather,nofsdp,ac"]
    results = run_layouts(packed4, 4, layouts, tmp_path)
    ref = one_process(packed4, accum=1)
    assert list(results) == layouts
    for layout, got in results.items():
        assert abs(got["loss"] - ref["loss"]) <= TOL * ref["loss"], layout
        assert max_rel_diff(got["grads"], ref["grads"]) <= TOL, layout


def test_cp_bins_fill_their_capacity_once_sharded(packed):
    plain, cp = PackedDataset(packed), PackedDataset(packed, cp_size=2)
    for b in range(len(plain)):
        x, y = plain[b], cp[b]
        lo, hi = int(plain.entry.bin_offsets[b]), int(plain.entry.bin_offsets[b + 1])
        lens = plain.entry.item_len[lo:hi]
        used = int(lens.sum())
        for key in ("input_ids", "labels", "position_ids", "category_ids"):  # the documents are untouched
            assert torch.equal(x[key][:, :used], y[key][:, :used]), key
        assert (y["labels"][0, used:] == IGNORE).all()
        assert torch.equal(y["cu_seqlens"][: len(lens) + 1], x["cu_seqlens"][: len(lens) + 1])
        shards = [shard_batch(y, r, 2) for r in range(2)]
        assert int(shards[0]["cu_seqlens_padded"][-1]) == plain.capacity  # padded for CP: exactly full
        assert int(padded_length(lens.astype("int64"), 2).sum()) <= plain.capacity
        targets = sum(int((s["labels"] != IGNORE).sum()) for s in shards)
        assert targets == int((x["labels"] != IGNORE).sum())  # padding never becomes a target


def test_packs_without_room_for_cp_are_refused(tmp_path):
    plain = category_pack(tmp_path / "plain")  # made without --cp-size
    with pytest.raises(XprepError, match="repack with `xprep pack ... --cp-size 2`"):
        PackedDataset(plain, cp_size=2)
    result = CliRunner().invoke(xtrain, ["run", str(plain), "--nproc-per-node", "2", "--cp", "2",
                                         "--output", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "--cp-size 2" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    cp4 = cp_pack(tmp_path / "cp4", cp_size=4)
    assert len(PackedDataset(cp4, cp_size=2)) > 0  # room for 2·4 is room for 2·2


@pytest.mark.parametrize("args,message", [
    (["--nproc-per-node", "2", "--dp", "2", "--cp", "2"], "2 process(es) were launched"),
    (["--nproc-per-node", "3", "--cp", "2"], "does not divide the 3"),
    (["--cp", "0"], "--cp 0 must be ≥ 1"),
])
def test_layout_errors_are_one_line(packed, tmp_path, args, message):
    result = CliRunner().invoke(xtrain, ["run", str(packed), *args, "--output", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_parallel_dims_layout():
    dims = ParallelDims.for_world(4, cp=2, rank=3)
    assert (dims.dp, dims.cp, dims.dp_rank, dims.cp_rank, dims.fsdp) == (2, 2, 1, 1, True)
    assert not ParallelDims.for_world(1, fsdp=True).fsdp  # nothing to shard over one process
    assert not ParallelDims.for_world(2, fsdp=False).fsdp
