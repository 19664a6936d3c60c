"""``xprep tokenize`` on chat records: the token stream is the template's rendering, and the targets are
exactly the assistant turns (content + end-of-turn), on the real Qwen3 template and the built-ins."""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
import pytest
from conftest import SHARED, requires_shared_data
from prepkit import (
    assert_same_files,
    chat_records,
    conversation_counts,
    read_jsonl,
    shaped_conversations,
    target_runs,
    text_records,
    tokenize,
    validate,
    write_jsonl,
)
from xprep.prep.chat import CHAT_RENDERS
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.tokenize import TokenizeConfig

N_CHITCHAT = 400
THINK = "<think>\n\n</think>\n\n"


@functools.lru_cache(maxsize=4)
def _compiled(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False)
    return env.from_string(source)


def render_jinja(source: str, messages: list[dict], **context) -> str:
    """Render a chat template the way transformers does, independently of prep/chat/templates.py."""
    return _compiled(source).render(messages=messages, add_generation_prompt=False, **context)


def qwen3_turns(messages: list[dict]) -> list[str]:
    """What the Qwen3 template renders for each assistant turn after its ``<|im_start|>assistant\\n``: the content
    and ``<|im_end|>``; the final message, when an assistant turn after the last user message, gets an empty
    think block first."""
    def is_query(m) -> bool:  # a user turn that is not just a tool response (the template's rule)
        c = m["content"]
        return m["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))

    last_user = max((i for i, m in enumerate(messages) if is_query(m)), default=len(messages) - 1)
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"]
        if i == len(messages) - 1 and i > last_user:
            content = THINK + content.lstrip("\n")
        out.append(content + "<|im_end|>")
    return out


def decode_runs(hf, ids, mask) -> list[str]:
    return [hf.decode(run, skip_special_tokens=False) for run in target_runs(ids, mask)]


@pytest.fixture(scope="module")
def qwen3_tok():
    if not SHARED.is_dir():
        pytest.skip(f"real test data not found at {SHARED} (../shared/data)")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(SHARED / "tokenizers/qwen3/tokenizer.json"))


@pytest.fixture(scope="module")
def chitchat(tmp_path_factory, qwen3_tok, run_cli):
    """The first N_CHITCHAT conversations of chitchat.jsonl tokenized with Qwen3's own template (via the CLI)."""
    d = tmp_path_factory.mktemp("chitchat")
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:N_CHITCHAT]
    src = d / "chitchat.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, _, err = run_cli("tokenize", src, "-o", d / "ds", "--tokenizer", SHARED / "tokenizers/qwen3",
                           "--on-error", "skip")
    assert code == 0, err
    records = [json.loads(line) for line in lines]
    return d / "ds", records


def test_qwen3_stream_is_the_rendered_conversation_and_targets_are_the_assistant_turns(chitchat, qwen3_tok):
    path, records = chitchat
    kept = [r for r in records if any(m["role"] == "assistant" for m in r["messages"])]
    assert 150 < len(kept) < len(records)
    ds = TokenDataset(path)
    assert len(ds) == len(kept)
    source = json.loads((SHARED / "tokenizers/qwen3/tokenizer_config.json").read_text())["chat_template"]
    rendered_all = [render_jinja(source, r["messages"]) for r in kept]
    encoded = qwen3_tok.encode_batch(rendered_all, add_special_tokens=False)
    for i, (record, rendered, enc) in enumerate(zip(kept, rendered_all, encoded, strict=True)):
        doc = ds.document(i)
        ids, mask = doc["input_ids"].tolist(), doc["loss_mask"]
        assert ids == enc.ids, f"conversation {i}: stream"
        turns = qwen3_turns(record["messages"])
        cursor = 0
        for turn in turns:  # the expected turns are what the template rendered, in order
            cursor = rendered.index("<|im_start|>assistant\n" + turn, cursor) + 1
        assert decode_runs(qwen3_tok, ids, mask) == turns, f"conversation {i}: targets"
        assert mask[0] == 0
    m = ds.manifest
    assert m["chat_template"]["name"] == "tokenizer"
    assert m["counts"]["loss_tokens"] == int(ds.loss_mask.items.sum())
    assert "category_ids" not in m["streams"]
    validate(m, "dataset")


