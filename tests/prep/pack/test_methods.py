"""The packing-method registry (prep/pack/methods.py): the one place a method is named, an unknown name an error,
and a method registered from outside (here, from this file alone) packed by ``xprep pack`` and described by
``xprep inspect`` like a built-in one."""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO_ROOT
from prepkit import category_dataset, lengths_for, one_line_error, schema
from prepkit import xprep_invoke as run
from xprep.prep.errors import XprepError
from xprep.prep.pack import (
    PackConfig,
    PackingMethod,
    method_names,
    methods_of,
    packing_method,
    register_method,
    unregister_method,
)
from xprep.prep.pack.kernels import bin_items
from xprep.prep.pack.methods import BUILT_IN

PRODUCT = ("prep", "train", "cli.py")  # the product code a method name must not be spelled in, but for the registry
REGISTRY = Path("prep/pack/methods.py")
# "sequential" also names a sampler (`xtrain run --sampler sequential`), which these files spell, and nothing else
SAMPLER_FILES = {Path("train/samplers.py"), Path("train/lineage.py"), Path("train/config.py")}


@pytest.fixture
def ds(tmp_path):
    return category_dataset(tmp_path / "ds", lengths_for(0, 60))


# ------------------------------------------------------------------------------------ one place per name
def quoted_names(source: str, names: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, name, line text) of every string token of ``source`` that holds a quoted method name: ``"chunk"``,
    ``'multipack'`` (also inside an f-string or a docstring); comments are not strings."""
    quoted = re.compile(r"""(["'])(""" + "|".join(map(re.escape, names)) + r")\1")
    lines = source.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            found += [(tok.start[0], m.group(2), lines[tok.start[0] - 1]) for m in quoted.finditer(tok.string)]
    return found


def spelled_outside_the_registry(names: tuple[str, ...]) -> list[str]:
    files = [REPO_ROOT / p for p in PRODUCT if p.endswith(".py")]
    files += [f for p in PRODUCT if not p.endswith(".py") for f in sorted((REPO_ROOT / p).rglob("*.py"))]
    wrong = []
    for path in files:
        rel = path.relative_to(REPO_ROOT)
        if rel == REGISTRY:
            continue
        for line, name, text in quoted_names(path.read_text(encoding="utf-8"), names):
            sampler = name == "sequential" and (rel in SAMPLER_FILES or "sampler" in text)
            if not sampler:
                wrong.append(f"{rel}:{line}: {text.strip()}")
    return wrong


def test_no_method_name_is_spelled_in_product_code_outside_the_registry():
    wrong = spelled_outside_the_registry(BUILT_IN)
    assert not wrong, "packing methods named outside prep/pack/methods.py (read the registry instead):\n" + "\n".join(
        wrong)


def test_the_name_scan_finds_what_it_looks_for():
    """The scan above is not vacuous: it sees every name in the registry itself, and a planted comparison."""
    registry = {name for _, name, _ in quoted_names((REPO_ROOT / REGISTRY).read_text(), BUILT_IN)}
    assert registry == set(BUILT_IN)
    planted = 'if config.method == "multipack":  # "chunk" in a comment is not code\n    x = f"{m == \'chunk\'}"\n'
    assert [(line, name) for line, name, _ in quoted_names(planted, BUILT_IN)] == [(1, "multipack"), (2, "chunk")]


def test_the_schemas_list_the_registered_methods():
    """pack.schema.json and mix.schema.json stay JSON files; their method enums (and the entry-name pattern) are
    the registry's names, in its order."""
    pack = schema("pack")
    assert pack["properties"]["config"]["properties"]["method"]["enum"] == list(method_names())
    assert pack["properties"]["name"]["pattern"] == f"^({'|'.join(method_names())})-[0-9a-f]{{16}}$"
    mix_source = schema("mix")["properties"]["sources"]["items"]["properties"]
    assert mix_source["method"]["enum"] == list(method_names())
    assert method_names() == BUILT_IN


# ---------------------------------------------------------------------------------------- unknown names
def test_an_unknown_method_is_an_error_never_a_default():
    with pytest.raises(XprepError, match=r"--method 'reverse' is unknown: choose one of sequential, multipack"):
        PackConfig(method="reverse", seq_len=64)
    config = PackConfig(method="sequential", seq_len=64)
    config.method = "reverse"  # a config changed after its checks: the dispatch looks the name up again
    with pytest.raises(XprepError, match="'reverse' is unknown"):
        bin_items(np.ones(10, np.int32), config)
    with pytest.raises(XprepError, match="'reverse' is unknown"):  # whatever the config object (no PackConfig)
        bin_items(np.ones(10, np.int32), SimpleNamespace(method="reverse", capacity=64, seq_len=64))
    with pytest.raises(XprepError, match=r"P/x: made by packing method 'bogus', which is not registered"):
        methods_of("sequential+bogus", "P/x")
    assert [m.name for m in methods_of("sequential+multipack")] == ["sequential", "multipack"]
    assert methods_of(None) == []


def test_an_unknown_method_on_the_command_line_lists_the_registered_ones(tmp_path, ds):
    result = run("pack", ds, "-o", tmp_path / "P", "--method", "reverse", "--seq-len", 64)
    assert result.exit_code == 2 and "'reverse' is not one of 'sequential', 'multipack', 'token-aware', 'chunk'" \
        in result.output, result.output
    assert not (tmp_path / "P").exists()


def test_a_broken_entry_is_refused_when_registered():
    def bins(costs, capacity, options):
        return np.array([0, len(costs)]), None

    with pytest.raises(ValueError, match="name 'Reverse'"):
        PackingMethod("Reverse", "in reverse", bins)
    with pytest.raises(ValueError, match="sized_by 'tokens'"):
        PackingMethod("reverse", "in reverse", bins, sized_by="tokens")
    with pytest.raises(ValueError, match="bins: a function"):
        PackingMethod("reverse", "in reverse")
    with pytest.raises(ValueError, match="'multipack' is registered already"):
        register_method(PackingMethod("multipack", "again", bins))
    with pytest.raises(ValueError, match="built in"):
        unregister_method("chunk")


# --------------------------------------------------------------- a method registered from outside (the recipe)
def one_per_bin(costs: np.ndarray, capacity: int, options: dict) -> tuple[np.ndarray, None]:
    """Every item alone in its bin, in visiting order (``BinFunction``: CSR offsets, items kept in order)."""
    return np.arange(len(costs) + 1, dtype=np.int64), None


ONE_PER_BIN = PackingMethod(name="one-per-bin", help="every document alone in its bin (a toy)", bins=one_per_bin)


@pytest.fixture
def one_per_bin_method():
    """The toy method, registered for one test and removed after it, even when the test fails."""
    register_method(ONE_PER_BIN)
    yield ONE_PER_BIN
    if ONE_PER_BIN.name in method_names():
        unregister_method(ONE_PER_BIN.name)


def test_a_method_registered_from_outside_packs_and_inspects(one_per_bin_method, tmp_path, ds):
    out = tmp_path / "P"
    assert "one-per-bin: every document alone in its bin (a toy)" in " ".join(run("pack", "--help").stdout.split())
    packed = run("pack", ds, "-o", out, "--method", "one-per-bin", "--seq-len", 256)
    assert packed.exit_code == 0, packed.output
    entry = json.loads((out / "manifest.json").read_text())["current"]
    assert entry.startswith("one-per-bin-")
    meta = json.loads((out / entry / "pack.json").read_text())
    assert meta["config"]["method"] == "one-per-bin" and meta["key_fields"]["method"] == "one-per-bin"
    offsets = np.load(out / entry / "bin_offsets.npy")
    assert np.array_equal(offsets, np.arange(meta["stats"]["items"] + 1))  # one item a bin
    assert meta["stats"]["bins"] == meta["stats"]["items"] > 0
    report = json.loads(run("inspect", out, "--json").output)
    assert report["packing"] == {"name": "one-per-bin", "help": "every document alone in its bin (a toy)",
                                 "capacity_option": "--seq-len", "options": [], "fixed_length_samples": False,
                                 "bin_is_micro_batch": False}
    assert report["bins"] == meta["stats"]["bins"] and report["entries"][0]["options"].startswith(
        "--method one-per-bin --seq-len 256")
    text = run("inspect", out, "--html", tmp_path / "page.html")
    assert text.exit_code == 0 and "one-per-bin, capacity 256" in text.output, text.output
    assert "--method one-per-bin" in (tmp_path / "page.html").read_text()
    assert run("pack", ds, "-o", out, "--method", "one-per-bin", "--seq-len", 256).output.startswith("cache hit:")
    unregister_method("one-per-bin")  # the process that reads its pack no longer knows it: an error, not a guess
    line = one_line_error(run("inspect", out))
    assert "made by packing method 'one-per-bin', which is not registered" in line, line
    assert run("pack", ds, "-o", out, "--method", "sequential", "--seq-len", 256).exit_code == 0
    rows = {e["name"]: e for e in json.loads(run("inspect", out, "--json").output)["entries"]}
    assert rows[entry]["status"] == "unknown-method" and "'one-per-bin'" in rows[entry]["problem"]  # the others show


def test_a_registered_method_must_keep_the_bins_contract(tmp_path, ds):
    """A registered ``bins`` that overfills a bin is refused before anything is published."""
    def one_bin(costs, capacity, options):
        return np.array([0, len(costs)], np.int64), None

    register_method(PackingMethod("one-bin", "everything in one bin (broken)", one_bin))
    try:
        with pytest.raises(ValueError, match="'one-bin': its bins function broke its contract: a bin holds more"):
            run("pack", ds, "-o", tmp_path / "P", "--method", "one-bin", "--seq-len", 256)
    finally:
        unregister_method("one-bin")
    assert not (tmp_path / "P").exists()  # the cache directory this command created is removed again


def test_registered_entries_drive_the_built_in_behaviour():
    """What was spelled as names is now read from the entries: a spot check of each fact against its use."""
    assert packing_method("token-aware").bin_is_micro_batch and PackConfig(
        method="token-aware", max_tokens=64).capacity_option == "--max-tokens"
    assert packing_method("chunk").fixed_length_samples and PackConfig(method="chunk", seq_len=64).overlong == "split"
    assert PackConfig(method="multipack", seq_len=64).key_fields()["group_size"] == 100_000
    with pytest.raises(XprepError, match="--group-size applies only to --method multipack, not sequential"):
        PackConfig(method="sequential", seq_len=64, group_size=5)
    with pytest.raises(XprepError, match="--balance-dp applies only to --method token-aware, not chunk"):
        PackConfig(method="chunk", seq_len=64, balance_dp=2)
