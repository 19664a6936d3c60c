"""Context parallelism for packed sequences: zigzag sharding, and the attention of each --cp-mode.

The zigzag *unit* is the range of tokens cut into 2·C equal chunks; rank r keeps chunks r and
2C−1−r of every unit, so each rank gets the same number of tokens and about the same
causal-attention work. Two kinds of units:

- per document (every pack but chunk): every document is padded to a multiple of 2·C
  (`padded_length`, the same rule the packer uses to reserve room with `--cp-size C`) and is
  its own unit;
- per sample (`--method chunk` packs, `sample_len`): a chunk sample is exactly --seq-len tokens
  of document pieces, with no room for padding; with --seq-len a multiple of 2·C the whole
  sample is the unit, unpadded, and the documents inside it stay separate for attention.

Sharding is a chain of small pure steps (STYLE 11), each testable without a process group:

    cu_seqlens --pad_documents / sample_units--> unit bounds --zigzag_permutation--> (C, T_pad/C) global indices
                                                             --inverse_permutation--> gathered order -> global order

At attention time (`cp_context` builds the model's `cp` for a batch, per mode):
- allgather (`CPContext`, the reference): each rank all-gathers K and V over the CP group
  (autograd-aware: the backward reduce-scatters their gradients) and puts them back in global
  order. Its local queries, cut into pieces that each lie inside one document (`local_pieces`),
  attend causally to their own document's keys only.
- ring (xprep.train.ring): K/V blocks travel around the CP ranks; K/V memory O(T/C).
- ulysses and hybrid (xprep.train.ulysses): all-to-all to whole-sequence heads; hybrid runs a ring
  across Ulysses groups.
Real tokens keep their labels and positions, so the loss is that of cp=1 in every mode.
"""

from __future__ import annotations

import functools
import itertools
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from xprep.prep.errors import XprepError
from xprep.train.attention import (
    attention_path,
    check_lower_right,
    lower_right_causal_attention,
    to_device_async,
    varlen_kernel,
)
from xprep.train.ring import Call, Ring, ring_attention, ring_path, ring_steps
from xprep.train.ulysses import UlyssesContext

Lengths = TypeVar("Lengths", int, np.ndarray, Tensor)
GatherFn = Callable[[Tensor], Tensor]  # (T_local, ...) -> (C·T_local, ...) concatenated in rank order
Piece = tuple[int, int, int]  # (start, end, key_start): global query range inside one document, its keys' start

# Fill values of the padding tokens, per batch key (keys not listed get 0). position_ids continue.
PAD_FILL = {"labels": -100, "category_ids": 0, "input_ids": 0}

# How attention reaches the other CP ranks' tokens (--cp-mode). The sharding is the same for all of them.
ALLGATHER = "allgather"  # every rank all-gathers the whole K/V (the reference: K/V memory O(T) per rank)
RING = "ring"  # K/V blocks passed around the ring, one step per rank (K/V memory O(T/C))
ULYSSES = "ulysses"  # all-to-all to whole-sequence Q/K/V on H/C heads, and back
HYBRID = "hybrid"  # Ulysses inside groups of --ulysses ranks, ring across the groups
CP_MODES = (ALLGATHER, RING, ULYSSES, HYBRID)
DEFAULT_CP_MODE = RING  # serves any head count, and its K/V memory shrinks with C


def ulysses_degree(mode: str, cp_size: int, ulysses: int | None = None) -> int:
    """The head-parallel factor U of a CP mode: C for ulysses, --ulysses N for hybrid, 1 for the others.

    The ring then has C / U ranks. An impossible combination is an XprepError naming the valid choices.
    """
    if mode not in CP_MODES:
        raise XprepError(f"--cp-mode {mode}: unknown; choose one of {', '.join(CP_MODES)}")
    if mode != HYBRID:
        if ulysses not in (None, 1) and not (mode == ULYSSES and ulysses == cp_size):
            raise XprepError(f"--ulysses {ulysses} is the head-parallel factor of --cp-mode hybrid, not of {mode}: "
                             "drop --ulysses or use --cp-mode hybrid")
        return cp_size if mode == ULYSSES else 1
    if ulysses is None:
        raise XprepError(f"--cp-mode hybrid needs --ulysses N (the head-parallel factor; --cp {cp_size} = N × ring "
                         f"size): N in {_divisors(cp_size)}")
    if ulysses < 1 or cp_size % ulysses:
        raise XprepError(f"--ulysses {ulysses} does not divide --cp {cp_size}: choose N in {_divisors(cp_size)}")
    return ulysses


