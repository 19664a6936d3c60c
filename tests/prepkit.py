"""Test helpers for ``xprep tokenize/merge``: run in-process, compare outputs, read targets back."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from trainkit import random_docs
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter
from xprep.prep.sources import ReadSizes, read_batches
from xprep.prep.tokenize import TokenizeConfig, write
from xprep.prep.tokenize.run import run_tokenize


def tokenize(inputs, out: Path, tokenizer, **options) -> dict:
    """Run ``xprep tokenize`` in this process (fast: no interpreter start-up); returns the manifest."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    options.setdefault("workers", 1)
    config = TokenizeConfig(inputs=[str(i) for i in inputs], output=str(out), tokenizer=str(tokenizer), **options)
    return run_tokenize(config)


def read_small_batches(monkeypatch, records: int) -> None:
    """Make the tokenize runs of this process read batches of ``records`` records (no option of the command sets
    the batch size: it is ``read_batches``' ``sizes``)."""
    small = functools.partial(read_batches, sizes=ReadSizes(batch_records=records))
    monkeypatch.setattr(write, "read_batches", small)


def dir_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a directory (recursively), by relative path: for byte-for-byte comparisons."""
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_same_files(a: Path, b: Path) -> None:
    fa, fb = dir_bytes(a), dir_bytes(b)
    assert sorted(fa) == sorted(fb), f"{a} and {b} hold different files"
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs between {a} and {b}"


def write_jsonl(path: Path, records, ensure_ascii: bool = False) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=ensure_ascii) + "\n")
    return path


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def target_runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """Maximal runs of consecutive tokens whose loss mask is 1."""
    runs, current = [], []
    for token, m in zip(np.asarray(ids).tolist(), np.asarray(mask).tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def chat_records(n: int = 12) -> list[dict]:
    """Small varied conversations (system turns, several assistant turns, unicode, newlines)."""
    out = []
    for i in range(n):
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": f"You are helper number {i}."})
        for t in range(1 + i % 3):
            messages.append({"role": "user", "content": f"Question {i}.{t}: how are you? ünï\ncode"})
            messages.append({"role": "assistant", "content": f"Answer {i}.{t}: fine, thanks!\n  indented"})
        out.append({"messages": messages})
    return out


def text_records(n: int = 20) -> list[dict]:
    words = "the quick brown fox jumps over a lazy dog while json parsers decode strings".split()
    return [{"text": " ".join(words[(i * 7 + k) % len(words)] for k in range(5 + (i * 13) % 40))}
            for i in range(n)]


def schema(name: str) -> dict:
    """A JSON Schema of the project, e.g. ``"dataset"`` or ``"records/chat"``."""
    from conftest import REPO_ROOT

    return json.loads((REPO_ROOT / "schemas" / f"{name}.schema.json").read_text())


def validate(instance, name: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` conforms to schema ``name``."""
    import jsonschema

    s = schema(name)
    jsonschema.Draft202012Validator.check_schema(s)
    jsonschema.Draft202012Validator(s, format_checker=jsonschema.FormatChecker()).validate(instance)


def is_valid(instance, name: str) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(schema(name)).is_valid(instance)


def xprep_invoke(*args):
    """``xprep ARGS`` in this process (click's runner; exceptions propagate, so a traceback fails the test)."""
    from click.testing import CliRunner
    from xprep import cli

    return CliRunner().invoke(cli.xprep, list(map(str, args)), catch_exceptions=False)


