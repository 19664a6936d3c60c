"""``PackConfig``: what ``xprep pack`` packs and how, one field per option, checked once.

Its own module so that the packing pipeline (``xprep.prep.pack.kernels``) takes it without importing the pack
command (``xprep.prep.pack.cache``), which depends on that pipeline. What differs between methods (what sizes
the bins, which options apply, the defaults) is read from the method registry (``xprep.prep.pack.methods``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.pack.methods import (
    CAPACITY_FIELDS,
    OVERLONG,
    PackingMethod,
    method_names,
    packing_method,
    packing_methods,
    with_option,
)

DEFAULT_GROUP_SIZE = 100_000
DEFAULT_DP_MICRO_BATCHES = 16  # a wider window balances micro-steps better (1.33 → 1.09 at 8 ranks)
DOCUMENT, CAUSAL = "document", "causal"  # --attention inside a chunk sample (chunk.py says what each means)
ATTENTION = (DOCUMENT, CAUSAL)
SOURCE_OPTIONS = ("method", "overlong")  # what one source of a blend may set for itself


@dataclass
class PackConfig:
    """What to pack and how; one field per ``xprep pack`` option.

    ``seq_len`` or ``max_tokens`` is the capacity of the bins, whichever the method is sized by
    (``PackingMethod.sized_by``). ``None`` fields take the method's default.
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
    split: tuple[float, ...] | None = None  # --split TRAIN,VALID[,TEST]: shares of documents (parse_split)
    attention: str = DOCUMENT  # --attention: documents apart inside a chunk sample, or one causal span (Megatron)
    eod_mask_loss: bool = False  # --eod-mask-loss: no EOD token is a target (chunk)
    defaulted: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)  # filled by the method

    def __post_init__(self):
        self.defaulted = tuple(n for n in ("overlong", "shuffle", "group_size", "dp_micro_batches")
                               if getattr(self, n) is None)
        spec = packing_method(self.method)  # an unknown --method is an error here, before anything else
        self._check_capacity_option(spec)
        self._check_method_options(spec)
        self._check_size_options()
        if spec.fixed_length_samples:
            self._check_samples()
        self._check_attention(spec)
        if self.overlong is None:
            self.overlong = spec.default_overlong
        if self.overlong not in OVERLONG:
            raise XprepError(f"--overlong {self.overlong!r} is unknown: choose one of {', '.join(OVERLONG)}")
        if self.shuffle is None:
            self.shuffle = spec.default_shuffle
        if not 0 <= self.seed < 2**63:
            raise XprepError(f"--seed {self.seed}: use a seed in [0, 2**63)")
        self._check_cp()

    def _check_capacity_option(self, spec: PackingMethod) -> None:
        wanted = spec.capacity_option
        other = next(f for f in CAPACITY_FIELDS if f != spec.sized_by)
        if getattr(self, other) is not None:
            raise XprepError(f"--{other.replace('_', '-')} does not apply to --method {self.method}: its bins are "
                             f"sized by {wanted}")
        value = self.capacity
        if value is None:
            what = "the sample length in tokens" if spec.fixed_length_samples else "the bin capacity in tokens"
            raise XprepError(f"--method {self.method} needs {wanted} N ({what})")
        if value < 1:
            raise XprepError(f"{wanted} {value} must be a positive number of tokens")

    def _check_method_options(self, spec: PackingMethod) -> None:
        """The options only some methods take (``PackingMethod.options``): refused by the others, defaulted."""
        for name in ("group_size", "balance_dp"):  # (dp_micro_batches goes with balance_dp, checked below)
            if getattr(self, name) is not None and name not in spec.options:
                raise XprepError(f"--{name.replace('_', '-')} applies only to --method "
                                 f"{' or '.join(with_option(name))}, not {self.method}")
        if "group_size" in spec.options:
            self.group_size = DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size
            if self.group_size < 1:
                raise XprepError(f"--group-size {self.group_size} must be ≥ 1 (documents per packing group)")
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

    def _check_samples(self) -> None:
        """Options that mean nothing when documents are cut by the stream into --seq-len samples (chunk)."""
        if self.overlong not in (None, "split"):  # split is what chunk does (and what a rebuilt config holds)
            raise XprepError(f"--overlong {self.overlong} does not apply to --method {self.method}: documents are "
                             "walked as one stream cut into --seq-len samples, so none is dropped or truncated; "
                             "leave it out")
        if self.cp_size > 1:
            check_chunk_cp(self.seq_len, self.cp_size, "--cp-size", method=self.method)
            # Context parallelism zigzags a chunk sample whole, unpadded (train/cp.py), so the samples are the same
            # for every C: --cp-size only checks that --seq-len splits into 2·C chunks, and `xtrain run --cp C`
            # takes any chunk pack whose --seq-len does. It is therefore neither recorded nor part of the cache key:
            # with or without --cp-size, the same command makes (or finds) the same entry, whose pack.json does not
            # claim a CP size it was never made for (and the keys of chunk packs made before stay as they were).
            self.cp_size = 1

    def _check_attention(self, spec: PackingMethod) -> None:
        """--attention and --eod-mask-loss say how a chunk sample is trained: only methods of fixed-length samples
        take them (the other methods' bins hold whole documents, kept apart)."""
        if self.attention not in ATTENTION:
            raise XprepError(f"--attention {self.attention!r} is unknown: choose one of {', '.join(ATTENTION)}")
        given = [o for o, on in (("--attention causal", self.attention != DOCUMENT),
                                 ("--eod-mask-loss", self.eod_mask_loss)) if on]
        if given and not spec.fixed_length_samples:
            chunked = " or ".join(m.name for m in packing_methods() if m.fixed_length_samples)
            raise XprepError(f"{given[0]} applies only to --method {chunked} (samples cut from the document stream), "
                             f"not {self.method}, whose bins keep whole documents apart: leave it out")

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
    def spec(self) -> PackingMethod:
        """The registry's entry of ``method`` (``xprep.prep.pack.methods``)."""
        return packing_method(self.method)

    @property
    def capacity(self) -> int | None:
        return getattr(self, self.spec.sized_by)

    @property
    def capacity_option(self) -> str:
        return self.spec.capacity_option

    @property
    def align(self) -> int:
        """Each item's cost is its length rounded up to a multiple of this (2·cp, or 1)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def key_fields(self) -> dict:
        """The options that change the output (the cache key hashes these plus the data)."""
        fields = {"method": self.method, "capacity": self.capacity, "overlong": self.overlong,
                  "cp_size": self.cp_size, "shuffle": self.shuffle,
                  "seed": self.seed if self.shuffle else None}
        fields.update(self.spec.option_values(self))  # the method's own options (the key sorts its fields)
        for name in ("total_tokens", "epochs", "split"):  # only when given: the keys of other packs stay as they were
            if name == "epochs" and self.epochs == 1:  # what the default sizes too: the same pack, the same key
                continue
            if getattr(self, name) is not None:
                fields[name] = list(self.split) if name == "split" else getattr(self, name)
        if self.attention != DOCUMENT:  # likewise: the default keeps the keys of the packs made before it
            fields["attention"] = self.attention
        if self.eod_mask_loss:
            fields["eod_mask_loss"] = True
        return fields

    def for_source(self, method: str | None, overlong: str | None, masked: bool) -> PackConfig:
        """The options one source of a blend is packed with: its own ``method``/``overlong`` where it sets them,
        else the command's; options the command left to the method's default take the source's method's. A
        source with no loss mask (pretraining text) is split where the command did not choose (--overlong):
        cutting a long text loses nothing, and dropping it would skew the mix towards short documents."""
        method = method or self.method
        if overlong is None and "overlong" not in self.defaulted:
            overlong = self.overlong
        if overlong is None and not masked and not packing_method(method).fixed_length_samples:
            overlong = "split"
        kept = {n: getattr(self, n) for n in ("shuffle", "group_size", "dp_micro_batches") if n not in self.defaulted}
        if "group_size" not in packing_method(method).options:
            kept.pop("group_size", None)
        return PackConfig(method=method, seq_len=self.seq_len, max_tokens=self.max_tokens, overlong=overlong,
                          cp_size=self.cp_size, balance_dp=self.balance_dp, seed=self.seed, split=self.split,
                          attention=self.attention, eod_mask_loss=self.eod_mask_loss, **kept)

    def for_validation(self) -> PackConfig:
        """The options of the ``--split`` validation part: the same, but a chunk pack of it is one epoch."""
        return replace(self, total_tokens=None, epochs=None)

    def to_json(self) -> dict:
        return {**asdict(self), "capacity": self.capacity, "align": self.align}


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The positive multiples of ``unit`` next to ``value`` (below and above): the values to suggest for it."""
    below = value // unit * unit
    return [m for m in (below, below + unit) if m > 0 and m != value]


