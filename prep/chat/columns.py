"""Chat batches parsed and rendered column-wise, for templates that lay out each message as a head, its content
and a tail (a ``Shape``, which the template's entry in ``prep/chat/registry.py`` gives: ChatML, Qwen3, Llama 3,
Llama 3.1, Gemma, Mistral).

Per record, the fast renderers of ``xprep.prep.chat.fast`` still run a few microseconds of CPython per message:
``json.loads``, ``normalize_messages``, the renderer, the span search. A batch's conversations are ``messages``
of ``role``/``content``, or ShareGPT's ``conversations`` of ``from``/``value`` (as its first line says). For a
batch of JSON lines whose
conversations are plain (roles system/user/assistant/tool as the template allows; string contents; no reasoning
or tool markup) all of that is column work: pyarrow's JSON reader parses the batch, each message becomes
``head + content + tail`` gathered by one numpy index (Llama 3 and Gemma: the content stripped of ASCII
whitespace at both ends; the BOS token before the first head; Llama 3.1: its dated system turn as the first
head; Mistral: a tail of its own after an answer; Qwen3: a run of tool turns as one user turn of
``<tool_response>`` blocks), and each assistant span is arithmetic on the message offsets. The text and spans
equal what ``ChatTemplate.render_with_spans`` gives for the same record, character for character
(tests/prep/chat/test_chat_columns.py compares them on every conversation of the shared chat data and on hostile lines).

Categories are read as columns too: the record's (``category``, or the ``--category-field``) and each
message's ``category``; a span takes its message's, the rest of the conversation the record's (or the
command's ``--category``). Roles are looked up as ``normalize_messages`` does, ``--role-map`` first.

A record is left to the per-record path (``OTHER``) wherever this module is not sure to agree with it:
a message with another role or type (a role without a head in the template's shape: Llama 3.1's tool turns,
Gemma's and Mistral's system ones); roles that do not alternate user/assistant where the
template requires it (it raises); content holding ``</think>``, ``<tool_response>`` or the span search's
placeholder character; an answer that Qwen3 would strip; where the template trims contents (Llama 3, 3.1,
Gemma), a content that begins or ends with a space beyond ASCII (``WIDE_SPACES``) or more than ``MAX_STRIP``
whitespace bytes; an empty category (a null one is a missing one, as per record). A batch is left to it whole
where pyarrow might not read it as Python's ``json`` does, or might not survive it:

- a line that is not one object (after JSON whitespace, ``{`` first and ``}`` last): pyarrow's reader is
  not line-based (``{..}{..}`` on one line is two rows, a record over two lines one, a top-level ``null``
  first in a batch crashes it), but no valid record spans lines between a ``}`` and a ``{``, so with one
  object a line and as many rows as lines, rows and lines pair up;
- a line with more than ``MAX_OPENINGS`` brackets (its parser recurses per nesting level);
- any line pyarrow refuses (malformed, duplicate keys, lone surrogates, raw control characters), invalid
  UTF-8 (which it accepts), both fields of conversations (``messages`` and ShareGPT's ``conversations``, which
  a record picks per record), a category that is not a string, a message field the template may read
  (``MESSAGE_EXTRAS`` but the category: other message fields are dropped, as ``normalize_messages`` drops them),
  another top-level field that is not a scalar;
- a batch whose first line names no ``messages`` (text under ``--format auto``) or of more than
  ``MAX_BATCH_BYTES``.

The parser's behaviour on these is checked at start (``agrees_with``), with the rendering, since it may
change from one pyarrow version to the next.

One module over 500 lines on purpose: the parser's guards, the column-wise rendering and the probes that check
them against the per-record path are one contract, changed together (the rendered batch the encoder reads is
``rendered.py``).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from xprep.prep.chat import fast as chat_fast
from xprep.prep.chat.messages import MESSAGE_EXTRAS, ROLES, TemplateError, normalize_messages
from xprep.prep.chat.rendered import ASCII_SPACE, WIDE_LEAD, Rendered
from xprep.prep.chat.shape import (  # noqa: F401  (the codes are this path's vocabulary too)
    ASSISTANT,
    CODES,
    SYSTEM,
    THINKING,
    TOOL,
    TOOL_CLOSE,
    TOOL_MID,
    TOOL_OPEN,
    USER,
    Shape,
)
from xprep.prep.tokenizer import csr_offsets

if TYPE_CHECKING:  # a type only: templates reads the registry (whose shapes are shape.py's)
    from xprep.prep.chat.templates import ChatTemplate

OTHER, KEPT, NO_ANSWER = 0, 1, 2  # what became of each record of a batch


_CANONICAL = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
MAX_STRIP = 64  # whitespace bytes stripped from a content's end, at most: more, and it goes the per-record way
# pyarrow's JSON parser recurses per nesting level: 20,000 levels overflow an 8 MB thread stack, ~2,000 a 1 MB
# one (a segfault, not an error). A line's nesting depth is at most its count of "[" and "{": lines with more
# than this many (~500 messages, or much code in a content) send their batch the per-record way.
MAX_OPENINGS = 1024
# the gather indexes every output byte (int32): a batch bigger than this (one huge line) goes the per-record way
MAX_BATCH_BYTES = 16 << 20
ROLE_BYTES = 16  # a role of 16 bytes or more (none of ROLES) goes the per-record way
FIELDS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # as normalize_messages reads them


def chat_field(line: bytes) -> str | None:
    """The field of a batch's conversations, by its first line: ``messages``, else ShareGPT's ``conversations``."""
    return next((key for key in FIELDS if f'"{key}"'.encode() in line), None)


@dataclass
class _Columns:
    """One batch's conversations as columns: the pyarrow arrays (``messages``, its ``structs`` and their fields) and
    numpy views of their buffers. Per record, its first message (``starts``: CSR offsets over the messages) and how
    many it has; per message, its record (``row``), index in its conversation (``position``), head code (-1: none
    for this path), content bytes (``data[c_off[i]:c_off[i + 1]]``; ``c_lo``/``c_hi``: as the template strips them,
    where it does, and whether ASCII work alone ``stripped`` it)."""

    messages: object
    structs: object
    role: object
    content: object
    category: object | None  # the messages' own categories, where some message has the field
    starts: np.ndarray
    counts: np.ndarray
    row: np.ndarray
    position: np.ndarray
    code: np.ndarray
    data: np.ndarray
    c_off: np.ndarray
    c_lo: np.ndarray
    c_hi: np.ndarray
    stripped: np.ndarray


class ColumnarChat:
    """Column-wise parsing and rendering of a batch of JSON lines for one template ``shape``;
    ``keep_unanswered``: a conversation without an assistant turn is a document (``--train-on all``) rather than
    a reject; ``bos``: the template's BOS token (for a shape that puts it first)."""

    def __init__(self, shape: Shape, keep_unanswered: bool, end_len: int | None = None,
                 category_field: str | None = None, role_map: dict[str, str] | None = None, bos: str = ""):
        import pyarrow as pa  # deferred with the module itself: only chat batches need it

        self.keep_unanswered = keep_unanswered
        self.role_map = role_map  # --role-map: looked up before ROLES, as normalize_messages does
        self.role_names = {**ROLES, **role_map} if role_map else ROLES
        self.shape = shape
        # what the span search takes after an answer's content (the end marker, as a rule)
        self.end_len = len(shape.end) if end_len is None else end_len
        self.category_field = category_field or "category"  # the record's category (--category-field)
        self._schemas = {}
        for key, names in FIELDS.items():  # OpenAI's messages, ShareGPT's conversations
            fields = [(name, pa.string()) for name in names]
            # a message's category is left out of the schema: then a batch without any has no such field at all
            self._schemas[key] = pa.schema([(key, pa.list_(pa.struct(fields))), (self.category_field, pa.string())])
        self._bos = bos if shape.bos else ""
        self._has_head = np.array([k in shape.heads for k in range(CODES)])  # a role without one goes per record
        heads = [shape.heads.get(k, "") for k in range(CODES)]
        first = [self._bos + (shape.first or {}).get(k, heads[k]) for k in range(CODES)]
        self._first_apart = first != heads  # a conversation's first message has its own head: code + CODES
        heads = [h.encode() for h in heads + first]
        tails = [(shape.tails or {}).get(k % CODES, shape.tail).encode() for k in range(2 * CODES)]
        pieces = heads + tails
        self._const = np.frombuffer(b"".join(pieces), np.uint8)
        at = csr_offsets([len(c) for c in pieces])[:-1]
        self._head_len = np.array([len(h) for h in heads], np.int64)
        self._head_at, self._tail_at = at[: 2 * CODES], at[2 * CODES :]
        self._tail_len = np.array([len(t) for t in tails], np.int64)
        # where an answer's span starts in its head: after the header, which ends its role's head (but Qwen3's
        # THINKING one, where it begins it) and whatever comes before that in the first message's
        before = [len(heads[k]) - len(heads[k % CODES]) for k in range(2 * CODES)]
        self._span_at = np.array(before, np.int64) + len(shape.header.encode())

    def render(self, items: list[bytes]) -> Rendered | None:
        """The batch rendered, or None where it must go the per-record way whole (see the module's docstring)."""
        read = self._read(items)
        if read is None:
            return None
        table, key = read
        cols = self._columns(table.column(key).combine_chunks(), key)
        record_cat = table.column(self.category_field).combine_chunks()
        status, code = self._status(cols, record_cat)
        kept = status == KEPT
        gathered = self._gather(kept, cols.starts, cols.counts, code, cols.data, cols.c_lo, cols.c_hi)
        if gathered is None:
            return Rendered(status, end=self.shape.end)
        *rendered, answer_msgs = gathered
        categories, span_categories = _categories(record_cat, cols.category, kept, answer_msgs)
        shape = _shape(kept, cols.starts, cols.counts, code, cols.row, cols.data, cols.c_off)
        return Rendered(status, *rendered, categories, span_categories, self.shape.end, shape)

    def _columns(self, messages, key: str) -> _Columns:
        """A batch's conversations (the pyarrow list array of field ``key``) as ``_Columns``."""
        structs = messages.values
        role, content = (structs.field(name) for name in FIELDS[key])
        category = structs.field("category") if structs.type.get_field_index("category") >= 0 else None
        starts = _offsets(messages)
        counts = np.diff(starts)
        row = np.repeat(np.arange(len(counts)), counts)
        data, c_off = _data(content), _offsets(content)
        c_lo, c_hi, stripped = _strip(data, c_off[:-1], c_off[1:]) if self.shape.strip else (
            c_off[:-1], c_off[1:], np.ones(len(structs), bool))
        return _Columns(messages, structs, role, content, category, starts, counts, row,
                        position=np.arange(len(structs)) - starts[row], code=self._roles(role, len(structs)),
                        data=data, c_off=c_off, c_lo=c_lo, c_hi=c_hi, stripped=stripped)

    def _message_ok(self, cols: _Columns) -> np.ndarray:
        """Per message: whether this path renders it (none null, a role with a head, alternating where the template
        requires it, no markup, a content stripped by ASCII work alone where stripped, no empty category)."""
        import pyarrow as pa  # deferred with the module itself (imported already by __init__)

        ok = _valid(cols.structs) & _valid(cols.role) & _valid(cols.content) & cols.stripped
        ok &= (cols.code >= 0) & self._has_head[np.maximum(cols.code, 0)]
        if self.shape.alternate:  # the template's own check (an error, per record) where roles do not alternate
            ok &= cols.code == np.where(cols.position % 2 == 0, USER, ASSISTANT)
        ok &= ~self._has_markup(cols.data, cols.c_off)
        if cols.category is not None and cols.category.type == pa.string():  # an empty category: rejected per record
            ok &= ~_empty(cols.category)
        return ok

    def _status(self, cols: _Columns, record_cat) -> tuple[np.ndarray, np.ndarray]:
        """Per record, KEPT, NO_ANSWER or OTHER: every message fine, at least one message, no empty record category,
        and the template's own conditions; and each message's head code (Qwen3's tool runs and thinking set)."""
        n = len(cols.counts)
        ok = ~_any(~self._message_ok(cols), cols.row, n) & (cols.counts > 0) & _valid(cols.messages)
        ok &= ~_empty(record_cat)
        answered = _any(cols.code == ASSISTANT, cols.row, n)
        code = cols.code
        if self.shape.thinking:
            code, ok = self._qwen3_heads(code, ok, cols.starts, cols.counts, cols.row, cols.position, cols.data,
                                         cols.c_off)
        status = np.where(ok, np.where(answered | self.keep_unanswered, KEPT, NO_ANSWER), OTHER).astype(np.int8)
        return status, code

    def agrees_with(self, template: ChatTemplate, probes: tuple[list[dict], ...] = (),
                    refused: list[bytes] | None = None) -> bool:
        """Whether every probe this path renders (``PROBES``, ``chat_fast.PROBES`` and the template's own
        ``probes``) comes out as ``template.render_with_spans`` renders it, every one it rejects for want of an
        answer has none (each probe a batch of its own), JSON escapes decode as Python's ``json`` decodes them, and
        every line pyarrow's reader could take otherwise (``refused``, else ``REFUSED``) sends its batch the
        per-record way."""
        lines = [json.dumps({"messages": probe}, ensure_ascii=False).encode()
                 for probe in [*PROBES, *chat_fast.PROBES, *probes]]
        lines.append(json.dumps({"messages": ESCAPES}, ensure_ascii=True).encode())  # emoji as surrogate pairs
        lines += [json.dumps({"conversations": [{"from": m["role"], "value": m["content"]} for m in probe]},
                             ensure_ascii=False).encode() for probe in PROBES]
        for line in lines:
            rendered = self.render([line])
            if rendered is None or rendered.status[0] == OTHER:
                continue
            try:
                messages = normalize_messages(json.loads(line), self.role_map)
                text, spans = template.render_with_spans(messages)
            except TemplateError:
                return False
            if rendered.status[0] == NO_ANSWER:
                if any(m["role"] == "assistant" for m in messages):
                    return False
            elif rendered.texts[0] != text or rendered.spans(0) != [(a, b) for a, b, _ in spans]:
                return False
        return all(self.render([lines[0], line]) is None for line in (REFUSED if refused is None else refused))

    def _read(self, items: list[bytes]):
        """(the batch as a table, the field of its conversations), or None (see the module's docstring)."""
        import pyarrow as pa  # deferred with the module itself: only chat batches need it
        import pyarrow.json as pj  # deferred: as pyarrow

        key = chat_field(items[0]) if items else None
        if key is None or sum(map(len, items)) > MAX_BATCH_BYTES:
            return None  # not chat (a text corpus under --format auto), or too big for the gather's indexes
        for line in items:
            if line[:1] != b"{" or line[-1:] != b"}":
                line = line.strip(b" \t\r\n")
                if line[:1] != b"{" or line[-1:] != b"}":
                    return None  # one object a line, else rows and lines may not pair up (module docstring)
            if len(line) > MAX_OPENINGS and line.count(b"[") + line.count(b"{") > MAX_OPENINGS:
                return None  # nested that deep (or holding that many brackets), it could overflow pyarrow's stack
        raw = b"\n".join(items) + b"\n"  # lines without their newlines
        try:
            table = pj.read_json(io.BytesIO(raw),
                                 read_options=pj.ReadOptions(use_threads=False, block_size=len(raw) + 1),
                                 parse_options=pj.ParseOptions(explicit_schema=self._schemas[key],
                                                               unexpected_field_behavior="infer"))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None
        if table.num_rows != len(items) or not _plain_messages(table.schema.field(key).type, key):
            return None
        for f in table.schema:  # (the other field of conversations: which one a record uses is per record)
            if f.name in FIELDS and f.name != key or (f.name != key and pa.types.is_nested(f.type)):
                return None
        try:
            table.validate(full=True)  # invalid UTF-8 passes pyarrow's reader; Python's json refuses it
        except pa.ArrowInvalid:
            return None
        return table, key

    def _roles(self, role, m: int) -> np.ndarray:
        """Each message's head code by its role, as ``normalize_messages`` maps it (-1: not for this path; a null
        role's code is whatever, the caller refuses it by its validity).

        Roles are told apart by their bytes and length with numpy alone (longer than ``ROLE_BYTES`` - 1: -1):
        pyarrow's ``dictionary_encode`` would import pyarrow.compute, ~0.3 s of every worker's start."""
        if m == 0:
            return np.zeros(0, np.int64)
        offsets, data = _offsets(role), _data(role)
        lengths = np.diff(offsets)
        short = lengths < ROLE_BYTES
        width = np.arange(ROLE_BYTES - 1)
        inside = width < np.where(short, lengths, 0)[:, None]
        padded = np.zeros((m, ROLE_BYTES), np.uint8)  # the role's bytes, then its length in the last byte
        padded[:, :-1][inside] = data[(offsets[:-1, None] + width)[inside]]
        padded[:, -1] = np.where(short, lengths, 0)
        halves = padded.view(np.uint64)  # (m, 2): one key of two words, made one by their ranks
        first, first_rank = np.unique(halves[:, 0], return_inverse=True)
        second, second_rank = np.unique(halves[:, 1], return_inverse=True)
        keys, inverse = np.unique(first_rank.ravel() * len(second) + second_rank.ravel(), return_inverse=True)
        rows = np.zeros(len(keys), np.int64)
        rows[inverse.ravel()] = np.arange(m)  # one message per distinct key
        names = [bytes(padded[r, : padded[r, -1]]) for r in rows.tolist()]
        lut = np.array([_CANONICAL.get(_canonical(name, self.role_names), -1) for name in names], np.int64)
        return np.where(short, lut[inverse.ravel()], -1)

    def _has_markup(self, data: np.ndarray, c_off: np.ndarray) -> np.ndarray:
        """Per message: whether its content holds any of this template's markup strings."""
        found = np.zeros(len(c_off) - 1, bool)
        raw = data.tobytes()
        for needle in self.shape.markup:
            at = raw.find(needle)
            while at >= 0:
                found[np.searchsorted(c_off, at, side="right") - 1] = True
                at = raw.find(needle, at + 1)
        return found

    def _qwen3_heads(self, code, ok, starts, counts, row_of_msg, position, data, c_off):
        """Qwen3: a run of tool turns is one user turn (each tool message's code says where it is in its run); the
        last message, when an answer after the last query (user turn), opens with an empty ``<think>`` block and
        loses its content's leading newlines (such content is left to the per-record path)."""
        n = len(counts)
        ok, code = ok.copy(), code.copy()
        tools = np.flatnonzero(code == TOOL)
        if len(tools):
            after = (position[tools] > 0) & (code[tools - 1] == TOOL)
            before = (position[tools] < counts[row_of_msg[tools]] - 1) & (code[np.minimum(tools + 1, len(code) - 1)]
                                                                          == TOOL)
            code[tools] = np.select([~after & before, after & before, after], [TOOL_OPEN, TOOL_MID, TOOL_CLOSE], TOOL)
        last_user = np.full(n, -1, np.int64)
        users = np.flatnonzero(code == USER)
        np.maximum.at(last_user, row_of_msg[users], position[users])
        last_query = np.where(last_user >= 0, last_user, counts - 1)
        rows = np.flatnonzero(counts > 0)
        last = starts[rows + 1] - 1  # the last message of each non-empty conversation
        opens = last[(code[last] == ASSISTANT) & (position[last] > last_query[rows])]
        code[opens] = THINKING
        filled = opens[c_off[opens + 1] > c_off[opens]]
        newline = filled[data[c_off[filled]] == ord("\n")]
        ok[row_of_msg[newline]] = False
        return code, ok

    def _gather(self, kept, starts, counts, code, data, c_lo, c_hi):
        """The kept conversations rendered: every message as head + content + tail, in one gather. Returns
        ``Rendered``'s data, bounds, span starts and ends (bytes), answers per conversation, and the message of
        each span (None for no conversation)."""
        rows = np.flatnonzero(kept)
        if len(rows) == 0:
            return None
        k_counts = counts[rows]
        msgs = np.repeat(starts[rows] - csr_offsets(k_counts)[:-1], k_counts) + np.arange(
            int(k_counts.sum()))
        mc = code[msgs]
        answer = (mc == ASSISTANT) | (mc == THINKING)
        if self._first_apart:
            mc[csr_offsets(k_counts)[:-1]] += CODES  # (mc is a copy: an index's gather)
        c_start, c_len = c_lo[msgs], c_hi[msgs] - c_lo[msgs]
        h_len, t_len = self._head_len[mc], self._tail_len[mc]
        msg_len = h_len + c_len + t_len
        msg_at = csr_offsets(msg_len)  # each message's byte offset in the output
        total = int(msg_at[-1])
        # three pieces per message: head (constants), content (data), tail (constants)
        src = np.concatenate([data, self._const])
        base = len(data)
        piece_src = np.stack([base + self._head_at[mc], c_start, base + self._tail_at[mc]], 1).ravel()
        piece_len = np.stack([h_len, c_len, t_len], 1).ravel()
        piece_out = csr_offsets(piece_len)[:-1]
        index = np.repeat((piece_src - piece_out).astype(np.int32), piece_len)  # int32: MAX_BATCH_BYTES bounds it
        index += np.arange(total, dtype=np.int32)
        out = src[index]
        # assistant spans: after the header, to the end of the content's end marker
        span_start = msg_at[:-1][answer] + self._span_at[mc[answer]]
        span_end = msg_at[:-1][answer] + h_len[answer] + c_len[answer] + self.end_len
        row_at = msg_at[csr_offsets(k_counts)]  # each kept conversation's byte range
        answers = np.bincount(np.repeat(np.arange(len(rows)), k_counts)[answer], minlength=len(rows))
        return out, row_at, span_start, span_end, answers, msgs[answer]


