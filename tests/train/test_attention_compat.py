"""Which attention kernel runs where, checked on the CPU with stand-ins that honour the real kernels' contracts.

No GPU here. What these tests prove is the choice and the call around each CUDA kernel:

- torch's ``varlen_attn`` is called with only the keywords its installed signature has (2.10: ``is_causal``;
  2.11: ``scale``, ``window_size``; 2.12+: also ``enable_gqa``), and what an old signature lacks is done around
  it (a scale folded into q, K/V heads repeated for GQA), with results equal to one SDPA call per document;
- varlen is chosen only on compute capability >= 8.0, in half precision, for head dims the flash kernels take;
  elsewhere FlexAttention or SDPA serve, and a model whose head dim a kernel refuses is routed, not failed;
- flash-attn < 2.1 (top-left causal alignment when a query sequence is shorter than its keys) is refused for
  context parallelism and still used for whole documents, where the alignment does not matter.

The stand-ins run on CPU tensors; ``device_capability`` is pointed at a pretend GPU and float64 is let through
as a "half precision" dtype, so that results and gradients compare exactly against the CPU reference.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import xprep.train.attention as attention
import xprep.train.cp as cp
from xprep.prep.errors import XprepError
from xprep.train.attention import lower_right_causal_attention, sdpa_per_document, varlen_attention
from xprep.train.cp import local_pieces, pad_documents, piece_attention
from xprep.train.model import ModelConfig, Transformer

# ----------------------------------------------------------------------------- stand-ins


def _sequences(q, k, v, cu_q, cu_k, scale, causal, top_left=False):
    """What a varlen kernel computes, one sequence at a time: query sequence i over key sequence i."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    outs = []
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        qs, ks, vs = q[a:b], k[c:d], v[c:d]
        if causal and top_left:  # flash-attn < 2.1: query i sees keys 0..i
            ks, vs = ks[: b - a], vs[: b - a]
        lq, lk = qs.shape[0], ks.shape[0]
        # causal, bottom-right: query i sees keys up to lk - lq + i; else full attention (a kernel not told)
        allowed = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None] if causal else None
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (qs, ks, vs))
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale,
                                                               enable_gqa=qs.shape[1] != ks.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _check_inputs(q, k, same_heads):
    if q.shape[-1] % 8 or q.shape[-1] > 256:  # the flash kernels' own check
        raise RuntimeError("FlashAttention only supports head dimension a multiple of 8, at most 256")
    if same_heads and q.shape[1] != k.shape[1]:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={q.shape[1]} "
                         f"and Hkv={k.shape[1]}")


class Calls(list):
    """The keywords of every call a stand-in received."""


def varlen_2_10(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append({"is_causal": is_causal, "return_aux": return_aux})
        _check_inputs(query, key, same_heads=True)  # (T, H, D) for all three: no GQA in 2.10
        return _sequences(query, key, value, cu_seq_q, cu_seq_k, None, is_causal)

    return varlen_attn


def varlen_2_11(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1)):
        calls.append({"scale": scale, "window_size": window_size})
        _check_inputs(query, key, same_heads=True)
        assert window_size in ((-1, -1), (-1, 0))
        return _sequences(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))

    return varlen_attn


def varlen_installed(calls):
    """The installed torch's exact signature (2.12+ has enable_gqa), its CUDA kernel replaced by the reference."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        calls.append(kwargs)
        window_size = kwargs.get("window_size", (-1, -1))
        _check_inputs(query, key, same_heads=not kwargs.get("enable_gqa", False))
        return _sequences(query, key, value, cu_seq_q, cu_seq_k, kwargs.get("scale"), window_size == (-1, 0))

    real = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    varlen_attn.__signature__ = inspect.signature(real)
    return varlen_attn


def flash_attn_stand_in(version, calls):
    """flash-attn's varlen and dense functions; before 2.1 causal masks align top-left when Lq != Lk."""
    top_left = attention._version(version) < (2, 1)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        calls.append({"causal": causal, "softmax_scale": softmax_scale})
        _check_inputs(q, k, same_heads=False)  # flash-attn 2 takes GQA natively
        return _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, top_left)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        lq, lk = q.shape[1], k.shape[1]
        cu_q, cu_k = torch.tensor([0, lq]), torch.tensor([0, lk])
        return flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, lq, lk, 0.0, softmax_scale, causal)[None]

    return flash_attn_varlen_func, flash_attn_func


