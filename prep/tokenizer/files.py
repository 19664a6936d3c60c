"""Which tokenizer files ``--tokenizer`` names, and their format: a tokenizer.json, GPT-2 BPE (``vocab.json``/
``encoder.json`` + ``merges.txt``/``vocab.bpe``), a SentencePiece ``.model`` or a tiktoken rank file; a directory is
searched in ``SEARCH_ORDER``. Formats other than tokenizer.json are converted once to one (conversion.py, with a
module per format: gpt2_bpe.py, sentencepiece_bpe.py, tiktoken_bpe.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from xprep.prep.errors import XprepError

TOKENIZER_JSON, GPT2, SENTENCEPIECE, TIKTOKEN = "tokenizer.json", "gpt2-bpe", "sentencepiece", "tiktoken"
GPT2_VOCAB_NAMES = ("vocab.json", "encoder.json")
GPT2_MERGES_NAMES = ("merges.txt", "vocab.bpe")
SEARCH_ORDER = ("tokenizer.json", "vocab.json or encoder.json + merges.txt or vocab.bpe (GPT-2 BPE)",
                "tokenizer.model (SentencePiece, or tiktoken ranks as Llama 3 ships them)", "one other *.model",
                "one *.tiktoken")


@dataclass(frozen=True)
class TokenizerFiles:
    """The files ``--tokenizer`` names, and their format; ``files[0]`` is the one the others sit beside."""

    format: str
    files: tuple[Path, ...]

    @property
    def directory(self) -> Path:
        return self.files[0].parent


def find_tokenizer_files(spec: str) -> TokenizerFiles:
    """Resolve ``--tokenizer`` (a file, or a directory searched in ``SEARCH_ORDER``) to files and a format."""
    path = Path(spec)
    if not path.exists():
        raise XprepError(f"--tokenizer {spec}: no such file or directory; pass a tokenizer.json (or GPT-2, "
                         "SentencePiece or tiktoken tokenizer files) or the directory holding it")
    found = _search_directory(path) if path.is_dir() else _classify_file(path)
    return TokenizerFiles(found.format, tuple(p.resolve() for p in found.files))


def _search_directory(d: Path) -> TokenizerFiles:
    if (d / "tokenizer.json").is_file():
        return TokenizerFiles(TOKENIZER_JSON, (d / "tokenizer.json",))
    vocab = next((d / n for n in GPT2_VOCAB_NAMES if (d / n).is_file()), None)
    merges = next((d / n for n in GPT2_MERGES_NAMES if (d / n).is_file()), None)
    if vocab and merges:
        return TokenizerFiles(GPT2, (vocab, merges))
    if (d / "tokenizer.model").is_file():
        return _classify_file(d / "tokenizer.model")
    for pattern in ("*.model", "*.tiktoken"):
        files = sorted(p for p in d.glob(pattern) if p.is_file())
        if len(files) > 1:
            raise XprepError(f"--tokenizer {d}: the directory holds several {pattern} files "
                             f"({', '.join(p.name for p in files)}); pass the one to use")
        if files:
            return _classify_file(files[0])
    half = vocab or merges
    if half is not None:
        missing = " or ".join(GPT2_MERGES_NAMES if vocab else GPT2_VOCAB_NAMES)
        raise XprepError(f"--tokenizer {d}: the directory holds GPT-2's {half.name} but no {missing} beside it; "
                         "GPT-2 BPE needs both the vocabulary and the merges")
    raise XprepError(f"--tokenizer {d}: the directory holds no tokenizer.json, nor any other tokenizer files xprep "
                     f"reads (looked for, in this order: {'; '.join(SEARCH_ORDER)}); pass a tokenizer.json or "
                     "the directory holding it")


# The other JSON files of a tokenizer (or model) directory: given as --tokenizer, the directory was meant
CONFIG_NAMES = ("tokenizer_config.json", "special_tokens_map.json", "config.json", "generation_config.json",
                "added_tokens.json")


def _classify_file(path: Path) -> TokenizerFiles:
    name = path.name
    if name in CONFIG_NAMES:
        raise XprepError(f"--tokenizer {path}: a {name}, not a tokenizer; pass the directory holding it "
                         f"(--tokenizer {path.parent}): xprep finds the tokenizer there and reads the "
                         "tokenizer_config.json beside it")
    if name.endswith(("vocab.json", "encoder.json")):
        return TokenizerFiles(GPT2, (path, _gpt2_partner(path, GPT2_MERGES_NAMES, "merges")))
    if name.endswith(("merges.txt", "vocab.bpe")):
        return TokenizerFiles(GPT2, (_gpt2_partner(path, GPT2_VOCAB_NAMES, "vocabulary"), path))
    head = _head(path)
    if name.endswith(".json") or head.lstrip()[:1] == b"{":
        return TokenizerFiles(TOKENIZER_JSON, (path,))
    if _looks_like_tiktoken(head):
        return TokenizerFiles(TIKTOKEN, (path,))
    if name.endswith(".tiktoken"):
        raise XprepError(f"{path}: not a tiktoken BPE file (its first line is not `<base64 token> <rank>`)")
    if head[:1] == b"\x0a":  # field 1 (pieces), length-delimited: a SentencePiece ModelProto
        return TokenizerFiles(SENTENCEPIECE, (path,))
    raise XprepError(f"{path}: neither a SentencePiece model nor a tiktoken BPE file; pass a tokenizer.json, "
                     "GPT-2 vocab.json + merges.txt, a SentencePiece .model or a .tiktoken file")


def _gpt2_partner(path: Path, names: tuple[str, ...], what: str) -> Path:
    """The other half of a GPT-2 pair beside ``path``: the same prefix (gpt2-vocab.json → gpt2-merges.txt), else
    the usual names."""
    prefix = next((path.name[: -len(s)] for s in (*GPT2_VOCAB_NAMES, *GPT2_MERGES_NAMES) if path.name.endswith(s)),
                  "")
    for candidate in [prefix + n for n in names] + list(names):
        if (path.parent / candidate).is_file():
            return path.parent / candidate
    raise XprepError(f"{path}: GPT-2 {what} file missing: no {' or '.join(prefix + n for n in names)} beside it; "
                     "GPT-2 BPE needs both the vocabulary and the merges")


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(256)
    except OSError as e:
        raise XprepError(f"{path}: cannot read it ({e.strerror})") from None


def _looks_like_tiktoken(head: bytes) -> bool:
    return re.match(rb"[A-Za-z0-9+/]+=*[ \t]\d+\r?\n", head) is not None
