"""``xprep pack``: cache keys, and the entries found or built (described by schemas/pack.schema.json).

``pack(datasets, output, config)`` is the whole of ``xprep pack``:

1. key = sha256 of canonical JSON over the pack format version, the options that change the
   output (``PackConfig.key_fields``) and every input dataset's fingerprint, in order;
2. if ``output/<method>-<key16>/`` is complete, it is a hit: nothing is packed;
3. otherwise, under an exclusive ``fcntl.flock`` on ``output/.<name>.lock`` (so concurrent
   identical invocations build once), the entry is built in ``output/.tmp-<name>-<pid>/``,
   ``pack.json`` with ``"complete": true`` is written last, and the directory is renamed into
   place; a killed build leaves only a temp directory, removed by the next build;
4. ``output/manifest.json`` names the entry as current (written atomically, under its own lock).

With ``--split TRAIN,VALID[,TEST]`` the documents are divided first (``split_parts``, a rule on each document's
dataset content and index alone) and each part is its own entry, keyed with the split (the validation and test
parts also with their ``"part"``); the manifest's ``"validation"`` and ``"test"`` name those entries of the
current one. The held-out entries are built first, so an empty one publishes nothing.

A hit reads only the datasets' manifests (and re-hashes their token indexes) and memory-maps the
entry. An entry that exists but does not open is reported as corrupt, never silently rebuilt. The locks,
temporary directories, renames and manifest.json that steps 3 and 4 use are ``xprep.prep.pack.publish``'s;
a blend's sources are read by ``xprep.prep.pack.mixfile`` and ordered by ``xprep.prep.pack.mixture``.
``PackConfig`` is defined in ``xprep.prep.pack.config`` (the packing pipeline takes it too);
``from xprep.prep.pack.cache import PackConfig`` keeps working.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from xprep.prep.dataset import (
    Retry,
    TokenDataset,
    canonical_json,
    open_url_parts,
    read_complete_manifest,
    read_manifest,
    stream_chunks,
    synced_from,
    verify_parts,
)
from xprep.prep.errors import XprepError, machine_errors
from xprep.prep.formats import BLEND_JSON, PACK_FORMAT, PACK_JSON, TOKENS_STREAM
from xprep.prep.fs import is_url
from xprep.prep.io import fsync_tree, write_json_atomic
from xprep.prep.pack.config import PackConfig, split_counts
from xprep.prep.pack.entry import DamagedEntry, PackEntry, open_fingerprinted, open_listed
from xprep.prep.pack.kernels import Packed, Targets, item_targets, pack_lengths, sample_targets
from xprep.prep.pack.methods import packing_methods
from xprep.prep.pack.mixfile import check_blend_config, read_phases, read_sources, shares, source_configs
from xprep.prep.pack.mixture import (
    BlendEntry,
    PhasePlan,
    blend_key,
    blend_name,
    blend_total,
    blend_unit,
    blend_units,
    build_blend,
    phase_plan,
)
from xprep.prep.pack.publish import (
    TEST,
    VALIDATION,
    building,
    locked,
    prepare_root,
    publish,
    refresh_paths,
    remove_if_only_locks,
    set_current,
)
from xprep.prep.pack.reader import doc_lengths
from xprep.prep.pack.shuffle import held_out, split_draws

PACK_VERSION = 2  # bump when the same options and data would pack differently (2: items with no target dropped)
TRAIN = "train"  # the parts of a --split pack (VALIDATION, TEST: the others, named as in manifest.json)
SPLIT_RULE = ("document d of dataset D is held out for validation when u(D, d) < VALID/(TRAIN+VALID), u = splitmix64 "
              "of (the first 8 bytes of sha256(D's fingerprint), d) as a fraction of 2**64: it depends on the "
              "dataset content and d alone")
SPLIT_RULE_3 = ("of the n documents of dataset D, Megatron-LM's counts for TRAIN,VALID,TEST (get_split_indices) go "
                "to each part: the VALID count with the smallest u(D, d) to validation, the TEST count with the next "
                "ones to test, the rest to training (ties by d); u = splitmix64 of (the first 8 bytes of sha256(D's "
                "fingerprint), d) as a fraction of 2**64: it depends on the dataset content alone")


def layout_of(config: PackConfig) -> str:
    """How the trainer must read the order of bins (recorded in pack.json)."""
    if not config.balance_dp:
        return "bins in packing order; documents inside a bin in visiting order"
    n, m = config.balance_dp, config.dp_micro_batches
    return (f"data-parallel steps, step-major then micro-batch then rank: bin b goes to rank b % {n}; "
            f"a step is {n * m} consecutive bins ({m} per rank; the last step may be shorter but is a "
            f"multiple of {n}); empty bins pad the total to a multiple of {n}")


# --------------------------------------------------------------------------------------------- keys


def read_fingerprints(paths: list[str | Path], cache_dir: str | None = None) -> list[dict]:
    """Path and fingerprint of each dataset, from its manifest (cheap: of the streams, only the token index is read).

    Datasets packed together must share a tokenizer: their token ids end up in the same batches. A dataset at a URL
    has its manifest and indexes fetched into ``cache_dir`` (``--cache-dir``; None: ``prep.fs.cache_root``'s).
    """
    out, tokenizers = [], {}
    for p in paths:
        if is_url(str(p)):  # read in place: its manifest and indexes fetched (and checked against their digests)
            manifest, _ = open_url_parts(str(p), cache_dir)  # (a sharded one's: each shard's)
            out.append({"path": str(p), "fingerprint": manifest["fingerprint"]})
            tokenizers.setdefault((manifest.get("tokenizer") or {}).get("sha256"), str(p))
            continue
        manifest = read_manifest(p)
        # The fingerprint stands for the data only if the streams were not edited since: re-hash the
        # token index (all a pack depends on; ~12 bytes a document, ~0.1 s at 10M documents).
        verify_parts(p, manifest, "idx", [TOKENS_STREAM])  # (a sharded dataset's: each shard's)
        described = {"path": str(Path(p).resolve()), "fingerprint": manifest["fingerprint"]}
        url = synced_from(p)  # a copy of a dataset at a URL: where a machine without the copy syncs it from
        out.append({**described, "url": url} if url else described)
        tokenizers.setdefault((manifest.get("tokenizer") or {}).get("sha256"), str(p))
    if len(tokenizers) > 1:
        (_, first), (_, other) = list(tokenizers.items())[:2]
        raise XprepError(f"{first} and {other} were tokenized with different tokenizers (tokenizer.json "
                         "sha256 differs): pack datasets of one tokenizer together, or re-tokenize")
    return out


def cache_key(config: PackConfig, datasets: list[dict], part: str | None = None) -> str:
    """sha256 of canonical JSON: pack format and version, output-changing options, fingerprints (and the
    ``--split`` part, for the validation and test ones)."""
    payload = {"pack_format": PACK_FORMAT, "pack_version": PACK_VERSION, **config.key_fields(),
               "datasets": [d["fingerprint"] for d in datasets]}
    if part in (VALIDATION, TEST):
        payload["part"] = part
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def entry_name(config: PackConfig, key: str) -> str:
    return f"{config.method}-{key[:16]}"


# -------------------------------------------------------------------------------------------- pack


@dataclass
class PackOutcome:
    entry: PackEntry | BlendEntry
    hit: bool
    seconds: float
    sources: list[PackOutcome] | None = None  # a blend's: each source's own entry, found or built
    validation: PackEntry | None = None  # the --split validation entry
    test: PackEntry | None = None  # the --split test entry (a third share)


def pack(datasets: list[str | Path], output: str | Path, config: PackConfig, force: bool = False,
         log: Callable[[str], None] | None = None, allow_empty: bool = False, weights: list[float] | None = None,
         mix: str | None = None, make_current: bool = True, source_options: list[dict] | None = None,
         cache_dir: str | None = None) -> PackOutcome:
    """Return the cache entry for these datasets and options, building it unless it exists.

    A pack of 0 bins (no documents, or all empty or dropped) is refused before anything is published,
    hit or build, unless ``allow_empty``: training on it would do nothing, silently. ``make_current``:
    record it as PACKED/manifest.json's current entry (a blend's sources are not: only the blend is).
    ``source_options``: each ``DATASET@WEIGHT:key=value`` argument's options (a blend's ``method``/``overlong``).
    ``cache_dir`` (``--cache-dir``): where the indexes of datasets at URLs are fetched (None: ``prep.fs.cache_root``);
    a blend's datasets at URLs are read in place too (``read_sources``).
    A full disk (a permission, a read-only filesystem) is the one-line error naming ``-o``; the entry being built
    is removed, and nothing is published.
    """
    with machine_errors(str(output), "-o"):
        return _pack(datasets, output, config, force, log, allow_empty, weights, mix, make_current, source_options,
                     cache_dir)


def _pack(datasets: list[str | Path], output: str | Path, config: PackConfig, force: bool,
          log: Callable[[str], None] | None, allow_empty: bool, weights: list[float] | None, mix: str | None,
          make_current: bool, source_options: list[dict] | None,
          cache_dir: str | None = None) -> PackOutcome:
    t0 = time.perf_counter()
    log = log or (lambda _msg: None)
    if weights is not None or mix is not None:
        return _pack_blend(datasets, output, config, force, log, weights, mix, allow_empty, source_options, cache_dir)
    new_root = not Path(output).exists()
    root = prepare_root(Path(output))
    try:
        inputs = read_fingerprints(datasets, cache_dir)
        check_sizing(config)
        split = split_names(config, inputs)
        check_split_counts(config, inputs, allow_empty)
        held = {part: _entry(root, inputs, config.for_validation(), force, allow_empty, log, split, part, cache_dir)[0]
                for part in held_out_parts(config)}
        entry, hit = _entry(root, inputs, config, force, allow_empty, log, split, TRAIN, cache_dir)
    except BaseException:
        if new_root:
            remove_if_only_locks(root)
        raise
    entry = refresh_paths(root, entry, inputs)
    held = {part: refresh_paths(root, e, inputs) for part, e in held.items()}
    if make_current:
        set_current(root, entry, held.get(VALIDATION), held.get(TEST))
    return PackOutcome(entry=entry, hit=hit, seconds=time.perf_counter() - t0, validation=held.get(VALIDATION),
                       test=held.get(TEST))


def _entry(root: Path, inputs: list[dict], config: PackConfig, force: bool, allow_empty: bool,
           log: Callable[[str], None], split: dict | None, part: str, cache_dir: str | None = None
           ) -> tuple[PackEntry, bool]:
    """The entry of one part (the whole pack without --split): found, or built under its lock."""
    key = cache_key(config, inputs, part if split else None)
    name = entry_name(config, key)
    entry = None if force else _open_existing(root / name, key, inputs, log, cache_dir)
    hit = entry is not None
    if not hit:
        entry, hit = _build_once(root, name, key, inputs, config, force, allow_empty, log,
                                 split and {**split, "part": part}, cache_dir)
    check_not_empty(entry.meta["stats"], config, allow_empty, part if split else None)  # an --allow-empty hit
    return entry, hit


def check_sizing(config: PackConfig) -> None:
    """--total-tokens / --epochs size a pack of fixed-length samples (chunk) or a blend (which never reaches
    here), nothing else."""
    if config.spec.fixed_length_samples:
        return
    option = f"--total-tokens {config.total_tokens}" if config.total_tokens is not None else (
        f"--epochs {config.epochs:g}" if config.epochs is not None else None)
    if option:
        sized = " or ".join(f"--method {m.name}" for m in packing_methods() if m.fixed_length_samples)
        raise XprepError(f"{option} sizes a {sized} pack or a blend (DATASET@WEIGHT, --mix), not a "
                         f"--method {config.method} pack of every document once: leave it out")


# ------------------------------------------------------------------------------------------- split


def held_out_parts(config: PackConfig) -> list[str]:
    """The parts of a --split pack besides training, each its own entry: those with a share (none without)."""
    shares = config.split or ()
    return [part for part, share in zip((VALIDATION, TEST), shares[1:], strict=False) if share]


def split_names(config: PackConfig, inputs: list[dict]) -> dict | None:
    """What pack.json records of a --split pack: the shares, the rule and every part's entry name."""
    if config.split is None:
        return None
    names = {TRAIN: entry_name(config, cache_key(config, inputs))}
    for part in held_out_parts(config):
        names[part] = entry_name(config, cache_key(config.for_validation(), inputs, part))
    train, valid, *test = config.split
    described = {"train": train, "valid": valid, **({"test": test[0]} if test else {})}
    return {**described, "rule": SPLIT_RULE_3 if test else SPLIT_RULE, "entries": names}


