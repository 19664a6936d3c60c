"""Chat templates: render a conversation and find which characters are assistant targets.

Templates are Jinja, rendered in jinja2's ``ImmutableSandboxedEnvironment`` as transformers does
(a tokenizer_config.json is untrusted input). Target spans work for any template without
special tags: for assistant message ``i`` the span starts where the template's own rendering of
``messages[:i]`` with ``add_generation_prompt=True`` ends (the assistant header), and ends after
the message content plus the end-of-turn marker that follows it. The whole conversation is
rendered once, so the token stream is exactly what the template renders.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from prep.errors import XprepError

BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")
ROLES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    "human": "user", "prompter": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant",
    # ShareGPT dumps name the assistant after the product that answered
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "claude": "assistant", "gemini": "assistant",
    "function": "tool", "observation": "tool", "ipython": "tool", "developer": "system",
}
CANONICAL_ROLES = ("system", "user", "assistant", "tool")


TEMPLATE_DATE = datetime(2024, 7, 26)  # what `strftime_now` renders: Llama 3.1's own default date_string
MAX_RENDERED = 1 << 26  # characters a single template operation may produce (untrusted templates)


class TemplateError(ValueError):
    """A conversation the template cannot render or whose targets cannot be located.

    ``kind`` names the class of problem (what rejects are counted by), the message the instance.
    """

    def __init__(self, message: str, kind: str = "chat template failed"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TemplateSpec:
    """Picklable description of a template: what workers need to rebuild it."""

    name: str
    source: str
    bos_token: str
    eos_token: str | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256}


def resolve_template(choice: str, tokenizer_template: str | None, bos: str | None, eos: str | None
                     ) -> TemplateSpec:
    """``--chat-template auto|chatml|llama3|FILE`` → a TemplateSpec."""
    if choice == "auto":
        if not tokenizer_template:
            raise XprepError(
                "--chat-template auto: the tokenizer has no chat_template in tokenizer_config.json; "
                "pass --chat-template chatml, llama3 or a Jinja file"
            )
        return TemplateSpec("tokenizer", tokenizer_template, bos or "", eos)
    if choice in BUILTIN_TEMPLATES:
        return TemplateSpec(choice, BUILTIN_TEMPLATES[choice], bos or "", eos)
    path = Path(choice)
    if not path.is_file():
        raise XprepError(f"--chat-template {choice}: neither auto, chatml, llama3 nor an existing Jinja file")
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise XprepError(f"--chat-template {choice}: not UTF-8 text (byte {e.start})") from None
    return TemplateSpec(str(path), source, bos or "", eos)


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    # deferred: jinja2 (~70 ms to import) loads only when a chat template is compiled
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with its verdicts memoized: they depend only on (type, name)."""

        _verdicts: dict = {}
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            """Refuse string/list repetition or powers that would exhaust memory."""
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_RENDERED:
                        raise TemplateError("chat template builds a value too large to render")
            if operator == "**" and isinstance(right, int) and abs(right) > 1024:
                raise TemplateError("chat template raises a number to a huge power")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    # Templates that print today's date (Llama 3.x) would make datasets depend on the day they were
    # built, and renders of one conversation disagree across midnight: the date is frozen.
    env.globals["strftime_now"] = lambda fmt: TEMPLATE_DATE.strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise XprepError(f"chat template: Jinja syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # constant folding at compile time runs the template's own arithmetic
        raise XprepError(f"chat template cannot be compiled: {type(e).__name__}: {e}") from None


class ChatTemplate:
    """A compiled template that renders conversations and locates their assistant spans."""

    def __init__(self, spec: TemplateSpec):
        self.spec = spec
        self._template = _compile(spec.source)
        self._markers = tuple(dict.fromkeys(m for m in (spec.eos_token, *END_OF_TURN) if m))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.spec.bos_token, eos_token=self.spec.eos_token or "")
        except TemplateError:
            raise
        except Exception as e:  # an untrusted template may raise anything, jinja2's own errors included
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
        """Render the conversation; return (text, [(start, end, message index)]) for assistant turns.

        A span covers what the model must generate: the assistant content as rendered plus
        the end-of-turn marker right after it (and e.g. an empty think block the template adds).
        Two renders: the conversation, and the same with assistant contents replaced by
        placeholders, whose surroundings (the template's glue) locate each turn in linear time.
        Templates whose glue depends on the content fall back to rendering every prefix.
        """
        text = self.render(messages)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistants:
            return text, []
        spans = self._spans_by_placeholders(text, messages, assistants)
        if spans is None:
            spans = self._spans_by_prefixes(text, messages, assistants)
        return text, spans

    def end_of_turn(self) -> str | None:
        """The marker this template puts right after an assistant turn's content (e.g. ``<|eot_id|>``), if any."""
        probe = [{"role": "user", "content": "\ue000"}, {"role": "assistant", "content": "\ue001"}]
        try:
            text = self.render(probe)
        except TemplateError:
            return None
        _, found, after = text.partition("\ue001")
        after = after.lstrip(" \t\r\n")
        return next((m for m in self._markers if found and after.startswith(m)), None)

    @property
    def generation_prompt(self) -> str:
        """What ``add_generation_prompt`` appends after a user turn (e.g. the assistant header)."""
        if not hasattr(self, "_generation_prompt"):
            probe = [{"role": "user", "content": "\ue000"}]
            try:
                plain, prompted = self.render(probe), self.render(probe, add_generation_prompt=True)
            except TemplateError:
                plain, prompted = "", ""
            self._generation_prompt = prompted[len(plain):] if prompted.startswith(plain) else ""
        return self._generation_prompt

    def _spans_by_placeholders(self, text: str, messages: list[dict], assistants: list[int]
                               ) -> list[tuple[int, int, int]] | None:
        header = self.generation_prompt
        if not header:
            return None
        marks = [f"\ue000{k}\ue001" for k in range(len(assistants))]
        masked = [dict(m) for m in messages]
        for k, i in enumerate(assistants):
            masked[i]["content"] = marks[k]
        try:
            skeleton = self.render(masked)
        except TemplateError:
            return None
        glue, rest = [], skeleton
        for mark in marks:
            head, found, rest = rest.partition(mark)
            if not found or any(m in head for m in marks):
                return None
            glue.append(head)
        glue.append(rest)
        spans, cursor = [], 0
        for k, i in enumerate(assistants):
            if not text.startswith(glue[k], cursor) or header not in glue[k]:
                return None
            start = cursor + glue[k].rindex(header) + len(header)
            cursor += len(glue[k])
            content = messages[i]["content"]
            rendered = next((c for c in content_forms(content)
                             if text.startswith(c, cursor) and text.startswith(glue[k + 1], cursor + len(c))),
                            None)
            if rendered is None:
                return None
            cursor += len(rendered)
            spans.append((start, self._after_marker(text, cursor), i))
        if text[cursor:] != glue[-1]:
            return None
        return spans

    def _spans_by_prefixes(self, text: str, messages: list[dict], assistants: list[int]
                           ) -> list[tuple[int, int, int]]:
        spans: list[tuple[int, int, int]] = []
        cursor = 0
        for i in assistants:
            start = self._turn_start(text, messages[:i], cursor)
            end = self._turn_end(text, messages[i]["content"], start, i)
            spans.append((start, end, i))
            cursor = end
        return spans

    def _turn_start(self, text: str, before: list[dict], cursor: int) -> int:
        try:
            prompt = self.render(before, add_generation_prompt=True)
        except TemplateError:
            return cursor
        if text.startswith(prompt):
            return max(len(prompt), cursor)
        common = 0
        for a, b in zip(text, prompt, strict=False):
            if a != b:
                break
            common += 1
        return max(common, cursor)

    def _turn_end(self, text: str, content: str, start: int, index: int) -> int:
        """End of the turn whose content is the first occurrence (from ``start``) followed by a marker."""
        for candidate in content_forms(content):
            pos = text.find(candidate, start)
            while pos >= 0:
                end = self._after_marker(text, pos + len(candidate))
                if end > pos + len(candidate) or not candidate:
                    return end
                pos = text.find(candidate, pos + 1)
        raise TemplateError(f"assistant message {index}: its content does not appear in the rendered template",
                            "assistant turn not found")

    def _after_marker(self, text: str, end: int) -> int:
        rest = len(text) - len(text[end:].lstrip(" \t\r\n"))
        for marker in self._markers:
            if text.startswith(marker, end):
                return end + len(marker)
            if text.startswith(marker, rest):
                return rest + len(marker)
        return end


