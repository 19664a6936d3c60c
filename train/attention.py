"""Document-masked (varlen) causal attention over packed sequences.

Every kernel here takes packed tokens `(T, H, D)` plus `cu_seqlens` (document boundaries) and
computes causal attention inside each document only, so nothing attends across a boundary.
Which path runs (`attention_path` names it; `varlen_kernel` and `varlen_attention` choose it):

- CUDA, fp16/bf16, compute capability >= 8.0 (the flash kernels need Ampere or later) and a head
  dim the flash kernels take (a multiple of 8, at most 256): one varlen call for the whole packed
  row, flash-attn's when it is installed, else torch's own (`torch.nn.attention.varlen.varlen_attn`,
  torch >= 2.10, called with only the keywords its installed signature has: `varlen_signature`).
  The context-parallel pieces (`train/cp.py`) go through the same call, each piece a query
  sequence over its key prefix (flash-attn >= 2.1: older ones align those top-left).
- CUDA otherwise (fp32, a pre-Ampere GPU, another head dim, no varlen kernel): FlexAttention with
  a document block mask built from the bounds at block granularity (compiled once per process; no
  T x T tensor, no host sync); head dims under 16, which its kernel refuses, run SDPA per document.
- CPU: one SDPA call per document (fastest there: 4k tokens in 10 documents, forward + backward,
  ~0.09 s against ~0.5 s for one call with a block-diagonal mask; FlexAttention has no CPU backward).
`lower_right_causal_attention` is the piece context parallelism needs: a query chunk that is
the tail of a longer key prefix. GQA (fewer K/V heads than query heads) works on every path.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from xprep.prep.errors import XprepError

try:  # optional CUDA kernel; absent on CPU machines
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn = flash_attn_func = flash_attn_varlen_func = None
try:  # torch's own flash varlen kernel (CUDA only; torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch
    varlen_attn = None

FLASH_ATTN_VERSION: str | None = getattr(flash_attn, "__version__", None)

# The paths, as attention_path names them.
FLASH_VARLEN = "flash-attn varlen"
TORCH_VARLEN = "varlen (torch)"
FLEX = "FlexAttention"
SDPA_PER_DOCUMENT = "SDPA per document"
SDPA_PER_PIECE = "SDPA per piece"  # context parallelism without a varlen kernel

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 and torch's varlen kernel: Ampere or later
_FLASH_MAX_HEAD_DIM = 256
_FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernel (tl.dot) refuses smaller head dims
_FLEX_BLOCK = 128  # FlexAttention's default sparse block size

# (q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out: causal attention of query sequence i (rows
# cu_q[i]:cu_q[i+1] of q) over key sequence i, aligned bottom-right when it is shorter than its keys.
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, "float | None"], Tensor]


# ----------------------------------------------------------------------------- which path


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None for any other device (the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def _flash_head_dim_ok(head_dim: int, capability: tuple[int, int]) -> bool:
    """Whether the flash kernels (flash-attn's, torch's varlen) take `head_dim`, forward and backward.

    A multiple of 8, at most 256; their backward at head dims 193..224 runs on sm80/sm90 (A100, H100) only.
    """
    if head_dim % 8 or head_dim > _FLASH_MAX_HEAD_DIM:
        return False
    return not (192 < head_dim <= 224 and capability not in ((8, 0), (9, 0)))


def _varlen_path(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """FLASH_VARLEN or TORCH_VARLEN when a one-call varlen kernel serves these inputs, else None."""
    capability = device_capability(device)
    if capability is None or dtype not in _FLASH_DTYPES or capability < _FLASH_MIN_CAPABILITY:
        return None
    if not _flash_head_dim_ok(head_dim, capability):
        return None
    if flash_attn_varlen_func is not None:
        return FLASH_VARLEN
    return TORCH_VARLEN if _torch_varlen_causal() is not None else None


def flex_serves(head_dim: int) -> bool:
    """Whether FlexAttention's CUDA kernel takes `head_dim`: at least 16, and whatever the installed
    torch's own check demands (older ones: a power of 2)."""
    return head_dim >= _FLEX_MIN_HEAD_DIM and _flex_accepts(head_dim)


