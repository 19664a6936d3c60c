"""``xprep inspect`` of token datasets and pack caches at URLs (``s3://``, ``gs://``, any fsspec URL), where they are.

What a URL holds is told from its listing and manifest (``url_kind``); a run directory there is refused (copy it).
A dataset is opened as the streaming reads open it (``open_url_parts``: its manifests and ``.idx`` files fetched once
into the cache directory, checked against their digests), so its report reads no token byte; ``--sample`` reads
its documents by range (``RemoteStream.__getitem__``) and fetches the tokenizer kept inside it (``fetch_tokenizer``).
A pack's entry files are fetched as ``xtrain run`` fetches them (``fetch_pack``: no token data). Every read goes
through a ``Retry``: transient errors are retried, a missing object or a refused access is one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath

from xprep.prep.dataset import Retry, ShardedDataset, StreamedDataset, is_sharded, open_url_parts
from xprep.prep.errors import XprepError
from xprep.prep.formats import BLEND_JSON, DATASET_FORMAT, MANIFEST, PACK_FORMAT, PACK_JSON, SHARDED_FORMAT
from xprep.prep.fs import cache_root, filesystem
from xprep.prep.io import file_sha256, write_atomic

RUN_FILES = ("metrics.jsonl", "config.json")  # what marks a run directory (options.kind_of reads the same)


def url_kind(url: str, retry: Retry | None = None) -> str:
    """What the directory at ``url`` is: "dataset" or "packed"; a run directory, a file, or anything else is an
    XprepError (a missing URL or a refused access one too, in ``Retry``'s words)."""
    retry = retry or Retry()
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    listing = retry.run(url, lambda: fs.ls(inner, detail=True, refresh=True))
    if len(listing) == 1 and listing[0]["name"].rstrip("/") == inner and listing[0].get("type") != "directory":
        raise XprepError(f"{url}: a file, not a directory; give the directory of a token dataset or a pack cache")
    names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listing}
    fmt = _manifest_format(fs, inner, url, retry) if MANIFEST in names else None
    if fmt in (DATASET_FORMAT, SHARDED_FORMAT):
        return "dataset"
    if fmt == PACK_FORMAT or PACK_JSON in names or BLEND_JSON in names:
        return "packed"
    if any(name in names for name in RUN_FILES):
        raise XprepError(f"{url}: a run directory at a URL is not supported (the run report reads its checkpoints "
                         "and metrics as local files); copy it to a local directory and inspect that")
    raise XprepError(f"{url}: neither a token dataset, a pack cache nor a run directory")


def _manifest_format(fs, inner: str, url: str, retry: Retry) -> str | None:
    text = retry.run(f"{url}/{MANIFEST}", lambda: fs.cat_file(f"{inner}/{MANIFEST}"))
    try:
        data = json.loads(text)
    except ValueError as e:
        raise XprepError(f"{url}/{MANIFEST}: unreadable ({e}); the directory is corrupt: re-upload it") from None
    if not isinstance(data, dict):
        raise XprepError(f"{url}/{MANIFEST}: not a JSON object; the directory is corrupt: re-upload it")
    return data.get("format")


def url_join(url: str, name: str) -> str:
    """The URL of ``name`` (a relative path, ``..`` allowed) inside the directory at ``url``."""
    scheme, _, rest = url.rstrip("/").partition("://")
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, name))}"


# ------------------------------------------------------------------------------------------ datasets
def open_url_dataset(url: str, cache_dir: str | None = None, retry: Retry | None = None
                     ) -> StreamedDataset | ShardedDataset:
    """The dataset at ``url``, plain or sharded, documents by their global index either way (as ``open_dataset``
    opens a local one); what is fetched (manifests, indexes) goes into ``cache_dir``."""
    manifest, parts = open_url_parts(url, cache_dir, retry or Retry())
    return ShardedDataset(url.rstrip("/"), manifest, parts) if is_sharded(manifest) else parts[0]


def tokenizer_location(url: str, manifest: dict) -> str:
    """Where the tokenizer recorded in the manifest of the dataset at ``url`` is: one kept inside the dataset
    (a relative path) at its URL, one named where it lay (an absolute path) on that machine."""
    path = (manifest.get("tokenizer") or {}).get("path") or ""
    return path if not path or os.path.isabs(path) else url_join(url, path)


def fetch_tokenizer(ds, cache_dir: str | None = None, retry: Retry | None = None) -> str:
    """The local path of the tokenizer.json the dataset ``ds`` at a URL was made with, checked against the sha256
    its manifest records (as ``dataset_tokenizer`` checks a local dataset's). One kept inside the dataset is
    fetched (that file alone) into CACHE/datasets/FINGERPRINT/, once; one named by an absolute path must be on
    this machine.

    A sharded dataset names the tokenizer kept in its first shard relative to itself, which an upload does not
    rewrite when it renames that shard (one that lay outside it, ``../x``, goes to ``shard-00000``): where that
    name finds nothing, the first shard's own manifest says where (shards share their tokenizer)."""
    try:
        return _fetch_tokenizer(ds, cache_dir, retry)
    except XprepError as e:
        if not getattr(ds, "shards", None):
            raise
        first = e
    try:
        return _fetch_tokenizer(ds.shards[0], cache_dir, retry)
    except XprepError:
        raise first from None


def _fetch_tokenizer(ds, cache_dir: str | None, retry: Retry | None) -> str:
    info, recorded = ds.manifest.get("tokenizer") or {}, f"{ds.path}/{MANIFEST}"
    where = tokenizer_location(ds.path, ds.manifest)
    if not where:
        raise XprepError(f"{recorded}: names no tokenizer (tokenizer.path); re-create the dataset")
    if os.path.isabs(where):
        return _local_tokenizer(where, info, recorded)
    name = ds.path.rsplit("/", 1)[-1]
    target = cache_root(cache_dir) / "datasets" / ds.manifest["fingerprint"] / f"{name}.tokenizer.json"
    if target.is_file() and _sha256(target.read_bytes()) == info.get("sha256"):
        return str(target)
    fs, inner = filesystem(where)
    data = (retry or Retry()).run(where, lambda: fs.cat_file(inner))
    if info.get("sha256") and _sha256(data) != info["sha256"]:
        raise XprepError(f"{where} is not the tokenizer {ds.path} was made with (its sha256 differs from the one in "
                         f"{recorded}); restore that tokenizer.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, data, durable=False)  # (a lost copy is fetched again)
    return str(target)


def _local_tokenizer(path: str, info: dict, recorded: str) -> str:
    if not os.path.isfile(path):
        raise XprepError(f"the tokenizer {path} recorded in {recorded} is not on this machine; put that "
                         "tokenizer.json at that path")
    if info.get("sha256") and file_sha256(path, "restore it") != info["sha256"]:
        raise XprepError(f"{path} is not the tokenizer {recorded} records (its sha256 differs); restore that "
                         "tokenizer.json")
    return path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------ packs
def moved_to(report: dict, local: str, url: str) -> dict:
    """``report`` of a pack fetched from ``url`` into ``local``, its paths (and its sources', for a blend) named
    at the URL again."""
    path = report["path"]
    if path == local or path.startswith(local + os.sep):
        report["path"] = url + path[len(local):].replace(os.sep, "/")
    for source in report.get("source_reports") or []:
        moved_to(source, local, url)
    return report
