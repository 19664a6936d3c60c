"""Tokenizer files other than a tokenizer.json — GPT-2 BPE, SentencePiece, tiktoken — converted once to one.

Megatron-LM users arrive with GPT-2's ``vocab.json``/``encoder.json`` + ``merges.txt``/``vocab.bpe``, a
SentencePiece ``.model`` or a tiktoken rank file; the rest of xprep knows only HF ``tokenizer.json`` (ids are
``tokenizers.Tokenizer.encode(text).ids``). Each format is converted to a tokenizer.json that gives the format's
own ids, and where tokenizers cannot express a feature exactly the conversion is refused rather than made
approximate. A conversion is checked on a built-in sample against the format's reference library where it is
installed (``sentencepiece``, ``tiktoken``; GPT-2 files against ``tokenizers``' own BPE built from the files),
and is cached by content (``<cache>/converted-v<N>-<key>/``, the cache of prep/tokenizer/encoder.py) so it
runs once. A dataset keeps the converted tokenizer.json inside it (``prep.dataset.token_dataset.dataset_tokenizer``):
clearing the cache costs a conversion, never a dataset's tokenizer.

Conventions of the converted tokenizers (the HF convention for every tokenizer.json): a special token's text
inside a document becomes that special token, and the text on each side of it is encoded on its own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.io import file_sha256, remove_tree, write_json_atomic

CONVERSION_VERSION = 2  # bump when a conversion gives another tokenizer.json for the same files
MAX_ID = 2**31 - 1  # token ids are stored as int32 at most

TOKENIZER_JSON, GPT2, SENTENCEPIECE, TIKTOKEN = "tokenizer.json", "gpt2-bpe", "sentencepiece", "tiktoken"
GPT2_VOCAB_NAMES = ("vocab.json", "encoder.json")
GPT2_MERGES_NAMES = ("merges.txt", "vocab.bpe")
SEARCH_ORDER = ("tokenizer.json", "vocab.json or encoder.json + merges.txt or vocab.bpe (GPT-2 BPE)",
                "tokenizer.model (SentencePiece, or tiktoken ranks as Llama 3 ships them)", "one other *.model",
                "one *.tiktoken")

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
# A GPT-2 vocabulary token no merge makes is special where it looks like a control token: <|endoftext|>, <s>, [CLS]
SPECIAL_LOOKING = re.compile(r"<[^<>\s\u0120\u010a\u0109]+>|\[[^\[\]\s\u0120\u010a\u0109]+\]")

# Whitespace runs, digits, scripts, emoji: where converted tokenizers usually go wrong (see tokenizer/encoder.py's).
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


# ------------------------------------------------------------------------------------------------- discovery
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


# ------------------------------------------------------------------------------------------------ conversion
@dataclass(frozen=True)
class Converted:
    """A converted tokenizer.json and what the manifest and the special-token choice need to know about it."""

    path: Path
    source: dict  # the manifest's tokenizer.source: format, files (name, sha256), options
    named: dict[str, str | None]  # eos_token / bos_token / pad_token the format itself names
    named_from: str  # where ``named`` came from, e.g. "tokenizer.model (its eos/bos/pad pieces)"
    flag_tokens: dict[str, str]  # an --eod-token/--bos-token value (TOKEN or TOKEN=ID) → the token
    notes: tuple[str, ...] = ()  # said on the console after the run


@dataclass
class _Built:
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
    meta = _read_entry(entry)
    if meta is None:
        entry, meta = _publish(entry, lambda out: _convert_unchanged(files, flags, out, digests))
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


# ---------------------------------------------------------------------------------------------------- cache
_ENTRY_KEYS = {"named": dict, "named_from": str, "options": dict, "notes": list, "flag_tokens": dict,
               "tokenizer_sha256": str}


def _read_entry(entry: Path, say: bool = True) -> dict | None:
    """A complete cache entry's metadata (``conversion.json`` is written last), or None (said when unusable)."""
    meta_path = entry / "conversion.json"
    warn = _warn if say else lambda entry, problem: None
    try:
        meta = json.loads(meta_path.read_bytes())
        sha = hashlib.sha256((entry / "tokenizer.json").read_bytes()).hexdigest()
    except FileNotFoundError:
        if entry.exists():
            warn(entry, "incomplete")
        return None
    except (OSError, ValueError) as e:
        warn(entry, f"cannot read it: {e}")
        return None
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), t) for k, t in _ENTRY_KEYS.items())):
        warn(entry, "not the shape this version of xprep writes")
        return None
    if meta["tokenizer_sha256"] != sha:
        warn(entry, "its tokenizer.json was changed after it was written")
        return None
    return meta