def test_qwen3_conversations_without_assistant_are_set_aside(chitchat):
    path, records = chitchat
    no_assistant = [n for n, r in enumerate(records, 1) if not any(m["role"] == "assistant" for m in r["messages"])]
    assert no_assistant, "chitchat has conversations with a single speaker"
    rejects = read_jsonl(path / "rejects.jsonl")
    assert [r["line"] for r in rejects] == no_assistant
    assert all(r["reason"].startswith("no assistant message") for r in rejects)
    assert all(r["source"].endswith("chitchat.jsonl") for r in rejects)
    manifest = TokenDataset(path).manifest
    assert manifest["rejects"] == {"count": len(no_assistant), "by_reason": {"no assistant message": len(no_assistant)},
                                   "file": "rejects.jsonl"}


def test_our_reference_rendering_equals_transformers_apply_chat_template(chitchat):
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers/qwen3"))
    except Exception as e:  # transformers missing or unable to load offline
        pytest.skip(f"transformers cannot load the Qwen3 tokenizer here: {e}")
    _, records = chitchat
    source = tok.chat_template
    for r in records[:40]:
        assert render_jinja(source, r["messages"]) == tok.apply_chat_template(r["messages"], tokenize=False)


def test_qwen3_template_on_system_tool_and_trailing_assistant_turns(tmp_path, qwen3_tok):
    records = [
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "sunny, 21C"},
                      {"role": "assistant", "content": "Sunny, 21 °C."}]},
        {"messages": [{"role": "user", "content": "Two answers please"}, {"role": "assistant", "content": "One."},
                      {"role": "assistant", "content": "Two."}]},
        {"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  spaced  \n"},
                      {"role": "user", "content": "<tool_response>r</tool_response>"},
                      {"role": "assistant", "content": "done"}]},
    ]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    tokenize(src, tmp_path / "ds", SHARED / "tokenizers/qwen3")
    source = json.loads((SHARED / "tokenizers/qwen3/tokenizer_config.json").read_text())["chat_template"]
    ds = TokenDataset(tmp_path / "ds")
    for i, r in enumerate(records):
        doc = ds.document(i)
        rendered = render_jinja(source, r["messages"])
        assert doc["input_ids"].tolist() == qwen3_tok.encode(rendered, add_special_tokens=False).ids, i
        assert decode_runs(qwen3_tok, doc["input_ids"], doc["loss_mask"]) == qwen3_turns(r["messages"]), i


def test_chat_backends_write_identical_bytes(tmp_path, qwen3_tok):
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:150]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for backend in ("hf", "gigatoken"):
        tokenize(src, tmp_path / backend, SHARED / "tokenizers/qwen3", backend=backend, on_error="skip")
    assert_same_files(tmp_path / "hf", tmp_path / "gigatoken")


def test_builtin_chatml_on_real_conversations(tmp_path, qwen3_tok):
    lines = (SHARED / "chat/chitchat.jsonl").read_text(encoding="utf-8").splitlines()[:80]
    records = [r for r in map(json.loads, lines) if any(m["role"] == "assistant" for m in r["messages"])]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    m = tokenize(src, tmp_path / "ds", SHARED / "tokenizers/qwen3", chat_template="chatml")
    assert m["chat_template"]["name"] == "chatml"
    ds = TokenDataset(tmp_path / "ds")
    for i, r in enumerate(records):
        rendered = "".join(f"<|im_start|>{x['role']}\n{x['content']}<|im_end|>\n" for x in r["messages"])
        doc = ds.document(i)
        assert doc["input_ids"].tolist() == qwen3_tok.encode(rendered, add_special_tokens=False).ids
        assert decode_runs(qwen3_tok, doc["input_ids"], doc["loss_mask"]) == [
            x["content"] + "<|im_end|>" for x in r["messages"] if x["role"] == "assistant"]


