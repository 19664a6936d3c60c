"""``xprep tokenize --ray`` and object-store paths: the same dataset, byte for byte, however it was made.

A Ray head is started once for the module as a separate process (`ray start --head`, 127.0.0.1 only,
2 CPUs, no dashboard) and every run joins it, with ``--ray auto`` (RAY_ADDRESS) or ``--ray HOST:PORT``.
The S3 tests start moto's standalone server on 127.0.0.1 and go through s3fs, as a user's run would.
Every command runs in its own process (as users run it), bounded in time.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, requires_shared_data
from prepkit import assert_same_files, dir_bytes
from xprep.prep.pack import PackConfig, pack
from xprep.prep.sources.discover import resolve_inputs
from xprep.prep.sources.shards import plan_shards

pytestmark = requires_shared_data
ray = pytest.importorskip("ray")
BIN = Path(sys.executable).parent
QWEN = REPO_ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The test cluster listens on 127.0.0.1 only and lives for this module: no token authentication (Ray 2.5x turns it
# on when ~/.ray/auth_token exists, which a developer's earlier local run may have left).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def xprep(*args, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "xprep"), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **RAY_ENV, **(env or {})})


def xprep_background(*args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "xprep"), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **RAY_ENV, **(env or {})})


@pytest.fixture(scope="module")
def ray_head():
    """(HOST:PORT, session id) of a Ray head started for this module (separate process), stopped after it.

    ``ray start --block`` in its own session and temp dir: ending that one process (SIGTERM) stops this
    cluster's processes and no other (``ray stop`` would stop every Ray cluster of the machine's user); its
    workers are in that session too, so that a test finds them there, not another cluster's (another test run's
    on the same machine)."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="xprep-ray-")  # short: Ray's socket paths live below it
    log = open(os.path.join(temp, "start.log"), "w+")
    start = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block", f"--temp-dir={temp}"]
    head = subprocess.Popen(start, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in Path(log.name).read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", head.pid  # (start_new_session: the session id is its pid)
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_head) -> str:
    """HOST:PORT of the module's Ray head."""
    return ray_head[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data) -> dict:
    """Real text (State of the Union paragraphs, with a malformed line and an empty text in the middle) and
    real chat (chitchat conversations) as JSON Lines, and the one-process dataset of both under skip."""
    root = tmp_path_factory.mktemp("scale_out")
    text = root / "sotu.jsonl"
    with open(text, "w", encoding="utf-8") as f:
        for i, path in enumerate(sorted((shared_data / "corpora" / "sotu").glob("*.txt"))[:40]):
            for para in path.read_text(encoding="utf-8").split("\n"):
                if para.strip():
                    f.write(json.dumps({"text": para}, ensure_ascii=False) + "\n")
            if i == 20:
                f.write('{"text": "cut off\n\n{"text": ""}\n')  # a truncated record, a blank line, an empty text
    chat = root / "chat.jsonl"
    with open(shared_data / "chat" / "chitchat.jsonl", encoding="utf-8") as src, open(chat, "w") as out:
        for _ in range(900):
            out.write(src.readline())
    reference = root / "reference"
    proc = xprep("tokenize", text, chat, "-o", reference, "--tokenizer", QWEN, "--on-error", "skip")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((reference / "manifest.json").read_text())["rejects"]["count"] > 2
    return {"root": root, "inputs": [text, chat], "reference": reference}


