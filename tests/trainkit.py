"""Test helpers for the trainer: small token datasets and hand-made pack entries.

Pack entries are written straight from their arrays and ``pack.json`` (prep/pack/entry.py layout),
so trainer tests do not depend on the packing algorithms.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner
from xprep.cli import xtrain
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter, TokenDataset
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.entry import MANIFEST, PACK_FORMAT, PACK_JSON, PackEntry
from xprep.train.config import ModelSection, OptimizerSection, ParallelSection
from xprep.train.cp import CPContext
from xprep.train.data import PackedDataset, collate
from xprep.train.dist import ParallelDims, full_tensor, param_dtype_for, plain_name
from xprep.train.loss_weights import LossWeights
from xprep.train.model import Transformer, load_model_config
from xprep.train.samplers import build_sampler
from xprep.train.trainer import Trainer, autocast_for, build_model


def make_dataset(out: Path, docs: list[np.ndarray], vocab_size: int = 256,
                 loss_masks: list[np.ndarray] | None = None, cats: list[np.ndarray] | None = None,
                 categories: list[str] | None = None, pad_id: int = 0, eod_id: int = 1) -> dict:
    """Write a token dataset with one document per array; returns its manifest."""
    with DatasetWriter(out, vocab_size) as w:
        for i, doc in enumerate(docs):
            w.append(np.asarray(doc), np.array([len(doc)]),
                     loss_mask=None if loss_masks is None else np.asarray(loss_masks[i], np.uint8),
                     category_ids=None if cats is None else np.asarray(cats[i], np.uint8))
        table = CategoryTable(["uncategorized", *(categories or [])])
        return w.finish({"tokenizer": {"path": "test", "vocab_size": vocab_size, "pad_id": pad_id,
                                       "eod_id": eod_id}}, table)


def sequential_bins(lengths: list[int], capacity: int) -> list[list[tuple[int, int, int]]]:
    """Greedy order-preserving packing: bins of (doc, start, len) items; overlong docs truncated."""
    bins, cur, used = [], [], 0
    for d, n in enumerate(lengths):
        n = min(n, capacity)
        if used + n > capacity:
            bins.append(cur)
            cur, used = [], 0
        cur.append((d, 0, n))
        used += n
    if cur:
        bins.append(cur)
    return bins


def write_pack(packed: Path, datasets: list[Path], bins: list[list[tuple[int, int, int]]], capacity: int,
               method: str = "sequential", key: str | None = None, **config) -> Path:
    """Write a pack cache with one entry holding ``bins``; returns the cache directory."""
    items = [it for b in bins for it in b]
    offsets = np.zeros(len(bins) + 1, np.int64)
    np.cumsum([len(b) for b in bins], out=offsets[1:])
    key = key or f"{method}{capacity}{len(items)}".ljust(64, "0")
    name = f"{method}-{key[:16]}"
    entry_dir = packed / name
    entry_dir.mkdir(parents=True)
    entry = PackEntry(
        path=entry_dir, meta={},
        bin_offsets=offsets,
        item_doc=np.array([i[0] for i in items], np.int64),
        item_start=np.array([i[1] for i in items], np.int64),
        item_len=np.array([i[2] for i in items], np.int32),
    )
    entry.write_arrays(entry_dir)
    meta = {
        "format": PACK_FORMAT, "complete": True, "key": key,
        "config": {"method": method, "capacity": capacity, **config},
        "datasets": [{"path": str(p), "fingerprint": TokenDataset(p).fingerprint} for p in datasets],
        "stats": {"bins": len(bins)},
    }
    (entry_dir / PACK_JSON).write_text(json.dumps(meta))
    (packed / MANIFEST).write_text(json.dumps({"format": PACK_FORMAT, "current": name,
                                               "entries": {name: {}}}))
    return packed


def random_docs(n: int, lo: int, hi: int, vocab: int = 256, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, int(rng.integers(lo, hi + 1)), dtype=np.int64) for _ in range(n)]


def category_pack(root: Path, n_docs: int = 40, capacity: int = 64, seed: int = 0) -> Path:
    """A dataset with loss masks and three categories, packed sequentially; returns the cache dir."""
    rng = np.random.default_rng(seed)
    docs = random_docs(n_docs, 4, 40, vocab=128, seed=seed)
    masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs]
    cats = [np.full(len(d), rng.integers(0, 4)) for d in docs]
    make_dataset(root / "ds", docs, vocab_size=128, loss_masks=masks, cats=cats, categories=["a", "b", "c"])
    return write_pack(root / "p", [root / "ds"], sequential_bins([len(d) for d in docs], capacity), capacity)


# --category-weight of the ``weighted`` layouts (tests/_train_parallel_worker.py) over the categories of
# ``category_pack`` and ``cp_pack``: one down, one up, one out of the gradient, and the uncategorized targets at 0.5
CATEGORY_WEIGHTS = {"uncategorized": 0.5, "a": 0.25, "b": 0.0, "c": 3.0}


def make_trainer(packed: Path, micro: int, accum: int, dims=None, sampler: str = "sequential", seed: int = 0,
                 lr: float = 1e-3, activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                 precision: str = "fp32", loss_chunk: int = 0, reduce_every_micro_batch: bool = True,
                 compile: bool = False, warmup: int = 0, category_weight: dict | None = None,
                 source_weight: dict | None = None):
    """A Trainer over the tiny model (built on the meta device, sharded, then initialized, as ``xtrain run``
    does), without a TrainConfig; the weights by name as --category-weight and --source-weight give them."""
    dims = dims or ParallelDims()
    device = torch.device("cpu")
    ds = PackedDataset(packed, cp_size=dims.cp)
    section = ModelSection("tiny", precision=precision, loss_chunk=loss_chunk, compile=compile)
    parallel = ParallelSection(reshard_after_forward=reshard_after_forward,
                               activation_checkpointing=activation_checkpointing)
    model, _ = build_model(section, parallel, ds.vocab_size, seed, dims, device)
    opt, sched = OptimizerSection(lr=lr, warmup=warmup).build(model, 100)
    smp = build_sampler(sampler, len(ds), micro, dims.dp_rank, dims.dp, seed)
    weights = LossWeights.build(category_weight, source_weight, ds.category_names, ds.source_names)
    return Trainer(model, opt, sched, ds, smp, dims, accum, device, grad_clip=1.0,
                   autocast=autocast_for(param_dtype_for(precision, "cpu"), device, dims), loss_chunk=loss_chunk,
                   reduce_every_micro_batch=reduce_every_micro_batch, loss_weights=weights)


def grads(model) -> dict:
    """Every parameter's whole gradient by plain name (FSDP2 shards gathered: a collective on every rank;
    the activation-checkpointing and compile wrappers' prefixes dropped)."""
    return {plain_name(n): full_tensor(p.grad.detach()).clone() for n, p in model.named_parameters()
            if p.grad is not None}


