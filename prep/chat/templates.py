"""Chat templates: render a conversation and find which characters are assistant targets.

Templates are Jinja, rendered in jinja2's ``ImmutableSandboxedEnvironment`` as transformers does
(a tokenizer_config.json is untrusted input), with bounds of its own: what a single operation may build
(``MAX_RENDERED``, ``MAX_INT_BITS``), what a namespace may keep across loop iterations (``MAX_KEPT_*``: the
only way a value grows from one iteration to the next), and how long one conversation may render
(``RENDER_SECONDS``, ``_Watchdog``). Target spans work for any template without
special tags: for assistant message ``i`` the span starts where the template's own rendering of
``messages[:i]`` with ``add_generation_prompt=True`` ends (the assistant header), and ends after
the message content plus the end-of-turn marker that follows it. The whole conversation is
rendered once, so the token stream is exactly what the template renders.

Known templates (``prep/chat/fast.py``, recognised by their exact source) are rendered by plain
Python instead, once it agreed with the sandboxed rendering on a built-in sample; their renderers also
say where each assistant content lies, which spares the placeholder rendering. The result is the same
text and spans, so everything below holds for both paths; ``ChatTemplate.path`` says which one runs.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

from xprep.prep.chat import fast as chat_fast
from xprep.prep.errors import XprepError

BUILTIN_TEMPLATES = {  # defined beside their fast renderers (prep/chat/fast.py)
    "chatml": chat_fast.CHATML_XPREP,
    "llama3": chat_fast.LLAMA3_XPREP,
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
MESSAGE_EXTRAS = ("category", "tool_calls", "name", "reasoning_content", "tool_call_id")  # kept by normalize_messages


RENDER_ENV = "XPREP_CHAT_RENDER"  # "jinja" forces the general path (what bench/tokenize.py compares against)
TEMPLATE_DATE = datetime(2024, 7, 26)  # what `strftime_now` renders: Llama 3.1's own default date_string
_SPACES = re.compile(r"[ \t\r\n]*")  # what _after_marker skips before an end-of-turn marker
_MARKER = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z_][\w.-]*>")  # what ChatTemplate.markers takes for a marker
MAX_RENDERED = 1 << 26  # characters a single template operation may produce (untrusted templates)
# What an untrusted template may keep from one loop iteration to the next (in a namespace: the only place a value
# outlives its iteration) and how long it may render one conversation: without these, a template can loop for
# hours, fill the memory, or nest a tuple deep enough that hashing it overflows the C stack.
MAX_KEPT_ITEMS = 1 << 20  # elements, over every nested list, tuple and dict of a value kept in a namespace
MAX_KEPT_DEPTH = 64  # nesting of such a value
MAX_INT_BITS = 1 << 16  # an integer's size (a product or power beyond it is refused)
RENDER_SECONDS = 60.0  # one conversation's rendering (a real template takes milliseconds)


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
    raise TemplateError(one_line(str(message)))


def one_line(message: str, limit: int = 500) -> str:
    """A template's own error message as one line of the console and of rejects.jsonl: newlines escaped, cut."""
    flat = message.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return flat if len(flat) <= limit else flat[:limit] + "…"


def _check_kept(value) -> None:
    """Refuse a value a template keeps in a namespace that is too large or nested too deep (``MAX_KEPT_*``)."""
    if isinstance(value, str) and len(value) > MAX_RENDERED:
        raise TemplateError("chat template builds a value too large to render")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateError("chat template builds a number too large to render")
    level, items = [value], 0
    for _ in range(MAX_KEPT_DEPTH + 1):  # breadth first, level by level: never recursive
        level = [child for v in level if isinstance(v, list | tuple | dict)
                 for child in ([*v.keys(), *v.values()] if isinstance(v, dict) else v)]
        items += len(level)
        if not level:
            return
        if items > MAX_KEPT_ITEMS:
            raise TemplateError("chat template builds a value too large to render")
    raise TemplateError(f"chat template nests a value more than {MAX_KEPT_DEPTH} levels deep")


class _Overran(BaseException):
    """Raised inside a render that ran past its time (``_Watchdog``); not an Exception, so nothing catches it."""


class _Watchdog:
    """Stops a Jinja render that runs past ``RENDER_SECONDS`` (or at once: ``abort``), by raising ``_Overran`` in
    its thread (CPython's ``PyThreadState_SetAsyncExc``: it lands between two bytecodes, which every Jinja loop
    runs). One daemon thread per process, started at the first render, that wakes twice a second."""

    def __init__(self):
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked worker gets no thread, and a fresh lock

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}  # thread id → when its render must stop
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self):
        thread = threading.get_ident()
        with self._lock:
            self._deadlines[thread] = time.monotonic() + RENDER_SECONDS
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="xprep-render-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._deadlines[thread]
                if thread in self._fired:  # fired as the render ended: not to land in the code after it
                    self._fired.discard(thread)
                    _async_raise(thread, None)

    def abort(self) -> None:
        """Stop every render now (the command is interrupted: its threads must not keep it waiting)."""
        self._fire(float("inf"))

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            self._fire(time.monotonic())

    def _fire(self, now: float) -> None:
        """Stop the renders due by ``now``."""
        with self._lock:
            for thread, deadline in self._deadlines.items():
                if thread not in self._fired and deadline < now:
                    self._fired.add(thread)
                    _async_raise(thread, _Overran)