def one_line_error(result) -> str:
    """Exit 2, nothing on stdout, one ``error: ...`` line on stderr, no traceback; returns the line."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert result.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def shaped_conversations(records: list[dict]) -> list[dict]:
    """Conversations (OpenAI style, a user first) reshaped as raw dumps come: some begin with the assistant (the
    opening question lost; after a system turn, too), some end with a user turn, some assistant turns are empty or
    blank (ASCII whitespace, or a wide space), and some have no assistant turn at all (rejected, not counted)."""
    out = []
    for i, record in enumerate(records):
        messages = [dict(m) for m in record["messages"]]
        if i % 5 == 0 and len(messages) > 2:
            messages = messages[1:]
        if i % 6 == 0:
            messages.insert(0, {"role": "system", "content": "Be kind."})
        if i % 7 == 0:
            messages.append({"role": "user", "content": "One more thing?"})
        answers = [m for m in messages if m["role"] == "assistant"]
        blank = {1: "", 3: " \n\t", 2: "\u3000", 4: "\n"}.get(i % 8)
        if blank is not None and answers:
            answers[i % len(answers)]["content"] = blank
        if i % 13 == 0:
            messages = [{"role": "user", "content": m["content"] or "?"} for m in messages]
        out.append({**record, "messages": messages})
    return out


def conversation_counts(records: list[dict]) -> dict:
    """What ``counts.conversations`` of a dataset made from ``records`` (--train-on assistant) must say, counted here
    the obvious way."""
    kept = [r["messages"] for r in records if any(m["role"] == "assistant" for m in r["messages"])]
    answers = [m for messages in kept for m in messages if m["role"] == "assistant"]
    first = [next(m["role"] for m in messages if m["role"] != "system") for messages in kept]
    return {"count": len(kept), "answers": len(answers), "assistant_first": first.count("assistant"),
            "empty_answers": sum(not m["content"].strip() for m in answers),
            "ends_without_answer": sum(messages[-1]["role"] != "assistant" for messages in kept)}


def category_dataset(path: Path, lengths, seed: int = 0, categories: bool = True, tokenizer_sha: str = "t") -> Path:
    """A small token dataset with a category stream (ids 0..2) built with the real writer."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    tokens = rng.integers(0, 1000, int(lengths.sum()))
    cats = rng.integers(0, 3, int(lengths.sum())).astype(np.uint8) if categories else None
    table = CategoryTable()
    table.id_of("chat")
    table.id_of("code")
    with DatasetWriter(path, vocab_size=1000) as w:
        w.append(tokens, lengths, category_ids=cats)
        w.finish({"tokenizer": {"path": "test", "sha256": tokenizer_sha, "vocab_size": 1000}}, table)
    return path


def lengths_for(seed: int, n: int = 500) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 300, n)


def random_dataset(path: Path, n: int, seed: int, tokenizer_sha: str = "a" * 64) -> Path:
    """``n`` random documents (4-39 tokens, vocabulary 128) written as a dataset with the real writer."""
    docs = random_docs(n, 4, 40, vocab=128, seed=seed)
    with DatasetWriter(path, 128) as w:
        for d in docs:
            w.append(np.asarray(d), np.array([len(d)]))
        w.finish({"tokenizer": {"path": "t", "vocab_size": 128, "pad_id": 0, "eod_id": 1, "sha256": tokenizer_sha}},
                 CategoryTable())
    return path


def web_and_mail(shared: Path, root: Path, addresses: int = 60, mails: int = 400) -> dict[str, Path]:
    """Two token datasets of real text with Mistral's tokenizer (uint16): ``web`` (paragraphs of State of the Union
    addresses, six sentences each) and ``mail`` (raw spam-assassin e-mails); made once per ``root``."""
    out = {"web": root / "web", "mail": root / "mail"}
    if all((p / "manifest.json").is_file() for p in out.values()):
        return out
    files = sorted((shared / "corpora" / "sotu").glob("*.txt"))[:addresses]
    sentences = [s for f in files for s in f.read_text(encoding="utf-8", errors="replace").split(". ")]
    write_jsonl(root / "web.jsonl", [{"text": ". ".join(sentences[i:i + 6])} for i in range(0, len(sentences), 6)])
    raw = sorted(p for p in (shared / "corpora" / "spam-assassin").rglob("*") if p.is_file())[:mails]
    write_jsonl(root / "mail.jsonl", [{"text": p.read_bytes().decode("utf-8", "replace")} for p in raw])
    mistral = shared / "tokenizers" / "mistral"
    for name, path in out.items():
        tokenize(root / f"{name}.jsonl", path, mistral)
    return out
