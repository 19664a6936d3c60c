"""Pack caches (DESIGN §2): the pack config, cache keys, and atomic, locked publication.

``pack(datasets, output, config)`` is the whole of ``xprep pack``:

1. key = sha256 of canonical JSON over the pack format version, the options that change the
   output (``PackConfig.key_fields``) and every input dataset's fingerprint, in order;
2. if ``output/<method>-<key16>/`` is complete, it is a hit: nothing is packed;
3. otherwise, under an exclusive ``fcntl.flock`` on ``output/.<name>.lock`` (so concurrent
   identical invocations build once), the entry is built in ``output/.tmp-<name>-<pid>/``,
   ``pack.json`` with ``"complete": true`` is written last, and the directory is renamed into
   place; a killed build leaves only a temp directory, removed by the next build;
4. ``output/manifest.json`` names the entry as current (written atomically, under its own lock).

A hit reads only the datasets' manifests and memory-maps the entry, and never imports numba.
An entry that exists but does not open is reported as corrupt, never silently rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from prep.dataset import canonical_json, write_json_atomic
from prep.errors import XprepError
from prep.io import check_output_dir
from prep.packfile import MANIFEST, PACK_FORMAT, PACK_JSON, PackEntry

PACK_VERSION = 1  # bump when the same options and data would pack differently
TEST_SLEEP_ENV = "XPREP_TEST_PACK_SLEEP"  # test hook: seconds to sleep mid-build, before pack.json


# ------------------------------------------------------------------------------------------ config
METHODS = ("sequential", "multipack", "token-aware")
OVERLONG = ("drop", "truncate", "split")
# Pretraining text is usually packed in order and long documents are worth keeping (split);
# SFT conversations lose meaning when cut, so the SFT-oriented methods drop them.
DEFAULT_OVERLONG = {"sequential": "split", "multipack": "drop", "token-aware": "drop"}
DEFAULT_SHUFFLE = {"sequential": False, "multipack": False, "token-aware": True}
DEFAULT_GROUP_SIZE = 100_000
DEFAULT_DP_MICRO_BATCHES = 16  # a wider window balances micro-steps better (1.33 → 1.09 at 8 ranks)


@dataclass
class PackConfig:
    """What to pack and how; one field per ``xprep pack`` option.

    ``seq_len`` is the capacity of ``sequential``/``multipack`` bins, ``max_tokens`` the token
    budget of a ``token-aware`` micro-batch. ``None`` fields take the method's default.
    """

    method: str
    seq_len: int | None = None
    max_tokens: int | None = None
    overlong: str | None = None
    cp_size: int = 1
    group_size: int | None = None
    balance_dp: int | None = None
    dp_micro_batches: int | None = None
    shuffle: bool | None = None
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise XprepError(f"--method {self.method!r} is unknown: choose one of {', '.join(METHODS)}")
        self._check_capacity_option()
        self._check_method_options()
        if self.overlong is None:
            self.overlong = DEFAULT_OVERLONG[self.method]
        if self.overlong not in OVERLONG:
            raise XprepError(f"--overlong {self.overlong!r} is unknown: choose one of {', '.join(OVERLONG)}")
        if self.shuffle is None:
            self.shuffle = DEFAULT_SHUFFLE[self.method]
        if not 0 <= self.seed < 2**63:
            raise XprepError(f"--seed {self.seed}: use a seed in [0, 2**63)")
        self._check_cp()

    def _check_capacity_option(self) -> None:
        token_aware = self.method == "token-aware"
        wanted, other = ("--max-tokens", "--seq-len") if token_aware else ("--seq-len", "--max-tokens")
        if (self.seq_len if token_aware else self.max_tokens) is not None:
            raise XprepError(
                f"{other} does not apply to --method {self.method}: its bins are sized by {wanted}")
        value = self.capacity
        if value is None:
            raise XprepError(f"--method {self.method} needs {wanted} N (the bin capacity in tokens)")
        if value < 1:
            raise XprepError(f"{wanted} {value} must be a positive number of tokens")

    def _check_method_options(self) -> None:
        if self.method == "multipack":
            self.group_size = DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size
            if self.group_size < 1:
                raise XprepError(f"--group-size {self.group_size} must be ≥ 1 (documents per packing group)")
        elif self.group_size is not None:
            raise XprepError(f"--group-size applies only to --method multipack, not {self.method}")
        if self.balance_dp is not None and self.method != "token-aware":
            raise XprepError(f"--balance-dp applies only to --method token-aware, not {self.method}")
        if self.balance_dp is None:
            if self.dp_micro_batches is not None:
                raise XprepError("--dp-micro-batches needs --balance-dp N")
            return
        if self.balance_dp < 1:
            raise XprepError(
                f"--balance-dp {self.balance_dp} must be ≥ 1 (the number of data-parallel ranks)")
        if self.dp_micro_batches is None:
            self.dp_micro_batches = DEFAULT_DP_MICRO_BATCHES
        if self.dp_micro_batches < 1:
            raise XprepError(
                f"--dp-micro-batches {self.dp_micro_batches} must be ≥ 1 (bins per rank per step)")

    def _check_cp(self) -> None:
        if self.cp_size < 1:
            raise XprepError(f"--cp-size {self.cp_size} must be ≥ 1")
        if self.capacity % self.align:
            opt = self.capacity_option
            fix = self.capacity + self.align - self.capacity % self.align
            raise XprepError(
                f"{opt} {self.capacity} is not a multiple of 2·cp={self.align}: use {opt} {fix} "
                f"or a --cp-size that divides {opt} / 2"
            )

    @property
    def capacity(self) -> int | None:
        return self.max_tokens if self.method == "token-aware" else self.seq_len

    @property
    def capacity_option(self) -> str:
        return "--max-tokens" if self.method == "token-aware" else "--seq-len"

    @property
    def align(self) -> int:
        """Each item's cost is its length rounded up to a multiple of this (2·cp, or 1)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def key_fields(self) -> dict:
        """The options that change the output (the cache key hashes these plus the data)."""
        fields = {"method": self.method, "capacity": self.capacity, "overlong": self.overlong,
                  "cp_size": self.cp_size, "shuffle": self.shuffle,
                  "seed": self.seed if self.shuffle else None}
        if self.method == "multipack":
            fields["group_size"] = self.group_size
        if self.method == "token-aware":
            fields["balance_dp"] = self.balance_dp
            fields["dp_micro_batches"] = self.dp_micro_batches
        return fields

    def to_json(self) -> dict:
        return {**asdict(self), "capacity": self.capacity, "align": self.align}


