"""``xprep tokenize`` on plain text and pre-tokenized records: Megatron compatibility on real tokenizers,
every input format, options, determinism (workers, fingerprints), and the manifest schema."""

from __future__ import annotations

import gc
import gzip
import json
import multiprocessing
import os
import select
import shutil
import signal
import sys
import threading
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
from conftest import SHARED, TINY_CHAT_TEMPLATE, requires_shared_data
from hypothesis import given, settings
from hypothesis import strategies as st
from prepkit import (
    assert_same_files,
    chat_records,
    dir_bytes,
    is_valid,
    read_small_batches,
    schema,
    text_records,
    tokenize,
    validate,
    write_jsonl,
)
from xprep.prep.chat.sandbox import render_watchdog_running
from xprep.prep.chat.templates import BUILTIN_TEMPLATES, ChatTemplate, TemplateSpec
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.tokenize import pool
from xprep.prep.tokenize.encode import Encoded
from xprep.prep.tokenize.records import Rejected
from xprep.prep.tokenizer import encoder, load_tokenizer_info
from xprep.prep.tokenizer.encoder import add_around

QWEN3_EOD = 151645  # <|im_end|>, Qwen3's eos_token (Megatron's choice too)
MISTRAL_BOS, MISTRAL_EOD = 1, 2  # <s>, </s>


def sotu_files(step: int = 6) -> list:
    """About 40 addresses spread over 1790–2018 (every ``step``-th file)."""
    return sorted((SHARED / "corpora/sotu").glob("*.txt"))[::step]


def hf_tokenizer(name: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(SHARED / "tokenizers" / name / "tokenizer.json"))


def tokens_of(path) -> list[list[int]]:
    ds = TokenDataset(path)
    return [ds.tokens[i].tolist() for i in range(len(ds))]