def _warn(entry: Path, problem: str) -> None:
    print(f"xprep: warning: {entry}: unusable converted-tokenizer cache entry ({problem}); converting again",
          file=sys.stderr)


def _publish(entry: Path, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """Build an entry in a temporary directory and rename it into place; returns (its directory, its metadata).

    An unwritable cache directory gets a temporary directory instead (said: the conversion runs every time; a
    dataset keeps its converted tokenizer.json inside it anyway, see prep.dataset.token_dataset.dataset_tokenizer).
    """
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        print(f"xprep: note: cannot write the cache in {entry.parent} ({e.strerror}): the converted tokenizer.json "
              "goes to a temporary directory, converted again every run; set XPREP_CACHE_DIR to a writable "
              "directory", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix="xprep-tokenizer-"))
        return tmp, _fill(tmp, build)
    try:
        meta = _fill(tmp, build)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if entry.exists():
        theirs = _read_entry(entry, say=False)
        if theirs is not None:  # another run published it meanwhile (and may be reading it): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return entry, theirs
        remove_tree(entry)  # a broken one, said by _read_entry
    try:
        os.replace(tmp, entry)
    except OSError:  # another run published it between the two: same content, keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        theirs = _read_entry(entry, say=False)
        if theirs is not None:
            return entry, theirs
        raise XprepError(f"{entry}: cannot publish the converted tokenizer there; remove that directory and run "
                         "again") from None
    return entry, meta


def _fill(tmp: Path, build: Callable[[Path], dict]) -> dict:
    meta = build(tmp)
    meta["tokenizer_sha256"] = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()
    write_json_atomic(tmp / "conversion.json", meta)  # last: the entry's completion marker
    return meta


# ----------------------------------------------------------------------------------- building and checking
def _finish(built: _Built) -> None:
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


def _add_flag_tokens(built: _Built, flags: list[tuple[str, str]], files: TokenizerFiles) -> list[str]:
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


def _segmented(encode: Callable[[str], list[int]], specials: dict[str, int]) -> Callable[[str], list[int]]:
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


def _self_check(built: _Built, files: TokenizerFiles) -> str:
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


def _import_or_none(name: str):
    try:
        return __import__(name)
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------------- byte level
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_CHARS = bytes_to_unicode()


def _byte_str(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str | None, ignore_merges: bool):
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


def _missing_bytes(vocab: dict, path: Path, what: str) -> None:
    missing = [c for c in BYTE_CHARS.values() if c not in vocab]
    if missing:
        raise XprepError(f"{path}: not a byte-level BPE vocabulary: {len(missing)} of the 256 single-byte tokens are "
                         f"missing (e.g. byte {ord(missing[0]) if ord(missing[0]) < 256 else '?'}), so {what} could "
                         "not encode every text")


