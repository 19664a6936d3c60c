"""Density on real SFT lengths: chitchat rendered with the Qwen3 chat template, tokenized by the CLI.

Skips when ../shared/data (relative to the repository root) is absent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.pack.cache import PackConfig
from xprep.prep.pack.kernels import pack_lengths

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT.parent / "shared" / "data"
CHITCHAT = DATA / "chat" / "chitchat.jsonl"
QWEN3 = DATA / "tokenizers" / "qwen3"


@pytest.fixture(scope="session")
def chitchat_lengths(tmp_path_factory):
    if not CHITCHAT.is_file() or not QWEN3.is_dir():
        pytest.skip(f"real data not found under {DATA}")
    out = tmp_path_factory.mktemp("chitchat") / "ds"
    result = subprocess.run([sys.executable, "-c", "from xprep import cli; cli.xprep()", "tokenize", str(CHITCHAT),
                             "-o", str(out), "--tokenizer", str(QWEN3)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return TokenDataset(out).lengths


@pytest.mark.parametrize("capacity", [2048, 4096, 8192])
def test_multipack_is_as_dense_as_plain_ffd_and_near_the_bound(chitchat_lengths, capacity):
    grouped = pack_lengths(chitchat_lengths, PackConfig(method="multipack", seq_len=capacity)).stats
    plain = pack_lengths(chitchat_lengths, PackConfig(method="multipack", seq_len=capacity,
                                                      group_size=len(chitchat_lengths))).stats
    assert grouped["bins"] <= plain["bins"]
    if capacity == 8192:
        assert grouped["gap_to_lower_bound"] <= 0.001
    for method in ("sequential", "token-aware"):  # order-preserving methods: looser, never over capacity
        kw = {"max_tokens": capacity} if method == "token-aware" else {"seq_len": capacity}
        s = pack_lengths(chitchat_lengths, PackConfig(method=method, overlong="drop", **kw)).stats
        assert s["tokens"] == grouped["tokens"] and s["bins"] >= grouped["bins"]
