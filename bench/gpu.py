"""GPU proof of ``xtrain``: environment, attention kernels, model numerics, FSDP2 + DCP on one rank, throughput,
and ``xtrain run`` stopped, resumed, exported and started from a checkpoint on the device.

    python -m bench.gpu                       # every part, on CUDA when there is a GPU (--device auto)
    python -m bench.gpu kernels model         # some parts: env, kernels, model, fsdp1, throughput, resilience
    python -m bench.gpu --device cpu          # the same checks at small sizes on the CPU (tests/test_bench_gpu.py)

One line per check: part, check, its figure, the bound, PASS / FAIL / SKIP (with why); notes have no
verdict. The exit status is the number of failed checks (a part that raises counts as one), so the
day a GPU is lent, the proof is this one command and its output pasted into a note.

- env: torch and CUDA versions, the device, compute capability, SMs, memory, whether it is a MIG slice,
  the peak FLOPS MFU is measured against (``xprep.train.flops.resolve_peak_tflops``, bf16 and fp32), the
  installed ``varlen_attn``'s keywords (``xprep.train.attention.varlen_signature``), flash-attn's version and the
  attention path a bf16 / fp32 / context-parallel forward takes (``xprep.train.attention.attention_path``).
  Check: on CUDA at compute capability ≥ 8.0, bf16 takes a one-call varlen kernel.
- kernels: forward and backward of each attention path over packed documents (GQA, a 1-token document,
  a long one) against SDPA per document in float64 on the same inputs; relative error ‖got − ref‖ / ‖ref‖
  of the output and of dq, dk, dv: bf16 < 2e-2, fp32 < 1e-4. Paths: ``varlen_attention`` (what the
  device takes), torch's ``varlen_attn`` and flash-attn called directly (CUDA), FlexAttention in bf16 and
  fp32 (forward only on the CPU, where it has no backward), and context parallelism at 2 and 4 ranks
  (``xprep.train.cp.piece_attention``: each rank's zigzag pieces over all keys, the ranks' losses summed as the
  all-gather's backward sums them). And FlexAttention's block mask at T = 8k and 64k (CUDA; 2k and 8k on
  the CPU): bytes of its tensors and, on CUDA, the peak allocated while it is built, both under T²/64
  bytes (1/64 of a T×T boolean grid: no path may build one).
- model: the built-in model ('small' at 2,048 tokens on CUDA, 'tiny' at 256 on the CPU), loss and
  gradients of one packed row: CUDA fp32 (TF32 off) = CPU fp32 within 1e-4; bf16 autocast = fp32 within
  1e-2 for the loss and 2e-2 for the gradients (their error grows with depth: 1.0e-2 measured for 'small'
  on a CPU); ``loss_chunk`` = whole logits and compiled blocks (``xprep.train.dist.apply_compile``) = eager within
  1e-4, the compiled ones over 3 document layouts with no recompilation after the first.
- fsdp1: FSDP2 (``xprep.train.dist.apply_fsdp``) over a 1-rank process group (nccl on CUDA, gloo on the CPU),
  the model built on the meta device and materialized, one AdamW step, DCP save, then a fresh meta
  model (its storage filled with NaN) and optimizer loaded from it: model and optimizer state bit-equal.
- throughput: the '1b' preset at 8,192 tokens per row in bf16 (CUDA; 'tiny' at 256 tokens in fp32 on the
  CPU) with and without compiled blocks and activation checkpointing: tokens/s, achieved TFLOPS, both MFUs
  (``mfu``, this project's count; ``mfu_6n``, torchtitan's and PaLM's: ``xprep.train.flops``) and the peak
  memory allocated. Targets (issue 30) on one H100/H200, compiled, no activation checkpointing:
  ``mfu_6n`` ≥ 40 % and peak memory well inside 80 GB; their ratios are printed, and checked there.
- resilience: issue 31's paths through ``xtrain run`` itself, in child processes on the device
  (``XTRAIN_DEVICE``, bench/tinyrun.py: a pack of random documents, the model part's preset, 32 steps of 2 bins
  of 1,024 tokens on CUDA, 16 of 64 tokens on the CPU). ``--async-save --save-every 4 --save-hf`` run twice side
  by side: one uninterrupted, one sent SIGTERM by this process once step 5 is logged: exit 143, ``latest`` a
  complete checkpoint of the last step logged, the last stderr line naming it. The same command then resumes:
  exit 0, each step logged once, the uninterrupted run's batches and lr exactly, its losses (bit-equal on the
  CPU; on CUDA in bf16 within 1e-2, the count bit-equal printed: attention's backward may use atomics).
  Meanwhile the uninterrupted run's ``RUN/hf/step-N``, gathered on the device, = ``xtrain export`` of step-N read
  on the CPU, bit for bit, and transformers (when installed) loads ``RUN/hf/latest`` with finite logits on the
  device. A run ``--init-from`` that run with ``--inject-nonfinite grad:0:3``: step 3 alone skipped, exit 0;
  run.json's init names the checkpoint, and the first loss is the checkpoint's weights evaluated here on the
  same bins (bit-equal on the CPU, within 1e-3 on CUDA).

On the CPU the compiled checks use the ``aot_eager`` backend (``--compile-backend``): dynamo, graph breaks
and recompiles are those of inductor, without ~30 s of C++ compilation per run on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import xprep.train.attention as attention  # noqa: E402
import xprep.train.cp as cp  # noqa: E402
import xprep.train.dist as tdist  # noqa: E402
import xprep.train.flops as flops  # noqa: E402
import xprep.train.ring as ring  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from xprep.train.checkpoint import find_latest  # noqa: E402
from xprep.train.config import ModelSection  # noqa: E402
from xprep.train.data import PackedDataset, collate  # noqa: E402
from xprep.train.hf_weights import export_run, model_from_checkpoint  # noqa: E402
from xprep.train.loss import IGNORE, auto_loss_chunk, token_ce  # noqa: E402
from xprep.train.model import PRESETS, ModelConfig, Transformer  # noqa: E402
from xprep.train.optim import build_optimizer  # noqa: E402
from xprep.train.samplers import BinSampler  # noqa: E402

from bench import tinyrun  # noqa: E402

PARTS = ("env", "kernels", "model", "fsdp1", "throughput", "resilience")
BF16_TOL, FP32_TOL = 2e-2, 1e-4  # relative error of attention kernels (output, dq, dk, dv)
BF16_LOSS_TOL, BF16_GRAD_TOL = 1e-2, 2e-2  # bf16 autocast against fp32, whole model
MFU_6N_TARGET = 0.40  # 1B preset, seq 8192, bf16, compiled, no AC, one H100/H200 (torchtitan's convention)
PEAK_MEMORY_TARGET = 80 * 2**30  # "well inside 80 GB"
TARGET_GPUS = ("H100", "H200")


@dataclass(frozen=True)
class Sizes:
    """How big each part runs: full size on CUDA, small on the CPU."""

    kernel_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    mask_tokens: tuple[int, ...]
    model: str  # preset of the model and fsdp1 parts
    model_vocab: int
    model_tokens: int
    bench_model: str  # preset of the throughput part
    bench_vocab: int
    bench_tokens: int
    warmup: int
    steps: int
    run_tokens: int  # bin capacity of the resilience part's runs (its model: ``model``)
    run_steps: int  # their length; more on CUDA, whose quicker steps leave the signal less time to arrive


CUDA_SIZES = Sizes(8192, 16, 4, 128, (8192, 65536), "small", 32_000, 2048, "1b", 128_256, 8192, 3, 10, 1024, 32)
CPU_SIZES = Sizes(512, 4, 2, 64, (2048, 8192), "tiny", 512, 256, "tiny", 512, 256, 1, 1, 64, 16)


# ----------------------------------------------------------------------------------------------- report
class Report:
    """The lines of a run, one per check (figure, bound, PASS / FAIL), skipped check or note; failures counted."""

    def __init__(self, stream=None):
        self.stream = stream
        self.part = ""
        self.failures = 0

    def _line(self, name: str, figure: str, bound: str = "", status: str = "") -> None:
        text = f"{self.part:<10} {name:<46} {figure:<46} {bound:<14} {status}".rstrip()
        print(text, file=self.stream or sys.stdout, flush=True)

    def check(self, name: str, ok: bool, figure: str, bound: str) -> bool:
        self.failures += not ok
        self._line(name, figure, bound, "PASS" if ok else "FAIL")
        return ok

    def below(self, name: str, value: float, bound: float, figure: str | None = None, shown: str | None = None
              ) -> bool:
        """A check that ``value`` < ``bound`` (NaN fails); ``shown`` is how the bound is printed."""
        return self.check(name, bool(value < bound), figure or f"{value:.2e}", shown or f"< {bound:.0e}")

    def attempt(self, name: str, fn: Callable, *args) -> None:
        """``fn(*args)``; should it raise, a failed check ``name`` saying what (the traceback to stderr), and the
        part goes on with its other checks."""
        try:
            fn(*args)
        except Exception as e:  # a check that breaks is a failure to report, not the end of the proof
            traceback.print_exc()
            self.check(name, False, _raised(e), "runs")

    def skip(self, name: str, why: str) -> None:
        self._line(name, why, "", "SKIP")

    def note(self, name: str, text: str) -> None:
        self._line(name, text)


def _raised(e: BaseException) -> str:
    return f"raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:60]}"


@dataclass
class Bench:
    """What every part is given: the device, how big to run, where to report, the compile backend, a scratch
    directory."""

    device: torch.device
    sizes: Sizes
    report: Report
    compile_backend: str
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ----------------------------------------------------------------------------------------------- helpers
def rel_error(got: Tensor, want: Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def doc_lengths(total: int, seed: int) -> list[int]:
    """Document lengths summing to ``total``: a 1-token document first, then lognormal ones around total/8."""
    rng = np.random.default_rng(seed)
    lengths = [1]
    while sum(lengths) < total:
        lengths.append(int(np.clip(rng.lognormal(math.log(total / 8), 1.0), 1, total)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def bounds_of(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def packed_row(lengths: list[int], vocab: int, device: torch.device, seed: int) -> dict[str, Tensor]:
    """A packed row as the trainer feeds it: ids, positions restarting per document, labels (the last token of
    each document predicts nothing) on ``device``; cu_seqlens int32 on the CPU (read as Python ints)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor(bounds_of(lengths), dtype=torch.int32)
    labels = torch.randint(0, vocab, (1, total), generator=g)
    labels[0, cu[1:].long() - 1] = IGNORE
    return {"input_ids": torch.randint(0, vocab, (1, total), generator=g).to(device),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),
            "labels": labels.to(device), "cu_seqlens": cu}


