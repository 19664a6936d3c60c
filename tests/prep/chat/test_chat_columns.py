"""prep/chat/columns.py: a chat batch rendered column-wise gives exactly what the per-record path gives.

The per-record path (the fast renderers, itself proven equal to Jinja in test_chat_fast.py) is forced with
``chat_render="records"`` (``--chat-render records``). Both run the same Processor on every conversation of
../shared/data/chat and on hostile lines, for every template of the registry with a column-wise shape, and must
agree array for array, reject for reject.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SHARED, known_templates, requires_shared_data
from prepkit import assert_same_files, conversation_counts, shaped_conversations, tokenize
from xprep.prep.chat import TEMPLATES
from xprep.prep.chat import columns as chat_columns
from xprep.prep.chat.messages import parse_role_map
from xprep.prep.chat.templates import ChatTemplate, TemplateSpec
from xprep.prep.dataset.token_dataset import CONVERSATION_COUNTS
from xprep.prep.formats import AUTO, CHAT
from xprep.prep.sources import LINES, RawBatch
from xprep.prep.tokenize.config import Options
from xprep.prep.tokenize.encode import Processor
from xprep.prep.tokenizer import choose_backend, load_tokenizer_info

QWEN3 = SHARED / "tokenizers/qwen3"
# every template of the registry that has a column-wise shape, by name (its first source)
SPECS = {name: spec for name, spec in known_templates().items() if TEMPLATES[name].shape is not None}
CHATML = SPECS["chatml"]
BATCH = chat_columns.OTHER - 1  # the whole batch went the per-record way


def _processor(spec: TemplateSpec | None, train_on: str = "assistant", category: str | None = None,
               fmt: str = CHAT, category_field: str | None = None, role_map: dict | None = None,
               chat_render: str = "auto") -> Processor:
    info = load_tokenizer_info(str(QWEN3))
    if spec is None:
        spec = TemplateSpec("tokenizer", info.chat_template, info.bos_token or "", info.eos_token)
    backend, _ = choose_backend(info, "auto")
    return Processor(info, backend, spec, Options(fmt, "text", train_on, category, category_field, None, info.eod_id,
                                                  info.vocab_size, role_map or {}), chat_render)


def _pair(spec, **kw) -> tuple[Processor, Processor]:
    """The column-wise path's Processor and the per-record one's (``--chat-render records``)."""
    columns = _processor(spec, **kw)
    assert columns.columns is not None
    records = _processor(spec, chat_render="records", **kw)
    assert records.columns is None and records.template.has_fast_path
    return columns, records


def _chitchat(limit: int | None = None) -> list[bytes]:
    return (SHARED / "chat/chitchat.jsonl").read_bytes().splitlines()[:limit]


def _batches(lines: list[bytes], size: int = 1024) -> list[RawBatch]:
    return [RawBatch(0, lines[i : i + size], list(range(i + 1, i + 1 + len(lines[i : i + size]))), LINES)
            for i in range(0, len(lines), size)]


def _assert_same(a, b, name: str) -> None:
    assert [(r.line, r.kind, r.reason, r.record, r.fatal) for r in a.rejects] == [
        (r.line, r.kind, r.reason, r.record, r.fatal) for r in b.rejects], name
    assert np.array_equal(a.lengths, b.lengths), name
    assert np.array_equal(a.tokens, b.tokens), name
    assert (a.loss_mask is None) == (b.loss_mask is None) and np.array_equal(a.loss_mask, b.loss_mask), name
    assert a.cat_keys == b.cat_keys, name
    assert (a.cat_codes is None) == (b.cat_codes is None) and np.array_equal(a.cat_codes, b.cat_codes), name
    assert a.bytes_in == b.bytes_in, name
    assert np.array_equal(a.conversations, b.conversations), name  # the conversations' shape, counted either way


def _rendered_run(columns: Processor, batch: RawBatch):
    """``columns(batch)`` and what its column-wise path rendered of the batch (None: it went per record whole),
    the batch rendered once, as a run renders it, rather than once more to look at."""
    seen = []
    render = columns.columns.render
    columns.columns.render = lambda items: seen.append(render(items)) or seen[-1]
    try:
        out = columns(batch)
    finally:
        del columns.columns.render
    assert len(seen) == 1
    return seen[0], out


@requires_shared_data
@pytest.mark.parametrize("template", list(SPECS))
@pytest.mark.parametrize("train_on,category", [("assistant", None), ("all", "chat")])
def test_every_conversation_column_wise_equals_per_record(template, train_on, category, monkeypatch):
    columns, records = _pair(SPECS[template], train_on=train_on, category=category)
    kept = 0
    for batch in _batches(_chitchat()):
        rendered, out = _rendered_run(columns, batch)
        assert rendered is not None  # chitchat is plain chat: every batch goes column-wise
        kept += int((rendered.status == chat_columns.KEPT).sum())
        _assert_same(out, records(batch), f"{template} lines {batch.lines[0]}..")
    assert kept > 4000


def _assert_batches_same(columns: Processor, records: Processor, lines: list[bytes], name: str) -> None:
    """Batches of ``lines``, each mostly column-wise (> 300 kept): the same output both ways."""
    for batch in _batches(lines):
        rendered, out = _rendered_run(columns, batch)
        assert rendered is not None and (rendered.status == chat_columns.KEPT).sum() > 300
        _assert_same(out, records(batch), f"{name} lines {batch.lines[0]}..")


def _msgs(*turns, **extra) -> list[dict]:
    return [{"role": r, "content": c, **extra} for r, c in turns]


QA = _msgs(("user", "q"), ("assistant", "a"))
# (name, raw line, what becomes of it with Qwen3's template, with ChatML): a status of chat_columns, or BATCH
HOSTILE: list[tuple[str, bytes, int, int]] = [
    ("duplicate key", b'{"messages": [{"role": "user", "content": "a", "role": "assistant"}]}', BATCH, BATCH),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}, '
                       b'{"role": "assistant", "content": "x"}]}', BATCH, BATCH),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "a\xffb"}, '
                      b'{"role": "assistant", "content": "x"}]}', BATCH, BATCH),
    ("surrogate bytes", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}, '
                        b'{"role": "assistant", "content": "x"}]}', BATCH, BATCH),
    ("raw control character", b'{"messages": [{"role": "user", "content": "a\x01b"}, '
                              b'{"role": "assistant", "content": "x"}]}', BATCH, BATCH),
    ("two objects", json.dumps({"messages": QA}).encode() * 2, BATCH, BATCH),
    ("two objects, a carriage return between", json.dumps({"messages": QA}).encode() + b"\r{}", BATCH, BATCH),
    ("null", b"null", BATCH, BATCH),
    ("padded", b"  " + json.dumps({"messages": QA}).encode() + b" \t\r", chat_columns.KEPT, chat_columns.KEPT),
    ("not an object", b"[1, 2]", BATCH, BATCH),
    ("cut off", b'{"messages": [{"role": "user"', BATCH, BATCH),
    ("blank", b"", BATCH, BATCH),
    ("message field", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), name="bob")}).encode(),
     BATCH, BATCH),
    ("reasoning field", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), reasoning_content="r")})
     .encode(), BATCH, BATCH),
    ("message fields dropped", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), weight=1, id="m",
                                                             meta={"a": [1], "b": None})}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("a dropped field pyarrow cannot type", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"),
                                                                          meta=[1, {"b": None}])}).encode(),
     BATCH, BATCH),
    ("a dropped field named like a ShareGPT one", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"),
                                                                                 value="not the content")}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("record category", json.dumps({"category": "x", "messages": QA}).encode(), chat_columns.KEPT, chat_columns.KEPT),
    ("message categories", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), category="m")}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("null record category", b'{"category": null, "messages": ' + json.dumps(QA).encode() + b"}", chat_columns.KEPT,
     chat_columns.KEPT),  # the command's category, as when there is no such key
    ("empty record category", json.dumps({"category": "", "messages": QA}).encode(), chat_columns.OTHER,
     chat_columns.OTHER),
    ("number record category", json.dumps({"category": 5, "messages": QA}).encode(), BATCH, BATCH),
    ("null message category", b'{"messages": [{"role": "user", "content": "q", "category":null}, '
                              b'{"role": "assistant", "content": "a"}]}', chat_columns.KEPT, chat_columns.KEPT),
    ("null message category among named ones", b'{"messages": [{"role": "user", "content": "q", "category":null}, '
     b'{"role": "assistant", "content": "a", "category": "x"}]}', chat_columns.KEPT, chat_columns.KEPT),
    ("empty message category", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), category="")}).encode(),
     chat_columns.OTHER, chat_columns.OTHER),
    ("number message category", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), category=3)}).encode(),
     BATCH, BATCH),
    ("a category in a content", json.dumps({"messages": _msgs(("user", '"category": null'), ("assistant", "a"))})
     .encode(), chat_columns.KEPT, chat_columns.KEPT),
    ("nested field", json.dumps({"meta": {"a": [1]}, "messages": QA}).encode(), BATCH, BATCH),
    ("number content", b'{"messages": [{"role": "user", "content": 5}]}', BATCH, BATCH),
    ("string messages", b'{"messages": "hi"}', BATCH, BATCH),
    ("deep nesting", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b', "messages": []}', BATCH, BATCH),
    ("many brackets", json.dumps({"messages": _msgs(("user", "{[" * 600), ("assistant", "a"))}).encode(),
     BATCH, BATCH),
    ("a field of another type", json.dumps({"id": 7, "messages": QA}).encode(), BATCH, BATCH),  # chitchat's are str
    ("conversations", json.dumps({"conversations": [{"from": "human", "value": "q"}]}).encode(), BATCH, BATCH),
    ("empty messages", b'{"messages": []}', chat_columns.OTHER, chat_columns.OTHER),
    ("null messages", b'{"messages": null, "text": "plain text"}', chat_columns.OTHER, chat_columns.OTHER),
    ("null message", b'{"messages": [null, {"role": "assistant", "content": "a"}]}', chat_columns.OTHER,
     chat_columns.OTHER),
    ("null content", b'{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "a"}]}',
     chat_columns.OTHER, chat_columns.OTHER),
    ("missing role", b'{"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}', chat_columns.OTHER,
     chat_columns.OTHER),
    ("unknown role", json.dumps({"messages": _msgs(("robot", "q"), ("assistant", "a"))}).encode(),
     chat_columns.OTHER, chat_columns.OTHER),
    ("long role", json.dumps({"messages": _msgs(("assistant-of-the-year", "q"), ("assistant", "a"))}).encode(),
     chat_columns.OTHER, chat_columns.OTHER),
    ("role with a NUL", json.dumps({"messages": _msgs(("user\u0000", "q"), ("assistant", "a"))}).encode(),
     chat_columns.OTHER, chat_columns.OTHER),
    ("tool turn", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "a"), ("tool", "42"),
                                                ("assistant", "b"))}).encode(), chat_columns.KEPT, chat_columns.KEPT),
    ("reasoning", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "<think>\nhm\n</think>\n\na"))}).encode(),
     chat_columns.OTHER, chat_columns.KEPT),
    ("think alone", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "<think> a"))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("tool response", json.dumps({"messages": _msgs(("user", "<tool_response>r</tool_response>"),
                                                    ("assistant", "a"))}).encode(),
     chat_columns.OTHER, chat_columns.KEPT),
    ("placeholder", json.dumps({"messages": _msgs(("user", "\ue000"), ("assistant", "\ue0000\ue001"))}).encode(),
     chat_columns.OTHER, chat_columns.OTHER),
    ("answer after a newline", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "\n\na"))}).encode(),
     chat_columns.OTHER, chat_columns.KEPT),
    ("earlier answer after a newline", json.dumps({"messages": _msgs(("user", "q"), ("assistant", "\n\na"),
                                                                     ("user", "q2"))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("aliases", json.dumps({"messages": _msgs(("Human", "q"), ("GPT", "a"), ("USER", "q2"), ("Bot", "b"))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("unicode", json.dumps({"messages": _msgs(("user", "naïve — 日本語 😀"), ("assistant", "Ünïcödé 👨‍👩‍👧"))},
                           ensure_ascii=False).encode(), chat_columns.KEPT, chat_columns.KEPT),
    ("escaped unicode", json.dumps({"messages": _msgs(("user", "é😀"), ("assistant", "\u2028\u00a0"))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("special tokens", json.dumps({"messages": _msgs(("user", "<|im_end|><|im_start|>assistant\n"),
                                                     ("assistant", "<|im_end|><|endoftext|>"))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("system later, answer first", json.dumps({"messages": _msgs(("assistant", "first"), ("system", "s"),
                                                                 ("user", "q"), ("assistant", ""))}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("no user", json.dumps({"messages": _msgs(("system", "s"), ("assistant", "a"))}).encode(), chat_columns.KEPT,
     chat_columns.KEPT),
    ("other fields", json.dumps({"rank": 7, "origin": "x", "score": 0.5, "ok": True, "messages": QA}).encode(),
     chat_columns.KEPT, chat_columns.KEPT),
    ("no answer", json.dumps({"messages": _msgs(("user", "q"))}).encode(), chat_columns.NO_ANSWER,
     chat_columns.NO_ANSWER),
]


# Contents Llama 3's template strips (Jinja's trim: str.strip()): all kept column-wise by ChatML and Qwen3, and by
# Llama 3 too but where LLAMA3_OTHER says (a character beyond ASCII that str.isspace calls space at an end, or
# more than MAX_STRIP whitespace bytes there)
STRIPPED: list[tuple[str, bytes, int, int]] = [
    (name, json.dumps({"messages": _msgs(("user", q), ("assistant", a))}, ensure_ascii=ascii).encode(),
     chat_columns.KEPT, chat_columns.KEPT)
    for name, q, a, ascii in [
        ("spaces around", "  q  ", " a \n", True),
        ("tabs, CR LF, form feed, vertical tab", "\t\r\nq\x0b", "\x0ca\r\n\t", True),
        ("information separators", "\x1cq\x1d", "\x1ea\x1f", True),
        ("only whitespace", " \n\t ", "\r\n", True),
        ("empty", "", "", True),
        ("inner whitespace kept", "a  \n  b", "x\u00a0y \u3000 z", False),
        ("no-break space first", "\u00a0q", "a", False),
        ("ideographic space last", "q", "a\u3000", False),
        ("line separator after spaces", "q", "  \u2028a", True),
        ("next line, escaped", "\x85q", "a", True),
        ("a run of 64", " " * 64 + "q", "a", True),
        ("a run of 65", "q", "a" + "\n" * 65, True),
        ("a leading run of 65", "\t" * 65 + "q", "a", True),
        ("only whitespace, 70 bytes", " " * 70, "a", True),
        ("next line, raw", "q\x85", "a", False),
        ("only a no-break space", "q", "\u00a0", False),
        ("a single wide character", "日", "é", False),
        ("unicode inside", "é 日本語", "😀 réponse", False),
        ("zero-width space is not space", "\u200bq", "a\u200b", False),
    ]
]
LLAMA3_OTHER = {"no-break space first", "ideographic space last", "line separator after spaces",
                "next line, escaped", "a run of 65", "a leading run of 65", "only whitespace, 70 bytes",
                "next line, raw", "only a no-break space",
                "escaped unicode"}  # the last: HOSTILE's answer "\\u2028\\u00a0"
LLAMA31_OTHER = {"tool turn"}  # Llama 3.1's tool turns hold their content as JSON: per record
ALTERNATING_OTHER = {"tool turn", "system later, answer first", "no user"}  # Gemma and Mistral raise on these


def _others(shape: chat_columns.Shape) -> set[str]:
    """What goes the per-record way with a template of this shape but for ChatML's column of the tables."""
    return ((LLAMA3_OTHER if shape.strip else set()) | (ALTERNATING_OTHER if shape.alternate else set())
            | (LLAMA31_OTHER if chat_columns.TOOL not in shape.heads else set()))


