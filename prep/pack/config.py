"""``PackConfig``: what ``xprep pack`` packs and how, one field per option, checked once.

Its own module so that the packing pipeline (``xprep.prep.pack.kernels``) takes it without importing the pack
command (``xprep.prep.pack.cache``), which depends on that pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from xprep.prep.errors import XprepError

METHODS = ("sequential", "multipack", "token-aware", "chunk")
OVERLONG = ("drop", "truncate", "split")
# Pretraining text is usually packed in order and long documents are worth keeping (split);
# SFT conversations lose meaning when cut, so the SFT-oriented methods drop them.
DEFAULT_OVERLONG = {"sequential": "split", "multipack": "drop", "token-aware": "drop", "chunk": "split"}
DEFAULT_SHUFFLE = {"sequential": False, "multipack": False, "token-aware": True, "chunk": False}
DEFAULT_GROUP_SIZE = 100_000
DEFAULT_DP_MICRO_BATCHES = 16  # a wider window balances micro-steps better (1.33 → 1.09 at 8 ranks)
SOURCE_OPTIONS = ("method", "overlong")  # what one source of a blend may set for itself
# Methods whose bins can share a blend: each bin is one row of --seq-len tokens, planned and read alike.
BLENDABLE_METHODS = ("sequential", "multipack")


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
    total_tokens: int | None = None  # --total-tokens: the size of a chunk pack (epochs of the stream) or of a blend
    epochs: float | None = None  # --epochs: the same, in epochs (of the stream; of the largest share of a blend)
    split: tuple[int, int] | None = None  # --split TRAIN,VALID: shares of documents held out for validation
    defaulted: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)  # filled by the method

    def __post_init__(self):
        self.defaulted = tuple(n for n in ("overlong", "shuffle", "group_size", "dp_micro_batches")
                               if getattr(self, n) is None)
        if self.method not in METHODS:
            raise XprepError(f"--method {self.method!r} is unknown: choose one of {', '.join(METHODS)}")
        self._check_capacity_option()
        self._check_method_options()
        self._check_size_options()
        if self.method == "chunk":
            self._check_chunk()
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
            what = "the sample length in tokens" if self.method == "chunk" else "the bin capacity in tokens"
            raise XprepError(f"--method {self.method} needs {wanted} N ({what})")
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

    def _check_size_options(self) -> None:
        """--total-tokens or --epochs (not both), positive; whether they apply is the pack's call (chunk or blend)."""
        if self.total_tokens is not None and self.epochs is not None:
            raise XprepError(f"--total-tokens {self.total_tokens} and --epochs {self.epochs:g} both size the pack: "
                             "give one of them")
        if self.total_tokens is not None and self.total_tokens < 1:
            raise XprepError(f"--total-tokens {self.total_tokens} must be a positive number of tokens")
        if self.epochs is not None and not 0 < self.epochs < float("inf"):
            raise XprepError(f"--epochs {self.epochs:g} must be a positive number of epochs, e.g. 1 or 2.5")

    def _check_chunk(self) -> None:
        """Options that mean nothing when documents are cut by the stream into --seq-len samples."""
        if self.overlong not in (None, "split"):  # split is what chunk does (and what a rebuilt config holds)
            raise XprepError(f"--overlong {self.overlong} does not apply to --method chunk: documents are walked as "
                             "one stream cut into --seq-len samples, so none is dropped or truncated; leave it out")
        if self.cp_size > 1:
            check_chunk_cp(self.seq_len, self.cp_size, "--cp-size")
            # Context parallelism zigzags a chunk sample whole, unpadded (train/cp.py), so the samples are the same
            # for every C: --cp-size only checks that --seq-len splits into 2·C chunks, and `xtrain run --cp C`
            # takes any chunk pack whose --seq-len does. It is therefore neither recorded nor part of the cache key:
            # with or without --cp-size, the same command makes (or finds) the same entry, whose pack.json does not
            # claim a CP size it was never made for (and the keys of chunk packs made before stay as they were).
            self.cp_size = 1

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
        for name in ("total_tokens", "epochs", "split"):  # only when given: the keys of other packs stay as they were
            if name == "epochs" and self.epochs == 1:  # what the default sizes too: the same pack, the same key
                continue
            if getattr(self, name) is not None:
                fields[name] = list(self.split) if name == "split" else getattr(self, name)
        return fields

    def for_source(self, method: str | None, overlong: str | None, masked: bool) -> PackConfig:
        """The options one source of a blend is packed with: its own ``method``/``overlong`` where it sets them,
        else the command's; options the command left to the method's default take the source's method's. A
        source with no loss mask (pretraining text) is split where the command did not choose (--overlong):
        cutting a long text loses nothing, and dropping it would skew the mix towards short documents."""
        method = method or self.method
        if overlong is None and "overlong" not in self.defaulted:
            overlong = self.overlong
        if overlong is None and not masked and method != "chunk":
            overlong = "split"
        kept = {n: getattr(self, n) for n in ("shuffle", "group_size", "dp_micro_batches") if n not in self.defaulted}
        if method != "multipack":
            kept.pop("group_size", None)
        return PackConfig(method=method, seq_len=self.seq_len, max_tokens=self.max_tokens, overlong=overlong,
                          cp_size=self.cp_size, balance_dp=self.balance_dp, seed=self.seed, split=self.split, **kept)

    def for_validation(self) -> PackConfig:
        """The options of the ``--split`` validation part: the same, but a chunk pack of it is one epoch."""
        return replace(self, total_tokens=None, epochs=None)

    def to_json(self) -> dict:
        return {**asdict(self), "capacity": self.capacity, "align": self.align}


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The positive multiples of ``unit`` next to ``value`` (below and above): the values to suggest for it."""
    below = value // unit * unit
    return [m for m in (below, below + unit) if m > 0 and m != value]


def check_chunk_cp(seq_len: int, cp_size: int, flag: str, entry: str | None = None) -> None:
    """Refuse context parallelism over ``cp_size`` ranks on chunk samples of ``seq_len`` tokens unless 2·C divides it.

    A chunk sample is exactly ``seq_len`` tokens of document pieces, with no room for padding: context
    parallelism cuts it into 2·C equal chunks (train/cp.py). ``flag`` is the option that set C (``--cp-size``
    when packing, ``--cp`` when training), ``entry`` the pack being trained on (None when packing).
    """
    unit = 2 * cp_size
    if seq_len % unit == 0:
        return
    what = f"the --seq-len of the --method chunk pack {entry}" if entry else "--seq-len with --method chunk"
    near = " or ".join(str(m) for m in nearest_multiples(seq_len, unit))
    fix = f"repack it with --seq-len {near}" if entry else f"use --seq-len {near}"
    if seq_len % 2 == 0 and seq_len > 2:
        fix += f", or {'use ' if entry else ''}a {flag} that divides {seq_len // 2}"
    raise XprepError(f"{flag} {cp_size} needs {what} to be a multiple of 2·cp={unit} (context parallelism cuts "
                     f"every sample into {unit} equal chunks), and {seq_len} is not: {fix}")


def parse_split(text: str | None) -> tuple[int, int] | None:
    """``--split 99,1`` → ``(99, 1)``: the shares of documents for training and validation."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        train, valid = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        train = valid = None
    if train is None or train < 0 or valid < 0 or train + valid == 0:
        raise XprepError(f"--split {text}: expected TRAIN,VALID shares as two non-negative integers, e.g. 99,1")
    if valid == 0:
        raise XprepError(f"--split {text}: leaves validation empty; give it a share, e.g. --split 99,1")
    if train == 0:
        raise XprepError(f"--split {text}: leaves nothing to train on; give training a share, e.g. --split 99,1")
    return train, valid