def check_chunk_cp(seq_len: int, cp_size: int, flag: str, entry: str | None = None, *, method: str) -> None:
    """Refuse context parallelism over ``cp_size`` ranks on chunk samples of ``seq_len`` tokens unless 2·C divides it.

    A chunk sample (of a ``--method`` whose bins are ``fixed_length_samples``) is exactly ``seq_len`` tokens of
    document pieces, with no room for padding: context parallelism cuts it into 2·C equal chunks (train/cp.py).
    ``flag`` is the option that set C (``--cp-size`` when packing, ``--cp`` when training), ``entry`` the pack
    being trained on (None when packing).
    """
    unit = 2 * cp_size
    if seq_len % unit == 0:
        return
    what = f"the --seq-len of the --method {method} pack {entry}" if entry else f"--seq-len with --method {method}"
    near = " or ".join(str(m) for m in nearest_multiples(seq_len, unit))
    fix = f"repack it with --seq-len {near}" if entry else f"use --seq-len {near}"
    if seq_len % 2 == 0 and seq_len > 2:
        fix += f", or {'use ' if entry else ''}a {flag} that divides {seq_len // 2}"
    raise XprepError(f"{flag} {cp_size} needs {what} to be a multiple of 2·cp={unit} (context parallelism cuts "
                     f"every sample into {unit} equal chunks), and {seq_len} is not: {fix}")