def _categories(record_cat, msg_cat, kept: np.ndarray, answer_msgs: np.ndarray) -> tuple[list | None, list | None]:
    """The kept conversations' record categories and each span's own category (its message's), or None for either
    where there is none at all (a message category on other messages than answers gives none to a span)."""
    categories = record_cat.to_pylist() if record_cat.null_count < len(record_cat) else None
    if categories is not None:
        categories = [categories[r] for r in np.flatnonzero(kept).tolist()]
    span_categories = None
    if msg_cat is not None and msg_cat.null_count < len(msg_cat):  # strings only where some message has a category
        cat_of = msg_cat.to_pylist()
        span_categories = [cat_of[i] for i in answer_msgs.tolist()]
        if all(c is None for c in span_categories):
            span_categories = None
    return categories, span_categories


def _shape(kept, starts, counts, code, row_of_msg, data, c_off) -> np.ndarray:
    """``conversation_shape`` summed over the kept records, column-wise: (conversations, assistant turns, those that
    begin with the assistant after any system turn, assistant turns of blank content, those that end with another
    turn than the assistant's)."""
    rows = np.flatnonzero(kept)
    answer = (code == ASSISTANT) | (code == THINKING)
    in_kept = np.repeat(kept, counts)
    answers = np.flatnonzero(answer & in_kept)
    spoken = np.flatnonzero((code != SYSTEM) & in_kept)  # (messages come in order: a record's first is first)
    first = spoken[np.flatnonzero(np.diff(row_of_msg[spoken], prepend=-1))]
    last = starts[rows + 1] - 1  # (a kept record has a message)
    return np.array([len(rows), len(answers), np.count_nonzero(answer[first]),
                     np.count_nonzero(_blank(data, c_off[answers], c_off[answers + 1])),
                     np.count_nonzero(~answer[last])], np.int64)


