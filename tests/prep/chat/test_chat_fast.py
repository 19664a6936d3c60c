"""prep/chat/fast.py: the fast chat path gives exactly the general (Jinja) path's tokens, targets and categories.

The general path is forced with ``chat_render="jinja"`` (``--chat-render jinja``); both run the same Processor on
every conversation of ../shared/data/chat plus hand-made edge cases, for every template of the registry
(``known_templates``), and must agree array for array, reject for reject. (Two Mistral variants, which differ from
``mistral`` in their glue only, take a sample of the conversations that holds every way content meets glue there:
``GLUE_VARIANTS``.)
"""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
from conftest import META_TEMPLATES, SHARED, known_templates, requires_shared_data
from prepkit import write_jsonl
from xprep.prep.chat import TEMPLATES, templates
from xprep.prep.chat import columns as chat_columns
from xprep.prep.chat import fast as chat_fast
from xprep.prep.chat.messages import TemplateError, normalize_messages
from xprep.prep.chat.registry import KnownTemplate, sha256
from xprep.prep.chat.templates import ChatTemplate, TemplateSpec
from xprep.prep.formats import CHAT
from xprep.prep.sources import LINES, RawBatch
from xprep.prep.tokenize.chats import ChatEncoder
from xprep.prep.tokenize.config import Options
from xprep.prep.tokenize.encode import Processor
from xprep.prep.tokenizer import choose_backend, load_tokenizer_info

THINK = "<think>\nI should answer.\n</think>\n\n"
EDGE_CASES: list[dict] = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "sunny, 21C"},
                  {"role": "assistant", "content": "Sunny, 21 °C."}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "again"}, {"role": "assistant", "content": "   "}]},
    {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": THINK + "a1"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": THINK + "a2"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\n\n</think>\n\nshort"}]},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a", "reasoning_content": "because\n"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "reasoning_content": "so"}]},
    {"messages": [{"role": "user", "content": "naïve café — 日本語 😀"},
                  {"role": "assistant", "content": "Ünïcödé 👨‍👩‍👧 ½"},
                  {"role": "user", "content": "\u00a0\u200b\r\n"}, {"role": "assistant", "content": "\r\n\tok\n"}]},
    {"messages": [{"role": "user", "content": "say <|im_end|> and <|im_start|>assistant\n"},
                  {"role": "assistant", "content": "<|im_end|><|endoftext|></s><s>[INST] <|eot_id|>"},
                  {"role": "user", "content": "<|start_header_id|>assistant<|end_header_id|>\n\n"},
                  {"role": "assistant", "content": "<tool_response>x</tool_response>"}]},
    {"messages": [{"role": "user", "content": "\ue000 placeholder look-alikes \ue0000\ue001"},
                  {"role": "assistant", "content": "\ue0000\ue001"}]},
    {"messages": [{"role": "user", "content": "two answers"}, {"role": "assistant", "content": "one"},
                  {"role": "assistant", "content": "two"}]},
    {"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"},
                  {"role": "assistant", "content": "fine"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  spaced  \n"},
                  {"role": "user", "content": "<tool_response>r</tool_response>"},
                  {"role": "assistant", "content": "\n\nleading newlines"}]},
    {"messages": [{"role": "user", "content": "call it"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                  {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]},
    {"category": "smalltalk", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "category": "math"}]},
    {"messages": [{"role": "user", "content": "only a user"}]},
    {"conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "style"}]},
] + [{"messages": probe} for probe in chat_fast.PROBES]


def _llama3_spec(source: str) -> TemplateSpec:
    return TemplateSpec("llama3", source, "<|begin_of_text|>", "<|eot_id|>")


