"""Process group, parallel layout and how the model is spread over it.

``ParallelDims`` is the one object describing the layout (degrees, this rank's coordinates, a
lazily built device mesh). Here the layout is plain data parallel: ``parallelize`` makes the
replicas identical and ``reduce_gradients`` *sums* gradients over DP ranks (the loss is already
normalized by the global token count, see train/loss.py). FSDP2 and context parallel slot in
behind the same two functions (``fully_shard`` in ``parallelize``, a no-op gradient reduction,
``cp`` > 1 in the dims) without the trainer changing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from prep.errors import XprepError


@dataclass
class ParallelDims:
    """Degrees of parallelism and this rank's place in them. Ranks are laid out (dp, cp)."""

    dp: int = 1
    cp: int = 1
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    fsdp: bool = False  # FSDP2 shards parameters and reduces gradients itself (issue 5)
    _mesh: object = field(default=None, repr=False)

    def __post_init__(self):
        if self.dp < 1 or self.cp < 1:
            raise XprepError(f"dp={self.dp}, cp={self.cp}: parallel degrees must be ≥ 1")
        if self.dp * self.cp != self.world_size:
            raise XprepError(f"dp={self.dp} × cp={self.cp} != {self.world_size} processes: "
                             "launch dp·cp processes or change --dp/--cp")

    @classmethod
    def from_env(cls, cp: int = 1) -> ParallelDims:
        """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK (a single process without them)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % cp:
            raise XprepError(f"--cp {cp} does not divide the {world} processes launched")
        return cls(dp=world // cp, cp=cp, world_size=world, rank=int(os.environ.get("RANK", "0")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(self, device_type: str):
        """The (dp, cp) DeviceMesh, built on first use (needs the process group)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        return self._mesh


def init_distributed(dims: ParallelDims) -> torch.device:
    """Start the process group when launched with several ranks; return this rank's device.

    nccl when CUDA is available, else gloo (the mixed "cpu:gloo,cuda:nccl" string fails on CPU
    builds, FACTS.md).
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", dims.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dims.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, **({"device_id": device} if device.type == "cuda" else {}))
    return device


def parallelize(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Spread the model over the layout. Plain DP: every replica starts from rank 0's weights.

    (FSDP2 goes here when ``dims.fsdp``: ``fully_shard`` each of ``model.layers`` then the root on
    ``dims.mesh``, gradient division off and sum reduction on every FSDPModule, FACTS.md.)
    """
    if dims.distributed:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    return model


def reduce_gradients(model: nn.Module, dims: ParallelDims, bucket_bytes: int = 32 << 20) -> None:
    """Sum gradients over all ranks (dp, and cp whose ranks hold other tokens), in flat buckets.

    No division: the loss is already normalized by the global token count (train/loss.py).
    Nothing to do under FSDP2, whose reduce-scatter sums (gradient division off) in the backward.
    """
    if not dims.distributed or dims.fsdp:
        return
    for p in model.parameters():  # every rank must reduce the same tensors, in the same order
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket, size = [], 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            _all_reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_sum(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum a tensor over all ranks in place (identity on one process)."""
    if dims.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(dims: ParallelDims) -> None:
    if dims.distributed and dist.is_initialized():
        dist.barrier()


def shutdown(dims: ParallelDims, code: int = 0) -> None:
    """End a distributed run: barrier, destroy the group, hard exit with ``code``.

    gloo + DeviceMesh can abort at interpreter exit (FACTS.md); ``os._exit`` after a clean
    teardown avoids it. After a failure (code != 0) peers may be stuck in a collective, so no
    barrier or teardown: exit at once and let the launcher stop the others. A single process
    just returns.
    """
    if not (dims.distributed and dist.is_initialized()):
        return
    try:
        if code == 0:
            dist.barrier()
            dist.destroy_process_group()
    finally:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
