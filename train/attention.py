"""Document-masked (varlen) causal attention over packed sequences.

Every kernel here takes packed tokens `(T, H, D)` plus `cu_seqlens` (document boundaries) and
computes causal attention inside each document only, so nothing attends across a boundary.
Which kernel runs (`varlen_kernel`, `varlen_attention`):

- CUDA, fp16/bf16: one varlen call for the whole packed row: flash-attn's when it is installed,
  else torch's own (`torch.nn.attention.varlen.varlen_attn`, in torch ≥ 2.10). The context-parallel
  pieces (`train/cp.py`) go through the same call, each piece a query sequence over its key prefix.
- CUDA otherwise (fp32, or an older torch without flash-attn): FlexAttention with a document block
  mask (compiled once per process; the mask built once per forward), no per-document loop.
- CPU: one SDPA call per document (fastest there: 4k tokens in 10 documents, forward + backward,
  ~0.09 s against ~0.5 s for one call with a block-diagonal mask; FlexAttention has no CPU backward).
`lower_right_causal_attention` is the piece context parallelism needs: a query chunk that is
the tail of a longer key prefix. GQA (fewer K/V heads than query heads) works on every path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

try:  # optional CUDA kernel; absent on CPU machines
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = flash_attn_varlen_func = None
try:  # torch's own flash varlen kernel (CUDA only; torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch
    varlen_attn = None

_FLASH_DTYPES = (torch.float16, torch.bfloat16)

# (q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out: causal attention of query sequence i (rows
# cu_q[i]:cu_q[i+1] of q) over key sequence i, aligned bottom-right when it is shorter than its keys.
VarlenKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, "float | None"], Tensor]


def _flash_attn_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=scale)


def _torch_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0),
                       enable_gqa=q.shape[1] != k.shape[1])


def varlen_kernel(q: Tensor) -> VarlenKernel | None:
    """The one-call varlen kernel for `q`, or None: CUDA and fp16/bf16, flash-attn's when installed, else
    torch's. (fp32 on CUDA takes FlexAttention instead of failing inside a half-precision kernel.)"""
    if not (q.is_cuda and q.dtype in _FLASH_DTYPES):
        return None
    if flash_attn_varlen_func is not None:
        return _flash_attn_kernel
    return _torch_varlen_kernel if varlen_attn is not None else None


def flash_varlen_usable(q: Tensor) -> bool:
    """Whether flash-attn's varlen kernel can take `q`: installed, CUDA tensor, fp16/bf16.

    fp32 on CUDA (no autocast) falls back to SDPA instead of failing inside the kernel.
    """
    return flash_attn_varlen_func is not None and q.is_cuda and q.dtype in _FLASH_DTYPES


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
    if q.is_cuda:
        return flex_document_attention(q, k, v, bounds, scale)
    return sdpa_per_document(q, k, v, bounds, scale)


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], scale: float | None = None) -> Tensor:
    """Causal attention within each document in one FlexAttention call: q (T, H, D), k/v (T, Hkv, D).

    The block mask (document ids compared, causal) skips every block between two documents, so the
    work is that of the documents alone. It is built once for a forward's bounds and reused by every
    layer (and rebuilt when the bounds change). flex_attention runs compiled on CUDA; eager (a slow
    reference) elsewhere, where it has no backward.
    """
    block_mask = _document_block_mask(tuple(bounds), q.device)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, T, D)
    out = _flex()(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


@functools.lru_cache(maxsize=2)  # the bounds of the current forward (and of the last one)
def _document_block_mask(bounds: tuple[int, ...], device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask  # deferred: FlexAttention is a CUDA-only path here

    total = bounds[-1]
    lengths = torch.tensor(bounds, device=device).diff()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # (T,) document of each token

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(same_document_causal, None, None, total, total, device=device)


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention  # deferred: as above

    return torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention


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
    elif flash_varlen_usable(q):  # flash-attn aligns causal masks bottom-right when Lq != Lk
        return flash_attn_func(q[None], k[None], v[None], causal=True, softmax_scale=scale)[0]
    elif q.is_cuda:  # SDPA dispatches this bias to its flash/efficient kernels without a mask
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