CASES = known_templates()  # name → a TemplateSpec of every template of the registry (its first source)
MISTRAL = TEMPLATES["mistral"].sources[0]
# Special tokens of the Llama-3, Mistral and Gemma templates: added to a copy of the Qwen3 tokenizer so that their
# spans start and end at special tokens as with those models' own tokenizers (otherwise every conversation
# takes the slow HF-offsets route, on both paths alike).
EXTRA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>",
                 "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    if not SHARED.is_dir():
        pytest.skip(f"real test data not found at {SHARED}")
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(SHARED / "tokenizers/qwen3/tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in EXTRA_SPECIAL])
    d = tmp_path_factory.mktemp("qwen3_plus")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_bytes((SHARED / "tokenizers/qwen3/tokenizer_config.json").read_bytes())
    return d


def _processor(tokenizer_dir, spec: TemplateSpec | None, train_on: str = "assistant",
               category: str | None = None, chat_render: str = "auto") -> Processor:
    """A Processor of chat (``spec`` None: the tokenizer's own template); ``chat_render``: ``--chat-render``."""
    info = load_tokenizer_info(str(tokenizer_dir))
    if spec is None:
        spec = TemplateSpec("tokenizer", info.chat_template, info.bos_token or "", info.eos_token)
    backend, _ = choose_backend(info, "auto")
    options = Options(CHAT, "text", train_on, category, None, None, info.eod_id, info.vocab_size)
    return Processor(info, backend, spec, options, chat_render)


CHITCHAT = "chat/chitchat.jsonl"


def _batch(limit: int | None = None, sample: bool = False) -> RawBatch:
    """The chitchat conversations (the first ``limit``; ``sample``: ``_glue_sample`` of them), then ``EDGE_CASES``."""
    real = _glue_sample(CHITCHAT) if sample else (SHARED / CHITCHAT).read_bytes().splitlines()[:limit]
    lines = [*real, *(json.dumps(r, ensure_ascii=False).encode() for r in EDGE_CASES)]
    return RawBatch(0, lines, list(range(1, len(lines) + 1)), LINES)


# Templates whose renderer, column-wise shape and general path are another template's with other glue (the Mistral
# family: one renderer factory, one shape with other markers, and no generation prompt, so that Jinja renders every
# prefix of a conversation, the costliest path of all: ~15 s a template). The template named here is compared on
# every conversation; its variants on ``_glue_sample``'s, where each route through the code that the full corpus
# takes is taken too (measured: the same route on every conversation for the three templates).
GLUE_VARIANTS = {"mistral-v0.1": "mistral", "mistral-spaced": "mistral"}


def _char_class(text: str) -> str:
    """What a character at the edge of a content is to a pre-tokenizer: empty, newline, space, letter, digit, other."""
    if not text:
        return "empty"
    c = text[0]
    return ("newline" if c in "\r\n" else "space" if c.isspace() else "letter" if c.isalpha() else
            "digit" if c.isdigit() else "other") + ("" if c.isascii() else " (non-ASCII)")


def _glue_features(line: bytes) -> set[tuple]:
    """Where a conversation's content meets a template's glue: each role's first and last character's class, each
    pair of characters across a turn boundary, an answer found earlier in the conversation (the span search must
    skip that occurrence), no answer at all (a reject), and a first and a last role."""
    messages = normalize_messages(json.loads(line))
    found = {("first", messages[0]["role"]), ("last", messages[-1]["role"])} if messages else {("no messages",)}
    if not any(m["role"] == "assistant" for m in messages):
        found.add(("no answer",))
    seen = ""
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        found |= {(role, "starts", _char_class(content)), (role, "ends", _char_class(content[-1:]))}
        if i:
            found.add((messages[i - 1]["role"], _char_class(messages[i - 1]["content"][-1:]), role,
                       _char_class(content)))
        if role == "assistant" and content and content in seen:
            found.add(("answer found earlier",))
        seen += content
    return found


@functools.cache
def _glue_sample(name: str, every: int = 16, per_feature: int = 3) -> tuple[bytes, ...]:
    """Of the conversations of ``SHARED / name``, every ``every``-th, and for each ``_glue_features`` feature the
    ``per_feature`` shortest that have it (so the rare ones, a reply that starts with a newline say, are all there),
    in order."""
    lines = (SHARED / name).read_bytes().splitlines()
    features = [_glue_features(line) for line in lines]
    by_length = sorted(range(len(lines)), key=lambda k: len(lines[k]))
    chosen, taken = set(range(0, len(lines), every)), {}
    for k in by_length:
        for feature in features[k]:
            if taken.get(feature, 0) < per_feature:
                taken[feature] = taken.get(feature, 0) + 1
                chosen.add(k)
    return tuple(lines[k] for k in sorted(chosen))


def _rendered(processor: Processor, lines: list[bytes]) -> list[str]:
    """The texts ``processor``'s template renders for ``lines`` (those it refuses left out)."""
    texts = []
    for line in lines:
        try:
            texts.append(processor.template.render(normalize_messages(json.loads(line))))
        except TemplateError:
            continue
    return texts


def _assert_same(a, b, name: str) -> None:
    assert [(r.line, r.kind, r.reason, r.fatal) for r in a.rejects] == [
        (r.line, r.kind, r.reason, r.fatal) for r in b.rejects]
    assert np.array_equal(a.lengths, b.lengths)
    starts = np.concatenate([[0], np.cumsum(a.lengths)])
    for k in range(len(a.lengths)):  # document by document, to name the first one that differs
        s = slice(starts[k], starts[k + 1])
        assert np.array_equal(a.tokens[s], b.tokens[s]), f"{name}: document {k}: tokens"
        assert np.array_equal(a.loss_mask[s], b.loss_mask[s]), f"{name}: document {k}: loss mask"
    assert a.cat_keys == b.cat_keys and np.array_equal(a.cat_codes, b.cat_codes)


@requires_shared_data
@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_equals_general_path_on_every_conversation(name, tokenizer_dir):
    spec = CASES[name]
    if name in GLUE_VARIANTS:  # the premise of the sample: the same code as the template compared on every one
        known, base = TEMPLATES[name], TEMPLATES[GLUE_VARIANTS[name]]
        assert known.renderer.__qualname__ == base.renderer.__qualname__
        assert (known.shape is None) == (base.shape is None)
        assert not ChatTemplate(spec).generation_prompt and not ChatTemplate(CASES[base.name]).generation_prompt
    batch = _batch(sample=name in GLUE_VARIANTS)
    fast = _processor(tokenizer_dir, spec)
    assert fast.template.path == f"fast path {name} (checked against Jinja)", fast.template.path
    general = _processor(tokenizer_dir, spec, chat_render="jinja")
    assert general.template.path == "Jinja (--chat-render jinja)"
    a, b = fast(batch), general(batch)
    _assert_same(a, b, name)
    assert len(a.lengths) > 100 and a.loss_mask.sum() > 0  # most conversations are documents


@requires_shared_data
def test_fast_path_equals_general_path_with_train_on_all_and_a_category(tokenizer_dir):
    batch = _batch(limit=300)
    fast = _processor(tokenizer_dir, None, train_on="all", category="chat")
    general = _processor(tokenizer_dir, None, train_on="all", category="chat", chat_render="jinja")
    assert fast.template.has_fast_path and not general.template.has_fast_path
    _assert_same(fast(batch), general(batch), "qwen3 --train-on all")


@requires_shared_data
@pytest.mark.parametrize("name", list(CASES))
def test_character_offsets_from_token_bytes_equal_hf_offsets(name, tokenizer_dir):
    """Where a span boundary splits a pre-token, each token's first character comes from gigatoken's token bytes:
    the character offsets HF tokenizers gives, on every rendered conversation (real ones and the edge cases)."""
    processor = _processor(tokenizer_dir, CASES[name], train_on="all")
    encoder = processor.encoder
    assert encoder._giga is not None and encoder._offsets_are_bytes()
    # real conversations once (the templates differ only in their glue), the edge cases for each
    texts = _rendered(processor, _batch(limit=2000 if name == "qwen3" else 0).items)
    flat, lengths = encoder.encode(texts, add_special_tokens=False)
    references = encoder.hf.encode_batch(texts, add_special_tokens=False)
    from_bytes = 0
    for text, ids, ref in zip(texts, np.split(flat, np.cumsum(lengths)[:-1]), references, strict=True):
        assert np.array_equal(ref.ids, ids)
        assert np.array_equal(encoder.char_starts(text, ids), [s for s, _ in ref.offsets]), text[:200]
        from_bytes += encoder._giga.backend.decode(ids) == text.encode()
    assert from_bytes > 0.9 * len(texts) > 20  # all but text that NFC normalization changes


@requires_shared_data
def test_a_pre_token_split_by_a_span_needs_no_hf_tokenizer(tokenizer_dir, monkeypatch):
    """Real conversations whose assistant content begins with a newline (the template's newline and the content's
    become one token): masked from the token bytes, with HF tokenizers never loaded, exactly as HF's offsets do."""
    from xprep.prep.tokenizer import encoder as encoder_module

    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nanswer"},
                             {"role": "user", "content": "é"}, {"role": "assistant", "content": "\n 日本語 😀"}]}]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records] + _batch(limit=500).items
    batch = RawBatch(0, lines, list(range(1, len(lines) + 1)), LINES)
    processor = _processor(tokenizer_dir, None)
    assert processor.encoder._offsets_are_bytes()  # memoized: HF is needed once per tokenizer, not per run
    split = []
    original = ChatEncoder._mask_from_offsets

    def spy(self, text, *args):
        split.append(text)
        return original(self, text, *args)

    monkeypatch.setattr(ChatEncoder, "_mask_from_offsets", spy)
    monkeypatch.setattr(encoder_module, "load_hf", lambda path: pytest.fail("HF tokenizers was loaded"))
    from_bytes = processor(batch)
    monkeypatch.undo()
    assert split, "no conversation split a pre-token"
    processor.encoder._bytes_verdict = False  # HF's offsets, the reference
    _assert_same(from_bytes, processor(batch), "token bytes vs HF offsets")