@functools.cache
def _flex_accepts(head_dim: int) -> bool:
    try:
        from torch.nn.attention import flex_attention as flex  # deferred: FlexAttention is a CUDA-only path here
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return False
    check = getattr(flex, "_validate_embed_dim", None)
    if check is None:  # pragma: no cover - depends on the torch
        return True
    x = torch.empty(1, 1, 1, head_dim, device="meta")
    try:
        check(x, x, x)
    except ValueError:  # e.g. "NYI: Currently non power of 2 embedding dimension are not supported"
        return False
    return True


def attention_path(device: torch.device | str, dtype: torch.dtype, head_dim: int,
                   context_parallel: bool = False) -> str:
    """The attention path a forward takes for these inputs, named for a start line.

    One of FLASH_VARLEN, TORCH_VARLEN, FLEX, SDPA_PER_DOCUMENT, or with `context_parallel` (the
    pieces of `xprep.train.cp.piece_attention`) SDPA_PER_PIECE where no varlen kernel serves. Raises
    XprepError where the path would be wrong (flash-attn < 2.1 with context parallelism).
    """
    path = _varlen_path(device, dtype, head_dim)
    if path == FLASH_VARLEN and context_parallel:
        check_flash_attn_lower_right()
    if path is not None:
        return path
    if context_parallel:
        return SDPA_PER_PIECE
    if device_capability(device) is not None and flex_serves(head_dim):
        return FLEX
    return SDPA_PER_DOCUMENT


def check_head_dim(head_dim: int, device_type: str) -> str:
    """Check a model's head dimension (dim / n_heads) against the attention kernels of `device_type`.

    Every head dim has a path that serves it (SDPA per document takes any), so a head dim a faster
    kernel refuses is routed, not a failure in the middle of a forward. Returns "" when every kernel
    of the device takes it, else one line for the start of a run: which kernels refuse it, the path
    taken instead, and what to set in the model JSON. Raises XprepError for a head dim no path
    takes (not a positive even integer: RoPE rotates pairs).
    """
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise XprepError(f"model config: head dim dim/n_heads={head_dim!r} must be a positive even integer "
                         "(RoPE rotates pairs of channels): change dim or n_heads in the model JSON")
    if device_type != "cuda":
        return ""
    if 192 < head_dim <= 224:
        return (f"head dim {head_dim} (dim/n_heads): the flash/varlen kernels' backward takes it on sm80/sm90 "
                f"(A100, H100) only, {FLEX} serves it on other GPUs; a head dim of at most 192 or exactly 256 "
                "in the model JSON keeps the varlen kernels everywhere")
    flash_ok, flex_ok = not (head_dim % 8 or head_dim > _FLASH_MAX_HEAD_DIM), flex_serves(head_dim)
    if flash_ok and flex_ok:
        return ""
    refused = [] if flash_ok else [f"the flash/varlen kernels (a multiple of 8, at most {_FLASH_MAX_HEAD_DIM})"]
    if not flex_ok:
        need = f"at least {_FLEX_MIN_HEAD_DIM}" if head_dim < _FLEX_MIN_HEAD_DIM else "a power of 2 in this torch"
        refused.append(f"{FLEX} ({need}" + (", the path of fp32 and pre-Ampere GPUs)" if flash_ok else ")"))
    instead = FLEX if flex_ok else f"{SDPA_PER_DOCUMENT} (one call per document: slower)"
    return (f"head dim {head_dim} (dim/n_heads) is refused by {' and '.join(refused)}; {instead} serves it"
            f"{' there' if flash_ok else ''}. For the fastest kernels make dim/n_heads a multiple of 8 from 16 "
            "to 256 (e.g. 64 or 128) in the model JSON")


# ----------------------------------------------------------------------------- varlen kernels