def check_split_counts(config: PackConfig, inputs: list[dict], allow_empty: bool) -> None:
    """Refuse a three-share --split whose validation or test share rounds to no document of any dataset, before
    any part is built (so that nothing is published), unless ``allow_empty``. (A dataset at a URL: its manifest
    alone read there; ``read_fingerprints`` opened and checked the dataset already.)"""
    if config.split is None or len(config.split) != 3 or allow_empty:
        return
    manifests = [read_complete_manifest(d["path"], Retry()) if is_url(d["path"]) else read_manifest(d["path"])
                 for d in inputs]
    sizes = [int(m["counts"]["documents"]) for m in manifests]
    for k, part in ((1, VALIDATION), (2, TEST)):
        if config.split[k] and not sum(split_counts(config.split, n)[k] for n in sizes):
            check_not_empty({"bins": 0, "documents_in": 0}, config, False, part)


def split_base(fingerprint: str) -> int:
    """64 bits of a dataset's content: the first 8 bytes (little-endian) of sha256 of its fingerprint."""
    return int.from_bytes(hashlib.sha256(fingerprint.encode()).digest()[:8], "little")


def split_documents(datasets: list[dict], split: tuple[int, int]) -> np.ndarray:
    """Which global documents go to validation (bool per document), by ``SPLIT_RULE`` (two shares).

    ``datasets``: {"fingerprint", "documents"} each, in the pack's order (pack.json's "datasets").
    """
    train, valid = split
    share = valid / (train + valid)
    parts = [held_out(int(d["documents"]), np.uint64(split_base(d["fingerprint"])), share) for d in datasets]
    return np.concatenate(parts) if parts else np.zeros(0, np.bool_)