def check_cp_heads(mode: str, cp_size: int, ulysses: int | None, n_heads: int) -> None:
    """Refuse a head-parallel factor that does not divide the model's query heads, naming the valid ones.

    K/V heads need no such rule: with fewer K/V heads than the factor (or not a multiple of it) each K/V
    head is repeated until they split evenly (`xprep.train.ulysses`).
    """
    factor = ulysses_degree(mode, cp_size, ulysses)
    if n_heads % factor == 0:
        return
    if mode == ULYSSES:
        valid = [c for c in _divisors(n_heads) if c > 1]
        raise XprepError(f"--cp-mode ulysses splits the {n_heads} attention heads over --cp {cp_size} ranks, which "
                         f"does not divide them: use --cp in {valid}, --cp-mode ring, or --cp-mode hybrid")
    valid = [u for u in _divisors(cp_size) if n_heads % u == 0]
    raise XprepError(f"--cp-mode hybrid splits the {n_heads} attention heads over --ulysses {factor} ranks, which "
                     f"does not divide them: use --ulysses in {valid} (dividing both --cp {cp_size} and the heads)")


def cp_attention_path(mode: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """The attention path of a `mode` forward, named for a start line (xprep.train.attention.attention_path):
    allgather's query pieces over gathered keys, Ulysses' whole documents, the ring's per-block kernel."""
    if mode in (RING, HYBRID):
        return ring_path(device, dtype, head_dim)
    return attention_path(device, dtype, head_dim, context_parallel=mode == ALLGATHER)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_alignment(cp_size: int) -> int:
    """What every document length is padded to a multiple of: 2·cp_size, or 1 without CP (cp_size 1)."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    return 2 * cp_size if cp_size > 1 else 1


def padded_length(doc_len: Lengths, cp_size: int) -> Lengths:
    """A document's length once padded for CP: rounded up to a multiple of `cp_alignment(cp_size)`.

    The pack's CP alignment (`xprep pack --cp-size C`, xprep.prep.pack.kernels.item_costs with
    PackConfig.align) must count documents with exactly this rule, so a bin that fits its
    capacity still fits after sharding; tests/test_cp.py checks the two agree. Works on ints
    and elementwise on integer numpy arrays / torch tensors.
    """
    unit = cp_alignment(cp_size)
    return (doc_len + unit - 1) // unit * unit


def pad_documents(cu_seqlens: Tensor, cp_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pad each document at its tail to `padded_length`: (cu_seqlens_padded, source, pad_offset).

    For every padded token: `source` (T_pad,) int64 is the unpadded token it copies (a padding
    token copies its document's last real token) and `pad_offset` (T_pad,) int64 is 0 for real
    tokens and k for the k-th padding token. Padding sits after the real tokens of its document,
    so causally no real token ever sees it.
    """
    cu = cu_seqlens.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]  # (n_docs,)
    cu_padded = torch.zeros_like(cu)
    cu_padded[1:] = torch.cumsum(padded_length(lengths, cp_size), 0)
    total = int(cu_padded[-1])
    pos = torch.arange(total, dtype=torch.int64)
    doc = torch.searchsorted(cu_padded, pos, right=True) - 1  # (T_pad,) document of each token
    offset = pos - cu_padded[doc]  # position inside the padded document
    pad_offset = (offset - lengths[doc] + 1).clamp(min=0)
    source = cu[doc] + offset - pad_offset
    return cu_padded.to(torch.int32), source, pad_offset


def sample_units(n_tokens: int, sample_len: int, cp_size: int) -> Tensor:
    """Zigzag unit bounds of a row of whole samples (a chunk pack's bins): [0, S, 2S, …, n_tokens], int32.

    Each sample is one unit, unpadded, so `sample_len` must be a multiple of 2·C (PackedDataset checks
    the pack's --seq-len for the user) and the row whole samples (chunk bins are always full).
    """
    unit = cp_alignment(cp_size)
    if sample_len < 1 or sample_len % unit or n_tokens % sample_len:
        raise ValueError(f"a row of {n_tokens} tokens is not whole samples of {sample_len} tokens "
                         f"(a multiple of 2·cp={unit})")
    return torch.arange(0, n_tokens + 1, sample_len, dtype=torch.int32)