def parse_split(text: str | None) -> tuple[float, ...] | None:
    """``--split 99,1`` → ``(99, 1)``; ``--split 969,30,1`` → ``(969, 30, 1)``: the shares of documents for
    training, validation and (with a third share) test, as Megatron-LM's ``--split`` string.

    Shares are non-negative integers or decimals (``0.9,0.05,0.05``), normalized to their sum as Megatron does;
    integers stay integers, so ``99,1`` keys the cache exactly as before three shares existed. A zero share means
    no such part (``90,0,10``: no validation); ``100,0,0`` holds nothing out and is no split at all (None). With
    two shares validation must have a share (``99,0`` would be no split: leave --split out), as always.
    """
    if text is None:
        return None
    shares = [_share(p) for p in text.split(",")]
    if len(shares) not in (2, 3) or None in shares:
        raise XprepError(f"--split {text}: expected TRAIN,VALID or TRAIN,VALID,TEST shares as two or three "
                         "non-negative numbers, e.g. 99,1 or 969,30,1")
    if sum(shares) == 0:
        raise XprepError(f"--split {text}: every share is zero; give training a share, e.g. --split 969,30,1")
    if shares[0] == 0:
        raise XprepError(f"--split {text}: leaves nothing to train on; give training a share, e.g. --split 99,1")
    if len(shares) == 2 and shares[1] == 0:
        raise XprepError(f"--split {text}: leaves validation empty; give it a share, e.g. --split 99,1")
    if len(shares) == 3 and shares[1] == shares[2] == 0:
        return None  # everything trains: the plain pack, with its key
    return tuple(shares)


def _share(text: str) -> float | None:
    """One share of --split: an int when written as one (the cache key of ``99,1`` stays as it was), else a
    finite non-negative float; None when it is neither."""
    text = text.strip()
    try:
        value = int(text) if text.isdigit() else float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


def split_counts(split: tuple[float, ...], n_docs: int) -> tuple[int, int, int]:
    """Documents of each part (train, validation, test) of ``n_docs`` under a three-share ``split``, rounded as
    Megatron-LM's ``get_split_indices`` rounds (so the same string cuts the same counts): shares normalized to
    sum 1 in float64, bound k+1 = bound k + round(share_k · n) (Python's round: half to even), then every bound
    shifted by the excess of the last over n, which lands on the training part."""
    shares = np.asarray(split, np.float64)
    shares = (shares / shares.sum()).tolist()
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(n_docs))))
    excess = bounds[-1] - n_docs
    bounds = [0] + [b - excess for b in bounds[1:]]
    return bounds[1] - bounds[0], bounds[2] - bounds[1], bounds[3] - bounds[2]


def check_source_option(key: str, value, where: str) -> None:
    """One per-source option of a blend (a mix file's ``method:``/``overlong:``, or ``DATASET@W:key=value``)."""
    allowed = {"method": method_names(), "overlong": OVERLONG}.get(key)
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
