"""Batch contract of train/data.py: labels, positions, boundaries, padding, refusals."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from trainkit import alone_logits, bin_logits, make_dataset, random_docs, sequential_bins, tiny_model, write_pack
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.train.data import IGNORE, PackedDataset, _source, collate, count_targets, fill_items, fill_items_reference


def rows(batch: dict) -> dict[str, list[int]]:
    """A one-bin batch as plain lists (the row of each (1, T) tensor; cu_seqlens as is)."""
    return {k: (v.tolist() if k == "cu_seqlens" else v[0].tolist()) for k, v in batch.items()}


def test_hand_made_bin(tmp_path):
    docs = [np.array([10, 11, 12, 13]), np.array([20, 21, 22]), np.array([30, 31, 32, 33, 34])]
    masks = [np.array([0, 1, 1, 1]), np.array([0, 0, 1]), np.array([0, 1, 0, 1, 1])]
    cats = [np.array([1, 1, 1, 1]), np.array([2, 2, 2]), np.array([1, 1, 2, 2, 2])]
    make_dataset(tmp_path / "ds", docs, loss_masks=masks, cats=cats, categories=["a", "b"], pad_id=7)
    # bin 0: doc 0 whole + doc 1 whole, padded to 10; bin 1: tokens 1..4 of doc 2 (a split item)
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 4), (1, 0, 3)], [(2, 1, 4)]], capacity=10)
    ds = PackedDataset(tmp_path / "p")
    b = rows(ds[0])
    assert b["input_ids"] == [10, 11, 12, 13, 20, 21, 22, 7, 7, 7]
    assert b["labels"] == [11, 12, 13, IGNORE, IGNORE, 22, IGNORE, IGNORE, IGNORE, IGNORE]
    assert b["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert b["cu_seqlens"] == [0, 4, 7, 10] and ds[0]["cu_seqlens"].dtype == torch.int32
    assert b["category_ids"] == [1, 1, 1, 0, 0, 2, 0, 0, 0, 0]
    assert ds[0]["input_ids"].shape == (1, 10)
    b = rows(ds[1])
    assert b["input_ids"][:4] == [31, 32, 33, 34]
    # token 32 is not a target (mask 0); 31 is the item's first token: nothing predicts it
    assert b["labels"][:4] == [IGNORE, 33, 34, IGNORE]
    assert b["category_ids"][:4] == [0, 2, 2, 0]
    assert b["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert b["cu_seqlens"] == [0, 4, 10]


def test_defaults_when_streams_absent_and_full_bin(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([5, 6, 7]), np.array([8, 9])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3), (1, 0, 2)]], capacity=5)
    b = rows(PackedDataset(tmp_path / "p")[0])
    assert b["labels"] == [6, 7, IGNORE, 9, IGNORE]
    assert b["category_ids"] == [0] * 5
    assert b["cu_seqlens"] == [0, 3, 5]  # no padding document when the bin is full


def test_empty_bin_is_all_padding(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([5, 6, 7])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3)], []], capacity=4)
    b = rows(PackedDataset(tmp_path / "p")[1])
    assert b["labels"] == [IGNORE] * 4 and b["cu_seqlens"] == [0, 4] and b["position_ids"] == [0, 1, 2, 3]


def make_dataset_with_streams(path, docs: list[np.ndarray], vocab_size: int, categories: list[str],
                              rng: np.random.Generator | None, **kwargs) -> tuple[list | None, list | None]:
    """``docs`` with a random loss mask and random categories per token drawn from ``rng`` (none without one);
    returns the masks and the categories."""
    masks = [rng.integers(0, 2, len(d)) for d in docs] if rng is not None else None
    cats = [rng.integers(0, len(categories) + 1, len(d)) for d in docs] if rng is not None else None
    make_dataset(path, docs, vocab_size=vocab_size, loss_masks=masks, cats=cats, categories=categories, **kwargs)
    return masks, cats


@pytest.mark.parametrize("with_streams", [True, False])
def test_kernel_matches_reference(tmp_path, with_streams):
    rng = np.random.default_rng(3)
    docs = random_docs(40, 1, 30, vocab=1000, seed=4)
    make_dataset_with_streams(tmp_path / "ds", docs, 1000, ["a", "b", "c"], rng if with_streams else None)
    src = _source(TokenDataset(tmp_path / "ds"))
    lens = np.array([len(d) for d in docs], np.int64)
    starts = rng.integers(0, np.maximum(lens, 1))
    take = np.maximum(1, lens - starts)
    dst = np.concatenate([[0], np.cumsum(take)[:-1]])
    args = (src.tokens, src.loss_mask, src.category_ids, src.offsets[:-1] + starts, take, dst)
    fast, slow = np.zeros((4, int(take.sum())), np.int64), np.zeros((4, int(take.sum())), np.int64)
    fill_items(*args, fast)
    fill_items_reference(*args, slow)
    np.testing.assert_array_equal(fast, slow)


def test_several_datasets_use_the_global_document_index(tmp_path):
    make_dataset(tmp_path / "a", [np.array([1, 2, 3]), np.array([4, 5])])
    make_dataset(tmp_path / "b", [np.array([6, 7, 8, 9])])
    write_pack(tmp_path / "p", [tmp_path / "a", tmp_path / "b"], [[(2, 0, 4), (1, 0, 2)], [(0, 0, 3)]], capacity=6)
    ds = PackedDataset(tmp_path / "p")
    b = rows(ds[0])
    assert b["input_ids"] == [6, 7, 8, 9, 4, 5] and b["labels"] == [7, 8, 9, IGNORE, 5, IGNORE]
    b = rows(ds[1])
    assert b["input_ids"][:3] == [1, 2, 3] and b["cu_seqlens"] == [0, 3, 6] and b["labels"][3:] == [IGNORE] * 3


def test_collate_concatenates_bins_into_one_row(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([1, 2, 3]), np.array([4, 5])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3)], [(1, 0, 2)]], capacity=4)
    ds = PackedDataset(tmp_path / "p")
    batch = collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 6, 8] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert count_targets(batch) == 3


def test_packed_logits_equal_alone(tmp_path):
    """No attention or label crosses a document: each document's logits are those it gets alone."""
    docs = random_docs(12, 3, 20, vocab=128, seed=5)
    make_dataset(tmp_path / "ds", docs, vocab_size=128)
    write_pack(tmp_path / "p", [tmp_path / "ds"], sequential_bins([len(d) for d in docs], 64), capacity=64)
    ds = PackedDataset(tmp_path / "p")
    model = tiny_model()
    for b in range(len(ds)):
        batch, packed, cu = bin_logits(model, ds[b])
        lo, hi = int(ds.entry.bin_offsets[b]), int(ds.entry.bin_offsets[b + 1])
        doc_ids = ds.entry.item_doc[lo:hi].tolist()  # cu also ends with the padding document
        for (s, e), doc in zip(zip(cu[:-1], cu[1:], strict=True), doc_ids, strict=False):
            alone_ids = torch.as_tensor(docs[doc]).unsqueeze(0)
            assert torch.equal(batch["input_ids"][0, s:e], alone_ids[0])
            torch.testing.assert_close(packed[0, s:e], alone_logits(model, alone_ids)[0], rtol=1e-5, atol=1e-5)


