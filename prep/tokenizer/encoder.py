"""Text → token ids, with HF ``tokenizers`` as the reference and ``gigatoken`` as the fast path.

Ids are exactly ``tokenizers.Tokenizer.encode(text).ids`` (post-processor included, e.g. a BOS).
gigatoken does not apply the post-processor, so the special tokens it adds are found once by
diffing ``encode(x)`` with and without special tokens (prep/tokenizer/info.py), and added here. gigatoken is only
used after a self-check on a built-in sample gives identical ids (``choose_backend``, memoized per tokenizer content).
"""

from __future__ import annotations

import sys
from functools import cached_property, lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.tokenizer.cuts import METASPACE, Cuts, clean_cuts, spelling_rule
from xprep.prep.tokenizer.info import SELF_CHECK_SAMPLE, TokenizerInfo, load_hf
from xprep.prep.tokenizer.memo import cached, is_verdict

SELF_CHECK_VERSION = 2  # bump when _self_check checks something new (another sample, another comparison); 2: HF
# without the truncation or padding a tokenizer.json may set
# Texts on which gigatoken must encode UTF-8 bytes as it encodes str (Encoder._bytes_as_text): chat markup, text
# that normalization changes (NFC, NFKC), every width of character, whitespace runs
BYTES_PROBES = (
    "<|im_start|>assistant\nHi<|im_end|>\n", "<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>",
    "<s>[INST] q [/INST] a</s>", "e\u0301 \u212b \ufb01 \u00bd \u2460", "naïve café — 日本語 😀 👨‍👩‍👧",
    "  \t\r\n\n  x \u00a0\u3000\u2028 ", "", "x" * 300, "\ue000\U0010fffd",
)