# -- 1. Megatron reads what we write, and every document is HF encode + EOD ------------------------------
@requires_shared_data
@pytest.mark.parametrize("name, eod, dtype", [("qwen3", QWEN3_EOD, np.int32), ("mistral", MISTRAL_EOD, np.uint16)])
def test_megatron_indexed_dataset_reads_real_tokenizer_output(tmp_path, run_cli, name, eod, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    files = sotu_files()
    assert len(files) >= 39
    code, _, err = run_cli("tokenize", *files, "-o", tmp_path / "ds", "--tokenizer", SHARED / "tokenizers" / name)
    assert code == 0, err
    lines = err.splitlines()
    assert all(line.startswith("xprep tokenize: ") for line in lines) and "\r" not in err, "no progress bar in a pipe"
    # one summary line; Qwen3's eos_token ends chat turns (<|im_end|>, as Megatron takes it): a note says so
    assert len(lines) == 1 + (name == "qwen3") and lines[-1].startswith(f"xprep tokenize: {len(files)} documents"), err
    meg = indexed.IndexedDataset(str(tmp_path / "ds" / "tokens"))
    assert len(meg) == len(files)
    assert meg.index.dtype == dtype
    assert meg.document_indices.tolist() == list(range(len(files) + 1))
    texts = [f.read_bytes().decode("utf-8") for f in files]  # bytes as they are: no newline translation
    expected = [e.ids + [eod] for e in hf_tokenizer(name).encode_batch(texts)]
    for i, want in enumerate(expected):
        assert meg[i].tolist() == want, f"document {i} ({files[i].name}) differs"
    if name == "mistral":
        assert all(int(meg[i][0]) == MISTRAL_BOS for i in range(len(meg)))  # the post-processor's BOS
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    validate(manifest, "dataset")
    assert manifest["tokenizer"]["eod_id"] == eod
    assert manifest["streams"]["tokens"]["dtype"] == np.dtype(dtype).name
    assert set(manifest["streams"]) == {"tokens"}  # plain text: no mask or category streams
    assert manifest["counts"]["tokens"] == sum(map(len, expected))
    assert manifest["counts"]["loss_tokens"] == sum(map(len, expected)) - len(expected)
    assert [s["path"] for s in manifest["sources"]] == [str(f) for f in files]


@requires_shared_data
def test_hf_and_gigatoken_backends_write_identical_bytes(tmp_path):
    files = sotu_files(step=12)
    tokenize(files, tmp_path / "hf", SHARED / "tokenizers/qwen3", backend="hf")
    tokenize(files, tmp_path / "giga", SHARED / "tokenizers/qwen3", backend="gigatoken")
    assert_same_files(tmp_path / "hf", tmp_path / "giga")


# -- input formats ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def format_inputs(tmp_path_factory):
    """The same records as JSONL, .gz, .zst, Parquet, Arrow file, save_to_disk directory and .txt files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path_factory.mktemp("formats")
    if SHARED.is_dir():
        texts = [f.read_bytes().decode("utf-8") for f in sotu_files(step=8)]
    else:
        texts = [r["text"] * 20 for r in text_records(30)]  # long enough to compress well
    records = [{"text": t, "id": i} for i, t in enumerate(texts)]
    raw = write_jsonl(d / "a.jsonl", records).read_bytes()
    (d / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, d / "d.parquet", row_group_size=4)
    with pa.OSFile(str(d / "e.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=5)
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_list(records).save_to_disk(str(d / "hf"), num_shards=3)
    (d / "txt").mkdir()
    for i, t in enumerate(texts):
        (d / "txt" / f"{i:03d}.txt").write_bytes(t.encode())
    return d


@pytest.fixture(scope="module")
def format_tokenizer(tiny_tokenizer):
    return SHARED / "tokenizers/qwen3" if SHARED.is_dir() else tiny_tokenizer




@pytest.mark.parametrize("name", ["b.jsonl.gz",
                                  "c.jsonl.zst",
                                  "d.parquet", "e.arrow", "hf", "txt"])
def test_every_input_format_gives_the_same_tokens_as_jsonl(tmp_path, format_inputs, format_tokenizer, name):
    ref = tokenize(format_inputs / "a.jsonl", tmp_path / "ref", format_tokenizer)
    got = tokenize(format_inputs / name, tmp_path / "got", format_tokenizer)
    assert got["counts"]["documents"] == ref["counts"]["documents"] > 0
    for f in ("tokens.bin", "tokens.idx"):
        assert (tmp_path / "got" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f"{name}: {f}"
    assert got["fingerprint"] == ref["fingerprint"]
    validate(got, "dataset")


def test_tables_mixing_record_kinds_equal_jsonl(tmp_path, tiny_tokenizer):
    """In a Parquet table every row has every column (null where a record lacks it): a text row has
    ``messages: null``, a chat row ``text: null``. They must read as the same records as in JSON Lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [*text_records(3), *chat_records(3), {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]
    recs[4]["messages"][-1]["category"] = "answers"
    table = pa.Table.from_struct_array(pa.array(recs))  # schema inferred over all rows
    assert table.slice(0, 1).to_pylist()[0]["messages"] is None
    pq.write_table(table, tmp_path / "mixed.parquet")
    ref = tokenize(write_jsonl(tmp_path / "mixed.jsonl", recs), tmp_path / "ref", tiny_tokenizer)
    got = tokenize(tmp_path / "mixed.parquet", tmp_path / "got", tiny_tokenizer, on_error="skip")
    assert got["rejects"]["count"] == 0
    assert_same_files_but_manifest(tmp_path / "ref", tmp_path / "got")
    assert got["fingerprint"] == ref["fingerprint"]


def test_limit_keeps_the_first_records(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", text_records(30))
    full = tokenize(p, tmp_path / "full", tiny_tokenizer)
    part = tokenize(p, tmp_path / "part", tiny_tokenizer, limit=7)
    assert part["counts"]["documents"] == 7 and full["counts"]["documents"] == 30
    assert tokens_of(tmp_path / "part") == tokens_of(tmp_path / "full")[:7]
    assert part["options"]["limit"] == 7 and part["fingerprint"] != full["fingerprint"]


def test_limit_spans_files_and_counts_rejected_records(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": ""}, {"text": "three"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "four"}, {"text": "five"}])
    m = tokenize([a, b], tmp_path / "o", tiny_tokenizer, limit=4, on_error="skip")
    assert m["counts"]["documents"] == 3 and m["rejects"]["count"] == 1
    assert [s["path"] for s in m["sources"]] == [str(a), str(b)]


def test_directories_globs_and_file_lists_agree(tmp_path, tiny_tokenizer):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    recs = text_records(12)
    names = ["a.txt", "b.jsonl", "sub/c.txt", "sub/d.jsonl"]
    (d / names[0]).write_text(recs[0]["text"])
    write_jsonl(d / names[1], recs[1:6])
    (d / names[2]).write_text(recs[6]["text"])
    write_jsonl(d / names[3], recs[7:])
    (d / "README.md").write_text("not an input")
    files = [d / n for n in names]
    tokenize(files, tmp_path / "list", tiny_tokenizer)
    tokenize([d], tmp_path / "dir", tiny_tokenizer)
    tokenize([str(d / "**" / "*.txt"), str(d / "**" / "*.jsonl")], tmp_path / "glob", tiny_tokenizer)
    ref = tokens_of(tmp_path / "list")
    assert len(ref) == 12
    assert tokens_of(tmp_path / "dir") == ref
    # The globs list the .txt files first, then the .jsonl ones.
    globbed = tokens_of(tmp_path / "glob")
    assert globbed == [ref[0], ref[6], *ref[1:6], *ref[7:]]
    assert_same_files_but_manifest(tmp_path / "list", tmp_path / "dir")


def assert_same_files_but_manifest(a, b):
    fa, fb = dir_bytes(a), dir_bytes(b)
    fa.pop("manifest.json")
    fb.pop("manifest.json")
    assert fa == fb


# -- determinism and fingerprints ------------------------------------------------------------------------
def test_same_input_twice_gives_identical_output(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", text_records(20) + chat_records(5))
    one = tokenize(p, tmp_path / "one", tiny_tokenizer)
    two = tokenize(p, tmp_path / "two", tiny_tokenizer)
    assert one["fingerprint"] == two["fingerprint"]
    assert_same_files(tmp_path / "one", tmp_path / "two")


def test_fingerprint_follows_content_not_file_metadata(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", text_records(20))
    base = tokenize(p, tmp_path / "base", tiny_tokenizer)["fingerprint"]
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    shutil.copy(p, copy)
    assert tokenize(copy, tmp_path / "copy", tiny_tokenizer)["fingerprint"] == base
    raw = bytearray(p.read_bytes())
    at = raw.index(b"fox")
    raw[at] = ord("b")  # one byte changed: "fox" -> "box"
    p.write_bytes(bytes(raw))
    changed = tokenize(p, tmp_path / "changed", tiny_tokenizer)
    assert changed["fingerprint"] != base
    assert tokenize(p, tmp_path / "nolf", tiny_tokenizer, append_eod=False)["fingerprint"] != changed["fingerprint"]


@requires_shared_data
def test_one_changed_byte_in_a_real_corpus_changes_the_fingerprint(tmp_path):
    files = sotu_files(step=40)
    d = tmp_path / "in"
    d.mkdir()
    for f in files:
        shutil.copy(f, d / f.name)
    q = SHARED / "tokenizers/qwen3"
    first = tokenize([d], tmp_path / "a", q)["fingerprint"]
    assert tokenize([d], tmp_path / "b", q)["fingerprint"] == first
    victim = sorted(d.iterdir())[2]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] = ord("Z") if raw[len(raw) // 2] != ord("Z") else ord("Y")
    victim.write_bytes(bytes(raw))
    assert tokenize([d], tmp_path / "c", q)["fingerprint"] != first


def test_workers_give_byte_identical_datasets_with_small_batches(tmp_path, tiny_tokenizer, monkeypatch):
    """Many small batches through 2 worker processes: order and bytes as with one worker."""
    read_small_batches(monkeypatch, 8)
    recs = []
    for i, (t, c) in enumerate(zip(text_records(60), chat_records(60), strict=True)):
        recs += [{**t, "category": f"t{i % 3}"}, c if i % 4 else {**c, "category": "dialog"}]
    # numeric ids kept verbatim, clear of the ids the names above take by first use
    recs += [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0], "category_ids": [200, 200, 201, 201]},
             {"text": ""}]
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    (tmp_path / "b.jsonl.gz").write_bytes(b"corrupt")  # an unreadable file between two readable ones
    q = write_jsonl(tmp_path / "c.jsonl", text_records(30))
    inputs = [p, tmp_path / "b.jsonl.gz", q]
    tokenize(inputs, tmp_path / "w1", tiny_tokenizer, workers=1, on_error="skip")
    # workers forked from this process once it built a Processor (unless a thread the test runner left makes that
    # unsafe: test_workers_1_and_2_write_byte_identical_datasets forks from the command for sure), or spawned
    for start in ("fork", "spawn"):
        tokenize(inputs, tmp_path / start, tiny_tokenizer, workers=2, on_error="skip", worker_start=start)
        assert_same_files(tmp_path / "w1", tmp_path / start)
    assert TokenDataset(tmp_path / "w1").manifest["rejects"]["count"] == 2


def test_workers_are_forked_with_the_processor_built_here_only_where_that_is_safe(monkeypatch):
    """Forked workers run the Processor this process built and warmed (none builds its own); with another Python
    thread running, or ``--worker-start spawn``, workers are spawned instead."""
    if sys.platform != "linux":
        pytest.skip("workers are forked on Linux only")

    class Fake:
        def __init__(self, *args):
            self.built_in, self.warmed = os.getpid(), False

        def warm(self):
            self.warmed = True

        def __call__(self, batch):
            return self.built_in, self.warmed, os.getpid(), batch, gc.get_freeze_count()

    # (a test runner may have left a thread of its own, e.g. tqdm's monitor: the rule is checked apart below)
    monkeypatch.setattr(pool, "_can_fork", lambda start: start == "fork")
    cycle = Fake()
    cycle.me, garbage = cycle, weakref.ref(cycle)
    del cycle
    gc.disable()  # (so that only the pool's own collection can free it)
    try:
        pipeline = pool.Pipeline((), 2, processor=Fake)
    finally:
        gc.enable()
    assert garbage() is None  # collected before the freeze, not frozen for good
    try:
        assert pipeline.pool._mp_context.get_start_method() == "fork"
        results = list(pipeline.map(range(6)))
    finally:
        pipeline.close(True)
    assert [r[3] for r in results] == list(range(6))
    assert {r[:2] for r in results} == {(os.getpid(), True)} and os.getpid() not in {r[2] for r in results}
    assert all(r[4] > 0 for r in results)  # what they share with this process is out of their collector's sight
    assert pool._PROCESSOR is None  # the one the workers were forked with is dropped once they are gone
    assert not os.path.exists(pipeline.spill)  # (results come through files: Spilled)
    monkeypatch.undo()

    can_fork = pool._can_fork
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not can_fork("fork")  # a fork now could copy a lock that thread holds
    finally:
        stop.set()
        other.join()
    # a chat template's check renders with Jinja here before the fork, which starts the render watchdog's thread:
    # it holds no lock a child could inherit, so the workers are still forked beside it
    ChatTemplate(TemplateSpec("chatml", BUILTIN_TEMPLATES["chatml"], "", "<|im_end|>")).render_jinja(
        [{"role": "user", "content": "x"}])
    assert render_watchdog_running()
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # this thread and the watchdog's
    assert can_fork("fork")
    assert not can_fork("spawn")


def test_a_result_crosses_the_pipe_as_a_path_short_enough_to_be_written_whole(tmp_path, monkeypatch):
    """A worker killed while it wrote a result of megabytes into the pipe left concurrent.futures reading the rest
    forever (the command hung); what it sends now is a path, one write below PIPE_BUF, and the result a file."""
    result = Encoded(0, np.arange(3_000_000, dtype=np.int32), np.array([3_000_000]), None, None, [],
                     [Rejected(7, "bad", "why", "{", True)], 12)
    monkeypatch.setattr(pool, "_PROCESSOR", lambda batch: result)  # (a worker's own Processor)
    spilled = pool._work(None, str(tmp_path))
    assert isinstance(spilled, pool.Spilled) and len(ForkingPickler.dumps(spilled)) < select.PIPE_BUF
    loaded = spilled.load()
    assert np.array_equal(loaded.tokens, result.tokens) and loaded.rejects == result.rejects
    assert list(tmp_path.iterdir()) == []  # read once, removed


def test_a_worker_that_dies_as_it_starts_ends_the_command_in_one_line(monkeypatch):
    """A forked worker killed before its first task (the moment it appears) gives the one-line error any later
    death gives, with the pool shut down and nothing left running (it was a BrokenProcessPool traceback)."""
    if sys.platform != "linux":
        pytest.skip("workers are forked on Linux only")

    class Idle:
        def __init__(self, *args):
            pass

        def warm(self):
            pass

    monkeypatch.setattr(pool, "_can_fork", lambda start: True)
    monkeypatch.setattr(pool, "_forked", lambda lifeline: os.kill(os.getpid(), signal.SIGKILL))  # in a worker, first
    with pytest.raises(XprepError, match="a tokenize worker process died"):
        pool.Pipeline((), 2, processor=Idle)
    assert pool._PROCESSOR is None and not multiprocessing.active_children()


@requires_shared_data
def test_workers_1_and_2_write_byte_identical_datasets(tmp_path, run_cli, monkeypatch):
    """Point 4 through the real CLI: text files, chat with the Qwen3 template, rejects; every file equal, with the
    workers forked (the command has no other thread when it starts them) and spawned."""
    lines = (SHARED / "chat/chitchat.jsonl").read_text().splitlines()[:300]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    text = write_jsonl(tmp_path / "text.jsonl", [{**r, "category": "prose"} for r in text_records(50)])
    inputs = [*sotu_files(step=24), text, tmp_path / "chat.jsonl"]
    outs = []
    for workers, start in ((1, "fork"), (2, "fork"), (2, "spawn")):
        out = tmp_path / f"w{workers}-{start}"
        code, _, err = run_cli("tokenize", *inputs, "-o", out, "--tokenizer", SHARED / "tokenizers/qwen3",
                               "--workers", workers, "--on-error", "skip", "--worker-start", start)
        assert code == 0, err
        assert f"{workers} worker" in err
        outs.append(out)
    assert {"loss_mask.bin", "category_ids.bin", "rejects.jsonl"} <= set(dir_bytes(outs[0]))
    assert_same_files(outs[0], outs[1])
    assert_same_files(outs[0], outs[2])


# -- options ------------------------------------------------------------------------------------------------
def test_eod_is_appended_to_text_only_by_default(tmp_path, tiny_tokenizer):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    eod = hf.token_to_id("<|endoftext|>")
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello world"}])
    tokenize(p, tmp_path / "on", tiny_tokenizer)
    tokenize(p, tmp_path / "off", tiny_tokenizer, append_eod=False)
    ids = hf.encode("hello world").ids
    assert tokens_of(tmp_path / "on") == [ids + [eod]]
    assert tokens_of(tmp_path / "off") == [ids]


def test_text_field_category_and_category_field(tmp_path, tiny_tokenizer):
    recs = [{"body": "alpha beta", "src": "web"}, {"body": "gamma", "src": "books"}, {"body": "delta"},
            {"body": "epsilon", "src": "web"}]
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    m = tokenize(p, tmp_path / "o", tiny_tokenizer, text_field="body", category_field="src", category="misc")
    assert m["categories"] == ["uncategorized", "web", "books", "misc"]
    ds = TokenDataset(tmp_path / "o")
    per_doc = [set(ds.category_ids[i].tolist()) for i in range(4)]
    assert per_doc == [{1}, {2}, {3}, {1}]
    lengths = ds.lengths.tolist()
    assert m["counts"]["categories"] == {
        "web": {"tokens": lengths[0] + lengths[3], "loss_tokens": lengths[0] + lengths[3] - 2},
        "books": {"tokens": lengths[1], "loss_tokens": lengths[1] - 1},
        "misc": {"tokens": lengths[2], "loss_tokens": lengths[2] - 1},
    }
    validate(m, "dataset")


def test_whole_run_category(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", text_records(5))
    m = tokenize(p, tmp_path / "o", tiny_tokenizer, category="code")
    ds = TokenDataset(tmp_path / "o")
    assert m["categories"] == ["uncategorized", "code"]
    assert set(ds.category_ids.items.tolist()) == {1}
    assert m["counts"]["categories"] == {"code": {"tokens": m["counts"]["tokens"],
                                                  "loss_tokens": m["counts"]["loss_tokens"]}}


# -- 3. pre-tokenized records round-trip exactly ----------------------------------------------------------------
def random_token_records(rng, n: int, vocab: int, max_cat: int = 12) -> list[dict]:
    recs = []
    for i in range(n):
        length = int(rng.integers(1, 60))
        r = {"input_ids": rng.integers(0, vocab, length).tolist()}
        if i % 4 != 1:
            r["loss_mask"] = [0, *rng.integers(0, 2, length - 1).tolist()]  # first token never a target
        if i % 3 != 2:
            r["category_ids"] = rng.choice([0, 3, max_cat], length).tolist()
        if i % 2:
            r["length"] = length
        recs.append(r)
    return recs


@pytest.mark.parametrize("max_cat", [12, 300])
def test_pretokenized_records_round_trip_exactly(tmp_path, tiny_tokenizer, max_cat):
    rng = np.random.default_rng(max_cat)
    recs = random_token_records(rng, 200, 600, max_cat)
    recs[0] = {"input_ids": [599], "loss_mask": [0], "category_ids": [max_cat], "length": 1}
    validate(recs[1], "records/tokens")
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    m = tokenize(p, tmp_path / "o", tiny_tokenizer)
    ds = TokenDataset(tmp_path / "o")
    assert len(ds) == len(recs) and m["rejects"]["count"] == 0
    for i, r in enumerate(recs):
        doc = ds.document(i)
        assert doc["input_ids"].tolist() == r["input_ids"], i
        n = len(r["input_ids"])
        default_mask = [0] + [1] * (n - 1)
        assert doc["loss_mask"].tolist() == r.get("loss_mask", default_mask), i
        assert doc["category_ids"].tolist() == r.get("category_ids", [0] * n), i
    assert m["streams"]["category_ids"]["dtype"] == ("uint16" if max_cat > 255 else "uint8")
    assert m["categories"][3] == "3" and m["categories"][max_cat] == str(max_cat)
    assert m["counts"]["loss_tokens"] == int(ds.loss_mask.items.sum())
    validate(m, "dataset")


def test_pretokenized_loss_mask_is_kept_verbatim_even_on_the_first_token(tmp_path, tiny_tokenizer):
    """Issue 2 point 3 asks for an exact round trip; DESIGN §1 says a document's first token is never a target.
    Today the record wins (verbatim); this test pins that choice."""
    p = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [7, 8, 9], "loss_mask": [1, 1, 0]}])
    tokenize(p, tmp_path / "o", tiny_tokenizer)
    assert TokenDataset(tmp_path / "o").document(0)["loss_mask"].tolist() == [1, 1, 0]


def test_pretokenized_records_get_no_eod_unless_asked(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [7, 8, 9]}])
    tokenize(p, tmp_path / "plain", tiny_tokenizer)
    tokenize(p, tmp_path / "eod", tiny_tokenizer, append_eod=True)
    assert tokens_of(tmp_path / "plain") == [[7, 8, 9]]
    assert tokens_of(tmp_path / "eod") == [[7, 8, 9, 0]]


