"""How ``xprep tokenize --ray`` cuts its inputs (prep/sources/shards.py) and reads a cut piece
(prep/sources/discover.py), without a cluster: the pieces cover the single run's read order exactly once, lines read
from a piece's own start renumber to the file's, and a shard's key follows everything its bytes depend on."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from xprep.prep.errors import XprepError
from xprep.prep.sources import RawBatch, plan_shard, read_batches, resolve_inputs
from xprep.prep.sources.shards import parse_size, plan_shards


def _lines(path, n, start=0, blank_every=7):
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"text": f"document {i} " + "x" * (i % 50)}) + "\n")
            if i % blank_every == 0:
                f.write("\n")  # blank lines count as lines but hold no record
    return path


def _records(sources, plan):
    """(source, line, item) of every record read, and the lines each assignment read."""
    counted: list[int] = []
    out = [(b.source, line, item) for b in read_batches(sources, plan, lines_read=counted) if isinstance(b, RawBatch)
           for line, item in zip(b.lines, b.items, strict=True)]
    return out, counted


def test_pieces_cover_the_single_run_once_and_renumber_to_its_lines(tmp_path):
    big = _lines(tmp_path / "a.jsonl", 3000)
    small = [_lines(tmp_path / f"b{i}.jsonl", 20, start=i * 100) for i in range(3)]
    sources = resolve_inputs([str(big), *map(str, small)])
    whole, _ = _records(sources, plan_shard(sources, 1, 0))
    for size in (big.stat().st_size + 1, 20_000, 4_321):
        shards = plan_shards(sources, size)
        got, before = [], {}
        for shard in shards:
            records, counted = _records(sources, list(shard.pieces))
            assert len(counted) == len(shard.pieces)
            shift = {p.source: before.get(p.source, 0) for p in shard.pieces}
            got += [(s, line + shift[s], item) for s, line, item in records]  # what the merge does to rejects
            for piece, n in zip(shard.pieces, counted, strict=True):
                before[piece.source] = before.get(piece.source, 0) + n
        assert got == whole, f"shard size {size}"
    cut = plan_shards(sources, 4_321)
    assert len(cut) > 10 and all(len(s.pieces) == 1 for s in cut[:-1])  # the big file alone, in ranges
    assert [p.source for p in cut[-1].pieces] == [1, 2, 3]  # the small files share the last shard


def test_compressed_files_are_read_whole(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(2000):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
    shards = plan_shards(resolve_inputs([str(path)]), 100)
    assert len(shards) == 1 and shards[0].pieces[0].start == 0 and shards[0].pieces[0].row_groups is None


def test_parquet_is_cut_into_runs_of_row_groups_numbered_as_one_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    table = pa.table({"text": [f"row {i} " + "y" * (i % 80) for i in range(5000)]})
    pq.write_table(table, path, row_group_size=400)
    sources = resolve_inputs([str(path)])
    shards = plan_shards(sources, os.path.getsize(path) // 4)
    assert 3 <= len(shards) <= 6
    groups = [s.pieces[0].row_groups for s in shards]
    assert groups[0][0] == 0 and groups[-1][1] == 13  # 5,000 rows in groups of 400
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
    whole, _ = _records(sources, plan_shard(sources, 1, 0))
    assert [r for s in shards for r in _records(sources, list(s.pieces))[0]] == whole


def test_a_shard_key_follows_inputs_and_options(tmp_path):
    path = _lines(tmp_path / "a.jsonl", 500)
    sources = resolve_inputs([str(path)])
    shard = plan_shards(sources, 5_000)[1]
    head = {"tokenizer": {"sha256": "a"}, "options": {"format": "auto"}}
    key = shard.key(sources, head)
    assert key == plan_shards(resolve_inputs([str(path)]), 5_000)[1].key(sources, head)  # stable
    assert key != shard.key(sources, {**head, "tokenizer": {"sha256": "b"}})
    assert key != plan_shards(sources, 3_000)[1].key(sources, head)  # another byte range
    os.utime(path, ns=(1, 1))
    assert key != shard.key(resolve_inputs([str(path)]), head)  # the file changed (mtime)


# Shard keys name the results a rerun of ``xprep tokenize --ray`` reuses: pinned (before the input formats became
# reader classes), so that no refactor of the readers renames a kind or reshapes a key and orphans every staged shard.
PINNED_KEYS = {
    10**9: ["6b9ff6fc677337009930b45edbf3f8ba"],
    300: ["7b35489ef0793791ab777de712ad3627", "2ab0e6f87988bd2870997e818f92375c", "3527f16b6e0b440d1ef2a76dd3b3e810",
          "36b4267e81a2ce8dc591fd92cd73cca8", "7d5b03c2b49aad889f0080b0973b1634"],
}


def test_shard_keys_and_source_descriptions_are_pinned(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths: the key holds each path as given
    recs = [{"text": f"record {i}"} for i in range(40)]
    Path("a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    Path("c.json").write_text(json.dumps(recs))
    Path("d.txt").write_text("one document")
    names = ["a.jsonl", "c.json", "d.txt"]
    for name in names:
        os.utime(name, ns=(10**18, 10**18))
    sources = resolve_inputs(names)
    assert [s.describe() for s in sources] == [{"path": n, "size": size, "mtime_ns": 10**18}
                                              for n, size in zip(names, (870, 910, 12), strict=True)]
    head = {"tokenizer": {"sha256": "a"}}
    for size, keys in PINNED_KEYS.items():
        assert [s.key(sources, head) for s in plan_shards(sources, size)] == keys


@pytest.mark.parametrize("text, size", [("256MB", 256 * 10**6), ("64MiB", 64 << 20), ("1.5GB", 1_500_000_000),
                                        ("4096", 4096)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5MB", "0"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(XprepError, match="--shard-size"):
        parse_size(text)


class _FakeRay:
    """Just enough of ``ray`` for ``_check_shared``: a probe pinned to a node in ``blind`` runs as on a machine
    that mounts nothing of ours (every path looked up under a root that does not exist), others run here."""

    def __init__(self, blind: set[str]):
        self.blind, self.asked = blind, []

    def remote(self, num_cpus=0):
        def task(fn):
            def on(scheduling_strategy):
                node = scheduling_strategy.node_id
                self.asked.append(node)
                root = "/nonexistent-node" if node in self.blind else ""
                return SimpleNamespace(remote=lambda paths: fn([root + p for p in paths]))
            return SimpleNamespace(options=on)
        return task

    def get(self, ref, timeout=None):
        return ref


def test_a_multi_node_cluster_that_cannot_see_local_paths_is_refused(tmp_path):
    """With several nodes, -o's staging area, local inputs and the tokenizer must be visible on each node:
    every node is asked (by a probe task pinned to it), and one that cannot see them stops the job at once."""
    pytest.importorskip("ray")
    from xprep.prep.tokenize.ray.cluster import _check_shared
    from xprep.prep.tokenize.ray.staging import Staging

    (tmp_path / "tok.json").write_text("{}")
    job = SimpleNamespace(info=SimpleNamespace(path=str(tmp_path / "tok.json")),
                          sources=[SimpleNamespace(path=str(_lines(tmp_path / "a.jsonl", 5)))])
    config = SimpleNamespace(output=str(tmp_path / "out"))
    staging = Staging.beside(config.output)
    nodes = [{"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.2"}]
    shared = _FakeRay(blind=set())
    _check_shared(shared, nodes, staging, job, config)  # a file system every node mounts: no error
    assert shared.asked == ["a" * 56, "b" * 56]  # each node was asked
    with pytest.raises(XprepError) as e:
        _check_shared(_FakeRay(blind={"b" * 56}), nodes, staging, job, config)
    message = str(e.value)
    assert "node 10.0.0.2 cannot see /nonexistent-node/" in message and "cluster of 2 nodes" in message
    assert "object-store URLs" in message and str(tmp_path / "out") in message
    assert not os.path.exists(os.path.join(staging.root, "probe"))  # the probe file is cleaned up


def _published_shard(tmp_path, rejects: int):
    """A small shard dataset written as a Ray task writes it (no fsync) and published in a staging area."""
    import numpy as np
    from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter
    from xprep.prep.tokenize.ray.staging import ShardDone, Staging

    staging = Staging(str(tmp_path / "out.xprep-shards"))
    scratch = staging.scratch()
    with DatasetWriter(os.path.join(scratch, "dataset"), 1000, np.uint16, durable=False) as writer:
        writer.append(np.arange(60, dtype=np.int64) % 1000, np.array([10, 20, 30]))
        for line in range(rejects):
            writer.reject("in.jsonl", line + 1, "malformed JSON: at column 1", "{")
        manifest = writer.finish({"tokenizer": {"sha256": "0" * 64}}, CategoryTable())
    done = ShardDone(manifest["counts"]["documents"], manifest["counts"]["tokens"], 100, (4,))
    staging.publish(os.path.join(scratch, "dataset"), "k", done)
    return staging, done, tmp_path / "out.xprep-shards" / "shards" / "k"


@pytest.mark.parametrize("damage", ["tokens.bin", "tokens.idx", "rejects.jsonl", "manifest.json"])
def test_a_shard_damaged_before_reuse_is_run_again(tmp_path, damage):
    """Shards are published without fsync (only the merged dataset is forced to disk), so a shard an earlier run
    left is reused only when its files still match its manifest's digests and counts; a damaged one is removed."""
    staging, done, shard = _published_shard(tmp_path, rejects=2)
    assert staging.reusable("k", 1) == done
    path = shard / damage
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # what a crash before the write-back leaves: a file cut short
    assert staging.reusable("k", 1) is None
    assert not shard.exists() and staging.finished("k") is None


