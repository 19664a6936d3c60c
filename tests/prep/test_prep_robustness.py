"""Damaged, hostile or surprising input to xprep: one clear error or a clean skip, never stale output."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT
from prepkit import chat_records, one_line_error, read_jsonl, text_records, tokenize, write_jsonl, xprep_invoke
from xprep.prep.dataset.indexed import HEADER
from xprep.prep.dataset.merge import merge_datasets
from xprep.prep.dataset.token_dataset import CategoryTable, TokenDataset
from xprep.prep.errors import XprepError
from xprep.prep.pack.cache import PackConfig, pack


def test_pack_refuses_a_dataset_whose_index_was_edited_in_place(tmp_path, tiny_tokenizer):
    """The cache key stands on the manifest's fingerprint: an edit behind its back must not be served."""
    tokenize(write_jsonl(tmp_path / "a.jsonl", text_records(30)), tmp_path / "ds", tiny_tokenizer)
    config = PackConfig(method="sequential", seq_len=256)
    pack([str(tmp_path / "ds")], str(tmp_path / "packed"), config)
    idx = tmp_path / "ds" / "tokens.idx"
    raw = bytearray(idx.read_bytes())
    lengths = np.frombuffer(raw, np.int32, 2, HEADER.size).copy()
    lengths += [3, -3]  # same total, so the .bin size still matches
    raw[HEADER.size:HEADER.size + 8] = lengths.tobytes()
    idx.write_bytes(bytes(raw))
    with pytest.raises(XprepError, match="edited in place"):
        pack([str(tmp_path / "ds")], str(tmp_path / "packed"), config)


def test_a_downloaded_dataset_is_checked_stream_by_stream_against_its_manifest(tmp_path, tiny_tokenizer):
    """A dataset synced from a URL is kept only if every .bin and .idx arrived whole (prep/dataset/remote.py)."""
    from xprep.prep.dataset.remote import _check_digests  # deferred: the one test of this private check

    recs = [{**r, "category": "c"} for r in chat_records(6)]
    tokenize(write_jsonl(tmp_path / "a.jsonl", recs), tmp_path / "ds", tiny_tokenizer, format="chat")
    ds = tmp_path / "ds"
    manifest = json.loads((ds / "manifest.json").read_text())
    assert {"tokens", "loss_mask", "category_ids"} <= set(manifest["streams"])
    _check_digests(ds, manifest, "s3://b/ds")
    for name, damage in (("loss_mask.bin", lambda f: f.write_bytes(f.read_bytes()[:-1] + b"\x07")),
                         ("category_ids.idx", lambda f: f.unlink())):
        shutil.copytree(ds, tmp_path / name)
        damage(tmp_path / name / name)
        with pytest.raises(XprepError, match=f"^s3://b/ds: {name} is missing or differs from its manifest digest"):
            _check_digests(tmp_path / name, manifest, "s3://b/ds")


def test_an_index_whose_pointers_disagree_with_its_lengths_does_not_open(tmp_path, tiny_tokenizer):
    tokenize(write_jsonl(tmp_path / "a.jsonl", text_records(5)), tmp_path / "ds", tiny_tokenizer)
    idx = tmp_path / "ds" / "tokens.idx"
    raw = bytearray(idx.read_bytes())
    lengths = np.frombuffer(raw, np.int32, 2, HEADER.size).copy()
    raw[HEADER.size:HEADER.size + 8] = (lengths + np.array([2, -2], np.int32)).tobytes()
    idx.write_bytes(bytes(raw))
    with pytest.raises(XprepError, match="inconsistent index"):
        TokenDataset(tmp_path / "ds")