def layout_of(config: PackConfig) -> str:
    """How the trainer must read the order of bins (recorded in pack.json)."""
    if not config.balance_dp:
        return "bins in packing order; documents inside a bin in visiting order"
    n, m = config.balance_dp, config.dp_micro_batches
    return (f"data-parallel steps, step-major then micro-batch then rank: bin b goes to rank b % {n}; "
            f"a step is {n * m} consecutive bins ({m} per rank; the last step may be shorter but is a "
            f"multiple of {n}); empty bins pad the total to a multiple of {n}")


# --------------------------------------------------------------------------------------------- keys
def read_fingerprints(paths: list[str | Path]) -> list[dict]:
    """Path and fingerprint of each dataset, from its manifest alone (cheap: no stream is read).

    Datasets packed together must share a tokenizer: their token ids end up in the same batches.
    """
    out, tokenizers = [], {}
    for p in paths:
        manifest = _read_dataset_manifest(Path(p))
        _check_lengths_unchanged(Path(p), manifest)
        out.append({"path": str(Path(p).resolve()), "fingerprint": manifest["fingerprint"]})
        tokenizers.setdefault((manifest.get("tokenizer") or {}).get("sha256"), str(p))
    if len(tokenizers) > 1:
        (_, first), (_, other) = list(tokenizers.items())[:2]
        raise XprepError(f"{first} and {other} were tokenized with different tokenizers (tokenizer.json "
                         "sha256 differs): pack datasets of one tokenizer together, or re-tokenize")
    return out


def _check_lengths_unchanged(path: Path, manifest: dict) -> None:
    """The fingerprint in the manifest stands for the data only if the streams were not edited
    since: re-hash ``tokens.idx`` (all a pack depends on; ~12 bytes a document, ~0.1 s at 10M)."""
    want = ((manifest.get("streams") or {}).get("tokens") or {}).get("idx_sha256")
    idx = path / "tokens.idx"
    digest = hashlib.sha256()
    try:
        with open(idx, "rb") as f:
            while block := f.read(16 << 20):
                digest.update(block)
    except OSError as e:
        raise XprepError(f"{idx}: cannot read ({e.strerror}); re-run `xprep tokenize`") from None
    if want != digest.hexdigest():
        raise XprepError(f"{idx}: changed since {path / 'manifest.json'} was written (its sha256 differs); "
                         "the dataset was edited in place: re-create it with `xprep tokenize`")