def _async_raise(thread: int, exception) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exception) if exception else None)


_WATCHDOG = _Watchdog()


def abort_renders() -> None:
    """Stop every Jinja render of this process now (see ``_Watchdog``)."""
    _WATCHDOG.abort()


def render_watchdog_running() -> bool:
    """Whether this process runs the render watchdog's thread: one that holds no lock a forked child could
    inherit (its own is made anew in the child), so a process may still fork its workers beside it."""
    thread = _WATCHDOG._thread
    return thread is not None and thread.is_alive()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# the widths and precisions of printf-style and str.format fields: '%999999999s', '{:>999999999}'
_FORMAT_NUMBERS = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


def _check_asked(args, kwargs) -> None:
    """Refuse integers beyond ``MAX_RENDERED`` among a call's arguments: the width, indent or count it would
    allocate (``'x'.ljust(10**9)``, ``center(10**9)``)."""
    if any(_int(v) and abs(v) > MAX_RENDERED for v in (*args, *kwargs.values())):
        raise TemplateError("chat template asks for a value too large to render")


SIZING_FILTERS = ("center", "indent", "batch", "slice", "truncate", "wordwrap", "tojson")  # widths, counts


def _asking_little(name: str, fn):
    """A filter that refuses to be asked for a value too large: a width or count beyond ``MAX_RENDERED`` (the
    ``SIZING_FILTERS``: ``center(10**9)``, ``tojson(indent=10**9)``), a ``format`` string with such a field, a
    ``replace`` or ``join`` whose result would pass it. The value filtered comes after the context or environment
    jinja2 passes some filters first."""
    from jinja2.utils import _PassArg  # deferred: jinja2 loads only when a chat template is compiled

    at = 0 if _PassArg.from_obj(fn) is None else 1

    @functools.wraps(fn)  # (its jinja_pass_arg mark included)
    def run(*args, **kwargs):
        if name in SIZING_FILTERS:
            _check_asked(args[at + 1 :], kwargs)
        elif name == "format" and isinstance(args[at], str):
            _check_format(args[at])
        elif name in ("replace", "join"):
            _check_grows(name, args[at], args[at + 1 :])
        return fn(*args, **kwargs)

    return run


def _check_grows(name: str, value, args) -> None:
    """Refuse ``replace(old, new)`` or ``join(sep)`` whose result would be longer than ``MAX_RENDERED``."""
    if name == "replace" and isinstance(value, str) and len(args) >= 2 and isinstance(args[1], str):
        old, new = str(args[0]), args[1]
        grown = len(value) + (len(value) // max(len(old), 1) + 1) * max(len(new) - len(old), 0)
    elif name == "join" and isinstance(value, list | tuple) and args and isinstance(args[0], str):
        grown = len(args[0]) * len(value) + sum(len(v) for v in value if isinstance(v, str))
    else:
        return
    if grown > MAX_RENDERED:
        raise TemplateError("chat template builds a value too large to render")


def _check_format(fmt: str) -> None:
    """Refuse a format string whose field widths or precisions go beyond ``MAX_RENDERED``."""
    if "%" in fmt or "{" in fmt:
        for match in _FORMAT_NUMBERS.finditer(fmt):
            if any(n and int(n) > MAX_RENDERED for n in match.groups()):
                raise TemplateError("chat template asks for a value too large to render")


def _kept_namespace_class():
    from jinja2.utils import Namespace  # deferred: jinja2 loads only when a chat template is compiled

    class KeptNamespace(Namespace):
        """Jinja's ``namespace()``, whose values are checked as they are set (``_check_kept``)."""

        def __init__(*args, **kwargs):
            for value in [*(args[1].values() if len(args) > 1 and isinstance(args[1], dict) else ()),
                          *kwargs.values()]:
                _check_kept(value)
            Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            _check_kept(value)
            Namespace.__setitem__(self, name, value)

    return KeptNamespace


@lru_cache(maxsize=8)
def _compile(source: str):
    # deferred: jinja2 (~70 ms to import) loads only when a chat template is compiled
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with its verdicts memoized: they depend only on (type, name)."""

        _verdicts: dict = {}
        intercepted_binops = frozenset({"*", "**", "%"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
            """Refuse a string method asked for a value too large (``'x'.ljust(10**9)``,
            ``s.replace('x', 'x' * 1000)``); other calls take what they are given (a record's own numbers)."""
            method, owner = getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                _check_asked(args, kwargs)
                if method == "replace":
                    _check_grows("replace", owner, args)
                elif method == "join" and args:  # sep.join(items): the filter's items|join(sep)
                    _check_grows("join", args[0], [owner])
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            """Refuse ``str.format`` with too wide a field (``'{:>999999999}'.format(x)``), as it is looked up."""
            if getattr(value, "__name__", "") in ("format", "format_map") and isinstance(
                    getattr(value, "__self__", None), str):
                _check_format(value.__self__)
            return super().wrap_str_format(value)

        def call_binop(self, context, operator, left, right):
            """Refuse string/list repetition, products or powers that would exhaust memory."""
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_RENDERED:
                        raise TemplateError("chat template builds a value too large to render")
                if _int(left) and _int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateError("chat template builds a number too large to render")
            if operator == "**" and _int(right) and (abs(right) > 1024 or _int(left) and
                                                     left.bit_length() * abs(right) > MAX_INT_BITS):
                raise TemplateError("chat template raises a number to a huge power")
            if operator == "%" and isinstance(left, str):
                _check_format(left)
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _asking_little(name, f) for name, f in env.filters.items()}  # called directly, not via call
    env.globals["raise_exception"] = _raise
    env.globals["namespace"] = _kept_namespace_class()
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
        self._compiled = None
        self._markers = tuple(dict.fromkeys(m for m in (spec.eos_token, *END_OF_TURN) if m))
        self._fast, self.path = None, ""
        self._fast, self.path = _choose_renderer(self)
        if self._fast is None:
            self._jinja  # noqa: B018 - compiled now: a broken template fails here, not at its first conversation

    @property
    def _jinja(self):
        """The compiled template: where a fast renderer renders it, compiled only when a conversation needs
        Jinja (a worker given the self-check's verdict, ``adopt_verdicts``, may never compile it). A template
        the fast path knows is one of fixed sources that compile; any other is compiled by ``__init__``."""
        if self._compiled is None:
            self._compiled = _compile(self.spec.source)
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
            with _WATCHDOG.watching():
                return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=self.spec.bos_token, eos_token=self.spec.eos_token or "")
        except TemplateError:
            raise
        except _Overran:  # the template's fault, not a record's: the run stops (a time limit is no per-record rule)
            raise XprepError(f"chat template {self.spec.name}: rendering one conversation took over "
                             f"{RENDER_SECONDS:.0f} s (a loop without bound?), and was stopped") from None
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


