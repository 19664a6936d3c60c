"""Run under torchrun by tests/train/test_cp_modes.py: the built-in model over each --cp-mode, against cp=1.

argv: PACKED CHUNK_PACKED CAUSAL_PACKED OUT BINS CAUSAL_BINS CONFIG... where a config is
``mode,C[,U][,chunk|causal][,mqa]`` (U: hybrid's Ulysses factor; chunk: the micro-batch of the chunk pack, whose
samples are zigzagged whole, documents crossing them; causal: of the chunk pack made with --attention causal, each
sample one attention span over its documents; mqa: the tiny model with one K/V head and tied embeddings instead of
4 heads over 2 K/V heads) and BINS the comma-separated bins of the one micro-batch of each pack (CAUSAL_BINS: of
the causal one). Every rank computes cp=1 itself (the whole micro-batch in one
row), then for each config: the ranks form groups of C (a (world/C, C) mesh, or (world/C, C/U, U) for hybrid,
as xtrain lays them out), each rank runs the model on its zigzag share through `cp_context`, and the loss
(summed over the CP group), the logits of every real token (gathered) and every parameter gradient (summed
over the CP group) are compared with cp=1 as relative differences. Rank 0 saves {config: {"loss", "logits",
"grads"}} (the differences) to OUT.
"""

import dataclasses
import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from xprep.train.cp import CPGroups, cp_context, pad_documents, shard_batch, ulysses_degree  # noqa: E402
from xprep.train.data import IGNORE, PackedDataset, collate  # noqa: E402
from xprep.train.model import Transformer, load_model_config  # noqa: E402

packed, chunk_packed, causal_packed = (Path(p) for p in sys.argv[1:4])
out, bins, causal_bins, configs = sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7:]
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
data = {}
for name, path in (("multi", packed), ("chunk", chunk_packed), ("causal", causal_packed)):
    ds = PackedDataset(path, cp_size=4)
    picked = causal_bins if name == "causal" else bins
    data[name] = (collate([ds[int(b)] for b in picked.split(",")]), ds.cp_sample_len)
vocab_size = ds.vocab_size


def loss_of(model, part, n_targets, cp=None):
    ce = model(part["input_ids"], part["position_ids"], part["cu_seqlens"], cp=cp, labels=part["labels"])
    return ce.sum() / n_targets


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


models = {}
for variant, changes in (("gqa", {}), ("mqa", {"n_kv_heads": 1, "tie_embeddings": True})):
    models[variant] = Transformer(dataclasses.replace(load_model_config("tiny", vocab_size), **changes))
    models[variant].init_weights(0)
wanted = {}
for (name, (batch, _)), (variant, model) in itertools.product(data.items(), models.items()):
    model.zero_grad()  # cp=1: the whole micro-batch in one row
    n_targets = int((batch["labels"] != IGNORE).sum())
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])[0]  # (T, V)
    loss = loss_of(model, batch, n_targets)
    loss.backward()
    wanted[name, variant] = (n_targets, logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})

results = {}
for config in configs:
    mode, size, *rest = config.split(",")
    size = int(size)
    name = next((r for r in rest if r in ("chunk", "causal")), "multi")
    variant = "mqa" if "mqa" in rest else "gqa"
    rest = [r for r in rest if r not in ("chunk", "causal", "mqa")]
    batch, sample_len = data[name]
    model = models[variant]
    n_targets, want_logits, want_loss, want_grads = wanted[name, variant]
    factor = ulysses_degree(mode, size, int(rest[0]) if rest else None)
    mesh = init_device_mesh("cpu", (world // size, size // factor, factor), mesh_dim_names=("dp", "ring", "ulysses"))
    cp_mesh = mesh["ring", "ulysses"]._flatten("cp")
    groups = CPGroups(cp_mesh.get_group(), mesh["ring"].get_group(), mesh["ulysses"].get_group())
    cp_rank = dist.get_rank(groups.cp)
    shard = shard_batch(batch, cp_rank, size, sample_len)
    cp = cp_context(shard, mode, cp_rank, size, factor, groups)
    model.zero_grad()
    loss = loss_of(model, shard, n_targets, cp)
    loss.backward()
    dist.all_reduce(loss.detach(), group=groups.cp)
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=groups.cp)
        grads[n] = rel(p.grad, want_grads[n])
    with torch.no_grad():
        logits = model(shard["input_ids"], shard["position_ids"], shard["cu_seqlens"], cp=cp)[0]
    index = shard["global_index"]
    if sample_len is None:  # padded documents: padding tokens have no cp=1 counterpart
        _, source, offset = pad_documents(batch["cu_seqlens"], size)
        real, index = offset[index] == 0, source[index]
    else:
        real = torch.ones_like(index, dtype=torch.bool)
    logits_diff = rel(logits[real], want_logits[index[real]])
    diffs = [None] * world
    dist.all_gather_object(diffs, {"loss": rel(loss.detach(), want_loss), "logits": logits_diff,
                                   "grads": max(grads.values())})
    results[config] = {key: max(d[key] for d in diffs) for key in diffs[0]}
if rank == 0:
    torch.save(results, out)
dist.destroy_process_group()