def test_a_whole_shard_without_rejects_is_reused(tmp_path):
    staging, done, shard = _published_shard(tmp_path, rejects=0)
    assert not (shard / "rejects.jsonl").exists()
    assert staging.reusable("k", 1) == done and shard.exists()


def test_a_duplicate_attempt_leaves_the_published_shard_alone(tmp_path):
    """A second attempt of a finished shard (a task resubmitted while the first still ran) must not remove the
    published one, which the merge may be reading; an attempt that died between its rename and its marker left a
    shard without marker, which the next attempt replaces."""
    staging, done, shard = _published_shard(tmp_path, rejects=1)

    def attempt(name: str) -> str:
        dataset = Path(staging.scratch()) / "dataset"
        dataset.mkdir()
        (dataset / name).write_text("this attempt's copy")
        return str(dataset)

    inode = shard.stat().st_ino
    late = attempt("late")
    staging.publish(late, "k", done)
    assert shard.stat().st_ino == inode and not (shard / "late").exists() and not os.path.exists(late)
    assert staging.reusable("k", 1) == done
    os.remove(staging.marker("k"))  # as if the first attempt had died before its marker
    staging.publish(attempt("next"), "k", done)
    assert (shard / "next").exists() and staging.finished("k") == done
    assert sorted(p.name for p in shard.parent.iterdir()) == ["k", "k.done"]  # the old one moved away, removed


