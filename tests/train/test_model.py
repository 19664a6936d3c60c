"""The decoder and its attention kernels: document isolation, GQA, tying, init, config loading."""

from __future__ import annotations

import json
import math

import pytest
import torch
from xprep.prep.errors import XprepError
from xprep.train import attention
from xprep.train.attention import lower_right_causal_attention, sdpa_per_document, varlen_attention
from xprep.train.model import PRESETS, ModelConfig, Transformer, load_model_config

VOCAB = 97


def naive_attention(q, k, v, allowed):
    """Reference: explicit scores, -inf outside `allowed` (Lq, Lk), softmax, weighted sum; GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (Lk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def document_causal_mask(lengths: list[int]) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = doc.numel()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


def cu_from(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos, cu_from(lengths)


def tiny(**overrides) -> Transformer:
    model = Transformer(ModelConfig(vocab_size=VOCAB, **{**PRESETS["tiny"], **overrides}))
    model.init_weights(seed=0)
    return model


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_varlen_attention_matches_naive_reference(n_kv, dtype, tol):
    lengths = [7, 1, 12, 5]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths), 4, 8, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths), n_kv, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths), n_kv, 8, generator=g, dtype=dtype, requires_grad=True)
    out = varlen_attention(q, k, v, cu_from(lengths), max(lengths))
    ref = naive_attention(q, k, v, document_causal_mask(lengths))
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    grads = torch.autograd.grad((out * ref.detach().cos()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref.detach().cos()).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def autograd_node_names(t: torch.Tensor) -> set[str]:
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("n_kv", [4, 2])
def test_cpu_attention_uses_the_fused_kernel_not_math(n_kv):
    """3-D SDPA inputs silently fall back to the quadratic-memory math kernel on CPU; ours must not."""
    q = torch.randn(48, 4, 16, requires_grad=True)
    k, v = torch.randn(48, n_kv, 16), torch.randn(48, n_kv, 16)
    out = varlen_attention(q, k, v, cu_from([30, 18]), 30)
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in autograd_node_names(out)
    tail = lower_right_causal_attention(q[40:], k, v)
    assert not {"BmmBackward0", "SoftmaxBackward0"} & autograd_node_names(tail)


def test_sdpa_per_document_skips_empty_documents():
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    out = sdpa_per_document(q, q, q, [0, 0, 4, 4, 6])
    ref = naive_attention(q, q, q, document_causal_mask([4, 2]))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("fused", [True, False], ids=["lse-merge", "masked"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 11), (1, 4), (16, 64)])
def test_lower_right_causal_attention_is_the_tail_of_full_causal(lq, lk, dtype, tol, fused, monkeypatch):
    """Both CPU paths (two fused calls merged by log-sum-exp, and the masked fallback), values and grads."""
    monkeypatch.setattr(attention, "_CPU_FLASH_LSE", fused and attention._CPU_FLASH_LSE)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(lk, h, 8, generator=g, dtype=dtype) for h in (4, 2, 2))
    q_tail = q[lk - lq :].clone().requires_grad_()
    k.requires_grad_(), v.requires_grad_()
    allowed = document_causal_mask([lk])[lk - lq :]
    out = lower_right_causal_attention(q_tail, k, v)
    ref = naive_attention(q_tail, k, v, allowed)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    weight = torch.randn(ref.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad((out * weight).sum(), (q_tail, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q_tail, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- model


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 4, "tie_embeddings": True}])
def test_document_logits_do_not_depend_on_packing(overrides):
    model = tiny(**overrides)
    lengths = [13, 1, 29, 7, 18]
    ids, pos, cu = packed_batch(lengths)
    with torch.no_grad():
        packed = model(ids, pos, cu)
        assert packed.shape == (1, sum(lengths), VOCAB) and packed.dtype == torch.float32
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = model(ids[:, start:end], pos[:, start:end], cu_from([end - start]))
            torch.testing.assert_close(packed[:, start:end], alone, atol=1e-6, rtol=1e-6)


def test_rope_depends_on_position_ids_not_on_row_offset():
    model = tiny()
    ids, pos, cu = packed_batch([10])
    with torch.no_grad():
        base = model(ids, pos, cu)
        shifted = model(ids, pos + 5, cu)  # same relative positions: RoPE scores are unchanged
        torch.testing.assert_close(base, shifted, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base, model(ids, pos.flip(-1), cu))


def test_tied_and_untied_parameters():
    tied, untied = tiny(tie_embeddings=True), tiny()
    assert tied.output is None and untied.output is not None
    for model in (tied, untied):
        assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params()
    ids, pos, cu = packed_batch([6, 4])
    tied(ids, pos, cu).sum().backward()
    assert tied.tok_embeddings.weight.grad is not None


def test_init_is_deterministic_and_independent_of_device_build():
    a, b, c = tiny(), tiny(), Transformer(tiny().cfg)
    c.init_weights(seed=1)
    with torch.device("meta"):
        meta = Transformer(a.cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=0)
    for (name, pa), pb, pc, pm in zip(
        a.named_parameters(), b.parameters(), c.parameters(), meta.parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pm), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert a.layers[0].attention.wo.weight.std() < a.layers[0].attention.wq.weight.std()


def test_layers_are_a_module_list_of_blocks():
    model = tiny()
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == model.cfg.n_layers


def test_rejects_batched_rows():
    model = tiny()
    with pytest.raises(ValueError, match="one packed row"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), cu_from([4]))


# ----------------------------------------------------------------------------- config


def test_presets_span_tiny_to_1b():
    counts = {name: load_model_config(name, 32000).num_params() for name in PRESETS}
    assert list(counts) == ["tiny", "small", "medium", "1b"]
    assert counts["tiny"] < counts["small"] < counts["medium"] < counts["1b"]
    assert 0.9e9 < counts["1b"] < 1.3e9


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(XprepError, match="tiny, small, medium, 1b"):
        load_model_config("huge", 100)


def test_json_config(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"dim": 32, "n_layers": 1, "n_heads": 2}))
    cfg = load_model_config(str(path), 100)
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.ffn_dim) == (100, 2, 128)
    assert ModelConfig(**cfg.to_dict()) == cfg

    path.write_text(json.dumps({"dim": 32, "n_layer": 1}))
    with pytest.raises(XprepError, match="n_layer"):
        load_model_config(str(path), 100)
    path.write_text(json.dumps({"vocab_size": 50}))
    with pytest.raises(XprepError, match="smaller than the data's vocabulary"):
        load_model_config(str(path), 100)
    path.write_text("{not json")
    with pytest.raises(XprepError, match="JSON"):
        load_model_config(str(path), 100)
    with pytest.raises(XprepError, match="not found"):
        load_model_config(str(tmp_path / "missing.json"), 100)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"dim": 30, "n_heads": 4}, "multiple of n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"dim": 12, "n_heads": 4}, "even"),
        ({"n_layers": 0}, "n_layers"),
        ({"norm_eps": -1.0}, "norm_eps"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_config_checks_name_the_field(fields, match):
    with pytest.raises(XprepError, match=match):
        ModelConfig(vocab_size=10, **fields)
