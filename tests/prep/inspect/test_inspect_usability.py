"""``xprep inspect`` for a new user (issue 9): decoded samples with targets marked, documents over given
lengths, options that do not apply, and a loss plot only where asked (``--plot FILE``)."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from prepkit import category_dataset as make_dataset
from prepkit import chat_records, target_runs, tokenize, write_jsonl
from xprep import cli
from xprep.prep.dataset.token_dataset import TokenDataset
from xprep.prep.inspect.dataset_report import dataset_report
from xprep.prep.inspect.text import render_dataset


def invoke(*args):
    return CliRunner().invoke(cli.xprep, list(map(str, args)))


def one_line_error(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert result.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory, tiny_tokenizer):
    """Chat records (a system turn, several assistant turns) whose last answers are category 'answers',
    tokenized with a private copy of the tiny tokenizer (so a test can delete it)."""
    d = tmp_path_factory.mktemp("usability")
    shutil.copytree(tiny_tokenizer, d / "tok")
    chats = chat_records(9)
    for c in chats[::2]:
        c["category"] = "dialog"
        c["messages"][-1]["category"] = "answers"
    tokenize(write_jsonl(d / "in.jsonl", chats), d / "ds", d / "tok")
    return d / "ds"


def decoder(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(TokenDataset(path).manifest["tokenizer"]["path"])


# -- --sample N ------------------------------------------------------------------------------------------------
def test_sample_spans_cover_each_document_and_follow_the_loss_mask(chat_dataset):
    result = invoke("inspect", chat_dataset, "--sample", 3, "--json")
    assert result.exit_code == 0, result.output
    sample = json.loads(result.stdout)["sample"]
    assert sample["selection"] == "first" and sample["seed"] is None
    ds, tok = TokenDataset(chat_dataset), decoder(chat_dataset)
    names = ds.category_names
    assert [d["index"] for d in sample["documents"]] == [0, 1, 2]
    for doc in sample["documents"]:
        d = ds.document(doc["index"])
        ids, mask, cats = (np.asarray(d[k]) for k in ("input_ids", "loss_mask", "category_ids"))
        spans = doc["spans"]
        assert sum(s["tokens"] for s in spans) == len(ids) == doc["tokens"]
        assert doc["targets"] == int(mask.sum())
        assert np.array_equal(np.repeat([s["target"] for s in spans], [s["tokens"] for s in spans]), mask == 1)
        assert [names[c] for c in cats] == [s["category"] for s in spans for _ in range(s["tokens"])]
        keys = [(s["target"], s["category"]) for s in spans]
        assert all(a != b for a, b in zip(keys, keys[1:], strict=False))  # maximal runs
        assert "".join(s["text"] for s in spans) == tok.decode(ids.tolist(), skip_special_tokens=False)
        assert [s["text"] for s in spans if s["target"]] == [tok.decode(r, skip_special_tokens=False)
                                                             for r in target_runs(ids, mask)]
    assert {s["category"] for d in sample["documents"] for s in d["spans"]} >= {"dialog", "answers"}


def test_sample_text_brackets_targets_and_names_categories(chat_dataset, run_cli):
    code, out, err = run_cli("inspect", chat_dataset, "--sample", 1)  # a pipe, not a terminal
    assert code == 0, err
    assert "\x1b[" not in out and "sample: the first 1 of 9 documents" in out
    doc = json.loads(invoke("inspect", chat_dataset, "--sample", 1, "--json").stdout)["sample"]["documents"][0]
    shown = "".join(f"{{{s['category']}}}" * (i == 0 or s["category"] != doc["spans"][i - 1]["category"])
                    + (f"[[{s['text']}]]" if s["target"] else s["text"]) for i, s in enumerate(doc["spans"]))
    assert shown in out and "[[" in shown and "{dialog}" in shown and "{answers}" in shown, out


def test_sample_in_colour_on_a_terminal(chat_dataset):
    from xprep.prep.inspect.options import InspectOptions

    report = dataset_report(chat_dataset, InspectOptions(sample=1))
    coloured, plain = render_dataset(report, color=True), render_dataset(report)
    assert "\x1b[" in coloured and "[[" not in coloured.split("sample:")[1] and "[[" in plain
    target = next(s["text"] for s in report["sample"]["documents"][0]["spans"] if s["target"])
    assert f"\x1b[1;32m{target}\x1b[0m" in coloured


def test_sample_with_seed_is_random_and_repeatable(chat_dataset):
    first = json.loads(invoke("inspect", chat_dataset, "--sample", 4, "--seed", 3, "--json").stdout)["sample"]
    again = json.loads(invoke("inspect", chat_dataset, "--sample", 4, "--seed", 3, "--json").stdout)["sample"]
    other = json.loads(invoke("inspect", chat_dataset, "--sample", 4, "--seed", 4, "--json").stdout)["sample"]
    picked = [d["index"] for d in first["documents"]]
    assert first == again and first["selection"] == "random" and first["seed"] == 3
    assert picked == sorted(np.random.default_rng(3).choice(9, 4, replace=False).tolist())
    assert picked != [d["index"] for d in other["documents"]]
    text = invoke("inspect", chat_dataset, "--sample", 4, "--seed", 3).stdout
    assert "sample: 4 of 9 documents drawn at random (--seed 3)" in text
    everything = json.loads(invoke("inspect", chat_dataset, "--sample", 50, "--json").stdout)["sample"]
    assert len(everything["documents"]) == 9


def test_sample_when_the_tokenizer_is_gone(chat_dataset, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(chat_dataset, ds)
    recorded = Path(TokenDataset(ds).manifest["tokenizer"]["path"])
    moved = tmp_path / "tokenizer.json"
    shutil.move(recorded, moved)
    try:
        line = one_line_error(invoke("inspect", ds, "--sample", 2))
        assert str(recorded) in line and "--sample" in line and "restore" in line, line
        assert invoke("inspect", ds).exit_code == 0  # the report itself needs no tokenizer
    finally:
        shutil.move(moved, recorded)


def test_sample_refuses_a_tokenizer_that_changed(chat_dataset, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(chat_dataset, ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    (ds / "manifest.json").write_text(json.dumps(manifest))
    line = one_line_error(invoke("inspect", ds, "--sample", 1))
    assert "sha256" in line and manifest["tokenizer"]["path"] in line, line


# -- --over ----------------------------------------------------------------------------------------------------
def test_over_counts_documents_longer_than_each_length(chat_dataset):
    lengths = TokenDataset(chat_dataset).lengths.astype(np.int64)
    cuts = sorted({int(np.percentile(lengths, 30)), int(np.percentile(lengths, 80))})
    result = invoke("inspect", chat_dataset, "--over", ",".join(map(str, cuts[::-1])), "--json")
    assert result.exit_code == 0, result.output
    over = json.loads(result.stdout)["over"]
    assert [o["length"] for o in over] == cuts
    for o in over:
        longer = lengths[lengths > o["length"]]
        assert o["documents"] == len(longer) and o["share"] == pytest.approx(len(longer) / len(lengths))
        assert o["tokens"] == int(longer.sum()) and o["token_share"] == pytest.approx(longer.sum() / lengths.sum())
    text = invoke("inspect", chat_dataset, "--over", ",".join(map(str, cuts))).stdout
    row = next(line for line in text.splitlines() if line.strip().startswith(f"> {cuts[0]:,}"))
    assert f"{over[0]['documents']:,}" in row and f"{over[0]['share']:.1%}" in row


def test_default_over_lengths_stop_past_the_longest_document(tmp_path):
    ds = make_dataset(tmp_path / "ds", [10, 2000, 3000, 5000])
    over = json.loads(invoke("inspect", ds, "--json").stdout)["over"]
    assert [(o["length"], o["documents"]) for o in over] == [(1024, 3), (2048, 2), (4096, 1), (8192, 0)]
    assert "> 4,096" in invoke("inspect", ds).stdout


@pytest.mark.parametrize("args, needles", [
    (["--over", "2048,lots"], ["--over 2048,lots", "comma-separated"]),
    (["--over", "0"], ["--over 0", "positive"]),
    (["--sample", "0"], ["--sample 0", "at least 1"]),
    (["--seed", "3"], ["--seed", "--sample N"]),
    (["--sample", "1", "--seed", "-1"], ["--seed -1"]),
    (["--plot", "x.png"], ["--plot", "run directory"]),
])
def test_option_mistakes_on_a_dataset_are_one_line(chat_dataset, args, needles):
    line = one_line_error(invoke("inspect", chat_dataset, *args))
    for needle in needles:
        assert needle in line, line


def test_dataset_options_on_a_pack_are_refused(tmp_path):
    ds = make_dataset(tmp_path / "ds", [10, 20, 30])
    assert invoke("pack", ds, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64).exit_code == 0
    for args in (["--sample", "2"], ["--over", "10"]):
        line = one_line_error(invoke("inspect", tmp_path / "P", *args))
        assert args[0] in line and "token dataset" in line and "pack cache" in line, line


def test_sample_on_a_dataset_without_its_tokenizer_names_the_recorded_path(tmp_path):
    ds = make_dataset(tmp_path / "ds", [10, 20])  # the manifest records the tokenizer path "test"
    line = one_line_error(invoke("inspect", ds, "--sample", 1))
    assert re.search(r"tokenizer (\S*/)?test\b", line), line  # as recorded, or resolved against the dataset


# -- runs: a picture only with --plot FILE ---------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "tiny", "sampler": "sequential", "lr": 1e-3}))
    rows = [{"step": s, "loss": 5.0 - s, "tokens": 100, "category_loss": {"a": 5.5 - s, "b": 4.5 - s}}
            for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def listing(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.fixture
def fake_matplotlib(monkeypatch):
    """Enough of matplotlib for train/report.py: savefig writes a small file (the real one may be absent)."""
    mpl, plt = types.ModuleType("matplotlib"), types.ModuleType("matplotlib.pyplot")

    class Figure:
        def savefig(self, path, **_kw):
            Path(path).write_bytes(b"\x89PNG fake")

    ax = types.SimpleNamespace(plot=lambda *a, **k: None, set_xlabel=lambda *a: None, set_ylabel=lambda *a: None,
                               legend=lambda *a, **k: None)
    mpl.use = lambda *_a, **_k: None
    plt.subplots = lambda *_a, **_k: (Figure(), ax)
    plt.close = lambda *_a: None
    mpl.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)


def test_inspect_run_writes_nothing_without_plot(run_dir, fake_matplotlib):
    before = listing(run_dir)
    for args in ([], ["--json"]):
        result = invoke("inspect", run_dir, *args)
        assert result.exit_code == 0, result.output
    assert listing(run_dir) == before
    assert json.loads(invoke("inspect", run_dir, "--json").stdout)["plot"] is None
    assert "--plot FILE" in invoke("inspect", run_dir).stdout


def test_inspect_run_plot_writes_only_the_file_asked_for(run_dir, tmp_path, fake_matplotlib):
    before = listing(run_dir)
    target = tmp_path / "pictures" / "loss.png"
    target.parent.mkdir()
    result = invoke("inspect", run_dir, "--plot", target, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plot"] == str(target) and target.read_bytes() == b"\x89PNG fake"
    assert listing(run_dir) == before and sorted(p.name for p in target.parent.iterdir()) == ["loss.png"]


def test_plot_without_matplotlib_names_the_fix(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    line = one_line_error(invoke("inspect", run_dir, "--plot", tmp_path / "loss.png"))
    assert "pip install matplotlib" in line and "--plot" in line, line
    assert not (tmp_path / "loss.png").exists()


def test_plot_into_a_directory_that_cannot_take_it(run_dir, tmp_path, fake_matplotlib):
    (tmp_path / "afile").write_text("x")
    for target, needle in ((tmp_path / "nowhere" / "loss.png", "does not exist"),
                           (tmp_path / "afile" / "loss.png", "not a directory"),
                           (tmp_path, "is a directory")):
        line = one_line_error(invoke("inspect", run_dir, "--plot", target))
        assert f"--plot {target}" in line and needle in line, line


def test_plot_with_real_matplotlib(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    before = listing(run_dir)
    result = invoke("inspect", run_dir, "--plot", tmp_path / "loss.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and listing(run_dir) == before


# -- pack caches and plurals in a terminal ---------------------------------------------------------------------
TERMINAL = 100  # characters: no line of `xprep inspect` text is wider (tables of a few columns aside)


@pytest.fixture(scope="module")
def blend_cache(tmp_path_factory) -> dict:
    """A cache of a dozen entries: a 70/30 blend with --split 95,5 (each source an entry, each with its
    validation part), the same blend reshuffled, and a pack balanced over 2 DP ranks; the blend is current.
    Each pack's stdout is kept."""
    d = tmp_path_factory.mktemp("cache")
    rng = np.random.default_rng(0)
    text = make_dataset(d / "text", rng.integers(300, 3000, 60), seed=1)
    chat = make_dataset(d / "chat", rng.integers(20, 900, 200), seed=2)
    packed, out = d / "packed", {}
    runs = {"balanced": [chat, "--method", "token-aware", "--max-tokens", 2048, "--balance-dp", 2,
                         "--dp-micro-batches", 2],
            "shuffled": [f"{text}@0.7", f"{chat}@0.3", "--method", "multipack", "--seq-len", 1024, "--overlong",
                         "split", "--split", "95,5", "--shuffle", "--seed", 3],
            "blend": [f"{text}@0.7", f"{chat}@0.3", "--method", "multipack", "--seq-len", 1024, "--overlong", "split",
                      "--split", "95,5"]}
    for name, args in runs.items():
        result = invoke("pack", *args, "-o", packed)
        assert result.exit_code == 0, result.output
        out[name] = result.stdout
    out["hit"] = invoke("pack", *runs["blend"], "-o", packed).stdout
    out["half"] = invoke("pack", f"{text}@0.7", f"{make_dataset(d / 'other', [500] * 30, seed=3)}@0.3",
                         *runs["blend"][2:], "-o", packed).stdout  # the text entry is in the cache already
    invoke("pack", *runs["blend"], "-o", packed)  # the 70/30 blend current again
    return {"packed": packed, "out": out}