PART_CODES = {TRAIN: 0, VALIDATION: 1, TEST: 2}  # split_parts' values


def split_parts(datasets: list[dict], split: tuple[float, ...]) -> np.ndarray:
    """The part of every global document (``PART_CODES``: 0 train, 1 validation, 2 test; uint8 per document).

    Two shares: ``SPLIT_RULE``, each document drawn on its own (today's rule, kept so that the packs and cache
    keys made with two shares stay valid; the counts are then binomial around Megatron's). Three shares:
    ``SPLIT_RULE_3``, Megatron-LM's counts exactly (``split_counts``) per dataset, as Megatron splits each
    dataset of ``--data-path``; unlike Megatron, whose parts are contiguous ranges of documents, the documents
    of each part are drawn by ``u`` (a sorted corpus would otherwise hold out its last topic). ``99,1,0`` is
    therefore ``99,1`` with Megatron's exact count.
    """
    if len(split) == 2:
        return split_documents(datasets, split).astype(np.uint8)
    parts = []
    for d in datasets:
        n = int(d["documents"])
        _, n_valid, n_test = split_counts(split, n)
        order = np.argsort(split_draws(n, np.uint64(split_base(d["fingerprint"]))), kind="stable")
        part = np.zeros(n, np.uint8)
        part[order[:n_valid]] = PART_CODES[VALIDATION]
        part[order[n_valid:n_valid + n_test]] = PART_CODES[TEST]
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


