"""The sources of a blend: ``xprep pack DATASET@WEIGHT ...`` arguments and ``--mix FILE``, read and checked before
anything is packed, and the options each source is packed with.

Mix file, YAML (needs PyYAML) or JSON (``schemas/mix.schema.json``)::

    sources:
      - dataset: data/web   # a token dataset; a relative path is read from the mix file's directory; a URL
                            # (s3://…) is read in place, as a plain pack reads it
        weight: 0.7         # > 0, a share of tokens (normalized over the sources)
        name: web           # optional: the source's name in per-source loss and reports [default: directory name]
        method: sequential  # optional: its own packing method and overlong policy [default: the command's]
    phases:                 # optional: the mix changes over the run, phase after phase (``Phase``)
      - tokens: 8e9         # its size: `tokens`, `bins`, or `epochs` of one source (`epochs: 1, source: code`)
        weights: {web: 0.8, code: 0.2}   # shares of this phase's tokens, by source name (absent: none)
      - epochs: 1
        source: code
        weights: {web: 0.3, code: 0.7}

With ``phases``, a source's ``weight`` is not read (it may be left out): each phase weighs the sources itself.

Every mistake (a missing dataset, a bad weight, two sources of one name or of different tokenizers, a method
that cannot blend with the others) is one error naming the file and the source. A source at a URL is read in place
(its manifest and indexes fetched into ``--cache-dir``, ``open_url_parts``), never copied whole: its path stays the
URL as typed, a string (pathlib would turn ``s3://b/x`` into ``s3:/b/x``). The blend itself (the order
of bins, blend.json) is ``xprep.prep.pack.mixture``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from xprep.prep.dataset import open_url_parts
from xprep.prep.errors import XprepError
from xprep.prep.formats import DATASET_FORMAT, LOSS_MASK_STREAM, MANIFEST, SHARDED_FORMAT, declared_format
from xprep.prep.fs import is_url, local_path
from xprep.prep.io import read_json
from xprep.prep.pack.blend import MAX_SOURCES
from xprep.prep.pack.config import SOURCE_OPTIONS, PackConfig, check_source_option
from xprep.prep.pack.methods import packing_method, packing_methods

MIX_KEYS = {"dataset", "weight", "name", *SOURCE_OPTIONS}
PHASE_SIZES = ("tokens", "bins", "epochs")  # a phase has exactly one (epochs: of the source it names)


@dataclass
class Source:
    """One dataset of a blend: where it is, its weight (a share of tokens, not normalized), its name, and the
    packing options it overrides (``method``, ``overlong``; None: the command's, see ``PackConfig.for_source``)."""

    path: str  # a local directory, or a URL as typed (read in place)
    weight: float | None  # None: a source of a phased mix file that gives none (its phases weigh it)
    name: str
    method: str | None = None
    overlong: str | None = None
    manifest: dict = field(default_factory=dict, repr=False)  # its manifest, once ``read_sources`` checked it


@dataclass(frozen=True)
class Phase:
    """One phase of a phased mix: its size (exactly one of ``tokens``, ``bins``, or ``epochs`` of ``source``) and
    the weight of each source in it, by name (sources it does not name, or names at 0, give no bin in it)."""

    weights: dict[str, float]
    tokens: int | None = None
    bins: int | None = None
    epochs: float | None = None
    source: str | None = None

    @property
    def size_option(self) -> str:
        """The phase's size as the mix file says it (blend.json, reports)."""
        if self.epochs is not None:
            return f"epochs: {self.epochs:g} of {self.source}"
        return f"tokens: {self.tokens}" if self.tokens is not None else f"bins: {self.bins}"


def read_sources(paths: list[str], weights: list[float] | None, mix: str | None, options: list[dict] | None = None,
                 cache_dir: str | None = None) -> list[Source]:
    """The sources of a blend: the ``--mix`` file's, then the ``DATASET@WEIGHT[:key=value,...]`` arguments
    (``options``: each argument's keys); all checked (weights, names, options, datasets present, one tokenizer)
    before anything is packed, each with its manifest. A dataset at a URL is read in place: its manifest and
    indexes fetched into ``cache_dir`` (``--cache-dir``; None: ``prep.fs.cache_root``'s), as a plain pack does."""
    sources = read_mix(mix) if mix is not None else []
    if paths and any(s.weight is None for s in sources):
        raise XprepError(f"--mix {mix} has phases: DATASET@WEIGHT arguments cannot be added to it (no phase weighs "
                         f"them); list {paths[0]} among its `sources:` and give it a weight in each phase")
    options = options or [{} for _ in paths]
    sources += [Source(p, float(w), dataset_name(p), **o)
                for p, w, o in zip(paths, weights or [], options, strict=True)]
    where = f"--mix {mix}" if mix is not None else "the blend"
    if len(sources) > MAX_SOURCES:
        raise XprepError(f"{where}: {len(sources):,} sources, more than {MAX_SOURCES:,}; merge some datasets first")
    seen_names, seen_paths = {}, {}
    for s in sources:
        s.manifest = check_dataset(s, where, cache_dir)
        resolved = dataset_identity(s.path)
        if resolved in seen_paths:
            raise XprepError(f"{where}: dataset {s.path} is listed twice ({seen_paths[resolved]} and {s.name}); "
                             "list each dataset once, with the sum of its weights")
        if s.name in seen_names:
            raise XprepError(f"{where}: two sources are named {s.name!r} ({seen_names[s.name]} and {s.path}); "
                             "give them distinct names (`name:` in a mix file)")
        seen_paths[resolved], seen_names[s.name] = s.name, s.path
    check_one_tokenizer(sources)
    return sources


def dataset_name(dataset: str) -> str:
    """A source's default name: the last part of its URL, or its directory's name."""
    return dataset.rstrip("/").rsplit("/", 1)[-1] if is_url(dataset) else Path(dataset).resolve().name


def dataset_identity(dataset: str) -> str:
    """What two sources of one dataset share: the URL (a trailing slash aside), or the resolved directory."""
    return dataset.rstrip("/") if is_url(dataset) else str(Path(dataset).resolve())


def read_mix(mix: str) -> list[Source]:
    """The sources a mix file lists; every mistake is one error naming the file and the source."""
    path = Path(mix)
    data = _load_mix(path)
    listed = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(listed, list) or not listed:
        raise XprepError(f"--mix {mix}: expected a mapping with a non-empty list `sources:` of "
                         "{dataset, weight, name?} (see schemas/mix.schema.json)")
    extra = set(data) - {"sources", "phases"}
    if extra:
        raise XprepError(f"--mix {mix}: unknown key {sorted(extra)[0]!r} at the top; only `sources:` and `phases:` "
                         "are read")
    return [_mix_source(item, i, path, "phases" in data) for i, item in enumerate(listed)]


def read_phases(mix: str | None, sources: list[Source]) -> list[Phase] | None:
    """The phases of a mix file (None: it has none), each checked against the sources it names."""
    if mix is None:
        return None
    data = _load_mix(Path(mix))
    if "phases" not in data:
        return None
    listed = data["phases"]
    if not isinstance(listed, list) or not listed:
        raise XprepError(f"--mix {mix}: `phases:` must be a non-empty list of {{tokens|bins|epochs, weights}} "
                         "(see schemas/mix.schema.json)")
    names = [s.name for s in sources]
    return [_phase(item, f"--mix {mix}: phase #{i + 1}", names) for i, item in enumerate(listed)]


def _phase(item, where: str, names: list[str]) -> Phase:
    if not isinstance(item, dict):
        raise XprepError(f"{where}: expected a mapping {{tokens|bins|epochs, weights}}, got {item!r}")
    unknown = set(item) - {*PHASE_SIZES, "source", "weights"}
    if unknown:
        raise XprepError(f"{where}: unknown key {sorted(unknown)[0]!r}; a phase has one of tokens, bins or epochs "
                         "(with source), and weights")
    sizes = [k for k in PHASE_SIZES if k in item]
    if len(sizes) != 1:
        raise XprepError(f"{where}: give exactly one size, `tokens:`, `bins:` or `epochs:` (with `source:`), "
                         f"not {sizes or 'none'}")
    size, value = sizes[0], item[sizes[0]]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf or (
            size != "epochs" and value < 1):
        raise XprepError(f"{where}: `{size}: {value!r}` must be a positive number" +
                         (" (at least 1)" if size != "epochs" else ""))
    source = item.get("source")
    if (size == "epochs") != (source is not None):
        raise XprepError(f"{where}: `source:` names the source whose `epochs:` size the phase; give both, or "
                         "size the phase by `tokens:` or `bins:`")
    weights = item.get("weights")
    if not isinstance(weights, dict) or not weights:
        raise XprepError(f"{where}: `weights:` must map source names to weights, e.g. {{{names[0]}: 1}}")
    for name, w in weights.items():
        if name not in names:
            raise XprepError(f"{where}: weights name {name!r}, which is no source of the mix ({', '.join(names)})")
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf:
            raise XprepError(f"{where}: the weight of {name!r}, {w!r}, must be a number ≥ 0")
    weights = {n: float(w) for n, w in weights.items() if w > 0}
    if not weights:
        raise XprepError(f"{where}: every weight is 0; give some source a positive weight")
    if source is not None and source not in weights:
        raise XprepError(f"{where}: `epochs: {value}` of {source!r}, which has no weight in this phase; size it by "
                         "a source the phase takes from, or by `tokens:`")
    return Phase(weights, tokens=round(value) if size == "tokens" else None,
                 bins=round(value) if size == "bins" else None,
                 epochs=float(value) if size == "epochs" else None, source=source)


def _load_mix(path: Path):
    if not path.is_file():
        raise XprepError(f"--mix {path}: no such file; give a YAML or JSON mix file")
    if path.suffix.lower() not in (".yaml", ".yml"):
        return read_json(path, "mix file", "fix it, or write it as YAML (.yaml)")
    try:
        import yaml  # optional dependency (the yaml extra): only YAML mix files need it
    except ImportError:
        raise XprepError(f"--mix {path}: reading YAML needs PyYAML, which is not installed: pip install pyyaml "
                         "(or pip install 'xprep[yaml]'), or write the mix file as JSON") from None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise XprepError(f"--mix {path}: not valid YAML ({str(e).splitlines()[0]}); fix the file") from None


def _mix_source(item, i: int, path: Path, phased: bool = False) -> Source:
    where = f"--mix {path}: source #{i + 1}"
    if not isinstance(item, dict):
        raise XprepError(f"{where}: expected a mapping {{dataset, weight, name?}}, got {item!r}")
    unknown = set(item) - MIX_KEYS
    if unknown:
        raise XprepError(f"{where}: unknown key {sorted(unknown)[0]!r}; a source has dataset, weight, name, "
                         "method and overlong")
    dataset, weight, name = item.get("dataset"), item.get("weight"), item.get("name")
    options = {k: item[k] for k in SOURCE_OPTIONS if k in item}
    for key, value in options.items():
        check_source_option(key, value, f"{where} ({dataset})")
    if not isinstance(dataset, str) or not dataset:
        raise XprepError(f"{where}: `dataset:` must name a token dataset directory")
    weighed = not (phased and weight is None)  # a phased mix's source may leave its weight to the phases
    if weighed and (isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf):
        raise XprepError(f"{where} ({dataset}): the weight {weight!r} must be a positive number")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise XprepError(f"{where} ({dataset}): `name:` must be a non-empty string")
    if is_url(dataset):  # an object-store dataset: read in place, named after the URL's last part
        return Source(dataset, _weight(weight), name or dataset_name(dataset), **options)
    local = Path(local_path(dataset))
    full = str(local if local.is_absolute() else path.parent / local)
    return Source(full, _weight(weight), name or dataset_name(full), **options)


def _weight(weight) -> float | None:
    return None if weight is None else float(weight)


def check_dataset(source: Source, where: str, cache_dir: str | None = None) -> dict:
    """The manifest of the source's token dataset, or one error naming the source. A dataset at a URL is opened in
    place (``open_url_parts``: its manifest and indexes fetched into ``cache_dir``, a sharded one's shards checked):
    no dataset there, a missing object or refused access is that one line."""
    if is_url(source.path):
        try:
            manifest, _ = open_url_parts(source.path, cache_dir)
        except XprepError as e:
            raise XprepError(f"{where}: source {source.name!r}: {e}") from None
        return manifest
    manifest = Path(source.path) / MANIFEST
    if not manifest.is_file():
        raise XprepError(f"{where}: source {source.name!r}: {source.path} is not a token dataset (no {MANIFEST}); "
                         "check the path (a mix file's relative paths are read from its directory)")
    fmt = declared_format(manifest)
    if fmt not in (DATASET_FORMAT, SHARDED_FORMAT):
        raise XprepError(f"{where}: source {source.name!r}: {source.path} holds a {fmt!r} manifest, not a token "
                         "dataset's; blend token datasets (written by `xprep tokenize` or `xprep merge`)")
    return read_json(manifest, "dataset manifest", "re-run `xprep tokenize`")


def check_one_tokenizer(sources: list[Source]) -> None:
    """All sources of a blend share a tokenizer: their token ids end up in the same batches."""
    first = None
    for s in sources:
        sha = (s.manifest.get("tokenizer") or {}).get("sha256")  # (check_dataset made it a manifest)
        if first is None:
            first = (s, sha)
        elif sha != first[1]:
            raise XprepError(f"blend sources {first[0].name!r} ({first[0].path}) and {s.name!r} ({s.path}) were "
                             "tokenized with different tokenizers (tokenizer.json sha256 differs): blend datasets "
                             "of one tokenizer, or re-tokenize")


def check_blend_config(config: PackConfig) -> None:
    """Options that cannot apply to a blend, refused before any work."""
    if config.balance_dp:
        raise XprepError("--balance-dp does not apply to a blend: the blend interleaves the sources' bins, which "
                         "would break the per-rank steps; drop --balance-dp")
    if config.total_tokens is not None and config.total_tokens < 1:
        raise XprepError(f"--total-tokens {config.total_tokens} must be a positive number of tokens")
    if config.epochs is not None and not 0 < config.epochs < math.inf:
        raise XprepError(f"--epochs {config.epochs} must be a positive number")
    if config.total_tokens is not None and config.epochs is not None:
        raise XprepError("--total-tokens and --epochs both size the blend: give one")


def source_configs(sources: list[Source], config: PackConfig) -> list[PackConfig]:
    """How each source is packed (``PackConfig.for_source``), one epoch each (the blend repeats or cuts), checked
    to blend: bins of one kind and size (methods that ``blends_with_others`` mix freely; the others, e.g. chunk
    and token-aware, only with their own kind)."""
    configs = []
    for s in sources:
        try:
            c = config.for_source(s.method, s.overlong, has_loss_mask(s.manifest))
        except XprepError as e:
            raise XprepError(f"blend source {s.name!r} ({s.path}): {e}") from None
        configs.append(replace(c, total_tokens=None, epochs=None))
    methods = sorted({c.method for c in configs})
    if len(methods) > 1 and not all(packing_method(m).blends_with_others for m in methods):
        odd = next(m for m in methods if not packing_method(m).blends_with_others)
        mixable = [m.name for m in packing_methods() if m.blends_with_others]
        raise XprepError(f"a blend cannot mix --method {odd} with {', '.join(m for m in methods if m != odd)}: "
                         f"{odd} bins are read differently by the trainer; give every source the same method, or "
                         f"mix only {' and '.join(mixable)} (e.g. text: method={mixable[0]}, overlong=split)")
    return configs


def has_loss_mask(manifest: dict) -> bool:
    """Whether a token dataset (its manifest) has a loss-mask stream (SFT data: some tokens are not targets)."""
    return LOSS_MASK_STREAM in (manifest.get("streams") or {})


def shares(sources: list[Source]) -> np.ndarray:
    weights = np.array([s.weight for s in sources], np.float64)
    return weights / weights.sum()
