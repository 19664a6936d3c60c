"""bench/parallel.py's section 3 (the K/V memory of the CP modes): its exact meter, and the figures of each mode.

The meter is checked in this process on tensors whose K/V content is known (element by element, through
data movement only) and on the no-CP stack, where every layer keeps exactly its K and V. One launch at C=2
under torchrun then checks what each mode keeps for backward against its layout: allgather the whole row's
K/V on every rank, ring and Ulysses half of it (about 10 s on two shared cores).
"""

from __future__ import annotations

import torch
from xprep.train.model import rope_cos_sin

from bench import parallel

CFG = parallel.BenchConfig(modes_seq=512, modes_docs=4, modes_layers=2, modes_steps=1, timeout=300.0)
HEAD_DIM = CFG.modes_dim // CFG.modes_heads
LAYER_KV = CFG.modes_seq * 2 * CFG.modes_kv_heads * HEAD_DIM * 4  # one layer's K and V for the whole row, fp32


def test_meter_follows_kv_element_by_element_through_data_movement_only():
    meter = parallel.TensorMeter()
    with meter:
        q, k, v = torch.randn(64, 4, 8), torch.randn(64, 2, 8), torch.randn(64, 2, 8)
        meter.mark_kv(k, v)
        assert meter.live_kv == 2 * k.nbytes
        bundle = torch.cat([q, k, v], dim=1)  # (64, 8, 8): Q, K and V in one buffer, as Ulysses sends them
        assert meter.live_kv == 4 * k.nbytes
        keys = bundle[:, 4:6].index_select(0, torch.arange(0, 64, 2))  # every other token's K: all of it K
        assert meter.live_kv == 4 * k.nbytes + keys.nbytes
        received = torch.empty_like(keys)  # a ring's receive buffer: the layout of the block it sends
        assert meter.live_kv == 4 * k.nbytes + 2 * keys.nbytes
        scores = torch.einsum("qhd,khd->hqk", q[:, :2], k)  # computed from K: not K/V
        assert meter.live_kv == 4 * k.nbytes + 2 * keys.nbytes
        peak_kv = meter.live_kv
        del bundle, keys, received
        torch.zeros(1)  # the next storage made: the freed ones are dropped
        assert meter.live_kv == 2 * k.nbytes
    assert meter.peak_kv == peak_kv
    assert meter.peak >= peak_kv + scores.nbytes + q.nbytes


def test_no_cp_stack_keeps_every_layers_k_and_v():
    layers = parallel.build_stack(CFG)
    attend, index, positions = parallel.mode_attention(parallel.modes_row(CFG), parallel.NO_CP, None, 0, 1)
    cos, sin = rope_cos_sin(positions, HEAD_DIM, 10000.0)
    x = torch.randn(len(index), CFG.modes_dim)
    meter = parallel.TensorMeter()
    with meter:
        parallel.stack_step(layers, parallel.ModeRun(attend, x, x, cos, sin), parallel.metered(attend, meter))
    saved, saved_kv = meter.saved_bytes()
    assert saved_kv == CFG.modes_layers * LAYER_KV
    assert meter.peak_kv == CFG.modes_layers * LAYER_KV  # no copies: the K and V themselves, saved
    assert saved > saved_kv  # queries and outputs too
    assert meter.peak > saved


def test_each_mode_keeps_its_share_of_kv_at_cp2():
    result = parallel.launch(CFG, "modes", 2)
    modes = result["modes"]
    assert list(modes) == ["allgather", "ring", "ulysses"]
    kept = {"allgather": LAYER_KV, "ring": LAYER_KV // 2, "ulysses": LAYER_KV // 2}  # per layer and rank
    for mode, m in modes.items():
        assert len(m["ranks"]) == 2
        for rank in m["ranks"]:
            assert rank["saved_kv"] == CFG.modes_layers * kept[mode], mode
            assert rank["kv_peak"] >= rank["saved_kv"], mode
    assert max(r["kv_peak"] for r in modes["ring"]["ranks"]) < min(r["kv_peak"] for r in modes["allgather"]["ranks"])
    losses = [m["loss"] for m in modes.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