# ------------------------------------------------------------------------------------------- blend


def _pack_blend(datasets: list[str | Path], output: str | Path, config: PackConfig, force: bool,
                log: Callable[[str], None], weights: list[float] | None, mix: str | None, allow_empty: bool,
                source_options: list[dict] | None = None, cache_dir: str | None = None) -> PackOutcome:
    """A blend (prep/pack/mixture.py): every source packed alone by the plain path (its own entry, shared with
    other mixtures; a source at a URL read in place and listed by URL), then the blend entry ordering their bins,
    built under its lock and made current."""
    t0 = time.perf_counter()
    check_blend_config(config)
    sources = read_sources([str(d) for d in datasets], weights, mix, source_options, cache_dir)  # all checked first
    phases = read_phases(mix, sources)
    configs = source_configs(sources, config)
    outcomes = []
    for s, c in zip(sources, configs, strict=True):
        try:
            outcomes.append(pack([s.path], output, c, force=force, log=log, allow_empty=allow_empty,
                                 make_current=False, cache_dir=cache_dir))
        except XprepError as e:
            raise XprepError(f"blend source {s.name!r} ({s.path}): {e}") from None
    entries = [o.entry for o in outcomes]
    unit = blend_unit(entries)
    available = [blend_units(e, unit) for e in entries]
    plan = phase_plan(phases, sources, available, config.capacity) if phases else None
    if plan is not None:  # the phases size the blend
        if config.total_tokens is not None or config.epochs is not None:
            raise XprepError(f"--mix {mix} has phases, which size the blend: drop --total-tokens/--epochs")
        total, size_option = sum(plan.totals), f"--mix phases: {'; '.join(plan.options)}"
    else:
        total, size_option = blend_total(config, shares(sources), available)
    root = Path(output)
    entry, hit = _blend_once(root, sources, entries, config, total, size_option, force, log,
                                plan=plan)
    held = {}
    for part in held_out_parts(config):  # the held-out parts of every source, each bin once
        parts = [getattr(o, part) for o in outcomes]
        held[part], _ = _blend_once(root, sources, parts, config, sum(blend_units(e, unit) for e in parts),
                                    part, force, log, every_bin_once=True)
    set_current(root, entry, held.get(VALIDATION), held.get(TEST))
    return PackOutcome(entry=entry, hit=hit, seconds=time.perf_counter() - t0, sources=outcomes,
                       validation=held.get(VALIDATION), test=held.get(TEST))


