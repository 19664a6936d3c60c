"""The packing methods of ``xprep pack --method``: one registry entry per method, the one place each is named.

Whatever differs between methods is an attribute of its entry (``PackingMethod``), read where it matters:

- ``PackConfig`` (config.py) checks the options against it (what sizes the bins, which options apply, the
  defaults) and puts the method's own options into the cache key;
- the pipeline (kernels.py) packs with its ``bins`` function, or cuts the document stream into samples for a
  method of ``fixed_length_samples`` (chunk.py); the pack cache (cache.py) and blends (mixture.py) ask it how
  a pack is sized and whether its bins blend with other methods';
- ``xprep pack --method`` lists the registry's names and help lines when it is parsed or shown (cli.py), so a
  method registered after import is accepted too;
- ``xprep inspect`` describes a pack by it (``describe``), and the trainer asks it how to read a pack's bins
  (train/data.py, train/samplers.py);
- schemas/pack.schema.json and schemas/mix.schema.json list the built-in names (tests/prep/pack/test_methods.py
  keeps them equal to the registry, and greps the product code for any name spelled outside this file).

An unknown name is an error wherever it is looked up (``packing_method``), never a silent default.

To add a method: write its ``bins`` function (or reuse one), then ``register_method(PackingMethod(...))``, here for a
built-in one (and its name into the two schemas' enums), or from your own module for a plugin that must run
before the command does; ``tests/prep/pack/test_methods.py::test_a_method_registered_from_outside_packs_and_inspects``
registers a toy method from the test file alone and runs it through ``xprep pack`` and ``xprep inspect``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from xprep.prep.errors import XprepError
from xprep.prep.pack.bins import UNDERFULL, grouped_ffd, next_fit, repack_underfull

OVERLONG = ("drop", "truncate", "split")  # what --overlong may do to a document longer than the capacity
CAPACITY_FIELDS = ("seq_len", "max_tokens")  # the PackConfig fields that can size a method's bins
METHOD_OPTIONS = ("group_size", "balance_dp", "dp_micro_batches")  # PackConfig fields only some methods take
NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")  # an entry is named <method>-<key16>, a blend joins names with '+'

BinFunction = Callable[[np.ndarray, int, dict], tuple[np.ndarray, np.ndarray | None]]
"""``bins(costs, capacity, options) → (offsets, items)``: the items, in visiting order, packed into bins.

``costs``: int32[n], each item's cost (its length rounded up for context parallelism), each in 1..capacity.
``options``: the method's own options by ``PackConfig`` field name (``PackingMethod.options``, e.g.
``{"group_size": 100000}``). Returns CSR ``offsets`` (int64[bins + 1]) over ``items``, the new order of the
items (int64[n], a permutation), or None when they stay in visiting order. Every item in exactly one bin, no
bin empty, and no bin's Σ cost over ``capacity``: the trainer's batches have room for nothing more.
"""


@dataclass(frozen=True)
class PackingMethod:
    """One packing method: its name, what it needs and how it packs, and the facts the rest of xprep asks of it.

    ``sized_by``: the ``PackConfig`` field (and option) that sizes its bins, ``seq_len`` (a row of the
    batch) or ``max_tokens`` (a token budget). ``options``: the fields that apply to it alone, given to
    ``bins`` and hashed into the cache key (``group_size``; ``balance_dp`` with ``dp_micro_batches``, which
    the pipeline applies after ``bins``); any other method refuses them. ``fixed_length_samples``: its bins
    are samples of exactly the capacity cut from the documents walked as one stream (chunk.py), so ``bins`` is
    None, nothing is overlong, the pack is sized by ``--total-tokens``/``--epochs``, labels look one token
    ahead, and context parallelism zigzags whole samples. ``bin_is_micro_batch``: a bin is one whole
    micro-batch of at most ``max_tokens`` tokens (trained one bin per micro-batch, counted by its tokens in a
    blend). ``blends_with_others``: its bins are rows of ``--seq-len`` tokens that a blend may mix with those
    of other such methods (the others blend only with their own kind).
    """

    name: str
    help: str  # its part of `xprep pack --help`'s --method line: what it does, in a few words
    bins: BinFunction | None = None
    sized_by: str = "seq_len"
    options: tuple[str, ...] = ()
    default_overlong: str = "drop"
    default_shuffle: bool = False
    fixed_length_samples: bool = False
    bin_is_micro_batch: bool = False
    blends_with_others: bool = False

    def __post_init__(self):
        """A mistake in an entry is the programmer's, found when it is registered (a ValueError, not a user error)."""
        problems = [
            (not NAME.fullmatch(self.name) or self.name == "blend",
             f"name {self.name!r}: lowercase letters and digits joined by '-', not 'blend'"),
            (not self.help.strip(), "help: say in a few words what it does"),
            (self.sized_by not in CAPACITY_FIELDS, f"sized_by {self.sized_by!r}: one of {CAPACITY_FIELDS}"),
            (not set(self.options) <= set(METHOD_OPTIONS), f"options {self.options}: a subset of {METHOD_OPTIONS}"),
            (("balance_dp" in self.options) != ("dp_micro_batches" in self.options),
             "options: balance_dp and dp_micro_batches go together"),
            (self.default_overlong not in OVERLONG, f"default_overlong {self.default_overlong!r}: one of {OVERLONG}"),
            ((self.bins is None) != self.fixed_length_samples,
             "bins: a function, unless the method cuts fixed-length samples (then None)"),
            (self.fixed_length_samples and (self.sized_by != "seq_len" or self.options or self.blends_with_others
                                            or self.bin_is_micro_batch or self.default_overlong != "split"),
             "fixed_length_samples: sized by seq_len, overlong split, no options, blending only with its own kind"),
            (self.bin_is_micro_batch and self.sized_by != "max_tokens", "bin_is_micro_batch: sized by max_tokens"),
            (self.blends_with_others and self.sized_by != "seq_len", "blends_with_others: sized by seq_len"),
        ]
        wrong = [what for bad, what in problems if bad]
        if wrong:
            raise ValueError(f"packing method {self.name!r}: {'; '.join(wrong)}")

    @property
    def capacity_option(self) -> str:
        """The option that sizes its bins, as typed: ``--seq-len`` or ``--max-tokens``."""
        return "--" + self.sized_by.replace("_", "-")

    def option_values(self, config) -> dict:
        """Its own options' values in ``config`` (a ``PackConfig``): what ``bins`` gets, and the cache key holds."""
        return {name: getattr(config, name) for name in self.options}

    def describe(self) -> dict:
        """What ``xprep inspect`` shows and words by (JSON-able): the inspect stage reads a pack's method here."""
        return {"name": self.name, "help": self.help, "capacity_option": self.capacity_option,
                "options": list(self.options), "fixed_length_samples": self.fixed_length_samples,
                "bin_is_micro_batch": self.bin_is_micro_batch}


