"""Access denied, for real: moto's S3 server enforcing IAM (``motokit.Endpoint.deny``), a dataset and its pack
stored there, and credentials whose policy denies s3:GetObject on the dataset's objects (all of them, or its ``.bin``
ones). ``xprep pack URL`` and ``xtrain run URL`` each stop with one line naming the object and "access denied",
exit 2, no traceback, nothing half-written, and without retrying (the server sees one request for the refused
object)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from motokit import Endpoint, use_endpoint
from trainkit import category_pack
from xprep.cli import xprep, xtrain
from xprep.prep.dataset import upload_dataset

s3fs = pytest.importorskip("s3fs")
DENIED = re.compile(r"^error: (the blend: source 'ds': )?s3://locked/ds/[\w.]+: access denied .*; "
                    r"check the URL and the credentials for it$")


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """(endpoint, credentials denied GetObject on s3://locked/ds/*.bin) with s3://locked/ds and s3://locked/packed
    (a pack of it, listing it by URL) uploaded before the policy took effect."""
    root = tmp_path_factory.mktemp("locked")
    endpoint = Endpoint(root).start()
    with pytest.MonkeyPatch.context() as mp:
        use_endpoint(mp, endpoint)
        mp.setenv("XPREP_CACHE_DIR", str(root / "setup-cache"))
        category_pack(root, n_docs=30)
        s3fs.S3FileSystem().mkdir("locked")
        upload_dataset(root / "ds", "s3://locked/ds")
        packed = CliRunner().invoke(xprep, ["pack", "s3://locked/ds", "-o", str(root / "packed"), "--method",
                                            "sequential", "--seq-len", "64"])
        assert packed.exit_code == 0, packed.output
        s3fs.S3FileSystem().put(str(root / "packed"), "locked/packed", recursive=True)
    every, bins = endpoint.deny("s3:GetObject", "arn:aws:s3:::locked/ds/*", "arn:aws:s3:::locked/ds/*.bin")
    yield endpoint, {"every object": every, "token streams": bins}
    endpoint.kill()


def _one_line(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and DENIED.match(lines[-1]), result.stderr
    return lines[-1]


def _refused_once(endpoint: Endpoint, since: int, line: str) -> None:
    """The refused object was asked for once (a permanent error is not retried), and nothing else was refused."""
    obj = next(w for w in line.split(": ") if w.startswith("s3://")).removeprefix("s3://")
    refused = [r for r in endpoint.requests(since) if '" 403' in r]
    assert len(refused) == 1 and f"/{obj} " in refused[0], refused


@pytest.mark.parametrize("denied", ["every object", "token streams"])
@pytest.mark.parametrize("given", ["s3://locked/ds", "s3://locked/ds@1"])  # read in place, for a blend too
def test_xprep_pack_with_denied_credentials_is_one_line(locked, tmp_path, monkeypatch, denied, given):
    endpoint, credentials = locked
    use_endpoint(monkeypatch, endpoint, credentials[denied])
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    since = len(endpoint.requests())
    result = CliRunner().invoke(xprep, ["pack", given, "-o", str(tmp_path / "p"), "--method", "multipack",
                                        "--seq-len", "64"])
    _refused_once(endpoint, since, _one_line(result))
    assert not (tmp_path / "p").exists()  # a new -o is removed again: no entry, no temp directory
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".tmp" in p.name]  # the index copy is whole or absent


@pytest.mark.parametrize("denied", ["every object", "token streams"])
def test_xtrain_run_with_denied_credentials_is_one_line(locked, tmp_path, monkeypatch, denied):
    endpoint, credentials = locked
    use_endpoint(monkeypatch, endpoint, credentials[denied])
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    since = len(endpoint.requests())
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", "s3://locked/packed", "--steps", "2", "--micro-batch-size", "2",
                                         "--output", str(run)])
    _refused_once(endpoint, since, _one_line(result))
    assert not list(run.glob("checkpoints/*"))  # no checkpoint, whole or half
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert not list((tmp_path / "cache").glob("blocks/*"))  # no block cache left behind
