"""Process group, parallel layout and how the model is spread over it.

``ParallelDims`` is the one object describing the layout: data-parallel × context-parallel
degrees, how attention reaches the other CP ranks (``--cp-mode``, ``--ulysses``: xprep.train.cp), this rank's
coordinates, and the device meshes, built lazily once the process group exists. Ranks are laid out
dp-major: rank = dp_rank · cp + cp_rank, so the cp ranks of one dp rank are neighbours (on one node when
cp ≤ GPUs per node). Inside them, with head-parallel factor U: cp_rank = ring_index · U + ulysses_index, so
the U ranks of a Ulysses group (an all-to-all every layer) are the closest neighbours.

``parallelize`` spreads the model: ``torch.compile`` and activation checkpointing per decoder
block, then FSDP2 ``fully_shard`` per block and the root over all dp×cp ranks (context-parallel
ranks hold other tokens of the same documents, so their gradients add up exactly like
data-parallel ones). Gradient division is off and the reduction is a sum: the loss is already
normalized by the global target count (train/loss.py). Without FSDP, ``reduce_gradients``
all-reduces the same sum in flat buckets.

Mixed precision is FSDP2's: the sharded parameters and the optimizer state stay fp32 (master
weights), the all-gathered ones are cast to bf16 for the forward and backward, and gradients are
reduce-scattered in fp32 (``MixedPrecisionPolicy``). Without FSDP2 the same split comes from
``torch.autocast`` (the trainer's; ``autocast_dtype``).

``materialize`` gives a model built on the meta device (and sharded) its storage and initial
values, shard by shard: no rank ever holds the whole model, and the values do not depend on the
layout (each full parameter is made from its name alone, then cut to this rank's shard).
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from xprep.prep.errors import XprepError
from xprep.train.cp import DEFAULT_CP_MODE, HYBRID, RING, ULYSSES, CPGroups, ulysses_degree

TIMEOUT_ENV = "XTRAIN_DIST_TIMEOUT"  # the default of --dist-timeout when neither a flag nor a config sets it
DEFAULT_TIMEOUT_S = 600.0  # seconds a collective waits for a peer when neither the option nor TIMEOUT_ENV says
DEVICE_ENV = "XTRAIN_DEVICE"  # the default of --device when neither a flag nor a config sets it (the tests: cpu)
DEVICES = ("auto", "cpu", "cuda")
BF16_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores and the flash (varlen) kernels
ALLOC_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the caching allocator's settings (older, newer name)
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)  # what wrappers add to parameter names (activation checkpointing)


@dataclass
class ParallelDims:
    """Degrees of parallelism and this rank's place in them. Ranks are laid out (dp, cp), and the cp ranks
    (ring, ulysses) for the CP modes that split heads."""

    dp: int = 1
    cp: int = 1
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    fsdp: bool = False  # FSDP2 shards parameters and reduces gradients itself
    device_type: str = "cpu"
    cp_mode: str = DEFAULT_CP_MODE  # how attention reaches the other CP ranks (xprep.train.cp.CP_MODES)
    ulysses: int | None = None  # --ulysses: hybrid's head-parallel factor (``ulysses_degree`` is U for any mode)
    _meshes: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.dp < 1 or self.cp < 1:
            raise XprepError(f"--dp {self.dp} --cp {self.cp}: parallel degrees must be ≥ 1")
        ulysses_degree(self.cp_mode, self.cp, self.ulysses)  # an impossible mode, factor and cp: an XprepError
        if self.dp * self.cp != self.world_size:
            raise XprepError(f"--dp {self.dp} × --cp {self.cp} = {self.dp * self.cp}, but {self.world_size} "
                             f"process(es) were launched: launch dp·cp processes (--nproc-per-node) or change "
                             "--dp/--cp")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")

    @classmethod
    def from_env(cls, dp: int | None = None, cp: int = 1, fsdp: bool | None = None,
                 device: str | None = None, cp_mode: str = DEFAULT_CP_MODE, ulysses: int | None = None
                 ) -> ParallelDims:
        """This process's layout from torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (one process
        without them)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls.for_world(world, dp, cp, fsdp, rank=int(os.environ.get("RANK", "0")),
                             local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=device,
                             local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), cp_mode=cp_mode,
                             ulysses=ulysses)

    @classmethod
    def for_world(cls, world: int, dp: int | None = None, cp: int = 1, fsdp: bool | None = None, rank: int = 0,
                  local_rank: int = 0, device: str | None = None, local_world: int | None = None,
                  cp_mode: str = DEFAULT_CP_MODE, ulysses: int | None = None) -> ParallelDims:
        """The layout of ``world`` processes, ``local_world`` of them on this machine (all by default):
        ``dp`` defaults to world / cp, ``fsdp`` to on whenever there is more than one process (there is
        nothing to shard over one), the device to ``resolve_device(device, local_world)``."""
        if cp < 1:
            raise XprepError(f"--cp {cp} must be ≥ 1")
        if dp is None:
            if world % cp:
                raise XprepError(f"--cp {cp} does not divide the {world} process(es) launched: launch a multiple "
                                 f"of {cp} processes or change --cp")
            dp = world // cp
        device_type = resolve_device(device, world if local_world is None else local_world)
        return cls(dp=dp, cp=cp, world_size=world, rank=rank, local_rank=local_rank,
                   fsdp=(world > 1) if fsdp is None else (fsdp and world > 1), device_type=device_type,
                   cp_mode=cp_mode, ulysses=ulysses)

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
    def ulysses_degree(self) -> int:
        """U, the head-parallel factor of the CP mode: C for ulysses, --ulysses for hybrid, else 1 (a ring of C/U)."""
        return ulysses_degree(self.cp_mode, self.cp, self.ulysses)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(self, device_type: str | None = None):
        """The 2-D (dp, cp) DeviceMesh, built on first use (needs the process group)."""
        if "dp,cp" not in self._meshes:
            self._meshes["dp,cp"] = init_device_mesh(device_type or self.device_type, (self.dp, self.cp),
                                                     mesh_dim_names=("dp", "cp"))
        return self._meshes["dp,cp"]

    def shard_mesh(self):
        """The 1-D mesh over all dp×cp ranks (the (dp, cp) mesh flattened) that FSDP2 shards over."""
        if "dp_cp" not in self._meshes:
            self._meshes["dp_cp"] = self.mesh()["dp", "cp"]._flatten("dp_cp")
        return self._meshes["dp_cp"]

    def cp_group(self) -> dist.ProcessGroup:
        """The process group of this rank's context-parallel peers (same dp rank)."""
        return self.mesh()["cp"].get_group()

    def cp_mesh(self):
        """The 3-D (dp, ring, ulysses) DeviceMesh of shape (dp, cp / U, U), built on first use: rank = dp_rank · cp +
        ring_index · U + ulysses_index, the (dp, cp) mesh's cp dimension cut in two. Making a mesh makes process
        groups on every rank, so only a mode that needs both of its groups asks for it (``ring_group``)."""
        if "dp,ring,ulysses" not in self._meshes:
            u = self.ulysses_degree
            self._meshes["dp,ring,ulysses"] = init_device_mesh(self.device_type, (self.dp, self.cp // u, u),
                                                               mesh_dim_names=("dp", "ring", "ulysses"))
        return self._meshes["dp,ring,ulysses"]

    def ring_group(self) -> dist.ProcessGroup:
        """The C/U ranks of this rank's ring: same dp rank and Ulysses index (the whole CP group when U = 1)."""
        return self.cp_group() if self.ulysses_degree == 1 else self.cp_mesh()["ring"].get_group()

    def ulysses_group(self) -> dist.ProcessGroup:
        """The U ranks this rank all-to-alls heads with: same dp rank and ring index (the whole CP group when
        U = C)."""
        return self.cp_group() if self.ulysses_degree == self.cp else self.cp_mesh()["ulysses"].get_group()

    def cp_groups(self) -> CPGroups:
        """The process groups the CP mode talks over (``xprep.train.cp.cp_context``), and only those: the CP group
        always, the ring group for ring and hybrid, the Ulysses group for ulysses and hybrid (None otherwise)."""
        return CPGroups(cp=self.cp_group(), ring=self.ring_group() if self.cp_mode in (RING, HYBRID) else None,
                        ulysses=self.ulysses_group() if self.cp_mode in (ULYSSES, HYBRID) else None)


def resolve_device(choice: str | None, local_ranks: int = 1) -> str:
    """What ``--device`` means here, for ``local_ranks`` ranks on this machine: "cpu" or "cuda".

    None takes ``$XTRAIN_DEVICE``, else auto. auto is CUDA when there is one GPU per local rank, the
    CPU when there is none; with some GPUs but fewer than the ranks it is an error, as is cuda without
    enough GPUs: ranks never share a GPU, nor silently leave it for the CPU.
    """
    shown = "--device" if choice is not None else f"${DEVICE_ENV}" if os.environ.get(DEVICE_ENV) else "--device"
    choice = choice if choice is not None else os.environ.get(DEVICE_ENV) or "auto"
    if choice not in DEVICES:
        raise XprepError(f"{shown} {choice!r} is not one of {', '.join(DEVICES)}")
    if choice == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "auto" and gpus == 0:
        return "cpu"
    if gpus == 0:
        build = f"torch {torch.__version__} " + ("has no CUDA" if torch.version.cuda is None else "sees no GPU")
        raise XprepError(f"{shown} cuda: no CUDA device ({build}); run with --device cpu")
    if gpus < local_ranks:
        raise XprepError(f"{shown} {choice}: {local_ranks} ranks on this machine but {gpus} GPU(s), and each rank "
                         f"needs a GPU of its own: launch at most {gpus} per machine (--nproc-per-node {gpus}, "
                         "with --dp/--cp to match), or run every rank on the CPU with --device cpu")
    return "cuda"


def bf16_capable(device_type: str) -> bool:
    """Whether the device computes in bf16 natively: CUDA at compute capability ≥ 8.0 (Ampere on). A V100 or
    T4 emulates it, far slower than fp32; on the CPU bf16 runs, but is the slower reference."""
    return device_type == "cuda" and torch.cuda.get_device_capability() >= BF16_CAPABILITY


def configure_device(device_type: str, tf32: bool = True) -> None:
    """Process-wide CUDA settings, to make before CUDA is initialized (the allocator reads its settings then):
    fp32 matmuls on TF32 tensor cores unless ``tf32`` is off, and the caching allocator's expandable segments
    (less fragmentation when packed sequences change shape every step) unless the user configured the
    allocator. Nothing on the CPU."""
    if device_type != "cuda":
        return
    if not any(name in os.environ for name in ALLOC_ENVS):
        os.environ[ALLOC_ENVS[0]] = "expandable_segments:True"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch ≥ 2.9
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    else:  # pragma: no cover - older torch
        torch.backends.cuda.matmul.allow_tf32 = tf32


def collective_timeout(seconds: float | None = None) -> timedelta:
    """How long a collective of the default process group waits for a peer: ``seconds`` (``--dist-timeout``), else
    ``$XTRAIN_DIST_TIMEOUT``, else 600 s. Every step all-reduces over that group, so a rank that hangs ends the job
    instead of blocking it for gloo's default 30 min. The DeviceMesh groups of FSDP2 and CP inherit it (torch 2.13:
    a mesh's sub-groups take the default group's timeout); a rank that dies is noticed sooner by the launcher,
    which stops the others."""
    return timeout_from(seconds, "--dist-timeout", TIMEOUT_ENV, os.environ.get(TIMEOUT_ENV), DEFAULT_TIMEOUT_S)


def timeout_from(seconds: float | None, flag: str, env: str, raw: str | None, default: float) -> timedelta:
    """``seconds`` as given by ``flag``, else ``raw``, the value of the environment variable ``env`` (its documented
    default; None: unset), else ``default``: a number of seconds > 0, or an error naming where the bad value came
    from."""
    if seconds is None:
        if raw is None:
            return timedelta(seconds=default)
        shown, fix = f"${env}={raw!r}", f"set it to e.g. {default:g} (the default), or unset it"
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
    else:
        shown, fix = f"{flag} {seconds}", f"give e.g. {default:g} (the default)"
    if not (math.isfinite(seconds) and seconds > 0):
        raise XprepError(f"{shown}: must be a number of seconds > 0; {fix}")
    return timedelta(seconds=seconds)


def init_distributed(dims: ParallelDims, timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)) -> torch.device:
    """Start the process group when launched with several ranks; return this rank's device.

    The device is ``dims.device_type``'s (``resolve_device``): GPU ``local_rank`` on CUDA. The backend is
    nccl on CUDA, else gloo (the mixed "cpu:gloo,cuda:nccl" backend string fails on CPU builds of torch).
    A collective waits at most ``timeout`` for a peer (``collective_timeout``: ``--dist-timeout``).
    """
    if dims.device_type == "cuda":
        device = torch.device("cuda", dims.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dims.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
    return device


def param_dtype_for(precision: str, device_type: str) -> torch.dtype:
    """The dtype forward and backward compute in: ``bf16``, ``fp32``, or ``auto`` = bf16 on a GPU with bf16
    tensor cores (``bf16_capable``), fp32 elsewhere (on CPU fp32 is the exact reference, and bf16 matmuls are
    no faster on most CPUs; a pre-Ampere GPU only emulates bf16). ``bf16`` asked of a pre-Ampere GPU is an
    error (``check_precision``)."""
    if precision == "bf16" or (precision == "auto" and bf16_capable(device_type)):
        return torch.bfloat16
    return torch.float32


def check_precision(precision: str, device_type: str) -> None:
    """``--precision bf16`` on a CUDA GPU without bf16 tensor cores is refused, naming it and the way out."""
    if precision == "bf16" and device_type == "cuda" and not bf16_capable(device_type):
        name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        raise XprepError(f"--precision bf16: {name} (compute capability {major}.{minor}) has no bf16 tensor cores "
                         "(compute capability 8.0, Ampere, and later do) and would emulate it, slower than fp32; "
                         "use --precision fp32 (or auto)")


def precision_name(precision: str, device_type: str) -> str:
    """What ``precision`` resolved to on this device: "bf16" or "fp32"."""
    return "bf16" if param_dtype_for(precision, device_type) == torch.bfloat16 else "fp32"


def precision_note(precision: str, device_type: str) -> str:
    """What ``precision`` resolved to on this device, and why when auto chose fp32 on a GPU."""
    dtype = precision_name(precision, device_type)
    if precision == "auto" and device_type == "cuda" and dtype == "fp32":
        major, minor = torch.cuda.get_device_capability()
        return (f"fp32 (auto: {torch.cuda.get_device_name()} has compute capability {major}.{minor} < 8.0, "
                "no bf16 tensor cores)")
    return dtype


def parallelize(model: nn.Module, dims: ParallelDims, reshard_after_forward: bool = True,
                activation_checkpointing: bool = False, param_dtype: torch.dtype = torch.float32,
                compile: bool = False) -> nn.Module:
    """Spread the model over the layout: compile, activation checkpointing, then FSDP2.

    ``compile`` compiles each block; activation checkpointing then wraps it (recomputed in the
    backward, context-parallel all-gathers included), before FSDP2 sees it. (torchtitan compiles the
    checkpointed block instead; here attention is a graph break, and a graph break inside the
    checkpoint region makes dynamo run the whole block eagerly.) Under FSDP2
    each of ``model.layers`` and then the root is ``fully_shard``-ed over the flattened dp×cp mesh
    (``dims.shard_mesh``), computing in ``param_dtype``. A model with real weights starts from
    rank 0's on every rank; one on the meta device is given its weights by ``materialize`` after.
    """
    if compile:
        apply_compile(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dims.distributed and not is_meta(model):
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    if dims.fsdp and dims.distributed:
        apply_fsdp(model, dims.shard_mesh(), reshard_after_forward, param_dtype)
    return model


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward instead of keeping them.

    The wrapper adds ``_checkpoint_wrapped_module`` to parameter names; DCP's state-dict API
    strips it, so checkpoints load with or without activation checkpointing.
    Nothing in a block is random (no dropout), so the RNG state is not saved and restored around each
    recomputation (``preserve_rng_state=False``; on CUDA saving it copies the device's RNG state per block).
    """
    layers = model.layers
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` each block's forward on its own (per block, as torchtitan does): the blocks share
    one code object, so they share its compiled graphs, and compile time does not grow with the depth.

    The forward is replaced in place rather than the block wrapped (torch.compile's wrapper would add
    ``_orig_mod`` to parameter names, which DCP's state-dict API does not strip inside an activation-
    checkpointing wrapper): names, and so checkpoints, are those of the eager model, and the hooks of
    the wrappers around the block (activation checkpointing, FSDP2) stay outside the graphs. Attention
    runs outside them too (xprep.train.model.run_attention).
    ``backend`` is torch.compile's (another than inductor for tests and benchmarks on a CPU, where inductor
    builds C++ first).
    """
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=backend)


def apply_fsdp(model: nn.Module, mesh, reshard_after_forward: bool = True,
               param_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 per block, then the root; gradient division off and plain-sum reduction everywhere.

    Both settings apply to one FSDPModule, not its children, so each is set on every one: the loss
    is divided by the global target count already, and gloo rejects the PREMUL_SUM a divide factor
    would use. The root is not resharded after forward (the backward needs its weights at once).
    With ``param_dtype`` bf16, blocks compute in bf16 from fp32 shards and reduce gradients in fp32;
    their floating-point inputs are not cast (the RoPE tables stay fp32, the hidden state arrives
    in bf16 from the embedding).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def is_meta(model: nn.Module) -> bool:
    """Whether the model's parameters are still on the meta device (no storage yet)."""
    return any(p.is_meta for p in model.parameters())


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' prefix: its name in the bare model."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, initial: Callable[[str], torch.Tensor]) -> None:
    """Give a meta-device model (sharded or not) storage on ``device`` and its initial values.

    ``initial(name)`` is the whole parameter by its plain name (on the CPU); each rank keeps its own
    FSDP2 shard of it (the same cut ``fully_shard`` makes, computed locally: no communication). So
    the weights are the same for any layout, but one whole parameter at a time is made on every rank.
    """
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        full = initial(plain_name(name))
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
            del local
        else:
            p.copy_(full)
        del full  # before the next parameter is made: one whole tensor at a time, never two


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


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly FSDP-sharded) DTensor; a collective for DTensors."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def all_reduce_sum(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum a tensor over all ranks in place (identity on one process)."""
    if dims.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def failed_in_collective(e: BaseException) -> bool:
    """Whether ``e`` was raised inside torch.distributed (a collective, FSDP's communication, DCP)."""
    root = os.path.dirname(dist.__file__)
    return any(frame.filename.startswith(root) for frame in traceback.extract_tb(e.__traceback__))


def barrier(dims: ParallelDims) -> None:
    if dims.distributed and dist.is_initialized():
        dist.barrier()


def shutdown(dims: ParallelDims, code: int = 0, clean: bool = False) -> None:
    """End a distributed run: barrier, destroy the group, hard exit with ``code``.

    gloo + DeviceMesh aborts (SIGABRT) at interpreter exit in about one run of seven, after all the
    work is done; ``os._exit`` after a clean teardown avoids it. After a failure (code != 0) peers
    may be stuck in a collective, so no barrier or teardown: exit at once and let the launcher stop
    the others — unless ``clean`` says every rank ends here together (a stop on a signal). A single
    process just returns.
    """
    if not (dims.distributed and dist.is_initialized()):
        return
    try:
        if code == 0 or clean:
            dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
