"""The one-call attention paths that CUDA takes (train/attention.py, train/cp.py), checked on the CPU.

No GPU here: the varlen kernels (flash-attn's, torch's ``varlen_attn``) only run on CUDA. What these tests
prove is everything around the kernel: the query and key ``cu_seqlens``, the key rows gathered for each
context-parallel piece, the GQA heads and the order of the output rows. A CPU stand-in with the kernels'
contract (query sequence i over key sequence i, causal aligned bottom-right) takes the kernel's place,
and the results and gradients must equal the per-document / per-piece loops the CPU runs.
FlexAttention's document block mask is checked in its forward (it has no CPU backward, FACTS.md).
"""

from __future__ import annotations

import pytest
import torch
import xprep.train.attention as attention
import xprep.train.cp as cp
from xprep.train.attention import lower_right_causal_attention, sdpa_per_document, varlen_attention
from xprep.train.cp import local_pieces, pad_documents, piece_attention


def cpu_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The varlen kernels' contract on the CPU, one sequence at a time."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    q_lens, k_lens = (torch.tensor(cu).diff().tolist() for cu in (cu_q, cu_k))
    assert max_q == max(q_lens) and max_k == max(k_lens)
    outs = [lower_right_causal_attention(q[a:a + m], k[c:c + n], v[c:c + n], scale)
            for a, m, c, n in zip(cu_q, q_lens, cu_k, k_lens, strict=False)]
    return torch.cat(outs)


@pytest.fixture
def stand_in(monkeypatch):
    """Every CPU tensor takes the one-call path, with the stand-in as its kernel."""
    calls = []

    def kernel_for(q):
        return lambda *args: calls.append(args[3:7]) or cpu_varlen_kernel(*args)

    monkeypatch.setattr(attention, "varlen_kernel", kernel_for)
    monkeypatch.setattr(cp, "varlen_kernel", kernel_for)
    return calls


def _qkv(total, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _grads(fn, tensors):
    out = fn(*tensors)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("lengths", [[37], [5, 1, 20, 0, 9], [1] * 6 + [30]])
def test_one_varlen_call_equals_one_sdpa_per_document(stand_in, lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v = _qkv(bounds[-1])
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(lengths)
    got = _grads(lambda q, k, v: varlen_attention(q, k, v, cu, longest), (q, k, v))
    want = _grads(lambda q, k, v: sdpa_per_document(q, k, v, bounds), (q, k, v))
    assert len(stand_in) == 1  # one call for the whole row
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_pieces_in_one_varlen_call_equal_the_loop(stand_in, monkeypatch, cp_size):
    """Each rank's pieces (zigzag chunks cut at document ends) over the gathered keys: one call."""
    lengths = torch.tensor([13, 2, 40, 7])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    padded, _, _ = pad_documents(cu, cp_size)
    bounds = padded.tolist()
    k_all, v_all = _qkv(bounds[-1], seed=1)[1:]
    for rank in range(cp_size):
        pieces = local_pieces(bounds, bounds, rank, cp_size)
        q = _qkv(sum(e - s for s, e, _ in pieces), seed=2 + rank)[0]
        got = _grads(lambda q, k, v, pieces=pieces: piece_attention(q, k, v, pieces), (q, k_all, v_all))
        calls = len(stand_in)
        with monkeypatch.context() as m:  # the per-piece loop, as the CPU runs it
            m.setattr(cp, "varlen_kernel", lambda q: None)
            want = _grads(lambda q, k, v, pieces=pieces: piece_attention(q, k, v, pieces),
                          (q, k_all, v_all))
        assert calls == rank + 1  # one call per rank's attention
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b)


def test_kernel_choice():
    """CPU tensors never take a CUDA kernel; the choice needs CUDA and half precision."""
    assert attention.varlen_kernel(torch.zeros(2, 1, 4)) is None
    assert attention.varlen_kernel(torch.zeros(2, 1, 4, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("bounds", [[0, 5, 6, 26, 26, 35], [0, 300, 301, 301, 700], [0, 128, 256, 384]])
def test_flex_document_mask_equals_one_sdpa_per_document(bounds):
    """The FlexAttention path (CUDA without a varlen kernel) on its CPU reference: same outputs. The longer rows
    span several 128-token tiles, full ones (the mask_mod skipped) among them."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (t.detach().float() for t in _qkv(bounds[-1]))
    got = attention.flex_document_attention(q, k, v, bounds)
    torch.testing.assert_close(got, sdpa_per_document(q, k, v, bounds), atol=1e-5, rtol=1e-5)
    assert attention._document_block_mask.cache_info().currsize >= 1  # built once per bounds


def _random_bounds(seed, count):
    g = torch.Generator().manual_seed(seed)
    cases = [[0, 1], [0, 128], [0, 300], [0, 5, 5, 9], [0, 128, 256, 384], [0, 127, 129, 640, 640]]
    for _ in range(count):
        total = int(torch.randint(1, 1100, (1,), generator=g))
        cuts = torch.randint(0, total + 1, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        cases.append([0, *sorted(cuts.tolist()), total])
    return cases


def test_document_block_mask_equals_create_block_mask():
    """The mask built from the bounds at tile granularity is create_block_mask's of the same mask_mod, field for
    field (partial and full tiles, in the same order), for random bounds: empty documents, rows cut mid-tile."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    for bounds in _random_bounds(0, 16):
        doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
        want = flex.create_block_mask(lambda b, h, q, kv, doc=doc: (doc[q] == doc[kv]) & (q >= kv), None, None,
                                      bounds[-1], bounds[-1], device="cpu")
        got = attention.document_block_mask(bounds, "cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (bounds, name)
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
        assert torch.equal(got.to_dense(), want.to_dense())


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op run under it, with its keyword arguments, and the most elements of any tensor it made."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.setdefault(str(func), []).append(kwargs or {})
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_document_block_mask_is_tiles_not_tokens_squared_and_never_waits_for_the_device():
    """At T = 8,269 no tensor the mask makes is larger than the (T/128)^2 tile grid or the (T,) document ids
    (create_block_mask's is T^2 = 68M elements: 647 MiB of peak memory on this CPU), and no op reads a device value
    back to the host (.item(), nonzero, repeat_interleave without output_size)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    bounds = [0, 100, 2000, 2000, 5000, 8192 + 77]
    total, tiles = bounds[-1], -(-bounds[-1] // 128)
    with _Recorder() as rec:
        attention.document_block_mask(bounds, "cpu")
    assert rec.largest <= max(total, tiles * (tiles + 1))
    assert not {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"} & set(rec.ops)
    assert all(kw.get("output_size") == total for kw in rec.ops["aten.repeat_interleave.Tensor"])