@pytest.fixture
def gpu(monkeypatch):
    """Every device (CPU tensors too) passes for a GPU of the capability set with ``gpu(major, minor)``; float64 passes
    for a half-precision dtype (exact comparisons); no flash-attn unless a test installs its stand-in."""
    monkeypatch.setattr(attention, "_FLASH_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention, "flash_attn_func", None)
    monkeypatch.setattr(attention, "FLASH_ATTN_VERSION", None)

    def set_capability(major, minor):
        monkeypatch.setattr(attention, "device_capability", lambda device: (major, minor))

    set_capability(8, 0)
    return set_capability


def _qkv(total, heads=4, kv_heads=2, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=g, dtype=dtype, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def _out_and_grads(fn, tensors):
    out = fn(*tensors)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return [out.detach(), *grads]


BOUNDS = [0, 5, 6, 26, 26, 35]


# ----------------------------------------------------------------------------- torch's varlen_attn signatures


@pytest.mark.parametrize("version,make,keywords", [
    ("2.10", varlen_2_10, ("is_causal", "return_aux")),
    ("2.11", varlen_2_11, ("return_aux", "scale", "window_size")),
    ("installed", varlen_installed, None),
])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_attn_gets_only_the_keywords_its_signature_has(gpu, monkeypatch, version, make, keywords, kv_heads,
                                                              scale):
    calls = Calls()
    stand_in = make(calls)
    monkeypatch.setattr(attention, "varlen_attn", stand_in)
    if keywords is not None:
        assert attention.varlen_signature() == keywords
    accepted = attention.varlen_signature()
    q, k, v = _qkv(BOUNDS[-1], kv_heads=kv_heads)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)

    got = _out_and_grads(lambda q, k, v: varlen_attention(q, k, v, cu, 20, scale=scale), (q, k, v))
    want = _out_and_grads(lambda q, k, v: sdpa_per_document(q, k, v, BOUNDS, scale), (q, k, v))

    assert len(calls) == 1  # one call for the whole row
    passed = calls[0] if version == "installed" else {key: val for key, val in calls[0].items()
                                                         if val != inspect.signature(stand_in).parameters[key].default}
    expected = {"is_causal": True} if "window_size" not in accepted else {"window_size": (-1, 0)}
    if scale is not None and "scale" in accepted:
        expected["scale"] = scale
    if kv_heads != 4 and "enable_gqa" in accepted:
        expected["enable_gqa"] = True
    assert passed == expected
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_installed_torch_varlen_signature_is_read():
    """What bench/gpu.py prints: the installed torch's keywords after the seven positional parameters."""
    real = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    names = tuple(inspect.signature(real).parameters)[7:]
    assert attention.varlen_signature() == names
    assert "window_size" in names or "is_causal" in names


def test_a_varlen_attn_that_cannot_be_asked_for_causal_attention_is_not_used(gpu, monkeypatch):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None):
        raise AssertionError("called")

    monkeypatch.setattr(attention, "varlen_attn", varlen_attn)
    q, k, v = (t.detach() for t in _qkv(BOUNDS[-1], dim=16))
    assert attention.varlen_kernel(q) is None
    assert attention.attention_path("cuda:0", torch.bfloat16, 64) == attention.FLEX
    got = varlen_attention(q, k, v, torch.tensor(BOUNDS, dtype=torch.int32), 20)  # FlexAttention, eager here
    torch.testing.assert_close(got, sdpa_per_document(q, k, v, BOUNDS))


@pytest.mark.parametrize("make", [varlen_2_10, varlen_2_11, varlen_installed])
def test_context_parallel_pieces_through_each_varlen_signature(gpu, monkeypatch, make):
    """Pieces shorter than their keys, GQA, through torch's varlen of each signature: equal to the per-piece loop."""
    calls = Calls()
    monkeypatch.setattr(attention, "varlen_attn", make(calls))
    cu = torch.tensor([0, 13, 15, 55, 62])
    bounds = pad_documents(cu, 2)[0].tolist()
    k_all, v_all = _qkv(bounds[-1], seed=1)[1:]
    pieces = local_pieces(bounds, bounds, 1, 2)
    q = _qkv(sum(e - s for s, e, _ in pieces), seed=2)[0]
    got = _out_and_grads(lambda q, k, v: piece_attention(q, k, v, pieces), (q, k_all, v_all))
    with monkeypatch.context() as m:
        m.setattr(cp, "varlen_kernel", lambda q: None)
        want = _out_and_grads(lambda q, k, v: piece_attention(q, k, v, pieces), (q, k_all, v_all))
    assert len(calls) == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- which path, by GPU and head dim


