"""Chat templates: render a conversation and find which characters are assistant targets.

Templates are Jinja, rendered in the bounded sandbox of ``prep/chat/sandbox.py`` (a tokenizer_config.json is
untrusted input). Target spans work for any template without
special tags: for assistant message ``i`` the span starts where the template's own rendering of
``messages[:i]`` with ``add_generation_prompt=True`` ends (the assistant header), and ends after
the message content plus the end-of-turn marker that follows it. The whole conversation is
rendered once, so the token stream is exactly what the template renders.

Known templates (``prep/chat/registry.py``, recognised by their exact source) are rendered by plain
Python instead (``prep/chat/fast.py``), once it agreed with the sandboxed rendering on a built-in sample; their
renderers also say where each assistant content lies, which spares the placeholder rendering. The result is the
same text and spans, so everything below holds for both paths; ``ChatTemplate.path`` says which one runs.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from xprep.prep.chat import fast as chat_fast
from xprep.prep.chat.messages import TemplateError, one_line
from xprep.prep.chat.registry import BUILTIN_TEMPLATES, TEMPLATES, KnownTemplate, sha256
from xprep.prep.chat.sandbox import RENDER_SECONDS, Overran, compile_template, watching
from xprep.prep.errors import XprepError

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")
# --chat-render: which renderer runs (the output is the same): auto = the fastest that passed its checks (column-wise,
# then per record), records = the per-record renderer (fast where known, else Jinja), jinja = Jinja for everything
CHAT_RENDERS = ("auto", "records", "jinja")
_SPACES = re.compile(r"[ \t\r\n]*")  # what _after_marker skips before an end-of-turn marker
_MARKER = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z_][\w.-]*>")  # what ChatTemplate.markers takes for a marker


@dataclass(frozen=True)
class TemplateSpec:
    """Picklable description of a template: what workers need to rebuild it."""

    name: str
    source: str
    bos_token: str
    eos_token: str | None

    @property
    def sha256(self) -> str:
        return sha256(self.source)

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256}


def resolve_template(choice: str, tokenizer_template: str | None, bos: str | None, eos: str | None
                     ) -> TemplateSpec:
    """``--chat-template auto|NAME|FILE`` (NAME: a built-in template of the registry) → a TemplateSpec."""
    names = ", ".join(BUILTIN_TEMPLATES)
    if choice == "auto":
        if not tokenizer_template:
            raise XprepError(
                "--chat-template auto: the tokenizer has no chat_template in tokenizer_config.json; "
                f"pass --chat-template {names} or a Jinja file"
            )
        return TemplateSpec("tokenizer", tokenizer_template, bos or "", eos)
    if choice in BUILTIN_TEMPLATES:
        return TemplateSpec(choice, BUILTIN_TEMPLATES[choice], bos or "", eos)
    path = Path(choice)
    if not path.is_file():
        raise XprepError(f"--chat-template {choice}: neither auto, {names} nor an existing Jinja file")
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise XprepError(f"--chat-template {choice}: not UTF-8 text (byte {e.start})") from None
    return TemplateSpec(str(path), source, bos or "", eos)


class ChatTemplate:
    """A compiled template that renders conversations and locates their assistant spans.

    ``fast``: whether a template of the registry may render with its fast renderer (``--chat-render jinja``: no);
    ``render_seconds``: how long one conversation may render in Jinja before the run stops; ``verdicts``: the
    self-check verdicts to read and add to (this process's, unless given: see ``adopt_verdicts``). ``known`` is
    the registry entry whose fast renderer runs (None: Jinja renders every conversation).
    """

    def __init__(self, spec: TemplateSpec, fast: bool = True, render_seconds: float = RENDER_SECONDS,
                 verdicts: dict | None = None):
        self.spec = spec
        self.render_seconds = render_seconds
        self._compiled = None
        self._markers = tuple(dict.fromkeys(m for m in (spec.eos_token, *END_OF_TURN) if m))
        self._fast, self.known, self.path = None, None, ""
        self.known, self.path = _choose_renderer(self, fast, _VERDICTS if verdicts is None else verdicts)
        self._fast = self.known.renderer if self.known is not None else None
        if self._fast is None:
            self._jinja  # noqa: B018 - compiled now: a broken template fails here, not at its first conversation

    @property
    def _jinja(self):
        """The compiled template: where a fast renderer renders it, compiled only when a conversation needs
        Jinja (a worker given the self-check's verdict, ``adopt_verdicts``, may never compile it). A template
        the fast path knows is one of fixed sources that compile; any other is compiled by ``__init__``."""
        if self._compiled is None:
            self._compiled = compile_template(self.spec.source)
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        text = self._render_fast(messages, add_generation_prompt)
        return text if text is not None else self.render_jinja(messages, add_generation_prompt)

    def _render_fast(self, messages: list[dict], add_generation_prompt: bool, slots: list | None = None) -> str | None:
        """The fast renderer's text, or None where there is none or it leaves this conversation to Jinja.

        ``slots`` (a list) gets ``(message index, start, end)`` of each assistant content in the text, -1s where
        the template's glue depends on that content (see ``chat_fast``).
        """
        if self._fast is None or not messages:
            return None
        try:
            parts = self._fast(messages, add_generation_prompt, self.spec.bos_token, self.spec.eos_token or "", slots)
        except chat_fast.RaisedByTemplate as e:
            raise TemplateError(one_line(str(e))) from None
        except Exception:  # noqa: BLE001 - a renderer's own bug: Jinja's rendering is the truth
            parts = None
        if parts is None:
            if slots:
                slots.clear()
            return None
        if slots:
            ends = list(accumulate(map(len, parts)))
            slots[:] = [(i, ends[p] - len(parts[p]), ends[p]) if p >= 0 else (i, -1, -1) for i, p in slots]
        return "".join(parts)

    def render_jinja(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's own rendering, in the sandbox (what ``render`` equals, faster where it can)."""
        compiled = self._jinja  # (outside the try: a template that does not compile is no record's fault)
        try:
            with watching(self.render_seconds):
                return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.spec.bos_token, eos_token=self.spec.eos_token or "")
        except TemplateError:
            raise
        except Overran:  # the template's fault, not a record's: the run stops (a time limit is no per-record rule)
            raise XprepError(f"chat template {self.spec.name}: rendering one conversation took over "
                             f"{self.render_seconds:.0f} s (a loop without bound?), and was stopped") from None
        except Exception as e:  # an untrusted template may raise anything, jinja2's own errors included
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int, int]]]:
        """Render the conversation; return (text, [(start, end, message index)]) for assistant turns.

        A span covers what the model must generate: the assistant content as rendered plus
        the end-of-turn marker right after it (and e.g. an empty think block the template adds).
        Two renders: the conversation, and the same with assistant contents replaced by
        placeholders, whose surroundings (the template's glue) locate each turn in linear time.
        Templates whose glue depends on the content fall back to rendering every prefix.
        A fast renderer that says where each content lies saves the second render (``_spans_by_slots``).
        """
        slots: list = []
        text = self._render_fast(messages, False, slots)
        if text is None:
            text = self.render_jinja(messages)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistants:
            return text, []
        spans = self._spans_by_slots(text, messages, assistants, slots) if slots else None
        if spans is None:
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

    def markers(self) -> list[str]:
        """The special-looking strings (``<|im_start|>``, ``<start_of_turn>``, ``</s>``) this template writes around
        the contents of a probe conversation (a system turn, where the template takes one, then two exchanges)."""
        turns = [{"role": role, "content": "\ue000"} for role in ("user", "assistant", "user", "assistant")]
        for probe in ([{"role": "system", "content": "\ue000"}, *turns], turns):
            try:
                text = self.render(probe)
            except TemplateError:
                continue
            return list(dict.fromkeys(_MARKER.findall(text.replace("\ue000", " "))))
        return []

    @property
    def has_fast_path(self) -> bool:
        """Whether a fast renderer (checked against Jinja) renders this template."""
        return self._fast is not None

    def span_end(self, text: str, end: int) -> int:
        """Where an assistant span that ends its content at ``end`` in ``text`` ends: past the end-of-turn marker
        there (after whitespace), as ``render_with_spans`` places it."""
        return self._after_marker(text, end)

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
        masked = list(messages)
        for k, i in enumerate(assistants):
            masked[i] = {**messages[i], "content": marks[k]}
        try:
            skeleton = self.render(masked)
        except TemplateError:
            return None
        glue, rest = [], skeleton
        for mark in marks:
            head, found, rest = rest.partition(mark)
            if not found or ("\ue000" in head and any(m in head for m in marks)):
                return None
            glue.append(head)
        glue.append(rest)
        spans, cursor = [], 0
        for k, i in enumerate(assistants):
            at = glue[k].rfind(header)
            if at < 0 or not text.startswith(glue[k], cursor):
                return None
            start = cursor + at + len(header)
            cursor += len(glue[k])
            rendered = _rendered_form(text, messages[i]["content"], cursor, glue[k + 1])
            if rendered is None:
                return None
            cursor += len(rendered)
            spans.append((start, self._after_marker(text, cursor), i))
        if text[cursor:] != glue[-1]:
            return None
        return spans

    def _spans_by_slots(self, text: str, messages: list[dict], assistants: list[int], slots: list
                        ) -> list[tuple[int, int, int]] | None:
        """``_spans_by_placeholders`` without its second rendering, for a fast renderer's text whose assistant
        contents lie at ``slots``: the placeholder rendering would be this text with each slot replaced by its
        placeholder, so its glue is the text between slots. Same checks, same result; None where it would be."""
        header = self.generation_prompt
        if (not header or "\ue000" in text or [i for i, _, _ in slots] != assistants
                or any(a < 0 for _, a, _ in slots)):
            return None  # no placeholder could be told apart, or the glue depends on a content: the general way
        spans, cursor, prev = [], 0, 0
        for k, (i, a, b) in enumerate(slots):  # glue k is text[prev:a]; the placeholder search walks a cursor
            at = text.rfind(header, prev, a)
            if at < 0 or (cursor != prev and not text.startswith(text[prev:a], cursor)):
                return None
            start = cursor + (at - prev) + len(header)
            cursor += a - prev
            content = messages[i]["content"]
            if cursor == a and b - a == len(content) and text.startswith(content, a):
                cursor = b  # the content as is, followed by the next glue: _rendered_form's first choice
            else:
                after = text[b : slots[k + 1][1]] if k + 1 < len(slots) else text[b:]
                rendered = _rendered_form(text, content, cursor, after)
                if rendered is None:
                    return None
                cursor += len(rendered)
            spans.append((start, self._after_marker(text, cursor), i))
            prev = b
        if cursor != prev and text[cursor:] != text[prev:]:
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
        """Past the first marker found at ``end``, or after the whitespace there (markers in order); else ``end``."""
        rest = -1
        for marker in self._markers:
            if text.startswith(marker, end):
                return end + len(marker)
            if rest < 0:
                rest = _SPACES.match(text, end).end()
            if text.startswith(marker, rest):
                return rest + len(marker)
        return end


