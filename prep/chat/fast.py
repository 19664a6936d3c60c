"""Chat templates rendered without Jinja: plain-Python renderers for the templates of the registry.

Rendering a long conversation in jinja2's sandbox costs milliseconds (every attribute access goes
through the sandbox); the common templates are a few string concatenations. A template is *recognised*
only by its exact source text (its sha256, in ``prep/chat/registry.py``, which pairs it with its renderer here):
no template code is ever executed here, so the fast path cannot do anything the template could not, and every
other template — a variant that differs by one character included — goes through the sandboxed Jinja path.

A renderer is a translation of one template, to be used only after it agreed with the template's
own Jinja rendering on ``PROBES`` (``prep/chat/templates.py`` checks that when it builds a ChatTemplate).
It takes the normalized messages (``xprep.prep.chat.messages.normalize_messages``) and returns the rendered
text as a list of parts, or None for what it does not cover — an empty conversation, tool calls, a
non-string ``reasoning_content`` — which the caller then renders with Jinja. ``raise_exception`` in a
template is ``RaisedByTemplate`` here, with the same message.

Given a ``slots`` list, a renderer also appends ``(message index, part index)`` for every assistant
message: the part that is its rendered content, where rendering the conversation with that content
replaced by a placeholder would change that part only (the template's glue does not depend on it), so
the span search needs no second rendering. Where that does not hold (Qwen3 moving reasoning out of a
content into a ``<think>`` block) the part index is -1 and the caller renders the placeholders.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# (messages, add_generation_prompt, bos, eos, slots) → the rendered text as a list of parts, or None (see above)
Renderer = Callable[[list, bool, str, str, "list | None"], "list[str] | None"]


class RaisedByTemplate(Exception):
    """What the template's own ``raise_exception(message)`` would raise, for the same conversation."""


ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."


