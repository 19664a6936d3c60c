"""A blend of datasets at URLs (``xprep pack a@0.7 b@0.3``, ``--mix`` files, phased or not, sharded datasets too)
reads them in place, as a plain pack does: only their manifests and indexes are fetched (into --cache-dir), the loss
mask a bounded chunk at a time for the target counts, the tokens never; nothing is copied whole. The blend entry
and its sources' entries are those of the same blend of the local copies (keys, arrays), list the datasets by URL,
``xprep inspect`` reports on them without copying anything, and ``xtrain run`` streams them to the same losses.

fsspec's in-memory file system (``memory://``) for the fast checks, moto's S3 server for the training run."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from click.testing import CliRunner
from motokit import Endpoint, count_memory_reads, use_endpoint
from prepkit import one_line_error
from trainkit import make_dataset, random_docs
from xprep.cli import xprep, xtrain
from xprep.prep.dataset import StreamedDataset, upload_dataset, write_sharded
from xprep.prep.fs import filesystem
from xprep.prep.pack import open_entry

PACK = ["--method", "multipack", "--seq-len", "32"]
PHASES = [{"bins": 12, "weights": {"web": 0.8, "chat": 0.2}}, {"bins": 12, "weights": {"web": 0.2, "chat": 0.8}}]
RUN = ["--steps", "3", "--micro-batch-size", "2", "--sampler", "random", "--save-every", "100"]


def write_datasets(root) -> dict:
    """``web``, a sharded dataset of two shards without a loss mask, and ``chat``, with loss masks and categories
    (some documents longer than a bin: dropped, so that inspect reads the categories of removed tokens)."""
    shards = [root / "shards" / f"web-{k}" for k in range(2)]
    for k, shard in enumerate(shards):
        make_dataset(shard, random_docs(25, 4, 30, vocab=128, seed=k), vocab_size=128)
    write_sharded(shards, root / "web")
    rng = np.random.default_rng(7)
    docs = random_docs(40, 4, 40, vocab=128, seed=7)
    masks = [(np.arange(len(d)) >= rng.integers(1, len(d))).astype(np.uint8) for d in docs]
    cats = [rng.integers(0, 3, len(d)) for d in docs]
    make_dataset(root / "chat", docs, vocab_size=128, loss_masks=masks, cats=cats, categories=["q", "a"])
    return {"web": root / "web", "chat": root / "chat"}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict:
    """The two datasets on local disk and at memory:// URLs."""
    root = tmp_path_factory.mktemp("blend-url")
    local = write_datasets(root)
    where = f"memory://xprep-tests/{uuid.uuid4().hex}"
    for name, path in local.items():
        upload_dataset(path, f"{where}/{name}")
    return {"local": local, "url": {name: f"{where}/{name}" for name in local}, "where": where}


def _pack(*args) -> None:
    result = CliRunner().invoke(xprep, ["pack", *map(str, args)])
    assert result.exit_code == 0, (result.output, result.exception)


