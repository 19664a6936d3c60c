"""A tokenizer as xprep records it (``TokenizerInfo``), resolved from ``--tokenizer`` once per run
(``load_tokenizer_info``): which files, converted where needed (prep/tokenizer/conversion.py); its
tokenizer_config.json; its special tokens (end of document, BOS, with where each came from); its vocabulary size and
the ids its post-processor adds, memoized per content (memo.py) so that HF tokenizers rarely loads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.fs import absolute_cache_dir, cache_root
from xprep.prep.io import file_sha256
from xprep.prep.tokenizer.conversion import Converted, convert
from xprep.prep.tokenizer.files import TOKENIZER_JSON, TokenizerFiles, find_tokenizer_files
from xprep.prep.tokenizer.memo import cached

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
    source: dict | None = None  # files converted to ``path``: format, names and sha256s (prep/tokenizer/conversion.py)
    notes: tuple[str, ...] = ()  # what the conversion says (said on the console with the defaults used)
    origin: str = ""  # the file --tokenizer named (for a converted tokenizer the first of its files), for messages
    # --cache-dir (absolute), None for the default: where facts about it are memoized, in this process and in workers
    cache_dir: str | None = field(default=None, compare=False)

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


def load_tokenizer_info(spec: str, eod_token: str | None = None, bos_token: str | None = None,
                        cache_dir: str | None = None) -> TokenizerInfo:
    """Resolve ``--tokenizer`` (a tokenizer.json, GPT-2/SentencePiece/tiktoken files, or a directory holding them;
    see prep/tokenizer/files.py) and read the tokenizer_config.json beside it.

    ``eod_token``/``bos_token`` (``--eod-token``/``--bos-token``) override the config's eos/bos; where neither names
    one, the token the format itself names (a SentencePiece model's eos/bos pieces, GPT-2's <|endoftext|>) is
    taken, else the first of the usual candidates found in the vocabulary, and ``eod_from``/``bos_from`` say so.
    For converted formats a flag's token the vocabulary lacks is added to it (``TOKEN=ID`` chooses its id).
    ``cache_dir`` (``--cache-dir``, None for the default) holds conversions and memoized facts.
    """
    cache_dir = absolute_cache_dir(cache_dir)
    files = find_tokenizer_files(spec)
    path, converted, eod_token, bos_token = _tokenizer_json(files, eod_token, bos_token, cache_dir)
    sha = file_sha256(path, "check the file or pass another --tokenizer")
    config = _read_config(files.directory / "tokenizer_config.json")
    named = _Named.of(converted)
    pad = config.pad or named.tokens.get("pad_token")
    facts = _tokenizer_facts(path, sha, _tokens_to_look_up(config, named, pad, eod_token, bos_token), cache_dir)
    _check_encodes_text(path, facts)
    ids = facts["ids"]
    eos, eod_from = _pick_special(ids, eod_token, "--eod-token", config.eos, "eos_token", config.path,
                                  EOD_CANDIDATES, named.token("eos_token"))
    bos, bos_from = _choose_bos(ids, bos_token, config, named)
    return TokenizerInfo(
        path=str(path),
        sha256=sha,
        vocab_size=facts["vocab_size"],
        eod_id=ids.get(eos) if eos else None,
        pad_id=ids.get(pad) if pad else None,
        bos_token=bos or None,
        eos_token=eos,
        chat_template=config.chat_template,
        prefix=tuple(facts["prefix"]),
        suffix=tuple(facts["suffix"]),
        eod_from=eod_from,
        bos_from=bos_from,
        known_ids=ids,
        source=converted.source if converted else None,
        notes=converted.notes if converted else (),
        origin=str(files.files[0]),
        cache_dir=cache_dir,
    )


@dataclass(frozen=True)
class _Config:
    """What tokenizer_config.json says (nothing where there is none)."""

    path: Path
    eos: str | None = None
    bos: str | None = None
    pad: str | None = None
    names_bos: bool = False  # it has a bos_token key, possibly null (no BOS)
    chat_template: str | None = None


@dataclass(frozen=True)
class _Named:
    """The special tokens the tokenizer files themselves name (a converted format's; none for a tokenizer.json)."""

    tokens: dict[str, str | None] = field(default_factory=dict)  # eos_token / bos_token / pad_token
    where: str = ""  # e.g. "tokenizer.model (its eos/bos/pad pieces)"

    @classmethod
    def of(cls, converted: Converted | None) -> _Named:
        return cls(converted.named, converted.named_from) if converted else cls()

    def token(self, key: str) -> tuple[str | None, str]:
        """(the token the files name as ``key``, where that comes from): ``_pick_special``'s ``from_format``."""
        return self.tokens.get(key), self.where


def _tokenizer_json(files: TokenizerFiles, eod_token: str | None, bos_token: str | None, cache_dir: str | None
                    ) -> tuple[Path, Converted | None, str | None, str | None]:
    """(The tokenizer.json to load, its conversion from other files or None, the flags' tokens): a flag value
    ``TOKEN=ID`` becomes ``TOKEN`` once the conversion has put it at ``ID``."""
    if files.format == TOKENIZER_JSON:
        return files.files[0], None, eod_token, bos_token
    flags = [(f, v) for f, v in (("--eod-token", eod_token), ("--bos-token", bos_token)) if v]
    converted = convert(files, flags, cache_root(cache_dir))
    eod_token, bos_token = (converted.flag_tokens.get(v, v) if v else v for v in (eod_token, bos_token))
    return converted.path, converted, eod_token, bos_token


def _read_config(cfg_path: Path) -> _Config:
    """The tokenizer_config.json beside the tokenizer, if any: its special tokens and its chat template."""
    if not cfg_path.is_file():
        return _Config(cfg_path)
    try:
        config = json.loads(cfg_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XprepError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise XprepError(f"{cfg_path}: expected a JSON object, got a {type(config).__name__}")
    eos, bos, pad = (_token_str(config.get(k)) for k in ("eos_token", "bos_token", "pad_token"))
    return _Config(cfg_path, eos, bos, pad, "bos_token" in config, _chat_template(config, cfg_path))


def _chat_template(config: dict, cfg_path: Path) -> str | None:
    """The config's chat template: a string, or of a list of named ones the one named "default"."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise XprepError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}} objects")
    return template


def _tokens_to_look_up(config: _Config, named: _Named, pad: str | None, eod_token: str | None,
                       bos_token: str | None) -> list[str]:
    """The tokens whose ids the facts hold: those named anywhere, then the usual candidates (in this order: it is
    part of the facts' key)."""
    candidates = [t for t in (eod_token, bos_token, config.eos, config.bos, pad, *named.tokens.values()) if t]
    return list(dict.fromkeys([*candidates, *EOD_CANDIDATES, *BOS_CANDIDATES, *END_OF_TURN_CANDIDATES,
                               *CHAT_MARKER_CANDIDATES]))


def _choose_bos(ids: dict, bos_token: str | None, config: _Config, named: _Named) -> tuple[str | None, str]:
    """(BOS token, where it came from): the flag, else the config's bos_token where it has the key (null: no BOS),
    else as ``_pick_special`` finds one."""
    if bos_token is None and config.names_bos:
        return config.bos, "tokenizer_config.json"
    return _pick_special(ids, bos_token, "--bos-token", config.bos, "bos_token", config.path, BOS_CANDIDATES,
                         named.token("bos_token"))


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
        hf = load_hf(Path(info.path))
        return {m: len(hf.encode(m, add_special_tokens=False).ids) for m in markers if hf.token_to_id(m) is None}

    key = hashlib.sha256("\0".join([info.sha256, *markers]).encode()).hexdigest()[:40]
    return cached(info.cache_dir, f"markers-v1-{key}.json", compute,
                  lambda v: isinstance(v, dict) and all(isinstance(n, int) for n in v.values()))


def _check_encodes_text(path: Path, facts: dict) -> None:
    """Refuse a tokenizer that turns text into (almost) nothing: e.g. an empty vocabulary, or only an unknown token."""
    distinct, chars = facts["sample_distinct_ids"], facts["sample_chars"]
    if distinct < MIN_SAMPLE_IDS:
        raise XprepError(f"{path}: this tokenizer cannot encode text: {chars:,} characters of varied sample text "
                         f"become {facts['sample_ids']:,} ids of which {distinct} distinct (an empty or almost "
                         "empty vocabulary?); check the file or pass another --tokenizer")


def _tokenizer_facts(path: Path, sha: str, tokens: list[str], cache_dir: str | None) -> dict:
    """Vocabulary size, ids of named tokens and the post-processor's added ids, keyed by content.

    Loading a 150k-token HF tokenizer takes ~0.5-1 s per process; these facts are all the fast
    path needs, so they are computed once per tokenizer file content.
    """
    def compute() -> dict:
        hf = load_hf(path)
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
    return cached(cache_dir, f"tokenizer-{key}.json", compute, _are_facts)


_FACT_INTS = ("vocab_size", "sample_chars", "sample_ids", "sample_distinct_ids")


def _are_facts(value) -> bool:
    """Whether a cached value has the shape ``_tokenizer_facts`` computes."""
    return (isinstance(value, dict) and all(isinstance(value.get(k), int) for k in _FACT_INTS)
            and isinstance(value.get("ids"), dict)
            and all(isinstance(i, int) or i is None for i in value["ids"].values())
            and all(isinstance(value.get(k), list) and all(isinstance(i, int) for i in value[k])
                    for k in ("prefix", "suffix")))


@lru_cache(maxsize=4)
def load_hf(path: Path):
    """The HF tokenizer (loaded once per process: a 150k-token vocabulary takes ~0.5 s)."""
    from tokenizers import Tokenizer  # deferred: with cached facts and gigatoken, HF tokenizers never loads

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise XprepError(f"{path}: not a loadable HF tokenizer.json ({e})") from None
    tokenizer.no_truncation()  # a document is encoded whole: a model's max_length is no cut for a corpus
    tokenizer.no_padding()
    return tokenizer


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    raise XprepError("tokenizer post-processor rewrites the text itself; use --backend hf")