def params(model) -> dict:
    """Every parameter's whole value by plain name (FSDP2 shards gathered: a collective on every rank)."""
    return {plain_name(n): full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def cp_pack(root: Path, cp_size: int = 2, n_docs: int = 40, capacity: int = 64, seed: int = 0) -> Path:
    """A dataset with loss masks and three categories, packed by `xprep pack` (multipack) with
    ``--cp-size cp_size``; returns the cache dir."""
    rng = np.random.default_rng(seed)
    docs = random_docs(n_docs, 3, 40, vocab=128, seed=seed)
    masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs]
    cats = [np.full(len(d), rng.integers(0, 4)) for d in docs]
    make_dataset(root / "ds", docs, vocab_size=128, loss_masks=masks, cats=cats, categories=["a", "b", "c"])
    pack([root / "ds"], root / "p", PackConfig(method="multipack", seq_len=capacity, cp_size=cp_size))
    return root / "p"


def chunk_pack(root: Path, docs: list[np.ndarray], seq_len: int, **options) -> Path:
    """``docs`` as a dataset, packed by `xprep pack --method chunk --seq-len seq_len` (PackConfig ``options``);
    returns the cache dir."""
    make_dataset(root / "ds", docs, vocab_size=128)
    pack([root / "ds"], root / "p", PackConfig(method="chunk", seq_len=seq_len, **options))
    return root / "p"


