"""prep/chat/registry.py: one entry per recognised template, and a template added from outside the product.

The toy template below follows the recipe "How to add a chat template" from this file alone: its source, a
renderer, a column-wise shape and a probe of its own, registered, then a chat set tokenized through it.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from prepkit import assert_same_files, chat_records, tokenize, write_jsonl
from xprep import cli
from xprep.prep.chat import TEMPLATES, KnownTemplate, columns
from xprep.prep.chat.columns import ASSISTANT, SYSTEM, TOOL, USER, Shape
from xprep.prep.chat.fast import PROBES
from xprep.prep.chat.registry import sha256
from xprep.prep.chat.templates import ChatTemplate, TemplateSpec
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.formats import CHAT
from xprep.prep.tokenize.config import Options
from xprep.prep.tokenize.encode import Processor
from xprep.prep.tokenizer import load_tokenizer_info

# 1. the template's source, exactly as a tokenizer_config.json would hold it: ChatML with the role in capitals
TOY = ("{% for message in messages %}"
       "{{ '<|im_start|>' + message['role'] | upper + ': ' + message['content'] + '<|im_end|>' + '\n' }}"
       "{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>ASSISTANT: ' }}{% endif %}")


# 2. its renderer: the same text as a list of parts, each assistant content's part noted in ``slots``
def toy_renderer(messages: list, gen: bool, bos: str, eos: str, slots: list | None) -> list[str] | None:
    parts = []
    for i, m in enumerate(messages):
        parts += ("<|im_start|>", m["role"].upper(), ": ", m["content"], "<|im_end|>\n")
        if slots is not None and m["role"] == "assistant":
            slots.append((i, len(parts) - 2))
    if gen:
        parts.append("<|im_start|>ASSISTANT: ")
    return parts


# 3. its column-wise shape (each role's head, the tail), and 4. a probe for what it does that others do not
TOY_ENTRY = KnownTemplate(
    "toy", toy_renderer, sources=(TOY,), builtin=True, eos="<|im_end|>",
    shape=Shape({role: f"<|im_start|>{name}: " for role, name in ((SYSTEM, "SYSTEM"), (USER, "USER"),
                                                                  (ASSISTANT, "ASSISTANT"), (TOOL, "TOOL"))},
                "<|im_end|>\n", "<|im_start|>ASSISTANT: ", "<|im_end|>"),
    probes=([{"role": "user", "content": "user: ASSISTANT: "}, {"role": "assistant", "content": "<|im_end|>"}],),
)


@pytest.fixture
def toy():
    """The toy template, registered for the test only."""
    TEMPLATES.register(TOY_ENTRY)
    try:
        yield TOY_ENTRY
    finally:
        TEMPLATES.unregister(TOY_ENTRY.name)


def test_a_template_registered_from_a_test_is_tokenized_through_its_fast_paths(toy, tmp_path, tiny_tokenizer,
                                                                                capsys):
    """Recognised by its sha256, checked against its Jinja, rendered by its renderer and column-wise by its shape,
    offered as ``--chat-template toy``: the same dataset as Jinja renders, byte for byte."""
    odd = [{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}, {"role": "user", "content": "q"},
           {"role": "assistant", "content": ""}]
    records = [*chat_records(12), {"messages": odd}]
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    for render in ("auto", "records", "jinja"):
        tokenize(src, tmp_path / render, tiny_tokenizer, chat_template="toy", chat_render=render)
        assert_same_files(tmp_path / "auto", tmp_path / render)
    said = capsys.readouterr().err
    assert said.count("chat template: fast path toy (checked against Jinja)") == 2, said
    assert "chat template: Jinja (--chat-render jinja)" in said
    dataset = TokenDataset(tmp_path / "auto")
    assert dataset.manifest["chat_template"] == {"name": "toy", "sha256": sha256(TOY)}
    assert len(dataset) == len(records) and int(dataset.manifest["counts"]["loss_tokens"]) > 0

    info = load_tokenizer_info(str(tiny_tokenizer))
    processor = Processor(info, "hf", TemplateSpec("toy", TOY, "", "<|im_end|>"),
                          Options(CHAT, "text", "assistant", None, None, None, info.eod_id, info.vocab_size))
    assert processor.template.known is toy and processor.columns is not None
    lines = src.read_bytes().splitlines()
    rendered = processor.columns.render(lines)
    assert (rendered.status == columns.KEPT).all()  # every record column-wise
    from_jinja = ChatTemplate(TemplateSpec("toy", TOY, "", "<|im_end|>"), fast=False)
    for k, line in enumerate(lines):  # as the template's own Jinja renders it, spans included
        text, spans = from_jinja.render_with_spans(records[k]["messages"])
        assert rendered.text_of(k) == text and rendered.spans(k) == [(a, b) for a, b, _ in spans], line


def test_what_the_registry_offers_follows_its_entries(toy):
    """``--chat-template``'s names (its help and ``resolve_template``) come from the registry; an unregistered
    template is Jinja's again."""
    shown = CliRunner().invoke(cli.xprep, ["tokenize", "--help"]).output
    assert "chatml, llama3, toy, or a Jinja file" in " ".join(shown.split())
    assert TEMPLATES.builtins["toy"] == TOY and TEMPLATES.recognise(TOY) is toy
    TEMPLATES.unregister("toy")
    try:
        assert "toy" not in TEMPLATES.builtins and TEMPLATES.recognise(TOY) is None
        assert not ChatTemplate(TemplateSpec("toy", TOY, "", "<|im_end|>")).has_fast_path
    finally:
        TEMPLATES.register(toy)


def test_a_name_or_source_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        TEMPLATES.register(KnownTemplate("chatml", toy_renderer, sources=(TOY,)))
    with pytest.raises(ValueError, match=r"registered already \(chatml\)"):
        TEMPLATES.register(KnownTemplate("other", toy_renderer, sources=(TEMPLATES["chatml"].sources[0],)))
    with pytest.raises(ValueError, match="recognises no source"):
        KnownTemplate("none", toy_renderer)
    assert TEMPLATES.recognise(TOY) is None and "other" not in [e.name for e in TEMPLATES]


def test_an_entrys_own_probes_are_part_of_its_check():
    """A renderer wrong only on a conversation of its entry's own probes is used without them and refused with
    them: the self-check renders them too."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "the toy's own probe"}]

    def wrong_there(messages, gen, bos, eos, slots):
        parts = toy_renderer(messages, gen, bos, eos, slots)
        return [*parts, "!"] if messages[-1]["content"] == probe[-1]["content"] else parts

    source = TOY + "{# another source, rendered alike #}"
    for probes, used in (((), True), ((probe,), False)):
        TEMPLATES.register(KnownTemplate("toy-wrong", wrong_there, sources=(source,), eos="<|im_end|>", probes=probes))
        try:
            t = ChatTemplate(TemplateSpec("w", source, "", "<|im_end|>"), verdicts={})
        finally:
            TEMPLATES.unregister("toy-wrong")
        assert t.has_fast_path == used, t.path
    assert t.path.startswith(f"Jinja (fast path toy-wrong failed its self-check: probe {len(PROBES)}: ")