def _blend_once(root: Path, sources: list, entries: list[PackEntry], config: PackConfig, total: int,
                size_option: str, force: bool, log: Callable[[str], None], every_bin_once: bool = False,
                plan: PhasePlan | None = None) -> tuple[BlendEntry, bool]:
    """The blend entry of these sources, built under its lock unless the cache has it; (entry, hit)."""
    shares_ = plan.shares() if plan is not None else shares(sources) if not every_bin_once else None
    key = blend_key(entries, sources, shares_, config.seed, total, every_bin_once, plan)
    name = blend_name(key)
    entry = None if force else _open_blend(root / name, key, log)
    if entry is not None:
        return entry, True
    with locked(root / f".{name}.lock", lambda: log(f"another `xprep pack` is building {name}: waiting")):
        entry = None if force else _open_blend(root / name, key, log)
        if entry is not None:
            return entry, True
        return _build_blend(root, name, sources, entries, config, key, total, size_option, every_bin_once,
                            plan), False


def _open_blend(path: Path, key: str, log: Callable[[str], None]) -> BlendEntry | None:
    """The complete blend at ``path``, None if absent or its arrays are damaged (said through ``log``, then
    rebuilt); one that does not open otherwise is an error."""
    if not path.exists():
        return None
    try:
        entry = BlendEntry.open(path)
    except DamagedEntry as e:
        if e.path != path:  # a source entry: built again (or found whole) just before, so this is not the blend's
            raise
        log(f"{path}: damaged pack entry ({e.problem}): building it again")
        return None
    if entry.key != key:
        raise XprepError(f"{path}: its blend.json has key {entry.key!r}, not {key!r}: the entry is corrupt; "
                         "re-run with --force")
    return entry


def _build_blend(root: Path, name: str, sources: list, entries: list[PackEntry], config: PackConfig, key: str,
                 total: int, size_option: str, every_bin_once: bool = False, plan: PhasePlan | None = None
                 ) -> BlendEntry:
    """Blend into a fresh temp directory, blend.json last, and publish it by rename (the caller holds the lock)."""
    with building(root, name) as claim:
        tmp = claim.path
        blend, meta = build_blend(sources, entries, config, key, total, size_option, every_bin_once, plan)
        BlendEntry(path=tmp, meta=meta, bin_source=blend.bin_source, bin_index=blend.bin_index,
                   sources=entries).write_arrays(tmp)
        write_json_atomic(tmp / BLEND_JSON, meta, durable=False)  # fsync_tree makes all of it durable
        fsync_tree(tmp)
        publish(claim, root / name)
    return BlendEntry.open(root / name)