@requires_shared_data
@pytest.mark.parametrize("template", list(SPECS))
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_hostile_lines_among_real_ones(template, train_on, monkeypatch):
    """Each line in a batch of real conversations: the batch or the line goes the per-record way exactly where
    the table says (for Llama 3, ChatML's column but where its content is stripped), and the output is the
    per-record path's either way (rejects included)."""
    columns, records = _pair(SPECS[template], train_on=train_on, fmt=AUTO)
    good = _chitchat(40)
    shape = TEMPLATES[template].shape
    for name, line, qwen3, chatml in [*HOSTILE, *STRIPPED]:
        want = qwen3 if shape.thinking else chatml
        if want == chat_columns.NO_ANSWER and train_on == "all":
            want = chat_columns.KEPT
        batch = RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES)
        rendered, out = _rendered_run(columns, batch)
        got = BATCH if rendered is None else int(rendered.status[20])
        if name in _others(shape):
            want = chat_columns.OTHER
        assert got == want, name
        _assert_same(out, records(batch), name)


@requires_shared_data
@pytest.mark.parametrize("lines", [
    [b"null", json.dumps({"messages": QA}).encode()],  # pyarrow's reader crashes on a first top-level null
    [json.dumps({"messages": QA}).encode() * 2, b'{"messages": [{"role": "user", "content": "x"},',
     b'{"role": "assistant", "content": "y"}]}'],  # three lines, three rows: one too many and one too few
    [b'{"text": "plain text, no chat"}', json.dumps({"messages": QA}).encode()],  # not chat: not parsed twice
], ids=["null first", "rows and lines out of step", "text first"])
def test_batches_whose_rows_might_not_be_their_lines(lines, monkeypatch):
    columns, records = _pair(None, fmt=AUTO)
    batch = RawBatch(0, lines + _chitchat(5), list(range(1, len(lines) + 6)), LINES)
    assert columns.columns.render(batch.items) is None
    _assert_same(columns(batch), records(batch), "out of step")


