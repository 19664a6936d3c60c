"""What a new user hit with ``xprep tokenize`` on real data (issue 9): each case failed before its fix.

Bad input ends in one line and exit status 2, within 30 s, leaving no temporary directory; a run that
produces nothing is refused; defaults that shape the output are said; progress reaches logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, SHARED, TINY_CHAT_TEMPLATE, _training_corpus, requires_shared_data, xprep_cli
from prepkit import chat_records, read_jsonl, text_records, write_jsonl, xprep_invoke
from xprep.prep.dataset.token_dataset import TokenDataset

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def one_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def no_temp_left(directory: Path) -> None:
    left = [p.name for p in directory.iterdir() if ".tmp-" in p.name or p.name.startswith(".xprep-probe")]
    assert not left, f"temporary output left behind: {left}"


def tokenizer_dir(tmp_path: Path, name: str, config: dict | None, specials=("<|endoftext|>",)) -> Path:
    """A byte-level BPE trained here with ``specials``; ``config`` becomes tokenizer_config.json (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    out = tmp_path / name
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    if config is not None:
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# -- 1. a broken chat template ends the command, whatever the worker count ---------------------------------------
@pytest.mark.parametrize("workers", ["1", "2"])
def test_template_syntax_error_fails_once_with_any_worker_count(tmp_path, tiny_tokenizer, workers):
    broken = "{% for m in messages %}{{ m.content }}{% endfor"
    tok = tokenizer_dir(tmp_path, "tok", {"eos_token": "<|endoftext|>", "chat_template": broken})
    src = write_jsonl(tmp_path / "chat.jsonl", chat_records(50))
    start = time.monotonic()
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tok, "--format", "chat",
                             "--workers", workers, timeout=30)
    assert time.monotonic() - start < 30
    one_line_error(code, err, "chat template: Jinja syntax error at line 1")
    assert not (tmp_path / "out").exists()
    no_temp_left(tmp_path)


def _workers(pid: int, start: str) -> list[int]:
    """The tokenize worker processes of ``pid``: forked ones (which keep its command line) or spawned ones."""
    spawned = [(child, "spawn_main" in cmdline) for child, cmdline in _child_processes(pid) if "tokenize" in cmdline
               or "spawn_main" in cmdline]
    return [child for child, was_spawned in spawned if was_spawned == (start == "spawn")]


def _child_processes(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each process whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append((int(entry.name), cmdline))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the worker processes")
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_killed_mid_run_ends_the_command(start, tmp_path, tiny_tokenizer):
    """A worker that dies (the OOM killer, a SIGKILL) must not leave the command waiting forever, whether the
    workers were forked or spawned."""
    src = write_jsonl(tmp_path / "chat.jsonl", chat_records(12) * 4000)
    script = Path(sys.executable).with_name("xprep")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([str(script), "tokenize", str(src), "-o", str(tmp_path / "out"), "--tokenizer",
                             str(tiny_tokenizer), "--format", "chat", "--workers", "2", "--worker-start", start],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 20
        workers = []
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid, start)
            time.sleep(0.05)
        assert workers, "no worker process appeared"
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    one_line_error(proc.returncode, err, "worker process died")
    assert not (tmp_path / "out").exists()
    no_temp_left(tmp_path)


# -- 2. output paths are checked up front -------------------------------------------------------------------------
def test_unusable_output_paths(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    (tmp_path / "afile").write_text("")
    cases = [(tmp_path / "afile" / "sub", "afile is a file, not a directory"),
             (tmp_path / "afile", "exists and is a file, not a directory"),
             ("/proc/forbidden", "cannot write in /proc")]
    for out, needle in cases:
        code, _, err = xprep_cli("tokenize", src, "-o", out, "--tokenizer", tiny_tokenizer, timeout=30)
        one_line_error(code, err, f"-o {out}: ", needle)
    assert (tmp_path / "afile").read_text() == ""
    no_temp_left(tmp_path)


# -- 3. messages that say what is wrong ----------------------------------------------------------------------------
@pytest.mark.parametrize("value, needle", [
    ('"hello"', "field 'conversations' is a string, expected a list of messages"),
    ('{"from": "human", "value": "hi"}', "field 'conversations' is an object, expected a list of messages"),
    ("42", "field 'conversations' is a number, expected a list of messages"),
    ("null", "field 'conversations' is null"),
])
def test_wrong_type_conversations_say_the_type(tmp_path, tiny_tokenizer, value, needle):
    src = tmp_path / "in.jsonl"
    src.write_text('{"conversations": ' + value + "}\n")
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer, timeout=30)
    one_line_error(code, err, f"{src}:1: {needle}")
    assert "empty conversation" not in err and "missing field" not in err


def test_truncated_line_is_called_cut_off(tmp_path, tiny_tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"messages": [{"role": "user", "content": "a long question that is cu\n')
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer, timeout=30)
    one_line_error(code, err, f"{src}:2: truncated JSON: the line ends", "cut off")
    assert "at at" not in err


def test_missing_tokenizer_says_the_path_does_not_exist(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", "/nonexistent", timeout=30)
    one_line_error(code, err, "--tokenizer /nonexistent: no such file or directory")


# -- 4. nothing produced is an error, not "0 documents" and exit 0 --------------------------------------------------
def test_empty_vocabulary_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "empty").mkdir()
    tok.save(str(tmp_path / "empty" / "tokenizer.json"))
    src = write_jsonl(tmp_path / "a.jsonl", text_records(20))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tmp_path / "empty", timeout=30)
    one_line_error(code, err, "this tokenizer cannot encode text", "distinct")
    assert not (tmp_path / "out").exists()


def test_empty_input_is_an_error_unless_allowed(tmp_path, tiny_tokenizer):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer, timeout=30)
    one_line_error(code, err, "no document to write", "--allow-empty")
    assert not (tmp_path / "out").exists()
    no_temp_left(tmp_path)
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                             "--allow-empty", timeout=30)
    assert code == 0, err
    assert len(TokenDataset(tmp_path / "out")) == 0


