"""Chat: messages and roles, chat templates in a sandbox, the registry of templates xprep recognises (their
renderers that skip Jinja, their column-wise shapes), and which characters are assistant targets. Uses the
tokenizer stage.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.chat import columns
from xprep.prep.chat.messages import TemplateError, json_type, normalize_messages, parse_role_map
from xprep.prep.chat.registry import BUILTIN_TEMPLATES, TEMPLATES, KnownTemplate, register
from xprep.prep.chat.rendered import SHAPE_COUNTS, Rendered
from xprep.prep.chat.sandbox import abort_renders, render_watchdog_running
from xprep.prep.chat.templates import (
    CHAT_RENDERS,
    END_OF_TURN,
    ChatTemplate,
    TemplateSpec,
    adopt_verdicts,
    resolve_template,
    verdicts,
)

__all__ = [
    "BUILTIN_TEMPLATES", "CHAT_RENDERS", "ChatTemplate", "END_OF_TURN", "KnownTemplate", "Rendered", "SHAPE_COUNTS",
    "TEMPLATES", "TemplateError", "TemplateSpec", "abort_renders", "adopt_verdicts", "columns", "json_type",
    "normalize_messages", "parse_role_map", "register", "render_watchdog_running", "resolve_template", "verdicts"
]
