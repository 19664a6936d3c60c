"""``xprep pack --method chunk --attention causal`` and ``--eod-mask-loss``: Megatron GPTDataset's samples (one causal
span, positions 0..S-1, labels across documents) as the trainer reads them, on real text and against megatron-core's
own ``_get_ltor_masks_and_position_ids``; no EOD token a target; the pack's target counts equal the trainer's labels;
the default (``document``) keeps its cache keys."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from prepkit import one_line_error, validate
from prepkit import xprep_invoke as run
from trainkit import alone_logits, bin_logits, make_dataset, random_docs, tiny_model
from xprep.prep.pack.entry import open_packed
from xprep.train.data import IGNORE, PackedDataset, count_targets

EOD = 2  # Mistral's </s>, appended to every document as `xprep tokenize` does for text


@pytest.fixture(scope="module")
def sotu(shared_data, tmp_path_factory):
    """State of the Union addresses (Mistral tokenizer) cut to 20..150 tokens, each ending with EOD: a dataset."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shared_data / "tokenizers" / "mistral" / "tokenizer.json"))
    texts = [p.read_text(errors="replace")[:2000] for p in sorted((shared_data / "corpora" / "sotu").iterdir())[:16]]
    cut = np.random.default_rng(0).integers(20, 150, len(texts))
    cut[0] = 63  # the first document ends exactly where a sample of 64 does
    docs = [np.array(e.ids[:n] + [EOD]) for e, n in zip(tok.encode_batch(texts), cut.tolist(), strict=True)]
    root = tmp_path_factory.mktemp("sotu")
    make_dataset(root / "ds", docs, vocab_size=tok.get_vocab_size(), eod_id=EOD)
    return root, docs, tok.get_vocab_size()


def chunk(root, name, *options) -> PackedDataset:
    result = run("pack", root / "ds", "-o", root / name, "--method", "chunk", *options)
    assert result.exit_code == 0, result.output
    return PackedDataset(root / name)