# -- schemas --------------------------------------------------------------------------------------------------
def test_schemas_are_valid_draft_2020_12():
    import jsonschema

    for name in ("dataset", "records/text", "records/chat", "records/tokens"):
        s = schema(name)
        jsonschema.Draft202012Validator.check_schema(s)
        assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert s["$id"].endswith(f"schemas/{name}.schema.json")


def test_record_schemas_accept_what_tokenize_accepts():
    assert is_valid({"text": "hello", "id": 3}, "records/text")
    assert is_valid({"text": "hello", "category": "web"}, "records/text")
    for bad in ({"text": 5}, {"text": "   "}, {"body": "x"}, {"text": "x", "category": ""}):
        assert not is_valid(bad, "records/text"), bad
    assert is_valid({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
                    "records/chat")
    assert is_valid({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                    "records/chat")
    for bad in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                {"messages": [{"role": "user", "content": 3}]}, {"conversations": [{"value": "x"}]}, {}):
        assert not is_valid(bad, "records/chat"), bad
    assert is_valid({"input_ids": [1, 2], "loss_mask": [0, 1], "category_ids": [0, 300], "length": 2},
                    "records/tokens")
    for bad in ({"input_ids": []}, {"input_ids": [-1]}, {"input_ids": [1], "loss_mask": [2]},
                {"input_ids": [1.5]}, {"input_ids": [1], "category_ids": [70000]}):
        assert not is_valid(bad, "records/tokens"), bad


@requires_shared_data
def test_real_chat_records_match_the_chat_schema():
    lines = (SHARED / "chat/chitchat.jsonl").read_text().splitlines()[:200]
    for line in lines:
        validate(json.loads(line), "records/chat")


def test_manifests_of_every_kind_validate(tmp_path, tiny_tokenizer):
    recs = text_records(5) + chat_records(4) + [{"input_ids": [1, 2, 3], "category_ids": [0, 4, 4]},
                                                 {"text": ""}]
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    for i, kwargs in enumerate([{}, {"format": "text"}, {"train_on": "all"}, {"num_shards": 2, "shard_index": 1},
                                {"category": "x", "append_eod": True}]):
        m = tokenize(p, tmp_path / f"o{i}", tiny_tokenizer, on_error="skip", **kwargs)
        validate(m, "dataset")
        assert json.loads((tmp_path / f"o{i}" / "manifest.json").read_text()) == m


def test_named_and_numeric_categories_never_share_an_id(tmp_path, tiny_tokenizer):
    """A name (id by first use) and a pre-tokenized numeric id (kept verbatim) must not be merged silently."""
    recs = [{"text": "named text", "category": "web"}, {"input_ids": [5, 6, 7], "category_ids": [1, 1, 1]}]
    p = write_jsonl(tmp_path / "a.jsonl", recs)
    try:
        m = tokenize(p, tmp_path / "o", tiny_tokenizer)
    except XprepError as e:  # refusing the mix with a clear message is fine too
        assert "category" in str(e)
        return
    ds = TokenDataset(tmp_path / "o")
    names = m["categories"]
    web = {names[c] for c in ds.category_ids[0].tolist()}
    numeric = {names[c] for c in ds.category_ids[1].tolist()}
    assert web == {"web"} and numeric == {"1"}, (web, numeric, names)


def test_fingerprint_does_not_depend_on_where_the_tokenizer_and_template_live(tmp_path, tiny_tokenizer):
    """The fingerprint covers content: the tokenizer's sha256, the template's sha256, not their paths
    (a dataset rebuilt on another machine must keep its fingerprint, or pack caches and resumes break)."""
    moved = tmp_path / "elsewhere" / "tok"
    shutil.copytree(tiny_tokenizer, moved)
    template = tmp_path / "t1.jinja"
    template.write_text(TINY_CHAT_TEMPLATE)
    moved_template = tmp_path / "elsewhere" / "t2.jinja"
    moved_template.write_text(TINY_CHAT_TEMPLATE)
    p = write_jsonl(tmp_path / "a.jsonl", text_records(5) + chat_records(3))
    a = tokenize(p, tmp_path / "a", tiny_tokenizer, chat_template=str(template))
    b = tokenize(p, tmp_path / "b", moved, chat_template=str(moved_template))
    assert a["tokenizer"]["sha256"] == b["tokenizer"]["sha256"]
    assert a["chat_template"]["sha256"] == b["chat_template"]["sha256"]
    assert a["streams"] == b["streams"]
    assert a["fingerprint"] == b["fingerprint"]


# -- the encoder: gigatoken plus the post-processor equals HF tokenizers ------------------------------------------
@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(3, 99), max_size=6), max_size=6),
       st.lists(st.integers(100, 110), max_size=2), st.lists(st.integers(100, 110), max_size=2))