@pytest.fixture
def cuda_capability(monkeypatch):
    """``torch.cuda.get_device_capability`` of a pretend GPU (what attention_path reads for a "cuda" device)."""
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    monkeypatch.setattr(attention, "FLASH_ATTN_VERSION", None)
    monkeypatch.setattr(attention, "varlen_attn", varlen_installed(Calls()))

    def set_capability(major, minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))

    return set_capability


@pytest.mark.parametrize("capability,dtype,head_dim,path", [
    ((7, 5), torch.bfloat16, 64, attention.FLEX),  # T4: no flash kernels before Ampere
    ((7, 0), torch.float32, 128, attention.FLEX),  # V100
    ((8, 0), torch.bfloat16, 64, attention.TORCH_VARLEN),
    ((9, 0), torch.float16, 128, attention.TORCH_VARLEN),
    ((8, 0), torch.float32, 64, attention.FLEX),  # fp32 has no flash kernel
    ((8, 0), torch.bfloat16, 36, attention.FLEX),  # not a multiple of 8
    ((8, 0), torch.bfloat16, 320, attention.FLEX),  # over 256
    ((8, 0), torch.bfloat16, 200, attention.TORCH_VARLEN),  # 193..224: A100/H100 only
    ((8, 9), torch.bfloat16, 200, attention.FLEX),
    ((8, 0), torch.bfloat16, 12, attention.SDPA_PER_DOCUMENT),  # FlexAttention needs >= 16
])
def test_attention_path_on_a_gpu(cuda_capability, capability, dtype, head_dim, path):
    cuda_capability(*capability)
    assert attention.attention_path("cuda", dtype, head_dim) == path
    expected_cp = path if path in (attention.TORCH_VARLEN, attention.FLASH_VARLEN) else attention.SDPA_PER_PIECE
    assert attention.attention_path("cuda", dtype, head_dim, context_parallel=True) == expected_cp


def test_attention_path_on_cpu_and_with_flash_attn(cuda_capability, monkeypatch):
    assert attention.attention_path("cpu", torch.float32, 64) == attention.SDPA_PER_DOCUMENT
    assert attention.attention_path(torch.device("cpu"), torch.bfloat16, 64) == attention.SDPA_PER_DOCUMENT
    assert attention.attention_path("cpu", torch.float32, 64, context_parallel=True) == attention.SDPA_PER_PIECE
    cuda_capability(8, 0)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", flash_attn_stand_in("2.6.3", Calls())[0])
    monkeypatch.setattr(attention, "FLASH_ATTN_VERSION", "2.6.3")
    assert attention.attention_path("cuda", torch.bfloat16, 64) == attention.FLASH_VARLEN
    assert attention.attention_path("cuda", torch.bfloat16, 64, context_parallel=True) == attention.FLASH_VARLEN
    cuda_capability(7, 5)
    assert attention.attention_path("cuda", torch.float16, 64) == attention.FLEX


def test_pre_ampere_gpu_never_calls_a_varlen_kernel(gpu, monkeypatch):
    """Compute capability 7.x in half precision: FlexAttention (eager here, forward only), equal to the reference."""
    gpu(7, 5)
    calls = Calls()
    monkeypatch.setattr(attention, "varlen_attn", varlen_installed(calls))
    monkeypatch.setattr(attention, "flash_attn_varlen_func", flash_attn_stand_in("2.6.3", calls)[0])
    q, k, v = (t.detach() for t in _qkv(BOUNDS[-1], dim=16))
    assert attention.varlen_kernel(q) is None
    got = varlen_attention(q, k, v, torch.tensor(BOUNDS, dtype=torch.int32), 20)
    torch.testing.assert_close(got, sdpa_per_document(q, k, v, BOUNDS))
    assert calls == []
    gpu(8, 0)
    assert attention.varlen_kernel(q) is attention._flash_attn_kernel


@pytest.mark.parametrize("head_dim,path", [(36, attention.FLEX), (12, attention.SDPA_PER_DOCUMENT),
                                           (64, attention.TORCH_VARLEN)])
def test_a_model_whose_head_dim_the_kernels_refuse_is_routed_not_failed(gpu, monkeypatch, head_dim, path):
    """A JSON model with dim/n_heads the flash kernels refuse runs on the pretend GPU (whose varlen stand-in raises
    as the real kernel does) and gives the CPU's logits."""
    calls = Calls()
    monkeypatch.setattr(attention, "varlen_attn", varlen_installed(calls))
    model = Transformer(ModelConfig(vocab_size=50, dim=2 * head_dim, n_layers=1, n_heads=2, n_kv_heads=1))
    model.init_weights(seed=0)
    model.double()
    lengths = [9, 3, 20]
    ids = torch.randint(0, 50, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 9, 12, 32], dtype=torch.int32)
    with torch.no_grad():
        got = model(ids, pos, cu)
        with monkeypatch.context() as m:
            m.setattr(attention, "device_capability", lambda device: None)  # the CPU path
            want = model(ids, pos, cu)
    torch.testing.assert_close(got, want)
    assert len(calls) == (1 if path == attention.TORCH_VARLEN else 0)
    note = attention.check_head_dim(head_dim, "cuda")
    assert (note == "") == (path == attention.TORCH_VARLEN)
    if note:
        assert f"head dim {head_dim}" in note and path in note and "model JSON" in note