def targets(batch: dict[str, Tensor]) -> int:
    return int((batch["labels"] != IGNORE).sum())


def dynamo_frames() -> int:
    """Frames dynamo has compiled so far in this process (a recompilation adds one)."""
    return counters["frames"]["total"]


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in IEEE fp32 (TF32 off) on CUDA inside the block: the reference precision."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        old = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = old
    else:  # pragma: no cover - older torch
        old = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = old


def build_model(preset: str, vocab: int, seed: int) -> tuple[nn.Module, ModelConfig]:
    """The built-in model on the CPU in fp32, initialized as ``xtrain run`` initializes it."""
    cfg = ModelConfig(vocab_size=vocab, **PRESETS[preset])
    model = Transformer(cfg)
    model.init_weights(seed)
    return model, cfg


def model_loss(model: nn.Module, batch: dict[str, Tensor], autocast: torch.dtype | None = None,
               loss_chunk: int | None = None) -> tuple[float, Tensor]:
    """(loss, all gradients flattened in fp32 on the CPU) of one packed row; ``loss_chunk`` None: whole logits
    and ``xprep.train.loss.token_ce``, as the trainer computes it without --loss-chunk."""
    model.zero_grad(set_to_none=True)
    device_type = batch["input_ids"].device.type
    ctx = torch.autocast(device_type, dtype=autocast) if autocast else contextlib.nullcontext()
    args = (batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    with ctx:
        if loss_chunk is None:
            ce = token_ce(model(*args), batch["labels"])
        else:
            ce = model(*args, labels=batch["labels"], loss_chunk=loss_chunk)
    loss = ce.sum() / targets(batch)
    loss.backward()
    grads = torch.cat([p.grad.detach().float().flatten().cpu() for p in model.parameters()])
    return float(loss.detach()), grads


def compare_model(report: Report, name: str, got: tuple[float, Tensor], want: tuple[float, Tensor],
                  loss_tol: float, grad_tol: float) -> None:
    loss_err = abs(got[0] - want[0]) / abs(want[0])
    grad_err = rel_error(got[1], want[1])
    report.below(f"{name}: loss", loss_err, loss_tol, f"rel {loss_err:.2e} ({got[0]:.6f} vs {want[0]:.6f})")
    report.below(f"{name}: gradients", grad_err, grad_tol, f"rel {grad_err:.2e} over {want[1].numel():,} values")


# ----------------------------------------------------------------------------------------------- env
def part_env(b: Bench) -> None:
    r, device = b.report, b.device
    r.note("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    if b.cuda:
        props = torch.cuda.get_device_properties(device)
        capability = torch.cuda.get_device_capability(device)
        r.note("device", f"{device}: {torch.cuda.get_device_name(device)}")
        r.note("compute capability", f"{capability[0]}.{capability[1]}, {props.multi_processor_count} SMs, "
                                     f"{props.total_memory / 2**30:.1f} GiB")
        is_mig = getattr(flops, "is_mig", None)
        r.note("MIG slice", "unknown (xprep.train.flops has no is_mig)" if is_mig is None else
               ("yes" if is_mig(device) else "no"))
    else:
        capability = None
        r.note("device", f"{device} (no CUDA: capability, MIG and peak FLOPS do not apply)")
    r.note("peak bf16", _peak_line(device, "bf16"))
    r.note("peak fp32", _peak_line(device, "fp32"))  # with TF32, as xtrain runs fp32 unless --no-tf32
    signature = getattr(attention, "varlen_signature", None)
    if signature is None:
        r.note("varlen_attn signature", "unknown (xprep.train.attention has no varlen_signature)")
    else:
        keywords = signature()
        r.note("varlen_attn signature", "none: this torch has no torch.nn.attention.varlen" if keywords is None
               else "(q, k, v, cu_q, cu_k, max_q, max_k, " + ", ".join(keywords) + ")")
    version = getattr(attention, "FLASH_ATTN_VERSION", None)
    if version is None and attention.flash_attn_varlen_func is not None:
        version = "installed (version unknown)"
    r.note("flash-attn", version or "not installed")
    path_of = getattr(attention, "attention_path", None)
    head_dim = ModelConfig(vocab_size=2, **PRESETS[b.sizes.bench_model]).head_dim
    paths = {}
    for label, dtype, context_parallel in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                           ("bf16, cp > 1", torch.bfloat16, True)):
        try:
            paths[label] = "unknown" if path_of is None else path_of(device, dtype, head_dim, context_parallel)
        except Exception as e:  # an XprepError saying why the path is refused is the figure here
            paths[label] = f"refused: {e}"
        r.note(f"attention path {label}", f"{paths[label]} (head dim {head_dim})")
    if capability is not None and capability >= (8, 0):
        varlen = (getattr(attention, "FLASH_VARLEN", "flash-attn varlen"), getattr(attention, "TORCH_VARLEN",
                                                                                   "varlen (torch)"))
        r.check("bf16 takes a varlen kernel", paths["bf16"] in varlen, paths["bf16"], "one call")


def _peak_line(device: torch.device, precision: str) -> str:
    try:
        peak, line = flops.resolve_peak_tflops(device, None, precision=precision, tf32=True)
    except TypeError:  # a xprep.train.flops without per-precision peaks: bf16 only
        peak, line = flops.resolve_peak_tflops(device)
    return line


# ----------------------------------------------------------------------------------------------- kernels
def part_kernels(b: Bench) -> None:
    s = b.sizes
    lengths = doc_lengths(s.kernel_tokens, seed=1)
    bounds = bounds_of(lengths)
    cu = torch.tensor(bounds, dtype=torch.int32, device=b.device)
    longest = max(lengths)
    b.report.note("inputs", f"{s.kernel_tokens} tokens in {len(lengths)} documents (longest {longest}), "
                            f"{s.heads} heads / {s.kv_heads} KV heads of {s.head_dim}")
    path = getattr(attention, "attention_path", None)
    for dtype in (torch.bfloat16, torch.float32):
        name = f"varlen_attention {_dtype_name(dtype)}"
        b.report.note(f"{name} path", "unknown" if path is None else path(b.device, dtype, s.head_dim))
        b.report.attempt(name, check_kernel, b, name, dtype, bounds,
                         lambda q, k, v: attention.varlen_attention(q, k, v, cu, longest, bounds=bounds))
    torch_varlen = getattr(attention, "_torch_varlen_kernel", None)
    if not (b.cuda and attention.varlen_attn is not None and torch_varlen is not None):
        b.report.skip("torch varlen_attn bf16", "needs CUDA and torch.nn.attention.varlen")
    else:
        name = "torch varlen_attn bf16"
        b.report.attempt(name, check_kernel, b, name, torch.bfloat16, bounds,
                         lambda q, k, v: torch_varlen(q, k, v, cu, cu, longest, longest, None))
    if not (b.cuda and attention.flash_attn_varlen_func is not None):
        b.report.skip("flash-attn bf16", "needs CUDA and flash-attn installed")
    else:
        name = "flash-attn bf16"
        b.report.attempt(name, check_kernel, b, name, torch.bfloat16, bounds,
                         lambda q, k, v: attention.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                                          causal=True))
    for dtype in (torch.bfloat16, torch.float32):
        name = f"flex {_dtype_name(dtype)}"
        b.report.attempt(name, check_kernel, b, name, dtype, bounds,
                         lambda q, k, v: attention.flex_document_attention(q, k, v, bounds), b.cuda)
    for size in (2, 4):
        for dtype in (torch.bfloat16, torch.float32):
            b.report.attempt(f"cp{size} {_dtype_name(dtype)}", check_cp, b, size, dtype, lengths)
            b.report.attempt(f"ring{size} {_dtype_name(dtype)}", check_ring, b, size, dtype, lengths)
    for total in s.mask_tokens:
        b.report.attempt(f"block mask T={total // 1024}k", check_block_mask, b, total)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def _qkv(b: Bench, total: int, dtype: torch.dtype, seed: int) -> tuple[list[Tensor], Tensor]:
    """q (T, H, D), k, v (T, Hkv, D) rounded to ``dtype`` (on the device, leaves), and a weight on the output
    that makes the backward's incoming gradient non-uniform."""
    g = torch.Generator().manual_seed(seed)
    s = b.sizes
    qkv = [torch.randn(total, h, s.head_dim, generator=g).to(b.device, dtype).requires_grad_()
           for h in (s.heads, s.kv_heads, s.kv_heads)]
    return qkv, torch.randn(total, s.heads, s.head_dim, generator=g).to(b.device)