# ---------------------------------------------------------------------------------------------- GPT-2 files
def _build_gpt2(files: TokenizerFiles) -> _Built:
    vocab_path, merges_path = files.files
    vocab = _read_gpt2_vocab(vocab_path)
    merges = _read_gpt2_merges(merges_path, vocab, vocab_path.name)
    _missing_bytes(vocab, vocab_path, "GPT-2 BPE")
    made = {a + b for a, b in merges} | set(BYTE_CHARS.values())
    unmade = {t: i for t, i in vocab.items() if t not in made}
    # the ones that look like control tokens (<|endoftext|>, RoBERTa's <s> and <mask>, [CLS]) are special; the rest
    # (a merges file shorter than its vocabulary) stay ordinary, as GPT-2's BPE never produces them either
    specials = {t: i for t, i in unmade.items() if SPECIAL_LOOKING.fullmatch(t)}
    eos = "<|endoftext|>" if "<|endoftext|>" in specials else None

    def reference(specials: dict[str, int]):
        # deferred: tokenizers loads only when files are converted
        from tokenizers import Tokenizer, models, pre_tokenizers

        try:
            model = models.BPE.from_file(str(vocab_path), str(merges_path))
        except Exception:  # noqa: BLE001 - it refuses a blank line, which xprep skips: the BPE of what xprep read
            model = models.BPE(dict(vocab), merges)
        ref = Tokenizer(model)
        ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return _segmented(lambda t: ref.encode(t, add_special_tokens=False).ids if t else [], specials)

    built = _Built(make=lambda v: _byte_level(v, merges, None, ignore_merges=False), vocab=vocab, specials=specials,
                   named={"eos_token": eos, "bos_token": None, "pad_token": None},
                   named_from=f"{vocab_path.name} (GPT-2's <|endoftext|>)", reference=reference,
                   reference_name=f"tokenizers {version('tokenizers')} (BPE from the files, byte-level split)")
    never = [t for t in unmade if t not in specials]
    if never:
        built.notes.append(f"{vocab_path.name}: {len(never):,} tokens no merge of {merges_path.name} makes (e.g. "
                           f"{never[0]!r}) are never produced, as by GPT-2's own BPE; tokens like <...> or [...] "
                           "that no merge makes are special tokens")
    return built


def _read_gpt2_vocab(path: Path) -> dict[str, int]:
    try:
        vocab = json.loads(path.read_bytes())
    except OSError as e:
        raise XprepError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise XprepError(f"{path}: not valid JSON ({e}); a GPT-2 vocabulary is a JSON object token → id") from None
    if not isinstance(vocab, dict) or not vocab:
        raise XprepError(f"{path}: a GPT-2 vocabulary is a non-empty JSON object token → id")
    bad = next((k for k, v in vocab.items() if type(v) is not int or not 0 <= v <= MAX_ID), None)
    if bad is not None:
        raise XprepError(f"{path}: the id of {bad!r} is {vocab[bad]!r}, not an integer from 0 to {MAX_ID:,}")
    if len(set(vocab.values())) != len(vocab):
        raise XprepError(f"{path}: several tokens share an id; a GPT-2 vocabulary gives each token its own")
    return vocab


def _read_gpt2_merges(path: Path, vocab: dict[str, int], vocab_name: str) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise XprepError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise XprepError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    merges = []
    for lineno, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise XprepError(f"{path}:{lineno}: {line[:60]!r} is not a merge (two tokens separated by one space)")
        lost = next((t for t in (*parts, parts[0] + parts[1]) if t not in vocab), None)
        if lost is not None:
            raise XprepError(f"{path}:{lineno}: the merge {line!r} uses {lost!r}, which {vocab_name} lacks; the "
                             "vocabulary and the merges must come from the same tokenizer")
        merges.append((parts[0], parts[1]))
    return merges


