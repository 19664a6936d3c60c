"""prep/chat/messages.py, sandbox.py and templates.py: message normalization, rendering in the sandbox, and assistant
target spans."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED, requires_shared_data
from prepkit import chat_records
from xprep.prep.chat.messages import TemplateError, normalize_messages
from xprep.prep.chat.templates import BUILTIN_TEMPLATES, ChatTemplate, TemplateSpec, resolve_template
from xprep.prep.errors import XprepError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def template(name: str, bos: str = "<s>", eos: str | None = "</s>") -> ChatTemplate:
    return ChatTemplate(resolve_template(name, None, bos, eos))


def span_texts(t: ChatTemplate, messages) -> list[str]:
    text, spans = t.render_with_spans(messages)
    assert [i for _, _, i in spans] == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [text[a:b] for a, b, _ in spans]


# -- normalize_messages ------------------------------------------------------------------------------------
def test_openai_messages_pass_through_with_extras():
    msgs = normalize_messages({"messages": [{"role": "User", "content": "a", "category": "math", "junk": 1},
                                            {"role": "assistant", "content": None}]})
    assert msgs == [{"role": "user", "content": "a", "category": "math"}, {"role": "assistant", "content": ""}]


def test_sharegpt_roles_are_mapped():
    conv = [{"from": f, "value": str(i)} for i, f in enumerate(["system", "human", "gpt", "function", "observation",
                                                                 "model", "bot"])]
    assert [m["role"] for m in normalize_messages({"conversations": conv})] == [
        "system", "user", "assistant", "tool", "tool", "assistant", "assistant"]
    assert [m["content"] for m in normalize_messages({"conversations": conv})] == [str(i) for i in range(7)]


@pytest.mark.parametrize("record, match", [
    ({"messages": []}, "empty conversation"),
    ({"messages": "hi"}, "field 'messages' is a string, expected a list of messages"),
    ({"conversations": {"a": 1}}, "field 'conversations' is an object, expected a list of messages"),
    ({"conversations": 42}, "field 'conversations' is a number, expected a list of messages"),
    ({"conversations": None}, "field 'conversations' is null, expected a list of messages"),
    ({"text": "x"}, r"missing field 'messages' \(or 'conversations'\)"),
    ({"messages": ["hi"]}, "message 0 is a string, not an object"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    ({"messages": [{"content": "x"}]}, "unknown role None"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "content must be a string, got list"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
])
def test_bad_conversations(record, match):
    with pytest.raises(TemplateError, match=match):
        normalize_messages(record)


# -- resolve_template ----------------------------------------------------------------------------------------
def test_resolve_template_choices(tmp_path):
    assert resolve_template("auto", "{{ 1 }}", None, None).name == "tokenizer"
    assert resolve_template("chatml", None, None, None).source == BUILTIN_TEMPLATES["chatml"]
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    spec = resolve_template(str(f), None, None, None)
    assert spec.source == "{{ messages[0].content }}" and spec.describe()["sha256"] == spec.sha256
    with pytest.raises(XprepError, match="no chat_template in tokenizer_config.json"):
        resolve_template("auto", None, None, None)
    with pytest.raises(XprepError, match="neither auto, chatml, llama3 nor an existing Jinja file"):
        resolve_template(str(tmp_path / "nope.jinja"), None, None, None)


def test_jinja_syntax_error_is_a_user_error():
    with pytest.raises(XprepError, match="Jinja syntax error at line 1"):
        ChatTemplate(TemplateSpec("bad", "{% for %}", "", None))


# -- rendering -----------------------------------------------------------------------------------------------
def test_chatml_render_and_spans():
    t = template("chatml")
    text, spans = t.render_with_spans(CONVERSATION)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n")
    assert [text[a:b] for a, b, _ in spans] == ["Hello!<|im_end|>", "4<|im_end|>"]
    assert t.generation_prompt == "<|im_start|>assistant\n"


def test_llama3_render_trims_and_spans_include_eot():
    t = template("llama3", bos="<|begin_of_text|>")
    msgs = [{"role": "user", "content": " hi \n"}, {"role": "assistant", "content": "  yes\n\n"}]
    text = t.render(msgs)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nyes<|eot_id|>")
    assert span_texts(t, msgs) == ["yes<|eot_id|>"]


def test_no_assistant_means_no_spans():
    text, spans = template("chatml").render_with_spans([{"role": "user", "content": "x"}])
    assert spans == [] and text.endswith("<|im_end|>\n")


def test_placeholder_spans_equal_prefix_spans():
    for t in (template("chatml"), template("llama3")):
        for rec in chat_records(12):
            msgs = rec["messages"]
            text = t.render(msgs)
            assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            fast = t._spans_by_placeholders(text, msgs, assistants)
            assert fast is not None
            assert fast == t._spans_by_prefixes(text, msgs, assistants)


def test_content_dependent_glue_falls_back_to_prefixes():
    # The header depends on the content, so the placeholder skeleton does not match the real render.
    source = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content|length > 3 %}[long]{% endif %}"
              "{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    t = ChatTemplate(TemplateSpec("glue", source, "", "</s>"))
    msgs = [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "ok"}, {"role": "assistant", "content": "yo"}]
    text = t.render(msgs)
    assert t._spans_by_placeholders(text, msgs, [1, 3]) is None
    # The turn starts after the generation prompt, so the content-dependent "[long]" is a target.
    assert span_texts(t, msgs) == ["[long]hello world</s>", "yo</s>"]


def test_same_content_twice_gets_two_different_spans():
    msgs = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]
    text, spans = template("chatml").render_with_spans(msgs)
    assert len({(a, b) for a, b, _ in spans}) == 2
    assert all(text[a:b] == "ok<|im_end|>" for a, b, _ in spans)


def test_empty_assistant_content_is_just_the_end_marker():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]
    assert span_texts(template("chatml"), msgs) == ["<|im_end|>"]


def test_template_raise_exception_is_a_template_error():
    t = ChatTemplate(TemplateSpec("r", "{{ raise_exception('roles must alternate') }}", "", None))
    with pytest.raises(TemplateError, match="roles must alternate"):
        t.render(CONVERSATION)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages.pop() }}",
])
def test_templates_run_in_the_immutable_sandbox(source):
    t = ChatTemplate(TemplateSpec("evil", source, "", None))
    with pytest.raises(TemplateError, match="chat template failed"):
        t.render([{"role": "user", "content": "x"}])


HUGE = 3 * 2**26  # beyond MAX_RENDERED
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("source, match", [
    # values a namespace carries from one loop iteration to the next: the only way they grow without bound
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "too large"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "too large"),
    ("{% set ns = namespace(t=()) %}{% for i in range(100000) %}{% set ns.t = (ns.t,) %}{% endfor %}{{ {ns.t: 1} }}",
     "nests a value more than 64 levels deep"),  # hashing it would overflow the C stack: a segfault
    ("{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = [ns.l] %}{% endfor %}", "levels deep"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(50) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}",
     "too large"),  # 2^50 elements, by reference
    ("{% set ns = namespace(n=10**30) %}{% for i in range(30) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "number too large"),
    (f"{{{{ '%{HUGE}s'|format(messages[0].content) }}}}", "asks for a value too large"),
    ("{{ (2**1000)**1000 }}", "huge power"),
    # one call asked for a huge width, indent, count or growth
    (f"{{{{ messages[0].content.ljust({HUGE}) }}}}", "asks for a value too large"),
    (f"{{{{ messages[0].content|center({HUGE}) }}}}", "asks for a value too large"),
    (f"{{{{ messages|tojson(indent={HUGE}) }}}}", "asks for a value too large"),
    (f"{{{{ messages|batch({HUGE}, 0)|list }}}}", "asks for a value too large"),
    (f"{{{{ '{{:>{HUGE}}}'.format(messages[0].content) }}}}", "asks for a value too large"),
    (f"{{{{ '%{HUGE}s' % messages[0].content }}}}", "asks for a value too large"),
    ("{{ ('x' * 60000000)|replace('x', 'xxxx') }}", "too large"),
    ("{{ ('x' * 60000000).replace('x', 'xxxx') }}", "too large"),
    ("{{ (['x'] * 60000000)|join('ab') }}", "too large"),
])
def test_a_template_cannot_build_values_without_bound(source, match):
    """What would fill the memory (or crash the interpreter) is refused as the template builds it; the records
    are then rejected as the template's failures."""
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(TemplateSpec("hostile", source, "", None)).render([{"role": "user", "content": "x"}])


