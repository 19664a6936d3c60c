"""File systems for paths and URLs: local paths stay plain paths (``file://`` URLs become one), anything else with a
scheme (``s3://``, ``gs://``) goes through fsspec, whose file systems take their credentials from their usual
environment (AWS_* variables and profiles for s3fs, application-default credentials for gcsfs).

Inputs are streamed: ``open_binary`` returns a seekable file that fetches ranges as they are read. Datasets at URLs
(upload, sync into a local cache) are ``prep/dataset/remote.py``'s.

Where xprep keeps what it derives once and reuses (``cache_root``): converted tokenizers and facts about tokenizers
(prep/tokenizer/), and local copies of datasets at URLs (prep/dataset/remote.py, under ``datasets/``). One setting:
``--cache-dir`` on the commands that use it, else ``$XPREP_CACHE_DIR``, else ``$XDG_CACHE_HOME/xprep``, else
``~/.cache/xprep``.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from xprep.prep.errors import XprepError

CACHE_ENV = "XPREP_CACHE_DIR"  # the cache directory when no --cache-dir is given


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a non-local file system (``s3://…``); ``file://`` is local."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str) -> str:
    """``file:///a/b`` → ``/a/b``; anything else unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def filesystem(url: str):
    """(fsspec file system, path inside it) for ``url``; a missing fsspec implementation is one clear error."""
    import fsspec  # deferred: only URLs need it

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        scheme = url.split("://", 1)[0]
        extra = {"s3": "'xprep[s3]'", "gs": "'xprep[gcs]'", "gcs": "'xprep[gcs]'", "az": "adlfs", "abfs": "adlfs"}
        hint = f" (pip install {extra[scheme]})" if scheme in extra else ""
        raise XprepError(f"{url}: no file system for {scheme}:// is installed{hint}: {e}") from None
    except ValueError as e:
        raise XprepError(f"{url}: not a URL fsspec understands ({e})") from None


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def url_of(fs, path: str) -> str:
    """The URL of a path returned by ``fs`` (globs and listings drop the scheme)."""
    return fs.unstrip_protocol(path)


def open_binary(path: str, block_size: int = 8 << 20):
    """A binary file for reading: local, or streamed from a URL in ``block_size`` ranges (seekable)."""
    if not is_url(path):
        return open(local_path(path), "rb")
    fs, inner = filesystem(path)
    return fs.open(inner, "rb", block_size=block_size)


def mtime_ns(info: dict) -> int:
    """A listing entry's modification time in ns (0 when the file system gives none): what the manifest records."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=dt.timezone.utc)
            return int(value.timestamp() * 1e9)
        return int(float(value) * 1e9)
    return 0


def exists(url: str) -> bool:
    fs, inner = filesystem(url)
    return fs.exists(inner)


def cache_root(cache_dir: str | os.PathLike | None = None, fallback: str | None = None) -> Path:
    """The cache directory: ``cache_dir`` (``--cache-dir``), else ``$XPREP_CACHE_DIR``, else ``fallback`` (the value
    of an older variable a caller still honours), else ``$XDG_CACHE_HOME/xprep``, else ``~/.cache/xprep``.

    Resolved where it is used (a worker or another node resolves its own default); an explicit ``cache_dir`` is
    absolute after ``absolute_cache_dir``."""
    for value in (cache_dir, os.environ.get(CACHE_ENV), fallback):
        if value:
            return Path(os.path.expanduser(value))
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xprep"


def absolute_cache_dir(cache_dir: str | os.PathLike | None) -> str | None:
    """``--cache-dir`` as an absolute path (workers may run elsewhere), or None for the default (``cache_root``)."""
    return str(Path(os.path.expanduser(cache_dir)).absolute()) if cache_dir else None
