"""``xprep pack`` and ``xprep inspect PACKED`` from the command line: output, JSON, user errors."""

from __future__ import annotations

import json
import shutil

import click
import pytest
from click.testing import CliRunner
from prepkit import category_dataset as make_dataset
from prepkit import lengths_for, one_line_error
from prepkit import xprep_invoke as run
from xprep import cli


@pytest.fixture
def ds(tmp_path):
    return make_dataset(tmp_path / "ds", lengths_for(0))


def test_pack_prints_stats_then_hit(tmp_path, ds):
    args = ["pack", ds, "-o", tmp_path / "P", "--method", "multipack", "--seq-len", 256]
    first = run(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("packed 411 of 500 documents (54,003 of 78,448 tokens; dropped 88 documents "
                                   "(24,444 tokens) longer than 256; dropped 1 piece (1 token; 1 document left with "
                                   "none) with no target token)")  # a document of one token: nothing to learn
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
    result = CliRunner().invoke(cli.xprep, ["inspect", str(out)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "damaged pack entry" in lines[0], result.output
    rebuilt = run(*args)  # the same command builds a damaged entry again (tests/test_packfile.py)
    assert rebuilt.exit_code == 0 and "damaged pack entry" in rebuilt.stderr, rebuilt.output


def test_inspect_still_reports_when_the_datasets_are_gone(tmp_path, ds):
    out = tmp_path / "P"
    assert run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256).exit_code == 0
    shutil.rmtree(ds)
    result = run("inspect", out)
    assert result.exit_code == 0 and "categories: input dataset unavailable" in result.output


# -- issue 9: what a new user hit -------------------------------------------------------------------------------
@pytest.mark.parametrize("under", [False, True])
def test_output_that_is_or_is_under_a_file_is_one_line_exit_2(tmp_path, ds, under):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile / "sub" if under else afile
    line = one_line_error(CliRunner().invoke(cli.xprep, ["pack", str(ds), "-o", str(out), "--method",
                                                         "multipack", "--seq-len", "256"]))
    assert f"-o {out}" in line and "is a file" in line, line
    assert afile.read_text() == "keep me"


def cache_state(out):
    """Every file of a pack cache except lock files (which a refused pack may leave), with its bytes."""
    if not out.exists():
        return None
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.parametrize("lengths, extra, reason", [
    ([], [], "no documents"),
    ([0, 0], [], "all 2 documents are empty"),
    ([300, 400, 500], ["--overlong", "drop"], "all 3 documents are longer than --seq-len 256"),
])
def test_a_pack_with_no_bins_is_refused_unless_allow_empty(tmp_path, ds, lengths, extra, reason):
    empty = make_dataset(tmp_path / "empty", lengths)
    out = tmp_path / "P"
    args = ["pack", empty, "-o", out, "--method", "multipack", "--seq-len", 256, *extra]
    fresh = CliRunner().invoke(cli.xprep, list(map(str, args)))
    line = one_line_error(fresh)
    assert "0 bins" in line and reason in line and "--allow-empty" in line, line
    assert not out.exists()  # the cache directory this command created is removed again
    assert run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256).exit_code == 0
    before = cache_state(out)
    one_line_error(CliRunner().invoke(cli.xprep, list(map(str, args))))
    assert cache_state(out) == before  # nothing published, manifest.json untouched
    allowed = run(*args, "--allow-empty")
    assert allowed.exit_code == 0, allowed.output
    assert " 0 bins" in allowed.stdout and "warning: the pack has 0 bins" in allowed.stderr
    assert json.loads(run("inspect", out, "--json").stdout)["bins"] == 0
    hit = CliRunner().invoke(cli.xprep, list(map(str, args)))  # the empty entry now exists: still refused
    assert "--allow-empty" in one_line_error(hit)


def test_summary_says_kept_and_dropped_and_warns_when_over_one_percent(tmp_path, ds):
    out = tmp_path / "P"
    result = run("pack", ds, "-o", out, "--method", "multipack", "--seq-len", 256)
    first = result.stdout.splitlines()[0]
    assert "411 of 500 documents" in first and "54,003 of 78,448 tokens" in first, first
    assert "dropped 88 documents (24,444 tokens) longer than 256" in first, first
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: 31.2 % of tokens (24,444 of 78,448) dropped as overlong: raise --seq-len "
                       "or use --overlong split|truncate"], result.stderr
    hit = run("pack", ds, "-o", out, "--method", "multipack", "--seq-len", 256)
    assert "411 of 500 documents" in hit.stdout.splitlines()[0] and warning[0] in hit.stderr
    cut = run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256, "--overlong", "truncate")
    assert "truncated 88 documents (1,916 tokens cut)" in cut.stdout.splitlines()[0], cut.stdout
    assert "2.4 % of tokens (1,916 of 78,448) cut by --overlong truncate: raise --seq-len or use --overlong " \
           "split" in cut.stderr
    kept = run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256, "--overlong", "split")
    assert kept.stdout.startswith("packed 499 of 500 documents (78,445 of 78,448 tokens; split 88 documents longer "
                                  "than 256 into 176 pieces; dropped 3 pieces (3 tokens; 1 document left with none) "
                                  "with no target token)")  # one-token tails of split documents, and a 1-token one
    assert kept.stderr == ""


