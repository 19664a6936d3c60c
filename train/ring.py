"""Ring attention: each rank keeps its queries and passes K/V blocks around the ring of CP ranks.

With R ranks in the ring, step s gives rank i the K/V block of rank (i − s) mod R: its own block at
step 0, then the others', each received while the previous one is attended to (one send/recv pair per
step, overlapped with the compute). Each block's partial attention output is merged into the running
output through the log-sum-exp, so no rank ever holds more than two blocks: K/V memory O(T/R) per layer.
The backward runs the same ring: dQ stays home, and each block's dK/dV accumulate as they travel one step
behind it (each hop overlapped with the next step's compute), arriving back at their owner after R hops.

What a query may see in a block is worked out once per batch, from global token indices alone
(`token_runs`, `block_calls`): a token set is cut into *runs*, stretches consecutive both in local order
and in global order, inside one document. Two token sets are disjoint or equal, so a key run and a query
run of one document are either the same run (the causal diagonal: the query run attends to itself,
square, causal) or one lies wholly before the other (every query sees every key: no mask) or after (no
pair: skipped). A block no local query can see costs nothing but its transfer; zigzag sharding gives each
rank the same work at every step. The alignment is explicit: the only masked calls are square diagonals.

The token sets are those `xprep.train.cp.shard_batch` gives the ranks (zigzag chunks), or the union of a
Ulysses group's (`xprep.train.ulysses`, hybrid mode): nothing here assumes zigzag.

Kernels (`BlockKernel`): fused flash kernels that return the log-sum-exp, with backwards that take the
merged output and log-sum-exp (what makes a block's gradient share exact): the CPU's, and on CUDA in half
precision torch's flash kernel (one call per query run and key rows, separate query and key cu_seqlens);
elsewhere a plain-ops kernel (scores per call: its memory is the query run × key rows of one call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from xprep.train.attention import FLASH_VARLEN, TORCH_VARLEN, attention_path

_aten = torch.ops.aten
_CPU_FLASH = hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
)

KeyRows = slice | Tensor  # the key rows of one call: a slice of the block, or their indices (int64)


@dataclass(frozen=True)
class Runs:
    """A token set cut into runs: `bounds` (n+1,) their local bounds, `start` (n,) the global index of each
    run's first token, `doc` (n,) the document of each run (its index in the document bounds)."""

    bounds: np.ndarray
    start: np.ndarray
    doc: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


def token_runs(global_index: np.ndarray, doc_bounds: np.ndarray) -> Runs:
    """Cut tokens (global indices in local order) into maximal runs consecutive in both orders, inside one
    document of `doc_bounds` (global, ascending, ending at T; empty documents allowed)."""
    index = np.asarray(global_index, dtype=np.int64)
    doc = np.searchsorted(np.asarray(doc_bounds, dtype=np.int64), index, side="right") - 1
    cuts = np.flatnonzero((np.diff(index) != 1) | (np.diff(doc) != 0)) + 1
    bounds = np.concatenate([[0], cuts, [len(index)]]).astype(np.int64)
    return Runs(bounds, index[bounds[:-1]], doc[bounds[:-1]])


@dataclass(frozen=True)
class Call:
    """One kernel call of a block: query rows [q0, q1) over `keys` of the block, causal (the diagonal) or not."""

    q0: int
    q1: int
    keys: KeyRows
    causal: bool


def block_calls(queries: Runs, keys: Runs, device: torch.device | str = "cpu") -> list[Call]:
    """The calls that attend `queries` to the block holding `keys` (disjoint token sets, or the same one).

    A query run sees the key runs of its document that start before it (wholly before it: one unmasked
    call over all of them, their rows as one slice when they are adjacent in the block) and itself
    (the causal diagonal, when the block is its own). Key runs after it are never seen.
    """
    if not len(queries) or not len(keys):
        return []
    span = int(max(queries.start.max(), keys.start.max())) + 1
    order = np.lexsort((keys.start, keys.doc))  # key runs by (document, global start)
    sorted_keys = keys.doc[order] * span + keys.start[order]
    q_keys = queries.doc * span + queries.start
    lo = np.searchsorted(sorted_keys, queries.doc * span, side="left")
    hi = np.searchsorted(sorted_keys, q_keys, side="left")  # key runs of the document starting before the query run
    k_len = np.diff(keys.bounds)
    calls = []
    for i in range(len(queries)):
        q0, q1 = int(queries.bounds[i]), int(queries.bounds[i + 1])
        if hi[i] > lo[i]:
            runs = order[lo[i] : hi[i]]
            last = runs[-1]
            if int(keys.start[last] + k_len[last]) > int(queries.start[i]):
                raise AssertionError("a key run overlaps a query run it does not equal: token sets not disjoint")
            calls.append(Call(q0, q1, _rows(keys.bounds, runs, device), False))
        if hi[i] < len(order) and sorted_keys[hi[i]] == q_keys[i]:  # the query run itself: the diagonal
            run = order[hi[i]]
            k0, k1 = int(keys.bounds[run]), int(keys.bounds[run + 1])
            if k1 - k0 != q1 - q0:
                raise AssertionError("a diagonal key run differs in length from its query run")
            calls.append(Call(q0, q1, slice(k0, k1), True))
    return calls


