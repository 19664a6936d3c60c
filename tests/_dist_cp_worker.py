"""torchrun worker for tests/test_cp.py: the tiny model with cp=WORLD equals cp=1 (loss, logits, grads).

Every rank builds the same model and packed batch, computes the single-process reference
itself, then the context-parallel forward/backward on its zigzag shard; gradients are summed
over the CP group (what FSDP's sum reduction would do). Both kinds of zigzag units: padded
documents, and whole samples of a chunk pack (``SAMPLE_LEN``: documents across chunk bounds).
Exit status 0 = equal, 1 = mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from xprep.train.cp import CPContext, shard_batch
from xprep.train.model import PRESETS, ModelConfig, Transformer

VOCAB = 101
TOL = 1e-5
SAMPLE_LEN = 48  # two chunk samples of documents 5, 30, 13 | 20, 28: a multiple of 2·C for C = 2 and 4
SAMPLE_DOCS = [5, 30, 13, 20, 28]


def make_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A packed row with labels shifted inside each document (-100 at document ends and at random)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(0, VOCAB, (1, t), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, cu[1:].long() - 1] = -100
    labels[torch.rand(1, t, generator=g) < 0.2] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "category_ids": torch.randint(1, 4, (1, t), generator=g),
        "cu_seqlens": cu,
    }


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check(cfg: ModelConfig, lengths: list[int], seed: int, rank: int, size: int,
          sample_len: int | None = None) -> dict[str, float]:
    """Relative errors of cp=size against the single-process run: loss, real-token logits, each grad.

    ``sample_len``: shard whole samples of that many tokens (chunk packs) instead of each document."""
    model = Transformer(cfg)
    model.init_weights(seed)
    batch = make_batch(lengths, seed)
    n_targets = int((batch["labels"] != -100).sum())

    ref_logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    ref_loss = loss_sum(ref_logits, batch["labels"]) / n_targets
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    shard = shard_batch(batch, rank, size, sample_len)
    cp = CPContext.from_shard(shard, dist.group.WORLD, rank, size)
    logits = model(shard["input_ids"], shard["position_ids"], shard["cu_seqlens"], cp=cp)
    loss = loss_sum(logits, shard["labels"]) / n_targets
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    errors = {"loss": rel_err(total, ref_loss)}
    # Real (non-padding) local tokens must reproduce the reference logits at their global index.
    doc_of_padded = torch.searchsorted(shard["cu_seqlens_padded"].long(), shard["global_index"], right=True) - 1
    offset = shard["global_index"] - shard["cu_seqlens_padded"].long()[doc_of_padded]
    lengths_t = torch.diff(batch["cu_seqlens"]).long()
    real = offset < lengths_t[doc_of_padded]
    source = batch["cu_seqlens"].long()[doc_of_padded] + offset
    errors["logits"] = rel_err(logits[0, real], ref_logits[0, source[real]])
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        errors[f"grad {name}"] = rel_err(grad, ref_grads[name])
    return errors


def main() -> int:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    lengths = [*torch.randint(1, 40, (7,), generator=g).tolist(), 97]  # same on every rank
    cases = [
        ModelConfig(vocab_size=VOCAB, **PRESETS["tiny"]),  # GQA 4/2, untied
        ModelConfig(vocab_size=VOCAB, **{**PRESETS["tiny"], "n_kv_heads": 1, "tie_embeddings": True}),
    ]
    failed, worst = False, 0.0
    for i, cfg in enumerate(cases):
        for docs, sample_len in ((lengths, None), (SAMPLE_DOCS, SAMPLE_LEN)):
            for what, err in check(cfg, docs, seed=i, rank=rank, size=size, sample_len=sample_len).items():
                worst = max(worst, err)
                if not err <= TOL:  # also catches NaN
                    failed = True
                    print(f"rank {rank} case {i} lengths {docs} sample_len {sample_len}: {what} relative error "
                          f"{err:.2e}", file=sys.stderr)
    if not failed:
        print(f"rank {rank}: cp={size} equals cp=1 (worst relative error {worst:.1e})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