@requires_shared_data
def test_slot_spans_equal_placeholder_spans_on_real_conversations():
    """The fast span search (no second rendering) gives what the placeholder search gives, turn for turn."""
    config = json.loads((SHARED / "tokenizers/qwen3/tokenizer_config.json").read_text())
    t = ChatTemplate(TemplateSpec("tokenizer", config["chat_template"], "", config["eos_token"]))
    checked = 0
    for line in (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:300]:
        msgs = normalize_messages(json.loads(line))
        assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not assistants:
            continue
        slots: list = []
        text = t._render_fast(msgs, False, slots)
        assert text == t.render_jinja(msgs)
        by_slots = t._spans_by_slots(text, msgs, assistants, slots)
        assert by_slots is not None and by_slots == t._spans_by_placeholders(text, msgs, assistants)
        checked += 1
    assert checked > 100


def test_every_known_template_passes_its_self_check():
    """Every source of every template of the registry that the tests hold (with the shared data: all of them)."""
    for name, spec in known_templates(every_source=True).items():
        t = ChatTemplate(spec, verdicts={})
        assert t.path == f"fast path {name.split('#')[0]} (checked against Jinja)", name
        assert t.known is TEMPLATES.recognise(spec.source) and t.known.name == spec.name


@requires_shared_data
def test_the_tests_hold_every_source_the_registry_recognises():
    """A template recognised by a sha256 alone has its text among the tests' (tests/templates, the shared data),
    so that the tables above check it; and the registry's names and sources are each its own."""
    table = known_templates(every_source=True)
    for entry in TEMPLATES:
        held = [spec.source for name, spec in table.items() if name.split("#")[0] == entry.name]
        assert len(held) == len(entry.sources) + len(entry.sha256s), entry.name
        assert set(entry.recognised) == {sha256(text) for text in held}
    assert TEMPLATES.builtins == {"chatml": TEMPLATES["chatml"].sources[0], "llama3": TEMPLATES["llama3"].sources[0]}