def chatml(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    parts = []
    for i, m in enumerate(messages):
        parts += ("<|im_start|>", m["role"], "\n", m["content"], "<|im_end|>\n")
        if slots is not None and m["role"] == "assistant":
            slots.append((i, len(parts) - 2))
    if gen:
        parts.append("<|im_start|>assistant\n")
    return parts


LLAMA3_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n"  # Llama 3's generation prompt


def _llama3_turn(parts: list, i: int, m: dict, slots: list | None) -> None:
    """Append message i as Llama 3 lays it out: its role's header, the content trimmed, ``<|eot_id|>``."""
    parts += ("<|start_header_id|>", m["role"], "<|end_header_id|>\n\n", m["content"].strip(), "<|eot_id|>")
    if slots is not None and m["role"] == "assistant":
        slots.append((i, len(parts) - 2))


def llama3(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    """xprep's built-in ``llama3`` and Meta-Llama-3-Instruct's, which differ only without messages (the BOS token
    or nothing): such a conversation is Jinja's."""
    if not messages:
        return None
    parts = [bos]
    for i, m in enumerate(messages):
        _llama3_turn(parts, i, m, slots)
    if gen:
        parts.append(LLAMA3_PROMPT)
    return parts


# Llama 3.1 and 3.2 Instruct open every conversation with a system turn dated as their templates date it when no
# ``date_string`` is passed (3.2 asks ``strftime_now``, frozen to the same day: xprep.prep.chat.sandbox.TEMPLATE_DATE)
LLAMA31_SYSTEM = ("<|start_header_id|>system<|end_header_id|>\n\n"
                  "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")


def llama31(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    """Meta's Llama 3.1 / 3.2 Instruct templates without tools (xprep passes none): the first message, when a
    system one, goes into the dated system turn; a tool turn is an ``ipython`` one holding its content as JSON
    (a string is iterable to Jinja); an answer with ``tool_calls`` is left to Jinja."""
    if not messages:
        return None  # the template indexes messages[0]: Jinja's own error
    first = messages[0]["role"] == "system"
    parts = [bos, LLAMA31_SYSTEM, messages[0]["content"].strip() if first else "", "<|eot_id|>"]
    for i in range(int(first), len(messages)):
        m = messages[i]
        if "tool_calls" in m:
            return None
        if m["role"] == "tool":
            parts += ("<|start_header_id|>ipython<|end_header_id|>\n\n", json.dumps(m["content"], ensure_ascii=False),
                      "<|eot_id|>")
            continue
        _llama3_turn(parts, i, m, slots)
    if gen:
        parts.append(LLAMA3_PROMPT)
    return parts


def mistral(inst: str, answer_prefix: str, answer_suffix: str) -> Renderer:
    """Mistral/Mixtral-Instruct: ``[INST] q [/INST]a</s>``, strictly alternating user/assistant, no system role."""
    def render(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
        parts = [bos]
        for i, m in enumerate(messages):
            role = m["role"]
            if (role == "user") != (i % 2 == 0):
                raise RaisedByTemplate(ALTERNATE)
            if role == "user":
                parts += (inst, m["content"], " [/INST]")
            elif role == "assistant":
                parts += (answer_prefix, m["content"], eos, answer_suffix)
                if slots is not None:
                    slots.append((i, len(parts) - 3))
            else:
                raise RaisedByTemplate("Only user and assistant roles are supported!")
        return parts
    return render


def gemma(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    if not messages:
        return None  # the template indexes messages[0]: Jinja's own error
    if messages[0]["role"] == "system":
        raise RaisedByTemplate("System role not supported")
    parts = [bos]
    for i, m in enumerate(messages):
        role = m["role"]
        if (role == "user") != (i % 2 == 0):
            raise RaisedByTemplate(ALTERNATE)
        parts += ("<start_of_turn>", "model" if role == "assistant" else role, "\n", m["content"].strip(),
                  "<end_of_turn>\n")
        if slots is not None and role == "assistant":
            slots.append((i, len(parts) - 2))
    if gen:
        parts.append("<start_of_turn>model\n")
    return parts


def _is_query(m: dict) -> bool:
    """Qwen3: a user turn that is not just a tool response."""
    c = m["content"]
    return m["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))


def qwen3(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    """Qwen3's template without ``tools`` (xprep never passes them): reasoning kept after the last user query only."""
    if not messages:
        return None
    n = len(messages)
    last_query = next((i for i in range(n - 1, -1, -1) if _is_query(messages[i])), n - 1)
    parts = []
    if messages[0]["role"] == "system":
        parts += ("<|im_start|>system\n", messages[0]["content"], "<|im_end|>\n")
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and i > 0):
            parts += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")
        elif role == "assistant":
            if m.get("tool_calls"):
                return None  # rendered with tojson: left to Jinja
            reasoning = m.get("reasoning_content")
            # a placeholder content has no </think>: with one here, the glue may differ after the last query
            glue_fixed = True
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
                    glue_fixed = i <= last_query
            elif not isinstance(reasoning, str):
                return None
            if i > last_query and (i == n - 1 or reasoning):
                parts += ("<|im_start|>assistant\n<think>\n", reasoning.strip("\n"), "\n</think>\n\n",
                          content.lstrip("\n"))
            else:
                parts += ("<|im_start|>assistant\n", content)
            if slots is not None:
                slots.append((i, len(parts) - 1 if glue_fixed else -1))
            parts.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                parts.append("<|im_start|>user")
            parts += ("\n<tool_response>\n", content, "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                parts.append("<|im_end|>\n")
    if gen:
        parts.append("<|im_start|>assistant\n")
    return parts


def _conv(*turns: tuple[str, str], **extra) -> list[dict]:
    return [{"role": r, "content": c, **extra} for r, c in turns]


U, A, S, T = "user", "assistant", "system", "tool"
# Conversations on which a renderer must agree with the template's own Jinja rendering (and its spans):
# every branch of the templates above, and the content that trips up string-level shortcuts.
PROBES: list[list[dict]] = [
    _conv((U, "Hi there"), (A, "Hello!"), (U, "2+2?"), (A, "4")),
    _conv((S, "Be brief."), (U, "Hi"), (A, "Hello.")),
    _conv((S, "sys"), (U, "q"), (A, "a"), (S, "another system turn"), (U, "q2"), (A, "a2")),
    _conv((U, "q"), (A, "")),
    _conv((U, ""), (A, "  padded  \n"), (U, " \n"), (A, "\n\nleading newlines")),
    _conv((U, "q"), (A, "a1"), (A, "a2")),
    _conv((A, "I speak first."), (U, "ok")),
    _conv((U, "weather?"), (A, "checking"), (T, "sunny"), (T, "21C"), (A, "It is sunny.")),
    _conv((U, "q"), (A, "a"), (U, "<tool_response>r</tool_response>"), (A, "done")),
    _conv((T, "tool first"), (U, "q"), (A, "a")),
    _conv((U, "q1"), (A, "<think>\nr1\n</think>\n\na1"), (U, "q2"), (A, "<think>\nr2\n</think>\n\na2")),
    _conv((U, "q"), (A, "<think>\nthinking\n</think>\n\nanswer"), (A, "<think>r</think>x")),
    _conv((U, "q"), (A, "no open tag</think>\n\nanswer"), (T, "t"), (A, "</think>")),
    [{"role": U, "content": "q"}, {"role": A, "content": "a", "reasoning_content": "\nreasoned\n"},
     {"role": U, "content": "q2"}, {"role": A, "content": "b", "reasoning_content": ""}],
    [{"role": U, "content": "q"}, {"role": A, "content": "a", "reasoning_content": "why"}, {"role": A, "content": "b"}],
    [{"role": U, "content": "q"}, {"role": A, "content": "a", "tool_calls": [{"name": "f", "arguments": "{}"}]},
     {"role": T, "content": "r"}, {"role": A, "content": "b", "tool_calls": []}],
    _conv((U, "naïve café — 日本語 😀 \u00a0\u200b"), (A, "Ünïcödé façade 👨‍👩‍👧 ½ ℃")),
    _conv((U, "<|im_start|>assistant\nfake<|im_end|>"), (A, "<|im_end|></s><|eot_id|><end_of_turn>[INST] [/INST]")),
    _conv((U, "<|start_header_id|>user<|end_header_id|>\n\n"), (A, "<s><start_of_turn>model\n<think>\n\n</think>")),
    _conv((U, "\ue000 private use \ue001"), (A, "\ue0000\ue001")),
    _conv((U, "same"), (A, "same"), (U, "same"), (A, "same")),
    _conv((U, "q"), (A, "a"), (U, "end with a user turn")),
    _conv((U, "only a user")),
    _conv((S, "only a system")),
    _conv((S, " \n padded system\t"), (S, " second system "), (U, "q"), (A, "a")),
    _conv((S, ""), (A, "answer after an empty system turn")),
    _conv((U, "q"), (T, 'a "quoted" tool result\nover lines, é \\ 😀'), (A, "a")),
    _conv((U, "q"), (U, "q again"), (A, "a")),
    _conv((U, "{{ 7 * 7 }} {% raw %}"), (A, "{% endraw %} {# not a comment #}")),
    _conv((U, "q"), (A, "a"), extra_field="kept", category="cat"),
    _conv((U, "q"), (A, "x" * 5000)),
    _conv(*[(U if k % 2 == 0 else A, f"turn {k}") for k in range(40)]),
]
