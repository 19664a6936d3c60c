"""Text → token ids, with HF ``tokenizers`` as the reference and ``gigatoken`` as the fast path.

Ids are exactly ``tokenizers.Tokenizer.encode(text).ids`` (post-processor included, e.g. a BOS).
gigatoken does not apply the post-processor, so the special tokens it adds are found once by
diffing ``encode(x)`` with and without special tokens, and added here. gigatoken is only used
after a self-check on a built-in sample (and the caller's own sample) gives identical ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.io import file_sha256, write_json_atomic
from xprep.prep.tokenizer.files import TOKENIZER_JSON, Converted, TokenizerFiles, convert, find_tokenizer_files

# Whitespace runs, digits, mixed scripts, emoji, odd unicode and special-token look-alikes:
# where BPE re-implementations usually disagree.
SELF_CHECK_SAMPLE = [
    "Hello world! It's 2024-01-02 and we've got 1234567 tokens.",
    "  leading spaces\n\n\ttabs\r\nCRLF   trailing   ",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "Ünïcödé façade naïve — “quotes” ‘single’ … ½ ℃",
    "日本語のテキスト。中文文本，한국어 텍스트. Русский текст. العربية",
    "emoji 😀👍🏽🇺🇸 and ZWJ 👨‍👩‍👧",
    "URLs https://example.com/a?b=c&d=e and e-mails a.b@c.de",
    "<|im_start|>user\nhi<|im_end|>\n<s> </s> <|endoftext|> <unk>",
    "a" * 300 + " " + "ab" * 150,
    "\u00a0\u2009\u200b zero-width and nbsp",
    "",
]
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
# End-of-turn markers of common chat templates: looked up with the other special tokens, so a chat
# dataset whose tokenizer config names no eos_token can end documents the way its template ends turns.
END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
                          "<|endoftext|>")
# Tokens that end a document (text) rather than a turn, in the order a suggestion prefers them: Llama 3's, GPT's
# and Qwen's, SentencePiece's, Gemma's.
DOCUMENT_END = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# The built-in chat templates' markers besides their end of turn: looked up too, so that a template whose markers
# the vocabulary lacks is told at no cost (tokenize's chat notes).
CHAT_MARKER_CANDIDATES = ("<|im_start|>", "<|start_header_id|>", "<|end_header_id|>")
MIN_SAMPLE_IDS = 8  # distinct ids the built-in sample must encode to: fewer means an (almost) empty vocabulary
FACTS_VERSION = 3  # bump when _tokenizer_facts computes something new
SELF_CHECK_VERSION = 2  # bump when _self_check checks something new (another sample, another comparison); 2: HF
# without the truncation or padding a tokenizer.json may set
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
# Texts on which gigatoken must encode UTF-8 bytes as it encodes str (Encoder._bytes_as_text): chat markup, text
# that normalization changes (NFC, NFKC), every width of character, whitespace runs
BYTES_PROBES = (
    "<|im_start|>assistant\nHi<|im_end|>\n", "<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>",
    "<s>[INST] q [/INST] a</s>", "e\u0301 \u212b \ufb01 \u00bd \u2460", "naïve café — 日本語 😀 👨‍👩‍👧",
    "  \t\r\n\n  x \u00a0\u3000\u2028 ", "", "x" * 300, "\ue000\U0010fffd",
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about a tokenizer, and what workers need to rebuild it."""

    path: str  # the tokenizer.json (for GPT-2, SentencePiece or tiktoken files: the one converted from them)
    sha256: str
    vocab_size: int
    eod_id: int | None
    pad_id: int | None
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None  # from tokenizer_config.json
    prefix: tuple[int, ...] = ()  # ids the post-processor puts before / after every text
    suffix: tuple[int, ...] = ()
    eod_from: str = "tokenizer_config.json"  # where eos_token/eod_id came from (see special_tokens)
    bos_from: str = "tokenizer_config.json"
    known_ids: dict[str, int | None] = field(default_factory=dict)  # ids of the special tokens looked up
    source: dict | None = None  # files converted to ``path``: format, names and sha256s (prep/tokenizer/files.py)
    notes: tuple[str, ...] = ()  # what the conversion says (said on the console with the defaults used)
    origin: str = ""  # the file --tokenizer named (for a converted tokenizer the first of its files), for messages

    def describe(self) -> dict:
        """The manifest's ``tokenizer``; ``source`` only for a converted tokenizer (a tokenizer.json's is as it was)."""
        described = {"path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size,
                     "eod_id": self.eod_id, "pad_id": self.pad_id}
        return {**described, "source": self.source} if self.source is not None else described

    def special_tokens(self) -> dict:
        """End-of-document and BOS tokens with where each came from (the manifest's ``special_tokens``)."""
        bos_id = self.known_ids.get(self.bos_token) if self.bos_token else None
        return {"eod": {"token": self.eos_token, "id": self.eod_id, "from": self.eod_from},
                "bos": {"token": self.bos_token, "id": bos_id, "from": self.bos_from}}

    def defaults_used(self, chat: bool) -> list[str]:
        """One line per special token taken from a default rather than the tokenizer's config.

        BOS only matters to chat templates (text gets the post-processor's own special tokens).
        """
        lines = list(self.notes)
        if self.eod_from.startswith("default"):
            lines.append(f"end-of-document token {self.eos_token!r} (id {self.eod_id}) is a {self.eod_from}; "
                         "pass --eod-token TOKEN to choose another")
        if chat and self.bos_token and self.bos_from.startswith("default"):
            lines.append(f"BOS token {self.bos_token!r} is a {self.bos_from}; pass --bos-token TOKEN "
                         "(or --bos-token '' for none) to choose another")
        return lines

    def with_eod(self, token: str, source: str) -> TokenizerInfo:
        return replace(self, eos_token=token, eod_id=self.known_ids[token], eod_from=source)


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer_info(spec: str, eod_token: str | None = None, bos_token: str | None = None) -> TokenizerInfo:
    """Resolve ``--tokenizer`` (a tokenizer.json, GPT-2/SentencePiece/tiktoken files, or a directory holding them;
    see prep/tokenizer/files.py) and read the tokenizer_config.json beside it.

    ``eod_token``/``bos_token`` (``--eod-token``/``--bos-token``) override the config's eos/bos; where neither names
    one, the token the format itself names (a SentencePiece model's eos/bos pieces, GPT-2's <|endoftext|>) is
    taken, else the first of the usual candidates found in the vocabulary, and ``eod_from``/``bos_from`` say so.
    For converted formats a flag's token the vocabulary lacks is added to it (``TOKEN=ID`` chooses its id).
    """
    files = find_tokenizer_files(spec)
    path, converted, eod_token, bos_token = _tokenizer_json(files, eod_token, bos_token)
    named = converted.named if converted else {}
    sha = file_sha256(path, "check the file or pass another --tokenizer")
    cfg_path = files.directory / "tokenizer_config.json"
    config = _read_config(cfg_path)
    eos, bos, pad = (_token_str(config.get(k)) for k in ("eos_token", "bos_token", "pad_token"))
    pad = pad or named.get("pad_token")
    candidates = [t for t in (eod_token, bos_token, eos, bos, pad, *named.values()) if t]
    facts = _tokenizer_facts(path, sha, list(dict.fromkeys(
        [*candidates, *EOD_CANDIDATES, *BOS_CANDIDATES, *END_OF_TURN_CANDIDATES, *CHAT_MARKER_CANDIDATES])))
    ids = facts["ids"]
    _check_encodes_text(path, facts)
    from_format = (named.get("eos_token"), converted.named_from) if converted else (None, "")
    eos, eod_from = _pick_special(ids, eod_token, "--eod-token", eos, "eos_token", cfg_path, EOD_CANDIDATES,
                                  from_format)
    if bos_token is None and "bos_token" in config:  # the config names it, possibly as null: no BOS
        bos_token, bos_from = bos, "tokenizer_config.json"
    else:
        from_format = (named.get("bos_token"), converted.named_from) if converted else (None, "")
        bos_token, bos_from = _pick_special(ids, bos_token, "--bos-token", bos, "bos_token", cfg_path,
                                            BOS_CANDIDATES, from_format)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise XprepError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}} objects")
    return TokenizerInfo(
        path=str(path),
        sha256=sha,
        vocab_size=facts["vocab_size"],
        eod_id=ids.get(eos) if eos else None,
        pad_id=ids.get(pad) if pad else None,
        bos_token=bos_token or None,
        eos_token=eos,
        chat_template=template,
        prefix=tuple(facts["prefix"]),
        suffix=tuple(facts["suffix"]),
        eod_from=eod_from,
        bos_from=bos_from,
        known_ids=ids,
        source=converted.source if converted else None,
        notes=converted.notes if converted else (),
        origin=str(files.files[0]),
    )


