"""A chat conversation is encoded once, as its segments, where every cut between them is proven clean.

``encoder.clean_cuts`` proves two kinds of cut from a tokenizer.json: right after an added token, and right
after "\\n" before a character that is not whitespace (for the Qwen2/Qwen3 and Llama 3 split patterns). The
proof is checked here against HF tokenizers itself, on real chat and on texts built around the cuts, and the
Processor's output with it must equal its output without it (every conversation encoded whole as well and
compared), on every conversation of ../shared/data/chat and the hostile lines of test_chat_columns.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import META_TEMPLATES, SHARED, requires_shared_data
from test_chat_columns import CHATML, HOSTILE, _assert_same, _batches, _chitchat, _processor
from xprep.prep.chat.templates import BUILTIN_TEMPLATES, TemplateSpec
from xprep.prep.formats import AUTO
from xprep.prep.sources import LINES, RawBatch
from xprep.prep.tokenize.chats import ChatEncoder
from xprep.prep.tokenize.config import Options
from xprep.prep.tokenize.encode import Processor
from xprep.prep.tokenizer import Encoder, choose_backend, load_tokenizer_info
from xprep.prep.tokenizer.cuts import NEWLINE_SAFE_PATTERNS, Cuts, _prove_cuts

QWEN3 = SHARED / "tokenizers/qwen3"
LLAMA3_PATTERN = next(p for p in NEWLINE_SAFE_PATTERNS if r"\p{N}{1,3}" in p)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# what may come before a cut, and after it: the cases where pre-tokenizers join characters
LEFT = ["assistant\n", "  \n", "x!\n", "\r\n", "\n\n", "\t\n", ":\n", "<|im_end|>", "a<|im_end|>", "</think>\n\n",
        "<|im_start|>assistant\n", "x", " ", "'"]
RIGHT = ["Hello", " Hello", "  x", "\tx", "\nx", "\n", "\r", "\rx", "\u00a0x", "\u2028x", "\u3000x", "\u200bx",
         "\x1cx", "\u0301e", "e\u0301", "'s good", "'S", "123", "1", "😀!", "日本語", "<|im_end|>", "<|im_start|>",
         "!!\n\n", "?", "-", "", "x" * 40, "\u00e9t\u00e9", "\ufeffx", "\x00x", "$100"]
POOL = "ab \n\n\r\t!'s1😀é\u0301\u00a0\u2028<|im_end|>日"


def _spec(**changes) -> dict:
    spec = json.loads((QWEN3 / "tokenizer.json").read_text())
    for key, value in changes.items():
        spec[key] = value
    return spec


def _with_pattern(pattern: str) -> dict:
    spec = _spec()
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = pattern
    return spec


def _proved(tmp_path, spec: dict) -> list:
    path = tmp_path / "tokenizer.json"
    model = {**spec["model"], "vocab": {}, "merges": []}  # what the proof reads does not include them: faster
    path.write_text(json.dumps({**spec, "model": model}))
    return _prove_cuts(str(path))


@requires_shared_data
def test_what_is_proven_for_real_and_altered_tokenizers(tmp_path):
    after_newline, after = _prove_cuts(str(QWEN3 / "tokenizer.json"))
    assert after_newline and {"<|im_end|>", "<|im_start|>", "<think>", "</think>"} <= set(after)
    assert _prove_cuts(str(SHARED / "tokenizers/mistral/tokenizer.json")) == [False, []]  # Metaspace: by position
    assert _proved(tmp_path, _with_pattern(LLAMA3_PATTERN))[0]
    assert _proved(tmp_path, _with_pattern(GPT2_PATTERN)) == [False, after]  # "  \n" at a text's end is one piece
    assert _proved(tmp_path, _spec(normalizer={"type": "NFKC"})) == [False, []]
    byte_level = _spec(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "use_regex": True})
    assert _proved(tmp_path, byte_level) == [False, after]
    byte_level["pre_tokenizer"]["add_prefix_space"] = True  # each piece alone would get a space
    assert _proved(tmp_path, byte_level) == [False, []]
    spec = _spec()
    spec["model"]["dropout"] = 0.1
    assert _proved(tmp_path, spec) == [False, []]
    for key, value in (("truncation", {"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                                       "direction": "Right"}), ("padding", {"strategy": {"Fixed": 64}})):
        assert _proved(tmp_path, _spec(**{key: value})) == [False, []], key
    for flag in ("lstrip", "rstrip", "single_word", "normalized"):
        spec = _spec()
        spec["added_tokens"][2][flag] = True
        assert _proved(tmp_path, spec) == [False, []], flag
    spec = _spec()
    base = max(t["id"] for t in spec["added_tokens"]) + 1
    extra = ["<|im_end|>\n", "zz<|im_", "<aa<a", "\nx"]  # extends one, overlaps one's start, overlaps itself, "\n"
    spec["added_tokens"] += [{**spec["added_tokens"][0], "id": base + i, "content": c} for i, c in enumerate(extra)]
    after_newline, after = _proved(tmp_path, spec)
    assert not after_newline
    assert not {"<|im_end|>", "<|im_end|>\n", "<|im_start|>", "<aa<a"} & set(after)  # "zz<|im_" holds both's start
    assert {"<think>", "</think>", "zz<|im_"} <= set(after)


def _check(tokenizer, cuts: Cuts, texts_and_cuts: list[tuple[str, list[int]]]) -> tuple[int, int]:
    """Assert that wherever ``cuts`` calls every cut of a text clean, the ids of its pieces are those of the text;
    (clean, not clean) counts."""
    clean = [(t, at) for t, at in texts_and_cuts if all(cuts.clean(t, a) for a in at)]
    for i in range(0, len(clean), 256):  # HF's Encoding objects are large: a few at a time
        chunk = clean[i : i + 256]
        pieces = [[t[a:b] for a, b in zip([0, *at], [*at, len(t)], strict=True)] for t, at in chunk]
        whole = tokenizer.encode_batch_fast([t for t, _ in chunk], add_special_tokens=False)
        apart = iter(tokenizer.encode_batch_fast([p for ps in pieces for p in ps], add_special_tokens=False))
        for (text, at), w, ps in zip(chunk, whole, pieces, strict=True):
            assert w.ids == [i for _ in ps for i in next(apart).ids], (text, at)
    return len(clean), len(texts_and_cuts) - len(clean)


def _built_texts(seed: int = 0) -> list[tuple[str, int]]:
    built = [(a + b, [len(a)]) for a in LEFT for b in RIGHT]
    rng = random.Random(seed)
    for _ in range(3000):
        left = "".join(rng.choice(POOL) for _ in range(rng.randrange(0, 8))) + "\n"
        right = "".join(rng.choice(POOL) for _ in range(rng.randrange(0, 8)))
        built.append((left + right, [len(left)]))
    return built


@requires_shared_data
@pytest.mark.parametrize("pattern", ["qwen3", "llama3"])
def test_clean_cuts_split_the_ids_of_hf_tokenizers(pattern, tmp_path):
    """The proof, checked against the reference: wherever a cut is called clean, HF tokenizers' ids of the text
    are those of its two pieces: on built texts around the cuts, random ones, and every span of chitchat."""
    from tokenizers import Tokenizer  # the reference implementation itself, not the fast path's

    spec = _spec() if pattern == "qwen3" else _with_pattern(LLAMA3_PATTERN)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    cuts = Cuts(*_proved(tmp_path, spec))
    assert cuts.after_newline
    clean, unclean = _check(tokenizer, cuts, _built_texts())
    assert clean > 1500 and unclean > 500
    columns = _processor(None).columns
    conversations = []
    for batch in _batches(_chitchat(3072)):
        rendered = columns.render(batch.items)
        conversations += [(text, sorted({at for span in rendered.spans(k) for at in span} - {0, len(text)}))
                          for k, text in enumerate(rendered.texts)]
    clean, unclean = _check(tokenizer, cuts, conversations)
    assert clean > 0.99 * len(conversations)
    # not a rule that holds anyway: some cuts it refuses do change the ids
    refused = [("assistant\n\nx", 10), ("  \n", 2), ("x\r\n", 2), ("assistant\n x", 10)]
    assert not any(cuts.clean(t, at) for t, at in refused)
    assert any(tokenizer.encode(t, add_special_tokens=False).ids != tokenizer.encode(t[:at], add_special_tokens=False)
               .ids + tokenizer.encode(t[at:], add_special_tokens=False).ids for t, at in refused)


def _count_encoded(once: Processor, twice: Processor) -> dict[str, int]:
    """Characters each of the two processors hands its encoder, counted as they run."""
    encoded = {"once": 0, "twice": 0}
    for name, processor in (("once", once), ("twice", twice)):
        encode = processor.encoder.encode
        processor.encoder.encode = lambda t, name=name, encode=encode, **kw: encoded.__setitem__(
            name, encoded[name] + sum(map(len, t))) or encode(t, **kw)
    return encoded


@requires_shared_data
@pytest.mark.parametrize("template", ["qwen3", "chatml"])
@pytest.mark.parametrize("render", ["auto", "records"])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_encoding_once_equals_encoding_whole_and_segments(template, render, train_on):
    """With the proven cuts and without any (every conversation encoded whole too and compared): equal, array
    for array, on every chitchat conversation and each hostile line among real ones. (Jinja's rendering hands the
    encoder the texts and spans the per-record fast renderers do, proven so in test_chat_fast.py, whose Processors
    run with these cuts: "records" covers what it would.)"""
    spec = None if template == "qwen3" else CHATML
    once = _processor(spec, train_on=train_on, fmt=AUTO, chat_render=render)
    assert once.encoder.cuts.after_newline
    twice = _processor(spec, train_on=train_on, fmt=AUTO, chat_render=render)
    twice.encoder.cuts = Cuts()
    encoded = _count_encoded(once, twice)
    good = _chitchat(40)
    batches = _batches(_chitchat())
    batches += [RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES) for _, line, *_ in HOSTILE]
    for batch in batches:
        _assert_same(once(batch), twice(batch), f"{template} {render} line {batch.lines[0]}")
    if train_on == "assistant":  # (under --train-on all both encode the whole texts only)
        assert encoded["once"] < 0.6 * encoded["twice"]  # about half: the whole texts are not encoded


@requires_shared_data
@pytest.mark.parametrize("name", ["llama3", "llama3.1"])
def test_a_llama3_shaped_tokenizer_encodes_once_as_twice(name, tmp_path):
    """The Llama 3 and Meta's Llama 3.1 templates over a tokenizer with Llama 3's split pattern and its markers as
    added tokens (Qwen3's vocabulary beneath): answers are stripped, so every cut is clean; once equals twice,
    encoding about half, column-wise and per record. (Jinja's rendering gives the encoder what the per-record fast
    renderers give: test_chat_fast.py proves it over a tokenizer with these markers and cuts.)"""
    spec = _with_pattern(LLAMA3_PATTERN)
    base = max(t["id"] for t in spec["added_tokens"]) + 1
    markers = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    spec["added_tokens"] += [{**spec["added_tokens"][0], "id": base + i, "content": c} for i, c in enumerate(markers)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    info = load_tokenizer_info(str(tmp_path / "tokenizer.json"), eod_token="<|eot_id|>", bos_token="<|begin_of_text|>")
    source = BUILTIN_TEMPLATES["llama3"] if name == "llama3" else META_TEMPLATES["llama-3.1"]
    template = TemplateSpec(name, source, "<|begin_of_text|>", "<|eot_id|>")
    backend, _ = choose_backend(info, "auto")
    options = Options(AUTO, "text", "assistant", None, None, None, info.eod_id, info.vocab_size)
    once, twice = Processor(info, backend, template, options), Processor(info, backend, template, options)
    assert once.encoder.cuts.after_newline and "<|eot_id|>" in once.encoder.cuts.after_tokens
    twice.encoder.cuts = Cuts()
    encoded = _count_encoded(once, twice)
    good = _chitchat(40)
    batches = _batches(_chitchat(2048))
    batches += [RawBatch(0, good[:20] + [line] + good[20:], list(range(1, 42)), LINES) for _, line, *_ in HOSTILE]
    records = Processor(info, backend, template, options, "records")  # where the auto one went column-wise
    for batch in batches:
        got = once(batch)
        _assert_same(got, twice(batch), f"{name} line {batch.lines[0]}")
        _assert_same(got, records(batch), f"{name} line {batch.lines[0]}, per record")
    assert encoded["once"] < 0.6 * encoded["twice"]
    assert once.columns is not None


@requires_shared_data
@pytest.mark.parametrize("template", ["qwen3", "chatml"])
def test_train_on_all_encodes_whole_texts_as_the_segments_give_them(template, monkeypatch):
    """--train-on all with one category encodes no segment: the same output as through the segments."""
    spec = None if template == "qwen3" else CHATML
    whole = _processor(spec, train_on="all", category="chat")
    calls = []
    encode_whole = ChatEncoder._encode_whole
    monkeypatch.setattr(ChatEncoder, "_encode_whole", lambda self, *a: calls.append(1) or encode_whole(self, *a))
    segments = _processor(spec, train_on="all", category="chat")
    segments.chats._needs_segments = lambda *a: True
    for batch in _batches(_chitchat()):
        _assert_same(whole(batch), segments(batch), f"{template} line {batch.lines[0]}")
    assert len(calls) == len(_batches(_chitchat()))


@requires_shared_data
def test_a_tokenizer_json_that_truncates_or_pads_encodes_whole_documents(tmp_path):
    """A tokenizer.json saved with a model's truncation (or padding) would cut every document, and every chat
    piece on its own: HF tokenizers loads it without either."""
    spec = _spec(truncation={"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"},
                 padding={"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                          "pad_type_id": 0, "pad_token": "<|endoftext|>"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    info = load_tokenizer_info(str(tmp_path / "tokenizer.json"), eod_token="<|endoftext|>")
    text = "A sentence long enough to pass eight tokens, and then some more words."
    flat, lengths = Encoder(info, "hf").encode([text, "hi"], add_special_tokens=False)
    reference = Encoder(load_tokenizer_info(str(QWEN3)), "hf")
    assert np.array_equal(flat, reference.encode([text, "hi"], add_special_tokens=False)[0]) and lengths[0] > 8


def test_a_cut_is_clean_only_where_a_rule_says_so():
    cuts = Cuts(True, ("<|im_end|>",))
    assert cuts.clean("a\nb", 2) and cuts.clean("x<|im_end|>\n", 11) and cuts.clean("ab", 0) and cuts.clean("ab", 2)
    assert not cuts.clean("a\n b", 2) and not cuts.clean("a\n\u2028", 2) and not cuts.clean("ab", 1)
    assert not cuts.clean("x<|im_end|>\n", 10) and not Cuts().clean("a\nb", 2)
    assert not Cuts(False, ("<|im_end|>",)).clean("a\nb", 2) and not Cuts(True).clean("x<|im_end|>\n", 11)


@requires_shared_data
def test_a_batch_not_rendered_as_built_is_checked_cut_by_cut():
    """Rendered.clean trusts its shape (a head ending in "\\n" before each span, END at its end) only after
    checking it for the batch; a batch where it does not hold is checked cut by cut."""
    columns = _processor(None).columns
    lines = _chitchat(50)
    rendered = columns.render(lines)
    cuts = Cuts(*_prove_cuts(str(QWEN3 / "tokenizer.json")))
    fast = rendered.clean(cuts)
    assert fast.all()
    rendered.starts = rendered.starts - 1  # each span now starts on the "\n": not the shape, and not clean
    assert not rendered.clean(cuts).any()


@requires_shared_data
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_without_a_clean_cut_a_conversation_is_clean_only_without_spans(train_on):
    """A tokenizer with neither rule (Metaspace ones): Rendered.clean says what the per-conversation check says."""
    columns = _processor(None, train_on=train_on).columns
    rendered = columns.render(_chitchat(300))
    per_conversation = [Cuts().spans_clean(rendered.text_of(k), rendered.spans(k)) for k in range(rendered.kept)]
    assert np.array_equal(rendered.clean(Cuts()), per_conversation)
    assert any(per_conversation) == (train_on == "all")  # (unanswered conversations are kept under "all" only)