def test_unknown_template_takes_the_general_path():
    # ChatML with one more space: not a known source, so rendered by Jinja (in the sandbox) — and still right.
    source = templates.BUILTIN_TEMPLATES["chatml"].replace("{% endfor %}", "{%  endfor %}")
    t = ChatTemplate(TemplateSpec("mine", source, "", "<|im_end|>"))
    assert t.path == "Jinja (not a template the fast path knows)" and not t.has_fast_path
    text, spans = t.render_with_spans([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert [text[a:b] for a, b, _ in spans] == ["a<|im_end|>"]


def test_a_renderer_that_disagrees_with_jinja_is_not_used():
    """A registered renderer that renders one probe otherwise than the template's Jinja (here a ChatML variant, one
    space apart, whose renderer adds a space to conversations of three messages) is never used."""
    source = TEMPLATES["chatml"].sources[0].replace("{% endfor %}", "{%  endfor %}")

    def off_by_one_space(messages, gen, bos, eos, slots):
        parts = chat_fast.chatml(messages, gen, bos, eos, slots)
        return parts if len(messages) != 3 else [*parts, " "]

    TEMPLATES.register(KnownTemplate("chatml-off", off_by_one_space, sources=(source,), eos="<|im_end|>"))
    try:
        t = ChatTemplate(TemplateSpec("mine", source, "", "<|im_end|>"))
    finally:
        TEMPLATES.unregister("chatml-off")
    assert not t.has_fast_path and t.known is None
    assert t.path.startswith("Jinja (fast path chatml-off failed its self-check: probe ")


def test_template_errors_are_the_same_on_both_paths():
    fast = ChatTemplate(TemplateSpec("mistral", MISTRAL, "<s>", "</s>"))
    general = ChatTemplate(TemplateSpec("mistral", MISTRAL, "<s>", "</s>"), fast=False)
    assert fast.has_fast_path and not general.has_fast_path
    for msgs, message in (([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "must alternate"),
                          ([{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}], "roles are supported"),
                          ([{"role": "tool", "content": "t"}], "must alternate")):
        for t in (fast, general):
            with pytest.raises(TemplateError, match=message) as e:
                t.render_with_spans(msgs)
            assert e.value.kind == "chat template failed"


def test_the_fast_path_runs_no_template_code():
    """A known source is recognised by its sha256 only: a template that merely looks like ChatML (here, one that
    tries to reach Python internals) is not recognised, and the sandbox stops it as before."""
    evil = templates.BUILTIN_TEMPLATES["chatml"] + "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    t = ChatTemplate(TemplateSpec("evil", evil, "", None))
    assert not t.has_fast_path
    with pytest.raises(TemplateError, match="chat template failed"):
        t.render([{"role": "user", "content": "x"}])


def test_cli_says_which_chat_path_ran(tmp_path, tiny_tokenizer, run_cli):
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3
    src = write_jsonl(tmp_path / "c.jsonl", records)
    code, _, err = run_cli("tokenize", src, "-o", tmp_path / "fast", "--tokenizer", tiny_tokenizer)
    assert code == 0 and "chat template: fast path chatml (checked against Jinja)" in err, err
    custom = tmp_path / "t.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}<|endoftext|>{% endfor %}"
                      "{% if add_generation_prompt %}[assistant] {% endif %}")
    code, _, err = run_cli("tokenize", src, "-o", tmp_path / "general", "--tokenizer", tiny_tokenizer,
                           "--chat-template", custom)
    assert code == 0 and "chat template: Jinja (not a template the fast path knows)" in err, err
    assert "1 worker]" in err


def test_a_worker_given_the_verdicts_neither_checks_nor_compiles_until_needed(monkeypatch):
    """The main process's self-check verdicts, adopted by a worker: the fast path without a second self-check and
    without Jinja compiled, which compiles on the first conversation the fast renderer leaves to it."""
    spec = _llama3_spec(META_TEMPLATES["llama-3.1"])
    monkeypatch.setattr(templates, "_VERDICTS", {})  # (this process's verdicts: what a worker adopts)
    checked = ChatTemplate(spec)
    assert checked.has_fast_path
    found = templates.verdicts()
    monkeypatch.setattr(templates, "_VERDICTS", {})
    templates.adopt_verdicts(found)
    monkeypatch.setattr(templates, "_self_check", lambda *a: pytest.fail("checked twice"))
    worker = ChatTemplate(spec)
    assert worker.has_fast_path and worker.path == checked.path and worker._compiled is None
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert worker.render_with_spans(plain) == checked.render_with_spans(plain) and worker._compiled is None
    calls = [*plain[:1], {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                          "arguments": {}}}]}]
    assert worker.render(calls) == checked.render_jinja(calls) and worker._compiled is not None
    # a verdict against the fast renderer: Jinja, compiled at once
    refused = ChatTemplate(spec, verdicts={(spec.sha256, spec.bos_token, spec.eos_token): "probe 0 differs"})
    assert not refused.has_fast_path and refused._compiled is not None


