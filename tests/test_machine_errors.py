"""Errors of the machine (issue 31): a full disk, a permission, a read-only filesystem end ``xprep tokenize``, ``pack``,
``merge`` and ``inspect --html`` with one line naming the path and what to do (``prep.errors.machine_error``), exit 2,
and nothing half-written left behind; any other OSError keeps its traceback."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO_ROOT
from prepkit import text_records, tokenize, write_jsonl
from trainkit import category_pack
from xprep import cli
from xprep.prep.errors import XprepError, machine_error, machine_errors

XPREP = [sys.executable, "-c", "from xprep import cli; cli.xprep()"]
XTRAIN = Path(sys.executable).with_name("xtrain")


def test_the_mapping_names_the_path_the_bytes_and_the_fix():
    full = machine_error(OSError(errno.ENOSPC, "No space left on device"), "/data/out", "-o", 56_456)
    assert str(full) == ("no space left on device writing /data/out: 56,456 bytes were being written; free space on "
                         "that filesystem or choose another -o")
    named = machine_error(PermissionError(errno.EACCES, "Permission denied", "/data/out/x.npy"), "/data/out", "-o")
    assert str(named).startswith("permission denied writing /data/out/x.npy; ") and "choose another -o" in str(named)
    assert "permission denied" in str(machine_error(OSError(errno.EPERM, "Operation not permitted"), "/p"))
    assert str(machine_error(OSError(errno.EROFS, "Read-only file system"), "/ro", "--html")) == (
        "read-only filesystem writing /ro; choose another --html on a writable one")
    assert str(machine_error(OSError(errno.EDQUOT, "Disk quota exceeded"))).startswith("disk quota exceeded; ")
    assert str(machine_error(OSError(errno.ENOSPC, "x", "/f"), action=None)).startswith("no space left on device: /f")
    for other in (OSError(errno.EIO, "I/O error"), OSError("56456 requested and 25584 written"), ValueError("x")):
        assert machine_error(other, "/p") is None
    with pytest.raises(XprepError, match="no space left on device writing /p"), machine_errors("/p"):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match="I/O error"), machine_errors("/p"):
        raise OSError(errno.EIO, "I/O error")


def test_the_cli_turns_a_machine_oserror_into_one_line_and_keeps_other_tracebacks(monkeypatch, tmp_path):
    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("xprep.prep.inspect.kind_of", denied)
    result = CliRunner().invoke(cli.xprep, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr == (
        f"error: permission denied: {tmp_path}; check its permissions (and its directory's) or write elsewhere\n")

    def broken(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("xprep.prep.inspect.kind_of", broken)
    result = CliRunner().invoke(cli.xprep, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, OSError)  # a traceback, as any unexpected error


def _one_line(result, disk) -> str:
    """Exit 2, one ``error: ...`` line on stderr (no traceback) that names the disk and says it is full."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "no space left on device writing " in lines[0] and str(disk.path) in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~1.6 MB of JSON lines (20,000 text records): a dataset of ~0.5 MB of uint16 tokens with the tiny tokenizer."""
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "a.jsonl", text_records(20_000))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenize_into_a_full_disk(corpus, tiny_tokenizer, small_disk, workers):
    """The main process's writes (and, with --workers 2, the workers' results spilled into the output's temporary
    directory, whichever fills the disk first) end in one line; the temporary directory and the lock are removed."""
    disk = small_disk("256k")
    result = disk.run([*XPREP, "tokenize", corpus, "-o", disk.path / "out", "--tokenizer", tiny_tokenizer,
                       "--workers", workers], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    line = _one_line(result, disk)
    assert "choose another -o" in line and "bytes were being written" in line, line
    assert disk.left == []


def test_pack_merge_and_inspect_html_into_a_full_disk(corpus, tiny_tokenizer, small_disk, tmp_path):
    """A pack whose arrays do not fit, a merge whose streams do not, a page that does not: one line each, and no
    entry, dataset or page (whole or half) left."""
    ds = tmp_path / "ds"
    tokenize(corpus, ds, tiny_tokenizer)
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, shard in enumerate(shards):
        tokenize(corpus, shard, tiny_tokenizer, num_shards=2, shard_index=i)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    disk = small_disk("64k")
    pack = disk.run([*XPREP, "pack", ds, "-o", disk.path / "P", "--method", "sequential", "--seq-len", "8",
                     "--overlong", "split"], env=env)
    assert "choose another -o" in _one_line(pack, disk)
    assert disk.left == []  # (a cache directory this command made is removed with its entry)
    merge = disk.run([*XPREP, "merge", *shards, "-o", disk.path / "merged"], env=env)
    assert "choose another -o" in _one_line(merge, disk)
    assert disk.left == []
    page = small_disk("4k", "page")  # (a page of the dataset's report: ~30 kB)
    html = page.run([*XPREP, "inspect", ds, "--html", page.path / "page.html"], env=env)
    assert "choose another --html" in _one_line(html, page)
    assert page.left == []


@pytest.mark.parametrize("ranks", [1, 2])
def test_train_into_a_full_disk(small_disk, tmp_path, ranks):
    """`xtrain run` whose checkpoint does not fit (its config, metrics and logs do): one line naming the checkpoint
    being written, how much this rank's part takes and what to do, exit 2, no traceback; nothing published. With
    2 ranks, each says it on one line and the launcher's closing line names the rank and the same reason."""
    packed = category_pack(tmp_path / "data")
    disk = small_disk("600k")  # a few hundred kB of the tiny model's checkpoint (weights + AdamW state) do not fit
    run = disk.path / "run"
    result = disk.run([XTRAIN, "run", packed, "--steps", "3", "--save-every", "1", "--log-every", "100", "-o", run,
                       *(["--nproc-per-node", "2"] if ranks == 2 else [])],
                      env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-len(errors):] and len(errors) <= ranks + 1, result.stderr
    for line in errors:
        assert "no space left on device writing" in line and "checkpoints/.step-1.tmp" in line, line
        assert "choose another --output" in line, line
    if ranks == 2:
        assert errors[-1].startswith("error: rank ") and " of 2 failed (exit code 2): no space" in errors[-1], errors
    if disk.direct:  # (else the disk is gone with the namespace it was mounted in)
        checkpoints = run / "checkpoints"
        assert not (checkpoints / "latest").exists() and not list(checkpoints.glob("step-*"))
