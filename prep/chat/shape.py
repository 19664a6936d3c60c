"""How a known chat template lays out each message (``Shape``), and the head codes the column-wise path gives
roles: what the registry (registry.py) declares for each template and the column-wise renderer (columns.py) reads.
Its own module so that the registry depends on no renderer."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM, USER, ASSISTANT, TOOL, THINKING = 0, 1, 2, 3, 4  # head codes; THINKING: Qwen3's answer after the last query
TOOL_OPEN, TOOL_MID, TOOL_CLOSE = 5, 6, 7  # Qwen3's tool turns in a run of several (TOOL: a run of one)
CODES = 8  # a code plus CODES: the same head after the BOS token (a conversation's first message, where it has one)


@dataclass(frozen=True)
class Shape:
    """How a template lays out each message: its role's head, the content (stripped or not), a tail; an
    assistant span runs from after ``header`` (the generation prompt, which begins the answer's head) to
    after ``end``."""

    heads: dict[int, str]  # a role without a head goes the per-record way
    tail: str
    header: str
    end: str
    # content the per-record renderers treat specially (Qwen3's reasoning split at ``</think>``, tool responses),
    # or that the span search refuses (its placeholder character): such a record goes the per-record way
    markup: tuple[bytes, ...] = ("\ue000".encode(),)
    strip: bool = False  # the content as Jinja's ``trim`` gives it
    bos: bool = False  # the BOS token before the first message
    # the head of a conversation's first message where it is not its role's (after the BOS token): Llama 3.1's
    # dated system turn, which takes in a first system message or comes before any other
    first: dict[int, str] | None = None
    tails: dict[int, str] | None = None  # a role's own tail, where it is not ``tail`` (Mistral's answers)
    alternate: bool = False  # user first, then assistant, and so on: the template raises otherwise (per record)
    # Qwen3's turns: a run of tool turns is one user turn (heads TOOL_OPEN/MID/CLOSE), and the last answer, when it
    # comes after the last query, opens with an empty <think> block (head THINKING)
    thinking: bool = False