def _arrays(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*.npy"))}


def assert_same_blend(there, here, urls: list[str]) -> None:
    """The blend at ``there`` is the blend at ``here`` (keys and arrays, its sources' entries too), its sources'
    entries listing their datasets by URL."""
    a, b = open_entry(there), open_entry(here)
    assert a.path.name == b.path.name and a.key == b.key  # the same cache key
    assert _arrays(a.path) == _arrays(b.path)
    assert [s.path.name for s in a.sources] == [s.path.name for s in b.sources]
    for x, y in zip(a.sources, b.sources, strict=True):
        assert _arrays(x.path) == _arrays(y.path)
    assert [d["path"] for s in a.sources for d in s.meta["datasets"]] == urls
    assert sorted(a.source_names) == ["chat", "web"] and a.num_bins > 0


def test_a_blend_by_arguments_reads_url_datasets_in_place(datasets, tmp_path, monkeypatch):
    """Split 8,1,1 too (its document counts read from the manifests at the URLs)."""
    local, url = datasets["local"], datasets["url"]
    tokens, masks = count_memory_reads(monkeypatch, "tokens.bin"), count_memory_reads(monkeypatch, "loss_mask.bin")
    _pack(f"{url['web']}@0.7", f"{url['chat']}@0.3", "-o", tmp_path / "there", *PACK, "--split", "8,1,1",
          "--cache-dir", tmp_path / "cache")
    _pack(f"{local['web']}@0.7", f"{local['chat']}@0.3", "-o", tmp_path / "here", *PACK, "--split", "8,1,1")
    assert_same_blend(tmp_path / "there", tmp_path / "here", [url["web"], url["chat"]])
    entries = [sorted(p.name for p in (tmp_path / d).iterdir() if p.is_dir()) for d in ("there", "here")]
    assert entries[0] == entries[1] and len(entries[0]) == 3 + 2 * 3  # three blends of the sources' three parts
    for name in entries[0]:  # the validation and test blends and every part too
        assert _arrays(tmp_path / "there" / name) == _arrays(tmp_path / "here" / name), name
    assert tokens == []  # never a token
    assert 0 < sum(masks) <= 1.1 * StreamedDataset(url["chat"]).loss_mask.nbytes  # the mask about once, for targets
    assert not list((tmp_path / "cache").rglob("*.bin"))  # nothing copied: manifests and indexes only
    assert list((tmp_path / "cache").rglob("tokens.idx"))


def test_a_phased_mix_of_urls_blends_and_inspects_like_the_local_one(datasets, tmp_path, monkeypatch):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    tokens = count_memory_reads(monkeypatch, "tokens.bin")
    for name, given in (("there", datasets["url"]), ("here", datasets["local"])):
        mix = {"sources": [{"dataset": str(given[n])} for n in ("web", "chat")], "phases": PHASES}
        (tmp_path / f"{name}.json").write_text(json.dumps(mix))
        _pack("--mix", tmp_path / f"{name}.json", "-o", tmp_path / name, *PACK)
    assert_same_blend(tmp_path / "there", tmp_path / "here", [datasets["url"]["web"], datasets["url"]["chat"]])
    there, here = (_report(tmp_path / name) for name in ("there", "here"))
    assert there == here and there["blend"]["phases"] and there["categories"]  # every table, with its categories
    assert tokens == [] and not list((tmp_path / "cache").rglob("*.bin"))  # the report copied nothing either


def _report(packed) -> dict:
    """``xprep inspect PACKED --json``, what depends on where the data lies (paths, times) left out."""
    result = CliRunner().invoke(xprep, ["inspect", str(packed), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    placed = ("path", "datasets", "created", "entries", "pack_seconds", "blend_seconds")
    blend = {**report["blend"], "sources": [{**s, "datasets": None} for s in report["blend"]["sources"]],
             "blend_seconds": None}
    sources = [{k: v for k, v in r.items() if k not in placed} for r in report["source_reports"]]
    assert all(r["categories_note"] is None for r in sources)  # every source's categories counted
    return {**{k: v for k, v in report.items() if k not in (*placed, "source_reports")}, "blend": blend,
            "source_reports": sources, "categories": [r["categories"] for r in sources]}


@pytest.mark.parametrize("case", ["missing", "not a dataset", "listed twice"])
def test_a_url_source_that_is_no_dataset_is_one_line(datasets, tmp_path, monkeypatch, case):
    monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
    url, where = datasets["url"], datasets["where"]
    if case == "not a dataset":  # another manifest (no COMPLETE marker), named in a mix file
        fs, inner = filesystem(f"{where}/packed")
        fs.pipe_file(f"{inner}/manifest.json", json.dumps({"format": "xprep-pack"}).encode())
        mix = {"sources": [{"dataset": url["web"], "weight": 1}, {"dataset": f"{where}/packed", "weight": 1}]}
        (tmp_path / "mix.json").write_text(json.dumps(mix))
        given = ["--mix", str(tmp_path / "mix.json")]
    else:
        other = f"{where}/nothing" if case == "missing" else f"{url['web']}/"
        given = [f"{url['web']}@1", f"{other}@1"]
    line = one_line_error(CliRunner().invoke(xprep, ["pack", *given, "-o", str(tmp_path / "out"), *PACK]))
    if case == "listed twice":
        assert f"dataset {url['web']}/ is listed twice (web and web)" in line
    else:
        assert "no complete dataset there" in line and (f"--mix {tmp_path / 'mix.json'}" in line) == (
            case == "not a dataset")
    assert not (tmp_path / "out").exists()


def test_a_blend_at_s3_trains_like_the_local_blend(datasets, tmp_path, monkeypatch):
    """moto's S3 server: the blend packed from s3:// lists its datasets there and ``xtrain run`` streams them to the
    losses (exact, fp32) of the same blend of the local copies."""
    s3fs = pytest.importorskip("s3fs")
    endpoint = Endpoint(tmp_path).start()
    try:
        use_endpoint(monkeypatch, endpoint)
        monkeypatch.setenv("XPREP_CACHE_DIR", str(tmp_path / "cache"))
        s3fs.S3FileSystem().mkdir("blend")
        for name, path in datasets["local"].items():
            upload_dataset(path, f"s3://blend/{name}")
        _pack("s3://blend/web@0.6", "s3://blend/chat@0.4", "-o", tmp_path / "there", *PACK)
        _pack(f"{datasets['local']['web']}@0.6", f"{datasets['local']['chat']}@0.4", "-o", tmp_path / "here", *PACK)
        assert_same_blend(tmp_path / "there", tmp_path / "here", ["s3://blend/web", "s3://blend/chat"])
        losses = []
        for name in ("there", "here"):
            run = tmp_path / f"run-{name}"
            result = CliRunner().invoke(xtrain, ["run", str(tmp_path / name), *RUN, "--output", str(run)])
            assert result.exit_code == 0, (result.output, result.exception)
            lines = (run / "metrics.jsonl").read_text().splitlines()
            losses.append([json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)])
        assert losses[0] == losses[1] and len(losses[0]) == 3
        assert not list((tmp_path / "cache").rglob("*.bin"))  # nothing copied: the run read the tokens by range
    finally:
        endpoint.kill()