def _rendered_form(text: str, content: str, at: int, after: str) -> str | None:
    """The form of ``content`` (``content_forms``, in order) that ``text`` holds at ``at``, followed by ``after``."""
    if text.startswith(content, at) and text.startswith(after, at + len(content)):
        return content  # the first form, and the usual one
    return next((c for c in content_forms(content) if text.startswith(c, at) and text.startswith(after, at + len(c))),
                None)


_VERDICTS: dict[tuple[str, str, str | None], str | None] = {}  # (source sha256, bos, eos) → self-check problem


def verdicts() -> dict:
    """The self-check verdicts of this process so far (picklable): for ``adopt_verdicts`` in a worker."""
    return dict(_VERDICTS)


def adopt_verdicts(found: dict) -> None:
    """Take another process's self-check verdicts (the same code's, on the same templates) as this one's: a
    worker then neither checks nor compiles a template whose fast renderer passed."""
    _VERDICTS.update(found)


def _choose_renderer(template: ChatTemplate, fast: bool, found: dict) -> tuple[KnownTemplate | None, str]:
    """The registry entry whose fast renderer renders this template, if it has one that agrees with Jinja (and
    ``fast`` allows it); and which path runs, in words.

    The self-check renders ``chat_fast.PROBES`` and the entry's own probes both ways (with and without the
    generation prompt, and with spans) and must find every text, span and error identical; its verdict is kept in
    ``found`` (by source, BOS and EOS token), so that it runs once per process and template.
    """
    if not fast:
        return None, "Jinja (--chat-render jinja)"
    known = TEMPLATES.recognise(template.spec.source)
    if known is None:
        return None, "Jinja (not a template the fast path knows)"
    key = (template.spec.sha256, template.spec.bos_token, template.spec.eos_token)
    if key not in found:
        found[key] = _self_check(template, known)
    if found[key] is not None:
        return None, f"Jinja (fast path {known.name} failed its self-check: {found[key]})"
    return known, f"fast path {known.name} (checked against Jinja)"


