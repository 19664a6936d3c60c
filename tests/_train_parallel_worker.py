"""Run under torchrun by test_parallel_equivalence.py: one global batch on several (dp, cp, accum) layouts.

argv: PACKED OUT GLOBAL_BATCH LAYOUT... where a layout is ``dp,cp,accum[,ac][,nofsdp][,keep]``
(ac = activation checkpointing; FSDP2 is on unless nofsdp; keep = no reshard after forward).
For each layout every rank builds the tiny model and a Trainer over its share, runs
``accumulate_gradients`` once, and gathers the whole gradients; rank 0 saves
{layout: {"loss": float, "grads": {name: tensor}}} to OUT.
"""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from trainkit import grads, make_trainer  # noqa: E402

from train.dist import ParallelDims, all_reduce_sum, init_distributed, shutdown  # noqa: E402
from train.loss import LossSums, step_losses  # noqa: E402

packed, out, global_batch, layouts = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
results = {}
dims = None
for layout in layouts:
    dp, cp, accum, *flags = layout.split(",")
    dp, cp, accum = int(dp), int(cp), int(accum)
    dims = ParallelDims.from_env(dp, cp, fsdp="nofsdp" not in flags)
    init_distributed(dims)
    trainer = make_trainer(packed, micro=global_batch // (dp * accum), accum=accum, dims=dims,
                           activation_checkpointing="ac" in flags, reshard_after_forward="keep" not in flags)
    sums, _, _ = trainer.accumulate_gradients()
    loss, _ = step_losses(LossSums.from_flat(all_reduce_sum(sums.flat(), dims)), trainer.category_names)
    results[layout] = {"loss": loss, "grads": grads(trainer.model)}
if dims.is_main:
    torch.save(results, out)
shutdown(dims, 0)
