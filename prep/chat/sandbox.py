"""The sandbox chat templates render in: jinja2's ``ImmutableSandboxedEnvironment``, with bounds of its own.

A tokenizer_config.json is untrusted input, so its template renders as transformers renders it, in the immutable
sandbox, and more bounded still: what a single operation may build (``MAX_RENDERED``, ``MAX_INT_BITS``), what a
namespace may keep across loop iterations (``MAX_KEPT_*``: the only way a value grows from one iteration to the
next), and how long one conversation may render (``RENDER_SECONDS``, ``Watchdog``). Templates that print
today's date see a frozen one (``TEMPLATE_DATE``), so that a dataset does not depend on the day it was built.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache

from xprep.prep.chat.messages import TemplateError, one_line
from xprep.prep.errors import XprepError

TEMPLATE_DATE = datetime(2024, 7, 26)  # what `strftime_now` renders: Llama 3.1's own default date_string
MAX_RENDERED = 1 << 26  # characters a single template operation may produce (untrusted templates)
# What an untrusted template may keep from one loop iteration to the next (in a namespace: the only place a value
# outlives its iteration) and how long it may render one conversation: without these, a template can loop for
# hours, fill the memory, or nest a tuple deep enough that hashing it overflows the C stack.
MAX_KEPT_ITEMS = 1 << 20  # elements, over every nested list, tuple and dict of a value kept in a namespace
MAX_KEPT_DEPTH = 64  # nesting of such a value
MAX_INT_BITS = 1 << 16  # an integer's size (a product or power beyond it is refused)
RENDER_SECONDS = 60.0  # one conversation's rendering (a real template takes milliseconds)


def _raise(message: str):
    raise TemplateError(one_line(str(message)))


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


class Overran(BaseException):
    """Raised inside a render that ran past its time (``Watchdog``); not an Exception, so nothing catches it."""


class Watchdog:
    """Stops a Jinja render that runs past its time (``RENDER_SECONDS`` as a rule; or at once: ``abort``), by
    raising ``Overran`` in its thread (CPython's ``PyThreadState_SetAsyncExc``: it lands between two bytecodes,
    which every Jinja loop runs). One daemon thread per process, started at the first render, that wakes twice a
    second."""

    def __init__(self):
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked worker gets no thread, and a fresh lock

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}  # thread id → when its render must stop
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, seconds: float):
        """The render in this thread meanwhile is stopped once it has run ``seconds``."""
        thread = threading.get_ident()
        with self._lock:
            self._deadlines[thread] = time.monotonic() + seconds
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
                    _async_raise(thread, Overran)


def _async_raise(thread: int, exception) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exception) if exception else None)


_WATCHDOG = Watchdog()


def watching(seconds: float):
    """Stop the Jinja render in this thread meanwhile once it has run ``seconds`` (raising ``Overran`` in it)."""
    return _WATCHDOG.watching(seconds)


def abort_renders() -> None:
    """Stop every Jinja render of this process now (see ``Watchdog``)."""
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


@lru_cache(maxsize=1)
def _sandbox_class():
    """jinja2's immutable sandbox, refusing what would exhaust memory, with its attribute verdicts memoized (they
    depend only on (type, name)). Built once: jinja2 (~70 ms to import) loads only when a template is compiled."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: see above

    class Sandbox(ImmutableSandboxedEnvironment):
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
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            key = (type(obj), attr)
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

    return Sandbox


def _check_binop(operator: str, left, right) -> None:
    """Refuse ``left operator right`` where it would build a value too large (``'x' * 10**9``, ``9 ** 10**6``)."""
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


def _environment():
    """A sandbox with the filters and globals templates expect (transformers' ``raise_exception``, ``tojson``
    and ``strftime_now``), every filter bounded (``_asking_little``) and ``namespace`` checked (``_check_kept``)."""
    from jinja2.ext import loopcontrols  # deferred: as _sandbox_class

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _asking_little(name, f) for name, f in env.filters.items()}  # called directly, not via call
    env.globals["raise_exception"] = _raise
    env.globals["namespace"] = _kept_namespace_class()
    # Templates that print today's date (Llama 3.x) would make datasets depend on the day they were
    # built, and renders of one conversation disagree across midnight: the date is frozen.
    env.globals["strftime_now"] = lambda fmt: TEMPLATE_DATE.strftime(fmt)
    return env


@lru_cache(maxsize=8)
def compile_template(source: str):
    """``source`` compiled in the sandbox; a template that does not compile is the command's error (XprepError)."""
    from jinja2 import TemplateSyntaxError  # deferred: as _sandbox_class

    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise XprepError(f"chat template: Jinja syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # constant folding at compile time runs the template's own arithmetic
        raise XprepError(f"chat template cannot be compiled: {type(e).__name__}: {e}") from None