def zigzag_owner(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """The CP rank that owns each padded token (T_pad,): chunk c of 2C goes to min(c, 2C−1−c).

    The bounds are those of the zigzag units: padded documents, or whole samples (`sample_units`).
    """
    cu = cu_seqlens_padded.to("cpu", torch.int64)
    pos = torch.arange(int(cu[-1]), dtype=torch.int64)
    if cp_size == 1:
        return torch.zeros_like(pos)
    doc = torch.searchsorted(cu, pos, right=True) - 1
    chunk_len = (cu[1:] - cu[:-1]) // (2 * cp_size)  # (n_docs,)
    chunk = (pos - cu[doc]) // chunk_len[doc]  # (T_pad,) in [0, 2C)
    return torch.minimum(chunk, 2 * cp_size - 1 - chunk)


def zigzag_permutation(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """Global token indices held by each rank, (C, T_pad/C): row r = chunks r and 2C−1−r of every unit.

    Units are padded documents or whole samples (see `zigzag_owner`). Within a rank, tokens keep
    their global order (unit by unit, chunk r before chunk 2C−1−r), which is exactly a stable sort
    of the tokens by owner rank. Flattened, the result is the order in which an all-gather
    concatenates the ranks' tokens.
    """
    lengths = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    if bool((lengths % cp_alignment(cp_size)).any()):
        raise ValueError(f"documents are not padded to a multiple of {cp_alignment(cp_size)}: use pad_documents")
    owner = zigzag_owner(cu_seqlens_padded, cp_size)
    return torch.argsort(owner, stable=True).view(cp_size, -1)


def inverse_permutation(perm: Tensor) -> Tensor:
    """Indices that put rank-major gathered tokens back in global order: gathered[inv] == global.

    Derived from the forward permutation (argsort), so the two can never disagree.
    """
    return torch.argsort(perm.reshape(-1))


def shard_batch(batch: dict[str, Tensor], cp_rank: int, cp_size: int, sample_len: int | None = None
                ) -> dict[str, Tensor]:
    """This CP rank's share of a packed batch: chunks r and 2C−1−r of every zigzag unit.

    The units are the documents, each padded first (`pad_documents`), or with `sample_len` the
    row's whole samples of that many tokens, unpadded (`sample_units`: chunk packs).
    Per-token keys (shape (1, T)) are padded (PAD_FILL; position_ids continue, so they stay
    GLOBAL positions within the document) and sliced to (1, T_pad/C). `cu_seqlens` becomes the
    local one (the rank's tokens of each document, contiguous since a rank keeps global order);
    added: `cu_seqlens_padded` (global document bounds, padded: unpadded with `sample_len`),
    `cu_units` (global zigzag unit bounds), `global_index` (T_pad/C,) local→global token index
    and `cp_inverse` (T_pad,) gathered→global order, which CPContext needs. Labels must already
    be aligned with their logits position (shifted) before sharding: the loss is computed per
    rank, locally.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} not in [0, cp_size={cp_size})")
    cu_seqlens = batch["cu_seqlens"]
    n_tokens = int(cu_seqlens[-1])
    if sample_len is None:
        cu_padded, source, pad_offset = pad_documents(cu_seqlens, cp_size)
        cu_units = cu_padded
    else:  # no padding: every token is its own source
        cu_padded, cu_units = cu_seqlens.to("cpu", torch.int32), sample_units(n_tokens, sample_len, cp_size)
        source, pad_offset = torch.arange(n_tokens), torch.zeros(n_tokens, dtype=torch.int64)
    perm = zigzag_permutation(cu_units, cp_size)
    local = perm[cp_rank]  # (T_pad/C,)
    src, off = source[local], pad_offset[local]
    out: dict[str, Tensor] = {}
    for key, value in batch.items():
        if key == "cu_seqlens":
            continue
        if value.dim() != 2 or value.shape[1] != n_tokens:
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}, expected (1, {n_tokens})")
        taken = value[:, src.to(value.device)]
        if key == "position_ids":
            taken = taken + off.to(value.device)
        else:
            taken = torch.where(off.to(value.device) > 0, PAD_FILL.get(key, 0), taken)
        out[key] = taken
    out["cu_seqlens"] = torch.searchsorted(local, cu_padded.to(torch.int64)).to(torch.int32)  # local tokens before
    out["cu_seqlens_padded"] = cu_padded
    out["cu_units"] = cu_units
    out["global_index"] = local
    out["cp_inverse"] = inverse_permutation(perm)
    return out


def all_gather_autograd(group: dist.ProcessGroup) -> GatherFn:
    """Concatenate a tensor over the group along dim 0; the backward reduce-scatters (sums) the gradient."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return lambda x: gather(x.contiguous(), 0, group)


@dataclass(frozen=True)
class CPContext:
    """One batch's context-parallel state, handed to the model as `cp`.

    `pieces` are this rank's query pieces (`local_pieces`) as Python ints, worked out once per
    batch, not per layer; `inverse` maps gathered (rank-major) tokens to global order. `gather`
    defaults to the autograd all-gather over `group`; tests pass a fake one to simulate ranks.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    pieces: list[Piece]
    inverse: Tensor
    gather: GatherFn

    @classmethod
    def from_shard(
        cls,
        shard: dict[str, Tensor],
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        gather: GatherFn | None = None,
    ) -> CPContext:
        """Build from the dict `shard_batch` returned (already on the compute device)."""
        if gather is None:
            if group is None:
                raise ValueError("CPContext needs a process group or a gather function")
            gather = all_gather_autograd(group)
        pieces = local_pieces(shard["cu_seqlens_padded"].tolist(), shard["cu_units"].tolist(), rank, size)
        return cls(group, rank, size, pieces, shard["cp_inverse"], gather)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Local queries over the whole sequence: q (T_l, H, D), k/v (T_l, Hkv, D) -> (T_l, H, D)."""
        n_kv = k.shape[1]
        kv = self.gather(torch.cat([k, v], dim=1))  # (C·T_l, 2·Hkv, D), one collective per layer
        kv = kv.index_select(0, self.inverse.to(kv.device))  # (T_pad, 2·Hkv, D) global order
        k_all, v_all = kv[:, :n_kv], kv[:, n_kv:]
        return piece_attention(q, k_all, v_all, self.pieces)


@dataclass(frozen=True)
class CPGroups:
    """The process groups the CP modes talk over. CP rank r sits at ring index r // U and Ulysses index
    r % U (U = the head-parallel factor, `ulysses_degree`): the U ranks of a Ulysses group are neighbours."""

    cp: dist.ProcessGroup  # all C ranks of this DP rank
    ring: dist.ProcessGroup | None = None  # the C/U ranks with this rank's Ulysses index (ring, hybrid)
    ulysses: dist.ProcessGroup | None = None  # the U ranks with this rank's ring index (ulysses, hybrid)


def cp_context(shard: dict[str, Tensor], mode: str, rank: int, size: int, ulysses: int | None,
               groups: CPGroups):
    """The model's `cp` for one batch (shard_batch's dict, on the compute device) under --cp-mode `mode`."""
    factor = ulysses_degree(mode, size, ulysses)
    if mode == ALLGATHER:
        return CPContext.from_shard(shard, groups.cp, rank, size)
    perm = zigzag_permutation(shard["cu_units"], size)  # (C, T_pad/C): the global tokens of every CP rank
    bounds = shard["cu_seqlens_padded"]
    device = shard["cp_inverse"].device
    if factor == 1:  # ring over all C ranks, each its own zigzag share
        steps = ring_steps(list(perm.numpy()), bounds.numpy(), rank, device)
        return RingContext(size, _ring(groups.cp), steps)
    if factor == size:  # Ulysses over all C ranks: the whole sequence, in global order, on H/C heads
        cu = bounds.to(torch.int32)
        bounds_list = cu.tolist()
        longest = max((b - a for a, b in itertools.pairwise(bounds_list)), default=0)
        return UlyssesContext(size, factor, groups.ulysses or groups.cp, shard["cp_inverse"],
                              perm.reshape(-1).to(device), to_device_async(cu, device), bounds_list, longest)
    groups_tokens = list(perm.reshape(size // factor, -1).numpy())  # ring member g: the tokens of CP ranks gU..gU+U-1
    steps = ring_steps(groups_tokens, bounds.numpy(), rank // factor, device)
    return UlyssesContext(size, factor, groups.ulysses, ring=_ring(groups.ring), steps=steps)


@dataclass(frozen=True)
class RingContext:
    """One batch's ring state, handed to the model as `cp`: the calls of every ring step (xprep.train.ring)."""

    size: int
    ring: Ring
    steps: list[list[Call]]

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_attention(q, k, v, self.ring, self.steps)


@functools.lru_cache(maxsize=4)
def _ring(group: dist.ProcessGroup) -> Ring:
    """The ring over `group` (its neighbours' global ranks), looked up once per group."""
    return Ring(group)


def local_segments(doc_len: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of a unit (a padded document, or a sample) that `rank` holds: chunks r and
    2C−1−r (the whole unit at C=1)."""
    if size == 1:
        return [(0, doc_len)] if doc_len else []
    chunk = doc_len // (2 * size)
    return [(c * chunk, (c + 1) * chunk) for c in (rank, 2 * size - 1 - rank)] if chunk else []


def local_pieces(bounds: list[int], units: list[int], rank: int, size: int) -> list[Piece]:
    """This rank's queries as (start, end, key_start) global ranges, in local order, each inside one document.

    `bounds` are the global document bounds, `units` the zigzag unit bounds (both as Python ints,
    ending at the same T). The rank holds chunks r and 2C−1−r of every unit (`local_segments`); a
    segment is cut where documents end, and each piece's keys start at its document's start. With
    units == bounds (one unit per document) a segment is one piece.
    """
    pieces = []
    for u_start, u_end in zip(units[:-1], units[1:], strict=True):
        for a, b in local_segments(u_end - u_start, rank, size):
            start, end = u_start + a, u_start + b
            d = bisect_right(bounds, start) - 1  # the document holding `start` (the last of empty ones there)
            while start < end:
                stop = min(bounds[d + 1], end)
                if stop > start:
                    pieces.append((start, stop, bounds[d]))
                start, d = stop, d + 1
    return pieces


def piece_attention(q: Tensor, k: Tensor, v: Tensor, pieces: list[Piece]) -> Tensor:
    """Attention of a rank's query pieces over global keys: q (T_local, H, D), k/v (T, Hkv, D) -> (T_local, H, D).

    q holds the pieces' queries one after the other. A piece (start, end, key_start) attends to
    keys [key_start, end) with bottom-right causal alignment: query start + i sees keys up to
    start + i, and none before its document's start. Where a varlen kernel serves (xprep.train.attention:
    CUDA, half precision, Ampere or later) all pieces go in one call, each piece's key range gathered
    after the previous one's; elsewhere one call per piece. A kernel that would align a piece top-left
    (flash-attn < 2.1) is refused with an XprepError.
    """
    kernel = varlen_kernel(q)
    if kernel is not None and pieces:
        check_lower_right(kernel)
        keys, cu_q, cu_k, max_q, max_k = _piece_layout(tuple(pieces), q.device)
        return kernel(q, k.index_select(0, keys), v.index_select(0, keys), cu_q, cu_k, max_q, max_k, None)
    outs = []
    q_start = 0
    for start, end, key_start in pieces:
        q_seg = q[q_start : q_start + end - start]
        outs.append(lower_right_causal_attention(q_seg, k[key_start:end], v[key_start:end]))
        q_start += end - start
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)  # (T_local, H, D)


@functools.lru_cache(maxsize=2)  # the pieces of the current batch: the same for every layer
def _piece_layout(pieces: tuple[Piece, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """For one varlen call over the pieces: the key rows to gather (each piece's [key_start, end), one
    after the other), the query and key cu_seqlens (int32) and the longest query and key sequence. Built on
    the CPU from the pieces (Python ints) and copied without waiting for the device."""
    q_lens = [end - start for start, end, _ in pieces]
    k_lens = [end - key_start for _, end, key_start in pieces]
    keys = torch.cat([torch.arange(key_start, end) for _, end, key_start in pieces])
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    return (*(to_device_async(x, device) for x in (keys, cu_q, cu_k)), max(q_lens), max(k_lens))


def zigzag_attention(q: Tensor, k: Tensor, v: Tensor, bounds: list[int], rank: int, size: int) -> Tensor:
    """Attention of rank `rank`'s zigzag queries over global keys, one unit per (padded) document:
    q (T_pad/C, H, D), k/v (T_pad, Hkv, D).

    A local segment [a, b) of a document starting at `start` attends to that document's keys
    [start, start + b) with bottom-right causal alignment: query a + i sees keys up to a + i.
    """
    return piece_attention(q, k, v, local_pieces(bounds, bounds, rank, size))


__all__ = [
    "CPContext",
    "PAD_FILL",
    "all_gather_autograd",
    "cp_alignment",
    "inverse_permutation",
    "local_pieces",
    "local_segments",
    "pad_documents",
    "padded_length",
    "piece_attention",
    "sample_units",
    "shard_batch",
    "zigzag_attention",
    "zigzag_owner",
    "zigzag_permutation",
]