def test_all_rejected_input_is_an_error(tmp_path, tiny_tokenizer):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": ""}\n{"messages": []}\n[1]\n')
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip", timeout=30)
    one_line_error(code, err, "no document to write", "all 3 records were rejected")
    assert not (tmp_path / "out").exists()
    no_temp_left(tmp_path)


def test_no_target_token_is_an_error(tmp_path, tiny_tokenizer):
    """Documents of one token each (no EOD) have nothing to learn: the first token is never a target."""
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, {"text": "b"}])
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                             "--no-append-eod", timeout=30)
    one_line_error(code, err, "2 documents but not one target token")
    assert not (tmp_path / "out").exists()


# -- 5. special tokens taken from defaults are said, and can be set ------------------------------------------------
def test_llama3_template_without_tokenizer_config(tmp_path):
    tok = tokenizer_dir(tmp_path, "llama", None, LLAMA3_SPECIALS)
    ids = json.loads((tok / "tokenizer.json").read_text())["added_tokens"]
    id_of = {t["content"]: t["id"] for t in ids}
    src = write_jsonl(tmp_path / "chat.jsonl", chat_records(6))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tok, "--format", "chat",
                             "--chat-template", "llama3", "--workers", "1", timeout=60)
    assert code == 0, err
    ds = TokenDataset(tmp_path / "out")
    assert all(ds.document(i)["input_ids"][0] == id_of["<|begin_of_text|>"] for i in range(len(ds)))
    special = ds.manifest["special_tokens"]
    assert special["bos"] == {"token": "<|begin_of_text|>", "id": id_of["<|begin_of_text|>"],
                              "from": "default (there is no tokenizer_config.json beside the tokenizer)"}
    assert special["eod"]["token"] == "<|eot_id|>" and special["eod"]["id"] == id_of["<|eot_id|>"]
    assert special["eod"]["from"].startswith("default") and "template ends turns with it" in special["eod"]["from"]
    assert ds.manifest["tokenizer"]["eod_id"] == id_of["<|eot_id|>"]
    assert "note: end-of-document token '<|eot_id|>'" in err and "--eod-token" in err
    assert "note: BOS token '<|begin_of_text|>'" in err and "--bos-token" in err
    # Named on the command line: used, and no note.
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "flags", "--tokenizer", tok, "--format", "chat",
                             "--chat-template", "llama3", "--workers", "1", "--eod-token", "<|end_of_text|>",
                             "--bos-token", "", timeout=60)
    assert code == 0, err
    ds = TokenDataset(tmp_path / "flags")
    assert ds.document(0)["input_ids"][0] != id_of["<|begin_of_text|>"]
    assert ds.manifest["special_tokens"]["eod"] == {"token": "<|end_of_text|>", "id": id_of["<|end_of_text|>"],
                                                    "from": "--eod-token"}
    assert "note:" not in err
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "bad", "--tokenizer", tok, "--eod-token", "<nope>",
                             timeout=30)
    one_line_error(code, err, "--eod-token <nope>: not a token of this tokenizer's vocabulary")