def _shard_size_for(inputs: list[Path], shards: int) -> int:
    """A --shard-size that plans exactly ``shards`` shards for ``inputs``."""
    sources = resolve_inputs([str(p) for p in inputs])
    total = sum(s.size for s in sources)
    for size in range(total + 1, 1024, -max(1, total // 4000)):
        if len(plan_shards(sources, size)) == shards:
            return size
    raise AssertionError(f"no shard size gives {shards} shards")


def _shards_said(stderr: str) -> tuple[int, int, int]:
    """(shards, reused, retried) from the final console line."""
    m = re.search(r"ray: (\d+) shards? on \d+ nodes?, (\d+) reused, (\d+) retried", stderr)
    assert m, stderr
    return int(m[1]), int(m[2]), int(m[3])


# one shard, and more shards than the cluster has CPUs; each way of joining the cluster (the tests below join by
# address, the staging test by RAY_ADDRESS too)
@pytest.mark.parametrize("shards, join", [(1, "auto"), (17, "address")])
def test_ray_output_is_byte_identical_to_one_process(cluster, corpus, tmp_path, shards, join):
    out = tmp_path / "ds"
    size = _shard_size_for(corpus["inputs"], shards)
    address = "auto" if join == "auto" else cluster
    proc = xprep("tokenize", *corpus["inputs"], "-o", out, "--tokenizer", QWEN, "--on-error", "skip", "--merge",
                 "--ray", address, "--shard-size", size, env={"RAY_ADDRESS": cluster} if join == "auto" else None)
    assert proc.returncode == 0, proc.stderr
    assert _shards_said(proc.stderr) == (shards, 0, 0)
    assert "starting a local one" not in proc.stderr  # it joined the running cluster
    assert_same_files(corpus["reference"], out)  # manifest, rejects (renumbered lines) and streams
    assert not Path(f"{out}.xprep-shards").exists()


def test_bad_record_under_ray_fails_as_without_it(cluster, corpus, tmp_path):
    """--on-error fail: exit 2 with the same file:line message as one process, though the bad line is counted
    from the start of the middle shard that met it."""
    local = xprep("tokenize", *corpus["inputs"], "-o", tmp_path / "a", "--tokenizer", QWEN)
    size = _shard_size_for(corpus["inputs"], 17)
    remote = xprep("tokenize", *corpus["inputs"], "-o", tmp_path / "b", "--tokenizer", QWEN, "--ray", cluster,
                   "--shard-size", size)
    assert local.returncode == remote.returncode == 2
    error = [line for line in local.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "sotu.jsonl:" in error[0] and "truncated JSON" in error[0]
    assert [line for line in remote.stderr.splitlines() if line.startswith("error:")] == error
    assert "Traceback" not in remote.stderr
    assert not (tmp_path / "b").exists()


def test_killed_worker_is_retried_and_output_unchanged(ray_head, corpus, tmp_path):
    (cluster, session), out = ray_head, tmp_path / "ds"
    size = _shard_size_for(corpus["inputs"], 17)
    proc = xprep_background("tokenize", *corpus["inputs"], "-o", out, "--tokenizer", QWEN, "--on-error", "skip",
                            "--merge", "--ray", cluster, "--shard-size", size)
    killed: list[str] = []
    deadline = time.monotonic() + 120
    while not killed and proc.poll() is None and time.monotonic() < deadline:
        killed = subprocess.run(["pgrep", "-s", str(session), "-f", "ray::tokenize_shard"], capture_output=True,
                                text=True).stdout.split()
        for pid in map(int, killed):  # every worker of this cluster that runs a shard at this moment
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=240)
    assert killed, "no shard task was seen running"
    assert proc.returncode == 0, err
    shards, reused, retried = _shards_said(err)
    assert shards == 17 and retried >= 1
    assert_same_files(corpus["reference"], out)


def test_killed_driver_resumes_from_finished_shards(cluster, corpus, tmp_path):
    """Without --merge: the resumed run publishes a sharded dataset (17 shards, nothing copied) whose `xprep merge`
    is the one-process dataset byte for byte, and which packs into the bins of that dataset."""
    out = tmp_path / "ds"
    args = ["tokenize", *corpus["inputs"], "-o", out, "--tokenizer", QWEN, "--on-error", "skip", "--ray", cluster,
            "--shard-size", _shard_size_for(corpus["inputs"], 17)]
    proc = xprep_background(*args)
    markers = Path(f"{out}.xprep-shards") / "shards"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and len(list(markers.glob("*.done"))) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    finished = len(list(markers.glob("*.done")))
    assert 3 <= finished < 17 and not out.exists()
    # shards are published without fsync: one cut short (as a machine crash would leave it) is run again
    damaged = markers / sorted(markers.glob("*.done"))[0].name.removesuffix(".done") / "tokens.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2])
    again = xprep(*args)
    assert again.returncode == 0, again.stderr
    shards, reused, _ = _shards_said(again.stderr)
    assert shards == 17 and finished - 1 <= reused < 17
    assert not markers.parent.exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "xprep-sharded-dataset" and len(manifest["shards"]) == 17
    assert not (out / "tokens.bin").exists()
    merged = xprep("merge", out, "-o", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert_same_files(corpus["reference"], tmp_path / "merged")  # manifest, rejects (renumbered lines), streams
    packs = [pack([p], tmp_path / f"P{i}", PackConfig(method="multipack", seq_len=512, overlong="split"))
             for i, p in enumerate((out, corpus["reference"]))]
    for name in ("bin_offsets", "item_doc", "item_start", "item_len", "bin_targets"):
        assert np.array_equal(*(np.load(p.entry.path / f"{name}.npy") for p in packs)), name


def test_an_unreadable_file_under_skip_is_set_aside_as_without_ray(cluster, corpus, tmp_path):
    """A .gz unreadable from its first byte, ahead of other shards: rejected as an unreadable file, the rest as one
    process does it (the shard that met it used to leave no line count for its piece, and every merge after it
    broke). A .gz cut short is data lost, under skip too: one line naming it, on Ray as without."""
    damaged = tmp_path / "bad.jsonl.gz"
    damaged.write_bytes(b"not gzip at all" + corpus["inputs"][1].read_bytes()[:1000])
    inputs = [damaged, corpus["inputs"][0]]
    local = xprep("tokenize", *inputs, "-o", tmp_path / "a", "--tokenizer", QWEN, "--on-error", "skip")
    assert local.returncode == 0, local.stderr
    remote = xprep("tokenize", *inputs, "-o", tmp_path / "b", "--tokenizer", QWEN, "--on-error", "skip",
                   "--merge", "--ray", cluster, "--shard-size", _shard_size_for(inputs, 5))
    assert remote.returncode == 0, remote.stderr
    assert_same_files(tmp_path / "a", tmp_path / "b")
    assert "unreadable file" in (tmp_path / "b" / "rejects.jsonl").read_text()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(corpus["inputs"][1].read_bytes())[:-500])
    for ray in ([], ["--ray", cluster, "--shard-size", _shard_size_for([cut, corpus["inputs"][0]], 5)]):
        proc = xprep("tokenize", cut, corpus["inputs"][0], "-o", tmp_path / "c", "--tokenizer", QWEN, "--on-error",
                     "skip", *ray)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and f"{cut}: the compressed file is cut short" in lines[0], \
            proc.stderr
        assert not (tmp_path / "c").exists()


def test_an_address_nothing_answers_is_an_error_at_once(corpus, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    proc = xprep("tokenize", corpus["inputs"][0], "-o", tmp_path / "x", "--tokenizer", QWEN, "--ray", dead,
                 timeout=120)
    assert proc.returncode == 2 and f"--ray {dead}: no Ray cluster answers there" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 60


def test_ray_refuses_options_it_cannot_honour(corpus, tmp_path):
    for extra, needle in ((["--limit", "5"], "--limit"), (["--num-shards", "2"], "--num-shards"),
                          (["--shard-size", "12 parsecs"], "--shard-size")):
        proc = xprep("tokenize", corpus["inputs"][0], "-o", tmp_path / "x", "--tokenizer", QWEN, "--ray", *extra)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    proc = xprep("tokenize", corpus["inputs"][0], "-o", tmp_path / "x", "--tokenizer", QWEN, "--merge")
    assert proc.returncode == 2 and "--merge is for --ray" in proc.stderr and "Traceback" not in proc.stderr


# -- object stores --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """Environment for s3fs/botocore pointing at a moto S3 server on 127.0.0.1 (started here), with a bucket."""
    pytest.importorskip("s3fs")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    server = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                              stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)
        import s3fs

        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})
        fs.mkdir("corpus")
        yield {"env": env, "fs": fs}
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _streams(path: Path) -> dict[str, bytes]:
    """A dataset's token streams, and its rejects with each source named by its file name (the manifest and the
    rejects name the inputs as given: a path here, a URL there)."""
    files = {k: v for k, v in dir_bytes(path).items() if k not in ("manifest.json", "rejects.jsonl")}
    if (path / "rejects.jsonl").is_file():
        rejects = [json.loads(line) for line in (path / "rejects.jsonl").read_text().splitlines()]
        files["rejects"] = [{**r, "source": r["source"].rsplit("/", 1)[-1]} for r in rejects]
    return files