def _tokenizer_json(files: TokenizerFiles, eod_token: str | None, bos_token: str | None
                    ) -> tuple[Path, Converted | None, str | None, str | None]:
    """(The tokenizer.json to load, its conversion from other files or None, the flags' tokens): a flag value
    ``TOKEN=ID`` becomes ``TOKEN`` once the conversion has put it at ``ID``."""
    if files.format == TOKENIZER_JSON:
        return files.files[0], None, eod_token, bos_token
    flags = [(f, v) for f, v in (("--eod-token", eod_token), ("--bos-token", bos_token)) if v]
    converted = convert(files, flags, cache_dir())
    eod_token, bos_token = (converted.flag_tokens.get(v, v) if v else v for v in (eod_token, bos_token))
    return converted.path, converted, eod_token, bos_token


def _read_config(cfg_path: Path) -> dict:
    if not cfg_path.is_file():
        return {}
    try:
        config = json.loads(cfg_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XprepError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise XprepError(f"{cfg_path}: expected a JSON object, got a {type(config).__name__}")
    return config


def _pick_special(ids: dict, flag_value: str | None, flag: str, configured: str | None, key: str, cfg_path: Path,
                  candidates: tuple[str, ...], from_format: tuple[str | None, str] = (None, "")
                  ) -> tuple[str | None, str]:
    """(token, where it came from): the flag, else the config's ``key``, else the token the tokenizer files name
    (``from_format``: token, where), else the first candidate in the vocabulary."""
    if flag_value is not None:
        if flag_value and ids.get(flag_value) is None:
            raise XprepError(f"{flag} {flag_value}: not a token of this tokenizer's vocabulary; pass a special token "
                             "it has (e.g. one of its added tokens)")
        return flag_value or None, flag
    if configured and ids.get(configured) is not None:
        return configured, "tokenizer_config.json"
    if from_format[0] and ids.get(from_format[0]) is not None:
        return from_format
    found = next((t for t in candidates if ids.get(t) is not None), None)
    if configured:
        why = f"{cfg_path.name}'s {key} {configured!r} is not in the vocabulary"
    elif cfg_path.is_file():
        why = f"{cfg_path.name} names no {key}"
    else:
        why = f"there is no {cfg_path.name} beside the tokenizer"
    return found, f"default ({why})"


def marker_pieces(info: TokenizerInfo, markers: list[str]) -> dict[str, int]:
    """Of ``markers``, those that are no single token of this vocabulary, with how many tokens each is encoded as
    (memoized per content; the tokenizer is loaded only where a marker is not among the tokens looked up already)."""
    unknown = [m for m in markers if m not in info.known_ids]
    if not unknown and all(info.known_ids[m] is not None for m in markers):
        return {}

    def compute() -> dict:
        hf = _load_hf(Path(info.path))
        return {m: len(hf.encode(m, add_special_tokens=False).ids) for m in markers if hf.token_to_id(m) is None}

    key = hashlib.sha256("\0".join([info.sha256, *markers]).encode()).hexdigest()[:40]
    return _cached(f"markers-v1-{key}.json", compute,
                   lambda v: isinstance(v, dict) and all(isinstance(n, int) for n in v.values()))


def _check_encodes_text(path: Path, facts: dict) -> None:
    """Refuse a tokenizer that turns text into (almost) nothing: e.g. an empty vocabulary, or only an unknown token."""
    distinct, chars = facts["sample_distinct_ids"], facts["sample_chars"]
    if distinct < MIN_SAMPLE_IDS:
        raise XprepError(f"{path}: this tokenizer cannot encode text: {chars:,} characters of varied sample text "
                         f"become {facts['sample_ids']:,} ids of which {distinct} distinct (an empty or almost "
                         "empty vocabulary?); check the file or pass another --tokenizer")


def cache_dir() -> Path:
    """Where derived facts about tokenizers are memoized ($XPREP_CACHE_DIR, else ~/.cache/xprep)."""
    env = os.environ.get("XPREP_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xprep"


_UNWRITABLE: set[Path] = set()  # cache directories already said to be unwritable (said once a process)


def _cached(name: str, compute: Callable[[], object], valid: Callable[[object], bool]):
    """Memoize a JSON-able result in ``cache_dir()/name``; ``name`` must hold every input and a version.

    An entry that cannot be read, is not JSON, or is not what ``valid`` expects is said on stderr (one
    line naming the file), then recomputed and rewritten, never used. A cache directory that cannot be
    written just recomputes each time (said once).
    """
    path = cache_dir() / name
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        pass
    except OSError as e:
        _warn_unusable(path, f"cannot read it: {e.strerror}")
    except ValueError as e:  # not UTF-8, not JSON
        _warn_unusable(path, f"not valid JSON: {e}")
    else:
        if valid(value):
            return value
        _warn_unusable(path, "not the shape this version of xprep writes")
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, value)
    except OSError as e:
        if path.parent not in _UNWRITABLE:
            _UNWRITABLE.add(path.parent)
            print(f"xprep: note: cannot write the cache in {path.parent} ({e.strerror}): tokenizer facts are "
                  "recomputed every run; set XPREP_CACHE_DIR to a writable directory", file=sys.stderr)
    return value


def _warn_unusable(path: Path, problem: str) -> None:
    print(f"xprep: warning: {path}: unusable cache entry ({problem}); recomputing it", file=sys.stderr)


def _tokenizer_facts(path: Path, sha: str, tokens: list[str]) -> dict:
    """Vocabulary size, ids of named tokens and the post-processor's added ids, keyed by content.

    Loading a 150k-token HF tokenizer takes ~0.5-1 s per process; these facts are all the fast
    path needs, so they are computed once per tokenizer file content.
    """
    def compute() -> dict:
        hf = _load_hf(path)
        with_special = hf.encode("x").ids
        plain = hf.encode("x", add_special_tokens=False).ids
        at = _find(with_special, plain)
        sample = "\n".join(SELF_CHECK_SAMPLE)
        sample_ids = hf.encode(sample, add_special_tokens=False).ids
        return {  # ids may have holes (tiktoken's special tokens): the size is the highest id + 1
            "vocab_size": max(hf.get_vocab_size(with_added_tokens=True),
                              max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1),
            "ids": {t: hf.token_to_id(t) for t in tokens},
            "prefix": with_special[:at],
            "suffix": with_special[at + len(plain):],
            "sample_chars": len(sample),
            "sample_ids": len(sample_ids),
            "sample_distinct_ids": len(set(sample_ids)),
        }

    key = hashlib.sha256(("\0".join([f"v{FACTS_VERSION}", sha, *tokens])).encode()).hexdigest()[:40]
    return _cached(f"tokenizer-{key}.json", compute, _are_facts)


_FACT_INTS = ("vocab_size", "sample_chars", "sample_ids", "sample_distinct_ids")


def _are_facts(value) -> bool:
    """Whether a cached value has the shape ``_tokenizer_facts`` computes."""
    return (isinstance(value, dict) and all(isinstance(value.get(k), int) for k in _FACT_INTS)
            and isinstance(value.get("ids"), dict)
            and all(isinstance(i, int) or i is None for i in value["ids"].values())
            and all(isinstance(value.get(k), list) and all(isinstance(i, int) for i in value[k])
                    for k in ("prefix", "suffix")))


@lru_cache(maxsize=4)
def _load_hf(path: Path):
    """The HF tokenizer (loaded once per process: a 150k-token vocabulary takes ~0.5 s)."""
    from tokenizers import Tokenizer  # deferred: with cached facts and gigatoken, HF tokenizers never loads

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise XprepError(f"{path}: not a loadable HF tokenizer.json ({e})") from None
    tokenizer.no_truncation()  # a document is encoded whole: a model's max_length is no cut for a corpus
    tokenizer.no_padding()
    return tokenizer


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
    return _cached(f"spelling-v{SPELLING_VERSION}-{info.sha256[:40]}.json", lambda: _spelling_rule(info.path),
                   lambda v: isinstance(v, list) and len(v) == 2 and isinstance(v[0], bool)
                   and isinstance(v[1], list) and all(isinstance(i, int) for i in v[1]))


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
    after_newline, after_tokens = _cached(name, lambda: _prove_cuts(info.path), _are_cuts)
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


class Encoder:
    """Batch encoder returning flat ids plus per-text lengths (CSR), never per-token Python."""

    def __init__(self, info: TokenizerInfo, backend: str):
        self.info = info
        self.backend = backend
        self._giga = _load_gigatoken(info.path) if backend == "gigatoken" else None
        self.prefix = np.array(info.prefix, np.int64)
        self.suffix = np.array(info.suffix, np.int64)

    @cached_property
    def cuts(self) -> Cuts:
        """Cuts of a text proven to leave its ids unchanged (``clean_cuts``)."""
        return clean_cuts(self.info)

    @property
    def hf(self):
        """The reference HF tokenizer, loaded on first use (the fast path rarely needs it)."""
        return _load_hf(Path(self.info.path))

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Encode texts → (flat int64 ids, int64 lengths)."""
        if self._giga is not None:
            flat, lengths = _giga_encode(self._giga, texts)
            if add_special_tokens and (len(self.prefix) or len(self.suffix)):
                flat, lengths = add_around(flat, lengths, self.prefix, self.suffix)
            return flat, lengths
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=add_special_tokens) if hasattr(
            self.hf, "encode_batch_fast") else self.hf.encode_batch(texts, add_special_tokens=add_special_tokens)
        lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        flat = np.concatenate([np.asarray(e.ids, np.int64) for e in encodings]) if encodings else np.zeros(0, np.int64)
        return flat, lengths

    def encode_utf8(self, texts: list[str], data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encode ``texts``, then each UTF-8 piece ``data[offsets[i]:offsets[i + 1]]``, in one call and without special
        tokens: gigatoken reads the pieces' bytes where they lie (no str for each), where it encodes bytes as it
        encodes their text (``_bytes_as_text``); else they are decoded first."""
        if self._giga is None or not self._bytes_as_text:
            cuts = offsets.tolist()
            pieces = [data[a:b].tobytes().decode("utf-8") for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            return self.encode(texts + pieces, add_special_tokens=False)
        head = [t.encode("utf-8") for t in texts]
        lead = np.frombuffer(b"".join(head), np.uint8)
        all_data = np.concatenate([lead, data[offsets[0] : offsets[-1]]])
        all_offsets = np.concatenate([csr_offsets([len(h) for h in head]), offsets[1:] - offsets[0] + len(lead)])
        return _giga_encode(self._giga, _bytestrings(all_data, all_offsets))

    def warm(self, chat: bool) -> None:
        """Load what the first batch would: gigatoken's batch results are awkward arrays (~0.15 s to import); a chat's
        token starts read the vocabulary's spelling (``_spelling``: ~0.05 s, 151k ids) and the memoized verdict
        on offsets."""
        if self._giga is None:
            return
        _ = self._bytes_as_text
        if chat:
            _ = self._spelling
            self._offsets_are_bytes()

    @cached_property
    def _bytes_as_text(self) -> bool:
        """Whether gigatoken encodes a text's UTF-8 bytes as it encodes the text (checked on ``BYTES_PROBES`` and the
        special tokens looked up for this tokenizer, once per Encoder)."""
        texts = [*BYTES_PROBES, "\n".join(t for t in self.info.known_ids if t)]
        data = np.frombuffer("".join(texts).encode("utf-8"), np.uint8)
        offsets = csr_offsets([len(t.encode("utf-8")) for t in texts])
        (ids, lengths), (text_ids, text_lengths) = (_giga_encode(self._giga, _bytestrings(data, offsets)),
                                                    _giga_encode(self._giga, texts))
        return np.array_equal(ids, text_ids) and np.array_equal(lengths, text_lengths)

    def offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Reference ids and character start offsets of ``text`` (no special tokens added)."""
        enc = self.hf.encode(text, add_special_tokens=False)
        return np.array(enc.ids, np.int64), np.array([s for s, _ in enc.offsets], np.int64)

    def char_starts(self, text: str, ids: np.ndarray) -> np.ndarray:
        """The character offset at which each of ``ids`` (this encoder's ids of ``text``, no special tokens added)
        begins, as HF tokenizers' offsets give it.

        From gigatoken's own token bytes where they spell ``text`` exactly and this tokenizer's offsets are
        byte-derived (``_offsets_verdict``, checked against HF once per tokenizer and memoized): then HF
        tokenizers never loads (~1 s). Elsewhere (a normalizer that changed the text, HF as the backend) from
        HF's offsets, whose ids must be ``ids``.
        """
        starts = self._starts_from_bytes(text, ids)
        if starts is not None and self._offsets_are_bytes():
            return starts
        ref_ids, starts = self.offsets(text)
        if not np.array_equal(ref_ids, ids):
            raise XprepError("the encoder disagrees with HF tokenizers on a rendered chat; use --backend hf")
        return starts

    def _starts_from_bytes(self, text: str, ids: np.ndarray) -> np.ndarray | None:
        """``byte_char_starts`` of ``ids`` from their spelling (``_spelled_starts``), or None where gigatoken does not
        encode or the tokens do not spell ``text`` byte for byte (a normalizer changed it)."""
        if self._giga is None:
            return None
        data = np.frombuffer(text.encode(), np.uint8)
        starts, spelled = self._spelled_starts(data, np.array([0, len(data)]), ids, np.array([len(ids)]))
        return byte_char_starts(data, starts) if spelled[0] else None

    def token_starts(self, data: np.ndarray, bounds: np.ndarray, flat: np.ndarray, lengths: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """``_spelled_starts`` of several texts at once, or None where this tokenizer's offsets are not its
        spelling's (``_offsets_are_bytes``)."""
        if self._giga is None or not self._offsets_are_bytes():
            return None
        return self._spelled_starts(data, bounds, flat, lengths)

    def _spelled_starts(self, data: np.ndarray, bounds: np.ndarray, flat: np.ndarray, lengths: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Where each token of several texts begins, in bytes of ``data`` (text k is ``data[bounds[k]:bounds[k + 1]]``,
        its ids the k-th ``lengths`` of ``flat``), from the tokens' spelling (``_spelling``); and per text whether
        its tokens spell it byte for byte (where not, its starts are not to be used)."""
        spelled, offsets, opens, added = self._spelling
        at, size = offsets[flat], offsets[flat + 1] - offsets[flat]
        first_token = csr_offsets(lengths)
        if opens is not None and len(flat):  # the ▁ the normalizer put before each section is no byte of the text
            first = np.zeros(len(flat), bool)
            first[1:] = added[flat[:-1]]
            first[first_token[:-1][lengths > 0]] = True  # each text starts a section
            drop = first & opens[flat] & ~added[flat]
            at, size = at + drop, size - drop
        row = np.repeat(np.arange(len(lengths)), lengths)
        spent = csr_offsets(size)  # bytes spelled before each token, over all texts
        starts = bounds[:-1][row] + spent[:-1] - spent[first_token[:-1]][row]
        ok = spent[first_token[1:]] - spent[first_token[:-1]] == np.diff(bounds)
        ends_empty = lengths > 0
        ends_empty[ends_empty] = size[first_token[1:][ends_empty] - 1] == 0
        ok &= ~ends_empty  # (a last token of no byte would start past its text)
        # the tokens of the texts spelled to their length tile those texts byte after byte: compare every byte
        take = ok[row]
        in_text = np.flatnonzero(np.repeat(ok, np.diff(bounds)))
        source = in_text.astype(np.int32) + np.repeat((at[take] - starts[take]).astype(np.int32), size[take])
        wrong = spelled[source] != data[in_text]  # (int32: a batch is far below 2 GB)
        if wrong.any():
            ok[np.searchsorted(bounds, in_text[wrong], side="right") - 1] = False
        return starts, ok

    @cached_property
    def _spelling(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """How each id spells the text: its bytes (flat, CSR ``offsets``) as gigatoken's vocabulary holds them, with
        "▁" read as the space it stands for where the normalizer writes spaces so (``spelling_rule``); then
        ``opens``: the ids whose "▁" first may be the one it prepends to a section (None where it prepends none),
        and ``added``: the added tokens' ids, between which the sections lie. Built once per encoder."""
        prepends, added_ids = spelling_rule(self.info)
        vocab = self._giga.backend.vocab
        pieces = [vocab.get(i, b"") for i in range(max(vocab, default=-1) + 1)]
        if prepends:
            pieces = [p.replace(METASPACE, b" ") for p in pieces]
        offsets = csr_offsets([len(p) for p in pieces])
        added = np.zeros(len(pieces) + 1, bool)
        added[[i for i in added_ids if i < len(pieces)]] = True
        opens = np.array([p[:1] == b" " for p in pieces] + [False]) if prepends else None
        return np.frombuffer(b"".join(pieces), np.uint8), offsets, opens, added

    def _offsets_are_bytes(self) -> bool:
        if not hasattr(self, "_bytes_verdict"):
            self._bytes_verdict = _offsets_verdict(self)[0]
        return self._bytes_verdict


def byte_char_starts(data: np.ndarray, first_bytes: np.ndarray) -> np.ndarray:
    """Index of the character that holds each of ``first_bytes`` in the UTF-8 bytes ``data``: a token that begins
    inside a character gets that character's index."""
    char_of_byte = np.cumsum((data & 0xC0) != 0x80) - 1  # a UTF-8 continuation byte adds no character
    return char_of_byte[first_bytes] if len(data) else first_bytes


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    raise XprepError("tokenizer post-processor rewrites the text itself; use --backend hf")


@lru_cache(maxsize=4)
def _load_gigatoken(path: str):
    import gigatoken  # optional: without it choose_backend falls back to HF tokenizers

    return gigatoken.Tokenizer(path)


def _giga_encode(giga, texts) -> tuple[np.ndarray, np.ndarray]:
    """gigatoken's ids of ``texts`` (a list of str, or ``_bytestrings``) as (flat int64 ids, int64 lengths)."""
    import awkward as ak  # deferred: ~0.35 s to import, and only the gigatoken path needs it

    layout = ak.to_layout(giga.encode_batch(texts))
    offsets = np.asarray(layout.offsets.data)
    flat = np.asarray(layout.content.data)[offsets[0] : offsets[-1]].astype(np.int64)
    return flat, np.diff(offsets).astype(np.int64)


def _bytestrings(data: np.ndarray, offsets: np.ndarray):
    """An awkward array of byte strings over ``data`` (piece i at ``offsets[i]:offsets[i + 1]``), copying nothing:
    what gigatoken's batch encoder reads as flat buffers."""
    import awkward as ak  # deferred: as in _giga_encode

    content = ak.contents.NumpyArray(data, parameters={"__array__": "byte"})
    return ak.Array(ak.contents.ListOffsetArray(ak.index.Index64(offsets), content,
                                                parameters={"__array__": "bytestring"}))


def csr_offsets(lengths) -> np.ndarray:
    """CSR offsets of ``lengths``: [0, l0, l0+l1, ...] (int64), where each of them starts laid end to end, and
    (last) where the last ends."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def add_around(flat: np.ndarray, lengths: np.ndarray, prefix: np.ndarray, suffix: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Put ``prefix`` before and ``suffix`` after every sequence of a CSR batch (vectorized)."""
    n, p, s = len(lengths), len(prefix), len(suffix)
    new_lengths = lengths + p + s
    out = np.empty(int(new_lengths.sum()), flat.dtype)
    starts = np.zeros(n, np.int64)
    np.cumsum(new_lengths[:-1], out=starts[1:])
    body = np.ones(len(out), bool)
    for j in range(p):
        out[starts + j] = prefix[j]
        body[starts + j] = False
    ends = starts + new_lengths
    for j in range(s):
        out[ends - s + j] = suffix[j]
        body[ends - s + j] = False
    out[body] = flat
    return out, new_lengths


def choose_backend(info: TokenizerInfo, requested: str) -> tuple[str, str]:
    """Pick the encoder backend; gigatoken only if it loads and matches HF on the self-check sample.

    The verdict is memoized per (self-check version, tokenizer content, gigatoken version,
    tokenizers version). Returns (backend, reason) so the caller can say what it chose and why.
    """
    if requested == "hf":
        return "hf", "requested"
    try:
        versions = f"{version('gigatoken')}-{version('tokenizers')}"
    except PackageNotFoundError:  # gigatoken not installed: no fast path
        ok, reason = False, "gigatoken is not installed"
    else:
        name = f"selfcheck-v{SELF_CHECK_VERSION}-{info.sha256[:40]}-{versions}.json"
        ok, reason = _cached(name, lambda: _self_check(info), _is_verdict)
    if ok:
        return "gigatoken", reason
    if requested == "gigatoken":
        raise XprepError(f"--backend gigatoken: {reason}; use --backend auto or hf")
    print(f"xprep: using HF tokenizers: {reason}", file=sys.stderr)
    return "hf", reason


# Where a chat span boundary splits a pre-token: text whose tokens straddle a boundary, and the sample's.
OFFSETS_SAMPLE = [*SELF_CHECK_SAMPLE, "<|im_start|>assistant\n\n\nanswer<|im_end|>", "x😀y日本語  z", "é\u0301 ½ "]
OFFSETS_CHECK_VERSION = 2  # bump when _offsets_check checks something new


def _offsets_verdict(encoder: Encoder) -> list:
    """[ok, reason]: whether character offsets derived from gigatoken's token bytes (``byte_char_starts``) equal
    HF tokenizers' offsets on ``OFFSETS_SAMPLE`` for this tokenizer; memoized like the self-check."""
    versions = f"{version('gigatoken')}-{version('tokenizers')}"
    name = f"offsets-v{OFFSETS_CHECK_VERSION}-{encoder.info.sha256[:40]}-{versions}.json"
    return _cached(name, lambda: _offsets_check(encoder), _is_verdict)


def _offsets_check(encoder: Encoder) -> tuple[bool, str]:
    specials = [t for t, i in encoder.info.known_ids.items() if t and i is not None]
    sample = OFFSETS_SAMPLE + [f"{t}x {t} y{t}\n z{t}{t}  w" for t in specials]  # sections between added tokens
    flat, lengths = encoder.encode(sample, add_special_tokens=False)
    compared = 0
    for text, ids in zip(sample, np.split(flat, np.cumsum(lengths)[:-1]), strict=True):
        from_bytes = encoder._starts_from_bytes(text, ids)
        if from_bytes is None:
            continue  # a normalizer changed it: such text always takes HF's offsets
        ref_ids, starts = encoder.offsets(text)
        if not np.array_equal(ref_ids, ids) or not np.array_equal(from_bytes, starts):
            return False, "HF offsets are not the token bytes' on the sample"
        compared += 1
    return compared > 0, f"byte offsets agree with HF on {compared} sample texts"


def _is_verdict(value) -> bool:
    """Whether a cached value has the shape of a ``_self_check`` verdict: [ok, reason]."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool) and isinstance(value[1], str)


def _self_check(info: TokenizerInfo) -> tuple[bool, str]:
    try:
        fast = Encoder(info, "gigatoken")
    except Exception as e:  # any failure to load means: do not use it
        first_line = next(iter(str(e).splitlines()), "")  # its messages go on with a source location
        return False, f"gigatoken cannot load this tokenizer ({type(e).__name__}: {first_line})"
    got_flat, got_len = fast.encode(SELF_CHECK_SAMPLE)
    want = [fast.hf.encode(t).ids for t in SELF_CHECK_SAMPLE]
    want_flat = np.array([i for ids in want for i in ids], np.int64)
    if np.array_equal(got_len, [len(w) for w in want]) and np.array_equal(got_flat, want_flat):
        return True, "self-check passed"
    return False, "gigatoken ids differ from HF tokenizers on the self-check sample"
