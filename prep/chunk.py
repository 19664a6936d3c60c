"""``--method chunk``: pretraining samples cut from the documents walked as one stream (Megatron GPTDataset).

Documents, in order (or a seeded shuffle, epoch after epoch), are concatenated into one stream of tokens and
cut into samples of ``seq_len`` input tokens: sample ``k`` takes stream positions ``[k·S, (k+1)·S)`` and its
labels are the next tokens, up to position ``(k+1)·S``: the first token of sample ``k+1`` (megatron-core's
``build_sample_idx`` with ``add_extra_token_to_sequence``: ``S+1`` tokens per sample, the next one starting
on the last). So every token is a target once, no slot is padding, and the sample starts are exactly
Megatron's for the same document order. Unlike Megatron, the documents inside a sample stay apart: each is
an item of the bin (``cu_seqlens``), so attention and labels never cross a document boundary, and positions
restart at each document and at each sample start.

In the pack, sample ``k`` is bin ``k``; its items are the pieces of documents it covers. A pack made this
way says ``"lookahead": true`` in pack.json: an item that stops inside its document takes that document's
next token as the label of its last position.
"""

from __future__ import annotations

import numpy as np


def samples_for(total_tokens: int | None, epoch_tokens: int, seq_len: int) -> tuple[int, int]:
    """(samples, epochs): what ``--total-tokens`` asks for, or one epoch's worth (``(tokens − 1) // S``)."""
    if total_tokens is None:
        return (epoch_tokens - 1) // seq_len, 1
    samples = -(-total_tokens // seq_len)
    epochs = -(-(samples * seq_len + 1) // epoch_tokens)  # the last sample's label token must exist
    return samples, epochs


def chunk_items(lengths: np.ndarray, seq_len: int, samples: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the stream of documents with these lengths (in visiting order, none empty) into samples.

    Returns ``(bin_offsets, item_pos, item_start, item_len)``: CSR over items, each a run of tokens of the
    document at position ``item_pos`` of the visiting order. The stream must hold ``samples·S + 1`` tokens.
    Vectorized: the item boundaries are the sample starts merged with the document starts.
    """
    lengths = np.asarray(lengths, np.int64)
    cum = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=cum[1:])
    end = samples * seq_len
    if cum[-1] < end + 1:
        raise ValueError(f"the stream holds {int(cum[-1])} tokens, {samples} samples of {seq_len} need {end + 1}")
    sample_starts = np.arange(samples, dtype=np.int64) * seq_len
    doc_starts = cum[1:-1][cum[1:-1] < end]
    bounds = np.union1d(sample_starts, doc_starts)
    item_pos = np.searchsorted(cum, bounds, side="right") - 1
    item_start = bounds - cum[item_pos]
    item_len = np.diff(np.append(bounds, end))
    bin_offsets = np.append(np.searchsorted(bounds, sample_starts), len(bounds)).astype(np.int64)
    return bin_offsets, item_pos, item_start, item_len