# -- built-in templates and record forms on the tiny tokenizer -------------------------------------------------
def hf(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory, tiny_tokenizer):
    """The tiny tokenizer plus Llama-3's special tokens (bos <|begin_of_text|>, end of turn <|eot_id|>)."""
    from tokenizers import AddedToken

    tok = hf(tiny_tokenizer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")])
    d = tmp_path_factory.mktemp("llama3_tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                         "eos_token": "<|eot_id|>"}))
    return d


def test_builtin_llama3(tmp_path, llama3_tokenizer):
    records = chat_records(12)
    records[1]["messages"][-1]["content"] = "\n  padded answer \n"
    src = write_jsonl(tmp_path / "c.jsonl", records)
    tokenize(src, tmp_path / "ds", llama3_tokenizer, chat_template="llama3")
    tok = hf(llama3_tokenizer)
    ds = TokenDataset(tmp_path / "ds")
    for i, r in enumerate(records):
        rendered = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
            for m in r["messages"])
        doc = ds.document(i)
        assert doc["input_ids"].tolist() == tok.encode(rendered, add_special_tokens=False).ids
        assert decode_runs(tok, doc["input_ids"], doc["loss_mask"]) == [
            m["content"].strip() + "<|eot_id|>" for m in r["messages"] if m["role"] == "assistant"]


def test_chatml_on_tiny_tokenizer_with_empty_and_unicode_turns(tmp_path, tiny_tokenizer):
    records = chat_records(9)
    records[0]["messages"][-1]["content"] = ""
    records[2]["messages"][-1]["content"] = "naïve café — 日本 😀"
    src = write_jsonl(tmp_path / "c.jsonl", records)
    tokenize(src, tmp_path / "ds", tiny_tokenizer, chat_template="chatml")
    tok = hf(tiny_tokenizer)
    ds = TokenDataset(tmp_path / "ds")
    for i, r in enumerate(records):
        doc = ds.document(i)
        assert decode_runs(tok, doc["input_ids"], doc["loss_mask"]) == [
            m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"]


def test_chat_template_from_a_jinja_file(tmp_path, tiny_tokenizer):
    source = ("{% for m in messages %}[{{ m.role | upper }}]:\n{{ m.content }}<|endoftext|>{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT]:\n{% endif %}")
    f = tmp_path / "template.jinja"
    f.write_text(source)
    records = chat_records(6)
    m = tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "ds", tiny_tokenizer, chat_template=str(f))
    assert m["chat_template"]["sha256"] == hashlib.sha256(source.encode()).hexdigest()
    tok = hf(tiny_tokenizer)
    ds = TokenDataset(tmp_path / "ds")
    for i, r in enumerate(records):
        rendered = "".join(f"[{x['role'].upper()}]:\n{x['content']}<|endoftext|>" for x in r["messages"])
        doc = ds.document(i)
        assert doc["input_ids"].tolist() == tok.encode(rendered, add_special_tokens=False).ids
        assert decode_runs(tok, doc["input_ids"], doc["loss_mask"]) == [
            x["content"] + "<|endoftext|>" for x in r["messages"] if x["role"] == "assistant"]


def test_sharegpt_conversations_equal_openai_messages(tmp_path, tiny_tokenizer):
    records = chat_records(10)
    role_to_from = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": role_to_from[m["role"]], "value": m["content"]} for m in r["messages"]]}
                for r in records]
    validate(sharegpt[0], "records/chat")
    a = tokenize(write_jsonl(tmp_path / "openai.jsonl", records), tmp_path / "a", tiny_tokenizer)
    b = tokenize(write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt), tmp_path / "b", tiny_tokenizer)
    for f in ("tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert a["fingerprint"] == b["fingerprint"]


def test_record_and_message_categories(tmp_path, tiny_tokenizer):
    records = [
        {"category": "smalltalk", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "category": "math"}]},
        {"messages": [{"role": "user", "content": "code?"},
                      {"role": "assistant", "content": "print(1)", "category": "code"}]},
        {"messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "yes"}]},
        {"text": "a text document", "category": "smalltalk"},
    ]
    m = tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "ds", tiny_tokenizer)
    names = m["categories"]
    assert set(names) == {"uncategorized", "smalltalk", "math", "code"}
    cid = {n: i for i, n in enumerate(names)}
    ds = TokenDataset(tmp_path / "ds")
    tok = hf(tiny_tokenizer)
    expected_run_cats = [["smalltalk", "math"], ["code"], ["uncategorized"]]
    for i, run_cats in enumerate(expected_run_cats):
        doc = ds.document(i)
        mask, cats = doc["loss_mask"], doc["category_ids"]
        record_cat = cid[records[i].get("category", "uncategorized")]
        assert set(cats[mask == 0].tolist()) == {record_cat}
        starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        for start, name in zip(starts, run_cats, strict=True):
            stop = start
            while stop < len(mask) and mask[stop]:
                stop += 1
            assert set(cats[start:stop].tolist()) == {cid[name]}
        assert len(decode_runs(tok, doc["input_ids"], mask)) == len(run_cats)
    text_doc = ds.document(3)
    assert set(text_doc["category_ids"].tolist()) == {cid["smalltalk"]}
    assert text_doc["input_ids"][-1] == tok.token_to_id("<|endoftext|>")  # EOD after text, not after chats
    assert all(ds.document(i)["input_ids"][-1] != tok.token_to_id("<|endoftext|>") for i in range(3))
    # Counts per category equal what the streams hold.
    all_cats, all_mask = ds.category_ids.items, ds.loss_mask.items
    for name, c in m["counts"]["categories"].items():
        assert c["tokens"] == int((all_cats == cid[name]).sum()), name
        assert c["loss_tokens"] == int(all_mask[all_cats == cid[name]].sum()), name