def _reference(qkv: list[Tensor], weight: Tensor, bounds: list[int]) -> tuple[Tensor, list[Tensor]]:
    """SDPA per document in float64 on the same (rounded) inputs: output and dq, dk, dv of (out · weight).sum()."""
    leaves = [t.detach().double().requires_grad_() for t in qkv]
    out = attention.sdpa_per_document(*leaves, bounds)
    grads = torch.autograd.grad((out * weight.double()).sum(), leaves)
    return out.detach(), list(grads)


def _tolerance(dtype: torch.dtype) -> float:
    return BF16_TOL if dtype == torch.bfloat16 else FP32_TOL


def check_kernel(b: Bench, name: str, dtype: torch.dtype, bounds: list[int], fn: Callable, backward: bool = True
                 ) -> None:
    """``fn(q, k, v)`` over the packed documents against the float64 reference, forward then backward."""
    qkv, weight = _qkv(b, bounds[-1], dtype, seed=2)
    ref_out, ref_grads = _reference(qkv, weight, bounds)
    tol = _tolerance(dtype)
    if not backward:  # FlexAttention on the CPU: eager, forward only (it warns that it is unfused: known)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = fn(*(t.detach() for t in qkv))
        b.report.below(f"{name} forward", rel_error(out, ref_out), tol)
        b.report.skip(f"{name} backward", f"no backward on {b.device.type}")
        return
    out = fn(*qkv)
    grads = torch.autograd.grad((out.float() * weight).sum(), qkv)
    b.report.below(f"{name} forward", rel_error(out, ref_out), tol)
    _check_grads(b.report, f"{name} backward", grads, ref_grads, tol)


