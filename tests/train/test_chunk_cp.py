"""Context parallelism on `--method chunk` packs: every sample is one zigzag unit, documents stay apart.

Pure sharding steps (units, owner/permutation/inverse, query pieces cut at documents), packed-vs-alone
logits of CP-sharded chunk samples (ranks simulated in one process), `xtrain run --cp 2` equal to one
process, and the CP options a chunk pack accepts or refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_cp import cu_from
from test_parallel_run import COMMON, CP2, metrics, same_curve, xtrain
from trainkit import (
    alone_logits,
    assert_simulated_cp_attention,
    chunk_pack,
    make_trainer,
    random_docs,
    simulated_cp_logits,
    tiny_model,
)
from xprep.cli import xtrain as xtrain_cli
from xprep.prep.errors import XprepError
from xprep.train.cp import (
    inverse_permutation,
    local_pieces,
    local_segments,
    sample_units,
    shard_batch,
    zigzag_owner,
    zigzag_permutation,
)
from xprep.train.data import IGNORE, PackedDataset, collate
from xprep.train.dist import ParallelDims


def chunk_like_batch(items: list[int]) -> dict[str, torch.Tensor]:
    """A row of chunk samples whose items have these lengths: tokens numbered 1..T, positions restarting at each
    item, labels = ids + 1000 but IGNORE at each item's last token (categories 7)."""
    t = sum(items)
    ids = torch.arange(1, t + 1)[None]
    cu = cu_from(items)
    labels = ids + 1000
    labels[0, cu[1:].long() - 1] = IGNORE
    return {"input_ids": ids, "labels": labels, "position_ids": torch.cat([torch.arange(n) for n in items])[None],
            "category_ids": torch.full((1, t), 7), "cu_seqlens": cu}


# ----------------------------------------------------------------------------- pure steps


