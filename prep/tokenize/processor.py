"""``xprep tokenize``: records → token datasets, in parallel and in input order.

The main process reads raw record batches and writes results in order; ``Processor`` (inline
for one worker, one per process otherwise) parses, validates, renders chat templates and
encodes a whole batch at once. Output bytes do not depend on the worker count.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from xprep.prep.chat import (
    END_OF_TURN,
    RENDER_ENV,
    ChatTemplate,
    TemplateError,
    TemplateSpec,
    abort_renders,
    adopt_verdicts,
    json_type,
    normalize_messages,
    parse_role_map,
    render_watchdog_running,
    resolve_template,
    verdicts,
)
from xprep.prep.chat import columns as chat_columns
from xprep.prep.dataset import KEPT_TOKENIZER, CategoryTable, DatasetWriter, count, token_dtype
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.formats import AUTO, CHAT, RECORD_FORMATS, REJECTS, TEXT, TOKENS
from xprep.prep.lifeline import die_with_parent
from xprep.prep.progress import Progress
from xprep.prep.sources import (
    LINES,
    ROWS,
    TEXT_FILE,
    Listing,
    RawBatch,
    Unreadable,
    plan_shard,
    read_batches,
    resolve_inputs,
)
from xprep.prep.tokenizer import (
    DOCUMENT_END,
    Encoder,
    TokenizerInfo,
    add_around,
    choose_backend,
    csr_offsets,
    load_tokenizer_info,
    marker_pieces,
)

WORKER_START_ENV = "XPREP_WORKER_START"  # "spawn": worker processes start fresh instead of forked (_start_pool)
CHAT_POOL_MIN_BYTES = 16 << 20  # below this much chat input, starting more workers costs more than they save


@dataclass
class TokenizeConfig:
    """Everything ``xprep tokenize`` takes; one field per CLI option."""

    inputs: list[str]
    output: str
    tokenizer: str
    format: str = AUTO
    text_field: str = "text"
    chat_template: str = "auto"
    train_on: str = "assistant"
    category: str | None = None
    category_field: str | None = None
    append_eod: bool | None = None
    workers: int = 0
    backend: str = "auto"
    dtype: str = "auto"
    num_shards: int = 1
    shard_index: int = 0
    on_error: str = "fail"
    limit: int | None = None
    eod_token: str | None = None
    bos_token: str | None = None
    role_map: str | None = None
    allow_empty: bool = False
    progress_every: float = 30.0  # seconds between progress lines when stderr is not a terminal; 0 = none
    ray: str | None = None  # --ray: "auto" or HOST:PORT of a Ray cluster to run the shards on (tokenize/ray/cluster.py)
    shard_size: int = 256 * 10**6  # --shard-size: bytes of input per Ray task
    max_retries: int = 3  # --max-retries: of a Ray task lost with its worker or node
    cache_dir: str | None = None  # --cache-dir: converted tokenizers and tokenizer facts (None: prep.fs.cache_root's)

    def __post_init__(self) -> None:
        if self.format not in RECORD_FORMATS:
            raise XprepError(f"--format {self.format}: expected one of {', '.join(RECORD_FORMATS)}")
        if self.num_shards < 1:
            raise XprepError(f"--num-shards {self.num_shards}: must be ≥ 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise XprepError(
                f"--shard-index {self.shard_index}: must be in [0, {self.num_shards - 1}] for "
                f"--num-shards {self.num_shards}"
            )
        if self.workers < 0:
            raise XprepError(f"--workers {self.workers}: must be ≥ 0 (0 = auto)")
        if self.limit is not None and self.limit < 1:
            raise XprepError(f"--limit {self.limit}: must be ≥ 1")
        if self.progress_every < 0:
            raise XprepError(f"--progress-every {self.progress_every}: must be ≥ 0 seconds (0 = no progress lines)")
        if self.ray is not None:
            if self.num_shards > 1:
                raise XprepError("--ray plans its own shards: leave out --num-shards/--shard-index (they are the "
                                 "route without a cluster, e.g. Slurm arrays + xprep merge)")
            if self.limit is not None:
                raise XprepError("--limit reads the first N records in order, which a cluster does not: try the "
                                 "command without --ray")
            if self.max_retries < 0:
                raise XprepError(f"--max-retries {self.max_retries}: must be ≥ 0")


@dataclass(frozen=True)
class Options:
    """What a Processor needs besides the tokenizer: content-defining options only."""

    format: str
    text_field: str
    train_on: str
    category: str | None
    category_field: str | None
    append_eod: bool | None  # None: plain text documents only
    eod_id: int | None
    vocab_size: int
    role_map: dict[str, str] = field(default_factory=dict)  # --role-map, on top of templates.ROLES

    def describe(self) -> dict:
        described = {"format": self.format, "text_field": self.text_field, "train_on": self.train_on,
                     "category": self.category, "category_field": self.category_field,
                     "append_eod": self.append_eod}
        if self.role_map:  # only when given: datasets made without it keep their fingerprints
            described["role_map"] = dict(sorted(self.role_map.items()))
        return described


@dataclass(frozen=True)
class Rejected:
    """A record set aside (or, if ``fatal`` under ``--on-error fail``, the end of the run), with why.

    ``kind`` is the class of problem rejects are counted by; ``fatal`` is False for a well-formed
    record with nothing to train on, which is always set aside.
    """

    line: int
    kind: str
    reason: str
    record: str | None
    fatal: bool


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
    conversations: np.ndarray = field(default_factory=lambda: np.zeros(chat_columns.SHAPE_COUNTS, np.int64))


class BadRecord(ValueError):
    """A record that is malformed: fatal under --on-error fail, set aside under skip.

    ``kind`` is the class of problem that rejects are counted by; the message says the details.
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


NO_ANSWER = "no assistant message: nothing to train on (use --train-on all to keep it)"


class Unusable(BadRecord):
    """A well-formed record with nothing to train on: always set aside in rejects.jsonl, counted."""