def _check_grads(report: Report, name: str, grads, ref_grads, tol: float) -> None:
    errors = [rel_error(g, w) for g, w in zip(grads, ref_grads, strict=True)]
    figure = " ".join(f"{n} {e:.2e}" for n, e in zip(("dq", "dk", "dv"), errors, strict=True))
    report.below(name, max(errors), tol, figure)


def check_cp(b: Bench, size: int, dtype: torch.dtype, lengths: list[int]) -> None:
    """Context parallelism over ``size`` ranks simulated in one process: each rank's zigzag query pieces over
    the whole sequence's keys (``xprep.train.cp.piece_attention``, what ``CPContext.attention`` runs after its
    all-gather), the outputs put back in global order, and the ranks' losses summed before one backward
    (the all-gather's backward sums each rank's K/V gradients the same way)."""
    cu_padded, _, _ = cp.pad_documents(torch.tensor(bounds_of(lengths), dtype=torch.int32), size)
    bounds = cu_padded.tolist()  # the padded documents are the units the ranks split
    qkv, weight = _qkv(b, bounds[-1], dtype, seed=3)
    ref_out, ref_grads = _reference(qkv, weight, bounds)
    q, k, v = qkv
    out = torch.zeros_like(ref_out)
    loss = 0.0
    for rank in range(size):
        pieces = cp.local_pieces(bounds, bounds, rank, size)
        rows = torch.cat([torch.arange(start, end) for start, end, _ in pieces]).to(b.device)
        local = cp.piece_attention(q.index_select(0, rows), k, v, pieces)
        out[rows] = local.detach().double()
        loss = loss + (local.float() * weight[rows]).sum()
    grads = torch.autograd.grad(loss, qkv)
    tol, name = _tolerance(dtype), f"cp{size} {_dtype_name(dtype)}"
    b.report.below(f"{name} forward", rel_error(out, ref_out), tol)
    _check_grads(b.report, f"{name} backward", grads, ref_grads, tol)


def check_ring(b: Bench, size: int, dtype: torch.dtype, lengths: list[int]) -> None:
    """Ring attention over ``size`` zigzag ranks simulated in one process (``xprep.train.ring.simulated_ring``: each
    rank's blocks in ring order through the kernel the device takes, merged by log-sum-exp; the backward given
    the merged output and log-sum-exp), against the float64 reference; the kernel used is noted."""
    cu_padded, _, _ = cp.pad_documents(torch.tensor(bounds_of(lengths), dtype=torch.int32), size)
    bounds = cu_padded.tolist()
    qkv, weight = _qkv(b, bounds[-1], dtype, seed=4)
    ref_out, ref_grads = _reference(qkv, weight, bounds)
    q, k, v = (t.detach() for t in qkv)
    sets = list(cp.zigzag_permutation(cu_padded, size).numpy())
    out, *grads = ring.simulated_ring(q, k, v, weight.to(dtype), sets, cu_padded.numpy())
    tol, name = _tolerance(dtype), f"ring{size} {_dtype_name(dtype)}"
    b.report.note(f"{name} kernel", type(ring.block_kernel(q)).__name__)
    b.report.below(f"{name} forward", rel_error(out, ref_out), tol)
    _check_grads(b.report, f"{name} backward", grads, ref_grads, tol)


def check_block_mask(b: Bench, total: int) -> None:
    """FlexAttention's document block mask for ``total`` tokens: the bytes of its tensors, of the largest tensor
    made while building it and (CUDA) the peak allocated meanwhile, each under T²/64 bytes."""
    bounds = bounds_of(doc_lengths(total, seed=4))
    build = getattr(attention, "document_block_mask", None)
    if build is None:  # a xprep.train.attention that only has the cached builder
        build = lambda bounds, device: attention._document_block_mask(tuple(bounds), device)  # noqa: E731
    bound = total * total // 64
    shown = f"< {_size(bound)}"
    if b.cuda:
        b.sync()
        torch.cuda.reset_peak_memory_stats(b.device)
        base = torch.cuda.memory_allocated(b.device)
    t0 = time.perf_counter()
    with LargestTensor() as largest:
        mask = build(bounds, b.device)
    b.sync()
    seconds = time.perf_counter() - t0
    stored = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, Tensor))
    name = f"block mask T={total // 1024}k"
    b.report.below(f"{name}: its tensors", stored, bound,
                   f"{_size(stored)} ({len(bounds) - 1} docs, built in {seconds * 1e3:.0f} ms)", shown)
    b.report.below(f"{name}: largest made building it", largest.bytes, bound, _size(largest.bytes), shown)
    if b.cuda:
        peak = torch.cuda.max_memory_allocated(b.device) - base
        b.report.below(f"{name}: peak while built", peak, bound, _size(peak), shown)


class LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any operation makes inside the block (on any device)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def _size(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


# ----------------------------------------------------------------------------------------------- model
def part_model(b: Bench) -> None:
    s, r = b.sizes, b.report
    model, cfg = build_model(s.model, s.model_vocab, seed=0)
    lengths = doc_lengths(s.model_tokens, seed=5)
    r.note("model", f"'{s.model}' ({_count(cfg.num_params())} parameters, vocab {cfg.vocab_size:,}), "
                    f"{s.model_tokens} tokens in {len(lengths)} documents")
    with ieee_fp32():
        cpu_batch = packed_row(lengths, cfg.vocab_size, torch.device("cpu"), seed=6)
        batch = packed_row(lengths, cfg.vocab_size, b.device, seed=6)
        if b.cuda:
            reference = model_loss(model, cpu_batch)
            model = model.to(b.device)
            fp32 = model_loss(model, batch)
            compare_model(r, "cuda fp32 = cpu fp32", fp32, reference, FP32_TOL, FP32_TOL)
        else:
            fp32 = model_loss(model, batch)
            r.skip("cuda fp32 = cpu fp32", "no CUDA device: the comparison needs one")
        r.attempt("bf16 = fp32", lambda: compare_model(r, "bf16 = fp32", model_loss(
            model, batch, autocast=torch.bfloat16), fp32, BF16_LOSS_TOL, BF16_GRAD_TOL))
        chunk = s.model_tokens // 3 + 1  # a last chunk shorter than the others
        name = f"loss_chunk {chunk} = whole logits"
        r.attempt(name, lambda: compare_model(r, name, model_loss(model, batch, loss_chunk=chunk), fp32, FP32_TOL,
                                              FP32_TOL))
        r.attempt("compiled = eager", check_compiled, b, model, cfg)


def check_compiled(b: Bench, model: nn.Module, cfg: ModelConfig) -> None:
    """Compiled blocks against the eager model over 3 document layouts of the same length; no recompilation
    after the first layout (the layout lives outside the graphs: attention is not traced)."""
    torch.compiler.reset()
    compiled = copy.deepcopy(model)
    tdist.apply_compile(compiled, b.compile_backend)
    loss_err = grad_err = 0.0
    frames = None
    for layout in range(3):
        batch = packed_row(doc_lengths(b.sizes.model_tokens, seed=10 + layout), cfg.vocab_size, b.device, seed=layout)
        got, want = model_loss(compiled, batch), model_loss(model, batch)
        loss_err = max(loss_err, abs(got[0] - want[0]) / abs(want[0]))
        grad_err = max(grad_err, rel_error(got[1], want[1]))
        if frames is None:
            frames = dynamo_frames()
    name = f"compiled = eager ({b.compile_backend})"
    b.report.below(f"{name}: loss", loss_err, FP32_TOL, f"rel {loss_err:.2e} (worst of 3 layouts)")
    b.report.below(f"{name}: gradients", grad_err, FP32_TOL, f"rel {grad_err:.2e} (worst of 3 layouts)")
    recompiles = dynamo_frames() - frames
    b.report.check("compiled: no recompiles", frames > 0 and recompiles == 0,
                   f"{frames} frames compiled at layout 1, {recompiles} more at layouts 2-3", "0 more")


# ----------------------------------------------------------------------------------------------- fsdp1
def part_fsdp1(b: Bench) -> None:
    """FSDP2 on a 1-rank group, one step, DCP save, load into a fresh meta model: bit-equal state."""
    s, r = b.sizes, b.report
    backend = "nccl" if b.cuda else "gloo"
    store_dir = Path(tempfile.mkdtemp(dir=b.workdir))
    if b.cuda:
        torch.cuda.set_device(b.device)
    dist.init_process_group(backend, store=dist.FileStore(str(store_dir / "store"), 1), rank=0, world_size=1,
                            **({"device_id": b.device} if b.cuda else {}))
    try:
        mesh = init_device_mesh(b.device.type, (1,))
        param_dtype = torch.bfloat16 if b.cuda else torch.float32
        section = ModelSection(name=s.model)
        model, _, initial = section.build_meta(s.model_vocab, seed=0)
        tdist.apply_fsdp(model, mesh, True, param_dtype)
        tdist.materialize(model, b.device, initial)
        optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
        batch = packed_row(doc_lengths(s.model_tokens, seed=7), s.model_vocab, b.device, seed=7)
        ce = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"])
        loss = ce.sum() / targets(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        r.note("step", f"'{s.model}' under FSDP2 on 1 {backend} rank ({_dtype_name(param_dtype)} compute), "
                       f"loss {loss.detach().item():.4f}, {type(optimizer).__name__}"
                       f"{' fused' if optimizer.defaults.get('fused') else ''}")
        checkpoint = store_dir / "checkpoint"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        t0 = time.perf_counter()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
        saved = time.perf_counter() - t0

        fresh, _, _ = section.build_meta(s.model_vocab, seed=1)
        tdist.apply_fsdp(fresh, mesh, True, param_dtype)
        fresh.to_empty(device=b.device)
        with torch.no_grad():
            for p in fresh.parameters():
                p.fill_(float("nan"))  # every value must come from the checkpoint
        fresh_optimizer = build_optimizer(fresh, 1e-3, 0.1, (0.9, 0.95))
        model_sd2, optim_sd2 = get_state_dict(fresh, fresh_optimizer)
        loaded = {"model": model_sd2, "optim": optim_sd2}
        dcp.load(loaded, checkpoint_id=checkpoint)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        r.note("DCP", f"saved in {saved:.2f} s to {sum(f.stat().st_size for f in checkpoint.iterdir()) / 2**20:,.1f} "
                      "MiB, loaded into a fresh meta model filled with NaN")
        want_model, want_optim = get_state_dict(model, optimizer)
        got_model, got_optim = get_state_dict(fresh, fresh_optimizer)
        for name, got, want in (("model state", got_model, want_model), ("optimizer state", got_optim, want_optim)):
            differ, count, size = bit_compare(got, want)
            figure = (f"{count} tensors ({_size(size)}) equal" if not differ
                      else f"{len(differ)} of {count} differ, e.g. {differ[0]}")
            r.check(f"DCP load = save: {name}", not differ, figure, "bit-equal")
    finally:
        dist.destroy_process_group()


def bit_compare(got, want, prefix: str = "") -> tuple[list[str], int, int]:
    """(names of the leaves that differ, tensors compared, their bytes) of two nested state dicts."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [prefix or "<root>"], 0, 0
        parts = [bit_compare(got[k], want[k], f"{prefix}.{k}" if prefix else str(k)) for k in want]
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [prefix], 0, 0
        parts = [bit_compare(g, w, f"{prefix}[{i}]") for i, (g, w) in enumerate(zip(got, want, strict=True))]
    elif isinstance(want, Tensor):
        a, w = tdist.full_tensor(got).detach().cpu(), tdist.full_tensor(want).detach().cpu()
        same = a.dtype == w.dtype and a.shape == w.shape and torch.equal(_bytes(a), _bytes(w))
        return ([] if same else [prefix]), 1, w.numel() * w.element_size()
    else:
        return ([] if got == want else [prefix]), 0, 0
    return [n for p in parts for n in p[0]], sum(p[1] for p in parts), sum(p[2] for p in parts)


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().flatten().view(torch.uint8)


# ----------------------------------------------------------------------------------------------- throughput
def part_throughput(b: Bench) -> None:
    s, r = b.sizes, b.report
    cfg = ModelConfig(vocab_size=s.bench_vocab, **PRESETS[s.bench_model])
    lengths = doc_lengths(s.bench_tokens, seed=8)
    pairs = flops.causal_pairs(lengths)
    dtype = torch.bfloat16 if b.cuda else torch.float32
    chunk = auto_loss_chunk(s.bench_tokens, cfg.vocab_size)
    peak, peak_line = flops.resolve_peak_tflops(b.device)
    model_flops = flops.ModelFlops.of(cfg)
    r.note("setup", f"'{s.bench_model}' ({_count(cfg.num_params())} parameters, vocab {cfg.vocab_size:,}), "
                    f"{s.bench_tokens} tokens in {len(lengths)} documents, {_dtype_name(dtype)}, "
                    f"loss chunk {chunk or 'none'}, {s.warmup} warm-up + {s.steps} timed steps")
    r.note("peak", peak_line)
    for compiled, checkpointed in ((False, False), (True, False), (False, True), (True, True)):
        name = f"{'compiled' if compiled else 'eager'}{', AC' if checkpointed else ''}"
        r.attempt(name, measure_variant, b, name, cfg, lengths, dtype, chunk, compiled, checkpointed,
                  (model_flops, peak, pairs))
        gc.collect()  # the last variant's model and optimizer, before the next one is built
        if b.cuda:
            torch.cuda.empty_cache()


def measure_variant(b: Bench, name: str, cfg: ModelConfig, lengths: list[int], dtype: torch.dtype, chunk: int,
                    compiled: bool, checkpointed: bool, counts: tuple) -> None:
    """One line of figures for a variant; for the compiled one without AC, the targets."""
    model_flops, peak, pairs = counts
    seconds, memory = time_steps(b, cfg, lengths, dtype, chunk, compiled, checkpointed)
    tokens = sum(lengths)
    rates = _rates(model_flops, peak, tokens, tokens, pairs, seconds)
    line = (f"{tokens / seconds:,.0f} tokens/s, {rates['tflops']} TFLOPS (6N: {rates['tflops_6n']}), "
            f"mfu {_pct(rates['mfu'])}, mfu_6n {_pct(rates['mfu_6n'])}")
    b.report.note(name, line + (f", peak memory {memory / 2**30:,.2f} GiB" if b.cuda else ""))
    if compiled and not checkpointed:
        _check_targets(b, rates["mfu_6n"], memory)


def time_steps(b: Bench, cfg: ModelConfig, lengths: list[int], dtype: torch.dtype, chunk: int, compiled: bool,
               checkpointed: bool) -> tuple[float, int]:
    """(seconds per training step, peak bytes allocated: CUDA only) of the trainer's one-process step: forward
    under autocast, token-normalized loss, backward, clipping, AdamW, over one packed row."""
    if compiled:
        torch.compiler.reset()
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=b.device)
    with torch.no_grad():  # values do not change the time: a quick init on the device
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.init_std)
    if compiled:
        tdist.apply_compile(model, b.compile_backend)
    if checkpointed:
        tdist.apply_activation_checkpointing(model)
    optimizer = build_optimizer(model, 1e-4, 0.1, (0.9, 0.95))
    batch = packed_row(lengths, cfg.vocab_size, b.device, seed=9)
    n = targets(batch)

    def step() -> None:
        with torch.autocast(b.device.type, dtype=dtype, enabled=dtype != torch.float32):
            ce = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], labels=batch["labels"],
                       loss_chunk=chunk, max_seqlen=max(lengths))
        (ce.sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if b.cuda:
        b.sync()
        torch.cuda.reset_peak_memory_stats(b.device)
    for _ in range(b.sizes.warmup):
        step()
    b.sync()
    t0 = time.perf_counter()
    for _ in range(b.sizes.steps):
        step()
    b.sync()
    seconds = (time.perf_counter() - t0) / b.sizes.steps
    return seconds, torch.cuda.max_memory_allocated(b.device) if b.cuda else 0


def _rates(model_flops, peak: float | None, seq_len: int, tokens: int, pairs: int, seconds: float) -> dict:
    """TFLOPS and both MFUs of a step, from ``xprep.train.flops.Throughput`` (its ``mfu_6n`` where it has one)."""
    try:
        measured = flops.Throughput(model_flops, peak, 1, seq_len=seq_len).measure(tokens, pairs, seconds)
    except TypeError:  # a Throughput without the 6N convention: (tflops, mfu)
        measured = flops.Throughput(model_flops, peak, 1).measure(tokens, pairs, seconds)
    tflops, mfu = measured[0], measured[1]
    per_token_6n = getattr(model_flops, "per_token_6n", None)
    tflops_6n = None if per_token_6n is None else per_token_6n(seq_len) * tokens / seconds / 1e12
    return {"tflops": "n/a" if tflops is None else f"{tflops:,.3g}", "mfu": mfu,
            "mfu_6n": getattr(measured, "mfu_6n", None),
            "tflops_6n": "n/a" if tflops_6n is None else f"{tflops_6n:,.3g}"}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _check_targets(b: Bench, mfu_6n: float | None, memory: int) -> None:
    """Issue 30's targets for the compiled, no-AC run: checked on an H100/H200, their ratios printed elsewhere."""
    r = b.report
    name = torch.cuda.get_device_name(b.device) if b.cuda else b.device.type
    target_gpu = b.cuda and any(g in name for g in TARGET_GPUS) and b.sizes.bench_model == "1b"
    if mfu_6n is None:
        r.skip("mfu_6n target (compiled, no AC)", "no peak FLOPS for this device: MFU not measured")
    elif target_gpu:
        r.check("mfu_6n target (compiled, no AC)", mfu_6n >= MFU_6N_TARGET,
                f"{_pct(mfu_6n)} = {mfu_6n / MFU_6N_TARGET:.2f}× the target", f">= {_pct(MFU_6N_TARGET)}")
    else:
        r.note("mfu_6n target (compiled, no AC)", f"{_pct(mfu_6n)} = {mfu_6n / MFU_6N_TARGET:.2f}× the "
                                                  f"{_pct(MFU_6N_TARGET)} expected of an H100/H200 (not checked here)")
    if target_gpu:
        r.check("peak memory (compiled, no AC)", memory < PEAK_MEMORY_TARGET,
                f"{memory / 2**30:,.1f} GiB = {memory / PEAK_MEMORY_TARGET:.2f}× 80 GiB", "< 80 GiB")


# ----------------------------------------------------------------------------------------------- resilience
SAVE_EVERY = 4
SIGNAL_AT_ROW = 5  # SIGTERM once step 5 is logged: step 4's asynchronous save may still be in flight
INIT_STEPS, BAD_STEP = 4, 3  # the --init-from run's length, and the step whose gradients are made non-finite
# A resumed run reloads the fp32 weights and optimizer state bit for bit (DCP: the fsdp1 part) and trains on the
# same batches at the same lr (checked exactly), so in bf16 on CUDA its losses part from the uninterrupted run's
# only where a kernel is not deterministic: flash/varlen attention's backward accumulates dq with atomics, so two
# runs' gradients differ by bf16 roundings (2^-8 = 4e-3 relative, per value) from the first step on, and their
# weights by fractions of AdamW's lr-sized updates: a loss should move by less than one bf16 rounding; 1e-2 leaves
# room for that (not measured on a GPU yet). On the CPU, in fp32, bit-equal.
RESUME_LOSS_TOL = 1e-2
# The first loss of an --init-from run and the checkpoint's weights evaluated here: the same forward kernels on the
# same inputs. Bit-equal on the CPU; on CUDA another process may pick other matmul algorithms (bf16 roundings).
INIT_LOSS_TOL = 1e-3


def part_resilience(b: Bench) -> None:
    """Issue 31's paths through ``xtrain run`` in child processes on the device: a SIGTERM from this process with
    --async-save, the same command resuming, --save-hf = export, a non-finite gradient skipped, --init-from."""
    s, r = b.sizes, b.report
    root = b.workdir / "resilience"
    root.mkdir()
    packed = tinyrun.tiny_pack(root, s.model_vocab, s.run_tokens)
    batch = ["--model", s.model, "--micro-batch-size", "2", "--global-batch-size", "2"]
    common = [str(packed), *batch, "--steps", str(s.run_steps), "--sampler", "random", "--seed", "5", "--lr", "2e-3",
              "--log-every", "100", "--async-save", "--save-every", str(SAVE_EVERY), "--save-hf"]
    ref, cut, init = root / "reference", root / "interrupted", root / "init-from"
    t0 = time.perf_counter()
    with tinyrun.Xtrain(b.device.type) as xtrain:
        reference, first = xtrain.start(ref, common), xtrain.start(cut, common)  # side by side
        rows = tinyrun.signal_after_rows(first, cut, SIGNAL_AT_ROW, signal.SIGTERM)
        stopped, ref_status = tinyrun.wait(first), tinyrun.wait(reference)
        r.note("runs", f"'{s.model}', {s.run_steps} steps of 2 bins of {s.run_tokens} tokens: {_layout(ref)}; "
                       f"{time.perf_counter() - t0:.1f} s side by side")
        if not r.check("uninterrupted run: exit status", ref_status == 0, f"exit {ref_status}", "0"):
            _explain(ref)
        r.attempt("SIGTERM", check_stopped, r, cut, stopped, rows)
        stop_step = (tinyrun.metrics(cut) or [{"step": 0}])[-1]["step"]
        resumed = xtrain.start(cut, common)  # the same command
        started = xtrain.start(init, [str(packed), *batch, "--steps", str(INIT_STEPS), "--log-every", "1",
                                      "--init-from", str(ref), "--inject-nonfinite", f"grad:0:{BAD_STEP}"])
        r.attempt("--save-hf", check_save_hf, r, ref, s.run_steps, root / "export")  # while those two run
        r.attempt("transformers", check_transformers, b, ref / "hf" / "latest", packed)
        resumed_status, init_status = tinyrun.wait(resumed), tinyrun.wait(started)
    r.attempt("resumed", check_resumed, b, ref, cut, resumed_status, stop_step)
    r.attempt("non-finite gradient", check_bad_step, r, init, init_status)
    r.attempt("--init-from", check_init, b, init, ref, packed)


def _layout(run_dir: Path) -> str:
    """The device, precision and attention of a run, from its start line ("1 DP, cuda, bf16, attention: ...")."""
    for line in tinyrun.stderr_lines(run_dir):
        if " → " in line and "; " in line:
            return line.rsplit(" → ", 1)[0].rsplit("; ", 1)[-1].rstrip(")")
    return "no start line"


def _explain(run_dir: Path, lines: int = 15) -> None:
    """The end of a run's stderr, on this process's stderr (where a failed check's traceback goes)."""
    print(f"--- {run_dir}.err, last {lines} lines:", *tinyrun.stderr_lines(run_dir)[-lines:], sep="\n", file=sys.stderr)


def check_stopped(r: Report, run_dir: Path, status: int, rows: int) -> None:
    """Exit 143, ``latest`` naming a complete checkpoint of the last step logged, the last stderr line naming it."""
    step = (tinyrun.metrics(run_dir) or [{"step": 0}])[-1]["step"]
    sent = f"sent at row {rows}" if rows else f"not sent: the run ended before row {SIGNAL_AT_ROW}"
    ok = r.check("SIGTERM: exit status", status == 143, f"exit {status} (SIGTERM {sent})", "143")
    latest, note = find_latest(run_dir / "checkpoints")
    ok &= r.check("SIGTERM: latest = the step reached", latest is not None and latest.name == f"step-{step}"
                  and note is None and step >= SIGNAL_AT_ROW, f"{latest.name if latest else 'none'}, last row step "
                  f"{step}{'; ' + note if note else ''}", "same, complete")
    last = (tinyrun.stderr_lines(run_dir) or [""])[-1]
    ok &= r.check("SIGTERM: last stderr line names it", "SIGTERM" in last and f"step-{step} " in last,
                  repr(last[:60]), f"step-{step}")
    if not ok:
        _explain(run_dir)


def check_save_hf(r: Report, ref: Path, step: int, out: Path) -> None:
    """RUN/hf/step-N (gathered from the device by the run) = `xtrain export` of step-N (DCP read on the CPU here)."""
    from safetensors.torch import load_file  # deferred: as in xprep.train.hf_weights, only this check reads safetensors

    exported = export_run(ref, step, out)
    saved = load_file(ref / "hf" / f"step-{step}" / "model.safetensors")
    want = load_file(exported / "model.safetensors")
    differ, count, size = bit_compare(saved, want)
    r.check("--save-hf (device) = export (CPU)", not differ, f"{count} tensors ({_size(size)}) equal" if not differ
            else f"{len(differ)} of {count} differ, e.g. {differ[0]}", "bit-equal")


def check_transformers(b: Bench, directory: Path, packed: Path) -> None:
    """transformers loads RUN/hf/latest and computes finite logits of the first bin on the device."""
    if importlib.util.find_spec("transformers") is None:
        b.report.skip("transformers: RUN/hf/latest", "transformers is not installed")
        return
    from transformers import AutoModelForCausalLM  # deferred: optional (the hf extra)

    model = AutoModelForCausalLM.from_pretrained(directory).to(b.device).eval()
    first = PackedDataset(packed)[0]
    with torch.no_grad():
        logits = model(input_ids=first["input_ids"].to(b.device), position_ids=first["position_ids"].to(b.device),
                       use_cache=False).logits
    finite = bool(torch.isfinite(logits).all())
    b.report.check("transformers: RUN/hf/latest logits", finite, f"{type(model).__name__}, {tuple(logits.shape)} "
                   f"{'finite' if finite else 'NOT finite'} on {b.device}", "finite")


def check_resumed(b: Bench, ref: Path, cut: Path, status: int, stop_step: int) -> None:
    """The same command resumes: exit 0, each step logged once, the uninterrupted run's batches, schedule, losses."""
    r, steps = b.report, b.sizes.run_steps
    said = [line for line in tinyrun.stderr_lines(cut) if f"resuming at step {stop_step}" in line]
    ok = r.check("resumed: exit status", status == 0 and bool(said),
                 f"exit {status}, " + (f"resumed at step {stop_step}" if said else "no resume said"), "0, resumed")
    got, want = tinyrun.metrics(cut), tinyrun.metrics(ref)
    logged = [row["step"] for row in got]
    ok &= r.check("resumed: each step once", logged == list(range(1, steps + 1)),
                  f"{len(logged)} rows, steps {_steps_text(logged)}", f"1..{steps} once")
    keys = ("tokens", "target_tokens", "consumed_samples", "lr")
    same = sum(all(g[k] == w[k] for k in keys) for g, w in zip(got, want, strict=False))
    ok &= r.check("resumed: same batches, lr", same == len(want) == len(got),
                  f"{same}/{len(want)} steps: tokens, targets, samples, lr", "all equal")
    pairs = [(g["loss"], w["loss"]) for g, w in zip(got, want, strict=False)]
    equal = sum(g == w for g, w in pairs)
    worst = max((abs(g - w) / abs(w) if g is not None and w is not None else math.inf for g, w in pairs),
                default=math.inf)
    figure = f"max rel {worst:.2e}, {equal}/{len(want)} bit-equal"
    if b.cuda:
        ok &= r.below("resumed = uninterrupted: losses", worst, RESUME_LOSS_TOL, figure)
    else:
        ok &= r.check("resumed = uninterrupted: losses", equal == len(want) == len(got), figure, "bit-equal")
    if not ok:
        _explain(cut)


def _steps_text(steps: list[int]) -> str:
    """1..16 for a run of consecutive steps, else each one."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ",".join(map(str, steps)) or "none"


def check_bad_step(r: Report, run_dir: Path, status: int) -> None:
    """--inject-nonfinite grad:0:3: step 3 and only it skipped, and the run ends well."""
    ok = r.check("init-from run: exit status", status == 0, f"exit {status}", "0")
    skipped = [row["step"] for row in tinyrun.metrics(run_dir) if row.get("skipped")]
    rows = len(tinyrun.metrics(run_dir))
    ok &= r.check(f"non-finite gradient at step {BAD_STEP}: skipped", skipped == [BAD_STEP] and rows == INIT_STEPS,
                  f"skipped: step {_steps_text(skipped)} of 1..{rows}", f"step {BAD_STEP} only")
    if not ok:
        _explain(run_dir)


def check_init(b: Bench, run_dir: Path, ref: Path, packed: Path) -> None:
    """--init-from REF: run.json's init names REF's last checkpoint, the run starts at step 1, and that step's loss
    is the checkpoint's weights evaluated here on the same batch."""
    r, source = b.report, ref / "checkpoints" / f"step-{b.sizes.run_steps}"
    record = json.loads((run_dir / "run.json").read_text()).get("init") or {}
    rows = tinyrun.metrics(run_dir)
    first = rows[0] if rows else {"step": None, "loss": math.nan}
    named = Path(record.get("path") or "?")
    r.check("--init-from: run.json init, step 1", named.resolve() == source.resolve() and first["step"] == 1,
            f"{record.get('from')} {named.name}, first row step {first['step']}",
            source.name)
    want = checkpoint_loss(b, source, packed)
    err = abs(first["loss"] - want) / abs(want)
    figure = f"{first['loss']:.6f} vs {want:.6f} (rel {err:.1e})"
    if b.cuda:
        r.below("--init-from: step-1 loss = checkpoint's", err, INIT_LOSS_TOL, figure)
    else:
        r.check("--init-from: step-1 loss = checkpoint's", first["loss"] == want, figure, "bit-equal")


def checkpoint_loss(b: Bench, checkpoint: Path, packed: Path) -> float:
    """The loss of a run's first step (sequential sampler, micro-batch 2) for the model weights of ``checkpoint``,
    read here with DCP and computed as the trainer does: Σ token CE / targets, in the precision auto picks."""
    cfg = ModelConfig(vocab_size=b.sizes.model_vocab, **PRESETS[b.sizes.model])
    model = model_from_checkpoint(checkpoint, cfg).to(b.device).eval()
    dataset = PackedDataset(packed)
    batch = collate([dataset[i] for i in BinSampler(len(dataset), 2).next_micro_batch()])
    dtype = tdist.param_dtype_for("auto", b.device.type)
    with torch.no_grad(), torch.autocast(b.device.type, dtype=dtype, enabled=dtype != torch.float32):
        ce = token_ce(model(batch["input_ids"].to(b.device), batch["position_ids"].to(b.device),
                            batch["cu_seqlens"]), batch["labels"].to(b.device))
    return float(ce.detach().double().sum() / (batch["labels"] != IGNORE).sum())


# ----------------------------------------------------------------------------------------------- main
RUNNERS: dict[str, Callable[[Bench], None]] = {"env": part_env, "kernels": part_kernels, "model": part_model,
                                               "fsdp1": part_fsdp1, "throughput": part_throughput,
                                               "resilience": part_resilience}


def resolve(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: no CUDA device (torch {torch.__version__}); run with --device cpu")
    return torch.device("cuda", 0) if choice == "cuda" else torch.device("cpu")


def run(parts: list[str], device: torch.device, compile_backend: str | None = None, stream=None) -> int:
    """Run ``parts`` on ``device``; print the lines; return the number of failed checks (a part that raises
    counts as one, and the others still run)."""
    cuda = device.type == "cuda"
    report = Report(stream)
    backend = compile_backend or ("inductor" if cuda else "aot_eager")
    if cuda:  # what xtrain sets before CUDA starts: the allocator's expandable segments; here TF32 off
        configure = getattr(tdist, "configure_device", None)
        if configure is not None:
            configure("cuda", tf32=False)
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as workdir:
        bench = Bench(device, CUDA_SIZES if cuda else CPU_SIZES, report, backend, Path(workdir))
        for part in parts:
            report.part = part
            t0 = time.perf_counter()
            try:
                RUNNERS[part](bench)
            except Exception as e:  # a part that breaks is a failure to report, not the end of the proof
                traceback.print_exc()
                report.check("ran to the end", False, _raised(e),
                             "runs")
            report.note("time", f"{time.perf_counter() - t0:.1f} s")
            if cuda:
                torch.cuda.empty_cache()
    report.part = "total"
    report.note("failures", str(report.failures))
    return report.failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"parts to run, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: CUDA when there is a GPU, else the CPU at small sizes")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the compiled checks (default: inductor on CUDA, aot_eager on CPU)")
    args = ap.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    device = resolve(args.device)
    torch.manual_seed(0)
    return run(args.parts or list(PARTS), device, args.compile_backend)


if __name__ == "__main__":
    failures = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(min(failures, 255))  # hard exit: gloo + DeviceMesh may abort at interpreter exit (FACTS.md)