@requires_shared_data
@pytest.mark.parametrize("render", ["auto", "jinja"])
def test_a_lone_surrogate_outside_contents_is_a_reject(render, tokenizer_dir):
    """A lone surrogate (a JSON escape) in what a template renders besides the contents (reasoning, a tool call's
    name) is rejected as one in a content is, on both paths: no tokenizer can encode it."""
    processor = _processor(tokenizer_dir, None, chat_render=render)
    lines = [b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", '
             b'"reasoning_content": "why \\ud800"}]}',
             b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": '
             b'[{"function": {"name": "f\\udfff", "arguments": {}}}]}, {"role": "tool", "content": "1"}]}',
             b'{"messages": [{"role": "user", "content": "q \\ud800"}, {"role": "assistant", "content": "a"}]}',
             b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}']
    out = processor(RawBatch(0, lines, [1, 2, 3, 4], LINES))
    assert [(r.line, r.kind) for r in out.rejects] == [(1, "lone surrogate"), (2, "lone surrogate"),
                                                       (3, "lone surrogate")]
    assert len(out.lengths) == 1


MISTRAL_TOKENIZER = SHARED / "tokenizers/mistral"


@requires_shared_data
def test_character_offsets_from_a_sentencepiece_spelling_equal_hf_offsets():
    """Mistral's tokenizer writes spaces as "▁" and puts one before each stretch of text between added tokens: token
    starts read from that spelling are HF tokenizers' offsets, on every chitchat conversation in Mistral's template
    and on hand-made texts (spaces first, added tokens side by side, byte-fallback emoji); a literal "▁" in the
    text, which the spelling cannot tell from a space, takes HF's offsets."""
    info = load_tokenizer_info(str(MISTRAL_TOKENIZER))
    backend, _ = choose_backend(info, "auto")
    processor = Processor(info, backend, TemplateSpec("mistral", MISTRAL, "<s>", "</s>"),
                          Options(CHAT, "text", "all", None, None, None, info.eod_id, info.vocab_size))
    encoder = processor.encoder
    assert encoder._giga is not None and encoder._offsets_are_bytes()
    texts = [" lead", "  two\n\n\tthree ", "<s></s><s> x</s>y", "<s>[INST] 😀🦀 日本語 [/INST] é</s>", "a" * 500, "\n"]
    texts += _rendered(processor, _batch().items)
    flat, lengths = encoder.encode(texts, add_special_tokens=False)
    references = encoder.hf.encode_batch(texts, add_special_tokens=False)
    for text, ids, ref in zip(texts, np.split(flat, np.cumsum(lengths)[:-1]), references, strict=True):
        assert np.array_equal(ref.ids, ids)
        spelled = encoder._starts_from_bytes(text, ids)
        assert spelled is not None and np.array_equal(spelled, [s for s, _ in ref.offsets]), text[:200]
    assert len(texts) > 4000
    literal = "a ▁ b"
    ids = encoder.encode([literal], add_special_tokens=False)[0]
    assert encoder._starts_from_bytes(literal, ids) is None
    assert np.array_equal(encoder.char_starts(literal, ids), encoder.offsets(literal)[1])


