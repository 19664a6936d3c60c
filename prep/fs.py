"""File systems for paths and URLs: local paths stay plain paths (``file://`` URLs become one), anything else with a
scheme (``s3://``, ``gs://``) goes through fsspec, whose file systems take their credentials from their usual
environment (AWS_* variables and profiles for s3fs, application-default credentials for gcsfs).

Inputs are streamed: ``open_binary`` returns a seekable file that fetches ranges as they are read. Datasets at URLs
(upload, sync into a local cache) are ``prep/dataset/remote.py``'s.
"""

from __future__ import annotations

import datetime as dt
import os

from xprep.prep.errors import XprepError


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