def _with_categories(lines: list[bytes]) -> list[bytes]:
    """Real conversations given record and message categories, in a pattern that leaves some without either."""
    out = []
    for i, line in enumerate(lines):
        record = json.loads(line)
        if i % 3 == 0:
            record["category"] = ["small talk", "chit-chat"][i % 2]
        for k, m in enumerate(record["messages"]):
            if (i + k) % 4 == 0 and m["role"] == "assistant":
                m["category"] = f"answer-{k % 3}"
            elif i % 5 == 0 and k == 0:
                m["category"] = "opening"
        out.append(json.dumps(record, ensure_ascii=False).encode())
    return out


@requires_shared_data
@pytest.mark.parametrize("template", ["qwen3", "chatml", "llama3"])
@pytest.mark.parametrize("train_on,category,field", [("assistant", None, None), ("all", "chat", None),
                                                     ("assistant", "chat", "topic"), ("all", None, "topic")])
def test_categories_column_wise_equal_per_record(template, train_on, category, field, monkeypatch):
    """Record categories (``category``, or chitchat's own ``topic`` through --category-field) and message ones:
    column-wise as per record, and column-wise it goes."""
    columns, records = _pair(SPECS[template], train_on=train_on, category=category, category_field=field)
    for batch in _batches(_with_categories(_chitchat(3000))):
        rendered, out = _rendered_run(columns, batch)
        assert rendered is not None and (rendered.status == chat_columns.KEPT).sum() > 300
        assert any(c is not None for c in rendered.span_categories)
        assert any(c is not None for c in rendered.categories)
        _assert_same(out, records(batch), f"{template} lines {batch.lines[0]}..")


