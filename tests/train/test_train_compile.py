"""``--compile`` (issue 13): each block compiled by torch.compile (inductor) gives the eager losses and gradients,
with activation checkpointing (and loss weights, issue 36), and under FSDP2 on 2 gloo ranks.

Slow: inductor compiles C++ on the CPU (about a minute per process on the shared 2 cores, less once its
on-disk cache is warm).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from trainkit import CATEGORY_WEIGHTS, category_pack, cp_pack, grads, make_trainer, max_rel_diff
from xprep.train.loss import LossSums

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TOL = 1e-5

pytestmark = pytest.mark.slow


def test_compiled_blocks_match_eager(tmp_path):
    """With --category-weight too: the weighted loss is taken outside the compiled blocks, its weights reach them
    through the backward."""
    packed = category_pack(tmp_path)
    eager = make_trainer(packed, micro=1, accum=2, activation_checkpointing=True, category_weight=CATEGORY_WEIGHTS)
    compiled = make_trainer(packed, micro=1, accum=2, activation_checkpointing=True, compile=True,
                            category_weight=CATEGORY_WEIGHTS)
    assert all(hasattr(block._checkpoint_wrapped_module.forward, "_torchdynamo_orig_callable")
               for block in compiled.model.layers)
    counters.clear()
    for step in range(3):  # every micro-batch has another document layout
        a, b = eager.train_step(), compiled.train_step()
        assert abs(a.loss - b.loss) <= TOL * a.loss, step
        assert abs(a.grad_norm - b.grad_norm) <= TOL * a.grad_norm, step
        if step == 0:
            frames = counters["frames"]["ok"]
    assert frames > 0 and counters["frames"]["total"] == frames  # compiled, and never again for a new layout
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()  # checkpoints load either way


def test_compiled_blocks_under_fsdp2(tmp_path):
    """dp 2, and cp 2 under the default --cp-mode (ring: its attention runs between the compiled graphs)."""
    packed = cp_pack(tmp_path)
    out = tmp_path / "layouts.pt"
    layouts = ["2,1,2,ac,compile", "1,2,2,ac,compile"]
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "_train_parallel_worker.py"),
           str(packed), str(out), "4", *layouts]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(out, weights_only=True)
    ref = make_trainer(packed, micro=2, accum=2)
    sums, _, _ = ref.accumulate_gradients()
    loss = LossSums.from_flat(sums.flat()).loss
    for layout in layouts:
        assert abs(results[layout]["loss"] - loss) <= TOL * loss, layout
        assert max_rel_diff(results[layout]["grads"], grads(ref.model)) <= TOL, layout
