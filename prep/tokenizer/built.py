"""What converting a tokenizer format builds on: ``Built`` (what a format's files give: vocabulary, special tokens,
how to make the tokenizers.Tokenizer, the format's own encoder to check against) and the byte-level BPE pieces GPT-2
and tiktoken files share. Each format's module (gpt2_bpe.py, tiktoken_bpe.py, sentencepiece_bpe.py) returns a
``Built``; conversion.py turns it into a checked, cached tokenizer.json.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from xprep.prep.errors import XprepError

MAX_ID = 2**31 - 1  # token ids are stored as int32 at most


@dataclass
class Built:
    """What a format's files give: the vocabulary, the special tokens, and how to make the tokenizer."""

    make: Callable[[dict[str, int]], object]  # the final vocabulary → tokenizers.Tokenizer (specials not marked)
    vocab: dict[str, int]  # the model's vocabulary, special tokens placed at their ids included
    specials: dict[str, int]  # added special tokens: matched in text before anything else
    named: dict[str, str | None]
    named_from: str
    options: dict = field(default_factory=dict)
    # specials → the format's own encoder (None where its library is not installed)
    reference: Callable[[dict[str, int]], Callable[[str], list[int]] | None] = lambda specials: None
    reference_name: str = ""
    notes: list[str] = field(default_factory=list)
    flag_tokens: dict[str, str] = field(default_factory=dict)  # flag value (TOKEN or TOKEN=ID) → token
    tokenizer: object = None


def segmented(encode: Callable[[str], list[int]], specials: dict[str, int]) -> Callable[[str], list[int]]:
    """An encoder that turns special-token text into the special token and encodes the text around it on its own
    (what HF tokenizers does with added tokens: leftmost, then longest match)."""
    if not specials:
        return encode
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))

    def run(text: str) -> list[int]:
        ids, at = [], 0
        for m in pattern.finditer(text):
            ids += encode(text[at : m.start()]) + [specials[m[0]]]
            at = m.end()
        return ids + encode(text[at:])

    return run


def import_or_none(name: str):
    try:
        return __import__(name)
    except ImportError:
        return None


def version_or(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_CHARS = bytes_to_unicode()


def byte_str(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str | None, ignore_merges: bool):
    """A byte-level BPE tokenizer: GPT-2's split (``pattern`` None) or the given one, then bytes → characters."""
    # deferred: tokenizers loads only when files are converted
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def check_byte_alphabet(vocab: dict, path: Path, what: str) -> None:
    missing = [c for c in BYTE_CHARS.values() if c not in vocab]
    if missing:
        raise XprepError(f"{path}: not a byte-level BPE vocabulary: {len(missing)} of the 256 single-byte tokens are "
                         f"missing (e.g. byte {ord(missing[0]) if ord(missing[0]) < 256 else '?'}), so {what} could "
                         "not encode every text")