def content_forms(content: str) -> tuple[str, ...]:
    """How templates commonly render an assistant content: as is, trimmed, or without the
    reasoning before ``</think>`` (Qwen3 drops it from earlier turns)."""
    forms = [content, content.strip(), content.lstrip("\n")]
    if "</think>" in content:
        answer = content.split("</think>")[-1]
        forms += [answer.lstrip("\n"), answer.strip()]
    return tuple(dict.fromkeys(forms))


def _role_kind(role) -> str:
    """The reject kind of an unknown role: by name for short role names (few distinct), else one kind."""
    if isinstance(role, str) and len(role) <= 32 and role.isprintable():
        return f"unknown role {role!r}"
    return "unknown role"


def parse_role_map(spec: str | None) -> dict[str, str]:
    """``--role-map from=to,...`` → {from (lower case): canonical role}, checked."""
    if not spec:
        return {}
    out = {}
    for pair in spec.split(","):
        name, sep, role = (part.strip() for part in pair.partition("="))
        if not sep or not name or role.lower() not in CANONICAL_ROLES:
            raise XprepError(f"--role-map {spec}: {pair.strip()!r} is not FROM=TO with TO one of "
                             f"{', '.join(CANONICAL_ROLES)} (e.g. --role-map chatgpt=assistant,person=user)")
        out[name.lower()] = role.lower()
    return out


