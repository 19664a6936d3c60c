"""Conversations as records hold them: messages and roles normalized, and the error a conversation is rejected with.

Both chat paths start here: ``normalize_messages`` turns OpenAI ``messages`` and ShareGPT ``conversations`` into
one list of ``{"role", "content", ...}`` (the per-record path, and the column-wise path's probes); ``TemplateError``
is what a conversation that cannot be rendered, or whose targets cannot be found, is rejected with.
"""

from __future__ import annotations

from xprep.prep.errors import XprepError

ROLES = {
    "system": "system", "user": "user", "assistant": "assistant", "tool": "tool",
    "human": "user", "prompter": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant",
    # ShareGPT dumps name the assistant after the product that answered
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "claude": "assistant", "gemini": "assistant",
    "function": "tool", "observation": "tool", "ipython": "tool", "developer": "system",
}
CANONICAL_ROLES = ("system", "user", "assistant", "tool")
MESSAGE_EXTRAS = ("category", "tool_calls", "name", "reasoning_content", "tool_call_id")  # kept by normalize_messages


class TemplateError(ValueError):
    """A conversation the template cannot render or whose targets cannot be located.

    ``kind`` names the class of problem (what rejects are counted by), the message the instance.
    """

    def __init__(self, message: str, kind: str = "chat template failed"):
        super().__init__(message)
        self.kind = kind


def one_line(message: str, limit: int = 500) -> str:
    """A template's own error message as one line of the console and of rejects.jsonl: newlines escaped, cut."""
    flat = message.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return flat if len(flat) <= limit else flat[:limit] + "…"


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
