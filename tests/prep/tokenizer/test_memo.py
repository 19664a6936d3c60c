"""prep/tokenizer/memo.py and the cache setting (prep/fs.py ``cache_root``): facts about tokenizers go to the cache
directory a command is given (``--cache-dir``), in its worker processes too, else to ``$XPREP_CACHE_DIR``."""

from __future__ import annotations

import os
from pathlib import Path

from prepkit import chat_records, text_records, write_jsonl, xprep_invoke
from xprep.prep.fs import cache_root
from xprep.prep.tokenizer import load_tokenizer_info


def _names(directory: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in directory.glob("*.json")) if directory.is_dir() else []


def test_tokenize_keeps_its_tokenizer_facts_in_cache_dir_workers_included(tmp_path, tiny_tokenizer, monkeypatch):
    """Chat records through two spawned workers (which rebuild the encoder and prove its clean cuts themselves):
    every memo lands in --cache-dir, none in $XPREP_CACHE_DIR."""
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "env-cache"))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(8) + text_records(4))
    result = xprep_invoke("tokenize", data, "-o", tmp_path / "ds", "--tokenizer", tiny_tokenizer, "--workers", 2,
                          "--cache-dir", tmp_path / "flag-cache", "--worker-start", "spawn")
    assert result.exit_code == 0, result.output
    assert {"tokenizer", "selfcheck", "cuts"} <= set(_names(tmp_path / "flag-cache"))
    assert not (tmp_path / "env-cache").exists()


def test_without_cache_dir_the_environment_names_the_cache(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "env-cache"))
    info = load_tokenizer_info(str(tiny_tokenizer))
    assert info.cache_dir is None and _names(tmp_path / "env-cache") == ["tokenizer"]
    monkeypatch.chdir(tmp_path)
    given = load_tokenizer_info(str(tiny_tokenizer), cache_dir="relative")
    assert given.cache_dir == str(tmp_path / "relative")  # absolute: workers may start elsewhere
    assert given == info and _names(tmp_path / "relative") == ["tokenizer"]


def test_the_cache_root_falls_back_in_order(tmp_path, monkeypatch):
    for name in ("XPREP_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "xprep"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "xprep"
    assert cache_root(fallback="~/old") == tmp_path / "home" / "old"  # an older variable's value, its caller's
    assert cache_root() == tmp_path / "xdg" / "xprep"
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root(fallback="~/old") == tmp_path / "env"
    assert cache_root(os.fspath(tmp_path / "flag"), fallback="~/old") == tmp_path / "flag"