def test_causal_sample_logits_equal_one_plain_sequence(sotu):
    """A sample of several documents runs as ONE causal sequence: the built-in model on it alone, positions 0..S-1."""
    root, _, vocab = sotu
    ds = chunk(root, "causal", "--seq-len", 128, "--attention", "causal")
    several = [b for b in range(len(ds)) if len(ds.bins.items(b)[1]) >= 3]
    assert several  # samples that cross two document boundaries
    model = tiny_model(vocab)
    for b in several[:2]:
        batch, logits, cu = bin_logits(model, ds[b])
        assert cu == [0, 128] and batch["position_ids"][0].tolist() == list(range(128))
        torch.testing.assert_close(logits, alone_logits(model, batch["input_ids"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_samples_are_megatrons(sotu, eod_mask_loss):
    """Inputs, positions and labels of every sample are megatron-core's for the same stream (samples of S + 1 tokens,
    reset_position_ids and reset_attention_mask off). With --eod-mask-loss no label is EOD; Megatron's
    eod_mask_loss masks the positions whose INPUT is EOD instead (``loss_mask[data == eod] = 0``): the two differ."""
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core (test extra)")
    root, docs, _ = sotu
    options = ("--eod-mask-loss",) if eod_mask_loss else ()
    ds = chunk(root, f"megatron{int(eod_mask_loss)}", "--seq-len", 64, "--attention", "causal", *options)
    stream, seq = torch.as_tensor(np.concatenate(docs)), 64
    ends_at_boundary = megatron_differs = 0
    for k in range(len(ds)):
        text = stream[k * seq:(k + 1) * seq + 1]
        tokens, labels = text[:-1], text[1:]
        _, loss_mask, position_ids = gpt._get_ltor_masks_and_position_ids(tokens, EOD, False, False, eod_mask_loss,
                                                                          False)
        batch = ds[k]
        assert torch.equal(batch["input_ids"][0], tokens) and torch.equal(batch["position_ids"][0], position_ids)
        targets = labels != EOD if eod_mask_loss else torch.ones_like(labels, dtype=torch.bool)
        assert torch.equal(batch["labels"][0], torch.where(targets, labels, IGNORE))
        if eod_mask_loss:
            assert (batch["labels"][0] != EOD).all()
            megatron_differs += not torch.equal(targets, loss_mask.bool())  # its rule is on the inputs
        ends_at_boundary += ds.bins.next_doc(k) >= 0
        assert int(ds.entry.bin_targets[k]) == count_targets(batch)  # the pack counted what the trainer learns
    assert ends_at_boundary  # some sample ends exactly at a document's end: the next one's first token labels it
    assert megatron_differs or not eod_mask_loss  # the difference the docs state is real on this data


def stream_reference(docs, masks, cats, seq, eod):
    """Labels and categories of consecutive causal samples, token by token, from the stream of ``docs``."""
    stream = np.concatenate(docs)
    starts = np.cumsum([0, *(len(d) for d in docs)])[:-1]
    target = np.ones(len(stream), bool) if masks is None else np.concatenate(masks).astype(bool)
    if masks is not None:
        target[starts] = False  # data with a loss mask never learns a document's first token
    if eod is not None:
        target &= stream != eod
    stream_cats = np.concatenate(cats) if cats is not None else np.zeros(len(stream), np.int64)
    n = (len(stream) - 1) // seq * seq
    nxt = np.arange(1, n + 1)
    return (np.where(target[nxt], stream[nxt], IGNORE).reshape(-1, seq),
            np.where(target[nxt], stream_cats[nxt], 0).reshape(-1, seq))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_labels_categories_and_counts_follow_the_stream(tmp_path, masked, eod_mask_loss):
    """Every label and its category against the stream token by token, with and without loss masks; the pack's
    bin_targets equal the trainer's targets, bin by bin."""
    rng = np.random.default_rng(3)
    docs = [np.append(d, EOD) for d in random_docs(40, 1, 20, vocab=64, seed=4)]
    masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs] if masked else None
    cats = [np.full(len(d), 1 + i % 2) for i, d in enumerate(docs)]
    make_dataset(tmp_path / "ds", docs, vocab_size=64, loss_masks=masks, cats=cats, categories=["a", "b"], eod_id=EOD)
    options = ("--eod-mask-loss",) if eod_mask_loss else ()
    ds = chunk(tmp_path, "P", "--seq-len", 16, "--attention", "causal", *options)
    labels, categories = stream_reference(docs, masks, cats, 16, EOD if eod_mask_loss else None)
    assert len(ds) == len(labels)
    for b in range(len(ds)):
        batch = ds[b]
        np.testing.assert_array_equal(batch["labels"][0].numpy(), labels[b])
        np.testing.assert_array_equal(batch["category_ids"][0].numpy(), categories[b])
        assert int(ds.entry.bin_targets[b]) == count_targets(batch)


def test_eod_mask_loss_under_document_attention(tmp_path):
    """--eod-mask-loss alone keeps documents apart and only drops the EOD labels (and counts them out)."""
    docs = [np.append(d, EOD) for d in random_docs(30, 1, 20, vocab=64, seed=5)]
    make_dataset(tmp_path / "ds", docs, vocab_size=64, eod_id=EOD)
    plain = chunk(tmp_path, "plain", "--seq-len", 16)
    masked = chunk(tmp_path, "masked", "--seq-len", 16, "--eod-mask-loss")
    assert len(plain) == len(masked)
    for b in range(len(plain)):
        want, got = plain[b], masked[b]
        assert torch.equal(want["cu_seqlens"], got["cu_seqlens"])
        assert torch.equal(got["labels"], torch.where(want["labels"] == EOD, IGNORE, want["labels"]))
        assert int(masked.entry.bin_targets[b]) == count_targets(got)
    assert masked.entry.meta["eod_id"] == EOD


def test_keys_records_and_inspect(tmp_path):
    """The default keeps the key of packs made before the option; causal and --eod-mask-loss are new entries,
    recorded in pack.json (valid against its schema) and shown by `xprep inspect`."""
    make_dataset(tmp_path / "ds", random_docs(20, 5, 30, vocab=128), vocab_size=128)
    base = ("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 16)
    assert run(*base).exit_code == 0
    default = open_packed(tmp_path / "P")
    assert "attention" not in default.meta["key_fields"] and "eod_mask_loss" not in default.meta["key_fields"]
    assert run(*base, "--attention", "document").output.startswith("cache hit:")
    names = {default.path.name}
    for options in (("--attention", "causal"), ("--eod-mask-loss",), ("--attention", "causal", "--eod-mask-loss")):
        assert run(*base, *options).exit_code == 0
        entry = open_packed(tmp_path / "P")
        names.add(entry.path.name)
        validate(json.loads((entry.path / "pack.json").read_text()), "pack")
    assert len(names) == 4
    assert entry.config["attention"] == "causal" and entry.config["eod_mask_loss"] and entry.meta["eod_id"] == 1
    shown = run("inspect", tmp_path / "P").output
    assert "--attention causal --eod-mask-loss" in " ".join(shown.split())
    assert "causal: one attention span over each sample" in shown and "EOD (id 1) is never a target" in shown


@pytest.mark.parametrize("options, needle", [
    (("--method", "sequential", "--seq-len", 16, "--attention", "causal"),
     "--attention causal applies only to --method chunk"),
    (("--method", "multipack", "--seq-len", 16, "--eod-mask-loss"), "--eod-mask-loss applies only to --method chunk"),
])
def test_options_of_other_methods_are_refused(tmp_path, options, needle):
    make_dataset(tmp_path / "ds", random_docs(5, 5, 30, vocab=128), vocab_size=128)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", *options))
    assert needle in line, line


def test_eod_mask_loss_needs_an_eod_id(tmp_path):
    make_dataset(tmp_path / "ds", random_docs(5, 5, 30, vocab=128), vocab_size=128, eod_id=None)
    line = one_line_error(run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 8,
                              "--eod-mask-loss"))
    assert "records no EOD token" in line and "--eod-token" in line, line


def sample_targets_reference(mask, tokens, offsets, lengths, item_doc, item_start, item_len, opens, eod):
    """Slow obvious ``sample_targets``: token by token, the rule of its docstring."""
    out = []
    for d, start, n, first in zip(item_doc, item_start, item_len, opens, strict=True):
        stop = start + n + (start + n < lengths[d])  # the token after an item cut inside its document
        count = 0
        for t in range(start + bool(first), stop):
            masked_out = len(mask) > 0 and (t == 0 or mask[offsets[d] + t] == 0)
            count += not masked_out and not (eod >= 0 and tokens[offsets[d] + t] == eod)
        out.append(count)
    return np.array(out)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("eod", [-1, EOD])
def test_sample_targets_kernel_matches_reference(masked, eod):
    from xprep.prep.pack.kernels import sample_targets

    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 30, 50)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 6, int(offsets[-1]))  # EOD (2) often
    mask = rng.integers(0, 2, int(offsets[-1])).astype(np.uint8) if masked else np.zeros(0, np.uint8)
    item_doc = rng.integers(0, 50, 400)
    item_start = rng.integers(0, lengths[item_doc])
    item_len = rng.integers(0, lengths[item_doc] - item_start + 1)  # empty items too: a sample's next document
    opens = rng.integers(0, 2, 400).astype(bool)
    args = (mask, tokens, offsets[:-1], lengths.astype(np.int64), item_doc, item_start, item_len, opens, eod)
    np.testing.assert_array_equal(sample_targets(*args), sample_targets_reference(*args))


@pytest.mark.parametrize("damage, needle", [(lambda a: a[:-1], "bin_next_doc.npy holds"),
                                            (lambda a: np.full_like(a, 10**6), "names document 1,000,000")])
def test_a_damaged_next_doc_array_is_refused_and_rebuilt(tmp_path, damage, needle):
    from xprep.prep.errors import XprepError
    from xprep.prep.pack.entry import save_array

    make_dataset(tmp_path / "ds", random_docs(20, 5, 30, vocab=128), vocab_size=128)
    ds = chunk(tmp_path, "P", "--seq-len", 16, "--attention", "causal")
    path = ds.entry.path / "bin_next_doc.npy"
    good = np.load(path)
    save_array(path, damage(good))
    with pytest.raises(XprepError, match=needle):
        PackedDataset(tmp_path / "P")
    again = run("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "chunk", "--seq-len", 16, "--attention",
                "causal")
    assert "damaged pack entry" in again.output and again.exit_code == 0, again.output
    np.testing.assert_array_equal(np.load(path), good)
