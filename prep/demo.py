"""The embedded demo corpus: built offline from Python's own standard library, on any machine.

``python -m xprep.prep.demo OUT`` writes
  OUT/corpus/code.jsonl   {"text", "category": "code"}         one standard-library module each
  OUT/corpus/chat.jsonl   {"messages", "category": <package>}   "what does X do?" → its docstring
  OUT/tokenizer/          a byte-level BPE trained here on the same sources, ChatML template
so ``make demo`` needs no network beyond the package registries.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from xprep.prep.chat import BUILTIN_TEMPLATES

VOCAB_SIZE = 8192
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def stdlib_files(limit_bytes: int) -> list[Path]:
    """Standard-library modules in a fixed order, up to ``limit_bytes`` of source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3") for p in rel):
            continue
        size = path.stat().st_size
        if size == 0 or size > 200_000:
            continue
        files.append(path)
        total += size
        if total >= limit_bytes:
            break
    return files


def docstring_conversations(path: Path, package: str) -> list[dict]:
    """One conversation per documented top-level function or class of a module."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    module = path.stem
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append({
                    "category": package,
                    "messages": [
                        {"role": "system", "content": "You explain the Python standard library."},
                        {"role": "user", "content": f"What does the {kind} `{module}.{node.name}` do?"},
                        {"role": "assistant", "content": doc},
                    ],
                })
    return out


def build(out: Path, limit_bytes: int = 6_000_000) -> None:
    files = stdlib_files(limit_bytes)
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    texts = []
    with open(corpus / "code.jsonl", "w") as code, open(corpus / "chat.jsonl", "w") as chat:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            texts.append(text)
            code.write(json.dumps({"text": text, "category": "code"}) + "\n")
            package = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).parts[0].removesuffix(".py")
            for conv in docstring_conversations(path, _family(package)):
                chat.write(json.dumps(conv) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": BUILTIN_TEMPLATES["chatml"],
    }, indent=2))
    n_chat = sum(1 for _ in open(corpus / "chat.jsonl"))
    print(f"demo corpus: {len(texts)} standard-library modules ({sum(map(len, texts)) / 1e6:.1f} MB), "
          f"{n_chat} docstring conversations, BPE tokenizer with {tokenizer.get_vocab_size()} tokens → {out}")


def _family(package: str) -> str:
    """Group standard-library packages into a handful of categories for channel loss."""
    groups = {
        "text": ("string", "re", "textwrap", "difflib", "unicodedata", "codecs", "html", "xml", "email", "json"),
        "system": ("os", "sys", "io", "shutil", "pathlib", "subprocess", "signal", "tempfile", "glob"),
        "concurrency": ("asyncio", "concurrent", "threading", "multiprocessing", "queue", "sched"),
        "net": ("http", "urllib", "socket", "ssl", "ftplib", "smtplib", "imaplib", "poplib", "wsgiref"),
    }
    for group, members in groups.items():
        if package in members:
            return group
    return "misc"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m xprep.prep.demo OUT_DIR")
    build(Path(sys.argv[1]))