def _build_once(root: Path, name: str, key: str, inputs: list[dict], config: PackConfig, force: bool,
                allow_empty: bool, log: Callable[[str], None], split: dict | None = None,
                cache_dir: str | None = None) -> tuple[PackEntry, bool]:
    """Build under the entry's lock; whoever waited for a builder finds its entry (a hit)."""
    with locked(root / f".{name}.lock", lambda: log(f"another `xprep pack` is building {name}: waiting")):
        entry = None if force else _open_existing(root / name, key, inputs, log, cache_dir)
        if entry is not None:
            return entry, True
        return _build(root, name, key, inputs, config, allow_empty, split, cache_dir), False


def _open_existing(path: Path, key: str, inputs: list[dict], log: Callable[[str], None],
                   cache_dir: str | None = None) -> PackEntry | None:
    """The complete entry at ``path``, None if absent or damaged (its arrays unreadable, or breaking the layout's
    invariants or the documents of ``inputs``: said through ``log``, then rebuilt); an entry whose pack.json does
    not open, or names another key, is an error."""
    if not path.exists():
        return None
    try:
        entry = PackEntry.open(path)
        if entry.meta.get("key") == key:
            entry.check_items(doc_lengths(open_fingerprinted(inputs, path, cache_dir=cache_dir)))
    except DamagedEntry as e:
        log(f"{path}: damaged pack entry ({e.problem}): building it again")
        return None
    if entry.meta.get("key") != key:
        raise XprepError(f"{path}: its pack.json has key {entry.meta.get('key')!r}, not {key!r}: "
                         "the entry is corrupt; re-run with --force")
    return entry


def check_not_empty(stats: dict, config: PackConfig, allow_empty: bool, part: str | None = None) -> None:
    """Refuse a pack of 0 bins, saying why it is empty and what to change."""
    if stats["bins"] or allow_empty:
        return
    n, empty, dropped = stats["documents_in"], stats.get("empty_documents"), stats.get("dropped_documents")
    opt = f"{config.capacity_option} {config.capacity}"
    split = ",".join(f"{s:g}" for s in config.split) if part else ""
    what = f"the {part} part of --split {split}" if part else "the pack"
    if n == 0 and part == VALIDATION and len(config.split) == 2:
        train, valid = config.split
        raise XprepError(f"--split {train},{valid}: no document was drawn for validation (each goes there with "
                         f"probability {valid}/{train + valid}); give validation a larger share, e.g. --split "
                         f"{max(1, train // 10)},{valid}, pack more documents, or leave --split out")
    if n == 0 and part in (VALIDATION, TEST):
        raise XprepError(f"--split {split}: its {part} share rounds to 0 documents of each dataset (Megatron's "
                         f"rounding); give {part} a larger share, pack more documents, or give it a zero share")
    if n == 0:
        why, fix = "the input has no documents", "check the DATASET arguments (`xprep inspect DATASET`)"
    elif empty == n:
        why, fix = f"all {n:,} documents are empty", "re-tokenize with the right --text-field or --format"
    elif config.spec.fixed_length_samples and (config.epochs is not None or config.total_tokens is not None):
        size = f"--epochs {config.epochs:g}" if config.epochs is not None else f"--total-tokens {config.total_tokens}"
        why, fix = (f"{size} asks for less than one sample of {opt} (which needs {config.capacity + 1:,} tokens of "
                    f"the {stats['tokens_in']:,}-token stream)", f"raise {size.split()[0]} or leave it out")
    elif config.spec.fixed_length_samples:
        why, fix = (f"its stream of {stats['tokens_in']:,} tokens is too short for one sample of {opt} (which needs "
                    f"{config.capacity + 1:,})", f"lower {config.capacity_option} or repeat it with --total-tokens N")
    elif empty == 0:
        why, fix = (f"all {n:,} documents are longer than {opt} (--overlong drop)",
                    f"raise {config.capacity_option} or use --overlong split|truncate")
    else:
        why, fix = (f"{empty:,} of {n:,} documents are empty and the other {dropped:,} are longer than {opt} "
                    "(--overlong drop)", f"raise {config.capacity_option} or use --overlong split|truncate")
    raise XprepError(f"{what} would have 0 bins: {why}; {fix}, or pass --allow-empty to publish an empty pack")