def test_templates_that_print_the_date_give_the_same_dataset_every_day(tmp_path, tiny_tokenizer, monkeypatch):
    import xprep.prep.chat.sandbox as T

    template = tmp_path / "dated.jinja"
    template.write_text(
        "{% set today = strftime_now('%d %b %Y %H:%M:%S.%f') %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.first %}{{ today }} {% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    src = write_jsonl(tmp_path / "c.jsonl", chat_records(4))
    a = tokenize(src, tmp_path / "a", tiny_tokenizer, chat_template=str(template))
    monkeypatch.setattr(T, "TEMPLATE_DATE", T.TEMPLATE_DATE)  # the frozen date is the only clock
    b = tokenize(src, tmp_path / "b", tiny_tokenizer, chat_template=str(template))
    assert a["fingerprint"] == b["fingerprint"]


@pytest.mark.parametrize("body", ["{{ 10 // (messages[0]['content'] | length - messages[0]['content'] | length) }}",
                                  "{% set x = 'ab' * (messages | length) * 2000000000 %}{{ x }}"],
                         ids=["zero-division", "huge-string"])
def test_a_hostile_template_rejects_records_instead_of_crashing(tmp_path, tiny_tokenizer, body):
    template = tmp_path / "bad.jinja"
    template.write_text(body)
    src = write_jsonl(tmp_path / "c.jsonl", chat_records(2))
    m = tokenize(src, tmp_path / "o", tiny_tokenizer, chat_template=str(template), on_error="skip", allow_empty=True)
    assert m["rejects"]["count"] == 2
    assert all("chat template" in r["reason"] for r in read_jsonl(tmp_path / "o" / "rejects.jsonl"))


def test_an_interrupted_run_does_not_wait_for_a_template_that_loops(tmp_path, tiny_tokenizer):
    """With one worker the records are rendered in a thread of the command's own process: SIGTERM (or Ctrl-C)
    while a template loops ends the command at once instead of waiting for that render."""
    template = tmp_path / "spin.jinja"
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    src = write_jsonl(tmp_path / "c.jsonl", chat_records(2))
    cmd = [sys.executable, "-c", "import sys, cli; sys.argv[0] = 'xprep'; cli.xprep()", "tokenize", str(src), "-o",
           str(tmp_path / "o"), "--tokenizer", str(tiny_tokenizer), "--chat-template", str(template), "--workers",
           "1", "--progress-every", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    time.sleep(4)  # (imports, the tokenizer, then the render)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("still running 30 s after SIGTERM")
    assert proc.returncode != 0 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))


def test_a_template_that_fails_to_compile_is_one_clear_error(tmp_path, tiny_tokenizer):
    template = tmp_path / "bad.jinja"
    template.write_text("{% set x = 'a' * 3000000000 %}{{ x }}")
    with pytest.raises(XprepError, match="chat template"):
        tokenize(write_jsonl(tmp_path / "c.jsonl", chat_records(2)), tmp_path / "o", tiny_tokenizer,
                 chat_template=str(template))


@pytest.mark.parametrize("config", [b"[]", b'{"chat_template": 5}', b"\xff\xfe{}"])
def test_a_malformed_tokenizer_config_is_one_clear_error(tmp_path, tiny_tokenizer, config):
    tok = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer, tok)
    (tok / "tokenizer_config.json").write_bytes(config)
    with pytest.raises(XprepError, match="tokenizer_config.json"):
        tokenize(write_jsonl(tmp_path / "a.jsonl", text_records(2)), tmp_path / "o", tok)


def _cut(path: Path, compress, fraction: float = 0.5) -> tuple[Path, int]:
    """``path`` written as 50 records compressed by ``compress``, cut to ``fraction`` of its bytes; (path, records)."""
    rng = np.random.default_rng(0)  # text that does not compress to nothing: the file is ~1 MB either way
    records = [{"text": f"record {i}: " + " ".join(rng.integers(0, 10**9, 2000).astype(str))} for i in range(50)]
    data = compress("".join(json.dumps(r) + "\n" for r in records).encode())
    path.write_bytes(data[: int(len(data) * fraction)])
    return path, len(records)


@pytest.mark.parametrize("kind", [".gz", ".zst"])
@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_compressed_input_cut_in_half_is_data_lost_under_either_on_error(tmp_path, tiny_tokenizer, kind, on_error):
    """Issue 31: a .gz or .zst cut in half is not "1 rejected" with half the records silently kept: under --on-error
    fail and skip alike it is one line naming the file, how many records were read and the last line read, and nothing
    is published. (A file unreadable from its first byte stays one bad input that skip sets aside: test_tokenize.)"""
    import zstandard

    compress = gzip.compress if kind == ".gz" else zstandard.ZstdCompressor().compress
    cut, total = _cut(tmp_path / f"cut.jsonl{kind}", compress)
    good = write_jsonl(tmp_path / "good.jsonl", text_records(5))
    result = xprep_invoke("tokenize", good, cut, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer,
                          "--on-error", on_error)
    line = one_line_error(result)
    read = int(re.search(r"(\d+) records? were read, the last at line (\d+)", line).group(1))
    assert f"{cut}: the compressed file is cut short or damaged (" in line and "nothing was published" in line, line
    assert 0 < read < total and f"the last at line {read}," in line, line  # one record a line, from line 1
    assert ("not a file cut short" in line) == (on_error == "skip"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cut.name, good.name])


