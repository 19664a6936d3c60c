"""Tokenizer files other than a tokenizer.json — GPT-2 BPE, SentencePiece, tiktoken — converted once to one.

Megatron-LM users arrive with GPT-2's ``vocab.json``/``encoder.json`` + ``merges.txt``/``vocab.bpe``, a
SentencePiece ``.model`` or a tiktoken rank file; the rest of xprep knows only HF ``tokenizer.json`` (ids are
``tokenizers.Tokenizer.encode(text).ids``). Each format is converted to a tokenizer.json that gives the format's
own ids, and where tokenizers cannot express a feature exactly the conversion is refused rather than made
approximate. A conversion is checked on a built-in sample against the format's reference library where it is
installed (``sentencepiece``, ``tiktoken``; GPT-2 files against ``tokenizers``' own BPE built from the files),
and is cached by content (``<cache>/converted-v<N>-<key>/``, conversion_cache.py) so it runs once. A dataset keeps
the converted tokenizer.json inside it (``prep.dataset.token_dataset.dataset_tokenizer``): clearing the cache costs
a conversion, never a dataset's tokenizer.

Conventions of the converted tokenizers (the HF convention for every tokenizer.json): a special token's text
inside a document becomes that special token, and the text on each side of it is encoded on its own.

A format is a builder in ``BUILDERS`` (format name → function of the files giving a ``Built``), one module each.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.io import file_sha256
from xprep.prep.tokenizer.built import MAX_ID, Built
from xprep.prep.tokenizer.conversion_cache import publish, read_entry
from xprep.prep.tokenizer.files import GPT2, SENTENCEPIECE, TIKTOKEN, TokenizerFiles
from xprep.prep.tokenizer.gpt2_bpe import build_gpt2
from xprep.prep.tokenizer.sentencepiece_bpe import build_sentencepiece
from xprep.prep.tokenizer.tiktoken_bpe import build_tiktoken

CONVERSION_VERSION = 2  # bump when a conversion gives another tokenizer.json for the same files

# Whitespace runs, digits, scripts, emoji: where converted tokenizers usually go wrong (see tokenizer/info.py's).
SELF_CHECK_TEXTS = [
    "Hello world! It's 2024-01-02 and we've got 1234567 tokens. DON'T SHOUT'S 'll 've",
    "  leading spaces\n\n\ttabs\r\nCRLF   trailing   \n \n\n  ",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "Ünïcödé façade naïve — “quotes” ‘single’ … ½ ℃ ™️ Ａ\u0301",
    "日本語のテキスト。中文文本，한국어 텍스트. Русский текст. العربية \u0915\u093c\u093f",
    "emoji 😀👍🏽🇺🇸 and ZWJ 👨\u200d👩\u200d👧 \U0001f9d1\u200d\U0001f4bb",
    "\u00a0\u2009\u200b\u3000\u2028\u0085\x0b\x0c zero-width, nbsp and other spaces \u00a0 x \u3000",
    "<|im_start|>user\nhi<|im_end|>\n<s> </s> <|endoftext|> <unk> <0x41> <pad>",
    "a" * 300 + " " + "ab" * 150 + " " + "9" * 40,
    "", " ", "\n",
]


@dataclass(frozen=True)
class Converted:
    """A converted tokenizer.json and what the manifest and the special-token choice need to know about it."""

    path: Path
    source: dict  # the manifest's tokenizer.source: format, files (name, sha256), options
    named: dict[str, str | None]  # eos_token / bos_token / pad_token the format itself names
    named_from: str  # where ``named`` came from, e.g. "tokenizer.model (its eos/bos/pad pieces)"
    flag_tokens: dict[str, str]  # an --eod-token/--bos-token value (TOKEN or TOKEN=ID) → the token
    notes: tuple[str, ...] = ()  # said on the console after the run


def convert(files: TokenizerFiles, flags: list[tuple[str, str]], cache: Path) -> Converted:
    """The tokenizer.json for ``files`` (converted once, cached by content under ``cache``), with the tokens of
    ``flags`` ((flag, value) of ``--eod-token``/``--bos-token``, ``TOKEN`` or ``TOKEN=ID``) added where the
    vocabulary lacks them."""
    digests = [file_sha256(p, "check the file or pass another --tokenizer") for p in files.files]
    reference = _reference_version(files.format)
    parts = [f"v{CONVERSION_VERSION}", files.format, *digests, *(p.name for p in files.files), "\0",
             *(v for _, v in flags), "\0", reference]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]
    source = {"format": files.format,
              "files": [{"name": p.name, "sha256": d} for p, d in zip(files.files, digests, strict=True)]}
    entry = cache / f"converted-v{CONVERSION_VERSION}-{key}"
    meta = read_entry(entry)
    if meta is None:
        entry, meta = publish(entry, lambda out: _convert_unchanged(files, flags, out, digests))
    return Converted(entry / "tokenizer.json", {**source, **meta["options"]}, meta["named"], meta["named_from"],
                     meta["flag_tokens"], tuple(meta["notes"]))


def _convert_unchanged(files: TokenizerFiles, flags: list[tuple[str, str]], out: Path, digests: list[str]) -> dict:
    """``_convert_into``, refused where a file changed while it was read: the entry is keyed by the digests taken
    before, so it would otherwise give the old files' key to the new files' conversion."""
    meta = _convert_into(files, flags, out)
    for path, digest in zip(files.files, digests, strict=True):
        if file_sha256(path, "check the file or pass another --tokenizer") != digest:
            raise XprepError(f"{path}: the file changed while it was being converted; run again once nothing is "
                             "writing it")
    return meta


def _convert_into(files: TokenizerFiles, flags: list[tuple[str, str]], out: Path) -> dict:
    built = BUILDERS[files.format](files)
    notes = built.notes + _add_flag_tokens(built, flags, files)
    built.tokenizer = built.make(built.vocab)
    _finish(built)
    checked = _self_check(built, files)
    notes.append(f"{files.files[0].name} ({files.format}) converted to a tokenizer.json, "
                 + (f"ids checked against {checked}" if checked else "not checked (its reference library is not "
                    "installed)"))
    (out / "tokenizer.json").write_text(built.tokenizer.to_str(), encoding="utf-8")
    return {"named": built.named, "named_from": built.named_from, "options": built.options, "notes": notes,
            "flag_tokens": built.flag_tokens}


def _reference_version(fmt: str) -> str:
    """The reference library a conversion is checked against ("none" where it is not installed): part of the
    cache key, so installing it later checks the conversion then."""
    package = {SENTENCEPIECE: "sentencepiece", TIKTOKEN: "tiktoken", GPT2: "tokenizers"}.get(fmt)
    try:
        return f"{package}-{version(package)}" if package else ""
    except PackageNotFoundError:
        return f"{package}-none"


def _finish(built: Built) -> None:
    """Mark the special tokens (placed in the vocabulary at their ids) as added special tokens."""
    from tokenizers import AddedToken  # deferred: tokenizers loads only when files are converted

    built.tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                        for t, _ in sorted(built.specials.items(), key=lambda kv: kv[1])])


def _split_flag(value: str, vocab: dict[str, int]) -> tuple[str, int | None]:
    """``TOKEN`` or ``TOKEN=ID`` (an id for a token the vocabulary lacks) → (token, id or None)."""
    match = re.fullmatch(r"(.+)=(\d+)", value)
    if value in vocab or match is None:
        return value, None
    return match[1], int(match[2])


def _add_flag_tokens(built: Built, flags: list[tuple[str, str]], files: TokenizerFiles) -> list[str]:
    """Put the ``--eod-token``/``--bos-token`` tokens the vocabulary lacks into it as special tokens; returns notes.

    A token the vocabulary has is used as it is (an ordinary token stays ordinary). A new one gets the id asked
    for (``TOKEN=ID``) or the one after the highest id.
    """
    notes, name = [], files.files[0].name
    for flag, value in flags:
        token, wanted = _split_flag(value, built.vocab)
        built.flag_tokens[value] = token
        if token in built.vocab:
            if wanted is not None and built.vocab[token] != wanted:
                raise XprepError(f"{flag} {value}: {token!r} is id {built.vocab[token]} in {name}, not {wanted}; "
                                 f"pass {flag} {token}")
            continue
        if wanted is not None and wanted > MAX_ID:
            raise XprepError(f"{flag} {value}: id {wanted:,} is above {MAX_ID:,}, the highest id a dataset stores; "
                             "choose a free id just past the vocabulary")
        taken = {i: t for t, i in built.vocab.items()}
        new_id = max(taken) + 1 if wanted is None else wanted
        if new_id in taken:
            raise XprepError(f"{flag} {value}: id {new_id} is {taken[new_id]!r} in {name}; choose a free id")
        built.vocab[token] = built.specials[token] = new_id
        how = "as asked" if wanted is not None else f"the next free id; pass {flag} {token}=ID to choose another"
        notes.append(f"{flag} {token!r} is not in {name}: added as special token id {new_id} ({how})")
    return notes


def _self_check(built: Built, files: TokenizerFiles) -> str:
    """Compare the converted tokenizer with the format's reference library on the built-in sample; refuse on any
    difference. Returns the reference's name, or "" where it is not installed."""
    reference = built.reference(dict(built.specials))
    if reference is None:
        return ""
    for text in SELF_CHECK_TEXTS:
        got, want = built.tokenizer.encode(text, add_special_tokens=False).ids, reference(text)
        if got != want:
            at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                      min(len(got), len(want)))
            raise XprepError(f"{files.files[0]}: converting this {files.format} tokenizer to a tokenizer.json does "
                             f"not reproduce {built.reference_name}: on the text {text[:60]!r} it gives "
                             f"{got[at:at + 5]} where {built.reference_name} gives {want[at:at + 5]} (token {at}); "
                             "xprep refuses to write other ids than the format's own: pass a tokenizer.json instead")
    return built.reference_name


BUILDERS = {GPT2: build_gpt2, TIKTOKEN: build_tiktoken, SENTENCEPIECE: build_sentencepiece}