def test_category_field_for_chat(tmp_path, tiny_tokenizer):
    records = [{**r, "domain": d} for r, d in zip(chat_records(4), ["a", "b", "a", "b"], strict=True)]
    m = tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "ds", tiny_tokenizer, category_field="domain")
    assert m["categories"] == ["uncategorized", "a", "b"]
    ds = TokenDataset(tmp_path / "ds")
    assert [set(ds.category_ids[i].tolist()) for i in range(4)] == [{1}, {2}, {1}, {2}]


def test_train_on_all(tmp_path, tiny_tokenizer):
    records = chat_records(5) + [{"messages": [{"role": "user", "content": "only a user here"}]}]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    m = tokenize(src, tmp_path / "all", tiny_tokenizer, train_on="all")
    ds = TokenDataset(tmp_path / "all")
    assert len(ds) == 6 and m["rejects"]["count"] == 0
    for i in range(6):
        mask = ds.document(i)["loss_mask"].tolist()
        assert mask == [0] + [1] * (len(mask) - 1)
    assert m["options"]["train_on"] == "all"
    # The same conversations with assistant-only targets: same tokens, fewer targets; the user-only one is set aside.
    a = tokenize(src, tmp_path / "asst", tiny_tokenizer, on_error="skip")
    assert a["counts"]["documents"] == 5 and a["rejects"]["count"] == 1
    assert (tmp_path / "asst/tokens.bin").read_bytes() == ds.tokens.items[: ds.tokens.offsets()[5]].tobytes()
    assert a["counts"]["loss_tokens"] < m["counts"]["loss_tokens"]
    assert a["fingerprint"] != m["fingerprint"]


def test_mixed_text_and_chat_masks(tmp_path, tiny_tokenizer):
    records = [text_records(1)[0], chat_records(1)[0], text_records(2)[1]]
    tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "ds", tiny_tokenizer)
    ds = TokenDataset(tmp_path / "ds")
    for i in (0, 2):
        mask = ds.document(i)["loss_mask"].tolist()
        assert mask == [0] + [1] * (len(mask) - 1)
    chat_mask = ds.document(1)["loss_mask"]
    assert 0 < chat_mask.sum() < len(chat_mask)
    assert np.array_equal(np.unique(chat_mask), [0, 1])