def _choose_renderer(template: ChatTemplate) -> tuple[chat_fast.Renderer | None, str]:
    """The fast renderer for this template, if it has one that agrees with Jinja; and which path runs, in words.

    The self-check renders ``chat_fast.PROBES`` both ways (with and without the generation prompt, and with
    spans) and must find every text, span and error identical; it runs once per process and template.
    """
    if os.environ.get(RENDER_ENV, "").lower() == "jinja":
        return None, f"Jinja ({RENDER_ENV}=jinja)"
    known = chat_fast.recognise(template.spec.source)
    if known is None:
        return None, "Jinja (not a template the fast path knows)"
    name, renderer = known
    key = (template.spec.sha256, template.spec.bos_token, template.spec.eos_token)
    if key not in _VERDICTS:
        _VERDICTS[key] = _self_check(template, renderer)
    if _VERDICTS[key] is not None:
        return None, f"Jinja (fast path {name} failed its self-check: {_VERDICTS[key]})"
    return renderer, f"fast path {name} (checked against Jinja)"


def _self_check(template: ChatTemplate, renderer: chat_fast.Renderer) -> str | None:
    """None when ``renderer`` renders every probe as the template's Jinja does, else the first difference."""
    fast, ref = copy.copy(template), copy.copy(template)
    fast._fast, ref._fast = renderer, None
    for k, probe in enumerate(chat_fast.PROBES):
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
    roles = {**ROLES, **role_map} if role_map else ROLES
    out = []
    for j, m in enumerate(raw):
        if type(m) is dict and len(m) == 2:  # the usual message: a role and a content, both strings
            role, content = m.get(role_key), m.get(content_key)
            if type(role) is str and type(content) is str:
                canonical = roles.get(role) or roles.get(role.lower())
                if canonical is not None:
                    out.append({"role": canonical, "content": content})
                    continue
        if not isinstance(m, dict):
            raise TemplateError(f"message {j} is {json_type(m)}, not an object", "bad message")
        role = m[role_key] if role_key in m else m.get("role")
        content = m[content_key] if content_key in m else m.get("content")
        canonical = roles.get(role.lower()) if isinstance(role, str) else None
        if canonical is None:
            raise TemplateError(f"message {j}: unknown role {role!r} (known: {', '.join(sorted(roles))}; "
                                "map others with --role-map NAME=assistant|user|system|tool)",
                                _role_kind(role))
        if content is None:
            content = ""
        elif not isinstance(content, str):
            raise TemplateError(f"message {j}: content must be a string, got {type(content).__name__}", "bad message")
        message = {"role": canonical, "content": content}
        if len(m) > 2:  # a message of just a role and a content has no extra
            for extra in MESSAGE_EXTRAS:
                if m.get(extra) is not None:  # table rows carry every column, null where absent
                    message[extra] = m[extra]
        out.append(message)
    return out