# ------------------------------------------------------------------------------------------- bins functions
def in_order(costs: np.ndarray, capacity: int, options: dict) -> tuple[np.ndarray, None]:
    """Order-preserving greedy (``next_fit``): the next bin when the next item does not fit. O(n)."""
    return next_fit(costs, capacity), None


def grouped_first_fit_decreasing(costs: np.ndarray, capacity: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """First-fit-decreasing over groups of ``group_size`` items in parallel, then the groups' underfull tail bins
    pooled and packed again (``grouped_ffd``, ``repack_underfull``)."""
    offsets, items, load = grouped_ffd(costs, capacity, options["group_size"])
    return repack_underfull(costs, offsets, items, load, capacity, math.ceil(UNDERFULL * capacity))


# ------------------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, PackingMethod] = {}


def register_method(method: PackingMethod) -> PackingMethod:
    """Add a packing method: from then on ``--method NAME`` packs with it everywhere. A name taken is refused."""
    if method.name in _REGISTRY:
        raise ValueError(f"packing method {method.name!r} is registered already; unregister it first")
    _REGISTRY[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove a method registered from outside this module (a plugin, a test); the built-in ones stay."""
    if name in BUILT_IN:
        raise ValueError(f"packing method {name!r} is built in: its packs and cache keys depend on it")
    if _REGISTRY.pop(name, None) is None:
        raise ValueError(f"packing method {name!r} is not registered")


def packing_methods() -> tuple[PackingMethod, ...]:
    """Every registered method, built-in ones first, in the order they were registered."""
    return tuple(_REGISTRY.values())


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def packing_method(name: str, where: str | None = None) -> PackingMethod:
    """The method called ``name``; an unknown name is an ``XprepError`` listing the known ones.

    ``where``: the pack entry (or file) that names it, for a name read back from disk rather than typed as
    ``--method`` (a method registered by the process that packed it, and not by this one).
    """
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    known = ", ".join(_REGISTRY)
    if where is None:
        raise XprepError(f"--method {name!r} is unknown: choose one of {known}")
    raise XprepError(f"{where}: made by packing method {name!r}, which is not registered in this xprep (it knows "
                     f"{known}); register it as the process that packed it did, or repack with one of those")


def methods_of(method: str | None, where: str | None = None) -> list[PackingMethod]:
    """The methods a pack.json's ``config.method`` names: one, or a blend's sources' joined by '+'
    (``sequential+multipack``); none for None (a config that names no method)."""
    return [packing_method(name, where) for name in method.split("+")] if method else []


def with_option(option: str) -> list[str]:
    """The names of the methods that take ``option`` (a ``METHOD_OPTIONS`` field): for messages."""
    return [m.name for m in _REGISTRY.values() if option in m.options]


# Pretraining text is usually packed in order and long documents are worth keeping (split); SFT conversations lose
# meaning when cut, so the SFT-oriented methods drop them.
SEQUENTIAL = register_method(PackingMethod(
    "sequential", "in order, next bin when full", in_order, default_overlong="split", blends_with_others=True))
MULTIPACK = register_method(PackingMethod(
    "multipack", "first-fit-decreasing over groups, then underfull bins repacked together (densest)",
    grouped_first_fit_decreasing, options=("group_size",), blends_with_others=True))
TOKEN_AWARE = register_method(PackingMethod(
    "token-aware", "in order, micro-batches of at most --max-tokens", in_order, sized_by="max_tokens",
    options=("balance_dp", "dp_micro_batches"), default_shuffle=True, bin_is_micro_batch=True))
CHUNK = register_method(PackingMethod(
    "chunk", "documents as one stream cut into --seq-len samples (Megatron GPTDataset, 100 % fill, pretraining)",
    default_overlong="split", fixed_length_samples=True))
BUILT_IN = method_names()
