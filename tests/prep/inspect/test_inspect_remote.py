"""``xprep inspect URL`` (moto's S3 server on 127.0.0.1): a token dataset (plain or sharded) or a pack cache at a URL
reports as its local copy does, read where it is: the dataset's manifests and indexes, never its token files
(``--sample`` reads its documents' bytes by range, and the tokenizer kept inside it); a pack's entry files. A URL
that is missing, refused, a run directory or nothing xprep wrote is one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SHARED
from motokit import Endpoint, use_endpoint
from prepkit import text_records, tokenize, write_jsonl
from trainkit import make_dataset, random_docs
from xprep.cli import xprep
from xprep.prep.dataset import upload_dataset, write_sharded
from xprep.prep.inspect import render

s3fs = pytest.importorskip("s3fs")
PACK = ["--method", "multipack", "--seq-len", "32", "--overlong", "truncate"]  # truncated tails: categories read


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer):
    """(endpoint, local root) with s3://insp/sh, a sharded dataset (categories numbered differently in each shard),
    s3://insp/packed, a pack of it made from the URL, s3://insp/kept, a dataset whose tokenizer (converted from
    GPT-2 files) is kept inside it, and s3://insp/ksh, a sharded one of two such datasets."""
    root = tmp_path_factory.mktemp("inspurl")
    endpoint = Endpoint(root).start()
    with pytest.MonkeyPatch.context() as mp:
        use_endpoint(mp, endpoint)
        mp.setenv("XPREP_CACHE_DIR", str(root / "setup-cache"))
        s3fs.S3FileSystem().mkdir("insp")
        _sharded(root / "sh")
        upload_dataset(root / "sh", "s3://insp/sh")
        packed = CliRunner().invoke(xprep, ["pack", "s3://insp/sh", "-o", str(root / "packed"), *PACK])
        assert packed.exit_code == 0, packed.output
        s3fs.S3FileSystem().put(str(root / "packed"), "insp/packed", recursive=True)
        gpt2 = _gpt2_files(tiny_tokenizer, root / "gpt2")
        texts = write_jsonl(root / "t.jsonl", text_records(12))
        tokenize(texts, root / "kept", gpt2)
        upload_dataset(root / "kept", "s3://insp/kept")
        for k in range(2):  # shards outside the sharded directory: uploaded as shard-0000k
            tokenize(texts, root / f"k{k}", gpt2, num_shards=2, shard_index=k)
        write_sharded([root / "k0", root / "k1"], root / "ksh")
        upload_dataset(root / "ksh", "s3://insp/ksh")
        s3fs.S3FileSystem().pipe_file("insp/run/metrics.jsonl", b'{"step": 1, "loss": 1.0}\n')
    yield endpoint, root
    endpoint.kill()


def _sharded(out):
    for k, names in enumerate([["a", "b"], ["b", "c"], ["c"]]):
        rng = np.random.default_rng(k)
        docs = random_docs(15, 4, 40, vocab=128, seed=k)
        masks = [np.concatenate([[0], rng.integers(0, 2, len(d) - 1)]) for d in docs]
        make_dataset(out / f"shard-{k}", docs, vocab_size=128, loss_masks=masks, categories=names,
                     cats=[np.full(len(d), rng.integers(0, len(names) + 1)) for d in docs])
    write_sharded([out / f"shard-{k}" for k in range(3)], out)