class Encoder:
    """Batch encoder returning flat ids plus per-text lengths (CSR), never per-token Python."""

    def __init__(self, info: TokenizerInfo, backend: str):
        self.info = info
        self.backend = backend
        self._giga = _load_gigatoken(info.path) if backend == "gigatoken" else None
        self.prefix = np.array(info.prefix, np.int64)
        self.suffix = np.array(info.suffix, np.int64)

    @cached_property
    def cuts(self) -> Cuts:
        """Cuts of a text proven to leave its ids unchanged (``clean_cuts``)."""
        return clean_cuts(self.info)

    @property
    def hf(self):
        """The reference HF tokenizer, loaded on first use (the fast path rarely needs it)."""
        return load_hf(Path(self.info.path))

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Encode texts → (flat int64 ids, int64 lengths)."""
        if self._giga is not None:
            flat, lengths = _giga_encode(self._giga, texts)
            if add_special_tokens and (len(self.prefix) or len(self.suffix)):
                flat, lengths = add_around(flat, lengths, self.prefix, self.suffix)
            return flat, lengths
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens) if hasattr(
            self.hf, "encode_batch_fast") else self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        flat = np.concatenate([np.asarray(e.ids, np.int64) for e in encodings]) if encodings else np.zeros(0, np.int64)
        return flat, lengths

    def encode_utf8(self, texts: list[str], data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encode ``texts``, then each UTF-8 piece ``data[offsets[i]:offsets[i + 1]]``, in one call and without special
        tokens: gigatoken reads the pieces' bytes where they lie (no str for each), where it encodes bytes as it
        encodes their text (``_bytes_as_text``); else they are decoded first."""
        if self._giga is None or not self._bytes_as_text:
            cuts = offsets.tolist()
            pieces = [data[a:b].tobytes().decode("utf-8") for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            return self.encode(texts + pieces, add_special_tokens=False)
        head = [t.encode("utf-8") for t in texts]
        lead = np.frombuffer(b"".join(head), np.uint8)
        all_data = np.concatenate([lead, data[offsets[0] : offsets[-1]]])
        all_offsets = np.concatenate([csr_offsets([len(h) for h in head]), offsets[1:] - offsets[0] + len(lead)])
        return _giga_encode(self._giga, _bytestrings(all_data, all_offsets))

    def warm(self, chat: bool) -> None:
        """Load what the first batch would: gigatoken's batch results are awkward arrays (~0.15 s to import); a chat's
        token starts read the vocabulary's spelling (``_spelling``: ~0.05 s, 151k ids) and the memoized verdict
        on offsets."""
        if self._giga is None:
            return
        _ = self._bytes_as_text
        if chat:
            _ = self._spelling
            self._offsets_are_bytes()

    @cached_property
    def _bytes_as_text(self) -> bool:
        """Whether gigatoken encodes a text's UTF-8 bytes as it encodes the text (checked on ``BYTES_PROBES`` and the
        special tokens looked up for this tokenizer, once per Encoder)."""
        texts = [*BYTES_PROBES, "\n".join(t for t in self.info.known_ids if t)]
        data = np.frombuffer("".join(texts).encode("utf-8"), np.uint8)
        offsets = csr_offsets([len(t.encode("utf-8")) for t in texts])
        (ids, lengths), (text_ids, text_lengths) = (_giga_encode(self._giga, _bytestrings(data, offsets)),
                                                    _giga_encode(self._giga, texts))
        return np.array_equal(ids, text_ids) and np.array_equal(lengths, text_lengths)

    def offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Reference ids and character start offsets of ``text`` (no special tokens added)."""
        enc = self.hf.encode(text, add_special_tokens=False)
        return np.array(enc.ids, np.int64), np.array([s for s, _ in enc.offsets], np.int64)

    def char_starts(self, text: str, ids: np.ndarray) -> np.ndarray:
        """The character offset at which each of ``ids`` (this encoder's ids of ``text``, no special tokens added)
        begins, as HF tokenizers' offsets give it.

        From gigatoken's own token bytes where they spell ``text`` exactly and this tokenizer's offsets are
        byte-derived (``_offsets_verdict``, checked against HF once per tokenizer and memoized): then HF
        tokenizers never loads (~1 s). Elsewhere (a normalizer that changed the text, HF as the backend) from
        HF's offsets, whose ids must be ``ids``.
        """
        starts = self._starts_from_bytes(text, ids)
        if starts is not None and self._offsets_are_bytes():
            return starts
        ref_ids, starts = self.offsets(text)
        if not np.array_equal(ref_ids, ids):
            raise XprepError("the encoder disagrees with HF tokenizers on a rendered chat; use --backend hf")
        return starts

    def _starts_from_bytes(self, text: str, ids: np.ndarray) -> np.ndarray | None:
        """``byte_char_starts`` of ``ids`` from their spelling (``_spelled_starts``), or None where gigatoken does not
        encode or the tokens do not spell ``text`` byte for byte (a normalizer changed it)."""
        if self._giga is None:
            return None
        data = np.frombuffer(text.encode(), np.uint8)
        starts, spelled = self._spelled_starts(data, np.array([0, len(data)]), ids, np.array([len(ids)]))
        return byte_char_starts(data, starts) if spelled[0] else None

    def token_starts(self, data: np.ndarray, bounds: np.ndarray, flat: np.ndarray, lengths: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """``_spelled_starts`` of several texts at once, or None where this tokenizer's offsets are not its
        spelling's (``_offsets_are_bytes``)."""
        if self._giga is None or not self._offsets_are_bytes():
            return None
        return self._spelled_starts(data, bounds, flat, lengths)

    def _spelled_starts(self, data: np.ndarray, bounds: np.ndarray, flat: np.ndarray, lengths: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Where each token of several texts begins, in bytes of ``data`` (text k is ``data[bounds[k]:bounds[k + 1]]``,
        its ids the k-th ``lengths`` of ``flat``), from the tokens' spelling (``_spelling``); and per text whether
        its tokens spell it byte for byte (where not, its starts are not to be used)."""
        spelled, offsets, opens, added = self._spelling
        at, size = offsets[flat], offsets[flat + 1] - offsets[flat]
        first_token = csr_offsets(lengths)
        if opens is not None and len(flat):  # the ▁ the normalizer put before each section is no byte of the text
            first = np.zeros(len(flat), bool)
            first[1:] = added[flat[:-1]]
            first[first_token[:-1][lengths > 0]] = True  # each text starts a section
            drop = first & opens[flat] & ~added[flat]
            at, size = at + drop, size - drop
        row = np.repeat(np.arange(len(lengths)), lengths)
        spent = csr_offsets(size)  # bytes spelled before each token, over all texts
        starts = bounds[:-1][row] + spent[:-1] - spent[first_token[:-1]][row]
        ok = spent[first_token[1:]] - spent[first_token[:-1]] == np.diff(bounds)
        ends_empty = lengths > 0
        ends_empty[ends_empty] = size[first_token[1:][ends_empty] - 1] == 0
        ok &= ~ends_empty  # (a last token of no byte would start past its text)
        # the tokens of the texts spelled to their length tile those texts byte after byte: compare every byte
        take = ok[row]
        in_text = np.flatnonzero(np.repeat(ok, np.diff(bounds)))
        source = in_text.astype(np.int32) + np.repeat((at[take] - starts[take]).astype(np.int32), size[take])
        wrong = spelled[source] != data[in_text]  # (int32: a batch is far below 2 GB)
        if wrong.any():
            ok[np.searchsorted(bounds, in_text[wrong], side="right") - 1] = False
        return starts, ok

    @cached_property
    def _spelling(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """How each id spells the text: its bytes (flat, CSR ``offsets``) as gigatoken's vocabulary holds them, with
        "▁" read as the space it stands for where the normalizer writes spaces so (``spelling_rule``); then
        ``opens``: the ids whose "▁" first may be the one it prepends to a section (None where it prepends none),
        and ``added``: the added tokens' ids, between which the sections lie. Built once per encoder."""
        prepends, added_ids = spelling_rule(self.info)
        vocab = self._giga.backend.vocab
        pieces = [vocab.get(i, b"") for i in range(max(vocab, default=-1) + 1)]
        if prepends:
            pieces = [p.replace(METASPACE, b" ") for p in pieces]
        offsets = csr_offsets([len(p) for p in pieces])
        added = np.zeros(len(pieces) + 1, bool)
        added[[i for i in added_ids if i < len(pieces)]] = True
        opens = np.array([p[:1] == b" " for p in pieces] + [False]) if prepends else None
        return np.frombuffer(b"".join(pieces), np.uint8), offsets, opens, added

    def _offsets_are_bytes(self) -> bool:
        if not hasattr(self, "_bytes_verdict"):
            self._bytes_verdict = _offsets_verdict(self)[0]
        return self._bytes_verdict


def byte_char_starts(data: np.ndarray, first_bytes: np.ndarray) -> np.ndarray:
    """Index of the character that holds each of ``first_bytes`` in the UTF-8 bytes ``data``: a token that begins
    inside a character gets that character's index."""
    char_of_byte = np.cumsum((data & 0xC0) != 0x80) - 1  # a UTF-8 continuation byte adds no character
    return char_of_byte[first_bytes] if len(data) else first_bytes


@lru_cache(maxsize=4)
def _load_gigatoken(path: str):
    import gigatoken  # optional: without it choose_backend falls back to HF tokenizers

    return gigatoken.Tokenizer(path)


def _giga_encode(giga, texts) -> tuple[np.ndarray, np.ndarray]:
    """gigatoken's ids of ``texts`` (a list of str, or ``_bytestrings``) as (flat int64 ids, int64 lengths)."""
    import awkward as ak  # deferred: ~0.35 s to import, and only the gigatoken path needs it

    layout = ak.to_layout(giga.encode_batch(texts))
    offsets = np.asarray(layout.offsets.data)
    flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]].astype(np.int64)
    return flat, np.diff(offsets).astype(np.int64)


def _bytestrings(data: np.ndarray, offsets: np.ndarray):
    """An awkward array of byte strings over ``data`` (piece i at ``offsets[i]:offsets[i + 1]``), copying nothing:
    what gigatoken's batch encoder reads as flat buffers."""
    import awkward as ak  # deferred: as in _giga_encode

    content = ak.contents.NumpyArray(data, parameters={"__array__": "byte"})
    return ak.Array(ak.contents.ListOffsetArray(ak.index.Index64(offsets), content,
                                                parameters={"__array__": "bytestring"}))


def csr_offsets(lengths) -> np.ndarray:
    """CSR offsets of ``lengths``: [0, l0, l0+l1, ...] (int64), where each of them starts laid end to end, and
    (last) where the last ends."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def add_around(flat: np.ndarray, lengths: np.ndarray, prefix: np.ndarray, suffix: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Put ``prefix`` before and ``suffix`` after every sequence of a CSR batch (vectorized)."""
    n, p, s = len(lengths), len(prefix), len(suffix)
    new_lengths = lengths + p + s
    out = np.empty(int(new_lengths.sum()), flat.dtype)
    starts = np.zeros(n, np.int64)
    np.cumsum(new_lengths[:-1], out=starts[1:])
    body = np.ones(len(out), bool)
    for j in range(p):
        out[starts + j] = prefix[j]
        body[starts + j] = False
    ends = starts + new_lengths
    for j in range(s):
        out[ends - s + j] = suffix[j]
        body[ends - s + j] = False
    out[body] = flat
    return out, new_lengths


def choose_backend(info: TokenizerInfo, requested: str) -> tuple[str, str]:
    """Pick the encoder backend; gigatoken only if it loads and matches HF on the self-check sample.

    The verdict is memoized per (self-check version, tokenizer content, gigatoken version,
    tokenizers version). Returns (backend, reason) so the caller can say what it chose and why.
    """
    if requested == "hf":
        return "hf", "requested"
    try:
        versions = f"{version('gigatoken')}-{version('tokenizers')}"
    except PackageNotFoundError:  # gigatoken not installed: no fast path
        ok, reason = False, "gigatoken is not installed"
    else:
        name = f"selfcheck-v{SELF_CHECK_VERSION}-{info.sha256[:40]}-{versions}.json"
        ok, reason = cached(info.cache_dir, name, lambda: _self_check(info), is_verdict)
    if ok:
        return "gigatoken", reason
    if requested == "gigatoken":
        raise XprepError(f"--backend gigatoken: {reason}; use --backend auto or hf")
    print(f"xprep: using HF tokenizers: {reason}", file=sys.stderr)
    return "hf", reason


# Where a chat span boundary splits a pre-token: text whose tokens straddle a boundary, and the sample's.
OFFSETS_SAMPLE = [*SELF_CHECK_SAMPLE, "<|im_start|>assistant\n\n\nanswer<|im_end|>", "x😀y日本語  z", "é\u0301 ½ "]
OFFSETS_CHECK_VERSION = 2  # bump when _offsets_check checks something new


def _offsets_verdict(encoder: Encoder) -> list:
    """[ok, reason]: whether character offsets derived from gigatoken's token bytes (``byte_char_starts``) equal
    HF tokenizers' offsets on ``OFFSETS_SAMPLE`` for this tokenizer; memoized like the self-check."""
    versions = f"{version('gigatoken')}-{version('tokenizers')}"
    name = f"offsets-v{OFFSETS_CHECK_VERSION}-{encoder.info.sha256[:40]}-{versions}.json"
    return cached(encoder.info.cache_dir, name, lambda: _offsets_check(encoder), is_verdict)


def _offsets_check(encoder: Encoder) -> tuple[bool, str]:
    specials = [t for t, i in encoder.info.known_ids.items() if t and i is not None]
    sample = OFFSETS_SAMPLE + [f"{t}x {t} y{t}\n z{t}{t}  w" for t in specials]  # sections between added tokens
    flat, lengths = encoder.encode(sample, add_special_tokens=False)
    compared = 0
    for text, ids in zip(sample, np.split(flat, np.cumsum(lengths)[:-1]), strict=True):
        from_bytes = encoder._starts_from_bytes(text, ids)
        if from_bytes is None:
            continue  # a normalizer changed it: such text always takes HF's offsets
        ref_ids, starts = encoder.offsets(text)
        if not np.array_equal(ref_ids, ids) or not np.array_equal(from_bytes, starts):
            return False, "HF offsets are not the token bytes' on the sample"
        compared += 1
    return compared > 0, f"byte offsets agree with HF on {compared} sample texts"


def _self_check(info: TokenizerInfo) -> tuple[bool, str]:
    try:
        fast = Encoder(info, "gigatoken")
    except Exception as e:  # any failure to load means: do not use it
        first_line = next(iter(str(e).splitlines()), "")  # its messages go on with a source location
        return False, f"gigatoken cannot load this tokenizer ({type(e).__name__}: {first_line})"
    got_flat, got_len = fast.encode(SELF_CHECK_SAMPLE)
    want = [fast.hf.encode(t).ids for t in SELF_CHECK_SAMPLE]
    want_flat = np.array([i for ids in want for i in ids], np.int64)
    if np.array_equal(got_len, [len(w) for w in want]) and np.array_equal(got_flat, want_flat):
        return True, "self-check passed"
    return False, "gigatoken ids differ from HF tokenizers on the self-check sample"
