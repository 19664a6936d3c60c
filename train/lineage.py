"""Data lineage of a run (``xprep inspect runs/NAME --seen [--step N]``): the documents trained on up to a step.

A run's data order is a function of a few recorded facts, so it is recomputed rather than logged: the pack
entry (run.json names it, with its key), the sampler's kind and seed (a checkpoint's trainer.json, else
config.json), the bins per optimizer step (the global batch, run.json's plan) and the bins consumed by step
N (a checkpoint or a metrics.jsonl record of that step, else N × global batch). Positions
``0 … consumed−1`` of the sampler's stream are the bins every rank together trained on, whatever the
layout, and whether or not the run was killed and resumed (a resumed run sees exactly the batches an
uninterrupted one would). Their items are the document ranges; the report counts tokens per document,
per source and per category (the tokens' own categories, read from the datasets' category streams).

No torch: this reads JSON files, the pack's arrays and the token datasets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from numba import njit
from xprep.prep.dataset import stream_chunks
from xprep.prep.errors import XprepError
from xprep.prep.pack import PackBins, open_entry, range_bincount
from xprep.train.ckpt_files import LATEST, TRAINER_JSON
from xprep.train.report import read_metrics
from xprep.train.samplers import BinSampler, RandomBinSampler

CHECKPOINTS = "checkpoints"  # of a run directory: checkpoints/latest names step-<N>/trainer.json (train/ckpt_files.py)
SAMPLERS = {"sequential": BinSampler, RandomBinSampler.kind: RandomBinSampler}
CATEGORY_CHUNK = 8 << 20  # category ids of a URL dataset fetched for the lineage at a time (about)
CONFIG_SAMPLERS = {"sequential": BinSampler, "random": RandomBinSampler}  # config.json's --sampler


def seen_report(run_dir: str | Path, step: int | None = None) -> dict:
    """JSON-able report of what the run in ``run_dir`` trained on up to ``step`` (default: its latest checkpoint,
    else its last logged step)."""
    run = Path(run_dir)
    info, config = _read(run / "run.json"), _read(run / "config.json")
    if not info.get("pack") or not info.get("plan"):
        raise XprepError(f"{run}: no run.json with the pack and the batch plan (written when training starts); "
                         "nothing was trained yet")
    records = read_metrics(run)
    step, step_from, state = _resolve_step(run, step, records)
    global_batch = int(info["plan"]["global_batch_size"])
    consumed = _consumed(step, state, records, global_batch)
    sampler = _sampler(run, state, config, info)
    entry = open_entry(info["pack"]["path"])
    if entry.key != info["pack"]["key"]:
        raise XprepError(f"{info['pack']['path']}: holds pack {entry.key[:16]}, but the run trained on "
                         f"{info['pack']['key'][:16]}: the pack was rebuilt; its lineage cannot be read from it")
    bins = PackBins(entry)
    positions = np.arange(consumed, dtype=np.int64)
    order = sampler(bins.num_bins)
    source, doc, start, length = bins.items_of(order.bins_at(positions))
    report = {"kind": "lineage", "run": str(run), "step": step, "step_from": step_from, "pack": str(entry.path),
              "key": entry.key, "sampler": order.kind, "seed": order.seed,
              "global_batch_size": global_batch, "consumed_samples": consumed, "tokens": int(length.sum())}
    report.update(_tally(bins, source, doc, start, length))
    return report


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise XprepError(f"{path}: unreadable ({e})") from None
    return data if isinstance(data, dict) else {}


def _resolve_step(run: Path, step: int | None, records: list[dict]) -> tuple[int, str, dict]:
    """The step asked for (or the default), how it was chosen, and the trainer state saved at it (if any)."""
    root = run / CHECKPOINTS
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    logged = max((int(r["step"]) for r in records), default=0)
    if step is None:
        if latest and (root / latest / TRAINER_JSON).is_file():
            state = _read(root / latest / TRAINER_JSON)
            return int(state["step"]), f"the latest checkpoint, {latest}", state
        if not logged:
            raise XprepError(f"{run}: no checkpoint and no logged step yet: nothing trained on")
        return logged, "the last logged step", {}
    if step < 0:
        raise XprepError(f"--step {step}: give a step ≥ 0")
    saved = root / f"step-{step}" / TRAINER_JSON
    state = _read(saved) if saved.is_file() else {}
    if not state and step > logged:
        raise XprepError(f"--step {step}: the run has reached step {logged} (metrics.jsonl) and has no checkpoint "
                         f"step-{step}; give a step ≤ {logged}")
    return step, "--step", state


def _consumed(step: int, state: dict, records: list[dict], global_batch: int) -> int:
    """Bins consumed by all ranks up to ``step``: saved in its checkpoint, logged in its record, or computed."""
    if state.get("sampler"):
        return int(state["sampler"]["consumed_samples"])
    for r in records:
        if int(r.get("step", -1)) == step and "consumed_samples" in r:
            return int(r["consumed_samples"])
    return step * global_batch


def _sampler(run: Path, state: dict, config: dict, info: dict):
    """A factory ``num_bins → sampler`` of the run's kind, seed and DP grouping (any checkpoint says, else config)."""
    saved = state.get("sampler") or _any_checkpoint_sampler(run)
    if saved:
        cls = SAMPLERS.get(saved["kind"])
        if cls is None:
            raise XprepError(f"{run}: its checkpoints use the {saved['kind']!r} sampler, whose order this version "
                             "does not produce; read the lineage with the xtrain that wrote them")
        seed = int(saved["seed"])
    else:
        name = (config.get("data") or {}).get("sampler", config.get("sampler", "sequential"))
        cls, seed = CONFIG_SAMPLERS[name], int(config.get("seed", 0))
    group = int(info["plan"].get("group") or 1)
    return lambda num_bins: cls(num_bins, 1, 0, group, seed, group)