def _flash_attn_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=scale)


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def check_flash_attn_lower_right() -> None:
    """Refuse flash-attn < 2.1 where a query sequence is shorter than its keys (context parallelism).

    Before 2.1 flash-attn aligns the causal mask of such a sequence top-left: query i sees keys 0..i
    instead of 0..Lk-Lq+i, so every context-parallel piece but the first of a document would attend
    to the wrong keys. Square sequences (the whole-row varlen call without CP) are the same either
    way, so they keep using it.
    """
    if flash_attn_varlen_func is None or FLASH_ATTN_VERSION is None:
        return
    if _version(FLASH_ATTN_VERSION) < (2, 1):
        raise XprepError(
            f"flash-attn {FLASH_ATTN_VERSION} aligns causal masks top-left when a query chunk is shorter than "
            "its keys (bottom-right from 2.1 on), so context parallelism (--cp > 1) would attend to the wrong "
            "keys: pip install 'flash-attn>=2.1', or pip uninstall flash-attn (torch's own kernels serve then)"
        )


def check_lower_right(kernel: VarlenKernel) -> None:
    """Refuse `kernel` for query sequences shorter than their keys when it cannot align them bottom-right."""
    if kernel is _flash_attn_kernel:
        check_flash_attn_lower_right()


def varlen_signature() -> tuple[str, ...] | None:
    """The parameters the installed `varlen_attn` takes after its seven positional ones (query, key,
    value, cu_seq_q, cu_seq_k, max_q, max_k), or None when this torch has none.

    torch 2.10: is_causal, return_aux; 2.11: return_aux, scale, window_size; 2.12 and 2.13 add
    enable_gqa, seqused_k, block_table, num_splits. Read once (per function object).
    """
    return None if varlen_attn is None else _keywords(varlen_attn)