def _rows(bounds: np.ndarray, runs: np.ndarray, device) -> KeyRows:
    """The block rows of `runs` (in that order): one slice when they follow each other, else their indices."""
    starts, ends = bounds[runs], bounds[runs + 1]
    if np.array_equal(starts[1:], ends[:-1]):
        return slice(int(starts[0]), int(ends[-1]))
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    return torch.from_numpy(rows).to(device)


# ----------------------------------------------------------------------------- kernels


class BlockKernel:
    """Attention of a query run over key rows with its log-sum-exp, and the gradient of that share given the
    MERGED output and log-sum-exp. q (Lq, H, D), k/v (Lk, Hkv, D) (H a multiple of Hkv); the output comes
    back in q's dtype, the log-sum-exp (H, Lq) in fp32. `causal` calls are square (the diagonal)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


class CPUFlashKernel(BlockKernel):
    """The CPU's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) and its backward; GQA native."""

    def forward(self, q, k, v, causal, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(*_heads_first(q, k, v), 0.0, causal, scale=scale)
        return out[0].transpose(0, 1), lse[0]  # (Lq, H, D), (H, Lq)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_heads_first(dout.contiguous(), q, k, v, out.contiguous()), lse[None], 0.0, causal, scale=scale)
        return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


class MathKernel(BlockKernel):
    """Plain tensor ops in fp32 (any device): scores (H, Lq, Lk) per call, the flash backward's formulas."""

    def forward(self, q, k, v, causal, scale):
        probs_log, v_full = self._scores(q, k, v, causal, scale)
        lse = torch.logsumexp(probs_log, dim=-1)  # (H, Lq)
        out = torch.einsum("hqk,khd->qhd", (probs_log - lse[..., None]).exp(), v_full)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        scores, v_full = self._scores(q, k, v, causal, scale)
        probs = (scores - lse[..., None]).exp()  # (H, Lq, Lk): this block's share of the merged softmax
        dout32, k_full = dout.float(), _repeat_heads(k, q.shape[1]).float()
        dv = torch.einsum("hqk,qhd->khd", probs, dout32)
        dp = torch.einsum("qhd,khd->hqk", dout32, v_full)
        delta = (dout32 * out.float()).sum(-1).transpose(0, 1)[..., None]  # (H, Lq, 1)
        ds = probs * (dp - delta)
        dq = torch.einsum("hqk,khd->qhd", ds, k_full) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
        return dq.to(q.dtype), _sum_heads(dk, k.shape[1]).to(k.dtype), _sum_heads(dv, v.shape[1]).to(v.dtype)

    @staticmethod
    def _scores(q, k, v, causal, scale):
        k_full, v_full = (_repeat_heads(x, q.shape[1]).float() for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q.float(), k_full) * scale
        if causal:
            lq = q.shape[0]
            scores = scores.masked_fill(torch.ones(lq, lq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return scores, v_full


class CUDAFlashKernel(BlockKernel):
    """torch's flash kernel (`_flash_attention_forward` / `_backward`, the ones its varlen attention calls) on one
    query sequence over one key sequence (cu_seqlens [0, Lq] and [0, Lk]); K/V heads repeated to the query heads
    (the backward sums the copies). CUDA, fp16/bf16, compute capability ≥ 8.0, head dims the kernel takes
    (`xprep.train.attention.varlen_kernel`). Its log-sum-exp comes back (H, Lq) or (1, H, Lq) by flash
    version; the backward is handed it in the layout the forward gave."""

    def forward(self, q, k, v, causal, scale):
        k, v = (_repeat_heads(x, q.shape[1]) for x in (k, v))
        cu_q, cu_k = _cu(q.shape[0], q.device), _cu(k.shape[0], q.device)
        out, lse, *_ = _aten._flash_attention_forward(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], 0.0, causal,
                                                      False, scale=scale)
        self.lse_dims = lse.dim()
        return out, lse.reshape(q.shape[1], q.shape[0]).float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        n_kv = k.shape[1]
        k, v = (_repeat_heads(x, q.shape[1]) for x in (k, v))
        cu_q, cu_k = _cu(q.shape[0], q.device), _cu(k.shape[0], q.device)
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # the dropout's RNG state: no dropout here
        lse = lse.contiguous() if getattr(self, "lse_dims", 2) == 2 else lse[None].contiguous()
        dq, dk, dv = _aten._flash_attention_backward(dout.contiguous(), q, k, v, out.contiguous(), lse, cu_q, cu_k,
                                                     q.shape[0], k.shape[0], 0.0, causal, unused, unused,
                                                     scale=scale)
        return dq, _sum_heads(dk, n_kv), _sum_heads(dv, n_kv)


def _cu(length: int, device: torch.device) -> Tensor:
    return torch.tensor([0, length], dtype=torch.int32).to(device, non_blocking=True)


def _heads_first(*xs: Tensor) -> list[Tensor]:
    return [x.transpose(0, 1)[None] for x in xs]  # (L, H, D) -> (1, H, L, D)


def _repeat_heads(x: Tensor, n_heads: int) -> Tensor:
    return x if x.shape[1] == n_heads else x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _sum_heads(x: Tensor, n_heads: int) -> Tensor:
    return x if x.shape[1] == n_heads else x.unflatten(1, (n_heads, -1)).sum(2)


# The kernels, as the start line names them (`ring_path`).
RING_CUDA_FLASH = "flash per ring block (torch)"
RING_CPU_FLASH = "CPU flash per ring block"
RING_MATH = "plain ops per ring block"

_CUDA_FLASH = CUDAFlashKernel()  # one instance: it remembers the flash build's log-sum-exp layout


def block_kernel(q: Tensor) -> BlockKernel:
    """The kernel ring steps use for `q`: the fused flash kernels on CPU and (half precision, Ampere or later)
    CUDA, plain ops elsewhere (fp32 on CUDA)."""
    path = ring_path(q.device, q.dtype, q.shape[-1])
    return CPUFlashKernel() if path == RING_CPU_FLASH else _CUDA_FLASH if path == RING_CUDA_FLASH else MathKernel()


def ring_path(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel ring steps take for these inputs (`block_kernel`), named for a start line."""
    if torch.device(device).type == "cpu" and _CPU_FLASH:
        return RING_CPU_FLASH
    if attention_path(device, dtype, head_dim) in (FLASH_VARLEN, TORCH_VARLEN) and hasattr(
            _aten, "_flash_attention_forward"):
        return RING_CUDA_FLASH
    return RING_MATH


# ----------------------------------------------------------------------------- one block, forward and backward


def attend_block(q: Tensor, k: Tensor, v: Tensor, calls: list[Call], out: Tensor, lse: Tensor,
                 kernel: BlockKernel, scale: float) -> None:
    """Merge one block's attention into the running `out` (Tq, H, D) fp32 and `lse` (H, Tq) fp32, in place."""
    for c in calls:
        o, m = kernel.forward(q[c.q0 : c.q1], k[c.keys], v[c.keys], c.causal, scale)
        old = lse[:, c.q0 : c.q1]
        new = torch.logaddexp(old, m)
        out[c.q0 : c.q1] = (out[c.q0 : c.q1] * (old - new).exp().T[..., None]
                            + o.float() * (m - new).exp().T[..., None])
        lse[:, c.q0 : c.q1] = new


def attend_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          calls: list[Call], dq: Tensor, dk: Tensor, dv: Tensor, kernel: BlockKernel,
                          scale: float) -> None:
    """Add one block's gradient shares to `dq` (Tq, H, D) and the block's `dk`/`dv` (Tk, Hkv, D), in place (fp32)."""
    for c in calls:
        rows = slice(c.q0, c.q1)
        gq, gk, gv = kernel.backward(dout[rows], q[rows], k[c.keys], v[c.keys], out[rows], lse[:, rows],
                                     c.causal, scale)
        dq[rows] += gq
        if isinstance(c.keys, slice):
            dk[c.keys] += gk
            dv[c.keys] += gv
        else:
            dk.index_add_(0, c.keys, gk.to(dk.dtype))
            dv.index_add_(0, c.keys, gv.to(dv.dtype))


# ----------------------------------------------------------------------------- the ring


class Ring:
    """Send to the next rank of `group` and receive from the previous one, without waiting."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.index = rank
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)

    def start(self, tensor: Tensor) -> tuple[Tensor, list]:
        """Start passing `tensor` on; returns the buffer the previous rank's tensor arrives in and the requests."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(requests: list) -> None:
        """Wait for the transfers, then drop them: a finished send would otherwise keep its block alive."""
        for request in requests:
            request.wait()
        requests.clear()


class _RingAttention(torch.autograd.Function):
    """q (Tq, H, D), k/v (Tq, Hkv, D) -> (Tq, H, D): this rank's queries over every rank's keys, by the ring.

    `steps[s]` are the calls of the block that arrives at step s (the rank's own block at step 0)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring, steps: list[list[Call]], scale: float) -> Tensor:
        kernel, n_kv = block_kernel(q), k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        block = torch.cat([k, v], dim=1)  # (Tk, 2·Hkv, D): one transfer per step
        for s, calls in enumerate(steps):
            if s + 1 < len(steps):
                arriving, requests = ring.start(block)
            attend_block(q, block[:, :n_kv], block[:, n_kv:], calls, out, lse, kernel, scale)
            if s + 1 < len(steps):
                ring.finish(requests)
                block = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.steps, ctx.scale = ring, steps, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, steps, scale = ctx.ring, ctx.steps, ctx.scale
        kernel, n_kv = block_kernel(q), k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.cat([k, v], dim=1)
        # The block held at step s gets this rank's dK/dV share in `grads`, plus the shares of the ranks that
        # held it before (`incoming`, sent by the previous rank at step s−1 and received during this step's
        # compute); the sum goes on to the next rank while the next step computes. After R hops it is home.
        incoming = grad_requests = None
        for s, calls in enumerate(steps):
            if s + 1 < len(steps):
                arriving, requests = ring.start(block)
            grads = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
            attend_block_backward(dout, q, block[:, :n_kv], block[:, n_kv:], out, lse, calls, dq,
                                  grads[:, :n_kv], grads[:, n_kv:], kernel, scale)
            if incoming is not None:
                ring.finish(grad_requests)
                grads += incoming
            if len(steps) > 1:
                incoming, grad_requests = ring.start(grads)
            if s + 1 < len(steps):
                ring.finish(requests)
                block = arriving
        if incoming is not None:  # this rank's own block, back with every rank's share
            ring.finish(grad_requests)
            grads = incoming
        dk, dv = grads[:, :n_kv], grads[:, n_kv:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring, steps: list[list[Call]],
                   scale: float | None = None) -> Tensor:
    """This rank's queries over the keys of every rank of `ring` (see the module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, steps, scale)


def ring_steps(token_sets: list[np.ndarray], doc_bounds: np.ndarray, index: int,
               device: torch.device | str = "cpu") -> list[list[Call]]:
    """The calls of each ring step for ring member `index`: `token_sets[j]` are the global indices member j holds
    (in its local order); step s brings member (index − s) mod R's block."""
    runs = [token_runs(tokens, doc_bounds) for tokens in token_sets]
    size = len(token_sets)
    return [block_calls(runs[index], runs[(index - s) % size], device) for s in range(size)]


def simulated_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, token_sets: list[np.ndarray],
                   doc_bounds: np.ndarray, kernel: BlockKernel | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ring run member by member in one process, with no communication: each member's forward over the
    blocks in ring order, then its backward with the merged output and log-sum-exp, each block's dK/dV summed
    into its owner's. q (T, H, D), k/v (T, Hkv, D) and `dout` (T, H, D) in global order; returns the output and
    dq, dk, dv in global order. What the kernels are checked with without a process group (tests/train/test_ring.py,
    bench/gpu.py)."""
    kernel = kernel or block_kernel(q)
    scale, size, n_heads = 1.0 / math.sqrt(q.shape[-1]), len(token_sets), q.shape[1]
    sets = [torch.from_numpy(np.asarray(t, dtype=np.int64)).to(q.device) for t in token_sets]
    steps = [ring_steps(token_sets, doc_bounds, i, q.device) for i in range(size)]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
    for i, tokens in enumerate(sets):
        acc = torch.zeros(len(tokens), *q.shape[1:], dtype=torch.float32, device=q.device)
        lse = torch.full((n_heads, len(tokens)), float("-inf"), device=q.device)
        for s, calls in enumerate(steps[i]):
            block = sets[(i - s) % size]
            attend_block(q[tokens], k[block], v[block], calls, acc, lse, kernel, scale)
        out[tokens] = acc.to(q.dtype)
        dq_i = torch.zeros(acc.shape, device=q.device)
        for s, calls in enumerate(steps[i]):
            block = sets[(i - s) % size]
            dk_b, dv_b = (torch.zeros(len(block), *x.shape[1:], device=q.device) for x in (k, v))
            attend_block_backward(dout[tokens], q[tokens], k[block], v[block], out[tokens], lse, calls, dq_i, dk_b,
                                  dv_b, kernel, scale)
            dk[block] += dk_b
            dv[block] += dv_b
        dq[tokens] += dq_i
    return out, dq, dk, dv