def test_a_marker_that_does_not_count_lines_for_each_piece_is_not_reused(tmp_path):
    """A shard's marker gives the lines each of its pieces read, for renumbering the shards after it; one that
    lacks a number (an unreadable file, before a fix) is run again, not reused into a merge that breaks."""
    staging, done, shard = _published_shard(tmp_path, rejects=0)
    assert staging.reusable("k", 2) is None
    assert not shard.exists() and staging.finished("k") is None


def test_an_unreadable_piece_still_counts_its_lines(tmp_path):
    """``lines_read`` gets a number for every assignment, read to its end or not."""
    good = _lines(tmp_path / "a.jsonl", 5)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(good.read_bytes())[:-30])  # cut short
    sources = resolve_inputs([str(tmp_path / "b.jsonl.gz"), str(good)])
    counted: list[int] = []
    batches = list(read_batches(sources, plan_shard(sources, 1, 0), lines_read=counted))
    assert any(not isinstance(b, RawBatch) for b in batches) and len(counted) == 2 and counted[1] == 6


class _FakeInit:
    """``ray`` as ``_connect`` uses it: records how ``init`` was called."""

    def __init__(self):
        self.calls: list[dict] = []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs):
        self.calls.append(kwargs)


def _dead_address() -> str:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_an_address_nothing_answers_is_refused_at_once(monkeypatch):
    """Ray retries an address nothing answers for ~14 minutes; xprep tries it first and says so at once."""
    from xprep.prep.tokenize.ray import cluster

    dead = _dead_address()
    fake = _FakeInit()
    with pytest.raises(XprepError, match=f"--ray {dead}: no Ray cluster answers there"):
        cluster._connect(fake, dead)
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with pytest.raises(XprepError, match=f"--ray auto: RAY_ADDRESS={dead}: no Ray cluster answers there"):
        cluster._connect(fake, "auto")
    assert fake.calls == []


def test_auto_starts_a_local_cluster_where_the_recorded_one_is_gone(monkeypatch, capsys):
    """A head killed by SIGKILL or the OOM killer leaves its address recorded; ``auto`` starts a local cluster
    instead of joining it (Ray would wait for it, and ``ray.init()`` without an address would join it)."""
    from xprep.prep.tokenize.ray import cluster

    dead = _dead_address()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "_cluster_left_here", lambda: dead)
    fake = _FakeInit()
    assert cluster._connect(fake, "auto")
    assert [c.get("address") for c in fake.calls] == ["local"]
    assert f"the cluster `ray start` left at {dead} is gone): starting a local one" in capsys.readouterr().err


def test_the_staging_area_outlives_a_failed_upload(tmp_path, monkeypatch):
    """With an object-store -o and --merge, the dataset is uploaded after the merge: the shards stay until the
    upload is done, so the same command run again reuses them all."""
    from xprep.prep.tokenize import run as tokenize_run
    from xprep.prep.tokenize.ray.staging import Staging

    out = "s3://bucket/ds"
    staging = Staging.beside(str(tmp_path / "ds"))
    monkeypatch.setattr(tokenize_run, "prepare", lambda config: SimpleNamespace(inputs_read=()))
    monkeypatch.setattr(tokenize_run, "join_cluster", lambda address: SimpleNamespace(leave=lambda: None))
    monkeypatch.setattr(tokenize_run.Staging, "beside", classmethod(lambda cls, output: staging))

    def tokenize(config, job, local, cluster):
        os.makedirs(os.path.join(staging.root, "shards"))
        os.makedirs(local)
        return {}, "ray"

    def upload(local, url):
        raise XprepError(f"-o {url}: the upload failed")

    monkeypatch.setattr(tokenize_run, "tokenize_on_ray", tokenize)
    monkeypatch.setattr(tokenize_run, "upload_dataset", upload)
    with pytest.raises(XprepError, match="the upload failed"):
        tokenize_run._tokenize_on_ray(SimpleNamespace(ray="auto", output=out, merge=True))
    assert os.path.isdir(os.path.join(staging.root, "shards"))