def test_inspect_of_a_pack_cache_fits_a_terminal(blend_cache):
    """The table of entries keeps within a terminal: each entry's `xprep pack` options (200 characters for a
    blend with --split) on the lines under it, whole and in order, to be copied; so do the pack's own lines (the
    overlong and DP balance ones run to 180 characters)."""
    packed = blend_cache["packed"]
    report = json.loads(invoke("inspect", packed, "--json").stdout)
    balanced = next(e for e in report["entries"] if e.get("balance_dp"))
    assert len(report["entries"]) >= 10 and max(len(e["options"]) for e in report["entries"]) > 150
    for path in (packed, packed / balanced["name"]):
        result = invoke("inspect", path)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert max(map(len, lines)) <= TERMINAL, max(lines, key=len)
        assert "\x00" not in result.stdout  # what wrapping keeps together is joined back with spaces
    lines = invoke("inspect", packed).stdout.splitlines()
    for entry in report["entries"]:
        row = next(k for k, line in enumerate(lines) if entry["name"] in line.split())
        under = []
        for line in lines[row + 1:]:
            if not line.startswith("     "):
                break
            under.append(line.strip())
        assert " ".join(under) == entry["options"], entry["name"]
    assert "2 data-parallel ranks" in invoke("inspect", packed / balanced["name"]).stdout