def test_add_around_equals_a_naive_loop(seqs, prefix, suffix):
    flat = np.array([t for s in seqs for t in s], np.int64)
    lengths = np.array([len(s) for s in seqs], np.int64)
    out, new_lengths = add_around(flat, lengths, np.array(prefix, np.int64), np.array(suffix, np.int64))
    want = [prefix + s + suffix for s in seqs]
    assert new_lengths.tolist() == [len(w) for w in want]
    assert out.tolist() == [t for w in want for t in w]


@pytest.mark.parametrize("backend", ["gigatoken", "hf"])
def test_post_processor_tokens_are_added_like_hf(tmp_path, tiny_tokenizer, backend):
    """A tokenizer whose post-processor adds BOS and EOS around each text (gigatoken does not apply it)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    bos, eos = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    tok.post_processor = TemplateProcessing(single="<|im_start|> $A <|im_end|>",
                                            special_tokens=[("<|im_start|>", bos), ("<|im_end|>", eos)])
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    texts = [r["text"] for r in text_records(15)] + ["ünï 😀", " lead", "x"]
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    tokenize(p, tmp_path / "o", d, backend=backend)
    eod = tok.token_to_id("<|endoftext|>")
    assert tokens_of(tmp_path / "o") == [e.ids + [eod] for e in tok.encode_batch(texts)]
    assert all(ids[0] == bos and ids[-2] == eos for ids in tokens_of(tmp_path / "o"))


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"vocab_size": "600"}'],
                         ids=["not-json", "wrong-shape", "wrong-type"])
def test_a_corrupt_tokenizer_cache_entry_is_said_then_rewritten(tmp_path, tiny_tokenizer, monkeypatch, capsys, damage):
    """A damaged memo of tokenizer facts or of the self-check verdict is reported (one stderr line naming it),
    never used, and replaced by a good one; the verdict's key carries its version."""
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    info = load_tokenizer_info(str(tiny_tokenizer))
    backend = encoder.choose_backend(info, "auto")
    entries = sorted((tmp_path / "cache").glob("*.json"))
    assert [p.name.split("-")[0] for p in entries] == ["selfcheck", "tokenizer"]
    assert entries[0].name.startswith(f"selfcheck-v{encoder.SELF_CHECK_VERSION}-")
    capsys.readouterr()
    for entry in entries:
        good = json.loads(entry.read_text())
        entry.write_text(damage)
        assert load_tokenizer_info(str(tiny_tokenizer)) == info
        assert encoder.choose_backend(info, "auto") == backend
        err = capsys.readouterr().err
        assert err.count("unusable cache entry") == 1 and str(entry) in err, err
        assert json.loads(entry.read_text()) == good
    load_tokenizer_info(str(tiny_tokenizer))
    assert "cache" not in capsys.readouterr().err