def simulated_cp_logits(model: Transformer, shards: list[dict]) -> list[torch.Tensor]:
    """Each CP rank's logits (1, T_local, V) of its shard (train.cp.shard_batch), the ranks simulated in this process.

    One thread per rank runs the model's forward; their all-gathers meet at a barrier and concatenate
    what every rank contributed, in rank order, as a real CP group's would. No gradient.
    """
    size = len(shards)
    parts: list[torch.Tensor | None] = [None] * size
    barrier = threading.Barrier(size, timeout=60)
    logits: list[torch.Tensor | None] = [None] * size
    errors: list[BaseException] = []

    def gather_of(rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:
            parts[rank] = x
            barrier.wait()
            out = torch.cat(parts)
            barrier.wait()  # every rank has read this layer's parts before any overwrites them
            return out
        return gather

    def run(rank: int) -> None:
        shard = shards[rank]
        try:
            cp = CPContext.from_shard(shard, None, rank, size, gather=gather_of(rank))
            with torch.no_grad():
                logits[rank] = model(shard["input_ids"], shard["position_ids"], shard["cu_seqlens"], cp=cp)
        except BaseException as e:  # the other ranks stop waiting at the barrier, the test sees the error
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return logits


def tiny_model(vocab_size: int = 128) -> Transformer:
    """The tiny preset, seeded: for comparing a packed bin's logits with each piece's logits alone."""
    torch.manual_seed(0)
    model = Transformer(load_model_config("tiny", vocab_size))
    model.init_weights(0)
    return model


def bin_logits(model: Transformer, sample: dict) -> tuple[dict, torch.Tensor, list[int]]:
    """(batch, logits, cu_seqlens as a list) of one bin run as a micro-batch of one."""
    batch = collate([sample])
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    return batch, logits, batch["cu_seqlens"].tolist()


def alone_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one sequence ``ids`` (1, T) on its own, positions from 0."""
    n = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(n).unsqueeze(0), torch.tensor([0, n], dtype=torch.int32))


def naive_document_attention(q, k, v, lengths):
    """Causal attention within each document of ``lengths`` (GQA by repeating K/V), the slow obvious way."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = torch.ones(len(doc), len(doc), dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def assert_simulated_cp_attention(shards: list[dict], lengths: list[int], cp_size: int) -> None:
    """Each 'rank' of ``shards`` runs CPContext.attention with a fake all-gather; its outputs, and the gradients of
    every rank's loss summed, equal document attention over ``lengths`` (the tokens before sharding) in float64.

    The fake gather reads the other ranks' K/V from the same global leaves, so summing every rank's loss and
    backpropagating once gives what the real reduce-scatter would.
    """
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(t, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    weight = torch.randn(t, heads, dim, generator=g, dtype=torch.float64)
    ref = naive_document_attention(q, k, v, lengths)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    kv_global = torch.cat([k, v], dim=1)
    total = 0.0
    for r, shard in enumerate(shards):
        local = shard["global_index"]

        def fake_gather(x, r=r):
            parts = [kv_global[s["global_index"]] for s in shards]
            parts[r] = x  # this rank's own contribution goes through the code under test
            return torch.cat(parts)

        out = CPContext.from_shard(shard, None, r, cp_size, gather=fake_gather).attention(q[local], k[local], v[local])
        torch.testing.assert_close(out, ref[local].detach(), atol=1e-12, rtol=1e-12)
        total = total + (out * weight[local]).sum()
    for got, want in zip(torch.autograd.grad(total, (q, k, v)), ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def user_error(*args: str) -> str:
    """Run `xtrain run ARGS` in-process; assert exit 2 with one line on stderr; return it."""
    result = CliRunner().invoke(xtrain, ["run", *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def side_by_side(calls: list[Callable[[], object]]) -> list:
    """Each of ``calls`` (one that starts a process and waits for it), as many at a time as this process may use
    cores, in threads; their results, in order. For single-process ``xtrain run``s: each computes on one thread
    (OMP_NUM_THREADS=1) and spends most of its time importing torch, so that two cores take two at once."""
    with ThreadPoolExecutor(max(1, min(len(calls), len(os.sched_getaffinity(0))))) as pool:
        return list(pool.map(lambda call: call(), calls))