@requires_shared_data
def test_a_sentencepiece_tokenizer_masks_chat_without_hf(monkeypatch):
    """Chat over Mistral's tokenizer (no clean cut: every conversation encoded whole, its mask from token starts),
    column-wise and per record: HF tokenizers never loads once its offsets verdict is known, and the output is
    what HF's offsets give."""
    from xprep.prep.tokenizer import encoder as encoder_module

    info = load_tokenizer_info(str(MISTRAL_TOKENIZER))
    backend, _ = choose_backend(info, "auto")
    spec = TemplateSpec("mistral", MISTRAL, "<s>", "</s>")
    options = Options(CHAT, "text", "assistant", None, None, None, info.eod_id, info.vocab_size)
    batch = _batch(limit=1500)
    processors = [Processor(info, backend, spec, options), Processor(info, backend, spec, options, "records")]
    assert processors[0].columns is not None and processors[1].columns is None
    for p in processors:
        assert p.encoder._offsets_are_bytes() and not p.encoder.cuts.after_newline
    with monkeypatch.context() as m:
        m.setattr(encoder_module, "load_hf", lambda path: pytest.fail("HF tokenizers was loaded"))
        outputs = [p(batch) for p in processors]
    reference = Processor(info, backend, spec, options)
    reference.encoder._bytes_verdict = False  # HF's offsets
    want = reference(batch)
    for got in outputs:
        _assert_same(got, want, "mistral")
    assert len(want.lengths) > 500