def test_config_tokens_are_not_called_defaults(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer, timeout=30)
    assert code == 0 and "note:" not in err, err
    special = TokenDataset(tmp_path / "out").manifest["special_tokens"]
    assert special["eod"]["from"] == "tokenizer_config.json" and special["bos"]["token"] is None


# -- friction: ShareGPT roles, reject kinds, progress in logs, worker choice, help ---------------------------------
def test_sharegpt_product_roles_and_role_map(tmp_path, tiny_tokenizer):
    def conv(assistant_role):
        return {"conversations": [{"from": "human", "value": "hi"}, {"from": assistant_role, "value": "hello"}]}

    src = write_jsonl(tmp_path / "sg.jsonl", [conv("chatgpt"), conv("bing"), conv("bard"), conv("wizard"),
                                              conv("wizard"), conv("oracle"), {"conversations": []}])
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "skip", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip", "--workers", "1", timeout=60)
    assert code == 0, err
    manifest = TokenDataset(tmp_path / "skip").manifest
    assert manifest["counts"]["documents"] == 3
    assert manifest["rejects"]["by_reason"] == {"empty conversation": 1, "unknown role 'oracle'": 1,
                                                "unknown role 'wizard'": 2}
    assert [r["kind"] for r in read_jsonl(tmp_path / "skip" / "rejects.jsonl")] == [
        "unknown role 'wizard'", "unknown role 'wizard'", "unknown role 'oracle'", "empty conversation"]
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "mapped", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip", "--role-map", "Wizard=assistant,oracle=assistant", timeout=60)
    assert code == 0, err
    manifest = TokenDataset(tmp_path / "mapped").manifest
    assert manifest["counts"]["documents"] == 6 and manifest["rejects"]["by_reason"] == {"empty conversation": 1}
    assert manifest["options"]["role_map"] == {"oracle": "assistant", "wizard": "assistant"}
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "bad", "--tokenizer", tiny_tokenizer,
                             "--role-map", "wizard=genie", timeout=30)
    one_line_error(code, err, "--role-map wizard=genie", "system, user, assistant, tool")


def test_progress_lines_in_a_log(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(20) * 500)
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                             "--progress-every", "0.000001", timeout=60)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("tokenize ")]
    assert lines and all("docs" in line and "tokens" in line and "MB/s" in line and "ETA" in line
                         for line in lines), err
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "quiet", "--tokenizer", tiny_tokenizer,
                             "--progress-every", "0", timeout=60)
    assert code == 0 and not [line for line in err.splitlines() if line.startswith("tokenize ")], err


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: auto picks one worker either way")
def test_auto_format_on_chat_uses_the_chat_worker_count(tmp_path, tiny_tokenizer):
    """--format auto sizes the pool by what the first record is, as --format chat does (issue 9: it took 1)."""
    import gzip

    from xprep.prep.tokenize.pool import CHAT_POOL_MIN_BYTES, auto_workers

    cores = min(os.cpu_count(), 8)
    assert auto_workers(True, CHAT_POOL_MIN_BYTES) == auto_workers(True, None) == cores
    assert auto_workers(True, CHAT_POOL_MIN_BYTES - 1) == auto_workers(False, None) == 1
    big = write_jsonl(tmp_path / "chat.jsonl", chat_records(10))  # compressed: its size is unknown up front
    (tmp_path / "chat.jsonl.gz").write_bytes(gzip.compress(big.read_bytes()))
    for fmt in ("auto", "chat"):
        code, _, err = xprep_cli("tokenize", tmp_path / "chat.jsonl.gz", "-o", tmp_path / fmt, "--tokenizer",
                                 tiny_tokenizer, "--format", fmt, timeout=60)
        assert code == 0 and f"{cores} workers]" in err, err
    code, _, err = xprep_cli("tokenize", big, "-o", tmp_path / "small", "--tokenizer", tiny_tokenizer, timeout=60)
    assert code == 0 and "1 worker]" in err, err  # too small to pay for starting workers
    text = write_jsonl(tmp_path / "text.jsonl", text_records(10))
    code, _, err = xprep_cli("tokenize", text, "-o", tmp_path / "text", "--tokenizer", tiny_tokenizer, timeout=60)
    assert code == 0 and "1 worker]" in err, err


