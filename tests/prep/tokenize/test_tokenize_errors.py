"""Bad input never ends in a traceback: ``--on-error fail`` exits 2 with ``file:line: reason``, ``skip`` sets
records aside in rejects.jsonl; a killed run never leaves something that opens as a dataset."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT, SHARED, requires_shared_data, xprep_cli
from prepkit import assert_same_files, read_jsonl, text_records, tokenize, write_jsonl
from xprep import cli
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.errors import XprepError

SPAM = SHARED / "corpora/spam-assassin"
# Real e-mails that are not valid UTF-8 (byte offset of the first bad byte).
SPAM_NOT_UTF8 = {"easy-ham-1/00007.37a8af848caae585af4fe35779656d55.txt": 2756,
                 "easy-ham-1/00009.371eca25b0169ce5cb4f71d3e07b9e2d.txt": 2720}
GOOD = b'{"text": "a good record"}\n'
GOOD_FOR_FORMAT = {
    "chat": b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
    "tokens": b'{"input_ids": [1, 2, 3]}\n',
}


def good_line(extra: list[str]) -> bytes:
    """A valid record for the --format among ``extra`` options."""
    fmt = extra[extra.index("--format") + 1] if "--format" in extra else "auto"
    return GOOD_FOR_FORMAT.get(fmt, GOOD)


def invoke(*args):
    """``xprep ARGS`` in this process: (exit code, stdout, stderr, exception that escaped or None)."""
    result = CliRunner().invoke(cli.xprep, [str(a) for a in args])
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.stdout, result.stderr, escaped


def spam_line() -> bytes:
    """A JSON line whose text is a real e-mail with its original non-UTF-8 bytes."""
    raw = (SPAM / next(iter(SPAM_NOT_UTF8))).read_bytes()
    return json.dumps({"text": raw.decode("latin-1")}, ensure_ascii=False).encode("latin-1") + b"\n"


# (id, bad line, extra options, expected reason) — the bad line is line 2 of its file, between good ones.
CASES = [
    ("malformed-json", b'{"text": broken\n', [], "malformed JSON: Expecting value at column 10"),
    ("not-an-object", b"[1, 2, 3]\n", [], "record is a JSON list, expected an object"),
    ("missing-field", b'{"body": "x"}\n', ["--format", "text"], "missing field 'text' (set --text-field)"),
    ("missing-field-chat", b'{"text": "x"}\n', ["--format", "chat"], "missing field 'messages' (or 'conversations')"),
    ("missing-field-tokens", b'{"text": "x"}\n', ["--format", "tokens"], "missing field 'input_ids'"),
    ("no-known-field", b'{"body": "x"}\n', [], "no 'text', 'messages', 'conversations' or 'input_ids' field"),
    ("wrong-type", b'{"text": 5}\n', [], "field 'text' is a number, expected a string"),
    ("wrong-type-content", b'{"messages": [{"role": "user", "content": {"a": 1}}]}\n', [],
     "message 0: content must be a string, got dict"),
    ("wrong-type-category", b'{"text": "x", "category": 5}\n', [], "category 5 must be a non-empty string"),
    ("empty-text", b'{"text": " \\n "}\n', [], "empty text"),
    ("unknown-role", b'{"messages": [{"role": "wizard", "content": "hi"}]}\n', [],
     "message 0: unknown role 'wizard'"),
    ("empty-conversation", b'{"messages": []}\n', [], "empty conversation: field 'messages' is an empty list"),
    ("ids-outside-vocab", b'{"input_ids": [1, 600]}\n', [], "input_ids outside [0, 600)"),
    ("ids-not-ints", b'{"input_ids": [1, "2"]}\n', [], "field 'input_ids' must be a list of integers"),
    ("mask-length", b'{"input_ids": [1, 2], "loss_mask": [1]}\n', [], "loss_mask must hold 2 integers in [0, 1]"),
    ("length-mismatch", b'{"input_ids": [1, 2], "length": 3}\n', [], "length 3 != len(input_ids) 2"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_record_fails_with_file_line_reason(tmp_path, tiny_tokenizer, case):
    _, bad, extra, reason = case
    src = tmp_path / "in.jsonl"
    src.write_bytes(good_line(extra) + bad + good_line(extra))
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer, *extra)
    assert escaped is None, f"an exception escaped: {escaped!r}"
    assert code == 2
    assert err.startswith(f"error: {src}:2: {reason}"), err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"], "no temporary directory left behind"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_record_is_skipped_into_rejects(tmp_path, tiny_tokenizer, case):
    _, bad, extra, reason = case
    src = tmp_path / "in.jsonl"
    src.write_bytes(good_line(extra) + bad + good_line(extra))
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                                   "--on-error", "skip", *extra)
    assert escaped is None and code == 0, err
    (reject,) = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert reject["source"] == str(src) and reject["line"] == 2 and reject["reason"].startswith(reason)
    assert reject["record"]
    ds = TokenDataset(tmp_path / "out")
    assert len(ds) == 2
    assert ds.manifest["rejects"]["count"] == 1 and ds.manifest["rejects"]["file"] == "rejects.jsonl"


@requires_shared_data
def test_invalid_utf8_in_real_emails(tmp_path, tiny_tokenizer):
    """Real spam-assassin mails that are not UTF-8, as .txt documents and inside a JSON line."""
    files = [SPAM / name for name in SPAM_NOT_UTF8]
    good = sorted((SPAM / "easy-ham-1").iterdir())[:3]
    for f in good:
        f.read_bytes().decode("utf-8")  # these are valid
    first = files[0]
    code, _, err, escaped = invoke("tokenize", *good, first, "-o", tmp_path / "o1", "--tokenizer", tiny_tokenizer)
    assert escaped is None and code == 2
    at = SPAM_NOT_UTF8[first.relative_to(SPAM).as_posix()]
    assert err.startswith(f"error: {first}:1: invalid UTF-8 at byte {at}"), err
    code, _, err, escaped = invoke("tokenize", *good, *files, "-o", tmp_path / "o2", "--tokenizer", tiny_tokenizer,
                                   "--on-error", "skip")
    assert escaped is None and code == 0, err
    rejects = read_jsonl(tmp_path / "o2" / "rejects.jsonl")
    assert [(r["source"], r["line"]) for r in rejects] == [(str(f), 1) for f in files]
    assert all(r["reason"].startswith("invalid UTF-8 at byte") for r in rejects)
    assert len(TokenDataset(tmp_path / "o2")) == len(good)
    # The same bytes inside a JSON line.
    src = tmp_path / "mail.jsonl"
    src.write_bytes(GOOD + spam_line())
    code, _, err, _ = invoke("tokenize", src, "-o", tmp_path / "o3", "--tokenizer", tiny_tokenizer)
    assert code == 2 and err.startswith(f"error: {src}:2: invalid UTF-8 at byte"), err


def test_all_bad_kinds_at_once_through_a_real_process(tmp_path, tiny_tokenizer):
    """One file with every kind of bad line, run as a real process in both modes."""
    src = tmp_path / "all.jsonl"
    src.write_bytes(GOOD + b"".join(c[1] for c in CASES if not c[2]) + GOOD)
    bad = [c for c in CASES if not c[2]]
    code, out, err = xprep_cli("tokenize", src, "-o", tmp_path / "fail", "--tokenizer", tiny_tokenizer)
    assert code == 2 and err.startswith(f"error: {src}:2: {bad[0][3]}") and "Traceback" not in err, err
    assert not (tmp_path / "fail").exists()
    code, out, err = xprep_cli("tokenize", src, "-o", tmp_path / "skip", "--tokenizer", tiny_tokenizer,
                               "--on-error", "skip")
    assert code == 0 and "Traceback" not in err, err
    assert f"{len(bad)} rejected" in err
    rejects = read_jsonl(tmp_path / "skip" / "rejects.jsonl")
    assert [r["line"] for r in rejects] == list(range(2, 2 + len(bad)))
    for r, case in zip(rejects, bad, strict=True):
        assert r["reason"].startswith(case[3]), (r, case)
    assert len(TokenDataset(tmp_path / "skip")) == 2


# -- unreadable files ------------------------------------------------------------------------------------------
def test_corrupt_gzip_is_an_unreadable_file(tmp_path, tiny_tokenizer):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"this is not gzip data")
    good = write_jsonl(tmp_path / "good.jsonl", text_records(3))
    code, _, err, escaped = invoke("tokenize", bad, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer)
    assert escaped is None and code == 2
    assert err.startswith(f"error: {bad}: unreadable file: Not a gzipped file"), err
    code, _, err, _ = invoke("tokenize", bad, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip")
    assert code == 0, err
    (r,) = read_jsonl(tmp_path / "o" / "rejects.jsonl")
    assert r["source"] == str(bad) and r["reason"].startswith("unreadable file")
    assert len(TokenDataset(tmp_path / "o")) == 3


def test_truncated_gzip_reports_the_file_as_cut_short(tmp_path, tiny_tokenizer):
    raw = write_jsonl(tmp_path / "x.jsonl", [{"text": f"record {i} " + "pad " * 50} for i in range(300)]).read_bytes()
    src = tmp_path / "t.jsonl.gz"
    src.write_bytes(gzip.compress(raw)[:-50])
    code, _, err, _ = invoke("tokenize", src, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer)
    assert code == 2 and err.startswith(f"error: {src}: the compressed file is cut short or damaged"), err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: chmod 000 does not stop root from reading (see the corrupt-gzip test)")
def test_unreadable_file_permission(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "secret.jsonl", text_records(2))
    good = write_jsonl(tmp_path / "good.jsonl", text_records(2))
    src.chmod(0)
    try:
        code, _, err, escaped = invoke("tokenize", src, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer)
        assert escaped is None and code == 2 and err.startswith(f"error: {src}"), err
        assert "Permission denied" in err
        code, _, err, _ = invoke("tokenize", src, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer,
                                 "--on-error", "skip")
        assert code == 0, err
        (r,) = read_jsonl(tmp_path / "o" / "rejects.jsonl")
        assert r["source"] == str(src) and "unreadable file" in r["reason"]
    finally:
        src.chmod(0o644)


def test_permission_denied_while_reading(tmp_path, tiny_tokenizer, monkeypatch):
    """EACCES on open, simulated so that it also holds when the suite runs as root."""
    from xprep.prep.sources.readers import jsonl

    secret = write_jsonl(tmp_path / "secret.jsonl", text_records(2))
    good = write_jsonl(tmp_path / "good.jsonl", text_records(2))
    real_open = jsonl.open_stream

    def deny(src):
        if src.path == str(secret):
            raise PermissionError(13, "Permission denied", src.path)
        return real_open(src)

    monkeypatch.setattr(jsonl, "open_stream", deny)
    code, _, err, escaped = invoke("tokenize", secret, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer)
    assert escaped is None and code == 2, err
    assert err.startswith(f"error: {secret}: unreadable file: [Errno 13] Permission denied"), err
    code, _, err, _ = invoke("tokenize", secret, good, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip")
    assert code == 0, err
    (r,) = read_jsonl(tmp_path / "o" / "rejects.jsonl")
    assert r["source"] == str(secret) and "Permission denied" in r["reason"]
    assert len(TokenDataset(tmp_path / "o")) == 2


# -- tokenizer and option mistakes ----------------------------------------------------------------------------
def user_error(tmp_path, *args) -> str:
    code, _, err, escaped = invoke("tokenize", *args)
    assert escaped is None, repr(escaped)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()
    return err


def test_wrong_tokenizer_paths(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    err = user_error(tmp_path, src, "-o", tmp_path / "o", "--tokenizer", tmp_path / "nope")
    assert f"--tokenizer {tmp_path / 'nope'}: no such file or directory" in err
    (tmp_path / "emptydir").mkdir()
    assert "the directory holds no tokenizer.json" in user_error(tmp_path, src, "-o", tmp_path / "o", "--tokenizer",
                                                   tmp_path / "emptydir")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    assert "not a loadable HF tokenizer.json" in user_error(tmp_path, src, "-o", tmp_path / "o", "--tokenizer",
                                                            tmp_path / "broken")
    cfg = tmp_path / "badcfg"
    cfg.mkdir()
    (cfg / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    (cfg / "tokenizer_config.json").write_text("{oops")
    assert "tokenizer_config.json: not valid JSON" in user_error(tmp_path, src, "-o", tmp_path / "o",
                                                                 "--tokenizer", cfg)


@requires_shared_data
def test_vocab_too_large_for_uint16(tmp_path, run_cli):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    code, _, err = run_cli("tokenize", src, "-o", tmp_path / "o", "--tokenizer", SHARED / "tokenizers/qwen3",
                           "--dtype", "uint16")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == ("error: --dtype uint16: the tokenizer has 151,669 tokens, more than uint16 holds "
                           "(65,536); use --dtype int32 or auto")
    assert not (tmp_path / "o").exists()


@requires_shared_data
def test_mistral_fits_uint16_and_int32_can_be_forced(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    m16 = tokenize(src, tmp_path / "u16", SHARED / "tokenizers/mistral", dtype="uint16")
    m32 = tokenize(src, tmp_path / "i32", SHARED / "tokenizers/mistral", dtype="int32")
    assert m16["streams"]["tokens"]["dtype"] == "uint16" and m32["streams"]["tokens"]["dtype"] == "int32"
    a, b = TokenDataset(tmp_path / "u16"), TokenDataset(tmp_path / "i32")
    assert a.tokens.items.tolist() == b.tokens.items.tolist()


@pytest.mark.parametrize("args, needle", [
    (["--num-shards", "0"], "--num-shards 0: must be ≥ 1"),
    (["--num-shards", "3", "--shard-index", "3"], "--shard-index 3: must be in [0, 2]"),
    (["--workers", "-1"], "--workers -1: must be ≥ 0"),
    (["--limit", "0"], "--limit 0: must be ≥ 1"),
    (["--chat-template", "no-such-template"], "neither auto, chatml, llama3 nor an existing Jinja file"),
])
def test_bad_options(tmp_path, tiny_tokenizer, args, needle):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    assert needle in user_error(tmp_path, src, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer, *args)


def test_input_and_output_mistakes(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    assert "no such file or directory" in user_error(tmp_path, tmp_path / "missing.jsonl", "-o", tmp_path / "o",
                                                     "--tokenizer", tiny_tokenizer)
    assert "the pattern matches no file" in user_error(tmp_path, str(tmp_path / "*.parquet"), "-o", tmp_path / "o",
                                                       "--tokenizer", tiny_tokenizer)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("precious")
    code, _, err, _ = invoke("tokenize", src, "-o", tmp_path / "o", "--tokenizer", tiny_tokenizer)
    assert code == 2 and "already exists and is not empty" in err
    assert (tmp_path / "o" / "keep.txt").read_text() == "precious"


def test_chat_template_missing_for_chat_records(tmp_path, tiny_tokenizer):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    src = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "yo"}]}])
    err = user_error(tmp_path, src, "-o", tmp_path / "o", "--tokenizer", d / "tokenizer.json", "--format", "chat")
    assert "no chat_template in tokenizer_config.json" in err
    # Text-only runs do not need a template.
    text = write_jsonl(tmp_path / "t.jsonl", text_records(2))
    code, _, err, _ = invoke("tokenize", text, "-o", tmp_path / "t", "--tokenizer", d / "tokenizer.json")
    assert code == 0, err


def test_errors_are_xprep_errors_in_the_api(tmp_path, tiny_tokenizer):
    src = tmp_path / "a.jsonl"
    src.write_bytes(GOOD + b"{bad\n")
    with pytest.raises(XprepError, match=r"a\.jsonl:2: malformed JSON"):
        tokenize(src, tmp_path / "o", tiny_tokenizer)


# -- 6. killing the process never leaves a dataset that opens ---------------------------------------------------
def _spawn(args) -> subprocess.Popen:
    script = [sys.executable, "-c", "from xprep import cli; cli.xprep()"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([*script, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and any worker processes it started
    except ProcessLookupError:
        pass
    proc.wait()


def _assert_absent_or_complete(out, reference) -> bool:
    """The output either does not exist, or opens and is the complete dataset. Returns whether it exists."""
    if not out.exists():
        return False
    ds = TokenDataset(out)  # must open: a published dataset is complete
    assert ds.fingerprint == reference["fingerprint"]
    assert_same_files(out, out.with_name("reference"))
    return True


@requires_shared_data
def test_sigkill_at_random_moments_never_leaves_a_valid_looking_dataset(tmp_path):
    corpus = sorted((SHARED / "corpora/sotu").glob("*.txt"))[:80]
    tok = SHARED / "tokenizers/qwen3"
    reference = tokenize(corpus, tmp_path / "reference", tok)
    out = tmp_path / "out"
    args = ["tokenize", *corpus, "-o", out, "--tokenizer", tok, "--backend", "hf", "--workers", "1"]
    rng = random.Random(1234)
    for _ in range(4):
        proc = _spawn(args)
        time.sleep(rng.uniform(0.2, 2.5))
        _kill(proc)  # if it finished already, the dataset must be complete
        if _assert_absent_or_complete(out, reference):
            break
        # A killed run leaves at most its own hidden temporary directory and lock file (whose lock died with it).
        for p in tmp_path.iterdir():
            assert p.name in ("reference", ".out.lock") or p.name.startswith(".out.tmp-"), p.name
    if not out.exists():
        proc = _spawn(args)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    _assert_absent_or_complete(out, reference)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "stale temporaries are cleaned"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie, ended but not yet reaped, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _until(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_end_with_a_killed_main_process_and_spill_only_into_the_output_temp(tmp_path, tiny_tokenizer, start):
    """Issue 31: SIGKILL of `xprep tokenize --workers 2` (its main process alone: the OOM killer's way) ends its
    workers too, forked or spawned, instead of leaving them waiting forever on their task pipe; their results would
    have gone into the output's temporary directory, never $TMPDIR (a fresh one here, which stays empty); the next
    run removes the killed one's temporary directory. The input is a FIFO nobody writes: the run waits on it with
    its workers started."""
    fifo, tmpdir, out = tmp_path / "slow.txt", tmp_path / "tmpdir", tmp_path / "out"
    os.mkfifo(fifo)
    tmpdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen([sys.executable, "-c", "from xprep import cli; cli.xprep()", "tokenize", str(fifo),
                             "-o", str(out), "--tokenizer", str(tiny_tokenizer), "--format", "text", "--workers", "2",
                             "--worker-start", start],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        _until(lambda: len(_children(proc.pid)) >= 2 and list(tmp_path.glob(".out.tmp-*/.scratch/results-*")),
               "the workers never started")
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _until(lambda: not any(_running(w) for w in workers), f"workers {workers} outlived the main process", 30)
    finally:
        _kill(proc)
    assert list(tmpdir.iterdir()) == []
    (tmp_path / "a.txt").write_text("the next run's only document")
    code, _, err = xprep_cli("tokenize", tmp_path / "a.txt", "-o", out, "--tokenizer", tiny_tokenizer, "--workers", "2")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out", "slow.txt", "tmpdir"]
    assert not (out / ".scratch").exists()


def test_a_second_writer_of_the_same_output_stops_at_once_naming_the_first(tmp_path, tiny_tokenizer):
    """Two ``xprep tokenize`` to one ``-o`` (issue 29): the second, started while the first holds the output, ends with
    one line naming the first (its pid, its lock file), exit 2; the first goes on undisturbed and publishes its whole
    dataset; nothing is left behind. The first reads a FIFO, so that it holds the output for as long as the test
    needs (its input ends when the test writes it)."""
    fifo = tmp_path / "slow.txt"
    os.mkfifo(fifo)
    out, lock = tmp_path / "out", tmp_path / ".out.lock"
    first = _spawn(["tokenize", fifo, "-o", out, "--tokenizer", tiny_tokenizer, "--format", "text", "--workers", "1"])
    try:
        deadline = time.monotonic() + 120
        while not (lock.is_file() and f'"pid": {first.pid}' in lock.read_text()):  # the first holds the output
            assert first.poll() is None, first.communicate()[1].decode()
            assert time.monotonic() < deadline, "the first writer never took the output"
            time.sleep(0.05)
        other = write_jsonl(tmp_path / "other.jsonl", text_records(5))
        code, out_text, err = xprep_cli("tokenize", other, "-o", out, "--tokenizer", tiny_tokenizer, "--workers", "1")
        assert code == 2 and out_text == "" and err.count("\n") == 1 and err.startswith("error: "), err
        assert f"-o {out}: another process is writing it" in err and f"pid {first.pid}" in err, err
        command = json.loads(lock.read_text())["command"]  # (-c: python -c, _spawn); cut to a line on long paths
        assert str(lock) in err and f"command: {command}" in err and command.startswith(f"-c tokenize {fifo}"), err
        with open(fifo, "w") as f:  # the first one's input, at last
            f.write("the first writer's only document\n")
        _, first_err = first.communicate(timeout=300)
    finally:
        _kill(first)
    assert first.returncode == 0, first_err.decode()
    assert len(TokenDataset(out)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.jsonl", "out", "slow.txt"]  # no temporary, no lock


def test_a_writer_that_finds_the_output_published_meanwhile_says_so(tmp_path, tiny_tokenizer, monkeypatch):
    """A writer that checked ``-o`` before another published there (the lock free again) refuses under the lock, as
    it would have at its start; what is there stays as it is."""
    src = write_jsonl(tmp_path / "a.jsonl", text_records(5))
    tokenize(src, tmp_path / "out", tiny_tokenizer)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr("xprep.prep.tokenize.run.check_output_dir", lambda path: None)  # as if it had checked earlier
    with pytest.raises(XprepError, match="already exists and is not empty"):
        tokenize(src, tmp_path / "out", tiny_tokenizer)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]


KILL_POINTS = {
    "before-publish": "xprep.prep.dataset.token_dataset.fsync_tree",
    "manifest-write": "xprep.prep.dataset.token_dataset.write_json_atomic",
    "stream-close": "xprep.prep.dataset.indexed.write_index",
}


@pytest.mark.parametrize("where", list(KILL_POINTS))
def test_kill_at_the_worst_moments(tmp_path, tiny_tokenizer, where):
    """SIGKILL inside the publishing steps themselves: nothing opens; the rerun succeeds and cleans up."""
    src = write_jsonl(tmp_path / "a.jsonl", text_records(40) + [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    module, func = KILL_POINTS[where].rsplit(".", 1)
    program = (
        "import os, signal, importlib, cli\n"
        f"m = importlib.import_module({module!r})\n"
        f"setattr(m, {func!r}, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))\n"
        "cli.xprep()\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", program, "tokenize", str(src), "-o", str(out), "--tokenizer",
                           str(tiny_tokenizer), "--workers", "1"], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]) == 1
    code, _, err = xprep_cli("tokenize", src, "-o", out, "--tokenizer", tiny_tokenizer, "--workers", "1")
    assert code == 0, err
    assert len(TokenDataset(out)) == 41
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


# -- untrusted values that must not reach numpy or a dict unchecked ---------------------------------------------
@pytest.mark.parametrize("bad, field", [
    (b'{"input_ids": [1, 99999999999999999999999]}\n', "input_ids"),
    (b'{"input_ids": [1, 2], "category_ids": [0, 99999999999999999999999]}\n', "category_ids"),
], ids=["input_ids", "category_ids"])
def test_huge_integers_are_bad_records(tmp_path, tiny_tokenizer, bad, field):
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD + bad)
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer)
    assert escaped is None, f"an exception escaped: {escaped!r}"
    assert code == 2 and err.startswith(f"error: {src}:2: ") and field in err, err
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                                   "--on-error", "skip")
    assert escaped is None and code == 0, err
    (reject,) = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert reject["line"] == 2 and field in reject["reason"]


@pytest.mark.parametrize("category", [["x"], {"a": 1}, 7, ""], ids=["list", "dict", "int", "empty"])
def test_message_category_is_validated_like_a_record_category(tmp_path, tiny_tokenizer, category):
    """A record's category must be a non-empty string (else a bad record); a message's too."""
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo", "category": category}]}
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD + json.dumps(record).encode() + b"\n")
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer)
    assert escaped is None, f"an exception escaped: {escaped!r}"
    assert code == 2 and err.startswith(f"error: {src}:2: ") and "category" in err, err


UNTRUSTED = {
    # Valid JSON whose strings hold lone surrogates: Python accepts them, no tokenizer can encode them.
    "surrogate-text": b'{"text": "abc \\ud800 def"}\n',
    "surrogate-chat": b'{"messages": [{"role": "user", "content": "hi \\udc00"}, '
                      b'{"role": "assistant", "content": "yo"}]}\n',
    # Nesting deeper than Python's recursion limit.
    "deep-nesting": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
}


@pytest.mark.parametrize("name", list(UNTRUSTED))
def test_untrusted_json_is_a_bad_record_not_a_crash(tmp_path, tiny_tokenizer, name):
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD + UNTRUSTED[name] + GOOD)
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer)
    assert escaped is None, f"an exception escaped: {escaped!r}"
    assert code == 2 and err.startswith(f"error: {src}:2: "), err
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                                   "--on-error", "skip")
    assert escaped is None and code == 0, err
    assert [r["line"] for r in read_jsonl(tmp_path / "out" / "rejects.jsonl")] == [2]
    assert len(TokenDataset(tmp_path / "out")) == 2


def test_chat_record_without_any_template_names_the_record_and_the_fix(tmp_path, tiny_tokenizer):
    """--format auto with a tokenizer that has no chat_template: the first chat record is the problem."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((tiny_tokenizer / "tokenizer.json").read_bytes())
    src = tmp_path / "in.jsonl"
    src.write_bytes(GOOD + GOOD_FOR_FORMAT["chat"])
    code, _, err, escaped = invoke("tokenize", src, "-o", tmp_path / "out", "--tokenizer", d)
    assert escaped is None and code == 2
    assert err.startswith(f"error: {src}:2: ") and "--chat-template" in err, err