def _blank(data: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per content ([lo, hi) in ``data``): whether ``str.strip()`` leaves nothing of it (``_strip``, and Python itself
    where that says a content is beyond its ASCII work)."""
    inner_lo, inner_hi, ok = _strip(data, lo, hi)
    blank = ok & (inner_lo >= inner_hi)
    for i in np.flatnonzero(~ok).tolist():
        blank[i] = not data[lo[i] : hi[i]].tobytes().decode("utf-8").strip()
    return blank


def conversation_shape(messages: list[dict]) -> tuple[int, int, bool, int, bool]:
    """One conversation's counts of ``prep.dataset.token_dataset.CONVERSATION_COUNTS`` (``normalize_messages``'
    messages): as ``_shape`` counts them column-wise. An answer with a tool call or reasoning is not blank."""
    answers = [m for m in messages if m["role"] == "assistant"]
    first = next((m["role"] for m in messages if m["role"] != "system"), None)
    blank = sum(1 for m in answers if not m["content"].strip() and not m.get("tool_calls")
                and not m.get("reasoning_content"))
    return 1, len(answers), first == "assistant", blank, messages[-1]["role"] != "assistant"


def _canonical(raw: bytes, roles: dict[str, str]) -> str | None:
    """``normalize_messages``' role mapping, for a role's UTF-8 bytes (None where it knows no such role)."""
    try:
        role = raw.decode("utf-8")
    except UnicodeDecodeError:  # cut inside a character by the padding: not one of ROLES anyway
        return None
    return roles.get(role) or roles.get(role.lower())


def _strip(data: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each content's bounds as ``str.strip()`` leaves them ([lo, hi) in ``data``, per message), and whether that
    was all ASCII work: False where a content begins or ends (after its ASCII whitespace) with one of
    ``WIDE_SPACES``, or has more than ``MAX_STRIP`` whitespace bytes at an end (such a record goes per record)."""
    lo, hi = lo.copy(), hi.copy()
    ok = np.ones(len(lo), bool)
    if len(data) == 0:
        return lo, hi, ok
    last = len(data) - 1
    for bounds, step in ((lo, 1), (hi, -1)):
        for _ in range(MAX_STRIP + 1):
            at = bounds if step == 1 else bounds - 1
            space = (lo < hi) & ASCII_SPACE[data[np.clip(at, 0, last)]]
            if not space.any():
                break
            bounds += step * space
        else:
            ok &= ~space
    # a wide space at an end: only contents with one of their lead bytes there are decoded (the first and the
    # last character, where a 2- or 3-byte one would be)
    size = hi - lo
    first = data[np.clip(lo, 0, last)]
    two, three = data[np.clip(hi - 2, 0, last)], data[np.clip(hi - 3, 0, last)]
    maybe = (size > 0) & WIDE_LEAD[first]
    maybe |= ((size >= 2) & (two == 0xC2)) | ((size >= 3) & WIDE_LEAD[three] & (three != 0xC2))
    for i in np.flatnonzero(maybe & ok).tolist():
        text = data[lo[i] : hi[i]].tobytes().decode("utf-8", "replace")
        if text[:1].isspace() or text[-1:].isspace():
            ok[i] = False
    return lo, hi, ok


