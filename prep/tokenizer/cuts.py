"""Where a text may be cut and its pieces encoded apart with the ids of the whole, proven from a tokenizer.json
(``clean_cuts``), and how its tokens spell the text (``spelling_rule``): what lets chat templates be encoded in
segments, and token starts be read from the tokens' bytes. Both are memoized per tokenizer content (memo.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from xprep.prep.tokenizer.info import TokenizerInfo
from xprep.prep.tokenizer.memo import cached

# Split patterns (Qwen2 and Qwen3; Llama 3) under which "\n" never joins a following character that is not
# whitespace in one pre-token: it is matched only by the whitespace alternatives, which take "\s*[\r\n]+" before
# "\s+(?!\S)", and as the [\r\n]* tail of a punctuation run; each stops before such a character. (GPT-2's
# pattern is not one of them: there "  \n" at the end of a text is one pre-token, "  " and "\n" before a word.)
NEWLINE_SAFE_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
})
CUTS_VERSION = 1  # bump when clean_cuts proves something new


@dataclass(frozen=True)
class Cuts:
    """Where a text can be cut and its pieces encoded apart with the ids of the whole (``clean_cuts``)."""

    after_newline: bool = False  # right after "\n", before a character that is not whitespace
    after_tokens: tuple[str, ...] = ()  # right after one of these added tokens

    def clean(self, text: str, at: int) -> bool:
        """Whether cutting ``text`` at character ``at`` leaves the ids of the whole equal to those of its pieces."""
        return self.spans_clean(text, ((at, at),))

    def spans_clean(self, text: str, spans) -> bool:
        """Whether every start and end of ``spans`` ((start, end, ...) in ``text``) is a clean cut (``clean``)."""
        size, newline, by_last = len(text), self.after_newline, self._by_last_char
        for span in spans:
            for at in span[:2]:
                if 0 < at < size:
                    before = text[at - 1]
                    if not (newline and before == "\n" and not text[at].isspace()):
                        ending = by_last.get(before)
                        if ending is None or not text.endswith(ending, 0, at):
                            return False
        return True

    @cached_property
    def _by_last_char(self) -> dict[str, tuple[str, ...]]:
        by: dict[str, tuple[str, ...]] = {}
        for token in self.after_tokens:
            by[token[-1]] = (*by.get(token[-1], ()), token)
        return by


METASPACE = "\u2581".encode()  # "▁": how SentencePiece tokenizers write a space
SPELLING_VERSION = 1  # bump when spelling_rule reads something new


def spelling_rule(info: TokenizerInfo) -> list:
    """[prepends, added ids] of this tokenizer, from its ``tokenizer.json`` (memoized per content): whether its
    normalizer writes each space as "▁" and puts one before each section of text between added tokens (Llama 2's
    and Mistral's: ``Prepend("▁")`` then ``Replace(" ", "▁")``, no pre-tokenizer), and its added tokens' ids."""
    return cached(info.cache_dir, f"spelling-v{SPELLING_VERSION}-{info.sha256[:40]}.json",
                  lambda: _spelling_rule(info.path), _is_spelling_rule)


def _is_spelling_rule(value) -> bool:
    """Whether a cached value has the shape ``_spelling_rule`` gives: [bool, [int, ...]]."""
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool)
            and isinstance(value[1], list) and all(isinstance(i, int) for i in value[1]))


def _spelling_rule(path: str) -> list:
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    normalizer = spec.get("normalizer") or {}
    steps = normalizer.get("normalizers") or [] if normalizer.get("type") == "Sequence" else [normalizer]
    prepends = (spec.get("pre_tokenizer") is None and len(steps) == 2
                and steps[0] == {"type": "Prepend", "prepend": "\u2581"}
                and steps[1] == {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    return [prepends, sorted(t["id"] for t in spec.get("added_tokens") or [])]


def clean_cuts(info: TokenizerInfo) -> Cuts:
    r"""The cuts proven clean for this tokenizer from its ``tokenizer.json`` (memoized per content).

    Added tokens are split out of the text first and what lies between them is encoded piece by piece, so a
    cut right after an added token ``T`` is clean where that occurrence is the one matched: no added token
    (``T`` included) overlaps its start (a proper suffix of one that is a prefix of ``T``, or holds it) and
    none extends it. A cut right after "\n", before a character that is not whitespace (``str.isspace``, a
    superset of the regex's ``\s``), is clean under a ``Split`` pattern of ``NEWLINE_SAFE_PATTERNS`` then a
    byte-level pre-tokenizer that adds no prefix space: a pre-token ends there, the patterns have no
    look-behind and their one look-ahead follows runs that ``\s*[\r\n]+`` takes first, so the pre-tokens on
    each side are those of each piece; NFC never composes "\n" with what follows; no added token holds "\n"
    before its last character. Both rules need BPE without dropout, no normalizer but NFC, a byte-level
    pre-tokenizer that adds no prefix space (a Metaspace one may treat a piece by where it starts), and added
    tokens that strip nothing (lstrip, rstrip, single_word) and are matched before normalization. Any other
    tokenizer (one that truncates or pads, too) gets no clean cut: its chat segments are checked against the
    whole text.
    """
    name = f"cuts-v{CUTS_VERSION}-{info.sha256[:40]}.json"
    after_newline, after_tokens = cached(info.cache_dir, name, lambda: _prove_cuts(info.path), _are_cuts)
    return Cuts(after_newline, tuple(after_tokens))


def _prove_cuts(path: str) -> list:
    with open(path, "rb") as f:
        spec = json.load(f)
    added = spec.get("added_tokens") or []
    model, normalizer, pre = spec.get("model") or {}, spec.get("normalizer"), spec.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or model.get("dropout") not in (None, 0)
            or spec.get("truncation") or spec.get("padding")  # pieces cut or padded alone are not the whole's
            or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized")
                   for t in added)):
        return [False, []]
    contents = [t["content"] for t in added]

    # every proper suffix of an added token: where a match that began before a token's start could still run
    suffixes = {c[k:] for c in contents for k in range(1, len(c))}

    def matched_whole(token: str) -> bool:
        return not any(token[:i] in suffixes for i in range(1, len(token) + 1)) and not any(
            token in other[1:] or (other != token and other.startswith(token)) for other in contents)

    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    split, byte_level = steps if len(steps) == 2 else ({}, steps[0] if len(steps) == 1 else {})
    if (normalizer not in (None, {"type": "NFC"}) or byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space") or (split and (
                split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                or byte_level.get("use_regex", True)))):
        return [False, []]  # a normalizer or pre-tokenizer that may treat a piece by where it starts
    after_newline = ((split.get("pattern") or {}).get("Regex") in NEWLINE_SAFE_PATTERNS
                     and not any("\n" in c[:-1] for c in contents))
    return [after_newline, [c for c in contents if c and matched_whole(c)]]


def _are_cuts(value) -> bool:
    """Whether a cached value has the shape ``_prove_cuts`` gives: [bool, [str, ...]]."""
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool)
            and isinstance(value[1], list) and all(isinstance(t, str) for t in value[1]))