def _read_dataset_manifest(path: Path) -> dict:
    manifest = path / "manifest.json"
    try:
        data = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise XprepError(f"{path}: not a token dataset (no manifest.json); run `xprep tokenize` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XprepError(f"{manifest}: unreadable dataset manifest ({e}); re-create the dataset") from None
    if not isinstance(data, dict) or "fingerprint" not in data:
        raise XprepError(f"{manifest}: not a token dataset manifest (no fingerprint); re-create the dataset")
    return data


def cache_key(config: PackConfig, datasets: list[dict]) -> str:
    """sha256 of canonical JSON: pack format and version, output-changing options, fingerprints."""
    payload = {"pack_format": PACK_FORMAT, "pack_version": PACK_VERSION, **config.key_fields(),
               "datasets": [d["fingerprint"] for d in datasets]}
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def entry_name(config: PackConfig, key: str) -> str:
    return f"{config.method}-{key[:16]}"


# -------------------------------------------------------------------------------------------- pack
@dataclass
class PackOutcome:
    entry: PackEntry
    hit: bool
    seconds: float


def pack(datasets: list[str | Path], output: str | Path, config: PackConfig, force: bool = False,
         log: Callable[[str], None] | None = None, allow_empty: bool = False) -> PackOutcome:
    """Return the cache entry for these datasets and options, building it unless it exists.

    A pack of 0 bins (no documents, or all empty or dropped) is refused before anything is published,
    hit or build, unless ``allow_empty``: training on it would do nothing, silently.
    """
    t0 = time.perf_counter()
    log = log or (lambda _msg: None)
    new_root = not Path(output).exists()
    root = _prepare_root(Path(output))
    try:
        inputs = read_fingerprints(datasets)
        key = cache_key(config, inputs)
        name = entry_name(config, key)
        entry = None if force else _open_existing(root / name, key)
        hit = entry is not None
        if not hit:
            entry, hit = _build_once(root, name, key, inputs, config, force, allow_empty, log)
        check_not_empty(entry.meta["stats"], config, allow_empty)  # a hit on an entry made with --allow-empty
    except BaseException:
        if new_root:
            _remove_if_only_locks(root)
        raise
    entry = _refresh_paths(root, entry, inputs)
    _set_current(root, entry)
    return PackOutcome(entry=entry, hit=hit, seconds=time.perf_counter() - t0)


def _remove_if_only_locks(root: Path) -> None:
    """Undo a cache directory this command created and failed to fill (unless another command now uses it)."""
    with contextlib.suppress(OSError):
        children = list(root.iterdir())
        if all(p.name.startswith(".") and p.name.endswith(".lock") for p in children):
            for lock in children:
                lock.unlink()
            root.rmdir()


def _build_once(root: Path, name: str, key: str, inputs: list[dict], config: PackConfig, force: bool,
                allow_empty: bool, log: Callable[[str], None]) -> tuple[PackEntry, bool]:
    """Build under the entry's lock; whoever waited for a builder finds its entry (a hit)."""
    with _locked(root / f".{name}.lock", log, f"another `xprep pack` is building {name}: waiting"):
        entry = None if force else _open_existing(root / name, key)
        if entry is not None:
            return entry, True
        return _build(root, name, key, inputs, config, allow_empty), False


def _prepare_root(root: Path) -> Path:
    """The cache directory: created if needed, refused if it is something else or cannot be made."""
    check_output_dir(root, option="-o", allow_nonempty=True)  # a cache accumulates entries
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise XprepError(f"{manifest}: corrupt ({e}); delete it (entries are kept) and re-run") from None
        if fmt != PACK_FORMAT:
            raise XprepError(f"-o {root}: holds a {fmt!r} manifest, not a pack cache; choose another -o")
    elif root.is_dir() and any(not _ours(p) for p in root.iterdir()):
        raise XprepError(f"-o {root}: exists and is not a pack cache (no {MANIFEST}); choose another -o")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _ours(p: Path) -> bool:
    return p.name.startswith(".") or (p / PACK_JSON).is_file()


def _open_existing(path: Path, key: str) -> PackEntry | None:
    """The complete entry at ``path``, None if absent; an entry that does not open is an error."""
    if not path.exists():
        return None
    entry = PackEntry.open(path)
    if entry.meta.get("key") != key:
        raise XprepError(f"{path}: its pack.json has key {entry.meta.get('key')!r}, not {key!r}: "
                         "the entry is corrupt; re-run with --force")
    return entry


@contextmanager
def _locked(path: Path, log: Callable[[str], None], busy_message: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (released by the kernel if the process dies)."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(busy_message)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_not_empty(stats: dict, config: PackConfig, allow_empty: bool) -> None:
    """Refuse a pack of 0 bins, saying why it is empty and what to change."""
    if stats["bins"] or allow_empty:
        return
    n, empty, dropped = stats["documents_in"], stats["empty_documents"], stats["dropped_documents"]
    opt = f"{config.capacity_option} {config.capacity}"
    if n == 0:
        why, fix = "the input has no documents", "check the DATASET arguments (`xprep inspect DATASET`)"
    elif empty == n:
        why, fix = f"all {n:,} documents are empty", "re-tokenize with the right --text-field or --format"
    elif empty == 0:
        why, fix = (f"all {n:,} documents are longer than {opt} (--overlong drop)",
                    f"raise {config.capacity_option} or use --overlong split|truncate")
    else:
        why, fix = (f"{empty:,} of {n:,} documents are empty and the other {dropped:,} are longer than {opt} "
                    "(--overlong drop)", f"raise {config.capacity_option} or use --overlong split|truncate")
    raise XprepError(f"the pack would have 0 bins: {why}; {fix}, or pass --allow-empty to publish an empty pack")


# ------------------------------------------------------------------------------------------- build
def _build(root: Path, name: str, key: str, inputs: list[dict], config: PackConfig,
           allow_empty: bool = False) -> PackEntry:
    """Pack into a fresh temp directory and publish it by rename (the caller holds the lock)."""
    for stale in [*root.glob(f".tmp-{name}-*"), *root.glob(f".old-{name}-*")]:  # from killed builds
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        lengths, described = _load_lengths(inputs)
        from prep.packing import pack_lengths

        t0 = time.perf_counter()
        packed = pack_lengths(lengths, config)
        check_not_empty(packed.stats, config, allow_empty)
        meta = {"format": PACK_FORMAT, "version": PACK_VERSION, "key": key, "name": name,
                "config": config.to_json(), "key_fields": config.key_fields(), "datasets": described,
                "layout": layout_of(config), "stats": packed.stats,
                "pack_seconds": round(time.perf_counter() - t0, 3),
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "complete": True}
        _write_entry(tmp, packed, meta)
        _publish(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PackEntry.open(root / name)


def _load_lengths(inputs: list[dict]) -> tuple[np.ndarray, list[dict]]:
    """Document lengths of all datasets concatenated (the global index), and their descriptions."""
    from prep.dataset import TokenDataset

    parts, described, first = [], [], 0
    for d in inputs:
        ds = TokenDataset(d["path"])
        if ds.fingerprint != d["fingerprint"]:
            raise XprepError(f"{d['path']}: the dataset changed while `xprep pack` ran; re-run it")
        parts.append(ds.lengths)
        described.append({**d, "documents": len(ds), "tokens": int(ds.manifest["counts"]["tokens"]),
                          "first_document": first})
        first += len(ds)
    return np.concatenate(parts) if parts else np.zeros(0, np.int32), described


def _write_entry(tmp: Path, packed, meta: dict) -> None:
    """Arrays first, then (after the test hook's pause) pack.json: the completion marker."""
    PackEntry(path=tmp, meta=meta, bin_offsets=packed.bin_offsets, item_doc=packed.item_doc,
              item_start=packed.item_start, item_len=packed.item_len).write_arrays(tmp)
    if os.environ.get(TEST_SLEEP_ENV):
        time.sleep(float(os.environ[TEST_SLEEP_ENV]))
    _write_json_durable(tmp / PACK_JSON, meta)
    _fsync_tree(tmp)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place, moving a forced-out old entry aside first."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


def _write_json_durable(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- manifest
def _refresh_paths(root: Path, entry: PackEntry, inputs: list[dict]) -> PackEntry:
    """Same data found at other paths (moved or copied): point the entry at the paths given now."""
    if [d["path"] for d in entry.meta["datasets"]] == [d["path"] for d in inputs]:
        return entry
    with _locked(root / f".{entry.path.name}.lock", lambda _m: None, ""):
        meta = dict(entry.meta)
        meta["datasets"] = [{**old, "path": new["path"]} for old, new in
                            zip(entry.meta["datasets"], inputs, strict=True)]
        _write_json_durable(entry.path / PACK_JSON, meta)
    return PackEntry.open(entry.path)


def _set_current(root: Path, entry: PackEntry) -> None:
    """Record the entry in ``manifest.json`` and make it the current one (atomic, locked)."""
    with _locked(root / ".manifest.lock", lambda _m: None, ""):
        path = root / MANIFEST
        manifest = {"format": PACK_FORMAT, "current": None, "entries": {}}
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise XprepError(f"{path}: corrupt ({e}); delete it (entries are kept) and re-run") from None
        stats = entry.meta["stats"]
        manifest["entries"][entry.path.name] = {
            "key": entry.key, "method": entry.config["method"], "capacity": entry.capacity,
            "datasets": [d["path"] for d in entry.meta["datasets"]], "bins": stats["bins"],
            "documents": stats["documents_in"], "created": entry.meta["created"]}
        manifest["current"] = entry.path.name
        write_json_atomic(path, manifest)