def _self_check(template: ChatTemplate, known: KnownTemplate) -> str | None:
    """None when ``known``'s renderer renders every probe as the template's Jinja does, else the first difference."""
    fast, ref = copy.copy(template), copy.copy(template)
    fast._fast, ref._fast = known.renderer, None
    for k, probe in enumerate([*chat_fast.PROBES, *known.probes]):
        for what, method, args in (("text", "render", (probe,)),
                                   ("text with the generation prompt", "render", (probe, True)),
                                   ("spans", "render_with_spans", (probe,))):
            if _outcome(getattr(fast, method), args) != _outcome(getattr(ref, method), args):
                return f"probe {k}: the {what} differs"
    if fast.generation_prompt != ref.generation_prompt or fast.end_of_turn() != ref.end_of_turn():
        return "the generation prompt or end-of-turn marker differs"
    return None


def _outcome(method, args: tuple) -> tuple:
    """What a call gives: its value, or the template error it raises (message and kind)."""
    try:
        return "ok", method(*args)
    except TemplateError as e:
        return "error", str(e), e.kind


def content_forms(content: str) -> tuple[str, ...]:
    """How templates commonly render an assistant content: as is, trimmed, or without the
    reasoning before ``</think>`` (Qwen3 drops it from earlier turns)."""
    forms = [content, content.strip(), content.lstrip("\n")]
    if "</think>" in content:
        answer = content.split("</think>")[-1]
        forms += [answer.lstrip("\n"), answer.strip()]
    return tuple(dict.fromkeys(forms))