def test_every_option_has_help():
    import click
    from xprep import cli

    def commands(group):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                yield from commands(command)
            else:
                yield name, command

    def has_help(option: click.Option, command: click.Command) -> bool:
        option.get_help_record(click.Context(command))  # some helps are written when --help shows them
        return bool(option.help)

    missing = [f"{name} {opt.opts[-1]}" for group in (cli.xprep, cli.xtrain) for name, command in commands(group)
               for opt in command.params if isinstance(opt, click.Option) and not has_help(opt, command)]
    assert not missing, f"options without a help line: {missing}"


@requires_shared_data
def test_bad_records_and_defaults_on_a_real_tokenizer(tmp_path):
    """Qwen3's own config names its tokens: no note; its template's syntax error fails with 2 workers too."""
    qwen = SHARED / "tokenizers/qwen3"
    src = SHARED / "chat/chitchat.jsonl"
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", qwen, "--limit", "200",
                             "--on-error", "skip", timeout=120)
    assert code == 0 and "note:" not in err, err
    manifest = TokenDataset(tmp_path / "out").manifest
    assert manifest["special_tokens"]["eod"] == {"token": "<|im_end|>", "id": 151645, "from": "tokenizer_config.json"}
    assert set(manifest["rejects"]["by_reason"]) <= {"no assistant message"}
    cfg = json.loads((qwen / "tokenizer_config.json").read_text())
    broken = tmp_path / "qwen-broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((qwen / "tokenizer.json").read_bytes())
    (broken / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": cfg["chat_template"][:-40]}))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "broken", "--tokenizer", broken, "--workers", "2",
                             "--limit", "200", timeout=30)
    one_line_error(code, err, "chat template")
    no_temp_left(tmp_path)


assert TINY_CHAT_TEMPLATE  # the tiny tokenizer's template is the ChatML one the cases above rely on