def test_s3_in_and_out_equals_local_and_packs_the_same(corpus, s3, tmp_path):
    fs = s3["fs"]
    text, chat = corpus["inputs"]
    fs.put_file(str(text), "corpus/in/a/sotu.jsonl")  # listed in this order, as the local reference read them
    fs.put_file(str(chat), "corpus/in/b/chat.jsonl")
    fs.put_file(str(text), "corpus/in/.hidden/skipped.jsonl")
    proc = xprep("tokenize", "s3://corpus/in/", "-o", "s3://corpus/out/ds", "--tokenizer", QWEN,
                 "--on-error", "skip", env=s3["env"])
    assert proc.returncode == 0, proc.stderr
    local = tmp_path / "downloaded"
    fs.get("corpus/out/ds/", str(local), recursive=True)
    assert (local / "COMPLETE").read_text() == json.loads((local / "manifest.json").read_text())["fingerprint"]
    (local / "COMPLETE").unlink()
    assert _streams(local) == _streams(corpus["reference"])
    manifest = json.loads((local / "manifest.json").read_text())
    assert [s["path"] for s in manifest["sources"]] == ["s3://corpus/in/a/sotu.jsonl", "s3://corpus/in/b/chat.jsonl"]

    again = xprep("tokenize", "s3://corpus/in/", "-o", "s3://corpus/out/ds", "--tokenizer", QWEN, env=s3["env"])
    assert again.returncode == 2 and "already holds a dataset" in again.stderr

    pack = ["--method", "multipack", "--seq-len", "4096", "--overlong", "split"]
    remote = xprep("pack", "s3://corpus/out/ds", "-o", tmp_path / "p1", *pack,
                   env={**s3["env"], "XPREP_CACHE_DIR": str(tmp_path / "cache")})
    assert remote.returncode == 0, remote.stderr
    direct = xprep("pack", local, "-o", tmp_path / "p2", *pack)
    assert direct.returncode == 0, direct.stderr
    e1, e2 = (sorted(p for p in (tmp_path / d).iterdir() if p.is_dir()) for d in ("p1", "p2"))
    assert [p.name for p in e1] == [p.name for p in e2]  # the same cache key: same fingerprint, same options
    bins = [{k: v for k, v in dir_bytes(e[0]).items() if k != "pack.json"} for e in (e1, e2)]  # (times, paths)
    assert bins[0] == bins[1] and len(bins[0]) >= 4
    # the pack read the dataset in place (its index only: nothing of it was copied whole) and lists it by URL: a
    # machine without anything of it (a training node) reads it in place too
    listed = json.loads((e1[0] / "pack.json").read_text())["datasets"]
    assert [d["path"] for d in listed] == ["s3://corpus/out/ds"]
    assert not list((tmp_path / "cache").rglob("*.bin"))
    shutil.rmtree(tmp_path / "cache")
    elsewhere = xprep("inspect", tmp_path / "p1", env={**s3["env"], "XPREP_CACHE_DIR": str(tmp_path / "node-cache")})
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert (tmp_path / "node-cache" / "datasets" / listed[0]["fingerprint"] / "ds.index" / "manifest.json").is_file()
    # a --mix file may name the URL dataset too: read in place, named after the URL
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"dataset": "s3://corpus/out/ds", "weight": 2},
                                           {"dataset": str(local), "weight": 1, "name": "local"}]}))
    blended = xprep("pack", "--mix", mix, "-o", tmp_path / "p3", *pack, "--cache-dir", tmp_path / "cache",
                    env=s3["env"])
    assert blended.returncode == 0, blended.stderr
    blend = json.loads((tmp_path / "p3" / json.loads((tmp_path / "p3" / "manifest.json").read_text())["current"]
                        / "blend.json").read_text())
    assert [s["name"] for s in blend["sources"]] == ["ds", "local"]
    assert blend["sources"][0]["entry"] == blend["sources"][1]["entry"] == e2[0].name  # the same data, one entry