def test_an_unwritable_tokenizer_cache_just_recomputes(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    first = load_tokenizer_info(str(tiny_tokenizer))
    assert load_tokenizer_info(str(tiny_tokenizer)) == first
    err = capsys.readouterr().err
    assert err.count("cannot write the cache") == 1 and "XPREP_CACHE_DIR" in err, err


def test_progress_on_a_terminal_and_in_logs(monkeypatch):
    """A terminal gets a line redrawn in place, with an ETA; a log gets a plain line per interval, or none."""
    import io

    from xprep.prep import progress as P

    class Tty(io.StringIO):
        def isatty(self):
            return True

    now = [0.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: now[0])

    def feed(stream, interval=30.0):
        now[0] = 0.0
        bar = P.Progress("tokenize", total_bytes=1000, stream=stream, interval=interval)
        for t in (10, 20, 40, 50):  # 100 bytes a step: 30 s in, 40 % done
            now[0] = float(t)
            bar.update(10, 2000, 100)
        bar.close()
        return stream.getvalue()

    out = feed(Tty())
    assert out.startswith("\rtokenize  10.0%  10 docs") and "2,000 tokens" in out and "MB/s" in out
    assert "ETA 1m15s" in out and out.endswith("\n")  # at 50 s, 40 % done: 75 s to go
    log = feed(io.StringIO()).splitlines()
    assert len(log) == 1 and "\r" not in log[0]  # only t=40 is 30 s past the last line
    assert log[0].startswith("tokenize  30.0%  30 docs") and "ETA 1m33s" in log[0] and "[0m40s elapsed]" in log[0]
    assert feed(io.StringIO(), interval=0) == ""


def test_one_worker_encodes_beside_the_reading_thread_in_order(monkeypatch):
    """With one worker the Processor runs in a thread of its own (the encoder releases the GIL, so reading,
    parsing and writing overlap it): results come back in batch order, unreadable files in their place, an
    error of the Processor reaches the caller as itself, and a Pipeline can map again after it was closed
    (a Ray worker keeps its Pipeline from one task to the next, and runs it without the extra thread)."""
    from xprep.prep.sources.discover import Unreadable

    class Fake:
        def __init__(self, *args):
            self.threads = set()

        def __call__(self, batch):
            self.threads.add(threading.current_thread().name)
            if batch == "bad":
                raise XprepError("bad batch")
            return f"done {batch}"

    pipeline = pool.Pipeline((), 1, processor=Fake)
    gone = Unreadable(0, 0, "unreadable")
    assert list(pipeline.map([1, 2, gone, 3, 4])) == ["done 1", "done 2", gone, "done 3", "done 4"]
    assert pipeline.inline.threads and threading.current_thread().name not in pipeline.inline.threads
    pipeline.close(True)
    with pytest.raises(XprepError, match="bad batch"):
        list(pipeline.map([1, "bad", 2]))
    assert list(pipeline.map([5])) == ["done 5"]
    own = pool.Pipeline((), 1, overlap=False, processor=Fake)  # a Ray task: one CPU, one thread of work
    assert list(own.map([1, gone, 2])) == ["done 1", gone, "done 2"]
    assert own.inline.threads == {threading.current_thread().name}