def test_sample_units_are_the_sample_bounds():
    assert sample_units(24, 8, 2).tolist() == [0, 8, 16, 24]
    assert sample_units(24, 24, 3).tolist() == [0, 24]
    for n_tokens, sample_len, cp_size in [(24, 6, 2), (20, 8, 2), (24, 0, 2)]:  # 2·C ∤ S; not whole samples
        with pytest.raises(ValueError, match="whole samples"):
            sample_units(n_tokens, sample_len, cp_size)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_rank_keeps_chunks_r_and_mirror_of_every_sample(cp_size):
    sample_len, n_samples = 4 * cp_size, 3
    units = sample_units(n_samples * sample_len, sample_len, cp_size)
    perm = zigzag_permutation(units, cp_size)
    c = sample_len // (2 * cp_size)
    for r in range(cp_size):
        expected = []
        for start in range(0, n_samples * sample_len, sample_len):
            for chunk in (r, 2 * cp_size - 1 - r):
                expected += list(range(start + chunk * c, start + (chunk + 1) * c))
        assert perm[r].tolist() == expected
    assert zigzag_owner(units, cp_size).bincount().tolist() == [n_samples * sample_len // cp_size] * cp_size
    assert torch.equal(perm.reshape(-1)[inverse_permutation(perm)], torch.arange(n_samples * sample_len))


def test_shard_of_chunk_samples_keeps_every_token_as_it_is():
    """Two samples of 8 at C=2 (chunks of 2). Sample 0: documents [0,3) and [3,8), the second crossing two chunk
    bounds; sample 1: the rest of that document [8,13) (positions restart) and [13,16)."""
    batch = chunk_like_batch([3, 5, 5, 3])
    batch["labels"][0, 7] = 1009  # the lookahead label of a piece that goes on in the next sample
    shards = [shard_batch(batch, r, 2, sample_len=8) for r in range(2)]
    assert shards[0]["global_index"].tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert shards[1]["global_index"].tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    for shard in shards:  # no padding: every key is the unsharded row, taken at the rank's global indices
        index = shard["global_index"]
        for key in ("input_ids", "labels", "position_ids", "category_ids"):
            assert torch.equal(shard[key][0], batch[key][0, index]), key
        assert shard["cu_units"].tolist() == [0, 8, 16]
        assert torch.equal(shard["cu_seqlens_padded"], batch["cu_seqlens"])  # the global documents, unpadded
    assert shards[0]["position_ids"].tolist() == [[0, 1, 3, 4, 0, 1, 1, 2]]  # per-document positions, untouched
    assert shards[0]["labels"][0, 3] == 1009
    assert shards[0]["cu_seqlens"].tolist() == [0, 2, 4, 6, 8]  # the rank's tokens of each document
    assert shards[1]["cu_seqlens"].tolist() == [0, 1, 4, 7, 8]
    gathered = torch.cat([s["input_ids"][0] for s in shards])[shards[0]["cp_inverse"]]
    assert torch.equal(gathered, batch["input_ids"][0])  # all-gather + inverse = the row back
    assert sum(int((s["labels"] != IGNORE).sum()) for s in shards) == int((batch["labels"] != IGNORE).sum())


def test_local_pieces_cut_segments_where_documents_end():
    bounds, units = [0, 3, 8, 13, 16], [0, 8, 16]  # the batch above
    assert local_pieces(bounds, units, 0, 2) == [(0, 2, 0), (6, 8, 3), (8, 10, 8), (14, 16, 13)]
    assert local_pieces(bounds, units, 1, 2) == [(2, 3, 0), (3, 4, 3), (4, 6, 3), (10, 12, 8), (12, 13, 8),
                                                 (13, 14, 13)]
    with_empty = [0, 0, 3, 3, 8, 13, 16, 16]  # empty documents are never a piece, nor a piece's document
    assert local_pieces(with_empty, units, 1, 2) == local_pieces(bounds, units, 1, 2)


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_local_pieces_with_one_unit_per_document_are_its_segments(cp_size):
    padded = [2 * cp_size * n for n in (3, 1, 4)]
    bounds = cu_from(padded).tolist()
    for r in range(cp_size):
        want = [(s + a, s + b, s) for s, n in zip(bounds[:-1], padded, strict=True)
                for a, b in local_segments(n, r, cp_size)]
        assert local_pieces(bounds, bounds, r, cp_size) == want


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("seed", range(3))
def test_pieces_cover_the_rank_tokens_in_order_each_inside_one_document(cp_size, seed):
    rng = np.random.default_rng(seed)
    sample_len, n_samples = 4 * cp_size * 3, 3
    cuts = [np.sort(rng.choice(np.arange(1, sample_len), rng.integers(0, 6), replace=False)) for _ in range(n_samples)]
    bounds = sorted({*(k * sample_len + int(c) for k, cs in enumerate(cuts) for c in cs),
                     *range(0, n_samples * sample_len + 1, sample_len)})
    units = sample_units(n_samples * sample_len, sample_len, cp_size).tolist()
    perm = zigzag_permutation(torch.tensor(units), cp_size)
    for r in range(cp_size):
        pieces = local_pieces(bounds, units, r, cp_size)
        assert [t for a, b, _ in pieces for t in range(a, b)] == perm[r].tolist()
        for a, b, key_start in pieces:
            d = np.searchsorted(bounds, a, side="right") - 1
            assert key_start == bounds[d] and b <= bounds[d + 1]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_attention_over_samples_with_simulated_ranks_equals_document_attention(cp_size):
    """As tests/test_cp.py does per document, with whole samples as units: outputs and grads equal cp=1."""
    sample_len = 2 * cp_size * 5
    items = [7, 2 * cp_size * 5 - 7, 3, 11, 2 * cp_size * 5 - 14]  # two samples; documents across chunk bounds
    batch = chunk_like_batch(items)
    assert_simulated_cp_attention([shard_batch(batch, r, cp_size, sample_len) for r in range(cp_size)], items,
                                  cp_size)


# ----------------------------------------------------------------------------- packed vs alone


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_logits_of_chunk_samples_equal_each_piece_alone(tmp_path, cp_size):
    """Micro-batches of two chunk samples sharded over simulated CP ranks: every local token's logits are those of
    its document piece run alone, including a document split over the two samples and pieces that cross
    chunk bounds; labels (the lookahead one included) and positions are the unsharded ones."""
    docs, seq_len = random_docs(8, 10, 60, vocab=128, seed=9), 48
    ds = PackedDataset(chunk_pack(tmp_path, docs, seq_len), cp_size=cp_size)
    entry, model = ds.entry, tiny_model()
    assert ds.cp_sample_len == seq_len
    split_over_two, crossing = 0, 0
    for first in range(0, len(ds) - 1, 2):
        batch = collate([ds[first], ds[first + 1]])
        items = slice(int(entry.bin_offsets[first]), int(entry.bin_offsets[first + 2]))
        doc, start = entry.item_doc[items].tolist(), entry.item_start[items].tolist()
        cu = batch["cu_seqlens"].tolist()
        assert len(cu) - 1 == len(doc)  # the samples are full: no padding document
        want = torch.cat([alone_logits(model, torch.as_tensor(docs[d][s:s + e - b])[None])[0]
                          for d, s, b, e in zip(doc, start, cu[:-1], cu[1:], strict=True)])  # (2·S, V)
        split_over_two += len(set(entry.item_doc[entry.bin_items(first)].tolist())
                              & set(entry.item_doc[entry.bin_items(first + 1)].tolist()))
        chunk = seq_len // (2 * cp_size)
        crossing += sum(b // chunk != (e - 1) // chunk for b, e in zip(cu[:-1], cu[1:], strict=True))
        shards = [shard_batch(batch, r, cp_size, ds.cp_sample_len) for r in range(cp_size)]
        for shard, logits in zip(shards, simulated_cp_logits(model, shards), strict=True):
            index = shard["global_index"]
            torch.testing.assert_close(logits[0], want[index], rtol=1e-5, atol=1e-5)
            for key in ("labels", "position_ids", "input_ids"):
                assert torch.equal(shard[key][0], batch[key][0, index]), key
    assert split_over_two >= 1 and crossing >= 1  # the cases that matter did occur
    lookahead = [b for b in range(len(ds)) if ds[b]["labels"][0, -1] != IGNORE]
    assert lookahead  # some sample's last token is labelled with the next sample's first: kept by the shard above


# ----------------------------------------------------------------------------- trainer, xtrain run, options


def test_trainer_zigzags_whole_samples_of_a_chunk_pack(tmp_path):
    """The trainer hands the pack's sample length to the sharding: no padding, one unit per bin of the micro-batch."""
    packed = chunk_pack(tmp_path, random_docs(20, 5, 60, vocab=128), 16)
    trainer = make_trainer(packed, micro=2, accum=1)
    trainer.dims = ParallelDims.for_world(2, cp=2, rank=1, fsdp=False)  # CP rank 1's share; no process group needed
    (batch,), _, _ = trainer.next_micro_batches()
    assert batch["cu_units"].tolist() == [0, 16, 32] and batch["input_ids"].shape == (1, 16)
    assert torch.equal(batch["cu_seqlens_padded"], collate([trainer.dataset[b] for b in (0, 1)])["cu_seqlens"])


def test_xtrain_cp2_on_a_chunk_pack_equals_one_process(tmp_path):
    """A chunk pack made without --cp-size: `xtrain run --cp 2` (2 processes, gloo) has cp=1's loss curve."""
    packed = chunk_pack(tmp_path, random_docs(40, 5, 60, vocab=128, seed=4), 32)
    args = [str(packed), *COMMON, "--steps", "5"]
    one = CliRunner().invoke(xtrain_cli, ["run", *args, "--output", str(tmp_path / "one")])  # in-process: faster
    assert one.exit_code == 0, one.output
    cp2 = xtrain(*args, *CP2, "--output", str(tmp_path / "cp2"))
    assert cp2.returncode == 0, cp2.stderr
    assert "1 DP × 2 CP" in cp2.stderr
    assert len(metrics(tmp_path / "one")) == 5
    same_curve(metrics(tmp_path / "one"), metrics(tmp_path / "cp2"))


def test_xtrain_cp_that_does_not_split_the_samples_is_one_line(tmp_path):
    packed = chunk_pack(tmp_path, random_docs(20, 5, 60, vocab=128), 36)  # 2·2 and 2·3 divide 36; 2·4 does not
    assert len(PackedDataset(packed, cp_size=3)) == len(PackedDataset(packed))
    with pytest.raises(XprepError, match=r"repack it with --seq-len 32 or 40, or use a --cp that divides 18"):
        PackedDataset(packed, cp_size=4)
    result = CliRunner().invoke(xtrain_cli, ["run", str(packed), "--nproc-per-node", "4", "--cp", "4",
                                             "--output", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cp 4 needs the --seq-len of the --method chunk pack" in lines[0], result.stderr