def test_real_data_batches(tmp_path, shared_data):
    """Real text (State of the Union, Mistral tokenizer): every bin honours the contract."""
    tok = Tokenizer.from_file(str(shared_data / "tokenizers" / "mistral" / "tokenizer.json"))
    texts = [p.read_text(errors="replace")[:3000] for p in sorted((shared_data / "corpora" / "sotu").iterdir())[:40]]
    docs = [np.array(e.ids + [2]) for e in tok.encode_batch(texts)]
    make_dataset(tmp_path / "ds", docs, vocab_size=tok.get_vocab_size())
    lengths = [len(d) for d in docs]
    bins = sequential_bins(lengths, 1024)  # overlong documents truncated to the capacity
    write_pack(tmp_path / "p", [tmp_path / "ds"], bins, capacity=1024)
    ds = PackedDataset(tmp_path / "p")
    for b in range(len(ds)):
        x = {k: v.numpy() if k == "cu_seqlens" else v[0].numpy() for k, v in ds[b].items()}
        cu = x["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == 1024 and (np.diff(cu) > 0).all()
        lo, hi = int(ds.entry.bin_offsets[b]), int(ds.entry.bin_offsets[b + 1])
        for k, doc in enumerate(ds.entry.item_doc[lo:hi].tolist()):
            s, e = int(cu[k]), int(cu[k + 1])
            np.testing.assert_array_equal(x["input_ids"][s:e], docs[doc][: e - s])
            np.testing.assert_array_equal(x["position_ids"][s:e], np.arange(e - s))
            np.testing.assert_array_equal(x["labels"][s : e - 1], docs[doc][1 : e - s])
            assert x["labels"][e - 1] == IGNORE
        used = int(cu[hi - lo])
        assert (x["labels"][used:] == IGNORE).all()


def test_missing_or_changed_dataset_is_refused(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([1, 2, 3])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3)]], capacity=4)
    shutil.rmtree(tmp_path / "ds")
    with pytest.raises(XprepError, match="is missing"):
        PackedDataset(tmp_path / "p")
    make_dataset(tmp_path / "ds", [np.array([1, 2, 4])])
    with pytest.raises(XprepError, match="changed since it was packed"):
        PackedDataset(tmp_path / "p")


