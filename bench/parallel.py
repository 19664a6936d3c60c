"""Benchmark of issue 5's parallelism (context-parallel activation memory, FSDP2 step time) and of issue 33's
CP modes (the K/V memory of allgather, ring, ulysses and hybrid).

    python bench/parallel.py                 # seq 16,384 for CP, 4,096 tokens per rank for FSDP2, 32,768 for the modes
    python bench/parallel.py --quick         # smaller sequences and fewer steps (smoke run, < 1 min a section)
    python bench/parallel.py --only modes    # one section (repeatable): cp, fsdp, modes

Everything is measured in one run, and every ratio is against a baseline measured in the same run:

1. Context parallelism. One packed row of ``cp_docs`` equal documents (4 × 4096 = 16,384 tokens),
   model 4 layers × width 256, 4 heads / 2 K/V heads, vocab 8192, fp32, AdamW. cp=2 over two
   gloo processes (``shard_batch`` + ``CPContext``, gradients summed over the CP group) against one
   process with cp=1 on the same batches and weights. Per-rank peak activation memory = peak RSS
   during one forward + backward + optimizer step minus the RSS after set-up. "Set-up" is the steady
   state: model, gradient buffers and AdamW state allocated (by the warm-up steps; gradients are
   zeroed, not freed), then freed heap handed back to the kernel with ``malloc_trim``. The peak is
   the kernel's VmHWM, reset before each step by writing "5" to /proc/self/clear_refs (checked at
   start; a thread sampling RSS every 5 ms takes over where the reset does not work). Target: ≤ 0.6×.
2. FSDP2, dp=2 on two processes: the same model with ``fully_shard`` per block then the root
   (gradient divide factor 1.0 and forced sum reduction set on every FSDPModule: neither setting
   reaches a module's children) against
   the same model replicated with one flat gradient all-reduce (sum) after backward; FSDP2 both
   with ``reshard_after_forward=True`` (fully_shard's default, the target's figure) and False.
   The three models live in the same two processes, start from the same weights and take the
   same batches, one step each in turn, in an order that rotates every round, so drift in the
   machine's load hits all of them. A step is forward + backward + gradient reduction + AdamW;
   its time is the slowest rank's. Target: ≤ 1.2×.
3. The CP modes' K/V memory. One packed row of ``modes_docs`` equal documents (8 × 4096 = 32,768
   tokens) through a stack of 4 attention layers of the built-in model (``xprep.train.model.Attention``:
   q/k/v/o projections, RoPE, GQA; width 64, 4 heads / 2 K/V heads), a residual around each, fp32,
   one forward + backward per step. C=1 is one plain process with the ordinary varlen attention; at
   C=2 and 4, C gloo processes run every mode in turn (groups and ``cp_context`` as xtrain lays them
   out; hybrid as 2 Ulysses ranks × a ring of C/2). Per rank: the peak RSS of a step above the RSS
   just before it (as in 1.), and exact figures from a metered step (``TensorMeter``): the peak of
   live tensor bytes, the bytes attention saves for backward, and the peak of the bytes holding K or V
   values (K, V and every copy made of them: gathered, permuted, repeated, ring blocks in flight).
   Goal: ring at C=4 ≤ 0.35× allgather's K/V peak at C=4; ring at C=4 against C=1 is printed too.

Fairness: the machine has 2 cores and every configuration gets all of them: the single process
runs 2 intra-op threads, each of two processes runs 1 (four processes of section 3 run 1 each: 2×
oversubscribed). Workers are spawned here (one plain
process, or ``torch.distributed.run --standalone``), each with a timeout; rank 0 prints one
``RESULT {json}`` line on stdout that this script reads. A failed or timed-out worker makes the
benchmark exit 1. Step times are medians of the timed steps; minima and paired ratios are printed
next to them because the machine is shared and a 2-thread process suffers most from contention.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# bench/train.py and bench/tokenize.py would shadow the `train` package and the stdlib module.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, fields, replace  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from bench.procs import descendants  # noqa: E402

if TYPE_CHECKING:
    from xprep.train.model import ModelConfig

RESULT = "RESULT "  # prefix of the one line a worker's rank 0 prints on stdout
FAILED = "WORKER FAILED"  # prefix of a failed rank's traceback on stderr
MIB = 1024 * 1024
MODES_SIZES = (1, 2, 4)  # CP degrees of section 3 (1: no CP, the ordinary varlen attention)
KV_GOAL = 0.35  # issue 33: ring's K/V memory per rank at C=4, over allgather's
SECTIONS = ("cp", "fsdp", "modes")  # --only choices: 1. cp=2 vs 1, 2. FSDP2, 3. the CP modes' K/V memory


class BenchError(Exception):
    """A worker failed, timed out or printed no result."""


@dataclass
class BenchConfig:
    """Everything both workers and the summary need; built once from the command line."""

    vocab: int = 8192
    dim: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    cp_seq: int = 16_384  # tokens of the context-parallel row
    cp_docs: int = 4  # equal documents in that row
    dp_seq: int = 4096  # tokens per rank and step for the FSDP2 comparison
    dp_docs: int = 4
    warmup: int = 2  # untimed steps per configuration
    steps: int = 3  # timed CP steps
    rounds: int = 9  # FSDP2 / replicated rotations (each mode runs first, middle and last equally often)
    round_steps: int = 1  # timed steps per mode and round
    cores: int = 2  # total intra-op threads given to each configuration
    timeout: float = 900.0  # seconds per worker launch
    seed: int = 0
    # 3. the K/V memory of the CP modes: a stack of attention layers over one long row
    modes_seq: int = 32_768  # tokens of the row
    modes_docs: int = 8  # equal documents in it
    modes_dim: int = 64  # width of the attention stack
    modes_heads: int = 4
    modes_kv_heads: int = 2
    modes_layers: int = 4
    modes_steps: int = 3  # timed steps per mode, after one measured (exact figures) untimed step

    def __post_init__(self) -> None:
        for seq, docs, name in ((self.cp_seq, self.cp_docs, "cp"), (self.dp_seq, self.dp_docs, "dp")):
            if docs < 1 or seq % docs or (seq // docs) % 4:
                raise BenchError(f"--{name}-seq {seq} --{name}-docs {docs}: the row must split into equal documents "
                                 "whose length is a multiple of 4 (2·cp with cp=2, so zigzag sharding adds no "
                                 f"padding); e.g. --{name}-seq {max(docs, 1) * 4 * max(1, seq // max(docs, 1) // 4)}")
        self._check_modes()
        if self.cores % 2:
            raise BenchError(f"--cores {self.cores} must be even: two processes share them equally")
        if self.warmup < 1 or self.steps < 1 or self.rounds < 1 or self.round_steps < 1:
            raise BenchError(f"--warmup {self.warmup} --steps {self.steps} --rounds {self.rounds} --round-steps "
                             f"{self.round_steps}: each must be ≥ 1")

    def _check_modes(self) -> None:
        top = max(MODES_SIZES)
        docs = max(self.modes_docs, 1)
        if self.modes_docs < 1 or self.modes_seq % docs or (self.modes_seq // docs) % (2 * top):
            raise BenchError(f"--modes-seq {self.modes_seq} --modes-docs {self.modes_docs}: the row must split into "
                             f"equal documents whose length is a multiple of {2 * top} (2·cp at cp={top}, so zigzag "
                             f"sharding adds no padding); e.g. --modes-seq "
                             f"{docs * 2 * top * max(1, self.modes_seq // docs // (2 * top))}")
        if self.modes_heads % top or self.modes_heads % self.modes_kv_heads:
            raise BenchError(f"--modes-heads {self.modes_heads} --modes-kv-heads {self.modes_kv_heads}: the query "
                             f"heads must be a multiple of {top} (Ulysses splits them over cp={top}) and of the K/V "
                             "heads (grouped-query attention); e.g. --modes-heads 4 --modes-kv-heads 2")
        if self.modes_dim % self.modes_heads or (self.modes_dim // self.modes_heads) % 2:
            raise BenchError(f"--modes-dim {self.modes_dim}: must be --modes-heads {self.modes_heads} × an even head "
                             f"dimension (RoPE); e.g. --modes-dim {self.modes_heads * 16}")
        if self.modes_layers < 1 or self.modes_steps < 1:
            raise BenchError(f"--modes-layers {self.modes_layers} --modes-steps {self.modes_steps}: each must be ≥ 1")

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(cp_seq=2048, dp_seq=1024, warmup=1, steps=2, rounds=3, round_steps=1, timeout=180.0,
                   modes_seq=2048, modes_docs=4, modes_steps=2)

    def model_config(self) -> ModelConfig:
        from xprep.train.model import ModelConfig

        return ModelConfig(vocab_size=self.vocab, dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.kv_heads)


# ------------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/self/status has no {field}")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Return freed heap to the kernel, so RSS measures live memory (glibc keeps it otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def hwm_reset_works() -> bool:
    """Whether writing "5" to clear_refs resets VmHWM here: fault in and free 64 MiB, reset, compare."""
    import torch

    torch.ones(16 * MIB)  # 64 MiB of fp32, faulted in and freed at once (mmap'd: RSS drops back)
    trim_heap()
    return _reset_hwm() and _status_kib("VmHWM") <= _status_kib("VmRSS") + 8 * 1024


class PeakRSS:
    """Peak RSS (MiB) over a `with` block: VmHWM reset at entry, or a 5 ms sampling thread."""

    def __init__(self, use_hwm: bool):
        self.use_hwm = use_hwm
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        if self.use_hwm:
            _reset_hwm()
        else:
            self.peak = rss_mib()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc) -> None:
        if self.use_hwm:
            self.peak = _status_kib("VmHWM") / 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_mib())


# Data-movement ops: the storage they make holds the data of their first argument (a tensor or a list of them),
# moved. Any other op computes new values (attention outputs, gradients...), which are never K/V.
MOVES = frozenset({
    "aten::cat", "aten::index_select", "aten::index", "aten::clone", "aten::_to_copy", "aten::empty_like",
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_to_all_single",
})
COLLECTIVE_MOVES = frozenset({"_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_to_all_single"})


@dataclass
class Stored:
    """A storage made under a `TensorMeter`: weakly referenced, its bytes, and which of its elements hold K/V."""

    ref: object  # torch.multiprocessing.reductions.StorageWeakRef: never keeps the storage alive
    nbytes: int
    kv: int = 0  # bytes holding K or V values
    shadow: object = None  # (elements,) uint8 tensor, 1 where the element holds a K or V value; None: no K/V


class TensorMeter:
    """Exact tensor memory of what runs under it: the peak of live bytes, and the peak of those holding K/V values.

    A TorchDispatchMode sees every op; each storage an op makes is followed through a weak reference (so it
    is freed exactly when it would be), and whenever a storage is made the expired ones are dropped and the
    live bytes summed: the peaks are exact at op boundaries (a kernel's scratch inside one call is not seen).
    Only storages made under the meter count: the peaks are above the state it started in.

    K/V is followed element by element: `mark_kv` flags the K and V an attention call receives, and every
    data-movement op (MOVES) runs a second time on uint8 *shadows* of its inputs (1 = this element holds K or
    V), collectives included (the shadows travel the same way, so a gathered or all-to-all'd buffer knows which
    of its elements came from K or V: Ulysses sends Q, K and V in one buffer). A ring's receive buffer
    (empty_like of the block it sends) gets the sent block's shadow: every ring block has the same layout.
    Values computed from K/V (attention outputs, gradients) are not K/V.

    `saving()` wraps the attention calls: what they save for backward (saved_tensors_hooks) is recorded by
    storage, so a view saved twice counts once.
    """

    def __init__(self):
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        self._torch, self._ref = torch, StorageWeakRef
        self.stored: dict[int, Stored] = {}
        self.live = self.live_kv = self.peak = self.peak_kv = 0
        self.saved: dict[int, tuple[object, int, int]] = {}  # storage -> (weak ref, bytes, K/V bytes) saved
        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return meter._dispatch(func, args, kwargs or {})

        self.mode = Mode()

    def __enter__(self) -> TensorMeter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    # -- bookkeeping
    def _plain(self, t):
        """t itself, or the tensor a wrapper subclass holds (a functional collective's AsyncCollectiveTensor)."""
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        while is_traceable_wrapper_subclass(t):
            t = getattr(t, t.__tensor_flatten__()[0][0])
        return t

    def _key(self, t):
        ref = self._ref(self._plain(t).untyped_storage())
        return ref.cdata, ref

    def _dispatch(self, func, args, kwargs):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **kwargs)
        name = func._schema.name
        shadow = self._moved_shadow(name, func, args, kwargs) if name in MOVES else None
        made = False
        for t in tree_flatten(out)[0]:
            if type(t) is self._torch.Tensor:  # a wrapper subclass holds no memory of its own
                made |= self._follow(t, shadow)
        if made:
            self._poll()
        return out

    def _follow(self, t, shadow) -> bool:
        """Start following t's storage if it is new (with `shadow`, t-shaped, for t's elements); True if it was."""
        key, ref = self._key(t)
        if key in self.stored:
            return False
        entry = Stored(ref, t.untyped_storage().nbytes())
        self.stored[key] = entry
        self.live += entry.nbytes
        if shadow is not None and bool(shadow.any()):
            self._set_shadow(entry, t, shadow)
        return True

    def _set_shadow(self, entry: Stored, t, shadow) -> None:
        """Write t's elements' K/V flags into its storage's shadow and recount the storage's K/V bytes."""
        torch = self._torch
        if entry.shadow is None:
            entry.shadow = torch.zeros(entry.nbytes // t.element_size(), dtype=torch.uint8)
        torch.as_strided(entry.shadow, t.size(), t.stride(), t.storage_offset()).copy_(shadow)
        kv = int(entry.shadow.count_nonzero()) * t.element_size()
        self.live_kv += kv - entry.kv
        entry.kv = kv

    def _poll(self) -> None:
        for key in [k for k, s in self.stored.items() if s.ref.expired()]:
            entry = self.stored.pop(key)
            self.live -= entry.nbytes
            self.live_kv -= entry.kv
        self.peak, self.peak_kv = max(self.peak, self.live), max(self.peak_kv, self.live_kv)

    # -- K/V shadows
    def _shadow(self, t):
        """t's K/V flags, shaped like t (uint8)."""
        torch = self._torch
        t = self._plain(t)
        entry = self.stored.get(self._key(t)[0])
        if entry is None or entry.shadow is None:
            return torch.zeros(t.shape, dtype=torch.uint8)
        return torch.as_strided(entry.shadow, t.size(), t.stride(), t.storage_offset())

    def _moved_shadow(self, name, func, args, kwargs):
        """The shadow of a data-movement op's output: the same op run on its data argument's shadows."""
        torch = self._torch
        data = args[0]
        shadows = [self._shadow(t) for t in data] if isinstance(data, (list, tuple)) else self._shadow(data)
        if name == "aten::empty_like":
            return shadows.clone()
        if name not in COLLECTIVE_MOVES and not any(bool(s.any()) for s in
                                                    (shadows if isinstance(shadows, list) else [shadows])):
            return None  # nothing to move (collectives run anyway: every rank must take part)
        kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
        moved = func(shadows, *args[1:], **kwargs)
        if name in COLLECTIVE_MOVES:
            moved = torch.ops._c10d_functional.wait_tensor(moved)
        return moved

    def mark_kv(self, *tensors) -> None:
        """Flag these tensors' elements as K/V (the K and V an attention call receives)."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the flags are the meter's own tensors, not the measured ones
            for t in tensors:
                key, _ = self._key(t)
                if key not in self.stored:
                    self._follow(t, None)
                self._set_shadow(self.stored[key], t, self._torch.ones(t.shape, dtype=self._torch.uint8))
            self._poll()

    # -- saved for backward
    def saving(self):
        """Context manager: record the storages saved for backward while it is active."""
        def pack(t):
            key, ref = self._key(t)
            entry = self.stored.get(key)
            kv = entry.kv if entry is not None else 0
            self.saved.setdefault(key, (ref, self._plain(t).untyped_storage().nbytes(), kv))
            return t

        return self._torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def saved_bytes(self) -> tuple[int, int]:
        """(bytes, K/V bytes) of the distinct storages saved so far under `saving()`."""
        return sum(nbytes for _, nbytes, _ in self.saved.values()), sum(kv for _, _, kv in self.saved.values())


# ------------------------------------------------------------------------------------- model, data, step
def build_model(cfg: BenchConfig):
    from xprep.train.model import Transformer

    model = Transformer(cfg.model_config())
    model.init_weights(cfg.seed)
    return model


def make_batch(seq: int, docs: int, vocab: int, seed: int) -> dict:
    """One packed row of `docs` equal documents; labels shifted inside each document (-100 at ends)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    length = seq // docs
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, length - 1 :: length] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(length).repeat(docs)[None],
        "cu_seqlens": torch.arange(0, seq + 1, length, dtype=torch.int32),
    }


