"""A batch's rendered conversations → token ids, loss mask and categories, each conversation's.

Every conversation is encoded as its span-separated segments, in one encoder call for the whole batch, and the
assistant spans are marked as targets. A conversation is (text, spans) or, for a batch ``xprep.prep.chat.columns``
rendered, the index of one of its kept conversations, whose segments it cuts for all of them at once. Where every
cut of a conversation is proven clean for this tokenizer (``Encoder.cuts``: right after an added token such as
the end-of-turn marker, or after "\\n" before a character that is not whitespace) its segment ids are its ids.
Elsewhere its whole text is encoded too: where the segment ids still concatenate to its ids, the segment lengths
give the mask, else each token's first character (``Encoder.char_starts``) places it inside or outside the spans.
Under ``--train-on all`` with one category for everything, no segment is needed at all; over a tokenizer without
any clean cut, the column-wise conversations are encoded whole and masked by where their tokens start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xprep.prep.chat import Rendered
from xprep.prep.tokenizer import Encoder, csr_offsets

Document = tuple[np.ndarray, np.ndarray, np.ndarray]  # ids, loss mask, category codes


@dataclass
class Segments:
    """A batch's conversations cut at their spans' bounds, in encoding order: the per-record ones, then (where
    the batch was rendered column-wise) that rendering's kept ones.

    Per conversation (``convs``): its index among the batch's chats, its spans (None: column-wise) and category;
    how many segments it has (``counts``) and whether every cut of it is clean (``clean``). Per segment: whether
    it is a span (``target``) and its category code (``cats``). The per-record segments' texts are ``texts`` (the
    conversations' own: ``whole``); the column-wise ones lie in the rendered batch's bytes, at ``offsets``.
    """

    whole: list[str]
    texts: list[str]
    target: np.ndarray
    cats: np.ndarray
    counts: np.ndarray
    clean: np.ndarray
    convs: list[tuple[int, list | None, object]]
    span_codes: np.ndarray  # each span's category code, in order
    offsets: np.ndarray | None = None

    @property
    def per_record(self) -> int:
        """How many conversations come first, cut from their texts: the column-wise ones follow."""
        return len(self.whole)

    def text_of(self, k: int, rendered: Rendered | None) -> str:
        """Conversation k's text."""
        return self.whole[k] if k < self.per_record else rendered.text_of(k - self.per_record)


