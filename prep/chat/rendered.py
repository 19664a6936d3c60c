"""A chat batch rendered column-wise (``prep/chat/columns.py``): its texts and assistant spans as UTF-8 bytes, and
where they cut into segments for the encoder.

Offsets are in bytes: the encoder reads each segment's bytes where they lie in the rendered batch, and a
conversation's text is decoded only where it is needed (``Rendered.text_of``, ``Rendered.spans``).
"""

from __future__ import annotations

import numpy as np
from xprep.prep.tokenizer import csr_offsets

SHAPE_COUNTS = 5  # xprep.prep.dataset.token_dataset.CONVERSATION_COUNTS (conversation_shape counts them per record)
# what ``str.strip()`` strips: ASCII bytes, and (as UTF-8) the other characters ``str.isspace`` calls space, which
# send a content that begins or ends with one the per-record way
ASCII_SPACE = np.zeros(256, bool)
ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
WIDE_SPACES = ("\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
               "\u2028\u2029\u202f\u205f\u3000")
WIDE_LEAD = np.zeros(256, bool)
WIDE_LEAD[[c.encode()[0] for c in WIDE_SPACES]] = True  # 0xC2, 0xE1, 0xE2, 0xE3


class Rendered:
    """One batch, column-wise: ``status[j]`` of record j; for the KEPT ones, in order, their texts as UTF-8 (``data``,
    conversation k at ``bounds[k]:bounds[k + 1]``) and assistant spans (``starts``/``ends`` in ``data``), as many
    per conversation as ``answers`` says. Offsets are in bytes: the encoder reads the segments' bytes where they lie
    (``segments``), and a conversation's text is decoded only where it is needed (``text_of``, ``spans``)."""

    def __init__(self, status: np.ndarray, data: np.ndarray | None = None, bounds: np.ndarray | None = None,
                 starts: np.ndarray | None = None, ends: np.ndarray | None = None, answers: np.ndarray | None = None,
                 categories: list | None = None, span_categories: list | None = None, end: str = "",
                 shape: np.ndarray | None = None):
        self.status, self.end = status, end  # end: the marker that ends each span
        # the kept conversations' shape: xprep.prep.dataset.token_dataset.CONVERSATION_COUNTS, summed over them
        self.shape = shape if shape is not None else np.zeros(SHAPE_COUNTS, np.int64)
        none = np.zeros(0, np.int64)
        self.data = data if data is not None else np.zeros(0, np.uint8)
        self.bounds = bounds if bounds is not None else np.zeros(1, np.int64)
        self.starts, self.ends = (starts, ends) if starts is not None else (none, none)
        self.answers = answers if answers is not None else none
        # the record's category of each kept conversation (None: the command's), each span's own (None: none)
        self.categories = categories if categories is not None else [None] * self.kept
        self.has_span_categories = span_categories is not None
        self.span_categories = span_categories if span_categories is not None else [None] * len(self.starts)
        self._first = csr_offsets(self.answers)  # each conversation's first span

    @property
    def kept(self) -> int:
        """How many conversations it holds: the batch's kept ones."""
        return len(self.bounds) - 1

    def text_of(self, k: int) -> str:
        """Conversation k's text, as ``render_with_spans`` gives it."""
        return self.data[self.bounds[k] : self.bounds[k + 1]].tobytes().decode("utf-8")

    @property
    def texts(self) -> list[str]:
        return [self.text_of(k) for k in range(self.kept)]

    def span_categories_of(self, k: int) -> list:
        """Conversation k's spans' own categories (None: none)."""
        return self.span_categories[self._first[k] : self._first[k + 1]]

    def spans(self, k: int) -> list[tuple[int, int]]:
        """Conversation k's spans, as ``render_with_spans`` gives them (characters, in its text)."""
        a, b, at = self._first[k], self._first[k + 1], self.bounds[k]
        chars = _chars_before(self.data[at : self.bounds[k + 1]])
        return list(zip(chars[self.starts[a:b] - at].tolist(), chars[self.ends[a:b] - at].tolist(), strict=True))

    def spans_with_categories(self, k: int) -> list[tuple[int, int, str | None]]:
        """Conversation k's spans with each one's own category, as the per-record way gives them."""
        return [(a, b, c) for (a, b), c in zip(self.spans(k), self.span_categories_of(k), strict=True)]

    def clean(self, cuts) -> np.ndarray:
        """Per conversation, whether every cut of its segments is clean under ``cuts`` (an ``encoder.Cuts``).

        A span starts after a head that ends with "\n" and ends with ``end`` (both checked here for the whole
        batch at once, so an ``end_len`` other than ``len(end)`` is checked cut by cut): with both rules proven
        for the tokenizer, the cuts to check are the starts, and a start is clean unless the answer begins with
        whitespace (``str.isspace``: an ASCII byte, or one of ``WIDE_SPACES`` after its lead byte).
        """
        data, starts, ends, n = self.data, self.starts, self.ends, self.kept
        row = np.repeat(np.arange(n), self.answers)
        # (an answer Llama 3's template strips never begins with whitespace here: a wide space at its start sends
        # its record the per-record way, see _strip)
        if not cuts.after_newline and not cuts.after_tokens:  # no clean cut (a Metaspace tokenizer): but at the ends
            bad = (starts > self.bounds[:-1][row]) | (ends < self.bounds[1:][row])
        elif cuts.after_newline and self.end in cuts.after_tokens and self._built():
            first = data[starts]  # (a span is never empty: it ends with the end marker)
            bad = ASCII_SPACE[first]
            for i in np.flatnonzero(WIDE_LEAD[first]).tolist():
                bad[i] = data[starts[i] : starts[i] + 3].tobytes().decode("utf-8", "replace")[:1].isspace()
        else:  # not what this module renders, or a tokenizer without both rules: every cut, one by one, in characters
            text, chars = data.tobytes().decode("utf-8"), _chars_before(data)
            last = chars[self.bounds[1:][row]].tolist()
            bad = np.array([not (cuts.clean(text, a) and (b == z or cuts.clean(text, b)))
                            for a, b, z in zip(chars[starts].tolist(), chars[ends].tolist(), last, strict=True)], bool)
        return np.bincount(row, weights=bad, minlength=n) == 0

    def _built(self) -> bool:
        """Whether every span starts after a "\n" and ends with ``end``, as this module renders them."""
        end = np.frombuffer(self.end.encode(), np.uint8)
        return bool(np.all(self.data[self.starts - 1] == ord("\n"))) and all(
            np.all(self.data[self.ends - len(end) + i] == byte) for i, byte in enumerate(end.tolist()))

    def segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the tokenize stage's ``ChatEncoder`` cuts each conversation into, for all of them at once: where the
        texts between and of the spans (a gap only where not empty) lie in ``data`` (CSR offsets: they follow each
        other), whether each is a span, how many each conversation has, and of each segment which span it is (-1 for
        a gap)."""
        n = self.kept
        per_row = 2 * self.answers + 2  # the conversation's start, each span's start and end, its end
        first = csr_offsets(per_row)
        points = np.empty(int(first[-1]), np.int64)
        points[first[:-1]] = self.bounds[:-1]
        points[first[1:] - 1] = self.bounds[1:]
        inner = np.ones(len(points), bool)
        inner[first[:-1]] = inner[first[1:] - 1] = False
        points[inner] = np.stack([self.starts, self.ends], 1).ravel()
        lo, hi = points[:-1], points[1:]
        row = np.repeat(np.arange(n), per_row)[:-1]  # each pair's conversation: that of its first point
        within = np.ones(len(lo), bool)
        within[first[1:-1] - 1] = False  # the pair from one conversation's end to the next one's start
        target = np.arange(len(lo)) % 2 == 1  # a block starts at an even index: its odd pairs are the spans
        keep = within & (target | (hi > lo))
        lo, hi, target = lo[keep], hi[keep], target[keep]
        counts = np.bincount(row[keep], minlength=n)
        span = np.full(len(target), -1, np.int64)
        span[target] = np.arange(int(target.sum()))  # spans come in order, one per odd pair
        return np.append(lo, hi[-1:]) if len(lo) else np.zeros(1, np.int64), target, counts, span


def _chars_before(data: np.ndarray) -> np.ndarray:
    """For each byte offset into UTF-8 ``data`` (its length included), how many characters come before it."""
    out = np.zeros(len(data) + 1, np.int64)
    np.cumsum((data & 0xC0) != 0x80, out=out[1:])
    return out