def _plain_messages(kind, key: str) -> bool:
    """Whether a batch's conversations (``key``) have the type this module reads: a list of messages of a role and a
    content (strings), maybe a category (a string or null), and fields ``normalize_messages`` drops (any but
    ``MESSAGE_EXTRAS``, which it keeps for the template: such a batch goes the per-record way)."""
    import pyarrow as pa  # deferred with the module itself (imported already by ColumnarChat)

    if not pa.types.is_list(kind) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {f.name: f.type for f in kind.value_type}
    role, content = FIELDS[key]
    return (fields.get(role) == pa.string() and fields.get(content) == pa.string()
            and fields.get("category", pa.null()) in (pa.string(), pa.null())
            and not any(name in MESSAGE_EXTRAS for name in fields if name != "category"))


def _offsets(arr) -> np.ndarray:
    """A pyarrow string or list array's offsets (one more than its length), from their buffer: ``to_numpy``
    would import pyarrow.compute."""
    return np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)


def _data(arr) -> np.ndarray:
    """A pyarrow string array's bytes (all of its buffer: ``_offsets`` index it)."""
    data = arr.buffers()[2]
    return np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)


def _any(flags: np.ndarray, row: np.ndarray, n: int) -> np.ndarray:
    """Per record (of ``n``): whether any of its messages (``row`` of each) is flagged."""
    return np.bincount(row, weights=flags, minlength=n) > 0


