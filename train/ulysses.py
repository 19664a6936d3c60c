"""Ulysses (head-parallel) context parallelism, alone or with a ring across Ulysses groups (hybrid).

A Ulysses group is U CP ranks, each holding its zigzag share of the sequence with all H heads. One
all-to-all turns that into the group's whole token set on H/U heads: member j sends head group j of
its tokens to member j and receives every member's tokens for its own heads. Attention then needs no
more communication inside the group: with U = C (--cp-mode ulysses) the group holds the whole
sequence, put back in global order for the ordinary document-masked varlen attention; with U < C
(--cp-mode hybrid) the groups pass K/V around a ring (`xprep.train.ring`), each group's token set
being the union of its members' zigzag shares. A second all-to-all returns the output to sequence
shards with all heads. Both all-to-alls are autograd-aware (the backward is the opposite all-to-all).

Q, K and V travel in one all-to-all. GQA: query head h reads K/V head h // (H/Hkv); when the K/V heads
do not split evenly over U ranks (Hkv < U, or not a multiple), each is repeated r = U / gcd(Hkv, U)
times first (query head h then reads repeated head h // (H/(Hkv·r)), the same K/V), and the repeat's
backward sums the copies' gradients. The query heads must divide by U (xprep.train.cp.check_cp_heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from xprep.train.attention import varlen_attention
from xprep.train.ring import Call, Ring, ring_attention


def kv_repeat(n_kv_heads: int, factor: int) -> int:
    """How many times each K/V head is repeated so that the K/V heads split evenly over `factor` ranks."""
    return factor // math.gcd(n_kv_heads, factor)


def heads_to_sequence(parts: list[Tensor], factor: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's tokens of Q, K and V, (T_l, heads, D) each, to (U·T_l, w, D): every member's tokens (member
    by member) for this rank's head group, its w = (H + 2·Hkv) / U heads being its Q heads, then K's, then V's.
    The send buffer is written once, already in head-group order."""
    n, d = parts[0].shape[0], parts[0].shape[-1]
    grouped = [x.reshape(n, factor, -1, d).transpose(0, 1) for x in parts]  # (U, T_l, heads / U, D) views
    chunks = torch.cat(grouped, dim=2)  # (U, T_l, w, D): chunk j is head group j, for member j
    return _all_to_all(chunks.reshape(factor * n, -1, d), group)


def sequence_to_heads(x: Tensor, factor: int, group: dist.ProcessGroup) -> Tensor:
    """The inverse of `heads_to_sequence`: (U·T_l, w, D) to (T_l, U·w, D), this rank's tokens with all heads."""
    back = _all_to_all(x.contiguous(), group)  # chunk j: this rank's tokens, head group j
    n, w, d = back.shape
    return back.view(factor, n // factor, w, d).transpose(0, 1).reshape(n // factor, factor * w, d)


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return funcol.all_to_all_single_autograd(x, None, None, group)


@dataclass(frozen=True)
class UlyssesContext:
    """One batch's Ulysses state, handed to the model as `cp` (size = C, the whole CP degree).

    With `ring` None (U = C): `to_global` puts the gathered tokens in global order, `to_gathered` back, and
    attention runs over the documents `bounds`. With a ring (hybrid): `steps` are the ring's calls for this
    group's token set.
    """

    size: int
    factor: int
    group: dist.ProcessGroup
    to_global: Tensor | None = None
    to_gathered: Tensor | None = None
    cu_seqlens: Tensor | None = None
    bounds: list[int] | None = None
    max_seqlen: int = 0
    ring: Ring | None = None
    steps: list[list[Call]] | None = None

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (T_l, H, D), k/v (T_l, Hkv, D) -> (T_l, H, D)."""
        repeat = kv_repeat(k.shape[1], self.factor)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        h, hk = q.shape[1] // self.factor, k.shape[1] // self.factor
        whole = heads_to_sequence([q, k, v], self.factor, self.group)  # (U·T_l, h + 2·hk, D)
        qs, ks, vs = whole.split([h, hk, hk], dim=1)
        if self.ring is None:
            qs, ks, vs = (x.index_select(0, self.to_global) for x in (qs, ks, vs))
            out = varlen_attention(qs, ks, vs, self.cu_seqlens, self.max_seqlen, bounds=self.bounds)
            out = out.index_select(0, self.to_gathered)
        else:
            out = ring_attention(qs.contiguous(), ks.contiguous(), vs.contiguous(), self.ring, self.steps)
        return sequence_to_heads(out, self.factor, self.group)

