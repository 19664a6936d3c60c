"""GPT-2 BPE files (``vocab.json``/``encoder.json`` + ``merges.txt``/``vocab.bpe``, what Megatron-LM's GPT-2 runs
use) → a byte-level BPE ``Built``, checked against ``tokenizers``' own BPE built from the same files."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.tokenizer.built import BYTE_CHARS, MAX_ID, Built, byte_level_bpe, check_byte_alphabet, segmented
from xprep.prep.tokenizer.files import TokenizerFiles

# A GPT-2 vocabulary token no merge makes is special where it looks like a control token: <|endoftext|>, <s>, [CLS]
SPECIAL_LOOKING = re.compile(r"<[^<>\s\u0120\u010a\u0109]+>|\[[^\[\]\s\u0120\u010a\u0109]+\]")


def build_gpt2(files: TokenizerFiles) -> Built:
    vocab_path, merges_path = files.files
    vocab = _read_gpt2_vocab(vocab_path)
    merges = _read_gpt2_merges(merges_path, vocab, vocab_path.name)
    check_byte_alphabet(vocab, vocab_path, "GPT-2 BPE")
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
        return segmented(lambda t: ref.encode(t, add_special_tokens=False).ids if t else [], specials)

    built = Built(make=lambda v: byte_level_bpe(v, merges, None, ignore_merges=False), vocab=vocab, specials=specials,
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