# --------------------------------------------------------------------------------------------- tiktoken files
def _build_tiktoken(files: TokenizerFiles) -> _Built:
    path = files.files[0]
    ranks = _read_tiktoken(path)
    pattern_name, pattern, specials = TIKTOKEN_ENCODINGS.get(path.name, DEFAULT_TIKTOKEN)
    vocab = {_byte_str(t): r for t, r in ranks.items()}
    _missing_bytes(vocab, path, "tiktoken")
    clash = next((t for t, i in specials.items() if i in set(ranks.values())), None)
    if clash is not None:
        raise XprepError(f"{path}: the file name says {path.name}, whose {clash} is id {specials[clash]}, but the "
                         "file gives that id to a token: rename the file (xprep then names no special tokens)")
    merges = [(_byte_str(a), _byte_str(b)) for a, b in _tiktoken_merges(ranks)]
    vocab.update(specials)

    def reference(specials: dict[str, int]):
        tiktoken = _import_or_none("tiktoken")
        if tiktoken is None:
            return None
        enc = tiktoken.Encoding(name="xprep-self-check", pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens=specials)
        return lambda t: enc.encode(t, allowed_special="all")

    known = path.name in TIKTOKEN_ENCODINGS
    # r50k's pattern is GPT-2's, which the ByteLevel pre-tokenizer has built in (and gigatoken knows)
    split = None if pattern_name == "r50k" else _onig(pattern)
    built = _Built(make=lambda v: _byte_level(v, merges, split, ignore_merges=True), vocab=vocab,
                   specials=dict(specials),
                   named={"eos_token": "<|endoftext|>" if "<|endoftext|>" in specials else None, "bos_token": None,
                          "pad_token": None},
                   named_from=f"{path.name} (tiktoken's {pattern_name} special tokens)",
                   options={"pattern": pattern_name}, reference=reference,
                   reference_name=f"tiktoken {_version_or('tiktoken')}")
    if not known:
        built.notes.append(f"{path.name}: a tiktoken file names neither its split pattern nor its special tokens: "
                           f"used {pattern_name}'s pattern (known names: {', '.join(TIKTOKEN_ENCODINGS)})")
    return built


def _version_or(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


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


# --------------------------------------------------------------------------------------- SentencePiece models
# sentencepiece_model.proto, the fields read here: ModelProto.pieces = 1 (piece = 1, score = 2, type = 3),
# trainer_spec = 2, normalizer_spec = 3.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TRAINER = {"model_type": 3, "treat_whitespace_as_suffix": 24, "byte_fallback": 35, "bos_piece": 46,
           "eos_piece": 47, "pad_piece": 48}
NORMALIZER = {"name": 1, "precompiled_charsmap": 2, "add_dummy_prefix": 3, "remove_extra_whitespaces": 4,
              "escape_whitespaces": 5}
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
META = "\u2581"  # ▁, SentencePiece's whitespace


@dataclass(frozen=True)
class SentencePieceModel:
    """The parts of a SentencePiece ``.model`` that decide its ids (read without protobuf or sentencepiece)."""

    pieces: list[tuple[str, float, int]]  # (piece, score, type) by id
    trainer: dict[int, int | bytes]  # TrainerSpec: field number → last value
    normalizer: dict[int, int | bytes]  # NormalizerSpec

    def trainer_flag(self, name: str, default: bool) -> bool:
        return bool(self.trainer.get(TRAINER[name], default))

    def normalizer_flag(self, name: str, default: bool) -> bool:
        return bool(self.normalizer.get(NORMALIZER[name], default))

    def trainer_text(self, name: str, default: str) -> str:
        value = self.trainer.get(TRAINER[name])
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else default