def test_values_real_templates_keep_are_untouched():
    source = ("{% set ns = namespace(n=0, s='', l=[]) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{% set ns.s = ns.s ~ m.content %}{% set ns.l = ns.l + [m.role] %}{% endfor %}"
              "{{ ns.n }} {{ ns.s }} {{ ns.l|join(',') }} {{ '%5s|%-3d' % ('a', 7) }} {{ '{:>4}'.format('b') }}"
              " {{ 1234567890123 }} {{ 'x'.ljust(3) }}|{{ messages|tojson(indent=2)|length > 0 }}"
              "{% set ns.t = namespace(ts=1700000000123) %} {{ ns.t.ts|default(9999999999) }}")
    t = ChatTemplate(TemplateSpec("kept", source, "", None))
    assert t.render(CONVERSATION[:2]) == (
        "2 Be brief.Hi there system,user     a|7      b 1234567890123 x  |True 1700000000123")


def test_a_render_that_runs_too_long_stops_the_run():
    """A template that loops without bound (nested ranges: 10^10 steps) is stopped after its ``render_seconds``
    (RENDER_SECONDS, as a rule), as an error of the template's (the command stops), not of the record; renders after
    it are unaffected."""
    import time

    t = ChatTemplate(TemplateSpec("spin", NESTED_LOOPS + "{{ messages[0].content }}", "", None), render_seconds=0.5)
    started = time.monotonic()
    with pytest.raises(XprepError, match=r"chat template spin: rendering one conversation took over 0 s"):
        t.render([{"role": "user", "content": "x"}])
    assert time.monotonic() - started < 10
    ok = template("chatml")
    for _ in range(2000):  # long enough for a stray stop to land, had one been left pending
        ok.render(CONVERSATION)