@requires_shared_data
@pytest.mark.parametrize("template", list(SPECS))
def test_role_map_column_wise_equals_per_record(template, monkeypatch):
    """--role-map names (any case), one that overrides a built-in alias, and unmapped ones: as per record."""
    role_map = parse_role_map("person=user,chatbot=assistant,narrator=system,gpt=user")
    renamed = {"user": ["person", "Person", "PERSON", "human"], "assistant": ["chatbot", "ChatBot", "assistant"]}
    lines = []
    for i, line in enumerate(_chitchat(2048)):
        record = json.loads(line)
        for k, m in enumerate(record["messages"]):
            names = renamed[m["role"]]
            m["role"] = names[(i + k) % len(names)]
        if i % 7 == 0:
            record["messages"].insert(0, {"role": "narrator", "content": "Be kind."})
        if i % 11 == 0:
            record["messages"].append({"role": "GPT", "content": "mapped to user here"})
        if i % 13 == 0:
            record["messages"].append({"role": "robot", "content": "unknown: rejected"})
        lines.append(json.dumps(record).encode())
    columns, records = _pair(SPECS[template], role_map=role_map)
    _assert_batches_same(columns, records, lines, template)


def _line(record: dict) -> bytes:
    return json.dumps(record).encode()


@requires_shared_data
@pytest.mark.parametrize("lines,train_on,category", [
    # no answer anywhere, categories that differ: every segment is a gap
    ([_line({"category": "a", "messages": _msgs(("user", "q"))}),
      _line({"category": "b", "messages": _msgs(("user", "r"))})], "all", None),
    ([_line({"category": "a", "messages": _msgs(("user", "q"))}), _line({"messages": _msgs(("user", "r"))})],
     "all", "chat"),
    # categories on answers only, none on a record: the category stream is still written
    ([_line({"messages": _msgs(("user", "q"), ("assistant", "a"), category="answers")}),
      _line({"messages": QA})], "assistant", None),
    ([_line({"messages": _msgs(("user", "q"), ("assistant", "a"), category="answers")}),
      _line({"messages": _msgs(("user", "q"), ("tool", "t"), ("assistant", "a"), category="tools")})], "all", None),
], ids=["unanswered, two categories", "unanswered, a category and --category", "answer categories only",
        "answer categories, a row per record"])