def read_sentencepiece(path: Path) -> SentencePieceModel:
    """Parse a SentencePiece ModelProto (protobuf wire format); a file it cannot parse is a one-line error."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise XprepError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        pieces, trainer, normalizer = [], {}, {}
        for number, value in _proto_fields(data):
            if number == 1:
                pieces.append(_piece(value))
            elif number in (2, 3):
                (trainer if number == 2 else normalizer).update(_proto_fields(value))
    except (ValueError, UnicodeDecodeError, struct.error, TypeError, AttributeError) as e:
        raise XprepError(f"{path}: not a readable SentencePiece model ({e}); pass the .model file sentencepiece "
                         "wrote, or a tokenizer.json") from None
    if not pieces or not any(t == UNKNOWN for _, _, t in pieces):
        raise XprepError(f"{path}: not a SentencePiece model (no pieces, or no unknown piece); pass the .model file "
                         "sentencepiece wrote, or a tokenizer.json")
    return SentencePieceModel(pieces, trainer, normalizer)


def _proto_fields(buf: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for everything else."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {i}")
        if i > len(buf):
            raise ValueError("truncated")
        yield number, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = 0
    for shift in range(0, 70, 7):
        if i >= len(buf):
            raise ValueError("truncated")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
    raise ValueError(f"a varint longer than 10 bytes at byte {i}")


def _piece(buf: bytes) -> tuple[str, float, int]:
    piece, score, kind = "", 0.0, NORMAL
    for number, value in _proto_fields(buf):
        if number == 1:
            piece = value.decode("utf-8")
        elif number == 2:
            (score,) = struct.unpack("<f", value)
        elif number == 3:
            kind = value
    return piece, score, kind


def _refuse_inexact(model: SentencePieceModel, path: Path) -> None:
    """Refuse what HF tokenizers cannot reproduce exactly (measured on ../shared/data corpora: see the tests)."""
    kind = MODEL_TYPES.get(model.trainer.get(TRAINER["model_type"], 1), "unknown")
    fix = "pass a tokenizer.json instead (e.g. from transformers' convert_slow_tokenizer, accepting the differences)"
    if kind == "unigram":
        raise XprepError(f"{path}: a SentencePiece unigram model cannot be converted exactly: sentencepiece adds path "
                         "scores in float32 and HF tokenizers in float64, so segmentations of equal score (e.g. "
                         "'00'+'0' and '0'+'00') come out differently (on 1 line in about 200 of real text with a "
                         f"1,000-piece model); {fix}")
    if kind != "bpe":
        raise XprepError(f"{path}: a SentencePiece {kind} model: only BPE models convert to a tokenizer.json; {fix}")
    if model.normalizer.get(NORMALIZER["precompiled_charsmap"]):
        value = model.normalizer.get(NORMALIZER["name"])
        name = value.decode("utf-8", "replace") if isinstance(value, bytes) else "custom"
        raise XprepError(f"{path}: SentencePiece normalization {name!r} cannot be reproduced exactly: HF tokenizers' "
                         "Precompiled normalizer maps a whole grapheme by its first character (e.g. '™️' or a "
                         "full-width letter with an accent lose the mark, which sentencepiece keeps); only models "
                         f"with the identity normalization (--normalization_rule_name=identity) convert; {fix}")
    if model.trainer_flag("treat_whitespace_as_suffix", False):
        raise XprepError(f"{path}: treat_whitespace_as_suffix has no tokenizer.json equivalent; {fix}")
    user_defined = [p for p, _, t in model.pieces if t == USER_DEFINED]
    if user_defined:
        raise XprepError(f"{path}: {len(user_defined)} user-defined pieces (e.g. {user_defined[0]!r}): sentencepiece "
                         "matches them inside the text as it runs its BPE, which HF tokenizers' added tokens do not "
                         f"reproduce (the whitespace around them comes out differently); {fix}")
    unused = [p for p, _, t in model.pieces if t == UNUSED]
    if unused:
        raise XprepError(f"{path}: {len(unused)} unused pieces (e.g. {unused[0]!r}): sentencepiece merges into them "
                         f"and splits them again, which a tokenizer.json cannot express; {fix}")


def _build_sentencepiece(files: TokenizerFiles) -> _Built:
    path = files.files[0]
    model = read_sentencepiece(path)
    _refuse_inexact(model, path)
    vocab = {p: i for i, (p, _, _) in enumerate(model.pieces)}
    # what sentencepiece itself refuses to load, refused here too (where it is not installed to say so)
    problem = ("a piece is listed twice" if len(vocab) != len(model.pieces) else
               "a piece is empty" if "" in vocab else
               "it has several unknown pieces" if sum(t == UNKNOWN for _, _, t in model.pieces) > 1 else
               "byte_fallback is on without the 256 byte pieces"
               if model.trainer_flag("byte_fallback", False) and sum(t == BYTE for _, _, t in model.pieces) != 256
               else None)
    if problem:
        raise XprepError(f"{path}: {problem}; not a valid SentencePiece model")
    unk = next(p for p, _, t in model.pieces if t == UNKNOWN)
    merges = _sentencepiece_merges(model.pieces)

    def make(vocab: dict[str, int]):
        # deferred: tokenizers loads only when files are converted
        from tokenizers import Tokenizer, decoders, models, normalizers

        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=model.trainer_flag("byte_fallback", False)))
        steps = _sentencepiece_normalizer(model)
        tok.normalizer = normalizers.Sequence(steps) if steps else None
        strip = [decoders.Strip(" ", 1, 0)] if model.normalizer_flag("add_dummy_prefix", True) else []
        tok.decoder = decoders.Sequence([decoders.Replace(META, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
        return tok

    def reference(specials: dict[str, int]):
        spm = _import_or_none("sentencepiece")
        if spm is None:
            return None
        try:
            sp = spm.SentencePieceProcessor(model_proto=path.read_bytes())
        except (RuntimeError, OSError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise XprepError(f"{path}: sentencepiece cannot load this model ({reason}); pass the .model file "
                             "sentencepiece wrote, or a tokenizer.json") from None
        return _segmented(lambda t: sp.encode(t) if t else [], specials)

    return _Built(make=make, vocab=vocab,
                  specials={p: i for i, (p, _, t) in enumerate(model.pieces) if t in (UNKNOWN, CONTROL)},
                  named={"eos_token": _control(model, "eos_piece"), "bos_token": _control(model, "bos_piece"),
                         "pad_token": _control(model, "pad_piece")},
                  named_from=f"{path.name} (its eos/bos/pad pieces)", options={"model_type": "bpe"},
                  reference=reference, reference_name=f"sentencepiece {_version_or('sentencepiece')}")


def _control(model: SentencePieceModel, field_name: str) -> str | None:
    """The eos/bos/pad piece the trainer spec names, where the model has it as a control piece."""
    piece = model.trainer_text(field_name, {"eos_piece": "</s>", "bos_piece": "<s>", "pad_piece": "<pad>"}[field_name])
    return piece if any(p == piece and t == CONTROL for p, _, t in model.pieces) else None


def _sentencepiece_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Merge rules giving sentencepiece's BPE: it merges the adjacent pair whose concatenation is the normal piece
    of highest score, so every split of a normal piece into two normal pieces is a merge, ranked by that score."""
    normal = {p: i for i, (p, _, t) in enumerate(pieces) if t == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in normal and b in normal:
                ranked.append((-pieces[i][1], i, normal[a], normal[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def _sentencepiece_normalizer(model: SentencePieceModel) -> list:
    """The identity normalization's whitespace handling (sentencepiece's normalizer.cc): drop leading and trailing
    spaces and squeeze runs (remove_extra_whitespaces), spaces → ▁ (escape_whitespaces), a ▁ in front
    (add_dummy_prefix). Only U+0020 is a space there, but the trailing ones are dropped after the escape, as ▁s:
    a ▁ the text itself ends with goes too (``"x▁"`` is ``"x"`` to sentencepiece)."""
    from tokenizers import Regex, normalizers  # deferred: tokenizers loads only when files are converted

    steps = []
    squeeze = model.normalizer_flag("remove_extra_whitespaces", True)
    if squeeze:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    escape = model.normalizer_flag("escape_whitespaces", True)
    if escape:
        steps.append(normalizers.Replace(" ", META))
        if squeeze:
            steps.append(normalizers.Replace(Regex(META + r"+\z"), ""))
    if model.normalizer_flag("add_dummy_prefix", True):
        steps.append(normalizers.Prepend(META if escape else " "))
    return steps


BUILDERS = {GPT2: _build_gpt2, TIKTOKEN: _build_tiktoken, SENTENCEPIECE: _build_sentencepiece}