def test_a_few_dropped_tokens_do_not_warn(tmp_path):
    ds = make_dataset(tmp_path / "ds", [100] * 399 + [300])  # 0.75 % of the tokens dropped
    result = run("pack", ds, "-o", tmp_path / "P", "--method", "multipack", "--seq-len", 256)
    first = result.stdout.splitlines()[0]
    assert "399 of 400 documents" in first and "dropped 1 document (300 tokens)" in first, first
    assert "warning" not in result.stderr


def test_inspect_lists_every_entry_and_marks_the_current_one(tmp_path, ds):
    out = tmp_path / "P"
    assert run("pack", ds, "-o", out, "--method", "multipack", "--seq-len", 256).exit_code == 0
    assert run("pack", ds, "-o", out, "--method", "token-aware", "--max-tokens", 512, "--balance-dp", 2,
               "--seed", 7).exit_code == 0
    last = run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 512, "--cp-size", 2)
    current = json.loads((out / "manifest.json").read_text())["current"]
    report = json.loads(run("inspect", out, "--json").stdout)
    assert report["current"] == current and report["path"] == str(out / current)
    entries = {e["name"]: e for e in report["entries"]}
    assert len(entries) == 3 and [e["name"] for e in report["entries"] if e["current"]] == [current]
    seq = entries[current]
    assert (seq["method"], seq["capacity"], seq["overlong"], seq["cp_size"], seq["shuffle"]) == (
        "sequential", 512, "split", 2, False)
    assert seq["bins"] == report["bins"] and seq["fill"] == pytest.approx(report["fill"])
    ta = next(e for e in entries.values() if e["method"] == "token-aware")
    assert (ta["capacity"], ta["overlong"], ta["shuffle"], ta["seed"], ta["balance_dp"],
            ta["dp_micro_batches"]) == (512, "drop", True, 7, 2, 16)
    assert ta["options"] == ("--method token-aware --max-tokens 512 --overlong drop --cp-size 1 --shuffle "
                             "--seed 7 --balance-dp 2 --dp-micro-batches 16")
    mp = next(e for e in entries.values() if e["method"] == "multipack")
    assert mp["group_size"] == 100_000 and mp["documents_kept"] == 411 and mp["documents_in"] == 500
    text = run("inspect", out).stdout
    lines = text.splitlines()
    marked = [k for k, line in enumerate(lines) if line.startswith("*")]
    assert len(marked) == 1 and current in lines[marked[0]], text
    assert lines[marked[0] + 1].strip().startswith("--method sequential --seq-len 512"), text  # options under it
    assert ta["options"] in " ".join(line.strip() for line in lines) and "current" in text
    flowed = " ".join(text.split())  # (a long path is wrapped onto a line of its own)
    assert last.exit_code == 0 and f"pack {out / current}" in flowed  # the detailed report is the current one's


def test_every_pack_and_inspect_option_has_help():
    ctx = click.Context(cli.xprep)
    for name in ("pack", "inspect"):
        command = cli.xprep.commands[name]
        for param in command.params:
            if isinstance(param, click.Option):  # the record --help shows (some helps are written only then)
                record = param.get_help_record(ctx)
                assert record and len(record[1]) > 10, (name, param.name)
    assert "--allow-empty" in run("pack", "--help").stdout
    helps = run("inspect", "--help").stdout
    for flag in ("--sample", "--seed", "--over", "--plot"):
        assert flag in helps, flag


def test_one_bin_and_one_document_are_singular(tmp_path):
    ds = make_dataset(tmp_path / "one", [40])
    result = run("pack", ds, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("packed all 1 document (40 tokens) into 1 bin of 64 in "), result.stdout
    again = run("pack", ds, "-o", tmp_path / "P", "--method", "sequential", "--seq-len", 64)
    assert " in 1 bin " in again.stdout, again.stdout