def test_format_auto_content_does_not_depend_on_the_first_record(tmp_path):
    """The EOD follows the chat template only when the command says the data is chat: shards of a mixed
    input (one starting with text, one with chat) agree and merge into the single run, byte for byte."""
    from prepkit import assert_same_files

    tok = tokenizer_dir(tmp_path, "tok", {"chat_template": TINY_CHAT_TEMPLATE},
                        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    a = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    b = write_jsonl(tmp_path / "b.jsonl", chat_records(3))
    for i in range(2):
        code, _, err = xprep_cli("tokenize", a, b, "-o", tmp_path / f"s{i}", "--tokenizer", tok, "--num-shards", "2",
                                 "--shard-index", str(i), timeout=60)
        assert code == 0, err
    code, _, err = xprep_cli("tokenize", a, b, "-o", tmp_path / "one", "--tokenizer", tok, timeout=60)
    assert code == 0, err
    code, _, err = xprep_cli("merge", tmp_path / "s0", tmp_path / "s1", "-o", tmp_path / "merged", timeout=60)
    assert code == 0, err
    assert_same_files(tmp_path / "one", tmp_path / "merged")
    assert TokenDataset(tmp_path / "one").manifest["special_tokens"]["eod"]["token"] == "<|endoftext|>"


def test_all_rejected_says_why_and_long_roles_share_one_kind(tmp_path, tiny_tokenizer):
    weird = "x" * 200
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                             {"messages": [{"role": weird, "content": "hi"}]}])
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer,
                             "--on-error", "skip", timeout=30)
    one_line_error(code, err, "all 2 records were rejected (1 × no assistant message, 1 × unknown role)")
    assert weird not in err.split("(")[1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the worker processes")
@pytest.mark.parametrize("how, start", [("sigterm", "fork"), ("ctrl-c", "fork"), ("ctrl-c", "spawn")])
def test_sigterm_removes_the_temporary_output_and_stops_the_workers(how, start, tmp_path, tiny_tokenizer):
    """Preemption (SIGTERM to the command, as Slurm and Kubernetes send) unwinds like Ctrl-C (SIGINT to every
    process of the terminal's group, workers included): nothing is left behind, whether workers were forked or
    spawned."""
    src = write_jsonl(tmp_path / "chat.jsonl", chat_records(12) * 4000)
    script = Path(sys.executable).with_name("xprep")
    proc = subprocess.Popen([str(script), "tokenize", str(src), "-o", str(tmp_path / "out"), "--tokenizer",
                             str(tiny_tokenizer), "--format", "chat", "--workers", "2", "--worker-start", start],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            # a job started without a terminal inherits SIGINT ignored: take it as a terminal's is
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 20
        workers = []
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = _workers(proc.pid, start)
            time.sleep(0.05)
        assert workers, "no worker process appeared"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    no_temp_left(tmp_path)
    assert not (tmp_path / "out").exists()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in workers if Path(f"/proc/{pid}/stat").exists()
             and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"]
    assert not alive, f"workers still running: {alive}"


# -- issue 29: what a new user building an SFT + continued-pretraining mix was not told ----------------------------
def _run(*args) -> tuple[int, str]:
    """``xprep ARGS`` in this process: (exit code, stderr)."""
    result = xprep_invoke(*args)
    return result.exit_code, result.stderr


@requires_shared_data
def test_text_ending_with_a_chat_end_of_turn_marker_gets_a_note(tmp_path):
    """Qwen3's config names ``<|im_end|>`` (ChatML's end of turn) as its eos_token: text documents ended with it, said
    nowhere; now a note says so and names the vocabulary's end-of-text token. Not said where --eod-token chose it, nor
    for chat data (whose turns it does end)."""
    qwen = SHARED / "tokenizers/qwen3"
    corpus = sorted((SHARED / "corpora/sotu").glob("*.txt"))[:3]
    code, err = _run("tokenize", *corpus, "-o", tmp_path / "text", "--tokenizer", qwen)
    assert code == 0, err
    assert ("note: text documents end with '<|im_end|>' (id 151645, from tokenizer_config.json), which ends a chat "
            "turn rather than a document; for pretraining text pass --eod-token '<|endoftext|>' (id 151643)") in err
    assert TokenDataset(tmp_path / "text").document(0)["input_ids"][-1] == 151645
    code, err = _run("tokenize", *corpus, "-o", tmp_path / "chosen", "--tokenizer", qwen, "--eod-token",
                     "<|endoftext|>")
    assert code == 0 and "note:" not in err, err
    assert TokenDataset(tmp_path / "chosen").document(0)["input_ids"][-1] == 151643
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(4))
    code, err = _run("tokenize", chat, "-o", tmp_path / "chat", "--tokenizer", qwen)
    assert code == 0 and "note:" not in err, err


def test_llama3_instruct_eos_on_text_names_end_of_text(tmp_path):
    """The issue's own case: a Llama 3 Instruct config names ``<|eot_id|>``; continued pretraining wants
    ``<|end_of_text|>``, which the note names with its id."""
    tok = tokenizer_dir(tmp_path, "llama", {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"},
                        LLAMA3_SPECIALS)
    id_of = {t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]}
    src = write_jsonl(tmp_path / "a.jsonl", text_records(3))
    code, err = _run("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tok, "--format", "text")
    assert code == 0, err
    assert (f"note: text documents end with '<|eot_id|>' (id {id_of['<|eot_id|>']}, from tokenizer_config.json)"
            in err and f"pass --eod-token '<|end_of_text|>' (id {id_of['<|end_of_text|>']})" in err), err


@requires_shared_data
def test_chatml_over_a_vocabulary_without_its_markers_gets_a_note(tmp_path):
    """``--chat-template chatml`` over Mistral's vocabulary, which has no ``<|im_start|>``/``<|im_end|>``: each marker
    is encoded as several text tokens, now said with how many; nothing said over Qwen3's, which has them."""
    from tokenizers import Tokenizer

    mistral = SHARED / "tokenizers/mistral"
    hf = Tokenizer.from_file(str(mistral / "tokenizer.json"))
    pieces = {m: len(hf.encode(m, add_special_tokens=False).ids) for m in ("<|im_start|>", "<|im_end|>")}
    assert min(pieces.values()) > 1
    chat = write_jsonl(tmp_path / "chat.jsonl", read_jsonl(SHARED / "chat/chitchat.jsonl")[:20])
    code, err = _run("tokenize", chat, "-o", tmp_path / "mistral", "--tokenizer", mistral, "--chat-template", "chatml")
    assert code == 0, err
    assert ("note: the chat template chatml writes markers that are no token of this vocabulary, each encoded as "
            f"text: <|im_start|> ({pieces['<|im_start|>']} tokens), <|im_end|> ({pieces['<|im_end|>']} tokens)"
            in err), err
    code, err = _run("tokenize", chat, "-o", tmp_path / "qwen", "--tokenizer", SHARED / "tokenizers/qwen3",
                     "--chat-template", "chatml")
    assert code == 0 and "note:" not in err, err


@requires_shared_data
def test_a_directory_input_says_what_it_read_and_skipped(tmp_path):
    """A directory took every .txt as a document (a NOTES.txt became document 0) and skipped the rest in silence: now
    what is read and skipped is said by extension, hidden files are counted, and notes read as documents warned of."""
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    (corpus / ".git").mkdir()
    for f in sorted((SHARED / "corpora/sotu").glob("*.txt"))[:3]:
        (corpus / f.name).write_bytes(f.read_bytes())
    (corpus / "NOTES.txt").write_text("where these speeches come from\n")
    write_jsonl(corpus / "more" / "extra.jsonl", text_records(2))
    for name in ("README.md", "fetch.py", "more/LICENSE", "more/index.html", "more/other.html", ".git/HEAD"):
        (corpus / name).write_text("not corpus\n")
    code, err = _run("tokenize", corpus, "-o", tmp_path / "out", "--tokenizer", SHARED / "tokenizers/qwen3")
    assert code == 0, err
    assert (f"xprep tokenize: {corpus}: reading 5 files (4 .txt, 1 .jsonl); skipped 5 files (2 .html, 1 .md, 1 .py, "
            "1 no extension): not a format read; left out 1 hidden or inside xprep outputs\n") in err, err
    assert (f"xprep tokenize: warning: {corpus}: NOTES.txt looks like notes about the corpus rather than part of it, "
            "and is read as a document") in err, err
    assert len(TokenDataset(tmp_path / "out")) == 6
    # a file named on the command line is no directory listing: nothing said
    code, err = _run("tokenize", corpus / "NOTES.txt", "-o", tmp_path / "one", "--tokenizer",
                     SHARED / "tokenizers/qwen3", "--eod-token", "<|endoftext|>")
    assert code == 0 and "reading" not in err and "warning" not in err, err
    # a directory holding nothing to read says what it holds
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.rst").write_text("x\n")
    code, err = _run("tokenize", tmp_path / "docs", "-o", tmp_path / "none", "--tokenizer", SHARED / "tokenizers/qwen3")
    assert code == 2 and ("holds no .jsonl/.json/.ndjson(.gz/.zst), .txt, .parquet or .arrow file (it holds 1 file "
                          "(1 .rst))") in err, err


@requires_shared_data
def test_tokenizer_config_json_as_the_tokenizer_says_pass_the_directory(tmp_path):
    """``--tokenizer …/tokenizer_config.json`` was read as a tokenizer.json: a JSON parse error. Now: pass the
    directory."""
    qwen = SHARED / "tokenizers/qwen3"
    src = write_jsonl(tmp_path / "a.jsonl", text_records(2))
    code, _, err = xprep_cli("tokenize", src, "-o", tmp_path / "out", "--tokenizer", qwen / "tokenizer_config.json",
                             timeout=60)
    one_line_error(code, err, f"--tokenizer {qwen / 'tokenizer_config.json'}: a tokenizer_config.json, not a "
                   f"tokenizer; pass the directory holding it (--tokenizer {qwen})")


def test_one_document_is_not_called_documents(tmp_path, tiny_tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", text_records(1))
    code, err = _run("tokenize", src, "-o", tmp_path / "out", "--tokenizer", tiny_tokenizer)
    assert code == 0 and "xprep tokenize: 1 document, " in err, err