def test_small_batches_with_categories(lines, train_on, category, monkeypatch):
    columns, records = _pair(None, train_on=train_on, category=category)
    batch = RawBatch(0, lines, list(range(1, len(lines) + 1)), LINES)
    assert columns.columns.render(batch.items) is not None
    got = columns(batch)
    _assert_same(got, records(batch), "small batch")
    assert got.cat_codes is not None and len(got.cat_keys) > 1


def test_a_category_field_that_names_the_messages_goes_per_record():
    assert chat_columns.for_template(ChatTemplate(CHATML), False, "messages") is None
    assert chat_columns.for_template(ChatTemplate(CHATML), False, "topic") is not None


def test_probes_are_checked_before_use():
    info_template = ChatTemplate(CHATML)
    assert chat_columns.for_template(info_template, False) is not None
    shape = TEMPLATES["chatml"].shape
    wrong_end = chat_columns.ColumnarChat(shape, False, len(shape.end) + 1)
    assert not wrong_end.agrees_with(info_template)


def test_a_parser_that_takes_a_line_json_refuses_is_not_used():
    """Were pyarrow to read a duplicate key as Python does not (a later version, say), the path is not used."""
    template = ChatTemplate(CHATML)
    columns = chat_columns.for_template(template, False)
    assert columns is not None and columns.agrees_with(template)
    assert not columns.agrees_with(template, refused=[*chat_columns.REFUSED, json.dumps({"messages": QA}).encode()])


