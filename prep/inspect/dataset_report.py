"""The report on a token dataset (``xprep inspect DATASET``): counts, lengths, categories, rejects.

With ``--sample N`` it adds decoded documents as spans of equal (target, category), so a loss mask can be
checked by eye (``xprep.prep.inspect.text`` marks the targets), and ``--over`` counts the documents longer than given
lengths (what packing at that capacity would cut).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from xprep.prep.dataset import CONVERSATION_COUNTS, conversation_counts, dataset_tokenizer, open_dataset
from xprep.prep.errors import XprepError
from xprep.prep.fs import is_url
from xprep.prep.inspect.options import InspectOptions
from xprep.prep.inspect.remote import fetch_tokenizer, open_url_dataset, tokenizer_location
from xprep.prep.inspect.stats import default_over, histogram, length_stats, over_counts


def dataset_report(path: str | Path, options: InspectOptions | None = None) -> dict:
    """What ``xprep inspect DATASET`` shows, as a JSON-able dict (``xprep.prep.inspect.text`` makes the text). A
    dataset at a URL is read where it is (prep/inspect/remote.py): its manifests and indexes, no token byte."""
    options = options or InspectOptions()
    remote = is_url(str(path))
    # plain or sharded: documents by their global index either way
    ds = open_url_dataset(str(path), options.cache_dir) if remote else open_dataset(Path(path))
    m = ds.manifest
    counts = m["counts"]
    conversations = conversation_counts(m)  # None: unknown (made before they were counted)
    report = {
        "kind": "dataset",
        "path": str(path) if remote else str(Path(path)),  # a URL as given (a Path would make s3:// s3:/)
        "fingerprint": m["fingerprint"],
        # the path where the tokenizer is (one kept inside the dataset is recorded relative to it)
        "tokenizer": {**m["tokenizer"], "path": tokenizer_location(str(path), m) if remote
                      else str(Path(path) / m["tokenizer"]["path"])},
        # the template chat records were rendered with: none where the dataset holds no conversation
        "chat_template": m.get("chat_template") if conversations is None or conversations[0] else None,
        "conversations": conversation_shape(conversations),
        "dtype": m["streams"]["tokens"]["dtype"],
        "streams": sorted(m["streams"]),
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "target_share": share(counts["loss_tokens"], counts["tokens"]),
        "lengths": length_stats(ds.lengths),
        "histogram": histogram(ds.lengths),
        "categories": counts["categories"],
        "category_shares": category_shares(counts["categories"], counts["tokens"]),
        "rejects": m["rejects"],
        "sources": len(m.get("sources", [])),
        "source_files": [{k: s.get(k) for k in ("path", "size")} for s in m.get("sources", [])],
        **({"shards": [{k: s[k] for k in ("path", "documents", "tokens")} for s in m["shards"]]} if "shards" in m
           else {}),
        "over": over_counts(ds.lengths, options.over or default_over(ds.lengths)),
    }
    if options.sample:
        report["sample"] = sample_documents(ds, options.sample, options.seed, options.cache_dir)
    return report


def conversation_shape(counts: np.ndarray | None) -> dict | None:
    """The conversations' shape (``prep.dataset.token_dataset.CONVERSATION_COUNTS``) with each count's share: of the
    assistant turns for empty answers, of the conversations for the others. None for a dataset without conversations, or
    made before they were counted."""
    if counts is None or not counts[0]:
        return None
    shape = dict(zip(CONVERSATION_COUNTS, counts.tolist(), strict=True))
    shares = {k: share(v, shape["answers"] if k == "empty_answers" else shape["count"])
              for k, v in shape.items() if k not in ("count", "answers")}
    return {**shape, "shares": shares}


def share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def category_shares(categories: dict, tokens: int) -> dict:
    """Per category: its share of all tokens, and the share of its own tokens that are targets."""
    return {name: {"tokens": share(c["tokens"], tokens), "targets": share(c["loss_tokens"], c["tokens"])}
            for name, c in categories.items()}


# ----------------------------------------------------------------------------------------- --sample
def sample_documents(ds, n: int, seed: int | None, cache_dir: str | None = None) -> dict:
    """The first ``n`` documents, or ``n`` drawn at random with ``seed`` (in index order), decoded (those of a
    dataset at a URL fetched by range, its tokenizer into ``cache_dir``)."""
    total = len(ds)
    k = min(n, total)
    if seed is None:
        picked = np.arange(k)
    else:
        picked = np.sort(np.random.default_rng(seed).choice(total, k, replace=False))
    tokenizer = load_decoder(ds, cache_dir) if k else None
    return {"selection": "first" if seed is None else "random", "seed": seed, "requested": n, "of": total,
            "documents": [decode_document(ds, int(i), tokenizer) for i in picked]}


def load_decoder(ds, cache_dir: str | None = None):
    """The ``tokenizers.Tokenizer`` the dataset was made with (``dataset_tokenizer``: found and checked; at a URL,
    ``fetch_tokenizer``)."""
    try:
        path = fetch_tokenizer(ds, cache_dir) if getattr(ds, "streamed", False) else \
            dataset_tokenizer(ds.path, ds.manifest)
    except XprepError as e:
        raise XprepError(f"--sample: {e} to decode the documents") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise XprepError(f"--sample: {path}: not a tokenizer.json ({e}); restore the original") from None


def span_bounds(mask: np.ndarray, cats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of the maximal runs of tokens with the same (target, category)."""
    if len(mask) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.flatnonzero((mask[1:] != mask[:-1]) | (cats[1:] != cats[:-1])) + 1
    return np.concatenate([[0], change]), np.concatenate([change, [len(mask)]])


def decode_document(ds, i: int, tokenizer) -> dict:
    """Document ``i`` as spans of equal (target, category), each decoded at once."""
    d = ds.document(i)
    ids, mask, cats = d["input_ids"], d["loss_mask"], d["category_ids"]
    names = ds.category_names
    spans = []
    for s, e in zip(*span_bounds(mask, cats), strict=True):
        cid = int(cats[s])
        name = names[cid] if cid < len(names) and names[cid] is not None else str(cid)
        spans.append({"target": bool(mask[s]), "category": name, "tokens": int(e - s),
                      "text": tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False)})
    return {"index": i, "tokens": int(len(ids)), "targets": int(np.count_nonzero(mask)), "spans": spans}
