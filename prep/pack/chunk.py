"""``--method chunk``: pretraining samples cut from the documents walked as one stream (Megatron GPTDataset).

Documents, in order (or a seeded shuffle, epoch after epoch), are concatenated into one stream of tokens and
cut into samples of ``seq_len`` input tokens: sample ``k`` takes stream positions ``[k·S, (k+1)·S)`` and its
labels are the next tokens, up to position ``(k+1)·S``: the first token of sample ``k+1`` (megatron-core's
``build_sample_idx`` with ``add_extra_token_to_sequence``: ``S+1`` tokens per sample, the next one starting
on the last). So no slot is padding, and the sample starts are exactly Megatron's for the same document order.

What the trainer does inside a sample is ``--attention`` (pack.json's config; train/data.py reads it):

- ``document`` (the default): the documents inside a sample stay apart. Each is an item of the bin
  (``cu_seqlens``), so attention and labels never cross a document boundary, positions restart at each document
  and at each sample start, and a document's first token is never a target.
- ``causal``: Megatron GPTDataset's default, ``reset_position_ids=False`` and ``reset_attention_mask=False`` in
  megatron-core's ``_get_ltor_masks_and_position_ids``: one causal attention span over the whole sample
  (``cu_seqlens`` [0, S]: under context parallelism one zigzag unit with no inner cut), position ids 0..S-1
  continuous across the documents in it, and labels the next token of the stream, across document boundaries:
  the last token of a document (its EOD) is labelled with the next document's first token, and the sample's last
  position with the first token of the next sample. In data without a loss mask (Megatron's case) every stream
  token but the very first is then a target exactly once; data with a loss mask keeps its mask, and a
  document's first token stays no target there (as its manifest counts).

``--eod-mask-loss`` (with either): no EOD token is a target, i.e. no label is the datasets' ``eod_id`` (pack.json
records it as ``eod_id``). Megatron's ``eod_mask_loss`` is another rule: ``loss_mask[tokens == eod] = 0`` masks the
positions whose INPUT is EOD, so it still trains the prediction OF each EOD and drops the prediction made FROM it
(the next document's first token); this one trains the latter and not the former.

In the pack, sample ``k`` is bin ``k``; its items are the pieces of documents it covers. A pack made this
way says ``"lookahead": true`` in pack.json: an item that stops inside its document takes that document's
next token as the label of its last position. Under ``causal`` a sample that ends exactly at a document's end
is labelled at its last position with the first token of the document that follows it in the stream, which the
entry records per bin (``bin_next_doc.npy``, -1 where the lookahead serves).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


def samples_for(total_tokens: int | None, epoch_tokens: int, seq_len: int) -> tuple[int, int]:
    """(samples, epochs): what ``--total-tokens`` asks for, or one epoch's worth (``(tokens − 1) // S``)."""
    if epoch_tokens == 0:
        return 0, 0
    if total_tokens is None:
        return (epoch_tokens - 1) // seq_len, 1
    samples = -(-total_tokens // seq_len)
    epochs = -(-(samples * seq_len + 1) // epoch_tokens)  # the last sample's label token must exist
    return samples, epochs


def samples_for_epochs(epochs: float, epoch_tokens: int, seq_len: int) -> tuple[int, int]:
    """(samples, epochs begun) for ``--epochs E``: Megatron's ``(E·tokens − 1) // S`` samples (E = 1: one epoch)."""
    if epoch_tokens == 0:
        return 0, 0
    samples = max(0, math.floor((epochs * epoch_tokens - 1) / seq_len))
    return samples, max(1, -(-(samples * seq_len + 1) // epoch_tokens))


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of epoch ``epoch``: ``seed`` itself for the first (the order ``--shuffle --seed`` gives
    the other methods), then one drawn from (seed, epoch), spread over 63 bits."""
    if epoch == 0:
        return seed
    mixed = np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32)
    return int((int(mixed[0]) << 31) ^ int(mixed[1]))


def chunk_items(lengths: np.ndarray, seq_len: int, samples: int, order: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the stream of documents ``order`` (positions into ``lengths``; all of them in turn when None, none
    empty) into samples.

    Returns ``(bin_offsets, item_pos, item_start, item_len)``: CSR over items, each a run of tokens of the
    document at position ``item_pos`` of the visiting order. The stream must hold ``samples·S + 1`` tokens.
    One linear pass over samples and documents (numba), as ``build_sample_idx`` walks them.
    """
    if samples <= 0:  # nothing to cut (an empty stream, or a size that asks for no sample)
        empty = np.zeros(0, np.int64)
        return np.zeros(1, np.int64), empty, empty, empty
    order = np.arange(len(lengths), dtype=np.int64) if order is None else order
    total = int(lengths[order].sum(dtype=np.int64)) if len(order) != len(lengths) else int(lengths.sum(dtype=np.int64))
    if total < samples * seq_len + 1:
        raise ValueError(f"the stream holds {total} tokens, {samples} samples of {seq_len} need "
                         f"{samples * seq_len + 1}")
    bin_offsets, items = _cut(lengths, order, np.int64(seq_len), np.int64(samples))
    return bin_offsets, items[:, 0], items[:, 1], items[:, 2]


@njit(cache=True)
def _cut(lengths, order, seq_len, samples):
    """One walk over samples and documents; items as rows (position, start, length): one write stream."""
    bin_offsets = np.empty(samples + 1, np.int64)
    items = np.empty((samples + len(order), 3), np.int64)  # at most one item per sample and per document
    i = d = off = 0
    length = lengths[order[0]]
    for k in range(samples):
        bin_offsets[k] = i
        remaining = seq_len
        while remaining > 0:
            avail = length - off
            take = remaining if remaining < avail else avail
            items[i, 0], items[i, 1], items[i, 2] = d, off, take
            i += 1
            remaining -= take
            if take == avail:
                d += 1
                off = 0
                if d < len(order):
                    length = lengths[order[d]]
            else:
                off += take
    bin_offsets[samples] = i
    return bin_offsets, items[:i]