def test_other_templates_and_options_go_the_per_record_way():
    mistral = TEMPLATES["mistral"].sources[0]
    for source, eos in ((mistral, "</s>"), (TEMPLATES["gemma"].sources[0], "<eos>")):
        assert chat_columns.for_template(ChatTemplate(TemplateSpec("tokenizer", source, "<s>", eos)), False)
    # a Mistral template whose EOS is another token than the shape's: its probes differ, per record
    other_eos = ChatTemplate(TemplateSpec("tokenizer", mistral, "<s>", "<|im_end|>"))
    assert other_eos.has_fast_path and chat_columns.for_template(other_eos, False) is None
    variant = ChatTemplate(TemplateSpec("mine", CHATML.source.replace("{% endfor %}", "{%  endfor %}"), "",
                                        "<|im_end|>"))
    assert chat_columns.for_template(variant, False) is None  # Jinja's: no fast renderer
    assert chat_columns.for_template(ChatTemplate(CHATML, fast=False), False) is None  # --chat-render jinja


@requires_shared_data
@pytest.mark.parametrize("categories,template", [(False, "auto"), (True, "auto"), (True, "llama3")])
def test_tokenize_chat_is_byte_identical_column_wise_and_per_record(categories, template, tmp_path, monkeypatch):
    """Whole runs, 2 workers, hostile lines included; with categories (record, message, chitchat's ``topic``
    through --category-field), the category table and stream too; with the tokenizer's template and Llama 3's."""
    lines = _with_categories(_chitchat(1500)) if categories else _chitchat(1500)
    lines += [line for _, line, _, _ in [*HOSTILE, *STRIPPED] if line]
    corpus = tmp_path / "chat.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    options = {"category_field": "topic"} if categories else {}
    if template != "auto":
        options["chat_template"] = template
    for mode in ("auto", "records"):
        tokenize(corpus, tmp_path / mode, QWEN3, on_error="skip", workers=2, chat_render=mode, **options)
    assert_same_files(tmp_path / "auto", tmp_path / "records")
    if categories:
        assert (tmp_path / "auto" / "category_ids.bin").stat().st_size > 0


