"""File-system plumbing shared by every command: checking an output path before any work starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prep.errors import XprepError


def check_output_dir(path: str | Path, *, option: str = "-o", allow_nonempty: bool = False) -> Path:
    """Fail early, with one message naming the path and the problem, unless a directory can be made at ``path``.

    Checked before any work so a long run never ends in a traceback at publish time: ``path`` must not be a
    file, must be empty unless ``allow_nonempty``, and the nearest existing ancestor must be a directory in
    which this process can really create one (probed with a throw-away directory: permission bits alone do
    not tell, e.g. root in /proc).
    """
    out = Path(path)
    shown = f"{option} {path}"
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise XprepError(f"{shown}: exists and is a file, not a directory; remove it or choose another {option}")
    if out.is_dir():
        if not allow_nonempty and any(out.iterdir()):
            raise XprepError(f"{shown}: already exists and is not empty; remove it or choose another {option}")
        _probe(out, shown, option)
        return out
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise XprepError(f"{shown}: cannot create it, {ancestor} is a file, not a directory; choose another {option}")
    _probe(ancestor, shown, option)
    return out


def _probe(directory: Path, shown: str, option: str) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".xprep-probe-", dir=directory))
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise XprepError(f"{shown}: cannot write in {directory} ({reason}); choose another {option}") from None
