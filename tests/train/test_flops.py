"""train/flops.py: the 6N (PaLM, torchtitan) count beside the project's, and the peak a run is measured against:
by precision (bf16, TF32, plain fp32) and never for a MIG slice. CUDA is a stand-in: torch.cuda's name lookup is
monkeypatched, as the GPU would answer it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from xprep.train.flops import PEAK_TFLOPS, ModelFlops, Throughput, causal_pairs, resolve_peak_tflops, table_peak_tflops
from xprep.train.model import ModelConfig, Transformer

CUDA0 = torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------- 6N
def torchtitan_params(model: nn.Module) -> int:
    """N as torchtitan's get_nparams_and_active_nparams counts it on a built model: every parameter once, less
    the embedding tables that are not also the output head (here: the table, unless the model ties it)."""
    params = {id(p): p.numel() for p in model.parameters()}
    head = {id(p) for p in model.output.parameters()} if model.output is not None else {
        id(model.tok_embeddings.weight)}  # tied: the output head is the embedding's weight
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            for p in m.parameters(recurse=False):
                if id(p) not in head:
                    params[id(p)] = 0
    return sum(params.values())


def test_6n_flops_per_token_by_hand():
    """6·N + 12·L·H·D·T for a small GQA model, each term counted by hand."""
    cfg = ModelConfig(vocab_size=1000, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160)
    # per layer: wq 64·64, wk and wv 64·32 each, wo 64·64, w1 w2 w3 64·160 each, two RMSNorm weights of 64
    layer = 4096 + 2048 + 2048 + 4096 + 3 * 10240 + 2 * 64
    n = 3 * layer + 64 + 1000 * 64  # + the final norm, + the output head; the embedding table is out
    assert n == 193_472
    flops = ModelFlops.of(cfg)
    assert flops.non_embedding_params == n
    assert flops.per_token_6n(256) == 6 * 193_472 + 12 * 3 * 4 * 16 * 256 == 1_750_656


@pytest.mark.parametrize("shape", [dict(), dict(tie_embeddings=True), dict(qkv_bias=True, n_kv_heads=6)])
def test_6n_matches_torchtitans_count_of_the_built_model(shape):
    """N is what torchtitan counts on the model itself (norms and biases in; an untied table out, a tied one kept
    as the output head), and the attention term is its 12·l·h·q·t with q = dim / n_heads."""
    cfg = ModelConfig(vocab_size=300, dim=48, n_layers=2, n_heads=6, ffn_dim=96, **{"n_kv_heads": 2, **shape})
    model = Transformer(cfg)
    flops = ModelFlops.of(cfg)
    assert flops.non_embedding_params == torchtitan_params(model)
    layers, h, q, t = cfg.n_layers, cfg.n_heads, cfg.dim // cfg.n_heads, 512
    assert flops.per_token_6n(t) == 6 * torchtitan_params(model) + 12 * layers * h * q * t
    assert ModelFlops.from_dict(cfg.to_dict()) == flops  # from the config a run records
    assert ModelFlops(1, 1).per_token_6n(t) is None  # no parameter count: no 6N figure


def test_both_mfus_of_a_step():
    """A step of 2 rows of one whole document each: mfu counts T(T+1)/2 causal pairs per row, mfu_6n every token
    against all T positions; both over the same real tokens, GPUs and peak."""
    cfg = ModelConfig(vocab_size=1000, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160)
    flops, t = ModelFlops.of(cfg), 256
    tokens, pairs, seconds = 2 * t, causal_pairs([t, t]), 0.5
    rates = Throughput(flops, peak_tflops=100.0, world_size=4, seq_len=t).measure(tokens, pairs, seconds)
    tflops, mfu, mfu_6n = rates  # a 3-tuple with names
    assert rates.tflops == tflops == pytest.approx(flops.step(tokens, pairs) / seconds / 4 / 1e12)
    assert mfu == pytest.approx(tflops / 100)
    assert mfu_6n == pytest.approx(1_750_656 * tokens / seconds / 4 / 100e12)
    assert mfu_6n > mfu  # the 6N convention counts the masked half of causal attention too
    assert Throughput(flops, 100.0, 4).measure(tokens, pairs, seconds) == (tflops, mfu, None)  # no seq_len
    assert Throughput(flops, None, 4, t).measure(tokens, pairs, seconds) == (tflops, None, None)  # no peak
    assert Throughput(None, 100.0, 4, t).measure(tokens, pairs, seconds) == (None, None, None)  # no model FLOPs


# ---------------------------------------------------------------------------------------------- peak
@pytest.fixture
def gpu(monkeypatch):
    """Make torch.cuda answer as a GPU named as the test says (and no CUDA_VISIBLE_DEVICES)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def named(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return named


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                                  "NVIDIA H200 MIG 1c.3g.71gb"])
def test_a_mig_slice_gets_no_peak(gpu, name):
    """A MIG slice is named after the whole GPU: the table would give the whole GPU's peak, several times the
    slice's. No MFU then, and the start line says why and how to set one."""
    gpu(name)
    for precision in ("bf16", "fp32"):
        peak, note = resolve_peak_tflops(CUDA0, precision=precision)
        assert peak is None, note
        assert note.startswith(f"MFU not reported: {name} is a MIG slice") and "give --peak-tflops" in note
    assert resolve_peak_tflops(CUDA0, 120.0) == (120.0, "MFU against --peak-tflops 120 per GPU")  # the user's