def test_mask_from_offsets_marks_tokens_that_begin_inside_a_span(tiny_tokenizer, monkeypatch):
    """Each token is a target exactly where its first character lies in a span [start, end), with that span's
    category (or the record's); on random token starts and spans, against the rule written out token by token."""
    info = load_tokenizer_info(tiny_tokenizer)
    processor = Processor(info, "hf", None, Options(CHAT, "text", "assistant", None, None, None, info.eod_id,
                                                      info.vocab_size))
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = np.sort(rng.integers(0, 60, rng.integers(1, 30)))
        cuts = np.sort(rng.choice(61, 2 * rng.integers(0, 6), replace=False))
        spans = [(int(a), int(b), rng.choice([None, "x", "y"])) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
        monkeypatch.setattr(processor.encoder, "char_starts", lambda text, ids, starts=starts: starts)
        codes: dict = {}
        target, cats = processor.chats._mask_from_offsets("", starts, spans, "r",
                                                    lambda k, codes=codes: codes.setdefault(k, len(codes)))
        for t, s in enumerate(starts.tolist()):
            inside = [c for a, b, c in spans if a <= s < b]
            assert target[t] == bool(inside) and cats[t] == codes[(inside[0] or "r") if inside else "r"]


@requires_shared_data
@pytest.mark.parametrize("template", ["mistral", "chatml"])
@pytest.mark.parametrize("train_on,category", [("assistant", None), ("all", "chat")])
def test_masks_from_token_starts_equal_masks_from_segments(template, train_on, category, monkeypatch):
    """Over a tokenizer without a clean cut (Mistral's), a column-wise batch's conversations are encoded whole and
    masked by where their tokens start, all at once: the same arrays as cutting each into segments and comparing,
    on every chitchat conversation (with message categories on some) and the hostile lines among real ones."""
    from test_chat_columns import HOSTILE, STRIPPED  # the hostile lines of the column-wise tests

    info = load_tokenizer_info(str(MISTRAL_TOKENIZER))
    backend, _ = choose_backend(info, "auto")
    source = TEMPLATES[template].sources[0]
    spec = TemplateSpec(template, source, "<s>", "</s>")
    options = Options(CHAT, "text", train_on, category, None, None, info.eod_id, info.vocab_size)
    by_starts, by_segments = Processor(info, backend, spec, options), Processor(info, backend, spec, options)
    assert by_starts.columns is not None and not by_starts.encoder.cuts.after_tokens
    monkeypatch.setattr(by_segments.encoder, "token_starts", lambda *a: None)
    calls = []
    original = ChatEncoder._columns_by_starts
    monkeypatch.setattr(ChatEncoder, "_columns_by_starts", lambda self, *a: calls.append(1) or original(self, *a))
    lines = (SHARED / "chat/chitchat.jsonl").read_bytes().splitlines()
    for i in range(0, len(lines), 5):  # a category on some answers
        record = json.loads(lines[i])
        for m in record["messages"][1::4]:
            m["category"] = "picked"
        lines[i] = json.dumps(record).encode()
    good = lines[:40]
    batches = [RawBatch(0, lines[i : i + 1024], list(range(i + 1, i + 1 + len(lines[i : i + 1024]))), LINES)
               for i in range(0, len(lines), 1024)]
    # a literal "▁", which the spelling reads as a space: that conversation's tokens do not spell it
    literal = json.dumps({"messages": [{"role": "user", "content": "say ▁"}, {"role": "assistant", "content": "▁ x"}]})
    batches += [RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES)
                for line in [literal.encode()] + [line for _, line, *_ in [*HOSTILE, *STRIPPED]]]
    spelled = []
    token_starts = by_starts.encoder.token_starts

    def spy(*a):
        got = token_starts(*a)
        spelled.append(got[1])
        return got

    monkeypatch.setattr(by_starts.encoder, "token_starts", spy)
    for batch in batches:
        spelled.clear()
        _assert_same(by_starts(batch), by_segments(batch), f"{template} line {batch.lines[0]}")
        if batch.items[20] == literal.encode():
            assert spelled and spelled[0].sum() == len(spelled[0]) - 1  # that one only
    assert len(calls) > len(batches) / 2