def test_chat_render_changes_no_byte_and_no_fingerprint(tmp_path, tiny_tokenizer, run_cli):
    """``--chat-render`` picks the renderer, never the output: column-wise, record by record or Jinja, the same
    dataset (manifest and fingerprint included) on chat and text records, in process and through the CLI; a value
    it does not know is the one-line error."""
    records = [*chat_records(24), *text_records(3), {"messages": [{"role": "user", "content": "no answer"}]}]
    src = write_jsonl(tmp_path / "mixed.jsonl", records)
    fingerprints = set()
    for render in CHAT_RENDERS:
        fingerprints.add(tokenize(src, tmp_path / render, tiny_tokenizer, chat_render=render)["fingerprint"])
        assert_same_files(tmp_path / "auto", tmp_path / render)
    assert len(fingerprints) == 1
    code, _, err = run_cli("tokenize", src, "-o", tmp_path / "cli", "--tokenizer", tiny_tokenizer, "--chat-render",
                           "jinja")
    assert code == 0 and "chat template: Jinja (--chat-render jinja)" in err, err
    assert_same_files(tmp_path / "auto", tmp_path / "cli")
    with pytest.raises(XprepError, match="--chat-render fast: expected one of auto, records, jinja"):
        TokenizeConfig(inputs=[str(src)], output=str(tmp_path / "x"), tokenizer=str(tiny_tokenizer), chat_render="fast")
    with pytest.raises(XprepError, match="--worker-start forkserver: expected one of fork, spawn"):
        TokenizeConfig(inputs=[str(src)], output=str(tmp_path / "x"), tokenizer=str(tiny_tokenizer),
                       worker_start="forkserver")


def test_megatron_opens_every_stream(chitchat, tmp_path, tiny_tokenizer):
    """loss_mask and category_ids are MMIDIDX pairs too: megatron-core reads them, aligned with tokens."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    path, _ = chitchat
    records = chat_records(6)
    records[0]["category"] = "greeting"
    tokenize(write_jsonl(tmp_path / "c.jsonl", records), tmp_path / "cat", tiny_tokenizer)
    for ds_path in (path, tmp_path / "cat"):
        ours = TokenDataset(ds_path)
        tokens = indexed.IndexedDataset(str(ds_path / "tokens"))
        for name in ("loss_mask", "category_ids"):
            if not (ds_path / f"{name}.idx").exists():
                continue
            meg = indexed.IndexedDataset(str(ds_path / name))
            assert np.array_equal(meg.sequence_lengths, tokens.sequence_lengths)
            reader = getattr(ours, name)
            for i in range(0, len(ours), 7):
                assert np.array_equal(meg[i], reader[i])
    assert (tmp_path / "cat" / "category_ids.idx").exists() and (path / "loss_mask.idx").exists()


@requires_shared_data
@pytest.mark.parametrize("template", ["auto", "chatml"])
def test_the_shape_of_the_conversations_is_counted_the_same_by_every_path(template, tmp_path):
    """Issue 29: chitchat conversations reshaped as raw dumps come (assistant first, a trailing user turn, empty
    and blank answers, some without any) are counted into the manifest, the same whichever path renders them
    (column-wise, per record, Jinja; one worker or two), with the same bytes."""
    records = shaped_conversations(read_jsonl(SHARED / "chat/chitchat.jsonl")[:300])
    src = write_jsonl(tmp_path / "shaped.jsonl", records)
    want = conversation_counts(records)
    assert min(want.values()) > 10 and want["count"] < len(records)  # every case occurs, and some are rejected
    qwen = SHARED / "tokenizers/qwen3"
    runs = {"columns": ("auto", 1), "records": ("records", 1), "jinja": ("jinja", 1), "two workers": ("auto", 2)}
    for name, (render, workers) in runs.items():
        m = tokenize(src, tmp_path / name, qwen, chat_template=template, on_error="skip", workers=workers,
                     chat_render=render)
        assert m["counts"]["conversations"] == want, name
        validate(m, "dataset")
        assert_same_files(tmp_path / name, tmp_path / "columns")