def _empty(arr) -> np.ndarray:
    """Per element of a pyarrow string array: an empty string (not a null)."""
    return _valid(arr) & (np.diff(_offsets(arr)) == 0)


def _valid(arr) -> np.ndarray:
    """Per element of a pyarrow array: not null (from its validity bitmap; ``is_valid()`` would import
    pyarrow.compute)."""
    if arr.null_count == 0:
        return np.ones(len(arr), bool)
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


# Conversations the column-wise rendering must render as ``render_with_spans`` does before it is used (besides
# chat_fast.PROBES, which mostly exercise what it leaves to the per-record path).
PROBES: list[list[dict]] = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": " a2\n"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, {"role": "system", "content": "later"},
     {"role": "assistant", "content": "\nsecond"}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "é 日本語 😀"},
     {"role": "assistant", "content": "réponse 😀"}],
    [{"role": "user", "content": "only a question"}],
    [{"role": "Human", "content": "q"}, {"role": "GPT", "content": "<|im_end|>a"}],
]

# Escapes Python's json decodes: \uXXXX (emoji as surrogate pairs), \", \\ and \t.
ESCAPES: list[dict] = [{"role": "user", "content": "\"quoted\" back\\slash /slash\ttab \u0000 \u2028 é 日本"},
                       {"role": "assistant", "content": "😀 👨‍👩‍👧 \ue001 <|im_end|>"}]
