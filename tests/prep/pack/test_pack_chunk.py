"""``xprep pack --method chunk``: Megatron's sample boundaries, 100 % fill, every token a target once, lookahead
labels, packed logits equal to each piece's alone, and the options that do not apply."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from prepkit import one_line_error
from prepkit import xprep_invoke as run
from trainkit import alone_logits, bin_logits, make_dataset, random_docs, tiny_model
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.pack.chunk import epoch_seed
from xprep.prep.pack.config import PackConfig
from xprep.prep.pack.entry import open_packed
from xprep.prep.pack.kernels import pack_lengths
from xprep.prep.pack.shuffle import shuffled_order
from xprep.train.data import IGNORE, PackedDataset, _source, fill_items_reference, fill_items_upto


def docs_with_empty(n: int = 30, seed: int = 0) -> list[np.ndarray]:
    """Random documents (1..40 tokens), two of them empty: chunk skips those."""
    docs = random_docs(n, 1, 40, vocab=128, seed=seed)
    docs[3] = docs[17] = np.zeros(0, np.int64)
    return docs


def chunk_pack(tmp_path, docs, *options) -> PackedDataset:
    make_dataset(tmp_path / "ds", docs, vocab_size=128)
    result = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", *options)
    assert result.exit_code == 0, result.output
    return PackedDataset(tmp_path / "P")


def visiting_order(lengths: np.ndarray, epochs: int, shuffle: bool, seed: int) -> np.ndarray:
    """Global ids of the non-empty documents, epoch after epoch: in order, or epoch e permuted by epoch_seed."""
    nonempty = np.flatnonzero(lengths)
    if not shuffle:
        return np.tile(nonempty, epochs)
    return np.concatenate([nonempty[shuffled_order(len(nonempty), epoch_seed(seed, e))] for e in range(epochs)])


@pytest.mark.parametrize("options, want_epochs", [
    ((), 1),
    (("--shuffle", "--seed", 5), 1),
    (("--total-tokens", 1500), 3),
    (("--shuffle", "--seed", 5, "--total-tokens", 1500), 3),
    (("--epochs", 2.5), 3),
])
def test_bins_start_where_megatron_build_sample_idx_does(tmp_path, options, want_epochs):
    helpers = pytest.importorskip("megatron.core.datasets.helpers", reason="megatron-core (test extra)")
    docs, seq_len = docs_with_empty(), 24
    ds = chunk_pack(tmp_path, docs, "--seq-len", seq_len, *options)
    stats = ds.entry.meta["stats"]
    assert stats["epochs"] == want_epochs and ds.entry.meta["lookahead"] is True
    lengths = np.array([len(d) for d in docs], np.int64)
    shuffle = "--shuffle" in options
    order = visiting_order(lengths, want_epochs, shuffle, 5)
    want = helpers.build_sample_idx(lengths.astype(np.int32), order.astype(np.int32), seq_len, want_epochs,
                                    int(lengths.sum()), True, True)
    n_bins = len(ds)
    assert n_bins == stats["samples"] and n_bins <= len(want) - 1
    firsts = np.asarray(ds.entry.bin_offsets[:-1])
    np.testing.assert_array_equal(np.asarray(ds.entry.item_doc)[firsts], order[want[:n_bins, 0]])
    np.testing.assert_array_equal(np.asarray(ds.entry.item_start)[firsts], want[:n_bins, 1])
    if "--total-tokens" in options:
        assert n_bins == -(-1500 // seq_len)
    if "--epochs" in options:
        assert n_bins == (int(2.5 * lengths.sum()) - 1) // seq_len  # Megatron's count for E epochs


@pytest.mark.parametrize("options", [(), ("--shuffle", "--seed", 3, "--total-tokens", 2000)])
def test_full_bins_and_every_stream_token_a_target_once(tmp_path, options):
    docs, seq_len = docs_with_empty(seed=1), 32
    ds = chunk_pack(tmp_path, docs, "--seq-len", seq_len, *options)
    stats = ds.entry.meta["stats"]
    summary = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", seq_len, *options)
    assert summary.stderr == ""  # the stream's unused tail is no overlong warning
    assert f"chunk         {stats['samples']:,} samples from {stats['epochs']:,} epoch(s)" in summary.stdout
    assert stats["fill"] == 1.0 and stats["padding_tokens"] == 0 and stats["tokens"] == len(ds) * seq_len
    lengths = np.array([len(d) for d in docs], np.int64)
    order = visiting_order(lengths, stats["epochs"], "--shuffle" in options, 3)
    stream = np.concatenate([docs[d] for d in order])
    doc_starts = np.cumsum(np.concatenate([[0], lengths[order]]))[:-1]
    labels, inputs = [], []
    for b in range(len(ds)):
        batch = ds[b]
        assert batch["cu_seqlens"][-1] == seq_len and batch["input_ids"].shape == (1, seq_len)
        labels.append(batch["labels"][0].numpy())
        inputs.append(batch["input_ids"][0].numpy())
    labels, inputs = np.concatenate(labels), np.concatenate(inputs)
    n = len(labels)
    np.testing.assert_array_equal(inputs, stream[:n])  # the bins are the stream, in order
    targets = np.flatnonzero(labels != IGNORE) + 1  # stream positions that are some position's target
    want = np.setdiff1d(np.arange(1, n + 1), doc_starts)  # every position but a document's first
    np.testing.assert_array_equal(targets, want)
    np.testing.assert_array_equal(labels[targets - 1], stream[targets])


def test_lookahead_only_for_packs_that_say_so(tmp_path):
    """The same bin read with and without the flag differs only in the last label of items cut inside a document."""
    docs = [np.arange(2, 12), np.arange(20, 26)]
    ds = chunk_pack(tmp_path, docs, "--seq-len", 4)
    rows = [ds[b]["labels"][0].tolist() for b in range(len(ds))]
    assert rows == [[3, 4, 5, 6], [7, 8, 9, 10], [11, IGNORE, 21, 22]]  # (16 - 1) // 4 samples
    ds.lookahead = False
    assert ds[0]["labels"][0].tolist() == [3, 4, 5, IGNORE]


@pytest.mark.parametrize("with_streams", [True, False])
def test_lookahead_kernel_matches_reference(tmp_path, with_streams):
    rng = np.random.default_rng(7)
    docs = random_docs(40, 1, 30, vocab=1000, seed=8)
    masks = [rng.integers(0, 2, len(d)) for d in docs] if with_streams else None
    cats = [rng.integers(0, 3, len(d)) for d in docs] if with_streams else None
    make_dataset(tmp_path / "ds", docs, vocab_size=1000, loss_masks=masks, cats=cats, categories=["a", "b"])
    src = _source(TokenDataset(tmp_path / "ds"))
    lens = np.array([len(d) for d in docs], np.int64)
    starts = rng.integers(0, lens)
    take = np.maximum(1, rng.integers(0, lens - starts + 1))  # some items stop inside their document
    dst = np.concatenate([[0], np.cumsum(take)[:-1]])
    ends = src.offsets[1:]
    args = (src.tokens, src.loss_mask, src.category_ids, src.offsets[:-1] + starts, take, dst)
    fast, slow = np.zeros((4, int(take.sum())), np.int64), np.zeros((4, int(take.sum())), np.int64)
    fill_items_upto(*args, ends, fast)
    fill_items_reference(*args, slow, ends)
    np.testing.assert_array_equal(fast, slow)
    assert np.any(starts + take < lens)


def test_packed_logits_equal_each_piece_alone(tmp_path):
    """Attention never crosses a piece: a document cut over two samples gives each piece the logits it has alone."""
    docs = random_docs(8, 10, 60, vocab=128, seed=9)
    seq_len = 48
    ds = chunk_pack(tmp_path, docs, "--seq-len", seq_len)
    entry = ds.entry
    pieces = np.bincount(np.asarray(entry.item_doc))
    assert pieces.max() >= 2  # some document is split over two samples
    model = tiny_model()
    for b in range(len(ds)):
        batch, packed, cu = bin_logits(model, ds[b])
        items = entry.bin_items(b)
        assert len(cu) - 1 == items.stop - items.start  # no padding document: the sample is full
        for (s, e), d, start in zip(zip(cu[:-1], cu[1:], strict=True), entry.item_doc[items].tolist(),
                                    entry.item_start[items].tolist(), strict=True):
            alone_ids = torch.as_tensor(docs[d][start:start + e - s]).unsqueeze(0)
            assert torch.equal(batch["input_ids"][0, s:e], alone_ids[0])
            assert batch["position_ids"][0, s:e].tolist() == list(range(e - s))
            torch.testing.assert_close(packed[0, s:e], alone_logits(model, alone_ids)[0], rtol=1e-5, atol=1e-5)


def test_pack_lengths_counts_empty_documents_and_reports_like_other_methods():
    lengths = np.array([5, 0, 7, 0, 9, 3], np.int32)
    p = pack_lengths(lengths, PackConfig(method="chunk", seq_len=4))
    plain = pack_lengths(lengths, PackConfig(method="sequential", seq_len=4)).stats
    assert set(plain) <= set(p.stats)
    assert p.stats["empty_documents"] == 2 and p.stats["documents_in"] == 6 and p.stats["overlong_documents"] == 0
    assert p.stats["bins"] == (24 - 1) // 4 and p.stats["fill"] == 1.0
    assert 1 not in p.item_doc.tolist() and 3 not in p.item_doc.tolist()


def test_key_changes_with_size_and_shuffle(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(20, 5, 30, vocab=128), vocab_size=128)
    names = set()
    for options in [(), ("--total-tokens", 900), ("--epochs", 2), ("--shuffle",), ("--shuffle", "--seed", 1)]:
        result = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 16, *options)
        assert result.exit_code == 0, result.output
        names.add(open_packed(tmp_path / "P").path.name)
    assert len(names) == 5 and all(n.startswith("chunk-") for n in names)
    again = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 16)
    assert again.output.startswith("cache hit:")
    one_epoch = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 16, "--epochs", 1)
    assert one_epoch.output.startswith("cache hit:"), one_epoch.output  # what the default sizes: the same key
    meta = json.loads((open_packed(tmp_path / "P").path / "pack.json").read_text())
    from prepkit import validate
    validate(meta, "pack")


@pytest.mark.parametrize("options, needle", [
    (("--seq-len", 6, "--cp-size", 2), "--cp-size 2 needs --seq-len with --method chunk to be a multiple of "
                                       "2·cp=4 (context parallelism cuts every sample into 4 equal chunks), and 6 "
                                       "is not: use --seq-len 4 or 8, or a --cp-size that divides 3"),
    (("--seq-len", 100, "--cp-size", 3), "use --seq-len 96 or 102, or a --cp-size that divides 50"),
    (("--seq-len", 9, "--cp-size", 2), "and 9 is not: use --seq-len 8 or 12"),
    (("--seq-len", 8, "--total-tokens", 100, "--epochs", 2), "give one of them"),
    (("--seq-len", 8, "--overlong", "drop"), "--overlong drop does not apply to --method chunk"),
    (("--seq-len", 8, "--group-size", 10), "--group-size applies only to --method multipack"),
    (("--seq-len", 8, "--balance-dp", 2), "--balance-dp applies only to --method token-aware"),
    (("--max-tokens", 8,), "--max-tokens does not apply to --method chunk"),
    ((), "--method chunk needs --seq-len N (the sample length in tokens)"),
    (("--seq-len", 8, "--epochs", 0), "--epochs 0 must be a positive number"),
    (("--seq-len", 8, "--total-tokens", 0), "--total-tokens 0 must be a positive number"),
    (("--seq-len", 4096,), "too short for one sample of --seq-len 4096"),
])
def test_bad_options_are_one_line(tmp_path, options, needle):
    make_dataset(tmp_path / "ds", random_docs(5, 5, 30, vocab=128), vocab_size=128)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", *options))
    assert needle in line, line
    assert not (tmp_path / "P").exists()


def test_cp_size_only_checks_the_sample_length(tmp_path):
    """--cp-size C does not change a chunk pack (CP zigzags whole samples): the same entry, recorded without it."""
    make_dataset(tmp_path / "ds", random_docs(20, 5, 30, vocab=128), vocab_size=128)
    base = ("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 24)
    assert run(*base, "--cp-size", 2).exit_code == 0
    made = open_packed(tmp_path / "P")
    assert made.config["cp_size"] == 1 and made.meta["key_fields"]["cp_size"] == 1
    for cp in ((), ("--cp-size", 3)):
        again = run(*base, *cp)
        assert again.output.startswith("cache hit:"), again.output
        assert open_packed(tmp_path / "P").path == made.path


def test_size_options_need_chunk_or_a_blend(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(5, 5, 30, vocab=128), vocab_size=128)
    for option in (("--total-tokens", 100), ("--epochs", 2)):
        line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "sequential",
                                  "--seq-len", 16, *option))
        assert "sizes a --method chunk pack or a blend" in line


def test_chunk_of_nothing_is_the_usual_empty_pack_error(tmp_path):
    """No non-empty document (or nothing drawn for a part) is the one-line 0-bins error, not a traceback."""

    from xprep.cli import xprep
    from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter

    with DatasetWriter(tmp_path / "e", 128) as w:
        w.finish({"tokenizer": {"path": "t", "vocab_size": 128, "pad_id": 0, "eod_id": 1, "sha256": "a" * 64}},
                 CategoryTable())
    res = CliRunner().invoke(xprep, ["pack", str(tmp_path / "e"), "-o", str(tmp_path / "P"), "--method", "chunk",
                                     "--seq-len", "8"])
    assert res.exit_code == 2 and "0 bins" in res.output and "Traceback" not in res.output, res.output
