"""prep.io.check_output_dir: every way an output path can be unusable is one clear XprepError, up front."""

from __future__ import annotations

import pytest

from prep.errors import XprepError
from prep.io import check_output_dir


def test_usable_paths_pass(tmp_path):
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert check_output_dir(tmp_path / "full", allow_nonempty=True) == tmp_path / "full"
    assert not [p for p in tmp_path.rglob(".xprep-probe-*")]


@pytest.mark.parametrize(
    ("make", "target", "needle"),
    [
        (lambda d: (d / "afile").write_text(""), "afile", "exists and is a file"),
        (lambda d: (d / "afile").write_text(""), "afile/sub", "is a file, not a directory"),
        (lambda d: ((d / "full").mkdir(), (d / "full" / "x").write_text("x")), "full", "not empty"),
    ],
)
def test_unusable_paths_name_the_problem(tmp_path, make, target, needle):
    make(tmp_path)
    with pytest.raises(XprepError, match=needle) as e:
        check_output_dir(tmp_path / target)
    assert str(tmp_path / target) in str(e.value)


def test_unwritable_location(tmp_path):
    with pytest.raises(XprepError, match="cannot write in /proc"):
        check_output_dir("/proc/forbidden")