def test_a_compressed_input_damaged_mid_stream_is_data_lost(tmp_path, tiny_tokenizer):
    """Bytes overwritten in the middle of a .gz: what decompresses before the damage is no whole file either."""
    data = bytearray(gzip.compress("".join(json.dumps(r) + "\n" for r in text_records(3000)).encode()))
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    (tmp_path / "d.jsonl.gz").write_bytes(bytes(data))
    with pytest.raises(XprepError, match="cut short or damaged"):
        tokenize(tmp_path / "d.jsonl.gz", tmp_path / "o", tiny_tokenizer, on_error="skip")


def test_a_directory_holding_an_earlier_output_is_not_read_as_corpus(tmp_path, tiny_tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", text_records(5))
    first = tokenize(corpus, corpus / "out1", tiny_tokenizer)
    second = tokenize(corpus, corpus / "out2", tiny_tokenizer)
    assert first["counts"] == second["counts"]


def test_merge_refuses_missing_repeated_or_shuffled_shards(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(60))
    shards = []
    for i in range(3):
        tokenize(src, tmp_path / f"s{i}", tiny_tokenizer, num_shards=3, shard_index=i)
        shards.append(str(tmp_path / f"s{i}"))
    for order in ([0, 2], [0, 1, 1, 2], [1, 0, 2]):
        with pytest.raises(XprepError, match="every shard"):
            merge_datasets([shards[i] for i in order], str(tmp_path / f"m{''.join(map(str, order))}"))
    merge_datasets(shards, str(tmp_path / "m"))


def test_categories_beyond_the_uint16_range_are_refused():
    table = CategoryTable(max_id=3)
    assert [table.id_of(n) for n in "abc"] == [1, 2, 3]
    with pytest.raises(XprepError, match="coarser"):
        table.id_of("d")


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_outside_the_kernel_range_is_refused(seed):
    with pytest.raises(XprepError, match="--seed"):
        PackConfig(method="token-aware", max_tokens=256, seed=seed)


def test_concatenated_zst_frames_are_one_stream_and_a_cut_between_them_is_data_lost(tmp_path, tiny_tokenizer):
    import zstandard

    lines = "".join(json.dumps(r) + "\n" for r in text_records(2000) * 20).encode()
    half = len(lines) // 2
    frames = zstandard.ZstdCompressor().compress(lines[:half]) + zstandard.ZstdCompressor().compress(lines[half:])
    (tmp_path / "whole.jsonl.zst").write_bytes(frames)  # two concatenated frames read as one stream
    whole = tokenize(tmp_path / "whole.jsonl.zst", tmp_path / "w", tiny_tokenizer)
    assert whole["counts"]["documents"] == 40_000
    (tmp_path / "cut.jsonl.zst").write_bytes(frames[: len(frames) * 3 // 4])
    with pytest.raises(XprepError, match="cut short or damaged .truncated .zst file"):
        tokenize(tmp_path / "cut.jsonl.zst", tmp_path / "o", tiny_tokenizer, on_error="skip")


def test_target_counts_never_include_a_documents_first_token(tmp_path, tiny_tokenizer):
    """Pre-tokenized masks are stored verbatim, but counts say what training uses (labels are shifted)."""
    recs = [{"input_ids": [5, 6, 7, 8], "loss_mask": [1, 1, 0, 1], "category_ids": [3, 3, 3, 3]}]
    m = tokenize(write_jsonl(tmp_path / "a.jsonl", recs), tmp_path / "o", tiny_tokenizer)
    assert TokenDataset(tmp_path / "o").loss_mask[0].tolist() == [1, 1, 0, 1]
    assert m["counts"]["loss_tokens"] == 2 and m["counts"]["categories"]["3"]["loss_tokens"] == 2
