"""Run under torchrun by test_parallel_equivalence.py: one global batch on several (dp, cp, accum) layouts.

argv: PACKED OUT GLOBAL_BATCH LAYOUT... where a layout is ``dp,cp,accum[,ac][,nofsdp][,keep][,bf16][,every]
[,chunk][,compile]`` (ac = activation checkpointing; FSDP2 is on unless nofsdp; keep = no reshard after
forward; bf16 = --precision bf16; every = reduce-scatter after every micro-batch; chunk = --loss-chunk 16;
compile = torch.compile each block).
For each layout every rank builds the tiny model (on the meta device, then sharded and initialized)
and a Trainer over its share, gathers the whole initial weights, runs ``accumulate_gradients`` once,
and gathers the whole gradients; rank 0 saves {layout: {"loss": float, "init": {name: tensor},
"grads": {name: tensor}, "reduce_scatters": int}} to OUT (the number of FSDP2 gradient
reduce-scatters during that step).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from trainkit import grads, make_trainer, params  # noqa: E402

from train.dist import ParallelDims, all_reduce_sum, init_distributed, shutdown  # noqa: E402
from train.loss import LossSums, step_losses  # noqa: E402

packed, out, global_batch, layouts = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
results = {}
dims = None
reduce_scatters = [0]
_reduce_scatter = dist.reduce_scatter_single  # what FSDP2's collectives call


def counting_reduce_scatter(*args, **kwargs):
    reduce_scatters[0] += 1
    return _reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = counting_reduce_scatter
for layout in layouts:
    dp, cp, accum, *flags = layout.split(",")
    dp, cp, accum = int(dp), int(cp), int(accum)
    dims = ParallelDims.from_env(dp, cp, fsdp="nofsdp" not in flags)
    init_distributed(dims)
    trainer = make_trainer(packed, micro=global_batch // (dp * accum), accum=accum, dims=dims,
                           activation_checkpointing="ac" in flags, reshard_after_forward="keep" not in flags,
                           precision="bf16" if "bf16" in flags else "fp32", reduce_every_micro_batch="every" in flags,
                           loss_chunk=16 if "chunk" in flags else 0, compile="compile" in flags)
    init = params(trainer.model)
    reduce_scatters[0] = 0
    sums, _, _ = trainer.accumulate_gradients()
    n_reduce_scatters = reduce_scatters[0]
    loss, _ = step_losses(LossSums.from_flat(all_reduce_sum(sums.flat(), dims)), trainer.category_names)
    results[layout] = {"loss": loss, "init": init, "grads": grads(trainer.model), "reduce_scatters": n_reduce_scatters}
if dims.is_main:
    torch.save(results, out)
shutdown(dims, 0)
