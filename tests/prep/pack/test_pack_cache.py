"""The pack cache: hits, misses, --force, concurrent and killed builds, edited and corrupt data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xprep.prep.pack.cache
from prepkit import category_dataset as make_dataset
from prepkit import lengths_for
from xprep.prep.errors import XprepError
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.entry import open_packed

ROOT = Path(__file__).resolve().parents[3]
XPREP = [sys.executable, "-c", "from xprep import cli; cli.xprep()"]
SLOW_PACK = str(Path(__file__).resolve().parents[2] / "_slow_pack.py")  # xprep, pausing before pack.json is written


@pytest.fixture
def ds(tmp_path) -> Path:
    return make_dataset(tmp_path / "ds", lengths_for(0))


def cfg(**kw) -> PackConfig:
    return PackConfig(**{"method": "multipack", "seq_len": 512, **kw})


def forbid_packing(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("packed on a cache hit")
    monkeypatch.setattr(xprep.prep.pack.cache, "pack_lengths", boom)


def test_same_command_twice_is_a_hit_that_does_no_packing(tmp_path, ds, monkeypatch):
    first = pack([ds], tmp_path / "P", cfg())
    assert not first.hit
    forbid_packing(monkeypatch)
    second = pack([ds], tmp_path / "P", cfg())
    assert second.hit and second.entry.path == first.entry.path
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert manifest["format"] == "xprep-packed" and manifest["current"] == first.entry.path.name


def test_every_option_and_dataset_order_is_a_new_entry(tmp_path, ds):
    ds2 = make_dataset(tmp_path / "ds2", lengths_for(1))
    variants = [cfg(), cfg(seq_len=1024), cfg(group_size=7), cfg(overlong="truncate"), cfg(cp_size=2),
                cfg(shuffle=True), cfg(shuffle=True, seed=3), cfg(method="sequential"),
                cfg(method="token-aware", seq_len=None, max_tokens=512)]
    names = {pack([ds], tmp_path / "P", c).entry.path.name for c in variants}
    names.add(pack([ds, ds2], tmp_path / "P", cfg()).entry.path.name)
    names.add(pack([ds2, ds], tmp_path / "P", cfg()).entry.path.name)
    assert len(names) == len(variants) + 2
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert set(manifest["entries"]) == names


def test_force_rebuilds(tmp_path, ds):
    first = pack([ds], tmp_path / "P", cfg())
    again = pack([ds], tmp_path / "P", cfg(), force=True)
    assert not again.hit and again.entry.path == first.entry.path
    assert np.array_equal(again.entry.item_doc, first.entry.item_doc)
    assert not list((tmp_path / "P").glob(".tmp-*")) and not list((tmp_path / "P").glob(".old-*"))


def test_a_build_removes_killed_builds_temporaries_but_not_another_hosts(tmp_path, ds):
    """Issue 31: a temporary entry directory is stale when its owner record names this host and a dead process; one
    of another host sharing the filesystem (where the entry's lock may not reach) is left alone."""
    import socket

    from xprep.prep.io import OWNER

    name = pack([ds], tmp_path / "P", cfg()).entry.path.name
    temps = {}
    for who, host in (("dead", socket.gethostname()), ("elsewhere", socket.gethostname() + "-b")):
        temps[who] = tmp_path / "P" / f".tmp-{name}-999999999-{who}"
        temps[who].mkdir()
        (temps[who] / OWNER).write_text(json.dumps({"host": host, "pid": 999_999_999}))
    assert not pack([ds], tmp_path / "P", cfg(), force=True).hit
    assert not temps["dead"].exists() and temps["elsewhere"].exists()
    assert [p.name for p in (tmp_path / "P").glob(".tmp-*")] == [temps["elsewhere"].name]


def test_edited_dataset_is_never_served_from_the_old_entry(tmp_path):
    ds = make_dataset(tmp_path / "ds", lengths_for(0))
    old = pack([ds], tmp_path / "P", cfg())
    shutil.rmtree(ds)
    lengths = lengths_for(0)
    lengths[17] += 1  # one more token in one document
    make_dataset(ds, lengths)
    new = pack([ds], tmp_path / "P", cfg())
    assert not new.hit and new.entry.key != old.entry.key
    assert new.entry.meta["stats"]["tokens_in"] == old.entry.meta["stats"]["tokens_in"] + 1
    assert open_packed(tmp_path / "P").key == new.entry.key


def test_moved_dataset_is_a_hit_pointing_at_the_new_path(tmp_path, ds, monkeypatch):
    pack([ds], tmp_path / "P", cfg())
    moved = tmp_path / "moved"
    shutil.move(ds, moved)
    forbid_packing(monkeypatch)
    outcome = pack([moved], tmp_path / "P", cfg())
    assert outcome.hit and outcome.entry.dataset_paths == [moved.resolve()]


def test_global_document_index_spans_datasets_in_order(tmp_path):
    a = make_dataset(tmp_path / "a", [10, 20, 30])
    b = make_dataset(tmp_path / "b", [40, 50], seed=1)
    entry = pack([a, b], tmp_path / "P", cfg(method="sequential", seq_len=64)).entry
    assert entry.item_doc.tolist() == [0, 1, 2, 3, 4]
    assert [d["first_document"] for d in entry.meta["datasets"]] == [0, 3]


@pytest.mark.parametrize("damage", ["garbage_json", "incomplete", "wrong_key"])
def test_corrupt_entry_is_an_error_not_a_silent_rebuild(tmp_path, ds, damage, monkeypatch):
    """A pack.json that does not open as this entry's (damaged arrays are built again: tests/test_packfile.py)."""
    entry = pack([ds], tmp_path / "P", cfg()).entry
    meta_path = entry.path / "pack.json"
    if damage == "garbage_json":
        meta_path.write_text("{ not json")
    else:
        meta = json.loads(meta_path.read_text())
        meta.update({"complete": False} if damage == "incomplete" else {"key": "0" * 64})
        meta_path.write_text(json.dumps(meta))
    forbid_packing(monkeypatch)
    with pytest.raises(XprepError, match="--force"):
        pack([ds], tmp_path / "P", cfg())
    monkeypatch.undo()
    assert not pack([ds], tmp_path / "P", cfg(), force=True).hit
    assert pack([ds], tmp_path / "P", cfg()).hit


def test_output_that_is_not_a_pack_cache_is_refused(tmp_path, ds):
    (tmp_path / "file").write_text("x")
    with pytest.raises(XprepError, match="is a file"):
        pack([ds], tmp_path / "file", cfg())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(XprepError, match="not a pack cache"):
        pack([ds], tmp_path / "other", cfg())
    with pytest.raises(XprepError, match="not a token dataset"):
        pack([tmp_path / "missing"], tmp_path / "P", cfg())
    other = make_dataset(tmp_path / "other_tok", [5, 6], tokenizer_sha="u")
    with pytest.raises(XprepError, match="different tokenizers"):
        pack([ds, other], tmp_path / "P", cfg())


def _pack_cmd(ds: Path, out: Path, sleep: float | None = None) -> list[str]:
    """``xprep pack`` in a fresh interpreter; with ``sleep``, a build pauses that long before pack.json."""
    xprep = XPREP if sleep is None else [sys.executable, SLOW_PACK, str(sleep)]
    return [*xprep, "pack", str(ds), "-o", str(out), "--method", "multipack", "--seq-len", "512"]


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_concurrent_identical_invocations_build_once(tmp_path, ds):
    procs = [subprocess.Popen(_pack_cmd(ds, tmp_path / "P", sleep=1.5), env=ENV, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    firsts = sorted(out.splitlines()[0].split()[0] for out, _ in outs)
    assert firsts == ["cache", "packed"], outs  # one built, the other waited and hit
    assert open_packed(tmp_path / "P").meta["complete"]


def test_killed_build_leaves_nothing_that_looks_complete(tmp_path, ds):
    out = tmp_path / "P"
    proc = subprocess.Popen(_pack_cmd(ds, out, sleep=60), env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out.glob(".tmp-*/item_len.npy")):  # arrays written, pack.json not yet
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not [p for p in out.iterdir() if not p.name.startswith(".")]  # no entry, no manifest
    with pytest.raises(XprepError):
        open_packed(out)
    rerun = subprocess.run(_pack_cmd(ds, out), env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0 and rerun.stdout.startswith("packed"), rerun.stderr
    assert open_packed(out).meta["complete"] and not list(out.glob(".tmp-*"))
