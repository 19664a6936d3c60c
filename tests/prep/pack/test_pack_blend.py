"""Blends end to end (issue 11): `xprep pack DATASET@WEIGHT ... | --mix FILE`, the blend entry, per-source batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from prepkit import random_dataset as make
from xprep.cli import xprep
from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.mixture import BlendEntry, open_entry
from xprep.train.data import PackedDataset

CAP = 64
SIZES = {"web": (60, 1), "code": (20, 2), "math": (8, 3)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("blend")
    for name, (n, seed) in SIZES.items():
        make(root / name, n, seed)
    return root


def blend(data: Path, out: Path, weights: dict[str, float], **options):
    config = PackConfig(method=options.pop("method", "multipack"),
                        **({"max_tokens": CAP} if options.get("token_aware") else {"seq_len": CAP}),
                        **{k: v for k, v in options.items() if k != "token_aware"})
    return pack([data / n for n in weights], out, config, weights=list(weights.values()))


def test_delivered_shares_follow_the_weights_and_batches_know_their_source(data, tmp_path):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    out = blend(data, tmp_path / "P", weights, total_tokens=40_000)
    entry = out.entry
    assert isinstance(entry, BlendEntry) and entry.path.name.startswith("blend-")
    assert json.loads((tmp_path / "P" / "manifest.json").read_text())["current"] == entry.path.name
    n = entry.num_bins
    assert n * CAP >= 40_000 > (n - 1) * CAP
    for s, w in zip(entry.meta["sources"], weights.values(), strict=True):
        assert abs(s["delivered_share"] - w) <= 1.5 / n  # within about a bin of its weight
        assert s["requested_share"] == pytest.approx(w)
        assert s["epochs"] == pytest.approx(s["bins"] / s["bins_available"]) and s["epochs"] > 1  # repeated
    ds = PackedDataset(tmp_path / "P")
    assert len(ds) == n and ds.source_names == ["web", "code", "math"]
    sources = [PackedDataset(e.path) for e in entry.sources]
    for j in range(0, n, 7):
        batch = ds[j]
        s, i = int(entry.bin_source[j]), int(entry.bin_index[j])
        assert (batch["source_ids"] == s).all() and batch["source_ids"].shape == batch["category_ids"].shape
        assert np.array_equal(batch["input_ids"], sources[s][i]["input_ids"])  # bin j is that source's bin
        assert np.array_equal(batch["labels"], sources[s][i]["labels"])


def test_plain_pack_has_one_source(data, tmp_path):
    pack([data / "web"], tmp_path / "P", PackConfig(method="multipack", seq_len=CAP))
    ds = PackedDataset(tmp_path / "P")
    assert ds.source_names == ["web"] and all((ds[b]["source_ids"] == 0).all() for b in range(len(ds)))


def test_epochs_size_the_blend_by_its_largest_share(data, tmp_path):
    out = blend(data, tmp_path / "P", {"web": 0.6, "code": 0.4})  # default --epochs 1
    web, code = out.entry.meta["sources"]
    assert abs(web["bins"] - web["bins_available"]) <= 1  # one epoch of the largest share
    two = blend(data, tmp_path / "P", {"web": 0.6, "code": 0.4}, epochs=2.0).entry.meta["sources"][0]
    assert abs(two["bins"] - 2 * web["bins_available"]) <= 1


def test_same_command_is_a_hit_and_sources_are_shared_between_mixtures(data, tmp_path):
    first = blend(data, tmp_path / "P", {"web": 0.5, "code": 0.5}, total_tokens=5000)
    assert not first.hit and [s.hit for s in first.sources] == [False, False]
    again = blend(data, tmp_path / "P", {"web": 0.5, "code": 0.5}, total_tokens=5000)
    assert again.hit and all(s.hit for s in again.sources) and again.entry.path == first.entry.path
    assert np.array_equal(again.entry.bin_index, first.entry.bin_index)
    other = blend(data, tmp_path / "P", {"web": 0.3, "math": 0.7}, total_tokens=5000)
    assert not other.hit and [s.hit for s in other.sources] == [True, False]  # web's pack is reused
    assert other.sources[0].entry.path == first.sources[0].entry.path


def test_deterministic_for_a_seed_and_repeats_reshuffled_per_epoch(data, tmp_path):
    a = blend(data, tmp_path / "A", {"web": 0.2, "math": 0.8}, total_tokens=20_000, seed=5).entry
    b = blend(data, tmp_path / "B", {"web": 0.2, "math": 0.8}, total_tokens=20_000, seed=5).entry
    assert np.array_equal(a.bin_source, b.bin_source) and np.array_equal(a.bin_index, b.bin_index)
    math_bins = a.bin_index[a.bin_source == 1]
    per_epoch = a.sources[1].num_bins
    epochs = math_bins[: len(math_bins) // per_epoch * per_epoch].reshape(-1, per_epoch)
    assert len(epochs) >= 3 and epochs[0].tolist() == list(range(per_epoch))
    assert all(sorted(e) == list(range(per_epoch)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # later epochs in fresh orders
    c = blend(data, tmp_path / "C", {"web": 0.2, "math": 0.8}, total_tokens=20_000, seed=6).entry
    assert not np.array_equal(c.bin_index, a.bin_index)


def test_token_aware_weights_count_tokens(data, tmp_path):
    out = blend(data, tmp_path / "P", {"web": 0.7, "code": 0.3}, method="token-aware", token_aware=True,
                total_tokens=30_000).entry
    ds = PackedDataset(tmp_path / "P")
    tokens = np.zeros(2)
    for j in range(len(ds)):
        tokens[int(out.bin_source[j])] += ds.bin_tokens([j])
    assert tokens.sum() >= 30_000 and abs(tokens[0] / tokens.sum() - 0.7) < CAP / tokens.sum() * 2
    assert [s["delivered_tokens"] for s in out.meta["sources"]] == tokens.astype(int).tolist()


def test_mix_file_json_and_yaml_and_inspect(data, tmp_path):
    mix = {"sources": [{"dataset": "web", "weight": 3, "name": "the-web"}, {"dataset": "code", "weight": 1}]}
    (data / "mix.json").write_text(json.dumps(mix))
    runner = CliRunner()
    args = ["pack", "-o", str(tmp_path / "P"), "--method", "multipack", "--seq-len", str(CAP)]
    res = runner.invoke(xprep, [*args, "--mix", str(data / "mix.json")])
    assert res.exit_code == 0, res.output
    assert "blended" in res.output and "the-web" in res.output
    yaml = pytest.importorskip("yaml")
    (data / "mix.yaml").write_text(yaml.safe_dump(mix))
    res = runner.invoke(xprep, [*args, "--mix", str(data / "mix.yaml")])
    assert res.exit_code == 0 and res.output.startswith("cache hit"), res.output  # the same blend
    assert PackedDataset(tmp_path / "P").source_names == ["the-web", "code"]
    shown = runner.invoke(xprep, ["inspect", str(tmp_path / "P")])
    assert shown.exit_code == 0 and "requested" in shown.output and "repeat" in shown.output, shown.output
    report = json.loads(runner.invoke(xprep, ["inspect", str(tmp_path / "P"), "--json"]).output)
    rows = report["blend"]["sources"]
    assert [r["name"] for r in rows] == ["the-web", "code"] and rows[0]["requested_share"] == 0.75
    assert {"delivered_share", "epochs"} <= set(rows[0])
    assert any(e["name"] == report["current"] and e["method"] == "blend" for e in report["entries"])


def test_blend_json_follows_its_schema(data, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from prepkit import schema

    entry = blend(data, tmp_path / "P", {"web": 1, "code": 1}).entry
    s = schema("pack")
    blend_schema = {**s["$defs"]["blend"], "$defs": s["$defs"]}
    jsonschema.Draft202012Validator(blend_schema).validate(entry.meta)
    mix = {"sources": [{"dataset": "web", "weight": 0.5, "name": "w"}]}
    jsonschema.Draft202012Validator(schema("mix")).validate(mix)


def _one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("case, needles", [
    ({"sources": [{"dataset": "web", "weight": 1}, {"dataset": "nope", "weight": 1}]},
     ["source 'nope'", "not a token dataset"]),
    ({"sources": [{"dataset": "web", "weight": 0}]}, ["weight 0", "positive"]),
    ({"sources": [{"dataset": "web", "weight": -2}]}, ["weight -2"]),
    ({"sources": [{"dataset": "web", "weight": "lots"}]}, ["'lots'", "positive number"]),
    ({"sources": [{"dataset": "web", "weight": True}]}, ["positive number"]),
    ({"sources": []}, ["sources"]),
    ({"sources": [{"dataset": "web", "weight": 1, "weigth": 2}]}, ["unknown key 'weigth'"]),
    ({"sources": [{"dataset": "web", "weight": 1}, {"dataset": "web", "weight": 2}]}, ["listed twice"]),
])
def test_bad_mix_files_are_one_clear_error(data, tmp_path, case, needles):
    mix = data / f"bad-{tmp_path.name}.json"  # beside the datasets: relative paths are read from its directory
    mix.write_text(json.dumps(case))
    res = CliRunner().invoke(xprep, ["pack", "-o", str(tmp_path / "P"), "--method", "multipack", "--seq-len",
                                     str(CAP), "--mix", str(mix)])
    _one_line_error(res, *needles)
    assert not (tmp_path / "P" / "manifest.json").exists()  # nothing packed


@pytest.mark.parametrize("args, needles", [
    (["web@0"], ["weight 0", "positive"]),
    (["web@-1", "code@1"], ["positive"]),
    (["web@1", "code"], ["give every dataset of a blend a weight"]),
    (["web@1", "missing@1"], ["missing", "not a token dataset"]),
])
def test_bad_weight_arguments_are_one_clear_error(data, tmp_path, args, needles):
    res = CliRunner().invoke(xprep, ["pack", *[str(data / a) for a in args], "-o", str(tmp_path / "P"),
                                     "--method", "multipack", "--seq-len", str(CAP)])
    _one_line_error(res, *needles)
    assert not (tmp_path / "P" / "manifest.json").exists()  # nothing packed


def test_different_tokenizers_are_refused(data, tmp_path):
    make(tmp_path / "other", 10, 9, tokenizer_sha="b" * 64)
    res = CliRunner().invoke(xprep, ["pack", f"{data / 'web'}@1", f"{tmp_path / 'other'}@1", "-o",
                                     str(tmp_path / "P"), "--method", "multipack", "--seq-len", str(CAP)])
    _one_line_error(res, "different tokenizers", "'web'", "'other'")


def test_yaml_without_pyyaml_names_the_install(data, tmp_path, monkeypatch):
    (tmp_path / "mix.yaml").write_text("sources:\n  - {dataset: web, weight: 1}\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    res = CliRunner().invoke(xprep, ["pack", "-o", str(tmp_path / "P"), "--method", "multipack", "--seq-len",
                                     str(CAP), "--mix", str(tmp_path / "mix.yaml")])
    _one_line_error(res, "pip install pyyaml")


def test_open_entry_reads_a_blend_directory_too(data, tmp_path):
    entry = blend(data, tmp_path / "P", {"web": 1, "code": 1}).entry
    assert open_entry(entry.path).key == entry.key == open_entry(tmp_path / "P").key


def test_a_split_blend_holds_out_every_source_and_validates_on_each_held_out_bin_once(data, tmp_path):
    """`--split` with a blend: each source is split by the document rule; training blends the training parts,
    and the validation entry is every held-out bin of every source exactly once (whatever the weights)."""
    weights = {"web": 0.6, "code": 0.4}
    out = blend(data, tmp_path / "P", weights, split=(70, 30))
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert manifest["current"] == out.entry.path.name and manifest["validation"] == out.validation.path.name
    valid = open_entry(tmp_path / "P" / manifest["validation"])
    assert isinstance(valid, BlendEntry) and valid.source_names == list(weights)
    held_out = [o.validation for o in out.sources]
    assert valid.num_bins == sum(e.num_bins for e in held_out)
    sources, index = np.asarray(valid.bin_source), np.asarray(valid.bin_index)
    for i, e in enumerate(held_out):
        assert sorted(index[sources == i].tolist()) == list(range(e.num_bins))
    assert set(sources[: len(held_out) * 2].tolist()) == set(range(len(held_out)))  # the first bins sample all
    for o in out.sources:  # no document on both sides
        assert not set(np.asarray(o.entry.item_doc).tolist()) & set(np.asarray(o.validation.item_doc).tolist())
    ds = PackedDataset(tmp_path / "P" / manifest["validation"])
    assert ds.source_names == list(weights) and len(ds) == valid.num_bins
    again = blend(data, tmp_path / "P", weights, split=(70, 30))
    assert again.hit and again.validation.path == out.validation.path
    # the validation blend follows neither the weights nor the seed: a re-weighted mixture reuses it
    reweighted = blend(data, tmp_path / "P", {"web": 0.2, "code": 0.8}, split=(70, 30), seed=7)
    assert reweighted.entry.path != out.entry.path and reweighted.validation.path == out.validation.path
    shown = CliRunner().invoke(xprep, ["inspect", str(out.validation.path)])
    assert shown.exit_code == 0 and "every held-out bin once" in shown.stdout, shown.output
    assert [s["weight"] for s in valid.meta["sources"]] == pytest.approx(
        [s["requested_share"] for s in valid.meta["sources"]])


def test_inspect_takes_a_blend_entry_directory(data, tmp_path):
    out = blend(data, tmp_path / "P", {"web": 0.5, "code": 0.5})
    result = CliRunner().invoke(xprep, ["inspect", str(out.entry.path)])
    flowed = " ".join(result.stdout.split())  # (a long path is wrapped onto a line of its own)
    assert result.exit_code == 0 and flowed.startswith(f"blend {out.entry.path}"), result.output


def test_a_failed_blend_leaves_the_current_entry_alone(data, tmp_path):
    """Sources are packed without becoming current: a blend that fails keeps what `xtrain run` trains on."""
    good = blend(data, tmp_path / "P", {"web": 0.5, "code": 0.5})
    (tmp_path / "empty").mkdir()
    with DatasetWriter(tmp_path / "empty" / "e", 128) as w:
        w.finish({"tokenizer": {"path": "t", "vocab_size": 128, "pad_id": 0, "eod_id": 1, "sha256": "a" * 64}},
                 CategoryTable())
    res = CliRunner().invoke(xprep, ["pack", f"{data / 'web'}@0.5", f"{tmp_path / 'empty' / 'e'}@0.5", "-o",
                                     str(tmp_path / "P"), "--method", "multipack", "--seq-len", str(CAP)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    manifest = json.loads((tmp_path / "P" / "manifest.json").read_text())
    assert manifest["current"] == good.entry.path.name


def test_blend_warns_per_source_about_dropped_tokens_and_reports_its_validation(data, tmp_path):
    res = CliRunner().invoke(xprep, ["pack", f"{data / 'web'}@0.5", f"{data / 'code'}@0.5", "-o",
                                     str(tmp_path / "P"), "--method", "multipack", "--seq-len", "24",
                                     "--overlong", "drop", "--split", "80,20"])  # text is split unless told
    assert res.exit_code == 0, res.output
    assert "warning: blend source 'web': " in res.stderr and "dropped as overlong" in res.stderr
    assert "validation (--split): " in res.stdout


def test_a_damaged_blend_is_a_corrupt_entry_not_an_index_error(data, tmp_path):
    """A bin beyond its own source's bins (within a larger source's: issue 31) is refused where the blend is opened,
    and the same `xprep pack` builds the blend again."""
    from xprep.prep.errors import XprepError

    weights = {"web": 0.5, "code": 0.5}
    out = blend(data, tmp_path / "P", weights)
    whole = np.load(out.entry.path / "bin_index.npy")
    source = np.load(out.entry.path / "bin_source.npy")
    small = int(np.argmin([e.num_bins for e in out.entry.sources]))
    j = int(np.flatnonzero(source == small)[0])
    for beyond in (10**6, out.entry.sources[small].num_bins):
        index = whole.copy()
        index[j] = beyond
        np.save(out.entry.path / "bin_index.npy", index)
        with pytest.raises(XprepError, match=f"damaged pack entry: blend arrays point outside its sources at bin {j}"):
            BlendEntry.open(out.entry.path)
    said = []
    again = pack([data / n for n in weights], tmp_path / "P", PackConfig(method="multipack", seq_len=CAP),
                 weights=list(weights.values()), log=said.append)
    assert not again.hit and any("damaged pack entry" in line for line in said), said
    assert np.array_equal(np.load(out.entry.path / "bin_index.npy"), whole)