# Lines Python's json reads otherwise than pyarrow's reader (or refuses where it does not): each must send its
# batch the per-record way.
REFUSED: list[bytes] = [
    b'{"messages": [{"role": "user", "content": "a", "content": "b"}, {"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "a\xffb"}, {"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}, {"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "a\x01b"}, {"role": "assistant", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}]}{"messages": []}',
    b"null",
]


def for_template(template: ChatTemplate | None, keep_unanswered: bool, category_field: str | None = None,
                 role_map: dict[str, str] | None = None) -> ColumnarChat | None:
    """The column-wise rendering for ``template``, where its fast renderer runs (``template.known``: its registry
    entry), the entry has a shape and that renders every probe as ``render_with_spans`` does; else None (the
    per-record path)."""
    known = template.known if template is not None else None
    if known is None or known.shape is None or category_field in ("messages", "conversations"):
        return None
    shape = known.shape
    if template.generation_prompt != shape.header:
        return None
    answer_tail = (shape.tails or {}).get(ASSISTANT, shape.tail)
    ends = {template.span_end(answer_tail + after, 0) for after in ("", shape.heads[USER])}
    if len(ends) != 1:
        return None
    columns = ColumnarChat(shape, keep_unanswered, ends.pop(), category_field, role_map, template.spec.bos_token)
    return columns if columns.agrees_with(template, known.probes) else None