def _any_checkpoint_sampler(run: Path) -> dict | None:
    root = run / CHECKPOINTS
    for path in sorted(root.glob(f"step-*/{TRAINER_JSON}")) if root.is_dir() else []:
        sampler = _read(path).get("sampler")
        if sampler:
            return sampler
    return None


def _tally(bins: PackBins, source: np.ndarray, doc: np.ndarray, start: np.ndarray, length: np.ndarray) -> dict:
    """Per document (dataset, index, source, categories, tokens, pieces), per source and per category."""
    names = bins.source_names
    by_source = {n: {"name": n, "tokens": 0, "documents": 0} for n in names}
    categories: dict[str, int] = {}
    documents = []
    which = np.searchsorted(bins.doc_base, doc, side="right") - 1
    for k, ds in enumerate(bins.datasets):
        sel = which == k
        if not sel.any():
            continue
        local, starts, lens = doc[sel] - bins.doc_base[k], start[sel], length[sel]
        cat_names = [n if n is not None else str(i) for i, n in enumerate(ds.category_names)]
        flat = ds.tokens.offsets()[local] + starts
        name = names[bins.dataset_source[k]]
        uniq, inverse = np.unique(local, return_inverse=True)
        tokens = np.bincount(inverse, weights=lens).astype(np.int64)
        pieces = np.bincount(inverse)
        by_source[name]["tokens"] += int(lens.sum())
        by_source[name]["documents"] += len(uniq)
        counts, present = _categories_taken(ds, flat, lens, inverse, len(uniq), cat_names)
        for cid in np.flatnonzero(counts):
            categories[cat_names[cid]] = categories.get(cat_names[cid], 0) + int(counts[cid])
        listed, index = bins.name_documents(uniq + bins.doc_base[k])  # a shard's documents: by the sharded dataset
        shard = [{"shard": {"path": str(ds.path), "document": int(d)}} if str(ds.path) != bins.listed[j] else {}
                 for j, d in zip(listed.tolist(), uniq.tolist(), strict=True)]
        documents += [{"dataset": bins.listed[listed[i]], "document": int(index[i]), "source": name,
                       "categories": present[i], "tokens": int(tokens[i]), "pieces": int(pieces[i]), **shard[i]}
                      for i in range(len(uniq))]
    return {"documents": documents, "sources": list(by_source.values()),
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]))}


def _categories_taken(ds, flat, lens, inverse, n_docs: int, cat_names: list[str]
                      ) -> tuple[np.ndarray, list[list[str]]]:
    """The tokens taken per category id, and the category names among each document's tokens taken: one numba
    pass over the items' category ids (a dataset without categories: all in its first)."""
    counts = np.zeros(len(cat_names), np.int64)
    if ds.category_ids is None:
        counts[0] = int(lens.sum())
        return counts, [[cat_names[0]] for _ in range(n_docs)]
    present = np.zeros((n_docs, len(cat_names)), np.bool_)
    for (items,), starts, part in stream_chunks(ds, [ds.category_ids], flat, flat + lens, CATEGORY_CHUNK):
        counts += range_bincount(items, starts, starts + lens[part], len(cat_names))
        _present_kernel(items, starts, lens[part], inverse[part], present)
    rows, row_of_doc = np.unique(present, axis=0, return_inverse=True)  # few distinct sets: name each once
    named = [[cat_names[c] for c in np.flatnonzero(r)] for r in rows]
    return counts, [named[r] for r in row_of_doc.reshape(-1).tolist()]


@njit(cache=True)
def _present_kernel(items, flat, lens, inverse, out):
    """Set ``out[d, c]`` where category ``c`` is among the tokens of an item of document ``d``."""
    for k in range(len(flat)):
        d = inverse[k]
        for t in range(flat[k], flat[k] + lens[k]):
            out[d, items[t]] = True