def _gpt2_files(tokenizer, out):
    """GPT-2's vocab.json and merges.txt of the tests' tiny byte-level BPE: ``xprep tokenize`` converts them and keeps
    the converted tokenizer.json inside the dataset."""
    model = json.loads((tokenizer / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    out.mkdir()
    (out / "vocab.json").write_text(json.dumps(model["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")
    return out


@pytest.fixture
def endpoint(store, tmp_path, monkeypatch):
    use_endpoint(monkeypatch, store[0])
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    return store[0]


@pytest.fixture
def reads(monkeypatch) -> dict[str, list[int]]:
    """The byte counts of every object read from now on (whole or by range), by key."""
    read: dict[str, list[int]] = {}
    cat_file = s3fs.S3FileSystem._cat_file

    async def counted(self, path, *args, **kwargs):
        data = await cat_file(self, path, *args, **kwargs)
        read.setdefault(path.split("://")[-1], []).append(len(data))
        return data

    monkeypatch.setattr(s3fs.S3FileSystem, "_cat_file", counted)
    return read


def _inspect(*args) -> str:
    result = CliRunner().invoke(xprep, ["inspect", *map(str, args)])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def _report(*args) -> dict:
    return json.loads(_inspect(*args, "--json"))


def _without_paths(report: dict) -> dict:
    return {**report, "path": None, "tokenizer": {**report["tokenizer"], "path": None}}


def _bin_bytes(reads: dict[str, list[int]]) -> dict[str, int]:
    return {key: sum(n) for key, n in reads.items() if key.endswith(".bin")}


# ----------------------------------------------------------------------------------------------- datasets
def test_a_sharded_dataset_at_a_url_reports_as_its_local_copy_without_reading_a_token(store, endpoint, reads):
    there = _report("s3://insp/sh/", "--over", "16,32")
    here = _report(store[1] / "sh", "--over", "16,32")
    assert there["path"] == "s3://insp/sh/"  # as typed
    assert _without_paths(there) == _without_paths(here)
    assert len(there["shards"]) == 3 and set(there["categories"]) == {"a", "b", "c", "uncategorized"}
    assert reads and not _bin_bytes(reads)  # manifests and indexes only
    text = _inspect("s3://insp/sh")
    assert text.splitlines()[0].startswith("dataset s3://insp/sh  (fingerprint")
    # a sharded dataset keeps no rejects.jsonl of its own (each shard keeps its records): the text says where
    there["rejects"] = {"count": 2, "by_reason": {"empty text": 2}, "file": None}
    assert "rejected records: 2 (see the rejects.jsonl of each shard under s3://insp/sh/)" in render(there)


def test_a_sharded_dataset_s_documents_at_a_url_are_its_local_copy_s(store, endpoint, reads):
    """--sample on the synthetic shards (no tokenizer to decode with) is refused alike; the documents themselves,
    read by range, are the local ones, categories in the sharded table."""
    from xprep.prep.dataset import ShardedDataset
    from xprep.prep.inspect.remote import open_url_dataset

    there, here = open_url_dataset("s3://insp/sh"), ShardedDataset(store[1] / "sh")
    assert len(there) == len(here) == 45 and np.array_equal(there.lengths, here.lengths)
    for i in (0, 14, 15, 31, 44):  # each shard's first and last
        a, b = there.document(i), here.document(i)
        assert all(np.array_equal(a[k], b[k]) for k in b), i
    touched = _bin_bytes(reads)
    assert sum(touched.values()) == sum(4 * int(here.lengths[i]) for i in (0, 14, 15, 31, 44))  # 3 streams, 2+1+1 B
    assert set(touched) == {f"insp/sh/shard-{k}/{s}.bin" for k in range(3)
                            for s in ("tokens", "loss_mask", "category_ids")}


@pytest.mark.usefixtures("shared_data")
def test_a_real_dataset_at_a_url_reports_and_samples_as_its_local_copy(tmp_path, endpoint, reads):
    """Qwen3 and 100 chitchat conversations: the report, and --sample's documents decoded, equal the local ones; only
    the sampled documents' bytes are fetched (the report itself: the indexes, a few percent of the tokens)."""
    tokenize(SHARED / "chat/chitchat.jsonl", tmp_path / "chat", SHARED / "tokenizers/qwen3", limit=100,
             on_error="skip")
    upload_dataset(tmp_path / "chat", "s3://insp/chat")
    reads.clear()
    there, here = _report("s3://insp/chat"), _report(tmp_path / "chat")
    assert _without_paths(there) == _without_paths(here) and there["tokenizer"] == here["tokenizer"]
    bins = s3fs.S3FileSystem().info("insp/chat/tokens.bin")["size"]
    assert not _bin_bytes(reads) and sum(map(sum, reads.values())) < bins / 10
    reads.clear()
    sample = ["--sample", 3, "--seed", 5]
    there, here = _report("s3://insp/chat", *sample), _report(tmp_path / "chat", *sample)
    assert there["sample"] == here["sample"] and there["rejects"]["count"]
    lengths = [d["tokens"] for d in here["sample"]["documents"]]
    assert sorted(reads["insp/chat/tokens.bin"]) == sorted(4 * n for n in lengths)  # int32: those documents only
    assert sorted(reads["insp/chat/loss_mask.bin"]) == sorted(lengths)
    text = _inspect("s3://insp/chat")
    assert text == _inspect(tmp_path / "chat").replace(str(tmp_path / "chat"), "s3://insp/chat")
    assert "(see s3://insp/chat/rejects.jsonl)" in text and s3fs.S3FileSystem().exists("insp/chat/rejects.jsonl")


def test_the_tokenizer_kept_inside_a_dataset_at_a_url_is_fetched_once_into_the_cache_dir(store, endpoint, reads,
                                                                                       tmp_path):
    there = _report("s3://insp/kept", "--sample", 2, "--cache-dir", tmp_path / "cd")
    here = _report(store[1] / "kept", "--sample", 2)
    assert there["tokenizer"]["path"] == "s3://insp/kept/tokenizer.json"
    assert there["sample"] == here["sample"] and _without_paths(there) == _without_paths(here)
    assert len(reads["insp/kept/tokenizer.json"]) == 1
    _report("s3://insp/kept", "--sample", 2, "--cache-dir", tmp_path / "cd")
    assert len(reads["insp/kept/tokenizer.json"]) == 1  # the cached copy, its sha256 checked
    fetched = {p.name for p in (tmp_path / "cd").rglob("*")}
    assert {"kept.index", "kept.tokenizer.json", "tokens.idx"} <= fetched and not (tmp_path / "cache").exists()


def test_a_sharded_dataset_at_a_url_finds_the_tokenizer_kept_in_its_first_shard(store, endpoint):
    """Its manifest names ../k0/tokenizer.json, which the upload moved to shard-00000/tokenizer.json."""
    sample = ["--sample", 3, "--seed", 1]
    there, here = _report("s3://insp/ksh", *sample), _report(store[1] / "ksh", *sample)
    assert there["sample"] == here["sample"] and len(there["sample"]["documents"]) == 3


# ----------------------------------------------------------------------------------------------- packs
@pytest.mark.parametrize("entry", [False, True])
def test_a_pack_at_a_url_reports_as_its_local_copy(store, endpoint, entry):
    local = store[1] / "packed"
    name = json.loads((local / "manifest.json").read_text())["current"]
    url, local = ("s3://insp/packed/" + name, local / name) if entry else ("s3://insp/packed", local)
    there, here = _report(url), _report(local)
    assert there["path"] == f"s3://insp/packed/{name}" and there["categories_note"] is None
    assert {**there, "path": None} == {**here, "path": None}
    assert there["overlong"]["truncated_tokens"]  # (the categories of the removed tokens were read by range)
    if not entry:
        assert _inspect(url).splitlines()[0] == "pack cache s3://insp/packed: 1 entry, oldest first"


# ----------------------------------------------------------------------------------------------- refusals
def _one_line(url: str, *needles: str, args: tuple = ()) -> None:
    result = CliRunner().invoke(xprep, ["inspect", url, *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {url}") and "Traceback" not in result.stderr, lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_what_is_no_dataset_nor_pack_at_a_url_is_one_line(endpoint):
    _one_line("s3://insp/nothing-here", "no such object")
    _one_line("s3://no-such-bucket/ds", "no such object")
    _one_line("s3://insp/run", "a run directory at a URL is not supported", "copy it to a local directory")
    _one_line("s3://insp/sh/manifest.json", "a file, not a directory")
    s3fs.S3FileSystem().pipe_file("insp/other/notes.txt", b"hello")
    _one_line("s3://insp/other", "neither a token dataset, a pack cache nor a run directory")


def test_an_endpoint_that_does_not_answer_is_one_line_once_the_retries_are_spent(tmp_path, monkeypatch):
    import functools

    from xprep.prep.inspect import remote

    use_endpoint(monkeypatch, Endpoint(tmp_path))  # a free port: nothing listens there
    monkeypatch.setattr(remote, "Retry", functools.partial(remote.Retry, budget_s=0.5))
    _one_line("s3://insp/sh", "unreachable for", "EndpointConnectionError")


def test_a_dataset_at_a_url_denied_is_one_line(store, tmp_path, monkeypatch):
    """Its own server: denying access applies to every request from then on. Denied every object or only the token
    stream (whose size the report checks against its index), the report is refused, naming the object."""
    server = Endpoint(tmp_path).start()
    try:
        use_endpoint(monkeypatch, server)
        s3fs.S3FileSystem().mkdir("locked")
        upload_dataset(store[1] / "kept", "s3://locked/ds")
        every, tokens = server.deny("s3:GetObject", "arn:aws:s3:::locked/ds/*", "arn:aws:s3:::locked/ds/tokens.bin")
        monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
        use_endpoint(monkeypatch, server, every)
        _one_line("s3://locked/ds", "manifest.json: access denied", "check the URL and the credentials for it")
        use_endpoint(monkeypatch, server, tokens)
        _one_line("s3://locked/ds", "tokens.bin: access denied", "check the URL and the credentials for it")
    finally:
        server.kill()
