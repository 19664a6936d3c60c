"""Records → documents: each item of a batch parsed as text, a conversation (rendered, with its assistant spans) or
pre-tokenized ids, with its category; or set aside as a reject, with the reason and the class of problem.

A conversation a batch's column-wise rendering already took (``xprep.prep.chat.columns``) is only its index in
that rendering here (``RecordParser.for_rendered``); every other record is parsed one by one (``parse``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np
from xprep.prep.chat import (
    BUILTIN_TEMPLATES,
    SHAPE_COUNTS,
    ChatTemplate,
    Rendered,
    TemplateError,
    json_type,
    normalize_messages,
)
from xprep.prep.chat import columns as chat_columns
from xprep.prep.formats import AUTO, CHAT, PREDICTION, TEXT, TOKENS
from xprep.prep.sources import LINES, TEXT_FILE, RawBatch
from xprep.prep.tokenize.config import Options


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


class RecordParser:
    """Parses items of batches into documents: (record format, payload, category) each, or a BadRecord.

    A chat payload is (text, [(start, end, span category)]) or, for a batch rendered column-wise, the index of
    the conversation among those it kept. ``shape`` counts the conversations parsed since it was last set, by
    shape (``xprep.prep.dataset.token_dataset.CONVERSATION_COUNTS``).
    """

    def __init__(self, options: Options, template: ChatTemplate | None):
        self.options, self.template = options, template
        self.shape = np.zeros(SHAPE_COUNTS, np.int64)

    def batch(self, batch: RawBatch, rendered: Rendered | None) -> tuple[list, list[Rejected]]:
        """The documents of ``batch`` and its rejects, in order; ``rendered``: what its column-wise rendering
        made of it (None: none), whose conversation counts ``shape`` starts from."""
        parse = self.parse if rendered is None else self.for_rendered(rendered)
        self.shape = rendered.shape.copy() if rendered is not None else np.zeros(SHAPE_COUNTS, np.int64)
        docs, rejects = [], []
        for item, line in zip(batch.items, batch.lines, strict=True):
            try:
                docs.append(parse(item, batch.holds))
            except (BadRecord, TemplateError) as e:
                rejects.append(Rejected(line, e.kind, str(e), _snippet(item), fatal=not isinstance(e, Unusable)))
        return docs, rejects

    def parse(self, item, kind: str):
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
                                f"--chat-template {'|'.join(BUILTIN_TEMPLATES)}|FILE", "no chat template")
            for m in messages:
                _check_text(m["content"])
                if "category" in m:
                    m["category"] = _category_name(m["category"], "message category")
            if self.options.train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
                raise Unusable(NO_ANSWER, "no assistant message")
            text, spans = self.template.render_with_spans(messages)  # a template error rejects this record
            _check_text(text)  # what a template renders besides the contents (tool calls, reasoning, names) too
            self.shape += chat_columns.conversation_shape(messages)
            return CHAT, (text, [(a, b, messages[i].get("category")) for a, b, i in spans]), category
        return TOKENS, self._tokens(record), category

    def for_rendered(self, rendered: Rendered):
        """``parse`` for a batch ``chat_columns`` rendered: the index of each record it kept among them (see
        ``chats.ChatEncoder``), the per-record way for the others."""
        status, kept, categories = iter(rendered.status.tolist()), itertools.count(), rendered.categories

        def parse(item, kind: str):
            done = next(status)
            if done == chat_columns.KEPT:
                k = next(kept)
                return CHAT, k, categories[k] or self.options.category
            if done == chat_columns.NO_ANSWER:
                raise Unusable(NO_ANSWER, "no assistant message")
            return self.parse(item, kind)

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
        if self.options.mask_convention == PREDICTION:
            mask, cats = prediction_to_target(mask, cats)
        return {"input_ids": ids, "loss_mask": mask, "category_ids": cats}


def prediction_to_target(mask: np.ndarray | None, cats: np.ndarray | None) -> tuple:
    """A pre-tokenized record's ``loss_mask`` and ``category_ids`` (None: absent) in VERL's prediction convention,
    moved to this project's target convention (``--mask-convention prediction``).

    VERL's fsdp_sft_trainer up to 0.5 takes ``labels = input_ids[:, 1:]`` against the logits of positions ``:-1``
    and weighs that cross entropy with ``loss_mask[:, :-1]``: ``loss_mask[t] = 1`` trains the prediction made at
    position t, of token t + 1, and ``loss_mask[T-1]`` (the last position, which predicts nothing) is never read.
    Here ``loss_mask[t] = 1`` means token t is a target (predicted at t - 1), so the rule is ``ours[t + 1] =
    verl[t]`` for t < T - 1 and ``ours[0] = 0``: for ``input_ids [100..104]`` and ``loss_mask [0,0,1,1,1]`` VERL
    trains 103 and 104, and so does this once the mask is read as ``[0,0,0,1,1]``. ``category_ids`` move with the
    mask, so a target keeps the category VERL gave its prediction; the first token (never a target) keeps its own.
    An absent mask stays absent: every token but the first is a target, as an all-ones mask trains in VERL.
    (From 0.6 on VERL's fsdp_sft_trainer reads ``loss_mask[:, 1:]`` and its model-engine SFT loss weighs position t
    with ``torch.roll(loss_mask, -1)[t] = loss_mask[t + 1]``: the target convention, read as it is.)
    """
    return (None if mask is None else _moved_on(mask, 0),
            None if cats is None else _moved_on(cats, cats[0]))


def _moved_on(values: np.ndarray, first: int) -> np.ndarray:
    """``values`` one place later, ``first`` at position 0, the last value dropped (same length)."""
    moved = np.empty_like(values)
    moved[0] = first
    moved[1:] = values[:-1]
    return moved



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