def test_check_head_dim():
    assert attention.check_head_dim(64, "cuda") == ""
    assert attention.check_head_dim(128, "cuda") == ""
    assert attention.check_head_dim(36, "cpu") == ""  # SDPA takes any head dim
    note = attention.check_head_dim(36, "cuda")
    assert "multiple of 8" in note and "FlexAttention serves it" in note
    assert "SDPA per document" in attention.check_head_dim(10, "cuda")
    assert "at most 256" in attention.check_head_dim(320, "cuda")
    assert "A100, H100" in attention.check_head_dim(200, "cuda")
    for bad in (0, 7, -8):
        with pytest.raises(XprepError, match="model JSON"):
            attention.check_head_dim(bad, "cuda")


# ----------------------------------------------------------------------------- flash-attn < 2.1


def _install_flash(monkeypatch, version):
    calls = Calls()
    varlen_func, dense_func = flash_attn_stand_in(version, calls)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen_func)
    monkeypatch.setattr(attention, "flash_attn_func", dense_func)
    monkeypatch.setattr(attention, "FLASH_ATTN_VERSION", version)
    return calls


def _cp_case():
    bounds = pad_documents(torch.tensor([0, 13, 15, 55]), 2)[0].tolist()
    k_all, v_all = _qkv(bounds[-1], seed=1)[1:]
    pieces = local_pieces(bounds, bounds, 1, 2)
    q = _qkv(sum(e - s for s, e, _ in pieces), seed=2)[0]
    return q, k_all, v_all, pieces


def test_flash_attn_before_2_1_is_refused_for_context_parallelism(gpu, monkeypatch):
    _install_flash(monkeypatch, "2.0.9")
    q, k, v, pieces = _cp_case()
    with pytest.raises(XprepError, match=r"flash-attn 2\.0\.9 .*top-left.*flash-attn>=2\.1.*uninstall flash-attn"):
        piece_attention(q, k, v, pieces)
    with pytest.raises(XprepError, match="2.0.9"):
        lower_right_causal_attention(q[:5], k[:20], v[:20])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(XprepError, match="2.0.9"):
        attention.attention_path("cuda", torch.bfloat16, 64, context_parallel=True)
    assert attention.attention_path("cuda", torch.bfloat16, 64) == attention.FLASH_VARLEN


def test_flash_attn_before_2_1_serves_whole_documents(gpu, monkeypatch):
    """Without CP every query sequence is as long as its keys: top-left and bottom-right agree."""
    calls = _install_flash(monkeypatch, "2.0.9")
    q, k, v = _qkv(BOUNDS[-1])
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    got = _out_and_grads(lambda q, k, v: varlen_attention(q, k, v, cu, 20), (q, k, v))
    want = _out_and_grads(lambda q, k, v: sdpa_per_document(q, k, v, BOUNDS), (q, k, v))
    assert calls == [{"causal": True, "softmax_scale": None}]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("version", ["2.1.0", "2.7.4.post1"])
def test_flash_attn_from_2_1_runs_context_parallel_pieces(gpu, monkeypatch, version):
    calls = _install_flash(monkeypatch, version)
    q, k, v, pieces = _cp_case()
    got = _out_and_grads(lambda q, k, v: piece_attention(q, k, v, pieces), (q, k, v))
    with monkeypatch.context() as m:
        m.setattr(cp, "varlen_kernel", lambda q: None)
        m.setattr(attention, "device_capability", lambda device: None)  # the CPU's per-piece loop
        want = _out_and_grads(lambda q, k, v: piece_attention(q, k, v, pieces), (q, k, v))
    assert len(calls) == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    tail = lower_right_causal_attention(q[:5].detach(), k[:20].detach(), v[:20].detach())  # flash_attn_func
    with monkeypatch.context() as m:
        m.setattr(attention, "device_capability", lambda device: None)
        torch.testing.assert_close(tail, lower_right_causal_attention(q[:5].detach(), k[:20].detach(),
                                                                      v[:20].detach()))