@requires_shared_data
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_segments_read_as_bytes_equal_segments_decoded(train_on, monkeypatch):
    """The column-wise segments go to gigatoken as the bytes they are in the rendered batch; an encoder whose bytes
    would not encode as their text gets them decoded: the same arrays, on every chitchat conversation and the
    hostile lines among real ones."""
    columns, _ = _pair(None, train_on=train_on, fmt=AUTO)
    decoded = _processor(None, train_on=train_on, fmt=AUTO)
    assert columns.encoder._bytes_as_text  # gigatoken encodes Qwen3's bytes as their text
    decoded.encoder.__dict__["_bytes_as_text"] = False
    calls = []
    encode = decoded.encoder.encode
    monkeypatch.setattr(decoded.encoder, "encode", lambda texts, **kw: calls.append(len(texts)) or encode(texts, **kw))
    good = _chitchat(40)
    batches = _batches(_chitchat())
    batches += [RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES) for _, line, *_ in HOSTILE]
    for batch in batches:
        _assert_same(columns(batch), decoded(batch), f"line {batch.lines[0]}")
    assert calls  # the decoded pieces went through encode



@requires_shared_data
@pytest.mark.parametrize("template", ["qwen3", "chatml", "llama3"])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_tool_turns_column_wise_equal_per_record(template, train_on, monkeypatch):
    """Runs of one to three tool turns put into real conversations (first, after an answer, last, between two
    answers): Qwen3 makes each run one user turn of <tool_response> blocks, ChatML and Llama 3 a turn each; all
    column-wise, and as per record."""
    lines = []
    for i, line in enumerate(_chitchat(2048)):
        record = json.loads(line)
        messages, run = record["messages"], [{"role": "tool", "content": f"result {k}"} for k in range(1 + i % 3)]
        at = (0, len(messages), 1, min(2, len(messages)))[i % 4]
        record["messages"] = messages[:at] + run + messages[at:]
        if i % 5 == 0:
            record["messages"].append({"role": "assistant", "content": "after the tools"})
        lines.append(json.dumps(record).encode())
    columns, records = _pair(SPECS[template], train_on=train_on)
    _assert_batches_same(columns, records, lines, template)


def _sharegpt(line: bytes, i: int) -> bytes:
    """A chitchat line as ShareGPT writes it: ``conversations`` of ``from``/``value`` (human/gpt, now and then
    user/assistant or another case), a message category on some, a ``weight`` (axolotl's, dropped) on others."""
    record = json.loads(line)
    names = {"user": ("human", "user", "Human"), "assistant": ("gpt", "assistant", "GPT")}
    turns = [{"from": names[m["role"]][(i + k) % 3], "value": m["content"], **({"weight": k % 2} if i % 4 == 1 else {})}
             for k, m in enumerate(record["messages"])]
    if i % 9 == 0 and turns:
        turns[-1]["category"] = "last"
    return json.dumps({"id": record["id"], "conversations": turns}).encode()


