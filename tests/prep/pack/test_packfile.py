"""Pack entries are checked where they are opened (issue 31): a damaged entry is refused by ``xprep inspect`` and
``xtrain run`` with one line naming the entry, the check and the first bad bin or item, and ``xprep pack`` with the
same options builds it again instead of taking it for a hit."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from prepkit import one_line_error
from trainkit import make_dataset, user_error
from xprep import cli
from xprep.prep.pack.entry import DamagedEntry, check_arrays, check_items, open_packed

PACK = ["--method", "sequential", "--seq-len", "64", "--overlong", "split"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    """A token dataset (40 documents of 4..100 tokens) and its pack cache, made by ``xprep pack``."""
    root = tmp_path_factory.mktemp("packfile")
    rng = np.random.default_rng(0)
    make_dataset(root / "ds", [rng.integers(2, 128, n) for n in rng.integers(4, 100, 40)], vocab_size=128)
    result = CliRunner().invoke(cli.xprep, ["pack", str(root / "ds"), "-o", str(root / "p"), *PACK])
    assert result.exit_code == 0, result.output
    return root / "ds", root / "p"


def _edit(entry: Path, name: str, change) -> None:
    """Replace array ``name`` of the entry by ``change`` of it; remove it where that is None."""
    a = change(np.load(entry / f"{name}.npy").copy())
    if a is None:
        (entry / f"{name}.npy").unlink()
    else:
        np.save(entry / f"{name}.npy", a)


def _swap_offsets(a):
    a[3], a[4] = a[4], a[3]  # non-monotonic: what `xprep inspect` showed as a fill of 118.6 %
    return a


def _set(index: int, value: int):
    def change(a):
        a[index] = value
        return a
    return change


# (array, change, what the one line must say)
DAMAGES = {
    "offsets-decrease": ("bin_offsets", _swap_offsets, "bin_offsets decrease at bin 3"),
    "offsets-end": ("bin_offsets", _set(-1, 10**6), "bin_offsets ends at 1,000,000"),
    "negative-start": ("item_start", _set(5, -7), "item 5 (bin "),
    "beyond-document": ("item_len", _set(6, 5000), "item 6 (bin "),
    "document-outside": ("item_doc", _set(7, 40), "item 7 (bin "),
    "empty-item": ("item_len", _set(8, 0), "item 8 (bin "),
    "targets-short": ("bin_targets", lambda a: a[:-1], "bin_targets.npy holds"),
    "float-array": ("item_len", lambda a: a.astype(np.float32), "item_len.npy holds float32"),
    "missing-array": ("item_start", lambda a: None, "item_start.npy is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_refused_by_inspect_and_xtrain_and_rebuilt_by_pack(packed, tmp_path, damage):
    ds, original = packed
    name, change, said = DAMAGES[damage]
    copy = tmp_path / "p"
    shutil.copytree(original, copy)
    entry = open_packed(copy).path
    whole = {n: np.load(entry / f"{n}.npy") for n in ("bin_offsets", "item_doc", "item_start", "item_len")}
    _edit(entry, name, change)

    line = one_line_error(CliRunner().invoke(cli.xprep, ["inspect", str(copy)]))
    assert f"{entry}: damaged pack entry: " in line and said in line and "xprep pack" in line, line
    line = user_error(str(copy), "--steps", "1", "-o", str(tmp_path / "run"))
    assert f"{entry}: damaged pack entry: " in line and said in line, line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())

    again = CliRunner().invoke(cli.xprep, ["pack", str(ds), "-o", str(copy), *PACK])
    assert again.exit_code == 0, again.output
    assert f"{entry}: damaged pack entry (" in again.stderr and "building it again" in again.stderr, again.stderr
    assert "cache hit" not in again.output
    for n, a in whole.items():  # the same entry as before the damage
        assert np.array_equal(np.load(entry / f"{n}.npy"), a), n
    assert CliRunner().invoke(cli.xprep, ["inspect", str(copy)]).exit_code == 0
    hit = CliRunner().invoke(cli.xprep, ["pack", str(ds), "-o", str(copy), *PACK])
    assert hit.exit_code == 0 and "damaged" not in hit.stderr, hit.output


def test_the_checks_against_a_slow_obvious_reference():
    """``check_arrays``/``check_items`` name the first bad item of any block (blocks of 4 here) as a loop does."""
    import xprep.prep.pack.entry as packfile

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 20, 30)
    for trial in range(200):
        n = int(rng.integers(1, 40))
        doc = rng.integers(0, 32 if trial % 3 == 0 else 30, n)
        start = rng.integers(-1 if trial % 5 == 0 else 0, 10, n)
        length = rng.integers(0 if trial % 7 == 0 else 1, 12, n)
        offsets = np.concatenate([[0], np.sort(rng.integers(0, n + 1, int(rng.integers(0, 8)))), [n]])
        expected = None
        for i in range(n):
            if length[i] < 1 or start[i] < 0 or doc[i] < 0:
                expected = ("arrays", i)
                break
        if expected is None:
            for i in range(n):
                if doc[i] >= len(lengths) or start[i] + length[i] > lengths[doc[i]]:
                    expected = ("items", i)
                    break
        arrays = {"bin_offsets": offsets, "item_doc": doc, "item_start": start, "item_len": length}
        found = None
        old = packfile.CHECK_BLOCK
        packfile.CHECK_BLOCK = 4
        try:
            try:
                check_arrays(Path("e"), arrays)
                check_items(Path("e"), offsets, doc, start, length, lengths)
            except DamagedEntry as e:
                found = e.problem
        finally:
            packfile.CHECK_BLOCK = old
        if expected is None:
            assert found is None, found
        else:
            assert found is not None and found.startswith(f"item {expected[1]:,} (bin "), (expected, found)
