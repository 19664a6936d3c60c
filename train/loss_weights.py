"""Category and source weights in the loss (``--category-weight NAME=W``, ``--source-weight NAME=W``).

A target token weighs w = (its category's weight) × (its blend source's weight), 1 for a name not given. The
loss of a step is then Σ w·CE / Σ w over the targets of the whole global batch: Σ w is counted on the CPU before
the forward and all-reduced with the target count (train/trainer.py), exactly as the unweighted loss's
denominator is, so the gradient stays the same for any dp × cp × accumulation split. A weight of 0 keeps the
token in the forward (and in the per-category and per-source channel losses, which stay unweighted) and out
of the gradient. Weights that are all 1 are no weighting at all (``LossWeights.build`` returns None): such a
run takes the unweighted code path and its values bit for bit.

Evaluation is never weighted: the validation loss stays the plain token mean, comparable across runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from xprep.prep.errors import XprepError
from xprep.train.loss import IGNORE

WEIGHTS = "loss_weights"  # the batch key of each token's weight (1, T), set by the trainer in a weighted run
FLAGS = {"category": "--category-weight", "source": "--source-weight"}


def parse_weights(value, flag: str) -> dict[str, float] | None:
    """A weight option as ``{name: weight}``: from a mapping (a config file), or from ``NAME=W`` strings (the
    repeated flag, or a list in a config file); None or empty: none given. Refuses a malformed item, a name given
    twice and a weight that is negative or not finite."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [_split(item, flag) for item in value]
    else:
        raise XprepError(f"{flag}: {value!r} is neither NAME=W items nor a {{name: weight}} object")
    out: dict[str, float] = {}
    for name, weight in items:
        if name in out:
            raise XprepError(f"{flag} {name} given twice ({out[name]:g} and {weight}): keep one")
        out[name] = _weight(name, weight, flag)
    return out or None


def _split(item, flag: str) -> tuple[str, object]:
    name, eq, weight = str(item).rpartition("=")
    if not eq or not name:
        raise XprepError(f"{flag} {item!r} is not NAME=W (e.g. {flag} user=0.1)")
    return name, weight


def _weight(name: str, weight, flag: str) -> float:
    try:
        w = float(weight) if not isinstance(weight, bool) else math.nan
    except (TypeError, ValueError):
        w = math.nan
    if not (math.isfinite(w) and w >= 0):
        raise XprepError(f"{flag} {name}={weight}: a weight must be a finite number ≥ 0 (0 keeps the tokens out "
                         "of the gradient)")
    return w


@dataclass(frozen=True)
class LossWeights:
    """Each category id's and each source id's weight (the pack's tables, ``PackedDataset.category_names`` and
    ``source_names``); ``token_weights`` turns a micro-batch's ids into per-token weights."""

    category_names: tuple[str, ...]
    source_names: tuple[str, ...]
    category: tuple[float, ...]
    source: tuple[float, ...]

    @classmethod
    def build(cls, category_weight: Mapping[str, float] | None, source_weight: Mapping[str, float] | None,
              category_names: Sequence[str | None], source_names: Sequence[str] | None) -> LossWeights | None:
        """The weights for a pack, None when every weight is 1 (nothing to weigh). A name the pack does not have
        is refused with the names it has; so are weights that leave no target any weight."""
        cats = tuple(n if n else str(i) for i, n in enumerate(category_names))
        sources = tuple(source_names or ("all",))
        category = _by_id(category_weight, cats, "category")
        source = _by_id(source_weight, sources, "source")
        if all(w == 1.0 for w in category + source):
            return None
        for kind, names, weights in (("category", cats, category), ("source", sources, source)):
            if not any(weights):
                raise XprepError(f"{FLAGS[kind]}: every {kind} of the pack ({', '.join(names)}) has weight 0, so no "
                                 "token would count in the loss: give one of them a weight > 0")
        return cls(cats, sources, category, source)

    def token_weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each token's weight (1, T) float32, 0 where there is no target; the ids as ``xprep.train.loss.Channels``
        reads them (a missing key is id 0; ids past a table count as its last)."""
        labels = batch["labels"]
        w = _lookup(self.category, batch.get("category_ids"), labels) * _lookup(self.source, batch.get("source_ids"),
                                                                              labels)
        return torch.where(labels != IGNORE, w, 0.0)

    def record(self) -> dict[str, dict[str, float]]:
        """The weights by name, as run.json and a checkpoint record them."""
        return {"category": dict(zip(self.category_names, self.category, strict=True)),
                "source": dict(zip(self.source_names, self.source, strict=True))}

    def text(self) -> str:
        """The weights other than 1, e.g. "category user 0.1, system 0; source web 2"."""
        parts = []
        for kind, names, weights in (("category", self.category_names, self.category),
                                     ("source", self.source_names, self.source)):
            given = [f"{n} {w:g}" for n, w in zip(names, weights, strict=True) if w != 1.0]
            if given:
                parts.append(f"{kind} " + ", ".join(given))
        return "; ".join(parts)


def _by_id(given: Mapping[str, float] | None, names: tuple[str, ...], kind: str) -> tuple[float, ...]:
    given = dict(given or {})
    unknown = [n for n in given if n not in names]
    if unknown:
        raise XprepError(f"{FLAGS[kind]} {unknown[0]}={given[unknown[0]]:g}: the pack has no {kind} {unknown[0]!r}; "
                         f"its {'categories' if kind == 'category' else 'sources'}: {', '.join(names)}")
    return tuple(float(given.get(n, 1.0)) for n in names)


def _lookup(table: tuple[float, ...], ids: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(table, dtype=torch.float32, device=labels.device)
    if ids is None:
        return values[0].expand(labels.shape)
    return values[ids.clamp(max=len(table) - 1)]


def weight_changes(saved: dict | None, now: LossWeights | None) -> list[str]:
    """"--category-weight NAME old → new" for each weight a resumed run changes from its checkpoint's (``saved``:
    ``LossWeights.record()``, None for an unweighted run or a checkpoint from before weights)."""
    after = now.record() if now is not None else {}
    out = []
    for kind in ("category", "source"):
        old, new = (saved or {}).get(kind) or {}, after.get(kind) or {}
        for name in sorted(set(old) | set(new), key=lambda n: (n not in new, n)):
            a, b = float(old.get(name, 1.0)), float(new.get(name, 1.0))
            if a != b:
                out.append(f"{FLAGS[kind]} {name} {a:g} → {b:g}")
    return out