@requires_shared_data
@pytest.mark.parametrize("template", ["qwen3", "llama3.1", "mistral"])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_sharegpt_conversations_column_wise_equal_per_record(template, train_on, monkeypatch):
    """ShareGPT's ``conversations`` are read column-wise as ``messages`` are: every chitchat conversation so
    written, and lines that must go the per-record way among them (a batch with both fields goes whole)."""
    lines = [_sharegpt(line, i) for i, line in enumerate(_chitchat())]
    columns, records = _pair(SPECS[template], train_on=train_on)
    _assert_batches_same(columns, records, lines, template)
    good = lines[:40]
    odd = [("role and content keys", b'{"conversations": [{"role": "user", "content": "q"}, '
                                      b'{"role": "assistant", "content": "a"}]}', chat_columns.OTHER),  # (no from)
           ("messages too", json.dumps({"messages": QA, "conversations": []}).encode(), BATCH),
           ("null conversations", b'{"conversations": null}', chat_columns.OTHER),
           ("no field", b'{"id": "x"}', chat_columns.OTHER),
           ("null value", b'{"conversations": [{"from": "human", "value": null}, {"from": "gpt", "value": "a"}]}',
            chat_columns.OTHER)]
    for name, line, want in odd:
        batch = RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES)
        rendered, out = _rendered_run(columns, batch)
        got = BATCH if rendered is None else int(rendered.status[20])
        assert got == want, name
        _assert_same(out, records(batch), name)


@requires_shared_data
def test_a_warmed_processor_leaves_a_forked_worker_nothing_to_build_and_returns_narrow_ids():
    """What a process builds before forking its workers (``Processor.warm``) is all a chat batch needs: the
    column-wise path, the encoder's verdicts and the vocabulary's spelling; and ids come back in the narrowest
    type that holds the vocabulary (what crosses the pipe from a worker)."""
    processor = _processor(None)
    processor.warm()
    assert processor._columns is not None
    assert {"_bytes_as_text", "_spelling", "_bytes_verdict"} <= vars(processor.encoder).keys()
    out = processor(_batches(_chitchat(300))[0])
    assert out.tokens.dtype == np.int32 and out.tokens.max() >= 65_536  # Qwen3: 151,669 ids

    info = load_tokenizer_info(str(SHARED / "tokenizers/mistral"))
    text = Processor(info, choose_backend(info, "auto")[0], None,
                     Options(AUTO, "text", "assistant", None, None, None, info.eod_id, info.vocab_size))
    small = text(RawBatch(0, [b'{"text": "Four score and seven years ago"}'], [1], LINES))
    assert small.tokens.dtype == np.uint16 and len(small.tokens) > 5


@requires_shared_data
@pytest.mark.parametrize("template,train_on", [*((t, "assistant") for t in SPECS),
                                               ("qwen3", "all"), ("mistral", "all")])
def test_the_conversations_shape_column_wise_equals_per_record(template, train_on, monkeypatch):
    """Issue 29: the shape of the conversations (assistant first, blank answers, a trailing turn) is counted
    column-wise as the per-record path counts it, on chitchat reshaped so that every case occurs; and the counts are
    the obvious ones (``conversation_counts``) where no record is rejected for its template's sake."""
    records = shaped_conversations([json.loads(line) for line in _chitchat(1024)])
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    columns, records_way = _pair(SPECS[template], train_on=train_on)
    total = np.zeros(len(CONVERSATION_COUNTS), np.int64)
    for batch in _batches(lines, 512):
        rendered, out = _rendered_run(columns, batch)
        assert rendered is not None and (rendered.status == chat_columns.KEPT).sum() > 100
        _assert_same(out, records_way(batch), f"{template} lines {batch.lines[0]}..")
        total += out.conversations
    assert total[0] > 0
    if not columns.columns.shape.alternate:  # (those reject a conversation that begins with the assistant)
        assert total[2:].min() > 0
        if train_on == "assistant":
            assert dict(zip(CONVERSATION_COUNTS, total.tolist(), strict=True)) == conversation_counts(records)