def test_a_mig_slice_selected_by_uuid(gpu, monkeypatch):
    """CUDA_VISIBLE_DEVICES=MIG-<uuid> marks the slice even where its name would not."""
    gpu("NVIDIA A100-SXM4-80GB")
    assert resolve_peak_tflops(CUDA0)[0] == 312.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-9d7ef4e6-2b5e-5b6c-8bd3-0123456789ab")
    assert resolve_peak_tflops(CUDA0)[0] is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0c4d, MIG-9d7ef4e6")
    assert resolve_peak_tflops(CUDA0)[0] == 312.0 and resolve_peak_tflops(torch.device("cuda", 1))[0] is None


@pytest.mark.parametrize("name, precision, tf32, peak, says", [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.0, "the bf16 dense peak of NVIDIA H100 80GB HBM3;"),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.5, "the TF32 dense peak of NVIDIA H100 80GB HBM3: fp32 matmuls"),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0, "the plain fp32 peak of NVIDIA H100 80GB HBM3: TF32 is off"),
    ("NVIDIA H200", "fp32", True, 494.5, "TF32"),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0, "TF32"),
    ("NVIDIA L4", "fp32", True, 60.0, "TF32"),
    ("Tesla V100-SXM2-16GB", "fp32", True, 15.7, "which has no TF32 tensor cores"),  # pre-Ampere: plain fp32
    ("Tesla V100-PCIE-32GB", "fp32", True, 14.0, "which has no TF32 tensor cores"),
    ("Tesla T4", "fp32", True, 8.1, "which has no TF32 tensor cores"),
    ("AMD Instinct MI250X", "fp32", True, 95.7, "which has no TF32 tensor cores"),
    ("Tesla T4", "bf16", True, None, "the table has no bf16 figure for Tesla T4; give --peak-tflops"),
    ("NVIDIA A10G", "fp32", True, None, "the table has no fp32 figure for NVIDIA A10G"),
])
def test_the_peak_is_of_the_precision_the_run_computes_in(gpu, name, precision, tf32, peak, says):
    """fp32 on CUDA is measured against the TF32 tensor-core peak where the GPU has TF32 and the run allows it,
    else the plain fp32 rate; bf16 against bf16. The start line says which."""
    gpu(name)
    got, note = resolve_peak_tflops(CUDA0, None, precision, tf32)
    assert got == peak and says in note, note
    assert table_peak_tflops(name, precision, tf32) == peak


def test_the_old_calls_still_mean_bf16(gpu):
    gpu("NVIDIA H100 PCIe")
    assert resolve_peak_tflops(CUDA0) == resolve_peak_tflops(CUDA0, None, "bf16") == (
        756.0, "MFU against 756 TFLOPS per GPU (the bf16 dense peak of NVIDIA H100 PCIe; --peak-tflops to change)")
    assert table_peak_tflops("NVIDIA H100 PCIe") == 756.0
    with pytest.raises(ValueError, match="fp16"):
        resolve_peak_tflops(CUDA0, None, "fp16")


def test_peak_table_is_ordered_by_rate():
    """A typing slip in the table shows as a TF32 rate above bf16 or a plain fp32 rate above TF32."""
    for key, p in PEAK_TFLOPS:
        rates = [r for r in (p.bf16, p.tf32, p.fp32) if r is not None]
        assert rates == sorted(rates, reverse=True) and rates, key
        if p.bf16 is not None and p.tf32 is not None and key.startswith(("H", "A100", "A800", "B", "GB")):
            assert p.tf32 == pytest.approx(p.bf16 / 2), key  # data-center Ampere, Hopper, Blackwell: TF32 = bf16/2