def json_type(value) -> str:
    """The JSON name of a parsed value's type, with its article: 'a string', 'an object', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list | tuple) else f"a {type(value).__name__}"


def normalize_messages(record: dict, role_map: dict[str, str] | None = None) -> list[dict]:
    """OpenAI ``messages`` or ShareGPT ``conversations`` → [{"role", "content", ...}], validated.

    Roles are matched case-insensitively against ``role_map`` (``--role-map``), then ``ROLES``.
    """
    key = "messages" if record.get("messages") is not None or "conversations" not in record else "conversations"
    raw = record.get(key)
    role_key, content_key = ("role", "content") if key == "messages" else ("from", "value")
    if raw is None:
        if key not in record:
            raise TemplateError("missing field 'messages' (or 'conversations')", "missing field")
        raise TemplateError(f"field {key!r} is null, expected a list of messages", "null field")
    if not isinstance(raw, list):
        raise TemplateError(f"field {key!r} is {json_type(raw)}, expected a list of messages", "bad type")
    if not raw:
        raise TemplateError(f"empty conversation: field {key!r} is an empty list", "empty conversation")
    roles = {**ROLES, **(role_map or {})}
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            raise TemplateError(f"message {j} is {json_type(m)}, not an object", "bad message")
        role = m.get(role_key, m.get("role"))
        content = m.get(content_key, m.get("content"))
        if not isinstance(role, str) or role.lower() not in roles:
            raise TemplateError(f"message {j}: unknown role {role!r} (known: {', '.join(sorted(roles))}; "
                                "map others with --role-map NAME=assistant|user|system|tool)",
                                _role_kind(role))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise TemplateError(f"message {j}: content must be a string, got {type(content).__name__}", "bad message")
        message = {"role": roles[role.lower()], "content": content}
        for extra in ("category", "tool_calls", "name", "reasoning_content", "tool_call_id"):
            if m.get(extra) is not None:  # table rows carry every column, null where absent
                message[extra] = m[extra]
        out.append(message)
    return out
