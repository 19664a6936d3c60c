"""``xprep pack`` and ``xprep inspect PACKED`` from the command line: output, JSON, user errors."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from test_pack_cache import lengths_for, make_dataset

import cli


def run(*args: str):
    return CliRunner().invoke(cli.xprep, list(map(str, args)), catch_exceptions=False)


@pytest.fixture
def ds(tmp_path):
    return make_dataset(tmp_path / "ds", lengths_for(0))


def test_pack_prints_stats_then_hit(tmp_path, ds):
    args = ["pack", ds, "-o", tmp_path / "P", "--method", "multipack", "--seq-len", 256]
    first = run(*args)
    assert first.exit_code == 0, first.output
    assert first.output.startswith("packed 500 documents")
    assert "dropped 88 (24,444 tokens)" in first.output and "truncated 0" in first.output and "split 0" in first.output
    second = run(*args)
    assert second.exit_code == 0 and second.output.startswith("cache hit:")
    assert "no packing done" in second.output


def test_inspect_reports_bins_fill_bound_categories_and_dp(tmp_path, ds):
    out = tmp_path / "P"
    result = run("pack", ds, "-o", out, "--method", "token-aware", "--max-tokens", 512, "--balance-dp", 2,
                 "--overlong", "truncate", "--cp-size", 2)
    assert result.exit_code == 0, result.output
    text = run("inspect", out)
    assert text.exit_code == 0, text.output
    for needle in ("fill", "lower bound", "padding", "documents per bin", "truncated", "dp balance", "chat"):
        assert needle in text.output
    report = json.loads(run("inspect", out, "--json").output)
    assert report["kind"] == "packed" and report["bins"] % 2 == 0
    assert report["fill"] == pytest.approx(report["tokens"] / (report["bins"] * 512))
    assert report["lower_bound_bins"] == -(-report["tokens"] // 512)
    assert sum(report["categories"].values()) == report["tokens"]
    assert set(report["categories"]) == {"uncategorized", "chat", "code"}
    dp = report["dp_balance"]
    assert dp["imbalance_after"]["mean"] <= dp["imbalance_before"]["mean"]
    assert report["config"]["balance_dp"] == 2 and "rank b % 2" in report["layout"]


def test_inspect_categories_subtract_dropped_and_truncated_tokens(tmp_path):
    ds = make_dataset(tmp_path / "ds", [5, 400, 30, 700], categories=False)
    out = tmp_path / "P"
    assert run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256, "--overlong",
               "truncate").exit_code == 0
    report = json.loads(run("inspect", out, "--json").output)
    assert report["categories"] == {"uncategorized": 5 + 256 + 30 + 256}
    assert report["overlong"]["truncated_tokens"] == 400 + 700 - 512


@pytest.mark.parametrize("extra, needle", [
    (["--method", "sequential", "--seq-len", "102", "--cp-size", "2"], "not a multiple of 2·cp=4"),
    (["--method", "multipack"], "needs --seq-len"),
    (["--method", "multipack", "--max-tokens", "64"], "--max-tokens does not apply"),
    (["--method", "sequential", "--seq-len", "64", "--group-size", "5"], "--group-size applies only"),
    (["--method", "token-aware", "--max-tokens", "64", "--balance-dp", "0"], "--balance-dp 0"),
])
def test_option_errors_are_one_line_exit_2(tmp_path, ds, extra, needle):
    result = CliRunner().invoke(cli.xprep, ["pack", str(ds), "-o", str(tmp_path / "P"), *extra])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in result.output


def test_missing_dataset_and_corrupt_cache_are_one_line_exit_2(tmp_path, ds):
    out = tmp_path / "P"
    missing = CliRunner().invoke(cli.xprep, ["pack", str(tmp_path / "nope"), "-o", str(out), "--method",
                                             "multipack", "--seq-len", "64"])
    assert missing.exit_code == 2 and "not a token dataset" in missing.output
    args = ["pack", str(ds), "-o", str(out), "--method", "multipack", "--seq-len", "256"]
    assert run(*args).exit_code == 0
    entry = next(p for p in out.iterdir() if p.is_dir() and not p.name.startswith("."))
    (entry / "bin_offsets.npy").write_bytes(b"garbage")
    for cmd in (args, ["inspect", str(out)]):
        result = CliRunner().invoke(cli.xprep, cmd)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and "--force" in lines[0], result.output
    assert run(*args, "--force").exit_code == 0


def test_inspect_still_reports_when_the_datasets_are_gone(tmp_path, ds):
    out = tmp_path / "P"
    assert run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256).exit_code == 0
    shutil.rmtree(ds)
    result = run("inspect", out)
    assert result.exit_code == 0 and "categories: input dataset unavailable" in result.output
