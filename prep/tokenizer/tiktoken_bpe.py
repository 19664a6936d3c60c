"""tiktoken rank files (``*.tiktoken``, or Llama 3's ``tokenizer.model``) → a byte-level BPE ``Built`` whose merges
reproduce tiktoken's ranks, checked against ``tiktoken`` where it is installed."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.tokenizer.built import (
    MAX_ID,
    Built,
    byte_level_bpe,
    byte_str,
    check_byte_alphabet,
    import_or_none,
    version_or,
)
from xprep.prep.tokenizer.files import TokenizerFiles

# tiktoken files name neither their split pattern nor their special tokens (both live in code). These are
# OpenAI's (tiktoken_ext/openai_public.py) and Llama 3's; a file is matched by name, anything else gets cl100k's
# pattern and no special tokens (said on the console).
_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
           r"""\s*[\r\n]|\s+(?!\S)|\s""")
_O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
TIKTOKEN_ENCODINGS = {  # file name → (pattern name, pattern, special tokens)
    "r50k_base.tiktoken": ("r50k", _R50K, {"<|endoftext|>": 50256}),
    "p50k_base.tiktoken": ("r50k", _R50K, {"<|endoftext|>": 50256}),
    "cl100k_base.tiktoken": ("cl100k", _CL100K, {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258,
                                                  "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
                                                  "<|endofprompt|>": 100276}),
    "o200k_base.tiktoken": ("o200k", _O200K, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
    "tokenizer.model": ("llama3", _LLAMA3, {}),
}
DEFAULT_TIKTOKEN = ("cl100k", _CL100K, {})


def build_tiktoken(files: TokenizerFiles) -> Built:
    path = files.files[0]
    ranks = _read_tiktoken(path)
    pattern_name, pattern, specials = TIKTOKEN_ENCODINGS.get(path.name, DEFAULT_TIKTOKEN)
    vocab = {byte_str(t): r for t, r in ranks.items()}
    check_byte_alphabet(vocab, path, "tiktoken")
    clash = next((t for t, i in specials.items() if i in set(ranks.values())), None)
    if clash is not None:
        raise XprepError(f"{path}: the file name says {path.name}, whose {clash} is id {specials[clash]}, but the "
                         "file gives that id to a token: rename the file (xprep then names no special tokens)")
    merges = [(byte_str(a), byte_str(b)) for a, b in _tiktoken_merges(ranks)]
    vocab.update(specials)

    def reference(specials: dict[str, int]):
        tiktoken = import_or_none("tiktoken")
        if tiktoken is None:
            return None
        enc = tiktoken.Encoding(name="xprep-self-check", pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens=specials)
        return lambda t: enc.encode(t, allowed_special="all")

    known = path.name in TIKTOKEN_ENCODINGS
    # r50k's pattern is GPT-2's, which the ByteLevel pre-tokenizer has built in (and gigatoken knows)
    split = None if pattern_name == "r50k" else _onig(pattern)
    built = Built(make=lambda v: byte_level_bpe(v, merges, split, ignore_merges=True), vocab=vocab,
                   specials=dict(specials),
                   named={"eos_token": "<|endoftext|>" if "<|endoftext|>" in specials else None, "bos_token": None,
                          "pad_token": None},
                   named_from=f"{path.name} (tiktoken's {pattern_name} special tokens)",
                   options={"pattern": pattern_name}, reference=reference,
                   reference_name=f"tiktoken {version_or('tiktoken')}")
    if not known:
        built.notes.append(f"{path.name}: a tiktoken file names neither its split pattern nor its special tokens: "
                           f"used {pattern_name}'s pattern (known names: {', '.join(TIKTOKEN_ENCODINGS)})")
    return built


def _read_tiktoken(path: Path) -> dict[bytes, int]:
    """``<base64 token> <rank>`` per line → {token bytes: rank}, every token and rank once."""
    ranks: dict[bytes, int] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise XprepError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].isdigit():
                shown = line.decode("utf-8", "replace").strip()[:60]
                raise XprepError(f"{path}:{lineno}: {shown!r} is not `<base64 token> <rank>`")
            try:
                token = base64.b64decode(parts[0], validate=True)
            except (binascii.Error, ValueError):
                shown = parts[0].decode("utf-8", "replace")[:60]
                raise XprepError(f"{path}:{lineno}: {shown!r} is not base64") from None
            if token in ranks:
                raise XprepError(f"{path}:{lineno}: the token {token!r} is listed twice")
            ranks[token] = int(parts[1])
            if ranks[token] > MAX_ID:
                raise XprepError(f"{path}:{lineno}: rank {ranks[token]:,} is above {MAX_ID:,}, the highest id a "
                                 "dataset stores")
    if not ranks:
        raise XprepError(f"{path}: no `<base64 token> <rank>` lines")
    if len(set(ranks.values())) != len(ranks):
        raise XprepError(f"{path}: several tokens share a rank; each token needs its own")
    return ranks


def _tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merge rules giving tiktoken's BPE, which merges the adjacent pair whose concatenation ranks lowest (the
    leftmost of equals): a token is the merge of the two parts that BPE run on the token's own bytes comes to
    (``_last_pair``), ranked by the token's rank. Inside any longer text that forms the token, its bytes are merged
    in that same order (a merge across its edge would leave it unformed), so these rules and tiktoken agree; a token
    the run never comes to is never formed, by tiktoken either."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := _last_pair(ranks, token)) is not None:
            merges.append(pair)
    return merges


def _last_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's BPE of ``token``'s bytes merges last, or None where it stops before (every rank
    counts, higher ones than the token's own included: ``bc`` may form before ``abc`` ranks below it)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        ranked = [(r, i) for i in range(len(parts) - 1) if (r := ranks.get(parts[i] + parts[i + 1])) is not None]
        if not ranked:
            return None
        _, at = min(ranked)
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def _onig(pattern: str) -> str:
    """A pattern of ``TIKTOKEN_ENCODINGS`` (fancy-regex) for tokenizers' Oniguruma (Ruby syntax), where two things
    read otherwise: ``$`` is the end of any line there (here the end of the text: ``\\z``), and ``{n,m}+`` is a
    repeat of the repeat, not possessive (its ``+`` is dropped: each such one here ends its alternative, where
    nothing can backtrack into it). ``?+``, ``*+``, ``++`` are possessive in both."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":  # an escape, \\p{..} whole: its braces are no repeat
            end = pattern.index("}", i) + 1 if pattern[i + 1 : i + 3] in ("p{", "P{") else i + 2
            out.append(pattern[i:end])
            i = end
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        if not in_class and c == "+" and out and out[-1] == "}":
            i += 1
            continue
        out.append("\\z" if c == "$" and not in_class else c)
        i += 1
    return "".join(out)