# ------------------------------------------------------------------------------------------- build


def _build(root: Path, name: str, key: str, inputs: list[dict], config: PackConfig,
           allow_empty: bool = False, split: dict | None = None, cache_dir: str | None = None) -> PackEntry:
    """Pack into a fresh temp directory and publish it by rename (the caller holds the lock).

    ``split``: what ``split_names`` gives plus the ``part`` to pack; None packs every document.
    """
    with building(root, name) as claim:
        groups = open_listed(inputs, root / name, since="`xprep pack` started", cache_dir=cache_dir)
        datasets = [ds for group in groups for ds in group]  # a sharded input is its shards
        lengths, described = _load_lengths(inputs, groups)
        t0 = time.perf_counter()
        docs = _part_documents(described, split)
        eod = chunk_eod(datasets, config)
        packed = pack_lengths(lengths, config, docs, dataset_targets(datasets, eod))
        check_not_empty(packed.stats, config, allow_empty, split and split["part"])
        meta = {"format": PACK_FORMAT, "version": PACK_VERSION, "key": key, "name": name,
                "config": config.to_json(), "key_fields": config.key_fields(), "datasets": described,
                "loss_mask": any(ds.loss_mask is not None for ds in datasets),
                "layout": layout_of(config), "stats": packed.stats,
                "pack_seconds": round(time.perf_counter() - t0, 3),
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "complete": True}
        if config.spec.fixed_length_samples:
            meta["lookahead"] = True  # an item that stops inside its document is labelled with its next token
        if eod is not None:
            meta["eod_id"] = eod  # --eod-mask-loss: the token that is never a target
        if split:
            meta["split"] = {**split, "documents": len(docs)}
        _write_entry(claim.path, packed, meta)
        publish(claim, root / name)
    return PackEntry.open(root / name)


def _part_documents(described: list[dict], split: dict | None) -> np.ndarray | None:
    """The global ids of the documents of this --split part, in order (None: no split, all of them)."""
    if split is None:
        return None
    shares = (split["train"], split["valid"], *([split["test"]] if "test" in split else []))
    return np.flatnonzero(split_parts(described, shares) == PART_CODES[split["part"]])


def _load_lengths(inputs: list[dict], groups: list[list[TokenDataset]]) -> tuple[np.ndarray, list[dict]]:
    """Document lengths of all datasets concatenated (the global index), and their descriptions (``groups``: the
    plain datasets of each input, ``open_listed``)."""
    parts, described, first = [], [], 0
    for d, group in zip(inputs, groups, strict=True):
        parts += [ds.lengths for ds in group]
        n = sum(len(ds) for ds in group)
        described.append({**d, "documents": n, "tokens": sum(int(ds.manifest["counts"]["tokens"]) for ds in group),
                          "first_document": first})
        first += n
    return np.concatenate(parts) if parts else np.zeros(0, np.int32), described


NO_MASK, NO_TOKENS = np.zeros(0, np.uint8), np.zeros(0, np.int32)  # (a dataset without a loss mask; no EOD rule)


