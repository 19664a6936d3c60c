"""Every --cp-mode equals cp=1 on real packed data: loss, the logits of every real token and every parameter
gradient (fp32, 1e-5 relative), under torchrun on gloo with real send/recv and all-to-all.

The data: State of the Union addresses (Mistral tokenizer) cut into documents of 3 to 400 tokens, multipacked
with --cp-size 4 (many documents per bin, documents shorter than a zigzag chunk and longer than a rank's share,
padding), and the same documents as a chunk pack (documents crossing sample bounds, samples zigzagged whole), also
made with --attention causal (each sample one attention span across its documents, as Megatron's GPTDataset).
Without ../shared/data the same shapes come from random tokens. Modes: ring and ulysses at C = 2 and 4, hybrid
at C = 4 as 2 × 2, allgather (the reference) at C = 4 and 2; the tiny model with 4 heads over 2 K/V heads, and
with one K/V head and tied embeddings (Ulysses repeats K/V heads when fewer than C). The trainer's paths
(FSDP2, activation checkpointing, accumulation) under each mode are tests/train/test_parallel_equivalence.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED
from trainkit import make_dataset, random_docs
from xprep.prep.pack import PackConfig, pack
from xprep.train.data import PackedDataset

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TOL = 1e-5
CONFIGS = ["ring,2", "ulysses,2", "ring,4", "ulysses,4", "hybrid,4,2", "allgather,4", "allgather,2,chunk",
           "ring,2,chunk", "ulysses,4,chunk", "hybrid,4,2,chunk", "ring,4,mqa", "ulysses,4,mqa", "hybrid,4,2,mqa",
           "allgather,2,causal", "ring,2,causal", "ulysses,4,causal", "hybrid,4,2,causal"]


def real_or_random_docs(n: int = 120) -> tuple[list[np.ndarray], int]:
    """Documents of 3 to 400 tokens: pieces of real addresses when ../shared/data is here, else random tokens."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 400, size=n)
    tokenizer = SHARED / "tokenizers" / "mistral" / "tokenizer.json"
    if not tokenizer.is_file():
        return [d[:n_] for d, n_ in zip(random_docs(n, 400, 401, vocab=512), lengths, strict=True)], 512
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    texts = [p.read_text(errors="replace")[:6000] for p in sorted((SHARED / "corpora" / "sotu").iterdir())[:n]]
    ids = [e.ids for e in tok.encode_batch(texts)]
    return [np.array(ids[i % len(ids)][: lengths[i] - 1] + [2]) for i in range(n)], tok.get_vocab_size()


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("modes")
    docs, vocab = real_or_random_docs()
    make_dataset(root / "ds", docs, vocab_size=vocab)
    pack([root / "ds"], root / "multi", PackConfig(method="multipack", seq_len=512, cp_size=4))
    pack([root / "ds"], root / "chunk", PackConfig(method="chunk", seq_len=128))
    pack([root / "ds"], root / "causal", PackConfig(method="chunk", seq_len=128, attention="causal"))
    return root / "multi", root / "chunk", root / "causal"


def test_every_mode_equals_one_process(packs, tmp_path):
    causal = PackedDataset(packs[2], cp_size=4)
    several = [b for b in range(len(causal)) if len(causal.bins.items(b)[1]) > 1][:2]  # documents cross in them
    assert [causal[b]["cu_seqlens"].tolist() for b in several] == [[0, 128]] * 2  # each sample one span
    out = tmp_path / "modes.pt"
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=4", str(ROOT / "tests" / "_cp_modes_worker.py"),
           *(str(p) for p in packs), str(out), "0,1", ",".join(map(str, several)), *CONFIGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(out, weights_only=True)
    assert list(results) == CONFIGS
    for config, diffs in results.items():
        assert diffs["loss"] <= TOL and diffs["logits"] <= TOL and diffs["grads"] <= TOL, (config, diffs)