# -- random conversations -----------------------------------------------------------------------------------------
# Pieces of content that templates and the span search treat specially: every template's markers, reasoning and tool
# tags, whitespace of every kind, Jinja syntax, multi-byte and joining characters, the span search's placeholders.
PIECES = ["Hello", "world", "a", ".", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u2003", "\u3000", "\u200b",
          "\u2028", "\x0b", "\x85", "<think>", "</think>", "<think>\n", "\n</think>\n\n", "<tool_call>",
          "</tool_call>", "<tool_response>", "</tool_response>", "<|im_start|>", "<|im_end|>",
          "<|im_start|>assistant\n", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
          "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]", "assistant", "user", "{{", "}}",
          "{%", "%}", "\\", '"', "<", ">", "|", "é", "日本", "😀", "👨‍👩‍👧", "\ue000", "\ue001", "\ue0000\ue001"]


def _text(rng, most: int = 5) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, most)))


def _plain(rng) -> dict:
    """A record the column-wise path may take: string contents, the four usual roles (alternating, mostly)."""
    messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
    alternate = rng.random() < 0.7
    for k in range(rng.randint(0, 7)):
        role = ("user", "assistant")[k % 2] if alternate else rng.choice(["user", "assistant", "tool", "system"])
        messages.append({"role": role, "content": _text(rng)})
        if rng.random() < 0.05:
            messages[-1]["category"] = rng.choice(["math", "x y", ""])
    record = {"messages": messages}
    if rng.random() < 0.05:
        record["category"] = rng.choice(["smalltalk", "qa"])
    return record


def _wild(rng) -> dict:
    """Anything a chat corpus may hold: other roles, contents that are not strings, reasoning, tool calls, names,
    categories of the wrong type, ShareGPT's fields."""
    messages = []
    for _ in range(rng.randint(0, 7)):
        content = rng.choice([_text(rng), _text(rng), _text(rng), "", None, 7, [{"type": "text", "text": "part"}]])
        message = {"role": rng.choice(["user", "assistant", "system", "tool", "user", "assistant", "developer",
                                       "function", "ipython", "human", "gpt"]), "content": content}
        if rng.random() < 0.08:
            message["reasoning_content"] = _text(rng)
        if message["role"] == "assistant" and rng.random() < 0.1:
            message["tool_calls"] = [{"function": {"name": "f", "arguments": rng.choice([{"a": 1}, '{"b": 2}'])}}]
        if rng.random() < 0.04:
            message["category"] = rng.choice(["math", "", 3])
        messages.append(message)
    if rng.random() < 0.1:
        return {"conversations": [{"from": m["role"], "value": m["content"]} for m in messages]}
    return {"messages": messages, **({"category": rng.choice(["chat", "", 5])} if rng.random() < 0.05 else {})}


@requires_shared_data
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_fast_path_equals_general_path_on_random_conversations(name, train_on, tokenizer_dir):
    """Random conversations built from the pieces templates treat specially (``PIECES``): the column-wise path,
    the fast path per record and Jinja give the same tokens, masks, categories and rejects. One batch of records
    the column-wise path may take (it must take some), one of anything."""
    rng = random.Random(f"{name} {train_on}")
    plain = [_plain(rng) for _ in range(400)]
    wild = [_wild(rng) for _ in range(300)]
    batches = [RawBatch(0, [json.dumps(r, ensure_ascii=rng.random() < 0.2).encode() for r in records],
                        list(range(1, len(records) + 1)), LINES) for records in (plain, wild)]
    columns = _processor(tokenizer_dir, CASES[name], train_on)
    assert columns.columns is not None, "the column-wise path refused this template at start"
    kept = columns.columns.render(batches[0].items).status == chat_columns.KEPT
    assert kept.sum() > 20, "the column-wise path takes none of the plain records"  # (Gemma's: fewest, ~50)
    records = _processor(tokenizer_dir, CASES[name], train_on, chat_render="records")
    general = _processor(tokenizer_dir, CASES[name], train_on, chat_render="jinja")
    assert records.columns is None and records.template.has_fast_path and not general.template.has_fast_path
    for k, batch in enumerate(batches):
        want = general(batch)
        _assert_same(columns(batch), want, f"{name}, batch {k}, column-wise")
        _assert_same(records(batch), want, f"{name}, batch {k}, per record")