def dataset_targets(datasets: list[TokenDataset], eod: int | None = None) -> Targets:
    """``Targets`` over the global document index of these datasets, from their loss masks (one pass over the
    masks of the items asked about; a dataset without a loss-mask stream learns every token but an item's first).
    ``eod``: the EOD id that ``mask_eod`` (``--eod-mask-loss``) keeps from being a target (``chunk_eod``)."""
    bases = np.cumsum([0, *(len(ds) for ds in datasets)])
    offsets = [ds.tokens.offsets() for ds in datasets]
    lengths = [ds.lengths.astype(np.int64) for ds in datasets]

    def counted(mask, tokens, doc_offsets, doc_lengths, item_doc, item_start, item_len, lookahead, opens, mask_eod):
        if opens is None and not mask_eod:
            return item_targets(mask, doc_offsets, doc_lengths, item_doc, item_start, item_len, lookahead)
        opens = np.ones(len(item_doc), np.bool_) if opens is None else opens
        return sample_targets(mask, tokens, doc_offsets, doc_lengths, item_doc, item_start, item_len, opens,
                              eod if mask_eod else -1)

    def one(k, item_doc, item_start, item_len, lookahead, opens, mask_eod):
        ds = datasets[k]
        read = [s for s in (ds.loss_mask, ds.tokens if mask_eod else None) if s is not None]
        if not read or not getattr(ds, "streamed", False):  # through the memory maps (or the lengths alone)
            mask = ds.loss_mask.items if ds.loss_mask is not None else NO_MASK
            return counted(mask, ds.tokens.items if mask_eod else NO_TOKENS, offsets[k], lengths[k], item_doc,
                           item_start, item_len, lookahead, opens, mask_eod)
        # at a URL: the items' ranges (with the token after each, if any) fetched a chunk at a time, each item
        # counted as a document of its own whose start lies where its tokens were put
        size = lengths[k][item_doc]
        lo = offsets[k][item_doc] + item_start
        hi = lo + np.minimum(item_len + 1, size - item_start)
        order, out = np.argsort(lo, kind="stable"), np.empty(len(item_doc), np.int64)  # in order: few requests
        for items, starts, part in stream_chunks(ds, read, lo[order], hi[order]):
            sel = order[part]
            out[sel] = counted(items[0] if ds.loss_mask is not None else NO_MASK, items[-1] if mask_eod else NO_TOKENS,
                               starts - item_start[sel], size[sel], np.arange(len(sel)), item_start[sel],
                               item_len[sel], lookahead, None if opens is None else opens[sel], mask_eod)
        return out

    def targets(item_doc, item_start, item_len, lookahead=False, opens=None, mask_eod=False):
        if len(datasets) == 1:
            return one(0, item_doc, item_start, item_len, lookahead, opens, mask_eod)
        out = np.zeros(len(item_doc), np.int64)
        which = np.searchsorted(bases, item_doc, side="right") - 1
        for k in np.unique(which).tolist():
            sel = np.flatnonzero(which == k)
            out[sel] = one(k, item_doc[sel] - bases[k], item_start[sel], item_len[sel], lookahead,
                           None if opens is None else opens[sel], mask_eod)
        return out

    return targets


def chunk_eod(datasets: list[TokenDataset], config: PackConfig) -> int | None:
    """The EOD id that ``--eod-mask-loss`` keeps from being a target: the ``eod_id`` the datasets' manifests record
    (``xprep tokenize``: the tokenizer's eos_token, or --eod-token), the same in all; None without the option."""
    if not config.eod_mask_loss:
        return None
    ids = {ds.path: (ds.manifest.get("tokenizer") or {}).get("eod_id") for ds in datasets}
    for path, eod in ids.items():
        if not isinstance(eod, int):
            raise XprepError(f"--eod-mask-loss: {path}/manifest.json records no EOD token (tokenizer.eod_id is "
                             f"null): re-tokenize it with --eod-token TOKEN, or leave --eod-mask-loss out")
    if len(set(ids.values())) > 1:
        listed = ", ".join(f"{p}: {e}" for p, e in ids.items())
        raise XprepError(f"--eod-mask-loss: the datasets record different EOD ids ({listed}); re-tokenize them with "
                         "the same --eod-token, or pack them apart")
    return next(iter(ids.values()))


def _write_entry(tmp: Path, packed: Packed, meta: dict) -> None:
    """Arrays first, then pack.json: the completion marker."""
    PackEntry(path=tmp, meta=meta, bin_offsets=packed.bin_offsets, item_doc=packed.item_doc,
              item_start=packed.item_start, item_len=packed.item_len, bin_targets=packed.bin_targets,
              bin_next_doc=packed.bin_next_doc).write_arrays(tmp)
    _mark_complete(tmp, meta)


def _mark_complete(tmp: Path, meta: dict) -> None:
    """Write pack.json (``"complete": true``) and make the whole entry durable before it is published."""
    write_json_atomic(tmp / PACK_JSON, meta, durable=False)  # fsync_tree makes all of it durable
    fsync_tree(tmp)