class Processor:
    """Parses, validates and encodes RawBatches. Pure: same batch in, same arrays out."""

    def __init__(self, info: TokenizerInfo, backend: str, template: TemplateSpec | None, options: Options):
        self.encoder = Encoder(info, backend)
        self.template = ChatTemplate(template) if template is not None else None
        self.options = options
        plain = options.format in (AUTO, CHAT) and os.environ.get(RENDER_ENV, "").lower() != "records"
        self._columns_for = ((self.template, options.train_on == "all", options.category_field, options.role_map)
                             if plain and self.template else None)
        self._columns = None
        self._shape = np.zeros(chat_columns.SHAPE_COUNTS, np.int64)  # the batch's conversations by shape (__call__)
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
        docs: list[tuple[str, object, str | int | None]] = []  # (kind, payload, category)
        rejects = []
        chat = batch.holds == LINES and batch.items and chat_columns.chat_field(batch.items[0]) is not None
        rendered = self.columns.render(batch.items) if chat and self.columns is not None else None
        parse = self._parse if rendered is None else self._rendered_parser(rendered)
        # the conversations' shape: those rendered column-wise counted so, the others by _parse, one by one
        self._shape = rendered.shape.copy() if rendered is not None else np.zeros(chat_columns.SHAPE_COUNTS, np.int64)
        for item, line in zip(batch.items, batch.lines, strict=True):
            try:
                docs.append(parse(item, batch.holds))
            except (BadRecord, TemplateError) as e:
                rejects.append(Rejected(line, e.kind, str(e), _snippet(item), fatal=not isinstance(e, Unusable)))
        out = self._encode(batch.source, docs, rendered)
        out.tokens = out.tokens.astype(self._token_dtype, copy=False)
        out.rejects = rejects
        out.bytes_in = sum(len(i) for i in batch.items) if batch.holds != ROWS else 0
        out.conversations = self._shape
        return out

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self, item, kind: str):
        """(record format, payload, category) of one item of a batch of ``kind``; BadRecord if it is unusable."""
        if kind == TEXT_FILE:
            return TEXT, _decode_text(item), self.options.category
        if kind == LINES:
            record = _json_record(item)
        else:
            record = item
        if not isinstance(record, dict):
            raise BadRecord(f"record is a JSON {type(record).__name__}, expected an object", "not an object")
        category = self._category(record)
        fmt = self.options.format if self.options.format != AUTO else _detect(record, self.options.text_field)
        if fmt == TEXT:
            value = record.get(self.options.text_field)
            if value is None:
                raise BadRecord(f"missing field {self.options.text_field!r} (set --text-field)", "missing field")
            if not isinstance(value, str):
                raise BadRecord(f"field {self.options.text_field!r} is {json_type(value)}, expected a string",
                                "bad type")
            if not value.strip():
                raise BadRecord("empty text", "empty text")
            _check_text(value)
            return TEXT, value, category
        if fmt == CHAT:
            messages = normalize_messages(record, self.options.role_map)
            if self.template is None:
                raise BadRecord("a chat record, but the tokenizer has no chat_template: pass "
                                "--chat-template chatml|llama3|FILE", "no chat template")
            for m in messages:
                _check_text(m["content"])
                if "category" in m:
                    m["category"] = _category_name(m["category"], "message category")
            if self.options.train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
                raise Unusable(NO_ANSWER, "no assistant message")
            text, spans = self.template.render_with_spans(messages)  # a template error rejects this record
            _check_text(text)  # what a template renders besides the contents (tool calls, reasoning, names) too
            self._shape += chat_columns.conversation_shape(messages)
            return CHAT, (text, [(a, b, messages[i].get("category")) for a, b, i in spans]), category
        return TOKENS, self._tokens(record), category

    def _rendered_parser(self, rendered: chat_columns.Rendered):
        """``_parse`` for a batch ``chat_columns`` rendered: the index of each record it kept among them (see
        ``_encode_chats``), the per-record way for the others."""
        status, kept, categories = iter(rendered.status.tolist()), itertools.count(), rendered.categories

        def parse(item, kind: str):
            done = next(status)
            if done == chat_columns.KEPT:
                k = next(kept)
                return CHAT, k, categories[k] or self.options.category
            if done == chat_columns.NO_ANSWER:
                raise Unusable(NO_ANSWER, "no assistant message")
            return self._parse(item, kind)

        return parse

    def _category(self, record: dict) -> str | None:
        field_name = self.options.category_field
        value = record.get(field_name) if field_name else record.get("category")
        if value is None:
            return self.options.category
        return _category_name(value, "category")

    def _tokens(self, record: dict) -> dict:
        ids = _int_list(record, "input_ids")
        if ids is None:
            raise BadRecord("missing field 'input_ids'", "missing field")
        n = len(ids)
        if n == 0:
            raise BadRecord("empty input_ids", "empty input_ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.options.vocab_size:
            raise BadRecord(f"input_ids outside [0, {self.options.vocab_size}) of the tokenizer vocabulary",
                            "ids outside the vocabulary")
        mask = _int_list(record, "loss_mask")
        cats = _int_list(record, "category_ids")
        for name, arr, hi in (("loss_mask", mask, 1), ("category_ids", cats, 65535)):
            if arr is not None and (len(arr) != n or (n and (arr.min() < 0 or arr.max() > hi))):
                raise BadRecord(f"{name} must hold {n} integers in [0, {hi}]", f"bad {name}")
        if "length" in record and record["length"] != n:
            raise BadRecord(f"length {record['length']!r} != len(input_ids) {n}", "bad length")
        return {"input_ids": ids, "loss_mask": mask, "category_ids": cats}

    # -- encoding ------------------------------------------------------------------------------
    def _encode(self, source: int, docs: list, rendered: chat_columns.Rendered | None = None) -> Encoded:
        keys: list = [None]
        code_of: dict = {None: 0}

        def code(key) -> int:
            if key not in code_of:
                code_of[key] = len(keys)
                keys.append(key)
            return code_of[key]

        parts_tok, parts_len, parts_mask, parts_cat = [], [], [], []
        need_mask = any(kind != TEXT for kind, _, _ in docs)
        need_cat = (any(cat is not None for _, _, cat in docs)
                    or any(kind == TOKENS and p["category_ids"] is not None for kind, p, _ in docs)
                    or any(kind == CHAT and not isinstance(p, int) and any(c is not None for *_, c in p[1])
                           for kind, p, _ in docs)  # a message's own category
                    or (rendered is not None and rendered.has_span_categories))
        # Text documents of the batch are encoded in one call; chat ones through their segments.
        order = []
        texts = [p for kind, p, _ in docs if kind == TEXT]
        if texts:
            flat, lengths = self.encoder.encode(texts, add_special_tokens=True)
            if len(texts) == len(docs):  # the common case, fully vectorized
                return self._text_batch(source, flat, lengths, [cat for _, _, cat in docs], need_cat, code, keys)
            offsets = csr_offsets(lengths)
        chats = [(p, cat) for kind, p, cat in docs if kind == CHAT]
        chat_out = self._encode_chats(chats, code, rendered) if chats else []
        ti = ci = 0
        for kind, payload, cat in docs:
            if kind == TEXT:
                ids = flat[offsets[ti] : offsets[ti + 1]]
                ti += 1
                mask = None
                cats = np.full(len(ids), code(cat), np.uint16) if need_cat else None
            elif kind == CHAT:
                ids, mask, cats = chat_out[ci]
                ci += 1
            else:
                ids = payload["input_ids"]
                mask = payload["loss_mask"]
                if payload["category_ids"] is not None:
                    values, inverse = np.unique(payload["category_ids"], return_inverse=True)
                    cats = np.array([code(int(v)) for v in values], np.uint16)[inverse]
                else:
                    cats = np.full(len(ids), code(cat), np.uint16)
            order.append((ids, mask, cats))
        for (kind, _, _), (ids, mask, cats) in zip(docs, order, strict=True):
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

    def _text_batch(self, source, flat, lengths, cats, need_cat, code, keys) -> Encoded:
        if self._appends_eod(TEXT):
            flat, lengths = add_around(flat, lengths, np.zeros(0, np.int64),
                                       np.array([self.options.eod_id], np.int64))
        codes = np.repeat(np.array([code(c) for c in cats], np.uint16), lengths) if need_cat else None
        return Encoded(source, flat, lengths, None, codes, keys)

    def _appends_eod(self, kind: str) -> bool:
        eod = self.options.append_eod
        return self.options.eod_id is not None and (eod or (eod is None and kind == TEXT))

    def _encode_chats(self, chats: list, code, rendered: chat_columns.Rendered | None = None
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Encode every rendered conversation as its span-separated segments, in one encoder call for the whole
        batch, and mark the assistant spans as targets.

        A chat is (text, spans) or, for a batch ``chat_columns`` rendered, the index of one of its kept
        conversations, whose segments it cuts for all of them at once. Where every cut of a conversation is
        proven clean for this tokenizer (``Encoder.cuts``: right after an added token such as the end-of-turn
        marker, or after "\n" before a character that is not whitespace) its segment ids are its ids. Elsewhere
        its whole text is encoded too: where the segment ids still concatenate to its ids, the segment lengths
        give the mask, else each token's first character (``Encoder.char_starts``) places it inside or outside
        the spans. Under ``--train-on all`` with one category for everything, no segment is needed at all.
        """
        texts, seg_texts, seg_target, seg_cat, seg_count, clean = [], [], [], [], [], []
        convs = []  # (position in chats, spans or None for a column-wise one, category) in encoding order
        cuts = self.encoder.cuts
        for j, (payload, cat) in enumerate(chats):
            if isinstance(payload, int):  # a column-wise one: its codes now, in the order the per-record way gives
                code(cat)
                if rendered is not None and rendered.has_span_categories:
                    for span_cat in rendered.span_categories_of(payload):
                        code(span_cat or cat)
                continue
            text, spans = payload
            texts.append(text)
            convs.append((j, spans, cat))
            pos, first = 0, len(seg_texts)
            for start, end, span_cat in spans:
                if start > pos:
                    seg_texts.append(text[pos:start])
                    seg_target.append(False)
                    seg_cat.append(code(cat))
                seg_texts.append(text[start:end])
                seg_target.append(True)
                seg_cat.append(code(span_cat or cat))
                pos = end
            if pos < len(text):
                seg_texts.append(text[pos:])
                seg_target.append(False)
                seg_cat.append(code(cat))
            seg_count.append(len(seg_texts) - first)
            clean.append(cuts.spans_clean(text, spans))
        seg_target, seg_cat = np.array(seg_target, bool), np.array(seg_cat, np.uint16)
        seg_count, clean = np.array(seg_count, np.int64), np.array(clean, bool)
        span_codes = seg_cat[seg_target]  # a gap's code is its conversation's
        columnar = [j for j, (payload, _) in enumerate(chats) if isinstance(payload, int)]
        per_record = len(texts)  # conversations after these are the column-wise ones (their text is in rendered)
        if columnar:  # all of the batch's kept conversations, in order
            assert rendered is not None and len(columnar) == rendered.kept
            convs += [(j, None, chats[j][1]) for j in columnar]
            conv_code = np.array([code(chats[j][1]) for j in columnar], np.uint16)
            span_code = np.repeat(conv_code, rendered.answers)  # a span without a category of its own: its record's
            if rendered.has_span_categories:
                own = [(i, c) for i, c in enumerate(rendered.span_categories) if c is not None]
                span_code[[i for i, _ in own]] = [code(c) for _, c in own]
            span_codes = np.concatenate([span_codes, span_code])
        if not self._needs_segments(span_codes, convs, code):
            return self._encode_whole(texts, rendered if columnar else None, convs, len(chats), code(convs[0][2]))
        done: dict = {}  # column-wise conversations encoded whole, masked by where their tokens start
        if columnar and not (cuts.after_newline or cuts.after_tokens):
            by_starts = self._columns_by_starts(rendered, conv_code, span_code, [chats[j][1] for j in columnar], code)
            if by_starts is not None:  # the per-record conversations go on below
                done = dict(zip(columnar, by_starts, strict=True))
                columnar, convs, rendered = [], convs[:per_record], None
                if not convs:
                    return self._first_not_a_target([done[j] for j in range(len(chats))])

        def text_of(k: int) -> str:
            return texts[k] if k < per_record else rendered.text_of(k - per_record)

        if columnar:
            seg_offsets, target, counts, span = rendered.segments()
            seg_target = np.concatenate([seg_target, target])
            column_cat = np.repeat(conv_code, counts)
            column_cat[span >= 0] = span_code[span[span >= 0]]
            seg_cat = np.concatenate([seg_cat, column_cat])
            seg_count = np.concatenate([seg_count, counts])
            clean = np.concatenate([clean, rendered.clean(cuts)])
        whole = np.flatnonzero(~clean)  # the conversations encoded whole as well
        ahead = [text_of(k) for k in whole] + seg_texts
        if columnar:  # the column-wise segments' bytes as they lie in the rendered batch
            flat, lengths = self.encoder.encode_utf8(ahead, rendered.data, seg_offsets)
        else:
            flat, lengths = self.encoder.encode(ahead, add_special_tokens=False)
        whole_off = csr_offsets(lengths[: len(whole)])
        split = int(whole_off[-1])
        whole_flat, seg_flat, seg_len = flat[:split], flat[split:], lengths[len(whole):]
        conv_seg = csr_offsets(seg_len)[csr_offsets(seg_count)]  # each conversation's first segment id in seg_flat
        target = np.repeat(seg_target, seg_len)
        cats = np.repeat(seg_cat, seg_len)
        mask = np.ones(len(target), np.uint8) if self.options.train_on == "all" else target.view(np.uint8).copy()
        out: list = [None] * len(chats)
        for k, (j, _, _) in enumerate(convs):
            sa, sb = conv_seg[k], conv_seg[k + 1]
            out[j] = (seg_flat[sa:sb], mask[sa:sb], cats[sa:sb])
        for w, k in enumerate(whole.tolist()):
            j, spans, cat = convs[k]
            ids = whole_flat[whole_off[w] : whole_off[w + 1]]
            sa, sb = conv_seg[k], conv_seg[k + 1]
            if not (sb - sa == len(ids) and np.array_equal(seg_flat[sa:sb], ids)):
                spans = spans if spans is not None else rendered.spans_with_categories(k - per_record)
                out[j] = self._doc_by_offsets(text_of(k), ids, spans, cat, code)
        for j, item in done.items():
            out[j] = item
        return self._first_not_a_target(out)

    @staticmethod
    def _first_not_a_target(out: list) -> list:
        """A document's first token is never a target (nothing comes before it to predict it from)."""
        for _, doc_mask, _ in out:
            doc_mask[:1] = 0
        return out

    def _columns_by_starts(self, rendered: chat_columns.Rendered, conv_code: np.ndarray, span_code: np.ndarray,
                           cats: list, code) -> list | None:
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

    def _needs_segments(self, span_codes: np.ndarray, convs: list, code) -> bool:
        """Whether the spans matter: for the mask (not ``--train-on all``) or for a category of their own."""
        one = code(convs[0][2])
        return (self.options.train_on != "all" or not np.all(span_codes == one)
                or any(code(c) != one for *_, c in convs))

    def _encode_whole(self, texts: list[str], rendered: chat_columns.Rendered | None, convs: list, n: int,
                      cat: int) -> list:
        """``_encode_chats`` where every token is a target of one category: the whole texts only (``texts``, then
        those of ``rendered``)."""
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

    def _doc_by_offsets(self, text, ids, spans, cat, code) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A conversation's (ids, loss mask, categories), its mask from where each token starts
        (``_mask_from_offsets``): what a conversation whose segments do not make its ids gets."""
        target, cats = self._mask_from_offsets(text, ids, spans, cat, code)
        return ids, self._loss_mask(target), cats

    def _loss_mask(self, target: np.ndarray) -> np.ndarray:
        """The loss mask of tokens ``target`` marks as in an assistant span: those, or all under --train-on all."""
        return np.ones(len(target), np.uint8) if self.options.train_on == "all" else target.astype(np.uint8)

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


def _in_spans(starts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whether each of ``starts`` lies inside a span ``[lo, hi)`` (in order, none overlapping), and the span it would
    lie in: the last that begins at or before it (0 where none does), found by bisection."""
    if not len(lo):
        return np.zeros(len(starts), bool), np.zeros(len(starts), np.int64)
    k = np.maximum(np.searchsorted(lo, starts, side="right") - 1, 0)
    return (starts >= lo[k]) & (starts < hi[k]), k


def _detect(record: dict, text_field: str) -> str:
    """Record kind by its fields; null fields count as absent (table rows carry every column)."""
    if record.get("messages") is not None or record.get("conversations") is not None:
        return CHAT
    if record.get("input_ids") is not None:
        return TOKENS
    if record.get(text_field) is not None:
        return TEXT
    nulls = [k for k in (text_field, "messages", "conversations", "input_ids") if k in record]
    if nulls:
        raise BadRecord(f"field {nulls[0]!r} is null (and no 'text', 'messages', 'conversations' or 'input_ids' "
                        "field has a value)", "null field")
    raise BadRecord(f"no {text_field!r}, 'messages', 'conversations' or 'input_ids' field "
                    "(set --text-field or --format)", "missing field")


def _int_list(record: dict, key: str) -> np.ndarray | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRecord(f"field {key!r} must be a list of integers, got {json_type(value)}", "bad type")
    try:
        arr = np.asarray(value) if value else np.zeros(0, np.int64)
    except (OverflowError, ValueError):
        raise BadRecord(f"field {key!r} must be a list of integers (within int64)", "bad type") from None
    # bools, floats, nested lists, strings and ints beyond int64 (object arrays) all fail here
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.dtype == np.uint64:
        raise BadRecord(f"field {key!r} must be a list of integers (within int64)", "bad type")
    return arr.astype(np.int64, copy=False)


def _category_name(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRecord(f"{what} {value!r} must be a non-empty string", "bad category")
    return value


def _check_text(text: str) -> None:
    """Reject strings no tokenizer can encode (lone UTF-16 surrogates from JSON escapes)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord(f"text holds a lone surrogate {text[e.start]!r} at character {e.start}",
                            "lone surrogate") from None


def _decode_text(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"invalid UTF-8 at byte {e.start}", "invalid UTF-8") from None
    if not text.strip():
        raise BadRecord("empty text", "empty text")
    return text


def _json_record(line: bytes):
    """One JSON line → its value; a line cut off before the value ends is told apart from other errors."""
    try:
        return json.loads(line)
    except UnicodeDecodeError as e:
        raise BadRecord(f"invalid UTF-8 at byte {e.start}", "invalid UTF-8") from None
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or e.pos >= len(line.rstrip()):
            raise BadRecord(f"truncated JSON: the line ends at column {len(line.rstrip()) + 1} before the record "
                            "is complete (cut off?)", "truncated JSON") from None
        raise BadRecord(f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}", "malformed JSON") from None
    except RecursionError:
        raise BadRecord("malformed JSON: nested too deeply", "malformed JSON") from None


def _snippet(item) -> str:
    if isinstance(item, bytes):
        return item[:300].decode("utf-8", "replace")
    return json.dumps(item, ensure_ascii=False, default=str)[:300]


# -- worker processes ----------------------------------------------------------------------------
_PROCESSOR: Processor | None = None
_START_ERROR: XprepError | None = None


def _start_pool(processor_args: tuple, workers: int) -> ProcessPoolExecutor:
    """``workers`` processes, each with a Processor: forked from this process once it has built one, where that is
    safe; else spawned, each building its own.

    A forked worker starts with the tokenizer loaded, the template checked and the modules imported, where a
    spawned one pays ~0.9 CPU-s for them (50 MB of chat on 2 cores: 3.5–3.9 CPU-s in all spawned, 2.6–2.8
    forked; 2.27–2.51 s and 2.09–2.33 s). Forking is safe where no other thread of this process can hold a
    lock: on Linux (fork is unsafe on macOS, absent on Windows), with this thread the only Python thread, so
    before the writer's thread starts. The native pools alive by then are idle and prepared for fork: OpenBLAS
    (numpy), and pyarrow's thread pool and jemalloc (pyarrow re-creates its pools in a child). A forked worker
    leaves without Python's teardown (multiprocessing ends it with ``os._exit``), so the file buffers it
    inherited are never flushed twice. ``XPREP_WORKER_START=spawn`` forces spawning.

    Either way the workers are started now, with SIGINT ignored, which they keep: Ctrl-C (SIGINT to the whole
    process group) reaches this process alone, which unwinds and stops them after their batch in hand, instead
    of each worker printing a KeyboardInterrupt traceback (as spawned ones did while still importing). Each
    worker ends with this process however it ends, SIGKILL included (``xprep.prep.lifeline``).
    """
    global _PROCESSOR
    lifeline = (os.getpid(), threading.current_thread() is threading.main_thread())  # (die_with_parent's)
    if not _can_fork():
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(processor_args, verdicts(), lifeline))
        with _sigint_ignored():  # while none is idle, each task starts a worker
            return _started(pool, lambda: [pool.submit(int) for _ in range(workers)])
    _PROCESSOR = _build(processor_args)
    _PROCESSOR.warm()
    # every object alive now out of the collector's sight (gc.freeze, as its docs advise before a fork): no worker's
    # collection writes to the pages it shares with this process, and none here or there traverses them again
    # (they stay frozen here too: reference counting still frees them, only a cycle among them would wait). Garbage
    # is collected first (~0.01 s): a dead cycle frozen with them would never be freed.
    gc.collect()
    gc.freeze()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_forked,
                               initargs=(lifeline,))
    with _sigint_ignored(), warnings.catch_warnings():  # Python ≥ 3.12 warns of any fork beside a native pool
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        started = pool.submit(int)  # forks every worker now (a pool using fork starts them all at its first task)
    return _started(pool, started.result)


def _started(pool: ProcessPoolExecutor, start) -> ProcessPoolExecutor:
    """``pool`` once ``start()`` (its first tasks) is done. A worker that dies meanwhile (killed as it appeared)
    ends the command as a death at any later task does: the one-line error, with the pool shut down here rather
    than left to the interpreter's exit."""
    global _PROCESSOR
    try:
        start()
    except BrokenProcessPool:
        pool.shutdown(wait=True, cancel_futures=True)
        _PROCESSOR = None
        raise _worker_died() from None
    return pool


@contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process meanwhile (where it can be: signals are set from the main thread only), so
    that processes started now inherit it ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _can_fork() -> bool:
    return (sys.platform == "linux" and threading.active_count() == 1 + render_watchdog_running()
            and os.environ.get(WORKER_START_ENV, "fork") != "spawn")


def _forked(lifeline: tuple[int, bool]) -> None:
    die_with_parent(*lifeline)
    # SIGTERM ends a worker at once, as a spawned one (the command's handler, inherited, would unwind it instead)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _build(args: tuple) -> Processor:
    try:
        return Processor(*args)
    except XprepError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a tokenizer or template library raises
        raise XprepError(f"a tokenize worker could not start: {type(e).__name__}: {e}") from None


def _init_worker(args, checked: dict, lifeline: tuple[int, bool]) -> None:
    """Build this worker's Processor (with the main process's template verdicts: no self-check, and no Jinja
    compiled until a conversation needs it); a failure is kept and raised by the first task instead.

    An initializer that raises would leave a pool respawning dying workers (multiprocessing.Pool
    does so forever); kept here, the error reaches the main process as the result of a task.
    """
    global _PROCESSOR, _START_ERROR
    die_with_parent(*lifeline)
    # A worker exits once the pool is shut down, every result already sent: skip the interpreter's teardown
    # (freeing the tokenizer and every module took ~0.3 s of each run's end on 2 cores).
    atexit.register(os._exit, 0)
    adopt_verdicts(checked)
    try:
        _PROCESSOR = _build(args)
    except XprepError as e:
        _START_ERROR = e


def _work(batch: RawBatch, spill: str) -> Spilled:
    if _START_ERROR is not None:
        raise _START_ERROR
    assert _PROCESSOR is not None
    return Spilled.write(_PROCESSOR(batch), spill)


@dataclass(frozen=True)
class Spilled:
    """A worker's result, left in a file for the main process: what crosses the pipe is this path alone.

    A worker killed while it writes a result into the pipe (the OOM killer, a SIGKILL) leaves a message cut short
    there, and ``concurrent.futures`` reads the rest forever: the command hung, instead of failing. A message this
    small is written whole or not at all (one write, below PIPE_BUF), so the death is seen as a death.
    """

    path: str

    @classmethod
    def write(cls, result: Encoded, directory: str) -> Spilled:
        """``result`` in a new file of ``directory``. A full disk (or the like) is the one-line error, raised in the
        worker and so by the main process's ``future.result()``: the run then ends as any failed run does."""
        data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        with machine_errors(directory, "-o", len(data)):
            fd, path = tempfile.mkstemp(dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return cls(path)

    def load(self) -> Encoded:
        with open(self.path, "rb") as f:
            data = f.read()
        os.remove(self.path)
        return pickle.loads(data)


class Pipeline:
    """Ordered map of a Processor over batches: in one thread beside this one, or over N processes, with
    bounded lookahead.

    One worker runs the Processor in a thread, so that this thread reads, splits, writes and hashes the
    neighbouring batches while the encoder (native code, the GIL released) runs: text tokenizing overlaps
    its Python with its encoding. Worker processes come from ``concurrent.futures``: unlike
    ``multiprocessing.Pool`` it notices a worker that dies (killed, out of memory) and fails every pending
    task instead of waiting forever.
    """

    def __init__(self, processor_args: tuple, workers: int, overlap: bool = True, scratch: str | None = None):
        self.workers = workers
        self.overlap = overlap  # one worker: its own thread (off where every core already runs a task, as on Ray)
        if workers <= 1:
            self.inline = Processor(*processor_args)
            self.pool = None
        else:
            # workers' results (Spilled) go into ``scratch``: the output's temporary directory, removed with it
            # whoever ends the run (a killed one's by the next run), not $TMPDIR, where nothing would remove them
            self.pool = _start_pool(processor_args, workers)
            self.spill = tempfile.mkdtemp(prefix="results-", dir=scratch)

    def map(self, batches):
        if self.pool is not None:
            yield from _ordered(batches, self._submit, 2 * self.workers)
            return
        if not self.overlap:
            for b in batches:
                yield b if isinstance(b, Unreadable) else self.inline(b)
            return
        # a thread per map (not per Pipeline): a Ray worker keeps its Pipeline from task to task
        thread = ThreadPoolExecutor(1, thread_name_prefix="xprep-encode")
        try:
            yield from _ordered(batches, lambda b: thread.submit(self.inline, b), 2)
        except BaseException:
            abort_renders()  # (interrupted, or failed) a template's render must not keep this waiting below
            raise
        finally:
            thread.shutdown(wait=True, cancel_futures=True)

    def _submit(self, batch: RawBatch):
        try:
            return self.pool.submit(_work, batch, self.spill)
        except BrokenProcessPool:  # a worker died before this batch could be queued
            raise _worker_died() from None

    def close(self, ok: bool) -> None:
        global _PROCESSOR
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=not ok)
            _PROCESSOR = None  # the one workers were forked with, if they were
            shutil.rmtree(self.spill, ignore_errors=True)  # results a failed run did not read


def _ordered(batches, submit, lookahead: int):
    """Results of ``submit(batch)`` (a future) in batch order, at most ``lookahead`` submitted ahead; Unreadable
    markers pass through in their place."""
    pending: deque = deque()
    for b in batches:
        pending.append(b if isinstance(b, Unreadable) else submit(b))
        if len(pending) >= lookahead:
            yield _result(pending.popleft())
    while pending:
        yield _result(pending.popleft())


def _result(item) -> Encoded | Unreadable:
    if isinstance(item, Unreadable):
        return item
    try:
        result = item.result()
    except BrokenProcessPool:
        raise _worker_died() from None
    return result.load() if isinstance(result, Spilled) else result


def _worker_died() -> XprepError:
    return XprepError("a tokenize worker process died (killed, or out of memory?); nothing was written: "
                      "run again, with fewer --workers if memory is short")


@dataclass
class Job:
    """What a tokenize run settled before reading a record: inputs, tokenizer, template, options, and the
    head of the manifest they make. Picklable: Ray tasks get it whole."""

    sources: list
    info: TokenizerInfo
    dtype: np.dtype
    template: TemplateSpec | None
    options: Options
    backend: str
    backend_reason: str
    chat: bool  # the data is (or starts as) chat: sizes the worker pool and says which defaults matter
    head: dict  # tokenizer, special_tokens, chat_template, options: the manifest before sources and counts
    notes: tuple[str, ...] = ()  # what the choices above may have got wrong, said after the run (prepare)
    inputs_read: tuple[str, ...] = ()  # what directory inputs held, read and skipped (sources.Listing), said first

    @property
    def processor_args(self) -> tuple:
        return self.info, self.backend, self.template, self.options

    @property
    def kept_tokenizer(self) -> str | None:
        """The tokenizer.json the dataset keeps inside it: one converted from other files (see ``prepare``)."""
        return self.info.path if self.info.source is not None else None


def prepare(config: TokenizeConfig) -> Job:
    """Resolve inputs, tokenizer, template and options: everything but the records."""
    listings: list[Listing] = []
    sources = resolve_inputs(config.inputs, listings)
    info = load_tokenizer_info(config.tokenizer, config.eod_token, config.bos_token, config.cache_dir)
    dtype = _dtype(config.dtype, info.vocab_size)
    plan = plan_shard(sources, config.num_shards, config.shard_index)
    # Content never depends on sniffing records (shards of one run must agree): the EOD follows the chat
    # template only where the command says the data is chat. The sniff only sizes the worker pool.
    chat_declared = config.format == CHAT or (config.format == AUTO and config.chat_template != AUTO)
    chat = chat_declared or (config.format == AUTO and _starts_with_chat(sources, plan))
    template = _template(config, info)
    if template is not None:
        compiled = ChatTemplate(template)  # a broken template fails here, before any worker starts (see _jinja)
        info = _chat_eod(info, compiled) if chat_declared else info
    append_eod = config.append_eod
    if info.eod_id is None and (append_eod or (append_eod is None and config.format in (AUTO, TEXT))):
        raise XprepError(f"{info.origin or info.path}: no end-of-document token found (eos_token); pass "
                         "--eod-token TOKEN or --no-append-eod")
    options = Options(config.format, config.text_field, config.train_on, config.category,
                      config.category_field, append_eod, info.eod_id, info.vocab_size,
                      parse_role_map(config.role_map))
    backend, reason = choose_backend(info, config.backend)
    if template is not None and chat:  # which chat path runs: said on the final line, after the encoder's
        reason = f"{reason}; chat template: {compiled.path}"
    tokenizer = info.describe()
    if info.source is not None:  # converted from other files: kept inside the dataset (dataset_tokenizer)
        tokenizer["path"] = KEPT_TOKENIZER
    head = {
        "tokenizer": tokenizer,
        "special_tokens": info.special_tokens(),
        "chat_template": template.describe() if template is not None else None,
        "options": {**options.describe(), "dtype": dtype.name, "limit": config.limit},
    }
    notes = _marker_notes(info, compiled) if template is not None and chat else []
    if not chat and (append_eod or (append_eod is None and config.format in (AUTO, TEXT))):
        notes += _eod_notes(info, compiled.end_of_turn() if template is not None else None)
    return Job(sources, info, dtype, template, options, backend, reason, chat, head, tuple(notes),
               tuple(line for listing in listings for line in listing.lines()))


def write_all(config: TokenizeConfig, sources, plan, writer: DatasetWriter, pipeline: Pipeline,
               lines_read: list[int] | None = None, progress: Progress | None = None) -> CategoryTable:
    """Feed every batch of the shard through ``pipeline`` and append the results in input order.

    ``lines_read`` gets the lines each assignment read (see ``read_batches``)."""
    categories = CategoryTable()
    if progress is None:
        progress = Progress("tokenize", total_bytes=planned_bytes(sources, plan), interval=config.progress_every)
    ok = False
    try:
        for result in pipeline.map(read_batches(sources, plan, config.limit, lines_read)):
            if isinstance(result, Unreadable):
                if result.cut_short:  # records were lost: not one bad record that --on-error skip could set aside
                    raise CutShort(sources[result.source].path, result, config.on_error)
                rejected = Rejected(result.line, "unreadable file", result.reason, None, fatal=True)
                _reject(writer, config.on_error, sources[result.source].path, rejected)
                continue
            for rejected in result.rejects:
                _reject(writer, config.on_error, sources[result.source].path, rejected)
            lut = _category_lut(categories, result.cat_keys, result.cat_codes)
            cats = lut[result.cat_codes] if result.cat_codes is not None else None
            writer.append(result.tokens, result.lengths, result.loss_mask, cats)
            writer.add_conversations(result.conversations)
            progress.update(len(result.lengths), len(result.tokens), result.bytes_in)
        ok = True
    finally:
        pipeline.close(ok)
        progress.close()
    return categories


def _template(config: TokenizeConfig, info: TokenizerInfo) -> TemplateSpec | None:
    """The chat template to render with, or None where no chat is expected and none is to be had."""
    if config.format not in (AUTO, CHAT):
        return None
    try:
        return resolve_template(config.chat_template, info.chat_template, info.bos_token, info.eos_token)
    except XprepError:
        if config.format == CHAT or config.chat_template != "auto":
            raise
        return None


def _chat_eod(info: TokenizerInfo, template: ChatTemplate) -> TokenizerInfo:
    """A chat dataset whose end-of-document token is only a default ends documents as its template ends turns."""
    if not info.eod_from.startswith("default"):
        return info
    marker = template.end_of_turn()
    if marker is None or info.known_ids.get(marker) is None or marker == info.eos_token:
        return info
    return info.with_eod(marker, f"{info.eod_from[:-1]}; the chat template ends turns with it)")


def _eod_notes(info: TokenizerInfo, turn_end: str | None) -> list[str]:
    """Text documents ending with a chat end-of-turn marker (the template's, ``turn_end``, or a usual one: an Instruct
    tokenizer's eos_token, as Llama 3's ``<|eot_id|>`` or Qwen's ``<|im_end|>``) where a pretraining corpus ends
    documents with the end-of-text token: what to pass instead, where the vocabulary has one. Nothing where
    ``--eod-token`` chose it."""
    turn_ends = {*END_OF_TURN, turn_end} - set(DOCUMENT_END)
    if info.eod_from == "--eod-token" or info.eos_token not in turn_ends:
        return []
    end = next((t for t in DOCUMENT_END if info.known_ids.get(t) is not None), None)
    fix = (f"pass --eod-token '{end}' (id {info.known_ids[end]}), this vocabulary's end-of-text token" if end else
           "pass --eod-token with this vocabulary's end-of-text token")
    return [f"text documents end with {info.eos_token!r} (id {info.eod_id}, from {info.eod_from}), which ends a "
            f"chat turn rather than a document; for pretraining text {fix}"]


def _marker_notes(info: TokenizerInfo, template: ChatTemplate) -> list[str]:
    """A chat template (not the tokenizer's own) whose markers the vocabulary has no token for: each is encoded as
    several text tokens, which the model must learn as text."""
    if template.spec.name == "tokenizer":
        return []
    pieces = marker_pieces(info, template.markers())
    if not pieces:
        return []
    listed = ", ".join(f"{m} ({count(n, 'token')})" for m, n in pieces.items())
    own = " (its own: --chat-template auto)" if info.chat_template else ""
    return [f"the chat template {template.spec.name} writes markers that are no token of this vocabulary, each "
            f"encoded as text: {listed}; use a template made for this tokenizer{own}"]


def auto_workers(chat: bool, planned_bytes: int | None) -> int:
    """``--workers 0``: one process per core (at most 8) for chat, whose template rendering is Python, unless the
    input is too small to pay for starting them; one otherwise (gigatoken already encodes on every core).

    Measured on 2 cores (bench/tokenize.py, chitchat with Qwen3's template), before the fast path and with
    spawned workers: 50 MB took 17.2 s with one worker and 10.4 s with two; 5 MB 2.7 s with one and 4.4 s with two
    (each worker loaded the tokenizer and Jinja). Forked (``_start_pool``), two cost about what one does at 5 and
    12 MB (1.4–1.6 s either way), so the floor stays for where workers are spawned.
    """
    if not chat or (planned_bytes is not None and planned_bytes < CHAT_POOL_MIN_BYTES):
        return 1
    return min(os.cpu_count() or 1, 8)


def _starts_with_chat(sources, plan) -> bool:
    """Whether the shard's first record is a conversation (``--format auto`` sizes its worker pool by it)."""
    try:
        batch = next(iter(read_batches(sources, plan, 1)), None)
        if batch is None or isinstance(batch, Unreadable) or not batch.items:
            return False
        record = batch.items[0] if batch.holds == ROWS else json.loads(batch.items[0])
    except (ValueError, XprepError, OSError):
        return False
    return isinstance(record, dict) and (record.get("messages") is not None or record.get("conversations") is not None)


def check_not_empty(config: TokenizeConfig, writer: DatasetWriter) -> None:
    """A run that yields no document, or nothing to train on, is a mistake unless ``--allow-empty`` says otherwise."""
    if config.allow_empty:
        return
    counts = writer.counts
    where = f"{', '.join(config.inputs)}"
    if config.num_shards > 1:
        where += f" (shard {config.shard_index} of {config.num_shards})"
    if counts.documents == 0:
        kinds = ", ".join(f"{n:,} × {kind}" for kind, n in sorted(writer.reject_reasons.items(), key=lambda kv: -kv[1]))
        rejected = ("" if not writer.reject_count else f"; the one record was rejected ({kinds})"
                    if writer.reject_count == 1 else f"; all {writer.reject_count:,} records were rejected ({kinds})")
        raise XprepError(f"{where}: no document to write{rejected}; nothing was published "
                         "(pass --allow-empty to write an empty dataset anyway)")
    if counts.loss_tokens == 0:
        raise XprepError(f"{where}: {count(counts.documents, 'document')} but not one target token (each document's "
                         "first token is never a target, chat targets only assistant turns); nothing was published "
                         "(check --tokenizer and --train-on, or pass --allow-empty)")


class BadInput(XprepError):
    """A fatal bad record under ``--on-error fail``: where it is and why, kept apart for the Ray driver,
    which renumbers lines of a shard that counted them from its own start."""

    def __init__(self, path: str, line: int, reason: str):
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason} (use --on-error skip to set bad records aside in {REJECTS})")
        self.path, self.line, self.reason = path, line, reason

    def __reduce__(self):
        return BadInput, (self.path, self.line, self.reason)


class CutShort(XprepError):
    """A compressed input that ended early, or broke after records came out of it: the records beyond the point read
    are lost, which no ``--on-error`` mode may pass over as one bad record. Names the file, the error, how many
    records were read and the last of them."""

    def __init__(self, path: str, unreadable: Unreadable, on_error: str):
        reason = unreadable.reason.removeprefix("unreadable file: ")
        read = (f"{count(unreadable.records, 'record')} were read, the last at line {unreadable.last_line:,}"
                if unreadable.records else "no record was read")
        skip = " (--on-error skip sets bad records aside, not a file cut short)" if on_error == "skip" else ""
        super().__init__(f"{path}: the compressed file is cut short or damaged ({reason}): {read}, and what follows "
                         f"was lost; nothing was published{skip}: restore the whole file, or leave it out of the "
                         "inputs")


def _reject(writer: DatasetWriter, on_error: str, path: str, rejected: Rejected) -> None:
    """Fail on a fatal bad record under --on-error fail; otherwise set it aside in rejects.jsonl."""
    if rejected.fatal and on_error == "fail":
        raise BadInput(path, rejected.line, rejected.reason)
    writer.reject(path, rejected.line, rejected.reason, rejected.record, rejected.kind)


def _category_lut(categories: CategoryTable, keys: list, codes: np.ndarray | None) -> np.ndarray:
    """Map a batch's local category codes to dataset ids, registering new names in order of first
    appearance in the token stream (so ids never depend on how a batch was processed)."""
    lut = np.zeros(len(keys), np.uint16)
    if codes is None or not len(codes):
        return lut
    present, first = np.unique(codes, return_index=True)
    in_order = present[np.argsort(first)]
    lut[in_order] = categories.remap([keys[code] for code in in_order.tolist()])
    return lut


def _dtype(choice: str, vocab_size: int) -> np.dtype:
    if choice == "auto":
        return token_dtype(vocab_size)
    if choice == "uint16" and vocab_size > 65536:
        raise XprepError(
            f"--dtype uint16: the tokenizer has {vocab_size:,} tokens, more than uint16 holds (65,536); "
            "use --dtype int32 or auto"
        )
    return np.dtype(choice)


def planned_bytes(sources, plan) -> int | None:
    """Bytes the shard will read, when that is known up front (not for compressed files or tables)."""
    if not all(sources[a.source].sized for a in plan):
        return None
    return sum(a.stop - a.start for a in plan)
