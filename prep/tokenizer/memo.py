"""Facts about tokenizers computed once and memoized as small JSON files, keyed by content: a tokenizer's vocabulary
size and special-token ids, the fast encoder's self-check verdict, its clean cuts, its spelling rule.

They live in the cache directory (``prep.fs.cache_root``: ``--cache-dir``, else ``$XPREP_CACHE_DIR``, else
``~/.cache/xprep``), which every caller passes down as ``cache_dir`` (None: the default, resolved in the process that
reads it). An entry's name holds every input and a version, so an entry is never stale, only unusable.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from xprep.prep.fs import CACHE_ENV, cache_root
from xprep.prep.io import write_json_atomic

# Cache directories already said to be unwritable: said once a process, not once per fact (a run asks for several)
_UNWRITABLE: set[Path] = set()


def cached(cache_dir: str | None, name: str, compute: Callable[[], object], valid: Callable[[object], bool]):
    """Memoize a JSON-able result in ``cache_root(cache_dir)/name``; ``name`` must hold every input and a version.

    An entry that cannot be read, is not JSON, or is not what ``valid`` expects is said on stderr (one
    line naming the file), then recomputed and rewritten, never used. A cache directory that cannot be
    written just recomputes each time (said once).
    """
    path = cache_root(cache_dir) / name
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        pass
    except OSError as e:
        _warn_unusable(path, f"cannot read it: {e.strerror}")
    except ValueError as e:  # not UTF-8, not JSON
        _warn_unusable(path, f"not valid JSON: {e}")
    else:
        if valid(value):
            return value
        _warn_unusable(path, "not the shape this version of xprep writes")
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, value)
    except OSError as e:
        if path.parent not in _UNWRITABLE:
            _UNWRITABLE.add(path.parent)
            print(f"xprep: note: cannot write the cache in {path.parent} ({e.strerror}): tokenizer facts are "
                  f"recomputed every run; pass --cache-dir DIR (or set {CACHE_ENV}) to a writable directory",
                  file=sys.stderr)
    return value


def _warn_unusable(path: Path, problem: str) -> None:
    print(f"xprep: warning: {path}: unusable cache entry ({problem}); recomputing it", file=sys.stderr)


def is_verdict(value) -> bool:
    """Whether a cached value has the shape of a check's verdict: [ok, reason]."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool) and isinstance(value[1], str)
