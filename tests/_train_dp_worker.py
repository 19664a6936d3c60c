"""Run under torchrun by test_train_dist.py: one global batch's gradient on this layout, saved by rank 0."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from trainkit import grads, make_trainer  # noqa: E402
from xprep.train.dist import ParallelDims, init_distributed, shutdown  # noqa: E402

packed, out, micro, accum = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dims = ParallelDims.from_env()
init_distributed(dims)
trainer = make_trainer(Path(packed), micro=micro, accum=accum, dims=dims)
sums, n_tokens, n_targets = trainer.accumulate_gradients()
full = grads(trainer.model)  # gathers FSDP2 shards: every rank takes part
if dims.is_main:
    torch.save(full, out)
shutdown(dims, 0)