def all_reduce_grads(model) -> None:
    """The replicated baseline's reduction: every gradient summed over the world in one flat all-reduce."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step(model, opt, batch: dict, n_targets: int, cp=None, all_reduce: bool = False,
               keep_grads: bool = False):
    """forward → Σ CE / global targets → backward → (gradient all-reduce) → AdamW. Returns the local loss."""
    from xprep.train.loss import token_ce

    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], cp=cp)  # (1, T, V)
    loss = token_ce(logits, batch["labels"]).sum() / n_targets
    del logits
    loss.backward()
    if all_reduce:
        all_reduce_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)
    return loss.detach()


def global_sum(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def slowest(times: list[float]) -> list[float]:
    """Per-step maximum over ranks: a synchronous step lasts as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ------------------------------------------------------------------------------------- workers
def cp_worker(cfg: BenchConfig) -> dict:
    """cp = world size (1: one plain process, no process group). Returns rank 0's result."""
    import torch
    import torch.distributed as dist
    from xprep.train.cp import CPContext, shard_batch

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    torch.set_num_threads(cfg.cores // size)
    use_hwm = hwm_reset_works()
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    build_rss = rss_mib()
    batches = [make_batch(cfg.cp_seq, cfg.cp_docs, cfg.vocab, cfg.seed + i) for i in range(cfg.warmup + cfg.steps)]
    targets = [int((b["labels"] != -100).sum()) for b in batches]
    local = [shard_batch(b, rank, size) if size > 1 else b for b in batches]
    del batches
    losses: list[float] = []

    def step(i: int) -> float:
        if size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        cp = CPContext.from_shard(local[i], dist.group.WORLD, rank, size) if size > 1 else None
        loss = train_step(model, opt, local[i], targets[i], cp=cp, all_reduce=size > 1, keep_grads=True)
        seconds = time.perf_counter() - t0
        losses.append(global_sum(float(loss)) if size > 1 else float(loss))
        return seconds

    for i in range(cfg.warmup):
        step(i)
    trim_heap()
    setup_rss = rss_mib()
    times, peaks = [], []
    for i in range(cfg.warmup, cfg.warmup + cfg.steps):
        trim_heap()
        with PeakRSS(use_hwm) as meter:
            times.append(step(i))
        peaks.append(meter.peak)
    mine = {"build_rss": build_rss, "setup_rss": setup_rss, "peak_rss": max(peaks),
            "activation": max(peaks) - setup_rss}
    ranks = [None] * size
    if size > 1:
        dist.all_gather_object(ranks, mine)
        times = slowest(times)
    else:
        ranks = [mine]
    return {"cp": size, "threads": torch.get_num_threads(), "tokens_per_rank": int(local[0]["input_ids"].shape[1]),
            "hwm": use_hwm, "times": times, "losses": losses, "ranks": ranks}


def shard(model, mesh, reshard_after_forward: bool):
    """FSDP2 as issue 5 lays it out: `fully_shard` per block then the root; sum reduction, no division."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # sum, not mean: the loss is normalized by the global target count
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo rejects the PREMUL_SUM the factor becomes
    return model


FSDP_MODES = ("replicated", "fsdp", "fsdp_keep")  # keep = reshard_after_forward=False


def fsdp_worker(cfg: BenchConfig) -> dict:
    """dp = world size: the replicated model and two FSDP2 variants, in rotating order on the same batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.cores // world)
    mesh = init_device_mesh("cpu", (world,))
    models = {
        "replicated": build_model(cfg),
        "fsdp": shard(build_model(cfg), mesh, reshard_after_forward=True),  # fully_shard's default
        "fsdp_keep": shard(build_model(cfg), mesh, reshard_after_forward=False),
    }
    opts = {m: torch.optim.AdamW(model.parameters(), lr=1e-4) for m, model in models.items()}
    n_steps = cfg.warmup + cfg.rounds * cfg.round_steps
    batches = [make_batch(cfg.dp_seq, cfg.dp_docs, cfg.vocab, 10_000 + cfg.seed + i * world + rank)
               for i in range(n_steps)]
    targets = [int(global_sum(float((b["labels"] != -100).sum()))) for b in batches]
    times: dict[str, list[float]] = {m: [] for m in FSDP_MODES}
    losses: dict[str, list[float]] = {m: [] for m in FSDP_MODES}

    def run(mode: str, i: int, timed: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(models[mode], opts[mode], batches[i], targets[i], all_reduce=mode == "replicated")
        if timed:
            times[mode].append(time.perf_counter() - t0)
        losses[mode].append(global_sum(float(loss)))

    for mode in FSDP_MODES:
        for i in range(cfg.warmup):
            run(mode, i, timed=False)
    for r in range(cfg.rounds):  # rotate the order so each mode runs first, second and last equally often
        for mode in FSDP_MODES[r % 3 :] + FSDP_MODES[: r % 3]:
            for k in range(cfg.round_steps):
                run(mode, cfg.warmup + r * cfg.round_steps + k, timed=True)
    return {"dp": world, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in models["replicated"].parameters()),
            "times": {m: slowest(t) for m, t in times.items()}, "losses": losses}


# ------------------------------------------------------------------------------------- 3. the CP modes' K/V memory
NO_CP = "none"  # C = 1: the ordinary varlen attention, no CP


def modes_of(size: int) -> list[tuple[str, int | None]]:
    """The (mode, Ulysses factor) measured at CP degree `size`: hybrid as 2 Ulysses ranks × a ring of size / 2."""
    from xprep.train.cp import ALLGATHER, HYBRID, RING, ULYSSES

    if size == 1:
        return [(NO_CP, None)]
    return [(ALLGATHER, None), (RING, None), (ULYSSES, None)] + ([(HYBRID, 2)] if size >= 4 and size % 2 == 0 else [])


def mode_label(mode: str, size: int) -> str:
    from xprep.train.cp import HYBRID

    return f"hybrid 2×{size // 2}" if mode == HYBRID else "no CP" if mode == NO_CP else mode


def modes_row(cfg: BenchConfig) -> dict:
    """The packed row of section 3: `modes_docs` equal documents (position_ids restart, cu_seqlens their bounds)."""
    import torch

    length = cfg.modes_seq // cfg.modes_docs
    return {"position_ids": torch.arange(length).repeat(cfg.modes_docs)[None],
            "cu_seqlens": torch.arange(0, cfg.modes_seq + 1, length, dtype=torch.int32)}


def mode_attention(row: dict, mode: str, factor: int | None, rank: int, size: int):
    """(attend, this rank's global token indices, their positions) of one mode: its groups and `cp_context` as
    xtrain lays them out (CP rank r at ring index r // U and Ulysses index r % U), or varlen attention at C = 1."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from xprep.train.attention import varlen_attention
    from xprep.train.cp import CPGroups, cp_context, shard_batch, ulysses_degree

    if size == 1:
        cu, bounds = row["cu_seqlens"], row["cu_seqlens"].tolist()
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        index = torch.arange(bounds[-1])
        return (lambda q, k, v: varlen_attention(q, k, v, cu, longest, bounds=bounds)), index, row["position_ids"][0]
    u = ulysses_degree(mode, size, factor)
    mesh = init_device_mesh("cpu", (size // u, u), mesh_dim_names=("ring", "ulysses"))
    groups = CPGroups(mesh._flatten("cp").get_group(), mesh["ring"].get_group(), mesh["ulysses"].get_group())
    shard = shard_batch(row, rank, size)
    cp = cp_context(shard, mode, rank, size, factor, groups)
    return cp.attention, shard["global_index"], shard["position_ids"][0]


def build_stack(cfg: BenchConfig):
    """`modes_layers` of the built-in model's attention (q/k/v/o projections, RoPE, GQA); the same weights on
    every rank and in every launch."""
    import torch
    from xprep.train.model import Attention

    torch.manual_seed(cfg.seed)
    return torch.nn.ModuleList(Attention(cfg.modes_dim, cfg.modes_heads, cfg.modes_kv_heads)
                               for _ in range(cfg.modes_layers))


@dataclass
class ModeRun:
    """One mode's share of the row on this rank: its attention, inputs and loss weights (T_local, dim), RoPE."""

    attend: object
    x: object
    target: object
    cos: object
    sin: object


def stack_step(layers, run: ModeRun, attend) -> float:
    """One forward + backward of the stack (a residual around each layer); returns the local loss, whose sum
    over the ranks is the loss of the whole row."""
    h = run.x  # (T_local, dim)
    for layer in layers:
        h = h + layer(h, run.cos, run.sin, attend)
    loss = (h * run.target).sum()
    loss.backward()
    layers.zero_grad(set_to_none=False)  # the weights' gradients stay allocated: part of the steady state
    return float(loss.detach())


def metered(attend, meter: TensorMeter):
    """`attend` with its K and V flagged for the meter and what it saves for backward recorded."""
    def attend_metered(q, k, v):
        meter.mark_kv(k, v)
        with meter.saving():
            return attend(q, k, v)

    return attend_metered


def modes_worker(cfg: BenchConfig) -> dict:
    """Every mode at C = world size (1: one plain process): one metered step each (the exact figures; it is also
    the warm-up), then `modes_steps` rounds of one step per mode in rotating order, each under a peak-RSS meter."""
    import torch
    import torch.distributed as dist
    from xprep.train.model import rope_cos_sin

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    torch.set_num_threads(max(1, cfg.cores // size))
    use_hwm = hwm_reset_works()
    layers = build_stack(cfg)
    g = torch.Generator().manual_seed(cfg.seed)
    x_all, target_all = (torch.randn(cfg.modes_seq, cfg.modes_dim, generator=g) for _ in range(2))
    row = modes_row(cfg)
    runs: dict[str, ModeRun] = {}
    for mode, factor in modes_of(size):
        attend, index, positions = mode_attention(row, mode, factor, rank, size)
        cos, sin = rope_cos_sin(positions, cfg.modes_dim // cfg.modes_heads, 10000.0)
        runs[mode] = ModeRun(attend, x_all[index], target_all[index], cos, sin)
    del x_all, target_all

    def step(mode: str, attend) -> tuple[float, float]:
        if size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = stack_step(layers, runs[mode], attend)
        return time.perf_counter() - t0, loss

    mine: dict[str, dict] = {}
    losses: dict[str, float] = {}
    for mode, run in runs.items():
        meter = TensorMeter()
        with meter:
            _, loss = step(mode, metered(run.attend, meter))
        saved, saved_kv = meter.saved_bytes()
        mine[mode] = {"tensors": meter.peak, "kv_peak": meter.peak_kv, "saved": saved, "saved_kv": saved_kv,
                      "rss": 0.0}
        losses[mode] = global_sum(loss) if size > 1 else loss
        del meter
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    order = list(runs)
    for r in range(cfg.modes_steps):  # rotate the order so load drift on the machine hits every mode alike
        for mode in order[r % len(order) :] + order[: r % len(order)]:
            trim_heap()
            steady = rss_mib()
            with PeakRSS(use_hwm) as peak:
                seconds, _ = step(mode, runs[mode].attend)
            times[mode].append(seconds)
            mine[mode]["rss"] = max(mine[mode]["rss"], peak.peak - steady)
    ranks = [mine]
    if size > 1:
        ranks = [None] * size
        dist.all_gather_object(ranks, mine)
        times = {mode: slowest(t) for mode, t in times.items()}
    return {"size": size, "threads": torch.get_num_threads(), "tokens_per_rank": len(runs[order[0]].x),
            "hwm": use_hwm, "modes": {mode: {"ranks": [r[mode] for r in ranks], "times": times[mode],
                                             "loss": losses[mode]} for mode in runs}}


def worker_main(kind: str, cfg: BenchConfig) -> None:
    """Run one worker; rank 0 prints the result line. Clean gloo shutdown, then a hard exit (gloo + DeviceMesh
    aborts at interpreter exit in about one run of seven)."""
    import torch.distributed as dist

    code = 0
    try:
        result = {"cp": cp_worker, "fsdp": fsdp_worker, "modes": modes_worker}[kind](cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT + json.dumps(result), flush=True)
    except BaseException:
        # one write, so the two ranks' tracebacks do not interleave in the shared pipe
        sys.stderr.write(f"{FAILED} (rank {os.environ.get('RANK', '0')}):\n{traceback.format_exc()}")
        code = 1
    if dist.is_initialized() and code == 0:  # after a failure peers may hang in a collective: just exit
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------- launcher
def stop(proc: subprocess.Popen) -> None:
    """Stop a worker launch we started: SIGTERM (torchrun passes it on to its ranks), then SIGKILL by pid."""
    pids = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def excerpt(err: str, limit: int = 3000) -> str:
    """The traceback of a worker's first failed rank (torchrun's own summary says little), else the
    end of its stderr; at most `limit` characters, keeping the end where the error message is."""
    start = err.find(FAILED)
    if start < 0:
        return err[-limit:]
    end = err.find(FAILED, start + 1)
    text = err[start : end if end > 0 else len(err)]
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def launch(cfg: BenchConfig, kind: str, nproc: int) -> dict:
    """Spawn a worker (plain process, or torchrun --standalone for nproc > 1) and read its result line."""
    script = str(Path(__file__).resolve())
    args = [script, "--worker", kind, "--config", json.dumps(asdict(cfg))]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cfg.cores // nproc)), "PYTHONPATH": str(ROOT)}
    what = f"{kind} worker ({nproc} process{'es' if nproc > 1 else ''})"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise BenchError(f"{what} timed out after {cfg.timeout:.0f} s; its stderr ends with:\n{excerpt(err)}") from None
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"{what} exited with status {proc.returncode}"
                         f"{'' if lines else ' and printed no result'}; its stderr:\n{excerpt(err)}")
    print(f"  {what}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(lines[-1][len(RESULT) :])


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report_cp(cfg: BenchConfig, one: dict, two: dict) -> tuple[float, float]:
    """Print the context-parallel section; return (activation memory ratio, median step-time ratio)."""
    t1, t2 = statistics.median(one["times"]), statistics.median(two["times"])
    act1 = one["ranks"][0]["activation"]
    act2 = max(r["activation"] for r in two["ranks"])
    how = "VmHWM reset before each step" if one["hwm"] and two["hwm"] else "RSS sampled every 5 ms"
    print(f"\n1. Context parallelism: seq {cfg.cp_seq:,} = {cfg.cp_docs} documents × {cfg.cp_seq // cfg.cp_docs:,} "
          f"tokens; peak = {how}; {len(one['times'])} timed steps after {cfg.warmup} warm-up")
    print(f"   {'layout':<28}{'tokens':>7}{'set-up RSS':>12}{'peak RSS':>10}{'activation':>12}"
          f"{'step median':>13}{'min':>8}")
    rows = [(f"cp=1: 1 process × {one['threads']} threads", one, one["ranks"][0])]
    rows += [(f"cp=2 rank {i}: {two['threads']} thread", two, r) for i, r in enumerate(two["ranks"])]
    for name, res, r in rows:
        print(f"   {name:<28}{res['tokens_per_rank']:>7,}{r['setup_rss']:>8.0f} MiB{r['peak_rss']:>6.0f} MiB"
              f"{r['activation']:>8.0f} MiB{statistics.median(res['times']):>11.2f} s{min(res['times']):>6.2f} s")
    build = max(r["peak_rss"] - r["build_rss"] for r in two["ranks"]) / (one["ranks"][0]["peak_rss"]
                                                                         - one["ranks"][0]["build_rss"])
    print(f"   measured instead from the RSS right after building model and AdamW (before gradients and AdamW "
          f"state exist): {build:.3f}×")
    print(f"   check: cp=2 losses equal cp=1's to {max_rel_diff(two['losses'], one['losses']):.1e} (relative), "
          f"{len(one['losses'])} steps")
    return act2 / act1, t2 / t1


FSDP_LABELS = {
    "replicated": "replicated + flat all-reduce",
    "fsdp": "FSDP2 (reshard after forward)",
    "fsdp_keep": "FSDP2 (no reshard after fwd)",
}


def report_fsdp(cfg: BenchConfig, res: dict) -> dict[str, float]:
    """Print the FSDP2 section; return each FSDP2 variant's median step-time ratio to the replicated one."""
    med = {m: statistics.median(t) for m, t in res["times"].items()}
    n = len(res["times"]["fsdp"])
    print(f"\n2. FSDP2, dp={res['dp']}, 1 process × {res['threads']} thread per rank: {res['params'] / 1e6:.2f}M "
          f"parameters, {cfg.dp_seq:,} tokens per rank and step ({cfg.dp_docs} documents); {n} timed steps per mode "
          f"in {cfg.rounds} rotating rounds after {cfg.warmup} warm-up")
    print(f"   {'mode':<32}{'median':>9}{'min':>9}{'max':>9}{'ratio of medians':>18}{'of mins':>9}{'paired':>8}")
    base = res["times"]["replicated"]
    for mode in FSDP_MODES:
        t = res["times"][mode]
        paired = statistics.median(a / b for a, b in zip(t, base, strict=True))
        print(f"   {FSDP_LABELS[mode]:<32}{med[mode]:>7.3f} s{min(t):>7.3f} s{max(t):>7.3f} s"
              f"{med[mode] / med['replicated']:>17.3f}×{min(t) / min(base):>8.3f}×{paired:>7.3f}×")
    print("   (paired = median over steps of the ratio to the replicated step run on the same batch in the same round)")
    worst = max(max_rel_diff(res["losses"][m], res["losses"]["replicated"]) for m in ("fsdp", "fsdp_keep"))
    print(f"   check: FSDP2 losses equal the replicated model's to {worst:.1e} (relative), "
          f"{len(res['losses']['fsdp'])} steps")
    return {m: med[m] / med["replicated"] for m in ("fsdp", "fsdp_keep")}


MODES_COLUMNS = """\
   columns, per rank (the largest over the ranks), for one forward + backward of the stack:
     RSS        peak RSS during the step minus the RSS just before it (VmHWM reset | RSS sampled), heap trimmed:
                everything the step touches (activations of the whole stack, attention, gradients); noisy
     tensors    exact: peak of the live bytes of the tensors the step made (RSS's scope, tensor storages only)
     saved      exact: bytes the attention calls keep for backward, all layers (saved_tensors_hooks, per storage)
     saved K/V  exact: the part of `saved` that holds K or V values
     K/V peak   exact: peak of the live bytes holding K or V values: the K and V attention receives and every
                copy made of them (concatenated, gathered, permuted, repeated, ring blocks sent and received);
                values computed from them (outputs, gradients) are not counted
     step       seconds of forward + backward, the slowest rank's, median and min of the timed steps"""


def modes_rows(results: dict[int, dict]) -> list[tuple[int, str, dict, dict]]:
    """(C, mode, the launch's result, the mode's figures as the largest over its ranks), in launch order."""
    rows = []
    for size, res in results.items():
        for mode, m in res["modes"].items():
            worst = {key: max(r[key] for r in m["ranks"]) for key in m["ranks"][0]}
            rows.append((size, mode, res, worst))
    return rows


def report_modes(cfg: BenchConfig, results: dict[int, dict]) -> list[tuple[str, float, float | None]]:
    """Print section 3; return its summary rows (name, value, target)."""
    rows = modes_rows(results)
    head_dim = cfg.modes_dim // cfg.modes_heads
    layer_kv = cfg.modes_seq * 2 * cfg.modes_kv_heads * head_dim * 4 / MIB
    hwm = all(res["hwm"] for res in results.values())
    print(f"\n3. K/V memory of the CP modes: one row of {cfg.modes_seq:,} tokens = {cfg.modes_docs} documents × "
          f"{cfg.modes_seq // cfg.modes_docs:,}; a stack of {cfg.modes_layers} attention layers of the built-in model "
          f"(q/k/v/o projections, RoPE, a residual around each; width {cfg.modes_dim}, {cfg.modes_heads} heads / "
          f"{cfg.modes_kv_heads} K/V heads of {head_dim}), fp32; gloo, C processes sharing {cfg.cores} cores; one "
          f"metered step (also the warm-up), then {cfg.modes_steps} timed steps per mode in rotating order")
    print(f"   one layer's K and V for the whole row: {cfg.modes_seq:,} × 2·{cfg.modes_kv_heads} × {head_dim} × 4 B = "
          f"{layer_kv:.1f} MiB; peak RSS by {'VmHWM reset before each step' if hwm else 'RSS sampled every 5 ms'}")
    print(MODES_COLUMNS)
    print(f"   {'C':>2}  {'mode':<12}{'procs×thr':>10}{'tokens':>8}{'RSS':>9}{'tensors':>9}{'saved':>9}"
          f"{'saved K/V':>11}{'K/V peak':>10}{'step':>9}{'min':>8}   (MiB, s)")
    for size, mode, res, worst in rows:
        times = res["modes"][mode]["times"]
        layout = f"{size}×{res['threads']}"
        print(f"   {size:>2}  {mode_label(mode, size):<12}{layout:>10}{res['tokens_per_rank']:>8,}"
              f"{worst['rss']:>9.1f}{worst['tensors'] / MIB:>9.1f}{worst['saved'] / MIB:>9.1f}"
              f"{worst['saved_kv'] / MIB:>11.1f}{worst['kv_peak'] / MIB:>10.1f}{statistics.median(times):>9.2f}"
              f"{min(times):>8.2f}")
    print_mode_ratios(results, rows)
    first_size, first_mode = rows[0][0], rows[0][1]
    reference = [results[first_size]["modes"][first_mode]["loss"]]
    worst_loss = max(max_rel_diff([res["modes"][m]["loss"]], reference)
                     for res in results.values() for m in res["modes"])
    print(f"   check: every mode's loss (summed over its ranks) equals that of {mode_label(first_mode, first_size)} "
          f"(C={first_size}) to {worst_loss:.1e} (relative)")
    summary = modes_summary({(size, mode): worst for size, mode, _, worst in rows}, max(results))
    if summary and summary[0][2] is not None:
        name, value, target = summary[0]
        print(f"   goal (issue 33): ring ≤ {target}× allgather's K/V memory at C={max(results)}, on the exact K/V "
              f"peak: {value:.3f}× {verdict(value <= target)}; against no CP (C=1): {summary[-1][1]:.3f}×")
    return summary


def print_mode_ratios(results: dict[int, dict], rows: list[tuple[int, str, dict, dict]]) -> None:
    """Each mode's figures over allgather's at the same C, and over no CP's (C=1)."""
    from xprep.train.cp import ALLGATHER

    fig = {(size, mode): worst for size, mode, _, worst in rows}
    print("   ratios to allgather at the same C:   K/V peak  saved K/V   tensors       RSS  step median")
    for size, mode, _, worst in rows:
        if size == 1 or mode == ALLGATHER:
            continue
        base = fig[(size, ALLGATHER)]
        t, t0 = (statistics.median(results[size]["modes"][m]["times"]) for m in (mode, ALLGATHER))
        print(f"   C={size} {mode_label(mode, size) + ' / allgather':<29}"
              f"{_ratio(worst['kv_peak'], base['kv_peak']):>10}{_ratio(worst['saved_kv'], base['saved_kv']):>11}"
              f"{_ratio(worst['tensors'], base['tensors']):>10}{_ratio(worst['rss'], base['rss']):>10}{t / t0:>12.3f}×")
    none = fig.get((1, NO_CP))
    if none is None:
        return
    print("   ratios to no CP (C=1):               K/V peak  saved K/V   tensors       RSS")
    for size, mode, _, worst in rows:
        if size > 1:
            print(f"   C={size} {mode_label(mode, size) + ' / no CP':<29}"
                  f"{_ratio(worst['kv_peak'], none['kv_peak']):>10}{_ratio(worst['saved_kv'], none['saved_kv']):>11}"
                  f"{_ratio(worst['tensors'], none['tensors']):>10}{_ratio(worst['rss'], none['rss']):>10}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}×" if b > 0 else "—"


def modes_summary(fig: dict[tuple[int, str], dict], top: int) -> list[tuple[str, float, float | None]]:
    """The summary rows of section 3: the goal is ring at the largest C ≤ 0.35× allgather's K/V peak there;
    ring there against no CP (C=1) comes last."""
    from xprep.train.cp import ALLGATHER, RING, ULYSSES

    rows = []
    ring, allgather = fig.get((top, RING)), fig.get((top, ALLGATHER))
    if ring and allgather:
        rows.append((f"K/V peak per rank, ring / allgather, C={top} (exact)", ring["kv_peak"] / allgather["kv_peak"],
                     KV_GOAL))
        rows.append(("  same, saved K/V (kept for backward)", ring["saved_kv"] / allgather["saved_kv"], None))
        rows.append(("  same, ulysses / allgather", fig[(top, ULYSSES)]["kv_peak"] / allgather["kv_peak"], None))
    if ring and (1, NO_CP) in fig:
        rows.append((f"K/V peak per rank, ring C={top} / no CP (C=1)", ring["kv_peak"] / fig[(1, NO_CP)]["kv_peak"],
                     None))
    return rows


def parse_args() -> tuple[argparse.Namespace, BenchConfig]:
    """Command line → BenchConfig: `--quick` picks the smoke-run defaults; one option per field overrides."""
    full, quick = BenchConfig(), BenchConfig.quick()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sequences and fewer steps (smoke run)")
    ap.add_argument("--only", action="append", choices=SECTIONS,
                    help="run only this section (repeatable): cp (1.), fsdp (2.), modes (3.); default all")
    for f in fields(BenchConfig):
        default, small = getattr(full, f.name), getattr(quick, f.name)
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(default), dest=f.name,
                        help=f"default {default}" + (f", quick {small}" if small != default else ""))
    ap.add_argument("--worker", choices=["cp", "fsdp", "modes"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return args, BenchConfig(**json.loads(args.config))
    chosen = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if getattr(args, f.name) is not None}
    return args, replace(quick if args.quick else full, **chosen)


def main() -> int:
    from xprep.prep.errors import XprepError

    try:
        args, cfg = parse_args()
        if args.worker:
            worker_main(args.worker, cfg)
        model = cfg.model_config()
    except (BenchError, XprepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    sections = args.only or list(SECTIONS)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; each configuration gets {cfg.cores} cores in total "
          f"(1 process × {cfg.cores} threads, or 2 processes × {cfg.cores // 2} thread{'s' if cfg.cores > 2 else ''})")
    if "cp" in sections or "fsdp" in sections:
        print(f"model: {model.n_layers} layers, width {model.dim}, {model.n_heads} heads / {model.n_kv_heads} K/V "
              f"heads, ffn {model.ffn_dim}, vocab {model.vocab_size}, {'tied' if model.tie_embeddings else 'untied'}, "
              f"fp32, AdamW; {model.num_params() / 1e6:.2f}M parameters")
    t0 = time.perf_counter()
    try:
        cp = (launch(cfg, "cp", 1), launch(cfg, "cp", 2)) if "cp" in sections else None
        fsdp = launch(cfg, "fsdp", 2) if "fsdp" in sections else None
        modes = {size: launch(cfg, "modes", size) for size in MODES_SIZES} if "modes" in sections else None
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = []
    if cp:
        act, cp_step = report_cp(cfg, *cp)
        rows += [("CP peak activation memory per rank, cp=2 / cp=1", act, 0.6),
                 ("CP step time (median), cp=2 / cp=1", cp_step, None),
                 ("CP step time (min), cp=2 / cp=1", min(cp[1]["times"]) / min(cp[0]["times"]), None)]
    if fsdp:
        fsdp_ratio = report_fsdp(cfg, fsdp)
        rows += [("step time (median), FSDP2 / replicated, dp=2", fsdp_ratio["fsdp"], 1.2),
                 ("  same, FSDP2 without reshard after forward", fsdp_ratio["fsdp_keep"], 1.2)]
    if modes:
        rows += report_modes(cfg, modes)
    print(f"\nsummary ({'quick' if args.quick else 'full'} run, {time.perf_counter() - t0:.0f} s; "
          f"every configuration on {cfg.cores} cores in total):")
    print(f"   {'measure':<52}{'value':>8}{'target':>9}   verdict")
    for name, value, target in rows:
        goal = f"≤ {target}×" if target else "—"
        print(f"   {name:<52}{value:>7.3f}×{goal:>9}   {verdict(value <= target) if target else ''}".rstrip())
    full = BenchConfig()
    if (cp and cfg.cp_seq != full.cp_seq) or (fsdp and cfg.dp_seq != full.dp_seq):
        print(f"   note: the targets are set for seq {full.cp_seq:,} (CP) and {full.dp_seq:,} tokens per rank (FSDP2); "
              "at smaller sizes the fixed costs (gradients, AdamW state, FSDP2's collectives) weigh more")
    if modes and cfg.modes_seq != full.modes_seq:
        print(f"   note: the K/V goal is set for a row of {full.modes_seq:,} tokens")
    return 0

if __name__ == "__main__":
    sys.exit(main())
