"""Run under torchrun by test_parallel_equivalence.py: one global batch on several (dp, cp, accum) layouts.

argv: PACKED OUT GLOBAL_BATCH LAYOUT... where a layout is ``dp,cp,accum[,ac][,nofsdp][,keep][,bf16][,once]
[,chunk][,compile][,weighted][,MODE][,uN]`` (ac = activation checkpointing; FSDP2 is on unless nofsdp; keep = no
reshard after forward; bf16 = --precision bf16; once = --reduce-once-per-step (reduce-scatter after the step's last
micro-batch only, not after every one); chunk = --loss-chunk 16; compile = torch.compile each block; weighted =
--category-weight trainkit.CATEGORY_WEIGHTS; MODE = a --cp-mode, the default one when left out; uN = --ulysses N).
For each layout every rank builds the tiny model (on the meta device, then sharded and initialized)
and a Trainer over its share, gathers the whole initial weights, runs ``accumulate_gradients`` once,
and gathers the whole gradients; rank 0 saves {layout: {"loss": float, "init": {name: tensor},
"grads": {name: tensor}, "reduce_scatters": int, "held_grad_bytes": int, "weighted_loss": float | None}} to OUT
(the number of FSDP2 gradient reduce-scatters during that step; the most bytes of unsharded gradients FSDP2 held on
rank 0 between two micro-batches, read off its parameters' accumulators, torch-internal state; Σ w·CE / Σ w of a
weighted layout, else None).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from trainkit import CATEGORY_WEIGHTS, grads, make_trainer, params  # noqa: E402
from xprep.train.cp import CP_MODES, DEFAULT_CP_MODE  # noqa: E402
from xprep.train.dist import ParallelDims, all_reduce_sum, init_distributed, shutdown  # noqa: E402
from xprep.train.loss import LossSums, step_losses  # noqa: E402

packed, out, global_batch, layouts = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
results = {}
dims = None
reduce_scatters = [0]
_reduce_scatter = dist.reduce_scatter_single  # what FSDP2's collectives call


def counting_reduce_scatter(*args, **kwargs):
    reduce_scatters[0] += 1
    return _reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = counting_reduce_scatter


def unsharded_grad_bytes(model) -> int:
    """Bytes of the whole-parameter gradients FSDP2 keeps while gradient sync is off: the unsharded parameters'
    own gradients (fp32 compute) or the fp32 accumulators they are moved into (bf16 compute)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                total += grad.numel() * grad.element_size() if grad is not None else 0
    return total


def measuring_held_gradients(trainer, held: list[int]):
    """``trainer.forward_backward`` that notes the unsharded gradient bytes held after each micro-batch."""
    forward_backward = trainer.forward_backward

    def wrapped(*args):
        forward_backward(*args)
        held.append(unsharded_grad_bytes(trainer.model))

    return wrapped

for layout in layouts:
    dp, cp, accum, *flags = layout.split(",")
    dp, cp, accum = int(dp), int(cp), int(accum)
    mode = next((f for f in flags if f in CP_MODES), DEFAULT_CP_MODE)
    ulysses = next((int(f[1:]) for f in flags if f.startswith("u") and f[1:].isdigit()), None)
    dims = ParallelDims.from_env(dp, cp, fsdp="nofsdp" not in flags, cp_mode=mode, ulysses=ulysses)
    init_distributed(dims)
    trainer = make_trainer(packed, micro=global_batch // (dp * accum), accum=accum, dims=dims,
                           activation_checkpointing="ac" in flags, reshard_after_forward="keep" not in flags,
                           precision="bf16" if "bf16" in flags else "fp32",
                           reduce_every_micro_batch="once" not in flags,
                           loss_chunk=16 if "chunk" in flags else 0, compile="compile" in flags,
                           category_weight=CATEGORY_WEIGHTS if "weighted" in flags else None)
    init = params(trainer.model)
    reduce_scatters[0] = 0
    held = []
    trainer.forward_backward = measuring_held_gradients(trainer, held)
    sums, _, _ = trainer.accumulate_gradients()
    n_reduce_scatters = reduce_scatters[0]
    total = LossSums.from_flat(all_reduce_sum(sums.flat(), dims), weighted="weighted" in flags)
    loss, _ = step_losses(total, trainer.category_names)
    results[layout] = {"loss": loss, "init": init, "grads": grads(trainer.model), "reduce_scatters": n_reduce_scatters,
                       "held_grad_bytes": max(held[:-1], default=0),  # between micro-batches: not after the last
                       "weighted_loss": total.weighted_loss}
if dims.is_main:
    torch.save(results, out)
shutdown(dims, 0)