def test_ray_with_object_store_staging(cluster, corpus, s3, tmp_path):
    """--ray -o URL writes a sharded dataset there (each shard copied into place inside the store as it finishes, the
    manifest and its marker last) whose `xprep merge` is the one-process dataset byte for byte (rejects renumbered).
    (That a sharded dataset at a URL packs like its merged copy: tests/prep/dataset/test_remote_sharded.py, without
    Ray; --merge with a URL -o is the upload of a local dataset test_s3_in_and_out_... covers.)"""
    fs = s3["fs"]
    fs.put_file(str(corpus["inputs"][0]), "corpus/ray/sotu.jsonl")
    fs.put_file(str(corpus["inputs"][1]), "corpus/ray/chat.jsonl")
    env = {**s3["env"], "RAY_ADDRESS": cluster}
    one = xprep("tokenize", "s3://corpus/ray/*.jsonl", "-o", tmp_path / "one", "--tokenizer", QWEN,
                "--on-error", "skip", env=env)
    many = xprep("tokenize", "s3://corpus/ray/*.jsonl", "-o", "s3://corpus/ray-out/ds", "--tokenizer", QWEN,
                 "--on-error", "skip", "--ray", "--shard-size", "1MB", env=env)
    assert one.returncode == 0 and many.returncode == 0, one.stderr + many.stderr
    shards = _shards_said(many.stderr)[0]
    assert shards > 3
    manifest = json.loads(fs.cat_file("corpus/ray-out/ds/manifest.json"))
    assert manifest["format"] == "xprep-sharded-dataset" and len(manifest["shards"]) == shards
    assert fs.cat_file("corpus/ray-out/ds/COMPLETE").decode() == manifest["fingerprint"]
    assert not fs.exists("corpus/ray-out/ds.xprep-shards")
    fs.get("corpus/ray-out/ds/", str(tmp_path / "many"), recursive=True)
    merged = xprep("merge", tmp_path / "many", "-o", tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    assert dir_bytes(tmp_path / "merged") == dir_bytes(tmp_path / "one")  # manifest and rejects included

