"""Rank worker for tests/test_checkpoint_coordination.py: checkpoints saved while training's collectives have
a timeout far shorter than rank 0's publication and deletions take.

    python tests/_ckpt_worker.py OUT RANK WORLD     one process per rank, meeting through the file OUT/store

Every rank starts gloo (a long timeout, so that a slow start cannot fail it), then cuts the default group's
timeout to ``SHORT_S``, as ``--dist-timeout`` would, for the checkpointing only (whose managers wait up to
``CKPT_TIMEOUT``, as ``--checkpoint-timeout`` would). On rank 0 each fsync of
a publication and each directory deletion sleeps ``SLOW_S`` first. A save, synchronous and asynchronous, with
``keep`` 1 retiring the step before, must still complete on every rank; rank 0 then checks OUT. Exit status 0
and "checkpoints ok" on rank 0's stdout = completed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from xprep.train import checkpoint
from xprep.train.checkpoint import CheckpointManager
from xprep.train.ckpt_files import RETIRED_PREFIX
from xprep.train.dist import ParallelDims

SHORT_S = 0.2  # the default group's timeout while checkpointing
SLOW_S = 0.8  # what rank 0's fsync of a publication and each deletion take
START_TIMEOUT = timedelta(seconds=60)
CKPT_TIMEOUT = timedelta(seconds=61)


def slowed(real):
    def wrapper(*args, **kwargs):
        time.sleep(SLOW_S)
        return real(*args, **kwargs)
    return wrapper


def main(out: Path, rank: int, world: int) -> int:
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world,
                            timeout=START_TIMEOUT)
    dims = ParallelDims(dp=world, world_size=world, rank=rank)  # on the CPU
    if dims.is_main:
        checkpoint.fsync_tree = slowed(checkpoint.fsync_tree)
        shutil.rmtree = slowed(shutil.rmtree)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    managers = {mode: CheckpointManager(out / mode, dims, keep=1, async_save=mode == "async", timeout=CKPT_TIMEOUT)
                for mode in ("sync", "async")}
    dist.barrier()
    _set_pg_timeout(timedelta(seconds=SHORT_S))
    for m in managers.values():
        m.save(1, model, optimizer, {"loss": 2.0})
        m.save(2, model, optimizer, {"loss": 1.0})  # retires step-1 (keep 1, and step-2 is the best)
        m.finish()
        assert m._group()._get_backend(torch.device("cpu")).options._timeout == CKPT_TIMEOUT
    _set_pg_timeout(START_TIMEOUT)
    dist.barrier()
    if dims.is_main:
        for mode, m in managers.items():
            left = sorted(p.name for p in m.root.iterdir())
            assert m.latest() == m.root / "step-2" and left == ["latest", "step-2"], (mode, left)
            assert not any(name.startswith(RETIRED_PREFIX) for name in left)
        print("checkpoints ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    sys.stdout.flush()
    os._exit(code)