def test_in_place_edit_caught_by_verify_data(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([1, 2, 3])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3)]], capacity=4)
    PackedDataset(tmp_path / "p", verify_data=True)
    data = bytearray((tmp_path / "ds" / "tokens.bin").read_bytes())
    data[0] ^= 1
    (tmp_path / "ds" / "tokens.bin").write_bytes(bytes(data))
    PackedDataset(tmp_path / "p")  # same size, same manifest: only hashing sees it
    with pytest.raises(XprepError, match="edited in place"):
        PackedDataset(tmp_path / "p", verify_data=True)


def test_pack_referring_to_more_documents_is_refused(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([1, 2, 3])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(5, 0, 3)]], capacity=4)
    with pytest.raises(XprepError, match="damaged pack entry: item 0 .bin 0. names document 5"):
        PackedDataset(tmp_path / "p")


def test_pickles_as_paths(tmp_path):
    make_dataset(tmp_path / "ds", [np.array([1, 2, 3])])
    write_pack(tmp_path / "p", [tmp_path / "ds"], [[(0, 0, 3)]], capacity=4)
    ds = PackedDataset(tmp_path / "p")
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    assert torch.equal(pickle.loads(blob)[0]["labels"], ds[0]["labels"])
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["current"]


def test_category_tables_merged_over_datasets(tmp_path):
    make_dataset(tmp_path / "a", [np.array([1, 2, 3])], cats=[np.array([1, 1, 1])], categories=["code"])
    make_dataset(tmp_path / "b", [np.array([4, 5, 6])], cats=[np.array([1, 2, 2])], categories=["chat", "code"])
    write_pack(tmp_path / "p", [tmp_path / "a", tmp_path / "b"], [[(0, 0, 3), (1, 0, 3)]], capacity=6)
    ds = PackedDataset(tmp_path / "p")
    assert ds.category_names == ["uncategorized", "code", "chat"]
    b = rows(ds[0])
    # dataset b's "code" (its id 2) is id 1 here, its "chat" (id 1) is the new id 2
    assert b["category_ids"] == [1, 1, 0, 1, 1, 0]


def reference_bin(docs, masks, cats, items, capacity, pad_id):
    """The batch of one bin straight from the definition, token by token (slow, obvious)."""
    ids, labels, pos, lab_cats, cu = [], [], [], [], [0]
    for doc, start, n in items:
        for j in range(n):
            t = start + j
            ids.append(int(docs[doc][t]))
            pos.append(j)
            target = j + 1 < n and (masks is None or masks[doc][t + 1] == 1)
            labels.append(int(docs[doc][t + 1]) if target else IGNORE)
            lab_cats.append(int(cats[doc][t + 1]) if target and cats is not None else 0)
        cu.append(cu[-1] + n)
    pad = capacity - cu[-1]
    if pad:
        ids += [pad_id] * pad
        labels += [IGNORE] * pad
        pos += list(range(pad))
        lab_cats += [0] * pad
        cu.append(capacity)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "category_ids": lab_cats,
            "source_ids": [0] * capacity, "cu_seqlens": cu}  # a plain pack: one source


@pytest.mark.parametrize("streams", [True, False])
def test_bins_match_reference(tmp_path, streams):
    rng = np.random.default_rng(11)
    docs = random_docs(60, 1, 50, vocab=500, seed=12)
    masks, cats = make_dataset_with_streams(tmp_path / "ds", docs, 500, ["a", "b"], rng if streams else None,
                                            pad_id=3)
    capacity, bins = 64, []
    order = rng.permutation(len(docs))
    while len(order):  # random bins of random pieces (split items start mid-document)
        items, used = [], 0
        for d in order[: rng.integers(1, 5)].tolist():
            start = int(rng.integers(0, len(docs[d])))
            n = min(len(docs[d]) - start, capacity - used)
            if n > 0:
                items.append((d, start, n))
                used += n
        order = order[len(items) or 1:]
        bins.append(items)
    write_pack(tmp_path / "p", [tmp_path / "ds"], bins, capacity=capacity)
    ds = PackedDataset(tmp_path / "p")
    for b, items in enumerate(bins):
        assert rows(ds[b]) == reference_bin(docs, masks, cats, items, capacity, pad_id=3)