def check_source_option(key: str, value, where: str) -> None:
    """One per-source option of a blend (a mix file's ``method:``/``overlong:``, or ``DATASET@W:key=value``)."""
    allowed = {"method": METHODS, "overlong": OVERLONG}.get(key)
    if allowed is None:
        raise XprepError(f"{where}: unknown option {key!r}; a source may set {' and '.join(SOURCE_OPTIONS)}")
    if value not in allowed:
        raise XprepError(f"{where}: {key} {value!r} is unknown: choose one of {', '.join(allowed)}")


def parse_sources(arguments: tuple[str, ...] | list[str], mix: str | None
                  ) -> tuple[list[str], list[float] | None, list[dict]]:
    """``DATASET`` / ``DATASET@WEIGHT`` / ``DATASET@WEIGHT:key=value,...`` arguments → (paths, weights or None when
    no weight is given, each argument's options, e.g. ``{"overlong": "split"}``).

    A mix file (``--mix``) is read by the blend itself; arguments given beside it must carry weights too.
    """
    paths, weights, options = [], [], []
    for arg in arguments:
        path, value, opts = _parse_source(arg)
        paths.append(path)
        weights.append(value)
        options.append(opts)
    given = [w is not None for w in weights]
    if any(given) and not all(given):
        missing = [p for p, w in zip(paths, weights, strict=True) if w is None]
        raise XprepError(f"{missing[0]}: give every dataset of a blend a weight (DATASET@WEIGHT), or none")
    if not paths and mix is None:
        raise XprepError("no DATASET given: name the token datasets to pack (or a --mix file)")
    if mix is not None and paths and not all(given):
        raise XprepError(f"{paths[0]}: datasets given beside --mix {mix} need a weight too (DATASET@WEIGHT)")
    return paths, (weights if all(given) and paths else None), options


def _parse_source(arg: str) -> tuple[str, float | None, dict]:
    """One DATASET argument: (path, weight or None, options). An '@' that belongs to an existing path is kept."""
    path, sep, rest = arg.rpartition("@")
    if not sep or Path(arg).exists():
        return arg, None, {}
    weight, _, listed = rest.partition(":")
    try:
        value = float(weight)
    except ValueError:
        if "://" in path:  # an object-store URL whose name holds an '@'
            return arg, None, {}
        raise XprepError(f"{arg}: {weight!r} is not a number: give a dataset's weight as DATASET@WEIGHT, e.g. "
                         f"{path}@0.3 (or DATASET@WEIGHT:overlong=split to set its options)") from None
    if not (value > 0 and value != float("inf")):
        raise XprepError(f"{arg}: the weight {weight} must be a positive number")
    opts = {}
    for pair in filter(None, listed.split(",")):
        key, eq, val = pair.partition("=")
        if not eq:
            raise XprepError(f"{arg}: expected key=value after ':', e.g. {path}@{weight}:overlong=split")
        check_source_option(key.strip(), val.strip(), arg)
        opts[key.strip()] = val.strip()
    return path, value, opts
