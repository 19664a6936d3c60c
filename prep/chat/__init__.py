"""Chat: messages and roles, chat templates in a sandbox, the renderers that skip Jinja for known templates and the
column-wise path, and which characters are assistant targets. Uses the tokenizer stage.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.chat import columns
from xprep.prep.chat.templates import (
    BUILTIN_TEMPLATES,
    END_OF_TURN,
    RENDER_ENV,
    ChatTemplate,
    TemplateError,
    TemplateSpec,
    abort_renders,
    adopt_verdicts,
    json_type,
    normalize_messages,
    parse_role_map,
    render_watchdog_running,
    resolve_template,
    verdicts,
)

__all__ = [
    "BUILTIN_TEMPLATES", "ChatTemplate", "END_OF_TURN", "RENDER_ENV", "TemplateError", "TemplateSpec", "abort_renders",
    "adopt_verdicts", "columns", "json_type", "normalize_messages", "parse_role_map", "render_watchdog_running",
    "resolve_template", "verdicts"
]