class ChatEncoder:
    """Encodes a batch's conversations (see the module's docstring); ``train_on``: ``--train-on``."""

    def __init__(self, encoder: Encoder, train_on: str):
        self.encoder, self.train_on = encoder, train_on

    def __call__(self, chats: list, code, rendered: Rendered | None = None) -> list[Document]:
        """(ids, loss mask, category codes) of each of ``chats`` ((payload, category) each), in order; ``code``
        gives a category's code in the batch (taken in the order the per-record way takes them)."""
        seg = self._cut(chats, code, rendered)
        columnar = [j for j, (payload, _) in enumerate(chats) if isinstance(payload, int)]
        conv_code = span_code = None
        if columnar:
            conv_code, span_code = self._add_columns(seg, chats, columnar, rendered, code)
        if not self._needs_segments(seg.span_codes, seg.convs, code):
            return self._encode_whole(seg.whole, rendered if columnar else None, seg.convs, len(chats),
                                      code(seg.convs[0][2]))
        done: dict = {}  # column-wise conversations encoded whole, masked by where their tokens start
        if columnar and not (self.encoder.cuts.after_newline or self.encoder.cuts.after_tokens):
            by_starts = self._columns_by_starts(rendered, conv_code, span_code, [chats[j][1] for j in columnar], code)
            if by_starts is not None:  # the per-record conversations go on below
                done = dict(zip(columnar, by_starts, strict=True))
                columnar, rendered, seg.convs = [], None, seg.convs[: seg.per_record]
                if not seg.convs:
                    return _first_not_a_target([done[j] for j in range(len(chats))])
        if columnar:
            self._add_column_segments(seg, rendered, conv_code, span_code)
        out = self._assemble(seg, self._encode_segments(seg, rendered), rendered, len(chats), code)
        for j, item in done.items():
            out[j] = item
        return _first_not_a_target(out)

    # -- the four steps: cut, add the column-wise conversations, encode, assemble -------------------------------
    def _cut(self, chats: list, code, rendered: Rendered | None) -> Segments:
        """Each per-record conversation cut into its gaps and spans (a gap only where not empty), with category
        codes; the column-wise ones' codes are taken now, in the order the per-record way would take them."""
        whole, texts, target, cats, counts, clean, convs = [], [], [], [], [], [], []
        cuts = self.encoder.cuts
        for j, (payload, cat) in enumerate(chats):
            if isinstance(payload, int):
                code(cat)
                if rendered is not None and rendered.has_span_categories:
                    for span_cat in rendered.span_categories_of(payload):
                        code(span_cat or cat)
                continue
            text, spans = payload
            whole.append(text)
            convs.append((j, spans, cat))
            pos, first = 0, len(texts)
            for start, end, span_cat in spans:
                if start > pos:
                    texts.append(text[pos:start])
                    target.append(False)
                    cats.append(code(cat))
                texts.append(text[start:end])
                target.append(True)
                cats.append(code(span_cat or cat))
                pos = end
            if pos < len(text):
                texts.append(text[pos:])
                target.append(False)
                cats.append(code(cat))
            counts.append(len(texts) - first)
            clean.append(cuts.spans_clean(text, spans))
        target, cats = np.array(target, bool), np.array(cats, np.uint16)
        return Segments(whole, texts, target, cats, np.array(counts, np.int64), np.array(clean, bool), convs,
                        span_codes=cats[target])  # a gap's code is its conversation's

    @staticmethod
    def _add_columns(seg: Segments, chats: list, columnar: list[int], rendered: Rendered, code
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The column-wise conversations (all of the rendered batch's kept ones, in order) after the per-record
        ones; returns each one's category code and each of their spans' (its own, else its record's)."""
        assert rendered is not None and len(columnar) == rendered.kept
        seg.convs += [(j, None, chats[j][1]) for j in columnar]
        conv_code = np.array([code(chats[j][1]) for j in columnar], np.uint16)
        span_code = np.repeat(conv_code, rendered.answers)  # a span without a category of its own: its record's
        if rendered.has_span_categories:
            own = [(i, c) for i, c in enumerate(rendered.span_categories) if c is not None]
            span_code[[i for i, _ in own]] = [code(c) for _, c in own]
        seg.span_codes = np.concatenate([seg.span_codes, span_code])
        return conv_code, span_code

    def _add_column_segments(self, seg: Segments, rendered: Rendered, conv_code: np.ndarray,
                             span_code: np.ndarray) -> None:
        """The column-wise conversations' segments, cut for all of them at once (``Rendered.segments``)."""
        seg.offsets, target, counts, span = rendered.segments()
        seg.target = np.concatenate([seg.target, target])
        column_cat = np.repeat(conv_code, counts)
        column_cat[span >= 0] = span_code[span[span >= 0]]
        seg.cats = np.concatenate([seg.cats, column_cat])
        seg.counts = np.concatenate([seg.counts, counts])
        seg.clean = np.concatenate([seg.clean, rendered.clean(self.encoder.cuts)])

    def _encode_segments(self, seg: Segments, rendered: Rendered | None) -> tuple:
        """Every segment, and the whole text of each conversation with a cut not proven clean, in one encoder
        call (the column-wise segments' bytes as they lie in the rendered batch): (which conversations were
        encoded whole, their ids, offsets into those, the segments' ids, each segment's length)."""
        whole = np.flatnonzero(~seg.clean)
        ahead = [seg.text_of(k, rendered) for k in whole] + seg.texts
        if seg.offsets is not None:
            flat, lengths = self.encoder.encode_utf8(ahead, rendered.data, seg.offsets)
        else:
            flat, lengths = self.encoder.encode(ahead, add_special_tokens=False)
        whole_off = csr_offsets(lengths[: len(whole)])
        split = int(whole_off[-1])
        return whole, flat[:split], whole_off, flat[split:], lengths[len(whole):]

    def _assemble(self, seg: Segments, encoded: tuple, rendered: Rendered | None, n: int, code) -> list:
        """Each conversation's (ids, mask, categories) from its segments; one encoded whole whose segment ids are
        not its ids gets its mask from where each of its tokens starts (``_doc_by_offsets``)."""
        whole, whole_flat, whole_off, seg_flat, seg_len = encoded
        conv_seg = csr_offsets(seg_len)[csr_offsets(seg.counts)]  # each conversation's first segment id in seg_flat
        target = np.repeat(seg.target, seg_len)
        cats = np.repeat(seg.cats, seg_len)
        mask = np.ones(len(target), np.uint8) if self.train_on == "all" else target.view(np.uint8).copy()
        out: list = [None] * n
        for k, (j, _, _) in enumerate(seg.convs):
            sa, sb = conv_seg[k], conv_seg[k + 1]
            out[j] = (seg_flat[sa:sb], mask[sa:sb], cats[sa:sb])
        for w, k in enumerate(whole.tolist()):
            j, spans, cat = seg.convs[k]
            ids = whole_flat[whole_off[w] : whole_off[w + 1]]
            sa, sb = conv_seg[k], conv_seg[k + 1]
            if not (sb - sa == len(ids) and np.array_equal(seg_flat[sa:sb], ids)):
                spans = spans if spans is not None else rendered.spans_with_categories(k - seg.per_record)
                out[j] = self._doc_by_offsets(seg.text_of(k, rendered), ids, spans, cat, code)
        return out

    # -- the ways around the segments ------------------------------------------------------------------------------
    def _needs_segments(self, span_codes: np.ndarray, convs: list, code) -> bool:
        """Whether the spans matter: for the mask (not ``--train-on all``) or for a category of their own."""
        one = code(convs[0][2])
        return (self.train_on != "all" or not np.all(span_codes == one)
                or any(code(c) != one for *_, c in convs))

    def _encode_whole(self, texts: list[str], rendered: Rendered | None, convs: list, n: int, cat: int
                      ) -> list[Document]:
        """Where every token is a target of one category: the whole texts only (``texts``, then those of
        ``rendered``)."""
        if rendered is not None:
            flat, lengths = self.encoder.encode_utf8(texts, rendered.data, rendered.bounds)
        else:
            flat, lengths = self.encoder.encode(texts, add_special_tokens=False)
        off = csr_offsets(lengths)
        mask = np.ones(len(flat), np.uint8)
        mask[off[:-1][lengths > 0]] = 0
        cats = np.full(len(flat), cat, np.uint16)
        out: list = [None] * n
        for k, (j, _, _) in enumerate(convs):
            out[j] = (flat[off[k] : off[k + 1]], mask[off[k] : off[k + 1]], cats[off[k] : off[k + 1]])
        return out

    def _columns_by_starts(self, rendered: Rendered, conv_code: np.ndarray, span_code: np.ndarray, cats: list,
                           code) -> list[Document] | None:
        """A column-wise batch's conversations where no cut is clean for this tokenizer (one that writes spaces as
        "▁", say): each encoded whole, its mask and categories from where its tokens start against the spans, for
        the whole batch at once (byte offsets: a token that starts inside a span's first character is in, as by
        characters). A conversation its tokens do not spell goes through ``_doc_by_offsets``; None where the
        encoder cannot tell where tokens start (then each is cut into segments)."""
        flat, lengths = self.encoder.encode_utf8([], rendered.data, rendered.bounds)
        found = self.encoder.token_starts(rendered.data, rendered.bounds, flat, lengths)
        if found is None:
            return None
        starts, spelled = found
        row = np.repeat(np.arange(rendered.kept), lengths)
        target, k = _in_spans(starts, rendered.starts, rendered.ends)
        token_cats = np.where(target, span_code[k], conv_code[row]) if len(span_code) else conv_code[row]
        mask = self._loss_mask(target)
        off = csr_offsets(lengths)
        out = []
        for c, ok in enumerate(spelled.tolist()):
            ids, doc = flat[off[c] : off[c + 1]], slice(off[c], off[c + 1])
            out.append((ids, mask[doc], token_cats[doc]) if ok else
                       self._doc_by_offsets(rendered.text_of(c), ids, rendered.spans_with_categories(c), cats[c], code))
        return out

    def _doc_by_offsets(self, text, ids, spans, cat, code) -> Document:
        """A conversation's (ids, loss mask, categories), its mask from where each token starts
        (``_mask_from_offsets``): what a conversation whose segments do not make its ids gets."""
        target, cats = self._mask_from_offsets(text, ids, spans, cat, code)
        return ids, self._loss_mask(target), cats

    def _loss_mask(self, target: np.ndarray) -> np.ndarray:
        """The loss mask of tokens ``target`` marks as in an assistant span: those, or all under --train-on all."""
        return np.ones(len(target), np.uint8) if self.train_on == "all" else target.astype(np.uint8)

    def _mask_from_offsets(self, text, ids, spans, cat, code):
        """Each token of ``ids`` (``text``'s) a target where it begins inside a span, with the span's category;
        the others of ``cat``. Spans come in order, none overlapping: each token's is found by bisection."""
        starts = self.encoder.char_starts(text, ids)
        cats = np.full(len(ids), code(cat), np.uint16)
        lo, hi = np.array([a for a, _, _ in spans], np.int64), np.array([b for _, b, _ in spans], np.int64)
        span_codes = np.array([code(c or cat) for *_, c in spans], np.uint16)
        assert np.all(lo[1:] >= hi[:-1]), "assistant spans out of order"
        target, k = _in_spans(starts, lo, hi)
        cats[target] = span_codes[k[target]]
        return target, cats


def _first_not_a_target(out: list[Document]) -> list[Document]:
    """A document's first token is never a target (nothing comes before it to predict it from)."""
    for _, doc_mask, _ in out:
        doc_mask[:1] = 0
    return out


def _in_spans(starts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each of ``starts`` lies inside a span ``[lo, hi)`` (in order, none overlapping), and the span it would
    lie in: the last that begins at or before it (0 where none does), found by bisection."""
    if not len(lo):
        return np.zeros(len(starts), bool), np.zeros(len(starts), np.int64)
    k = np.maximum(np.searchsorted(lo, starts, side="right") - 1, 0)
    return (starts >= lo[k]) & (starts < hi[k]), k
