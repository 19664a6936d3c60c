"""Ring and Ulysses attention without a process group: the ring's per-block plan and merge, simulated rank by
rank, equal document-masked causal attention over the whole sequence (outputs and gradients); the alignment of
every (query run, key block) pair is stated on a small case; Ulysses' head split keeps GQA's head mapping.
The same code under torchrun (real send/recv and all-to-all) is tests/train/test_cp_modes.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from xprep.train.cp import pad_documents, zigzag_permutation
from xprep.train.ring import (
    Call,
    CPUFlashKernel,
    MathKernel,
    ring_steps,
    simulated_ring,
    token_runs,
)
from xprep.train.ulysses import kv_repeat


def reference(q, k, v, bounds):
    """Causal attention inside each document, (T, H, D) in and out, by SDPA with an explicit mask."""
    t = q.shape[0]
    doc = torch.searchsorted(torch.tensor(bounds), torch.arange(t), right=True)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def test_runs_cut_where_the_global_order_or_the_document_breaks():
    runs = token_runs(np.array([0, 1, 2, 3, 12, 13, 14, 15]), np.array([0, 2, 16]))
    assert runs.bounds.tolist() == [0, 2, 4, 8]
    assert runs.start.tolist() == [0, 2, 12]
    assert runs.doc.tolist() == [0, 1, 1]


def test_each_query_piece_meets_a_block_wholly_before_it_unmasked_itself_causally_and_nothing_after():
    # one document of 16 tokens, C = 2: rank 0 holds chunks 0 and 3 (tokens 0-3, 12-15), rank 1 chunks 1 and 2
    perm = zigzag_permutation(torch.tensor([0, 16], dtype=torch.int32), 2)
    assert perm.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    steps = ring_steps(list(perm.numpy()), np.array([0, 16]), 0)
    own, other = steps
    # own block: 0-3 over itself (causal); 12-15 over 0-3 (all of it) and over itself (causal)
    assert own == [Call(0, 4, slice(0, 4), True), Call(4, 8, slice(0, 4), False), Call(4, 8, slice(4, 8), True)]
    # rank 1's block (4-11): only 12-15 see it, all of it; 0-3 see nothing of it
    assert other == [Call(4, 8, slice(0, 8), False)]
    steps = ring_steps(list(perm.numpy()), np.array([0, 16]), 1)
    # rank 1's chunks are adjacent (4-11): one run, causal over itself; of rank 0's block it sees 0-3 (12-15 come later)
    assert steps[0] == [Call(0, 8, slice(0, 8), True)]
    assert steps[1] == [Call(0, 8, slice(0, 4), False)]


def test_keys_of_other_documents_are_never_seen():
    # two documents [0, 8) and [8, 16), C = 2: rank 0's second document chunks see only that document's keys
    cu, _, _ = pad_documents(torch.tensor([0, 8, 16], dtype=torch.int32), 2)
    perm = zigzag_permutation(cu, 2)
    steps = ring_steps(list(perm.numpy()), cu.numpy(), 0)
    for s, calls in enumerate(steps):
        block = perm[(0 - s) % 2]
        for c in calls:
            keys = block[c.keys] if isinstance(c.keys, slice) else block[c.keys]
            queries = perm[0, c.q0 : c.q1]
            assert (keys // 8 == queries[0] // 8).all()  # the same document
            assert keys.max() <= queries.max()


def simulate(q, k, v, sets, bounds, kernel):
    """The ring over members holding `sets` (global indices), run in this process, with dout = 1."""
    return simulated_ring(q, k, v, torch.ones_like(q), sets, bounds, kernel)


def assert_equals_reference(got, q, k, v, bounds):
    """(out, dq, dk, dv) equal the document attention of q, k, v and its gradients for dout = 1."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, bounds)
    ref.sum().backward()
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-5, atol=1e-5)
    for grad, leaf in zip(got[1:], leaves, strict=True):
        torch.testing.assert_close(grad, leaf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", [CPUFlashKernel(), MathKernel()], ids=["cpu-flash", "math"])
@pytest.mark.parametrize("cp_size,seed", [(2, 0), (3, 1), (4, 2)])
def test_simulated_ring_equals_document_attention(kernel, cp_size, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=9)  # documents shorter than a chunk, and longer than a rank's share
    cu, _, _ = pad_documents(torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32), cp_size)
    t = int(cu[-1])
    torch.manual_seed(seed)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    perm = zigzag_permutation(cu, cp_size)
    assert_equals_reference(simulate(q, k, v, list(perm.numpy()), cu.numpy(), kernel), q, k, v, cu.tolist())


def test_simulated_ring_over_ulysses_groups_and_chunk_samples():
    # hybrid: C = 4 as 2 groups of 2; units are whole samples of 32 tokens cut by documents anywhere (a chunk pack)
    bounds = np.array([0, 5, 6, 30, 45, 64, 70, 96])
    units = torch.arange(0, 97, 32, dtype=torch.int32)
    perm = zigzag_permutation(units, 4)
    sets = list(perm.reshape(2, -1).numpy())
    torch.manual_seed(3)
    q, k, v = torch.randn(96, 2, 8), torch.randn(96, 2, 8), torch.randn(96, 2, 8)
    assert_equals_reference(simulate(q, k, v, sets, bounds, CPUFlashKernel()), q, k, v, bounds.tolist())


@pytest.mark.parametrize("n_heads,n_kv,factor", [(4, 2, 4), (4, 2, 2), (8, 2, 4), (6, 3, 2), (12, 4, 6), (4, 4, 4)])
def test_ulysses_head_split_keeps_each_query_head_on_its_kv_head(n_heads, n_kv, factor):
    repeat = kv_repeat(n_kv, factor)
    assert (n_kv * repeat) % factor == 0
    kv_heads = np.repeat(np.arange(n_kv), repeat)  # the K/V head each repeated head copies
    h, hk = n_heads // factor, n_kv * repeat // factor
    for member in range(factor):
        for local in range(h):
            head = member * h + local  # the query head this member holds
            local_kv = local // (h // hk)  # GQA inside the member: h / hk queries per K/V head
            assert kv_heads[member * hk + local_kv] == head // (n_heads // n_kv)


def test_the_start_line_names_each_mode_s_kernel():
    from xprep.train import attention
    from xprep.train.cp import cp_attention_path
    from xprep.train.ring import RING_CPU_FLASH, RING_MATH, ring_path

    assert cp_attention_path("ring", "cpu", torch.float32, 16) == RING_CPU_FLASH
    assert cp_attention_path("hybrid", "cpu", torch.bfloat16, 16) == RING_CPU_FLASH
    assert cp_attention_path("ulysses", "cpu", torch.float32, 16) == attention.SDPA_PER_DOCUMENT  # whole documents
    assert cp_attention_path("allgather", "cpu", torch.float32, 16) == attention.SDPA_PER_PIECE
    assert ring_path("meta", torch.float32, 16) == RING_MATH