@functools.lru_cache(maxsize=4)
def _keywords(fn: Callable) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - not introspectable
        return ()
    return tuple(p.name for p in params[7:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _torch_varlen_causal() -> dict[str, object] | None:
    """How the installed varlen_attn is asked for causal attention, or None (no varlen_attn, or a
    signature without a way to say it: the varlen path is then not taken)."""
    accepted = varlen_signature()
    if accepted is None:
        return None
    if "window_size" in accepted:  # 2.11+: (-1, 0) is causal, bottom-right aligned
        return {"window_size": (-1, 0)}
    if "is_causal" in accepted:  # 2.10
        return {"is_causal": True}
    return None


def _torch_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """torch's varlen_attn with only the keywords its signature has; what it lacks is done around it:
    no `scale` (2.10): q is scaled so that the kernel's own 1/sqrt(D) gives `scale`; no `enable_gqa`
    (before 2.12): K/V heads are repeated to the query heads (query head h reads K/V head h // (H/Hkv),
    as with SDPA's enable_gqa)."""
    accepted = varlen_signature()
    kwargs = dict(_torch_varlen_causal())
    if scale is not None:
        if "scale" in accepted:
            kwargs["scale"] = scale
        else:
            q = q * (scale * math.sqrt(q.shape[-1]))
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in accepted:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def varlen_kernel(q: Tensor) -> VarlenKernel | None:
    """The one-call varlen kernel for `q` (T, H, D), or None: CUDA, fp16/bf16, compute capability >= 8.0
    and a head dim the flash kernels take; flash-attn's when installed, else torch's. (fp32, pre-Ampere
    GPUs and other head dims take FlexAttention instead of failing inside a half-precision kernel.)"""
    path = _varlen_path(q.device, q.dtype, q.shape[-1])
    if path == FLASH_VARLEN:
        return _flash_attn_kernel
    return _torch_varlen_kernel if path == TORCH_VARLEN else None


def flash_varlen_usable(q: Tensor) -> bool:
    """Whether flash-attn's kernels can take `q`: installed, and the varlen path's device, dtype and head dim.

    fp32 on CUDA (no autocast) falls back to SDPA instead of failing inside the kernel.
    """
    return _varlen_path(q.device, q.dtype, q.shape[-1]) == FLASH_VARLEN


# ----------------------------------------------------------------------------- attention over documents


def sdpa_per_document(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float | None = None) -> Tensor:
    """Causal SDPA run once per document; `bounds` are the cu_seqlens as Python ints.

    q (T, H, D), k/v (T, Hkv, D) with H a multiple of Hkv (GQA through `enable_gqa`);
    returns (T, H, D). Each call sees a square causal block, so the fused kernels apply.
    Inputs are given to SDPA as 4-D (1, H, L, D): with 3-D inputs the CPU dispatcher falls
    back to the math kernel, whose memory is quadratic in the document length.
    """
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, T, D), (1, Hkv, T, D)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        q_doc, k_doc, v_doc = (x[:, :, start:end] for x in (qt, kt, vt))  # (1, H, L, D)
        outs.append(F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True, scale=scale, enable_gqa=gqa))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=2)[0].transpose(0, 1)  # (T, H, D)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float | None = None,
    bounds: list[int] | None = None,
) -> Tensor:
    """Causal attention within each document of a packed sequence: q (T, H, D), k/v (T, Hkv, D) -> (T, H, D).

    `cu_seqlens` is int32 `[n_docs + 1]` starting at 0 and ending at T; `max_seqlen` is the longest
    document (only the flash kernel needs it). Queries never see keys of another document.
    `bounds` are the cu_seqlens as Python ints when the caller has them (read once per forward,
    not per layer: reading a device tensor waits for the device).
    """
    kernel = varlen_kernel(q)
    if kernel is not None:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, scale)
    bounds = cu_seqlens.tolist() if bounds is None else bounds
    if device_capability(q.device) is not None and flex_serves(q.shape[-1]) and bounds[-1] > 0:
        return flex_document_attention(q, k, v, bounds, scale)
    return sdpa_per_document(q, k, v, bounds, scale)


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float | None = None) -> Tensor:
    """Causal attention within each document in one FlexAttention call: q (T, H, D), k/v (T, Hkv, D).

    The block mask (`document_block_mask`) skips every block between two documents, so the work is
    that of the documents alone. It is built once for a forward's bounds and reused by every layer
    (and rebuilt when the bounds change). flex_attention runs compiled on CUDA; eager (a slow
    reference) elsewhere, where it has no backward.
    """
    block_mask = _document_block_mask(tuple(bounds), q.device)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, T, D)
    out = _flex(q.device.type)(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def document_block_mask(bounds: Sequence[int], device: torch.device | str, block: int = _FLEX_BLOCK):
    """FlexAttention's BlockMask for causal attention within documents, built from their bounds.

    Worked out per (query block, key block) tile from the bounds alone: tile (i, j) has an allowed
    pair iff j lies in [first block of the document of query block i's first token, i], and is full
    (every pair allowed, the mask_mod skipped) iff the whole of tiles i and j lies in one document and
    j < i. Nothing is T x T: the tiles are (T/block)^2, the document id of each token (T,) is what the
    mask_mod reads in partial tiles. Equal to `create_block_mask` of the same mask_mod (which evaluates
    every one of the T^2 pairs: 649 MiB and 1.2 s at T=8192 on a CPU). Built with device ops only, the
    bounds copied in from pinned memory: no host sync.
    """
    from torch.nn.attention.flex_attention import BlockMask  # deferred: FlexAttention is a CUDA-only path here

    device = torch.device(device)
    total = int(bounds[-1])
    cu = to_device_async(torch.tensor(bounds, dtype=torch.int64), device)  # (n_docs + 1,)
    n = -(-total // block)  # tiles per side
    first = torch.arange(n, device=device) * block  # (n,) first token of each tile
    last = (first + block).clamp(max=total) - 1  # (n,) last token of each tile

    def doc_start(pos: Tensor) -> Tensor:  # start of the document holding each position
        return cu[torch.searchsorted(cu, pos, right=True) - 1]

    rows = torch.arange(n, device=device)[:, None]  # (n, 1) query tile
    cols = torch.arange(n, device=device)[None, :]  # (1, n) key tile
    seen = (cols >= (doc_start(first) // block)[:, None]) & (cols <= rows)  # (n, n) some pair allowed
    whole = ((first + block) <= total)[:, None]  # a tile cut by T is never full (create_block_mask's rule)
    full = (cols >= (-(-doc_start(last) // block))[:, None]) & (cols < rows) & whole  # (n, n) every pair allowed
    partial = seen & ~full
    lengths = cu.diff()
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)  # (T,)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(total, total))


def to_device_async(x: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor copied to `device` without waiting for the device: to CUDA from pinned memory
    (a copy from pageable memory waits for all the work queued before it)."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """A BlockMask's (num_blocks (1, 1, n), indices (1, 1, n, n)) of a boolean (n, n) tile grid: each row's
    set tiles first, ascending, then the others (the layout create_block_mask produces)."""
    tiles = tiles.to(torch.int32)[None, None]
    indices = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1).to(torch.int32), indices.to(torch.int32)


@functools.lru_cache(maxsize=2)  # the bounds of the current forward (and of the last one)
def _document_block_mask(bounds: tuple[int, ...], device: torch.device):
    return document_block_mask(bounds, device)


@functools.cache
def _flex(device_type: str):
    """flex_attention compiled for CUDA tensors (its fused kernel); eager for others, whatever the machine has."""
    from torch.nn.attention.flex_attention import flex_attention  # deferred: as above

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def lower_right_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal attention of the LAST Lq positions of a document over its first Lk keys.

    q (Lq, H, D), k/v (Lk, Hkv, D) with Lq <= Lk: query i sits at position Lk - Lq + i and sees
    keys 0..Lk - Lq + i (bottom-right aligned; SDPA's own `is_causal` is top-left aligned).
    Used by context parallelism, where a rank's query chunk is the tail of a key prefix.
    No path materializes an (Lq, Lk) mask except the generic fallback for other devices.
    """
    lq, lk = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, L, D)
    if lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    elif flash_varlen_usable(q):  # flash-attn >= 2.1 aligns causal masks bottom-right when Lq != Lk
        check_flash_attn_lower_right()
        return flash_attn_func(q[None], k[None], v[None], causal=True, softmax_scale=scale)[0]
    elif device_capability(q.device) is not None:  # SDPA dispatches this bias to its flash/efficient kernels
        if gqa:
            rep = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(lq, lk), scale=scale)
    elif q.device.type == "cpu" and _CPU_FLASH_LSE:
        out = _PrefixThenCausalCPU.apply(qt, kt, vt, scale)
    else:
        q_pos = torch.arange(lk - lq, lk, device=q.device)
        mask = torch.arange(lk, device=q.device)[None, :] <= q_pos[:, None]  # (Lq, Lk), True = attend
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # (Lq, H, D)


_aten = torch.ops.aten
_CPU_FLASH_LSE = hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
)


class _PrefixThenCausalCPU(torch.autograd.Function):
    """Bottom-right causal attention on CPU as two fused-kernel calls merged by log-sum-exp.

    Keys split into the prefix [0, Lk-Lq) that every query sees (no mask) and the square
    diagonal block [Lk-Lq, Lk) (plain causal). The outputs merge exactly through their
    log-sum-exps; the backward hands each block the MERGED output and log-sum-exp, which is
    what the flash backward needs to produce that block's share of the gradient (the
    ring-attention identity). A masked SDPA call would save an (Lq, Lk) float mask per call
    and runs ~8x slower on CPU. q (1, H, Lq, D), k/v (1, Hkv, Lk, D); GQA handled by the kernel.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
        p = k.shape[-2] - q.shape[-2]
        o_a, lse_a = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k[..., :p, :], v[..., :p, :], 0.0, False, scale=scale
        )
        o_b, lse_b = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k[..., p:, :], v[..., p:, :], 0.0, True, scale=scale
        )  # o (1, H, Lq, D), lse (1, H, Lq)
        acc = torch.promote_types(q.dtype, torch.float32)
        lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))
        w_a, w_b = (lse_a - lse).exp().unsqueeze(-1), (lse_b - lse).exp().unsqueeze(-1)
        out = (o_a.to(acc) * w_a + o_b.to(acc) * w_b).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse.to(lse_a.dtype))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        p = k.shape[-2] - q.shape[-2]
        grad_out = grad_out.contiguous()
        dq_a, dk_a, dv_a = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k[..., :p, :], v[..., :p, :], out, lse, 0.0, False, scale=ctx.scale
        )
        dq_b, dk_b, dv_b = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k[..., p:, :], v[..., p:, :], out, lse, 0.0, True, scale=ctx.scale
        )
        return dq_a + dq_b, torch.cat([dk_a, dk_b], dim=-2), torch.cat([dv_a, dv_b], dim=-2), None