def test_pack_says_which_blend_sources_came_from_the_cache(blend_cache):
    """"the others found in the cache" only where there are others."""
    out = blend_cache["out"]
    assert "all 2 sources packed now)" in out["shuffled"].splitlines()[0], out["shuffled"]
    assert "all 2 sources found in the cache)" in out["hit"].splitlines()[0], out["hit"]
    assert "1 of 2 sources packed now, 1 found in the cache)" in out["half"].splitlines()[0], out["half"]
    assert "data-parallel ranks" in out["balanced"], out["balanced"]
    assert not any("the others" in text for text in out.values())


def test_counts_of_one_are_singular(chat_dataset, tmp_path):
    """"1 source", "1 document", "1 dataset", "1 step": never "1 sources"."""
    text = invoke("inspect", chat_dataset, "--sample", 1).stdout
    assert "(from 1 source, " in text, text
    ds = make_dataset(tmp_path / "ds", [10])
    assert invoke("pack", ds, "-o", tmp_path / "P", "--method", "multipack", "--seq-len", 64).exit_code == 0
    pack = invoke("inspect", tmp_path / "P").stdout
    assert "1 document, 10 tokens from 1 dataset" in pack and "holding 1 document or piece," in pack, pack
    assert "1 bin (" in pack, pack
    for shown in (text, pack):
        assert not re.search(r"\b1 (source|document|dataset|bin|step|rank|entrie)s\b", shown), shown


def test_a_run_with_steps_without_targets(run_dir, tmp_path):
    """A step whose batch had no target token has no loss: the text says how many, and a run whose every step
    is such still makes a page (no loss table, the count on a card)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows.append({"step": 4, "loss": None, "tokens": 100, "category_loss": {}})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = invoke("inspect", run_dir).stdout
    assert "1 step without a target token" in text and "training loss" in text, text
    (run_dir / "metrics.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    text = invoke("inspect", run_dir).stdout
    assert "no loss yet" in text and "no metrics yet" not in text, text
    result = invoke("inspect", run_dir, "--html", tmp_path / "page.html")
    assert result.exit_code == 0, result.output
    assert "steps without targets" in (tmp_path / "page.html").read_text()
