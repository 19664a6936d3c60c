"""What a tokenize run settles before it reads a record (``prepare`` → ``Job``): inputs, tokenizer, chat template,
options (the ``--category-names`` file read and checked), and the head of the manifest they make, with the notes to
say after the run."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
from xprep.prep.chat import END_OF_TURN, ChatTemplate, TemplateSpec, json_type, parse_role_map, resolve_template
from xprep.prep.dataset import KEPT_TOKENIZER, MAX_CATEGORY, count, token_dtype
from xprep.prep.errors import XprepError
from xprep.prep.formats import AUTO, CHAT, TEXT
from xprep.prep.sources import ROWS, Listing, Unreadable, plan_shard, read_batches, resolve_inputs
from xprep.prep.tokenize.config import Options, TokenizeConfig
from xprep.prep.tokenizer import DOCUMENT_END, TokenizerInfo, choose_backend, load_tokenizer_info, marker_pieces


@dataclass
class Job:
    """What a tokenize run settled before reading a record: inputs, tokenizer, template, options, and the
    head of the manifest they make. Picklable: Ray tasks get it whole."""

    sources: list
    info: TokenizerInfo
    dtype: np.dtype
    template: TemplateSpec | None
    options: Options
    backend: str
    backend_reason: str
    chat: bool  # the data is (or starts as) chat: sizes the worker pool and says which defaults matter
    head: dict  # tokenizer, special_tokens, chat_template, options: the manifest before sources and counts
    notes: tuple[str, ...] = ()  # what the choices above may have got wrong, said after the run (prepare)
    inputs_read: tuple[str, ...] = ()  # what directory inputs held, read and skipped (sources.Listing), said first
    chat_render: str = "auto"  # --chat-render: which renderer runs (in no part of the head: the output is the same)

    @property
    def processor_args(self) -> tuple:
        """What each worker builds its Processor from."""
        return self.info, self.backend, self.template, self.options, self.chat_render

    @property
    def kept_tokenizer(self) -> str | None:
        """The tokenizer.json the dataset keeps inside it: one converted from other files (see ``prepare``)."""
        return self.info.path if self.info.source is not None else None


def prepare(config: TokenizeConfig) -> Job:
    """Resolve inputs, tokenizer, template and options: everything but the records."""
    listings: list[Listing] = []
    sources = resolve_inputs(config.inputs, listings)
    info = load_tokenizer_info(config.tokenizer, config.eod_token, config.bos_token, config.cache_dir)
    dtype = _dtype(config.dtype, info.vocab_size)
    plan = plan_shard(sources, config.num_shards, config.shard_index)
    # Content never depends on sniffing records (shards of one run must agree): the EOD follows the chat
    # template only where the command says the data is chat. The sniff only sizes the worker pool.
    chat_declared = config.format == CHAT or (config.format == AUTO and config.chat_template != AUTO)
    chat = chat_declared or (config.format == AUTO and _starts_with_chat(sources, plan))
    template = _template(config, info)
    if template is not None:
        # a broken template fails here, before any worker starts (see ChatTemplate._jinja)
        compiled = ChatTemplate(template, fast=config.chat_render != "jinja")
        info = _chat_eod(info, compiled) if chat_declared else info
    append_eod = config.append_eod
    if info.eod_id is None and (append_eod or (append_eod is None and config.format in (AUTO, TEXT))):
        raise XprepError(f"{info.origin or info.path}: no end-of-document token found (eos_token); pass "
                         "--eod-token TOKEN or --no-append-eod")
    category_names = read_category_names(config.category_names) if config.category_names is not None else {}
    options = Options(config.format, config.text_field, config.train_on, config.category,
                      config.category_field, append_eod, info.eod_id, info.vocab_size,
                      parse_role_map(config.role_map), config.mask_convention, category_names)
    backend, reason = choose_backend(info, config.backend)
    if template is not None and chat:  # which chat path runs: said on the final line, after the encoder's
        reason = f"{reason}; chat template: {compiled.path}"
    tokenizer = info.describe()
    if info.source is not None:  # converted from other files: kept inside the dataset (dataset_tokenizer)
        tokenizer["path"] = KEPT_TOKENIZER
    head = {
        "tokenizer": tokenizer,
        "special_tokens": info.special_tokens(),
        "chat_template": template.describe() if template is not None else None,
        "options": {**options.describe(), "dtype": dtype.name, "limit": config.limit},
    }
    notes = _marker_notes(info, compiled) if template is not None and chat else []
    if not chat and (append_eod or (append_eod is None and config.format in (AUTO, TEXT))):
        notes += _eod_notes(info, compiled.end_of_turn() if template is not None else None)
    return Job(sources, info, dtype, template, options, backend, reason, chat, head, tuple(notes),
               tuple(line for listing in listings for line in listing.lines()), config.chat_render)

def _template(config: TokenizeConfig, info: TokenizerInfo) -> TemplateSpec | None:
    """The chat template to render with, or None where no chat is expected and none is to be had."""
    if config.format not in (AUTO, CHAT):
        return None
    try:
        return resolve_template(config.chat_template, info.chat_template, info.bos_token, info.eos_token)
    except XprepError:
        if config.format == CHAT or config.chat_template != "auto":
            raise
        return None


def _chat_eod(info: TokenizerInfo, template: ChatTemplate) -> TokenizerInfo:
    """A chat dataset whose end-of-document token is only a default ends documents as its template ends turns."""
    if not info.eod_from.startswith("default"):
        return info
    marker = template.end_of_turn()
    if marker is None or info.known_ids.get(marker) is None or marker == info.eos_token:
        return info
    return info.with_eod(marker, f"{info.eod_from[:-1]}; the chat template ends turns with it)")


def _eod_notes(info: TokenizerInfo, turn_end: str | None) -> list[str]:
    """Text documents ending with a chat end-of-turn marker (the template's, ``turn_end``, or a usual one: an Instruct
    tokenizer's eos_token, as Llama 3's ``<|eot_id|>`` or Qwen's ``<|im_end|>``) where a pretraining corpus ends
    documents with the end-of-text token: what to pass instead, where the vocabulary has one. Nothing where
    ``--eod-token`` chose it."""
    turn_ends = {*END_OF_TURN, turn_end} - set(DOCUMENT_END)
    if info.eod_from == "--eod-token" or info.eos_token not in turn_ends:
        return []
    end = next((t for t in DOCUMENT_END if info.known_ids.get(t) is not None), None)
    fix = (f"pass --eod-token '{end}' (id {info.known_ids[end]}), this vocabulary's end-of-text token" if end else
           "pass --eod-token with this vocabulary's end-of-text token")
    return [f"text documents end with {info.eos_token!r} (id {info.eod_id}, from {info.eod_from}), which ends a "
            f"chat turn rather than a document; for pretraining text {fix}"]


def _marker_notes(info: TokenizerInfo, template: ChatTemplate) -> list[str]:
    """A chat template (not the tokenizer's own) whose markers the vocabulary has no token for: each is encoded as
    several text tokens, which the model must learn as text."""
    if template.spec.name == "tokenizer":
        return []
    pieces = marker_pieces(info, template.markers())
    if not pieces:
        return []
    listed = ", ".join(f"{m} ({count(n, 'token')})" for m, n in pieces.items())
    own = " (its own: --chat-template auto)" if info.chat_template else ""
    return [f"the chat template {template.spec.name} writes markers that are no token of this vocabulary, each "
            f"encoded as text: {listed}; use a template made for this tokenizer{own}"]


def _starts_with_chat(sources, plan) -> bool:
    """Whether the shard's first record is a conversation (``--format auto`` sizes its worker pool by it)."""
    try:
        batch = next(iter(read_batches(sources, plan, 1)), None)
        if batch is None or isinstance(batch, Unreadable) or not batch.items:
            return False
        record = batch.items[0] if batch.holds == ROWS else json.loads(batch.items[0])
    except (ValueError, XprepError, OSError):
        return False
    return isinstance(record, dict) and (record.get("messages") is not None or record.get("conversations") is not None)


def _dtype(choice: str, vocab_size: int) -> np.dtype:
    if choice == "auto":
        return token_dtype(vocab_size)
    if choice == "uint16" and vocab_size > 65536:
        raise XprepError(
            f"--dtype uint16: the tokenizer has {vocab_size:,} tokens, more than uint16 holds (65,536); "
            "use --dtype int32 or auto"
        )
    return np.dtype(choice)


def planned_bytes(sources, plan) -> int | None:
    """Bytes the shard will read, when that is known up front (not for compressed files or tables)."""
    if not all(sources[a.source].sized for a in plan):
        return None
    return sum(a.stop - a.start for a in plan)


# --category-names FILE: names for the numeric category_ids of pre-tokenized records, one JSON object
# {"3": "math", "7": "code"} (JSON keys are strings: an id is a decimal number in quotes); an id it leaves out keeps
# its number as its name (CategoryTable.numeric_name)
_ID = re.compile(r"[0-9]+")
_EXAMPLE = '{"1": "math", "2": "code"}'


class _Object(list):
    """A JSON object as its (key, value) pairs in file order: a key given twice is seen, not overwritten."""


def read_category_names(path: str) -> dict[int, str]:
    """The id → name table in the JSON file at ``path``, checked; anything wrong is one XprepError naming the file,
    the entry and the rule."""
    where = f"--category-names {path}"
    try:
        with open(path, "rb") as f:
            pairs = json.loads(f.read(), object_pairs_hook=_Object)
    except OSError as e:
        raise XprepError(f"{where}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise XprepError(f"{where}: not valid JSON ({e}); expected an object of id → name, e.g. {_EXAMPLE}") from None
    if not isinstance(pairs, _Object):
        raise XprepError(f"{where}: holds {json_type(pairs)}, expected one object of id → name, e.g. {_EXAMPLE}")
    names: dict[int, str] = {}
    for key, name in pairs:
        cid = _category_id(key, where)
        if cid in names:
            raise XprepError(f"{where}: id {cid} is named twice ({names[cid]!r} and {_shown(name)}); keep one")
        names[cid] = _category_name(cid, name, where)
    _check_unique(names, where)
    return names


def _category_id(key: str, where: str) -> int:
    if not _ID.fullmatch(key):
        raise XprepError(f"{where}: key {key!r} is not a category id (a whole number 1..{MAX_CATEGORY:,} in quotes, "
                         f"as in {_EXAMPLE})")
    cid = int(key)
    if not 1 <= cid <= MAX_CATEGORY:
        why = "0 is uncategorized and keeps that name" if cid == 0 else "category ids are stored as uint16"
        raise XprepError(f"{where}: id {cid} is out of range 1..{MAX_CATEGORY:,} ({why})")
    return cid


def _category_name(cid: int, name, where: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise XprepError(f"{where}: the name of id {cid} is {_shown(name)}, expected a non-empty string")
    if _ID.fullmatch(name) or name == "uncategorized":
        # a number is how an unnamed numeric id is named, "uncategorized" id 0's: either would stand for two ids
        raise XprepError(f"{where}: id {cid} cannot be named {name!r}, the name of "
                         f"{'id ' + str(int(name)) if _ID.fullmatch(name) else 'id 0'}; choose a name with a letter")
    return name


def _check_unique(names: dict[int, str], where: str) -> None:
    """Two ids with one name would be one category in the channel loss, and not in the data: refused."""
    first: dict[str, int] = {}
    for cid, name in names.items():
        if name in first:
            raise XprepError(f"{where}: ids {first[name]} and {cid} are both named {name!r}; give each id its own "
                             "name (or map them to one id when writing the records)")
        first[name] = cid


def _shown(value) -> str:
    if isinstance(value, _Object):
        return "an object"
    return repr(value) if isinstance(value, str) else json_type(value)
