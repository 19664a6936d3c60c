"""SentencePiece ``.model`` files (BPE models with the identity normalization) → a ``Built`` with sentencepiece's
whitespace handling, read without protobuf or sentencepiece and checked against ``sentencepiece`` where it is
installed; what a tokenizer.json cannot reproduce exactly (unigram models, precompiled normalizations,
user-defined or unused pieces) is refused."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.tokenizer.built import Built, import_or_none, segmented, version_or
from xprep.prep.tokenizer.files import TokenizerFiles

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


def build_sentencepiece(files: TokenizerFiles) -> Built:
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
        spm = import_or_none("sentencepiece")
        if spm is None:
            return None
        try:
            sp = spm.SentencePieceProcessor(model_proto=path.read_bytes())
        except (RuntimeError, OSError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise XprepError(f"{path}: sentencepiece cannot load this model ({reason}); pass the .model file "
                             "sentencepiece wrote, or a tokenizer.json") from None
        return segmented(lambda t: sp.encode(t) if t else [], specials)

    return Built(make=make, vocab=vocab,
                  specials={p: i for i, (p, _, t) in enumerate(model.pieces) if t in (UNKNOWN, CONTROL)},
                  named={"eos_token": _control(model, "eos_piece"), "bos_token": _control(model, "bos_piece"),
                         "pad_token": _control(model, "pad_piece")},
                  named_from=f"{path.name} (its eos/bos/pad pieces)", options={"model_type": "bpe"},
                  reference=reference, reference_name=f"sentencepiece {version_or('sentencepiece')}")


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
