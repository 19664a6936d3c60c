"""Training from object storage (issue 35, streaming reads): a pack cache and its dataset at an S3-compatible
endpoint (moto's server, started here on 127.0.0.1), read in place: the pack's small files fetched once, token bytes
by range through a bounded block cache, fetched ahead by a thread.

- the same losses (exact, fp32) as the same pack on local disk, the cache never above --cache-size;
- the endpoint killed mid-run: the run retries, stops with one line and a checkpoint; a new server on the same
  port with the same data: the same command finishes with the losses of an uninterrupted run;
- a missing object is one line, exit 2; transient errors are retried, permanent ones are not (``Retry``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import numpy as np
import pytest
from click.testing import CliRunner
from motokit import Endpoint
from test_train_run import metrics
from trainkit import category_pack, user_error
from xprep.cli import xtrain
from xprep.prep.dataset import Retry, StreamUnavailable, upload_dataset
from xprep.prep.dataset import stream as stream_module
from xprep.prep.errors import XprepError
from xprep.train import trainer as trainer_module
from xprep.train.trainer import DATA_UNREACHABLE_EXIT

s3fs = pytest.importorskip("s3fs")
ROOT = Path(__file__).resolve().parents[2]
FAULT_WORKER = ROOT / "tests" / "_train_fault_worker.py"  # `xtrain run` with the fault the environment names
RUN = ["--steps", "6", "--micro-batch-size", "2", "--sampler", "random", "--save-every", "100"]


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """A dataset (loss masks, categories) and its sequential pack on local disk, and the losses of a run on it."""
    root = tmp_path_factory.mktemp("local")
    packed = category_pack(root, n_docs=60, capacity=64)
    run = root / "run"
    result = CliRunner().invoke(xtrain, ["run", str(packed), *RUN, "--output", str(run)])
    assert result.exit_code == 0, (result.output, result.exception)
    return {"root": root, "packed": packed, "losses": [m["loss"] for m in metrics(run)]}


@pytest.fixture
def endpoint(tmp_path, monkeypatch, local):
    """The endpoint, up, holding s3://stream/ds and s3://stream/packed (the local pack, its dataset named by URL
    as `xprep pack s3://stream/ds` names it: a local copy this machine lacks, and its URL)."""
    server = Endpoint(tmp_path)
    server.start()
    # s3fs and botocore retry a refused connection themselves for ~10 s before raising: once each here, so that
    # the run's own retries (--stream-timeout) are what the tests time
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": server.url, "key": "testing", "secret": "testing",
                                                   "config_kwargs": {"retries": {"max_attempts": 1}}})
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    packed = tmp_path / "packed"
    shutil.copytree(local["packed"], packed)
    for entry in (p for p in packed.iterdir() if p.is_dir()):
        meta = json.loads((entry / "pack.json").read_text())
        meta["datasets"] = [{**d, "path": str(tmp_path / "elsewhere" / "ds"), "url": "s3://stream/ds"}
                            for d in meta["datasets"]]
        (entry / "pack.json").write_text(json.dumps(meta))

    def upload() -> None:
        s3fs.S3FileSystem.clear_instance_cache()  # (a restarted server holds nothing: no listing from before)
        fs = s3fs.S3FileSystem()
        fs.mkdir("stream")
        upload_dataset(local["root"] / "ds", "s3://stream/ds")
        fs.put(str(packed), "stream/packed", recursive=True)

    upload()
    server.upload = upload
    yield server
    server.kill()


def test_a_pack_at_a_url_trains_like_the_local_pack_in_a_bounded_cache(endpoint, local, tmp_path, monkeypatch):
    """A random sampler: the exact ranges of the next steps' documents are fetched ahead (about the bytes the bins
    need, not the blocks around them), the steps never fetch themselves, the cache stays within --cache-size. The
    thread's requests are made by a process of their own (FetchProcess): none by this one's fetching thread."""
    cache_size = 2048  # bytes: the 60 documents take 4.5 kB of streams, so ranges are evicted
    seen, needed, callers = [], [], []
    here = stream_module.cat_ranges
    monkeypatch.setattr(stream_module, "cat_ranges",
                        lambda *a: (callers.append(threading.current_thread().name), here(*a))[1])

    def on_step(t) -> None:
        cache = t.dataset.cache
        seen.append((cache.disk_bytes(), cache.fetched_bytes, cache.demand_reads))
        bins = t.sampler.bins_at(np.arange(t.sampler.consumed_samples, dtype=np.int64))  # (one rank: all of them)
        needed.append(int(t.dataset.bins.items_of(bins)[3].sum()) * 4)  # tokens (uint16), loss mask, categories

    monkeypatch.setattr(trainer_module, "STEP_END_CALLBACKS", [on_step])
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", "s3://stream/packed", *RUN, "--output", str(run), "--cache-size",
                                         str(cache_size), "--prefetch-steps", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert [m["loss"] for m in metrics(run)] == local["losses"]
    assert len(seen) == 6 and max(disk for disk, _, _ in seen) <= cache_size
    assert seen[-1][1] > cache_size  # more was fetched than the cache holds: it evicted
    assert seen[-1][1] <= 1.2 * needed[-1] and seen[-1][2] == 0
    assert not list((tmp_path / "cache" / "blocks").iterdir())  # the run's block cache is removed at its end
    assert "MainThread" in callers and "xtrain-prefetch" not in callers, callers  # (the loop fetches step 1 itself)


def test_a_cache_smaller_than_a_step_still_trains_and_says_what_it_costs(endpoint, local, tmp_path, monkeypatch):
    """--cache-size below one step's bytes: the start says so (and what size would hold the window); each step reads
    what does not fit itself, keeping none of it; the losses are the local ones, the disk never above the size."""
    peak = []
    monkeypatch.setattr(trainer_module, "STEP_END_CALLBACKS", [lambda t: peak.append(t.dataset.cache.disk_bytes())])
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", "s3://stream/packed", *RUN, "--output", str(run), "--cache-size",
                                         "300", "--prefetch-steps", "4"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert [m["loss"] for m in metrics(run)] == local["losses"] and max(peak) <= 300
    said = re.search(r"--cache-size 300 bytes holds less than --prefetch-steps 4 \+ 1 steps of data at URLs "
                     r"\(([\d,]+) bytes; .*\): each step waits on the network for what does not fit; give it "
                     r"--cache-size \1 or more", result.stderr)
    assert said, result.stderr


def test_endpoint_down_mid_run_stops_with_a_checkpoint_and_resumes(endpoint, local, tmp_path, monkeypatch):
    def kill_after_step_2(t) -> None:
        if t.step == 2:
            endpoint.kill()

    monkeypatch.setattr(trainer_module, "STEP_END_CALLBACKS", [kill_after_step_2])
    run = tmp_path / "run"
    args = ["run", "s3://stream/packed", *RUN, "--output", str(run), "--stream-timeout", "2",
            "--prefetch-steps", "1", "--cache-size", "2048"]  # (small blocks: steps 3-6 need blocks not fetched yet)
    result = CliRunner().invoke(xtrain, args)
    assert result.exit_code == DATA_UNREACHABLE_EXIT == 75, (result.output, result.exception)  # (EX_TEMPFAIL)
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: s3://stream/ds/") and "unreachable" in lines[-1], result.stderr
    stopped = re.search(r"stopped after step (\d) \(checkpoint step-(\d) saved\)", lines[-1])
    assert stopped and stopped[1] == stopped[2] and "Traceback" not in result.stderr, lines[-1]
    assert int(stopped[1]) in (2, 3)  # (step 3's data may have been fetched ahead before the kill)
    assert (run / "checkpoints" / f"step-{stopped[1]}").is_dir()

    endpoint.start()  # back, on the same port, with the same data (moto keeps nothing across a restart)
    endpoint.upload()
    monkeypatch.setattr(trainer_module, "STEP_END_CALLBACKS", [])
    again = CliRunner().invoke(xtrain, args)
    assert again.exit_code == 0, (again.output, again.exception)
    assert f"resuming at step {stopped[1]}" in again.stderr, again.stderr
    by_step = {m["step"]: m["loss"] for m in metrics(run)}
    assert [by_step[s] for s in range(1, 7)] == local["losses"]


def test_two_ranks_stream_like_local_disk_and_stop_together_when_the_endpoint_dies(endpoint, local, tmp_path):
    """`--nproc-per-node 2`: each rank reads its own bins from the endpoint, with the losses of the same 2-rank run on
    local disk. Rank 0 kills the endpoint after step 2: whichever rank's read fails, the ranks agree (one all-reduce
    before each step) and stop after step 2 together, one checkpoint of it, each with one line and no traceback; on
    a new server the same command resumes and ends with the losses of the uninterrupted run."""
    ranks = [*RUN, "--nproc-per-node", "2", "--dp", "2", "--stream-timeout", "2", "--prefetch-steps", "0"]
    env = {"FSSPEC_S3": json.dumps({**fsspec.config.conf["s3"]}), "OMP_NUM_THREADS": "1"}  # (the ranks' s3fs)
    here = launch(str(local["packed"]), *ranks, "--output", str(tmp_path / "here"))
    assert here.returncode == 0, here.stderr
    run = tmp_path / "run"
    args = ["s3://stream/packed", *ranks, "--output", str(run)]
    stopped = launch(*args, env={**env, "XTRAIN_TEST_SIGNAL": f"KILL,2,pid-{endpoint.proc.pid}"})
    assert stopped.returncode == DATA_UNREACHABLE_EXIT and "Traceback" not in stopped.stderr, stopped.stderr
    said = [line for line in stopped.stderr.splitlines() if line.startswith("error: ")]  # only the ranks' own
    assert 1 <= len(said) <= 2 and said[-1] == stopped.stderr.strip().splitlines()[-1], stopped.stderr
    for line in said:  # (a rank whose own read worked follows the others, silently; the launcher adds nothing)
        assert re.search(r"^error: \[rank [01]\] s3://stream/ds/.*: unreachable.*: stopped after step 2 \(checkpoint "
                         r"step-2 saved\)", line), stopped.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2"]

    endpoint.start()
    endpoint.upload()
    again = launch(*args, env=env)
    assert again.returncode == 0 and "resuming at step 2" in again.stderr, again.stderr
    by_step = {m["step"]: m["loss"] for m in metrics(run)}
    assert [by_step[s] for s in range(1, 7)] == [m["loss"] for m in metrics(tmp_path / "here")]


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`xtrain run ARGS` in a process of its own (which starts the ranks), through the fault worker when ``env``
    names a fault."""
    return subprocess.run([sys.executable, str(FAULT_WORKER), "run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_xprep_pack_of_a_url_reads_its_index_and_loss_mask_only(endpoint, local, tmp_path):
    """Every method packs from document lengths, and counts each bin's targets from the loss mask: the tokens and
    categories are never fetched (moto's log lists every request), and the entry is the local dataset's."""
    from xprep.cli import xprep
    from xprep.prep.pack.cache import PackConfig, pack

    before = endpoint.log.read_text().count("\n")
    args = ["pack", "s3://stream/ds", "-o", str(tmp_path / "p"), "--method", "multipack", "--seq-len", "64"]
    result = CliRunner().invoke(xprep, args)
    assert result.exit_code == 0, (result.output, result.exception)
    requests = endpoint.log.read_text().splitlines()[before:]
    assert any("GET /stream/ds/loss_mask.bin" in r for r in requests), requests
    assert not [r for r in requests if "GET /stream/ds/tokens.bin" in r or "GET /stream/ds/category_ids.bin" in r]
    here = pack([local["root"] / "ds"], tmp_path / "here", PackConfig(method="multipack", seq_len=64)).entry.path
    there = tmp_path / "p" / here.name
    assert json.loads((there / "pack.json").read_text())["datasets"][0]["path"] == "s3://stream/ds"
    assert {f.name: f.read_bytes() for f in there.glob("*.npy")} == {f.name: f.read_bytes() for f in here.glob("*.npy")}


def test_verify_data_rehashes_the_objects_at_the_url(endpoint, tmp_path):
    """--verify-data means for a dataset read in place what it means on local disk: each .bin's sha256 against its
    manifest, each object read once. An object rewritten in place with its size unchanged (which the sizes the index
    implies cannot tell) is then refused in one line."""
    from xprep.prep.dataset import StreamedDataset

    StreamedDataset("s3://stream/ds").verify()  # the dataset as written
    fs = s3fs.S3FileSystem()
    data = bytearray(fs.cat("stream/ds/loss_mask.bin"))
    data[3] ^= 1
    fs.pipe("stream/ds/loss_mask.bin", bytes(data))
    line = user_error("s3://stream/packed", *RUN, "--verify-data", "--output", str(tmp_path / "run"))
    assert "s3://stream/ds/loss_mask.bin: changed since" in line and "rewritten in place" in line, line


def test_a_missing_object_is_one_line(endpoint, tmp_path):
    s3fs.S3FileSystem().rm("stream/ds/tokens.bin")
    line = user_error("s3://stream/packed", *RUN, "--output", str(tmp_path / "run"))
    assert "s3://stream/ds/tokens.bin: no such object" in line, line
    assert "nowhere" in user_error("s3://stream/nowhere", "--output", str(tmp_path / "run2"))


def test_retry_classifies_errors():
    slept = []
    retry = Retry(budget_s=1.0, sleep=slept.append)
    calls = iter([ConnectionRefusedError("refused"), TimeoutError("slow"), b"data"])

    def flaky():
        value = next(calls)
        if isinstance(value, Exception):
            raise value
        return value

    assert retry.run("s3://b/x", flaky) == b"data" and slept == [0.2, 0.4]  # backoff, then the bytes
    for error, said in ((PermissionError("AccessDenied"), "access denied"), (FileNotFoundError("x"), "no such")):
        with pytest.raises(XprepError, match=f"s3://b/x: {said}") as caught:
            retry.run("s3://b/x", lambda e=error: (_ for _ in ()).throw(e))
        assert not isinstance(caught.value, StreamUnavailable)
    slept.clear()
    with pytest.raises(StreamUnavailable, match="s3://b/x: unreachable"):
        Retry(budget_s=0.0, sleep=slept.append).run("s3://b/x", lambda: (_ for _ in ()).throw(ConnectionResetError()))
    with pytest.raises(ZeroDivisionError):  # a bug is no network error: raised at once
        retry.run("s3://b/x", lambda: 1 / 0)


def test_a_causal_chunk_pack_of_a_url_reads_like_the_local_one(endpoint, local, tmp_path):
    """--attention causal labels each document's last token with the next one's first: read through the block
    cache too, where the dataset is at a URL (the tokens of the items and of those first tokens)."""
    import torch
    from xprep.prep.pack.cache import PackConfig, pack
    from xprep.train.data import PackedDataset

    config = PackConfig(method="chunk", seq_len=64, attention="causal")
    pack(["s3://stream/ds"], tmp_path / "there", config)
    pack([local["root"] / "ds"], tmp_path / "here", config)
    there, here = PackedDataset(tmp_path / "there"), PackedDataset(tmp_path / "here")
    assert there.cache is not None and here.cache is None and len(there) == len(here) > 1
    for b in range(len(here)):
        x, y = there[b], here[b]
        assert all(torch.equal(x[k], y[k]) for k in y), b
    there.close()


def test_steps_read_in_order_come_in_a_handful_of_requests(endpoint, local, tmp_path, monkeypatch):
    """A sequential sampler over the sequential pack: the loop fetches the first step itself, then the thread reads
    the window and on to the last step (the cache holds it all) in one request a stream: two requests a stream in
    all (one a step a stream without reading ahead), the bytes the bins need, the local losses."""
    sequential = [*RUN[:RUN.index("--sampler")], "--sampler", "sequential", "--prefetch-steps", "1"]
    here = tmp_path / "here"
    assert CliRunner().invoke(xtrain, ["run", str(local["packed"]), *sequential, "--output", str(here)]).exit_code == 0
    seen = []

    def on_step(t) -> None:
        cache = t.dataset.cache
        bins = t.sampler.bins_at(np.arange(t.sampler.consumed_samples, dtype=np.int64))
        needed = int(t.dataset.bins.items_of(bins)[3].sum()) * 4  # tokens (uint16), loss mask, categories
        seen.append((cache.requests, cache.fetched_bytes, needed, cache.demand_reads))

    monkeypatch.setattr(trainer_module, "STEP_END_CALLBACKS", [on_step])
    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", "s3://stream/packed", *sequential, "--output", str(run)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert [m["loss"] for m in metrics(run)] == [m["loss"] for m in metrics(here)]
    requests, fetched, needed, demand = seen[-1]
    assert requests <= 3 * 3 and fetched <= 1.2 * needed and demand == 0, seen  # (3 streams; a request's margin)


def test_a_fetch_process_reads_like_this_one_and_survives_its_death(endpoint):
    """FetchProcess (the prefetcher's requests, made by a process of their own): the bytes this process reads; a
    missing object comes back as FileNotFoundError (permanent for ``Retry``); a child killed is a transient error
    (ConnectionError) and the next call starts another."""
    from xprep.prep.dataset import FetchProcess
    from xprep.prep.dataset.remote import cat_ranges

    fs, paths, starts, ends = s3fs.S3FileSystem(), ["stream/ds/tokens.bin"] * 2, [0, 10], [6, 30]
    via = FetchProcess()
    try:
        assert via.cat_ranges(fs, paths, starts, ends) == cat_ranges(fs, paths, starts, ends)
        with pytest.raises(FileNotFoundError):
            via.cat_ranges(fs, ["stream/ds/nothing.bin"], [0], [1])
        via._proc.kill()
        with pytest.raises(ConnectionError, match="ended"):
            via.cat_ranges(fs, paths, starts, ends)
        assert via.cat_ranges(fs, paths, starts, ends) == cat_ranges(fs, paths, starts, ends)
    finally:
        via.close()
