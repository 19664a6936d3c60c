"""The Processor: one batch of records → its documents as flat token, loss-mask and category arrays.

It parses the batch (``records.py``; a chat batch rendered column-wise first, where the template's registry entry
allows it), encodes its text documents in one encoder call and its conversations through their segments
(``chats.py``), and keeps pre-tokenized ones as they are. Pure: the same batch gives the same arrays, in whatever
process (``pool.py``) it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from xprep.prep.chat import SHAPE_COUNTS, ChatTemplate, Rendered, TemplateSpec
from xprep.prep.chat import columns as chat_columns
from xprep.prep.dataset import token_dtype
from xprep.prep.formats import AUTO, CHAT, TEXT, TOKENS
from xprep.prep.sources import LINES, ROWS, RawBatch
from xprep.prep.tokenize.chats import ChatEncoder
from xprep.prep.tokenize.config import Options
from xprep.prep.tokenize.records import RecordParser, Rejected
from xprep.prep.tokenizer import Encoder, TokenizerInfo, add_around, csr_offsets


@dataclass
class Encoded:
    """One batch of documents as flat arrays, plus the records rejected on the way.

    ``cat_codes`` index into ``cat_keys`` (name strings, or ints kept verbatim from
    pre-tokenized data); code 0 is "no category". Arrays are None when no document needs them.
    """

    source: int
    tokens: np.ndarray
    lengths: np.ndarray
    loss_mask: np.ndarray | None
    cat_codes: np.ndarray | None
    cat_keys: list
    rejects: list[Rejected] = field(default_factory=list)
    bytes_in: int = 0
    # the batch's conversations by shape: xprep.prep.dataset.token_dataset.CONVERSATION_COUNTS
    conversations: np.ndarray = field(default_factory=lambda: np.zeros(SHAPE_COUNTS, np.int64))


class CategoryCodes:
    """A batch's local category codes: code 0 is "no category" (None), the others in order of first use;
    ``keys[code]`` is the category (a name, or an int kept verbatim from pre-tokenized data)."""

    def __init__(self):
        self.keys: list = [None]
        self._code_of: dict = {None: 0}

    def __call__(self, key) -> int:
        if key not in self._code_of:
            self._code_of[key] = len(self.keys)
            self.keys.append(key)
        return self._code_of[key]


class Processor:
    """Parses, validates and encodes RawBatches. Pure: same batch in, same arrays out.

    ``chat_render`` (``--chat-render``) picks the chat renderer: ``auto`` the column-wise path where it applies,
    ``records`` the per-record one, ``jinja`` the template's own Jinja for everything; the arrays are the same.
    """

    def __init__(self, info: TokenizerInfo, backend: str, template: TemplateSpec | None, options: Options,
                 chat_render: str = "auto"):
        self.encoder = Encoder(info, backend)
        self.template = ChatTemplate(template, fast=chat_render != "jinja") if template is not None else None
        self.options = options
        self.records = RecordParser(options, self.template)
        self.chats = ChatEncoder(self.encoder, options.train_on)
        plain = options.format in (AUTO, CHAT) and chat_render == "auto"
        self._columns_for = ((self.template, options.train_on == "all", options.category_field, options.role_map)
                             if plain and self.template else None)
        self._columns = None
        # ids leave a worker process in the narrowest type that holds the vocabulary (the writer's own, as a rule):
        # int64 would double what crosses the pipe (50 MB of chat: 77 MB of ids)
        self._token_dtype = token_dtype(options.vocab_size)

    @property
    def columns(self) -> chat_columns.ColumnarChat | None:
        """The column-wise chat path (``chat_columns``) where it applies, built on first use: it imports pyarrow
        and checks its probes, which a text corpus under ``--format auto`` never needs."""
        if self._columns_for is not None:
            self._columns = chat_columns.for_template(*self._columns_for)
            self._columns_for = None
        return self._columns

    def warm(self) -> None:
        """Build now what the first batch would: a process forks its workers after this, which then share it."""
        _ = self.columns
        self.encoder.warm(chat=self.template is not None)

    def __call__(self, batch: RawBatch) -> Encoded:
        chat = batch.holds == LINES and batch.items and chat_columns.chat_field(batch.items[0]) is not None
        rendered = self.columns.render(batch.items) if chat and self.columns is not None else None
        # the conversations' shape: those rendered column-wise counted so, the others as parsed, one by one
        docs, rejects = self.records.batch(batch, rendered)
        out = self._encode(batch.source, docs, rendered)
        out.tokens = out.tokens.astype(self._token_dtype, copy=False)
        out.rejects = rejects
        out.bytes_in = sum(len(i) for i in batch.items) if batch.holds != ROWS else 0
        out.conversations = self.records.shape
        return out

    def _encode(self, source: int, docs: list, rendered: Rendered | None = None) -> Encoded:
        """The batch's documents ((kind, payload, category) each) as one Encoded: text ones in one encoder call
        (a batch of text only, fully vectorized), chat ones through their segments, tokens as given."""
        code = CategoryCodes()
        need_cat = _needs_categories(docs, rendered)
        texts = [p for kind, p, _ in docs if kind == TEXT]
        text_ids = self.encoder.encode(texts, add_special_tokens=True) if texts else None
        if texts and len(texts) == len(docs):  # the common case
            return self._text_batch(source, *text_ids, [cat for _, _, cat in docs], need_cat, code)
        chats = [(p, cat) for kind, p, cat in docs if kind == CHAT]
        chat_docs = self.chats(chats, code, rendered) if chats else []
        return self._concatenate(source, docs, self._documents(docs, text_ids, chat_docs, need_cat, code),
                                 need_cat, code.keys)

    def _text_batch(self, source, flat, lengths, cats, need_cat, code: CategoryCodes) -> Encoded:
        if self._appends_eod(TEXT):
            flat, lengths = add_around(flat, lengths, np.zeros(0, np.int64),
                                       np.array([self.options.eod_id], np.int64))
        codes = np.repeat(np.array([code(c) for c in cats], np.uint16), lengths) if need_cat else None
        return Encoded(source, flat, lengths, None, codes, code.keys)

    @staticmethod
    def _documents(docs: list, text_ids: tuple | None, chat_docs: list, need_cat: bool, code: CategoryCodes
                   ) -> list[tuple]:
        """Each document's (ids, loss mask or None, category codes or None), in order: text ones cut from the
        batch's encoding (``text_ids``), chat ones from ``chat_docs``, pre-tokenized ones as given."""
        offsets = csr_offsets(text_ids[1]) if text_ids is not None else None
        chat_docs, ti, out = iter(chat_docs), 0, []
        for kind, payload, cat in docs:
            if kind == TEXT:
                ids = text_ids[0][offsets[ti] : offsets[ti + 1]]
                ti += 1
                out.append((ids, None, np.full(len(ids), code(cat), np.uint16) if need_cat else None))
            elif kind == CHAT:
                out.append(next(chat_docs))
            else:
                out.append(_token_document(payload, cat, code))
        return out

    def _concatenate(self, source: int, docs: list, arrays: list[tuple], need_cat: bool, keys: list) -> Encoded:
        """The documents' arrays end to end, each with its end-of-document token where one is appended; a
        document without a mask (text) learns every token but its first."""
        need_mask = any(kind != TEXT for kind, _, _ in docs)
        parts_tok, parts_len, parts_mask, parts_cat = [], [], [], []
        for (kind, _, _), (ids, mask, cats) in zip(docs, arrays, strict=True):
            if self._appends_eod(kind):
                ids = np.append(ids, self.options.eod_id)
                if mask is not None:
                    mask = np.append(mask, 1)
                if cats is not None:
                    cats = np.append(cats, cats[-1] if len(cats) else 0)
            parts_tok.append(ids)
            parts_len.append(len(ids))
            if need_mask:
                if mask is None:
                    mask = np.ones(len(ids), np.uint8)
                    mask[:1] = 0
                parts_mask.append(np.asarray(mask, np.uint8))
            if need_cat:
                parts_cat.append(cats if cats is not None else np.zeros(len(ids), np.uint16))
        return Encoded(
            source=source,
            tokens=np.concatenate(parts_tok) if parts_tok else np.zeros(0, np.int64),
            lengths=np.array(parts_len, np.int64),
            loss_mask=np.concatenate(parts_mask) if need_mask and parts_mask else None,
            cat_codes=np.concatenate(parts_cat) if need_cat and parts_cat else None,
            cat_keys=keys,
        )

    def _appends_eod(self, kind: str) -> bool:
        eod = self.options.append_eod
        return self.options.eod_id is not None and (eod or (eod is None and kind == TEXT))


def _needs_categories(docs: list, rendered: Rendered | None) -> bool:
    """Whether the batch needs a category stream: a document or a span with a category of its own."""
    return (any(cat is not None for _, _, cat in docs)
            or any(kind == TOKENS and p["category_ids"] is not None for kind, p, _ in docs)
            or any(kind == CHAT and not isinstance(p, int) and any(c is not None for *_, c in p[1])
                   for kind, p, _ in docs)  # a message's own category
            or (rendered is not None and rendered.has_span_categories))


def _token_document(payload: dict, cat, code: CategoryCodes) -> tuple:
    """A pre-tokenized record's (ids, loss mask or None, category codes): its own numeric categories coded (kept
    verbatim as keys), else the record's category for every token."""
    ids = payload["input_ids"]
    if payload["category_ids"] is not None:
        values, inverse = np.unique(payload["category_ids"], return_inverse=True)
        cats = np.array([code(int(v)) for v in values], np.uint16)[inverse]
    else:
        cats = np.full(len(ids), code(cat), np.uint16)
    return ids, payload["loss_mask"], cats