def test_a_template_error_message_is_one_line():
    t = ChatTemplate(TemplateSpec("r", "{{ raise_exception('first\nsecond ' ~ messages[0].content) }}", "", None))
    with pytest.raises(TemplateError) as e:
        t.render([{"role": "user", "content": "a\r\nb"}])
    assert str(e.value) == "first\\nsecond a\\r\\nb" and "\n" not in str(e.value)


def test_tojson_and_loop_controls_are_available():
    source = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
              "{{ m | tojson }}{% endfor %}")
    t = ChatTemplate(TemplateSpec("j", source, "", None))
    assert t.render([{"role": "system", "content": "s"}, {"role": "user", "content": "é"}]) == (
        '{"role": "user", "content": "é"}')


# -- the real Qwen3 template ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3():
    if not SHARED.is_dir():
        pytest.skip(f"real test data not found at {SHARED}")
    config = json.loads((SHARED / "tokenizers/qwen3/tokenizer_config.json").read_text())
    return ChatTemplate(resolve_template("auto", config["chat_template"], None, config["eos_token"]))


@requires_shared_data
def test_qwen3_last_assistant_turn_gets_the_empty_think_block(qwen3):
    assert qwen3.generation_prompt == "<|im_start|>assistant\n"
    assert span_texts(qwen3, CONVERSATION) == ["Hello!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]


@requires_shared_data
def test_qwen3_assistant_turns_after_the_last_user(qwen3):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "assistant", "content": "a2"}]
    assert span_texts(qwen3, msgs) == ["a1<|im_end|>", "<think>\n\n</think>\n\na2<|im_end|>"]
    # A conversation ending with a user turn: no think block anywhere.
    msgs = CONVERSATION[:3] + [{"role": "user", "content": "bye"}]
    assert span_texts(qwen3, msgs) == ["Hello!<|im_end|>"]


@requires_shared_data
def test_qwen3_tool_turns(qwen3):
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "checking"},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    text, spans = qwen3.render_with_spans(msgs)
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    # Both assistant turns follow the last real user query; only the last one gets the think block.
    assert [text[a:b] for a, b, _ in spans] == ["checking<|im_end|>", "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"]


@requires_shared_data
def test_qwen3_reasoning_in_earlier_turns_is_dropped_by_the_template(qwen3):
    """Qwen3 keeps the reasoning of the final turn only; targets are what the template renders."""
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"}]
    text = qwen3.render(msgs)
    assert "r1" not in text and "<think>\nr2\n</think>\n\na2<|im_end|>" in text
    assert span_texts(qwen3, msgs) == ["a1<|im_end|>", "<think>\nr2\n</think>\n\na2<|im_end|>"]


@requires_shared_data
def test_qwen3_spans_on_real_conversations_match_prefix_method(qwen3):
    lines = (SHARED / "chat/chitchat.jsonl").read_text().splitlines()[:60]
    checked = 0
    for line in lines:
        msgs = normalize_messages(json.loads(line))
        assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not assistants:
            continue
        text = qwen3.render(msgs)
        fast = qwen3._spans_by_placeholders(text, msgs, assistants)
        assert fast is not None and fast == qwen3._spans_by_prefixes(text, msgs, assistants)
        checked += 1
    assert checked > 20
