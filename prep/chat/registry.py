"""The chat templates xprep recognises: one entry each, holding everything that knows that template.

An entry (``KnownTemplate``) names the template, the sha256 of every source text it recognises (a template is
recognised by its exact text only: see ``prep/chat/fast.py``), its per-record renderer (``fast.py``), its
column-wise shape (``columns.Shape``, or none: per record only), the probes its renderer must also agree on, and
the special tokens its models use. Recognition (``ChatTemplate``: ``TEMPLATES.recognise``), the column-wise
path (``ChatTemplate.known.shape``), ``--chat-template NAME`` (``builtin``) and the tests' template tables all
read the registry; template names and sha256s are spelled nowhere else in the product.

Adding a template is one ``register(KnownTemplate(...))`` (the recipe: /work/notes/recipe-chat-template.md): its
renderer is used only once it renders every probe as the template's own Jinja does, and its shape only once the
column-wise path renders every probe as the renderer does; a failed check falls back to the slower path, with the
reason on the console, never to a different output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from xprep.prep.chat import fast
from xprep.prep.chat.shape import (
    ASSISTANT,
    SYSTEM,
    THINKING,
    TOOL,
    TOOL_CLOSE,
    TOOL_MID,
    TOOL_OPEN,
    USER,
    Shape,
)


def sha256(source: str) -> str:
    """What a template source is recognised by: the sha256 of its UTF-8 text."""
    return hashlib.sha256(source.encode()).hexdigest()


@dataclass(frozen=True)
class KnownTemplate:
    """One recognised template: what recognises it, what renders it, and what it was checked with.

    ``sources`` are texts xprep ships (``builtin``: the first is ``--chat-template NAME``); ``sha256s`` recognise
    texts it does not ship (their authors', e.g. Meta's: tests/templates holds copies). ``bos``/``eos`` are the
    tokens the template's models render it with (their tokenizer_config.json's): the shape's markers assume them
    (the column-wise path checks that against each tokenizer's own), and the tests render with them.
    """

    name: str  # what the console says ("fast path chatml") and --chat-template NAME for a built-in one
    renderer: fast.Renderer
    sources: tuple[str, ...] = ()
    sha256s: tuple[str, ...] = ()
    shape: Shape | None = None  # its column-wise layout; None: the per-record path only
    builtin: bool = False
    bos: str = ""
    eos: str | None = None
    probes: tuple[list[dict], ...] = ()  # conversations for this template's branches, besides fast.PROBES

    def __post_init__(self) -> None:
        if not self.sources and not self.sha256s:
            raise ValueError(f"chat template {self.name}: recognises no source (give sources or sha256s)")
        if self.builtin and not self.sources:
            raise ValueError(f"chat template {self.name}: built in, but xprep ships no source of it")

    @property
    def recognised(self) -> tuple[str, ...]:
        """The sha256 of every source this entry recognises."""
        return (*map(sha256, self.sources), *self.sha256s)


class Registry:
    """The known templates, by name and by the sha256 of each source they recognise (each unique)."""

    def __init__(self):
        self._by_name: dict[str, KnownTemplate] = {}
        self._by_sha: dict[str, KnownTemplate] = {}
        self._builtins: dict[str, str] = {}
        self.builtins: Mapping[str, str] = MappingProxyType(self._builtins)  # name → source, for --chat-template

    def register(self, entry: KnownTemplate) -> KnownTemplate:
        """Add ``entry``; a name or a source another entry has already is a mistake in the code."""
        taken = [sha for sha in entry.recognised if sha in self._by_sha]
        if entry.name in self._by_name or taken:
            raise ValueError(f"chat template {entry.name}: its name or a source of it is registered already "
                             f"({self._by_sha[taken[0]].name if taken else entry.name})")
        self._by_name[entry.name] = entry
        self._by_sha.update(dict.fromkeys(entry.recognised, entry))
        if entry.builtin:
            self._builtins[entry.name] = entry.sources[0]
        return entry

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` (a test's own template, once the test is done)."""
        entry = self._by_name.pop(name)
        for sha in entry.recognised:
            del self._by_sha[sha]
        self._builtins.pop(name, None)

    def recognise(self, source: str) -> KnownTemplate | None:
        """The entry that recognises this exact source text, if any."""
        return self._by_sha.get(sha256(source))

    def __iter__(self) -> Iterator[KnownTemplate]:
        return iter(self._by_name.values())

    def __getitem__(self, name: str) -> KnownTemplate:
        return self._by_name[name]


TEMPLATES = Registry()
register = TEMPLATES.register


# -- ChatML and Qwen3 ---------------------------------------------------------------------------------------------
CHATML_HEADER = "<|im_start|>assistant\n"  # the generation prompt: an answer's span begins after it
_IM_END = "<|im_end|>"
_CHATML_HEADS = {SYSTEM: "<|im_start|>system\n", USER: "<|im_start|>user\n", ASSISTANT: CHATML_HEADER,
                 TOOL: "<|im_start|>tool\n"}

register(KnownTemplate(
    "chatml", fast.chatml, builtin=True, eos=_IM_END,
    sources=(
        (  # --chat-template chatml
            "{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
        (  # the ChatML template of transformers' documentation and many fine-tunes
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    ),
    shape=Shape(_CHATML_HEADS, _IM_END + "\n", CHATML_HEADER, _IM_END),
))

_QWEN3_TOOL = "<|im_start|>user\n<tool_response>\n"
register(KnownTemplate(
    "qwen3", fast.qwen3, eos=_IM_END,
    sha256s=("87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",),  # Qwen/Qwen3-* (hybrid thinking)
    # (a run of tool turns is one user turn, each response wrapped in <tool_response>)
    shape=Shape({**_CHATML_HEADS, THINKING: CHATML_HEADER + "<think>\n\n</think>\n\n",
                 TOOL: _QWEN3_TOOL, TOOL_OPEN: _QWEN3_TOOL, TOOL_MID: "\n<tool_response>\n",
                 TOOL_CLOSE: "\n<tool_response>\n"}, _IM_END + "\n", CHATML_HEADER, _IM_END,
                (b"</think>", b"<tool_response>", "\ue000".encode()),
                tails={TOOL: "\n</tool_response>" + _IM_END + "\n", TOOL_OPEN: "\n</tool_response>",
                       TOOL_MID: "\n</tool_response>", TOOL_CLOSE: "\n</tool_response>" + _IM_END + "\n"},
                thinking=True),
))

# -- Llama 3 ------------------------------------------------------------------------------------------------------
_BEGIN, _EOT = "<|begin_of_text|>", "<|eot_id|>"
_LLAMA3_HEADS = {SYSTEM: "<|start_header_id|>system<|end_header_id|>\n\n",
                 USER: "<|start_header_id|>user<|end_header_id|>\n\n", ASSISTANT: fast.LLAMA3_PROMPT}

register(KnownTemplate(
    "llama3", fast.llama3, builtin=True, bos=_BEGIN, eos=_EOT,
    sources=(
        (  # --chat-template llama3
            "{{ bos_token }}"
            "{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
            " + '<|eot_id|>' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
        ),
        (  # meta-llama/Meta-Llama-3-8B-Instruct (and 70B) tokenizer_config.json
            "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
            "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
            "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
            "{% endif %}"
        ),
    ),
    shape=Shape({**_LLAMA3_HEADS, TOOL: "<|start_header_id|>tool<|end_header_id|>\n\n"}, _EOT, fast.LLAMA3_PROMPT,
                _EOT, strip=True, bos=True),
))

_DATED = fast.LLAMA31_SYSTEM  # Llama 3.1's system turn, which a first system message's content completes
register(KnownTemplate(
    "llama3.1", fast.llama31, bos=_BEGIN, eos=_EOT,
    sha256s=(  # Meta's own (their text is Meta's; tests/templates holds copies to test against)
        "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",  # Llama-3.1-8B/70B-Instruct
        "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",  # Llama-3.2-1B/3B-Instruct
    ),
    # (no tool head: its turns hold their content as JSON, the per-record way)
    shape=Shape(_LLAMA3_HEADS, _EOT, fast.LLAMA3_PROMPT, _EOT, strip=True, bos=True,
                first={SYSTEM: _DATED, USER: _DATED + _EOT + _LLAMA3_HEADS[USER],
                       ASSISTANT: _DATED + _EOT + fast.LLAMA3_PROMPT}),
))

# -- Mistral/Mixtral-Instruct: "[INST] q [/INST]", then the answer and the EOS token --------------------------------
_MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ 'INST' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ANSWER}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
_MISTRAL_HEADS = {USER: "[INST] ", ASSISTANT: ""}

register(KnownTemplate(  # mistralai/Mistral-7B-Instruct-v0.2, Mixtral-8x7B-Instruct-v0.1
    "mistral", fast.mistral("[INST] ", "", ""), bos="<s>", eos="</s>",
    sources=(_MISTRAL.replace("INST", "[INST] ", 1).replace("ANSWER", "message['content'] + eos_token"),),
    shape=Shape(_MISTRAL_HEADS, " [/INST]", "", "</s>", bos=True, alternate=True, tails={ASSISTANT: "</s>"}),
))
register(KnownTemplate(  # mistralai/Mistral-7B-Instruct-v0.1
    "mistral-v0.1", fast.mistral("[INST] ", "", " "), bos="<s>", eos="</s>",
    sources=(_MISTRAL.replace("INST", "[INST] ", 1).replace("ANSWER}", "message['content'] + eos_token + ' ' }"),),
    shape=Shape(_MISTRAL_HEADS, " [/INST]", "", "</s>", bos=True, alternate=True, tails={ASSISTANT: "</s> "}),
))
register(KnownTemplate(  # the Mixtral variant with a space before [INST] and before each answer
    "mistral-spaced", fast.mistral(" [INST] ", " ", ""), bos="<s>", eos="</s>",
    sources=(_MISTRAL.replace("INST", " [INST] ", 1).replace("ANSWER", "' ' + message['content'] + eos_token"),),
    shape=Shape({USER: " [INST] ", ASSISTANT: " "}, " [/INST]", "", "</s>", bos=True, alternate=True,
                tails={ASSISTANT: "</s>"}),  # (its span takes the space before the answer)
))

# -- Gemma ----------------------------------------------------------------------------------------------------------
register(KnownTemplate(  # google/gemma-7b-it, gemma-2b-it
    "gemma", fast.gemma, bos="<bos>", eos="<eos>",
    sources=((
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
        "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
    ),),
    shape=Shape({USER: "<start_of_turn>user\n", ASSISTANT: "<start_of_turn>model\n"}, "<end_of_turn>\n",
                "<start_of_turn>model\n", "<end_of_turn>", strip=True, bos=True, alternate=True),
))

BUILTIN_TEMPLATES = TEMPLATES.builtins  # name → source: --chat-template chatml|llama3|...
