"""``xprep inspect``: what is in a token dataset, a pack cache or a run directory.

Each kind has a ``report(path) -> dict`` (JSON-able) and a ``render(report) -> str`` (tables).
A dataset report can add decoded sample documents (``--sample N``), with their target tokens marked
so a loss mask can be checked by eye, and counts of documents longer than given lengths (``--over``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prep.errors import XprepError

PERCENTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)
DEFAULT_OVER = tuple(1024 << k for k in range(8))  # 1,024 … 131,072 tokens
KIND_NAMES = {"dataset": "token dataset", "packed": "pack cache", "run": "run directory"}


@dataclass
class InspectOptions:
    """What ``xprep inspect`` adds to the plain report; one field per option.

    ``sample``/``seed``/``over`` apply to a token dataset, ``plot`` (an image file) to a run directory.
    ``over`` may be given as the option's text, ``"2048,4096"``.
    """

    sample: int | None = None
    seed: int | None = None
    over: tuple[int, ...] | str | None = None
    plot: str | None = None

    def __post_init__(self):
        if self.sample is not None and self.sample < 1:
            raise XprepError(f"--sample {self.sample}: ask for at least 1 document")
        if self.seed is not None and self.sample is None:
            raise XprepError(f"--seed {self.seed} applies only with --sample N (it draws the N documents at random)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise XprepError(f"--seed {self.seed}: use a seed in [0, 2**63)")
        if isinstance(self.over, str):
            self.over = parse_over(self.over)

    def check_applies(self, kind: str, path: Path) -> None:
        given = {"--sample": self.sample, "--over": self.over, "--plot": self.plot}
        wanted = {"--sample": "dataset", "--over": "dataset", "--plot": "run"}
        for flag, value in given.items():
            if value is not None and wanted[flag] != kind:
                raise XprepError(f"{flag} applies only to a {KIND_NAMES[wanted[flag]]}, and {path} is a "
                                 f"{KIND_NAMES[kind]}; drop {flag}")


def parse_over(text: str) -> tuple[int, ...]:
    """``"8192,2048"`` → ``(2048, 8192)``: sorted, distinct, positive token counts."""
    try:
        lengths = sorted({int(part.replace("_", "")) for part in text.split(",")})
    except ValueError:
        raise XprepError(f"--over {text}: expected comma-separated token counts, e.g. --over 2048,4096,8192") from None
    if lengths[0] < 1:
        raise XprepError(f"--over {text}: lengths must be positive numbers of tokens")
    return tuple(lengths)


def inspect_path(path: str | Path, options: InspectOptions | None = None, color: bool = False) -> tuple[dict, str]:
    """Dispatch on what ``path`` is; return (report, rendered text). ``color``: ANSI for a terminal."""
    path, options = Path(path), options or InspectOptions()
    if not path.exists():
        raise XprepError(f"{path}: no such file or directory")
    kind = _kind(path)
    options.check_applies(kind, path)
    if kind == "dataset":
        report = dataset_report(path, options)
        return report, render_dataset(report, color)
    if kind == "packed":
        from prep.pack_report import pack_report, render_pack

        report = pack_report(path)
        return report, render_pack(report)
    from train.report import render_run, run_report

    report = run_report(path, plot=options.plot)
    return report, render_run(report)


def _kind(path: Path) -> str:
    manifest = path / "manifest.json"
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise XprepError(f"{manifest}: not valid JSON; the directory is corrupt") from None
        if fmt == "xprep-dataset":
            return "dataset"
        if fmt == "xprep-packed":
            return "packed"
    if (path / "pack.json").is_file():
        return "packed"
    if (path / "metrics.jsonl").is_file() or (path / "config.json").is_file():
        return "run"
    raise XprepError(f"{path}: neither a token dataset, a pack cache nor a run directory")


def length_stats(lengths: np.ndarray) -> dict:
    """Count, sum, mean and percentiles of document lengths."""
    if len(lengths) == 0:
        return {"count": 0, "sum": 0}
    pct = np.percentile(lengths, PERCENTILES, method="nearest")
    return {
        "count": int(len(lengths)),
        "sum": int(lengths.sum(dtype=np.int64)),
        "mean": round(float(lengths.mean()), 2),
        "percentiles": {f"p{p}": int(v) for p, v in zip(PERCENTILES, pct, strict=True)},
    }


def histogram(lengths: np.ndarray, bins: int = 12) -> list[dict]:
    """Log-spaced length histogram (lengths span orders of magnitude)."""
    if len(lengths) == 0:
        return []
    hi = max(int(lengths.max()), 2)
    edges = np.unique(np.geomspace(1, hi + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    return [{"lo": int(a), "hi": int(b) - 1, "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts,
                                                                                 strict=True)]


def render_histogram(hist: list[dict], width: int = 40) -> list[str]:
    top = max((h["count"] for h in hist), default=0) or 1
    return [f"  {h['lo']:>8,}-{h['hi']:<8,} {h['count']:>10,} {'#' * round(width * h['count'] / top)}"
            for h in hist]


def table(headers: list[str], rows: list[list], align: str | None = None) -> list[str]:
    """A plain text table; numbers right-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)
    def line(values):
        return "  ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(values, widths, align,
                                                                                   strict=True))
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def dataset_report(path: Path, options: InspectOptions | None = None) -> dict:
    from prep.dataset import TokenDataset

    options = options or InspectOptions()
    ds = TokenDataset(path)
    m = ds.manifest
    counts = m["counts"]
    report = {
        "kind": "dataset",
        "path": str(path),
        "fingerprint": m["fingerprint"],
        "tokenizer": m["tokenizer"],
        "chat_template": m.get("chat_template"),
        "dtype": m["streams"]["tokens"]["dtype"],
        "streams": sorted(m["streams"]),
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "lengths": length_stats(ds.lengths),
        "histogram": histogram(ds.lengths),
        "categories": counts["categories"],
        "rejects": m["rejects"],
        "sources": len(m.get("sources", [])),
        "over": over_counts(ds.lengths, options.over or default_over(ds.lengths)),
    }
    if options.sample:
        report["sample"] = sample_documents(ds, options.sample, options.seed)
    return report


# ------------------------------------------------------------------------------------------- --over
def default_over(lengths: np.ndarray) -> tuple[int, ...]:
    """Powers of two from 1,024 up to the first one no document exceeds."""
    longest = int(lengths.max()) if len(lengths) else 0
    below = sum(1 for t in DEFAULT_OVER if t < longest)
    return DEFAULT_OVER[:below + 1]


def over_counts(lengths: np.ndarray, thresholds: tuple[int, ...]) -> list[dict]:
    """Documents (and their tokens) longer than each threshold: what packing at that capacity cuts."""
    n, total = len(lengths), int(lengths.sum(dtype=np.int64))
    out = []
    for t in thresholds:
        longer = lengths > t
        docs, tokens = int(np.count_nonzero(longer)), int(lengths.sum(dtype=np.int64, where=longer))
        out.append({"length": int(t), "documents": docs, "share": docs / n if n else 0.0,
                    "tokens": tokens, "token_share": tokens / total if total else 0.0})
    return out


def render_over(over: list[dict]) -> list[str]:
    rows = [[f"> {o['length']:,}", o["documents"], f"{o['share']:.1%}", o["tokens"], f"{o['token_share']:.1%}"]
            for o in over]
    return ["documents longer than N tokens (what `xprep pack` at that capacity drops, truncates or splits)",
            *table(["longer than", "documents", "share", "tokens", "token share"], rows)]


# ----------------------------------------------------------------------------------------- --sample
ANSI_TARGET, ANSI_CATEGORY, ANSI_RESET = "\x1b[1;32m", "\x1b[35m", "\x1b[0m"
# Decoded text is untrusted: control characters (other than newline and tab) are shown, not obeyed.
_VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), 127] if chr(c) not in "\n\t"}


def sample_documents(ds, n: int, seed: int | None) -> dict:
    """The first ``n`` documents, or ``n`` drawn at random with ``seed`` (in index order), decoded."""
    total = len(ds)
    k = min(n, total)
    if seed is None:
        picked = np.arange(k)
    else:
        picked = np.sort(np.random.default_rng(seed).choice(total, k, replace=False))
    tokenizer = load_decoder(ds) if k else None
    return {"selection": "first" if seed is None else "random", "seed": seed, "requested": n, "of": total,
            "documents": [decode_document(ds, int(i), tokenizer) for i in picked]}


def load_decoder(ds):
    """The ``tokenizers.Tokenizer`` recorded in the dataset's manifest (path and sha256 checked)."""
    info = ds.manifest.get("tokenizer") or {}
    path, manifest = info.get("path"), ds.path / "manifest.json"
    if not path or not Path(path).is_file():
        raise XprepError(f"--sample: the tokenizer {path} recorded in {manifest} is gone; restore it at that path "
                         "to decode the documents")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if info.get("sha256") and digest != info["sha256"]:
        raise XprepError(f"--sample: {path} is not the tokenizer {ds.path} was made with (its sha256 differs from "
                         f"{manifest}); restore that tokenizer.json to decode the documents")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise XprepError(f"--sample: {path}: not a tokenizer.json ({e}); restore the original") from None


def span_bounds(mask: np.ndarray, cats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of the maximal runs of tokens with the same (target, category)."""
    if len(mask) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.flatnonzero((mask[1:] != mask[:-1]) | (cats[1:] != cats[:-1])) + 1
    return np.concatenate([[0], change]), np.concatenate([change, [len(mask)]])


def decode_document(ds, i: int, tokenizer) -> dict:
    """Document ``i`` as spans of equal (target, category), each decoded at once."""
    d = ds.document(i)
    ids, mask, cats = d["input_ids"], d["loss_mask"], d["category_ids"]
    names = ds.category_names
    spans = []
    for s, e in zip(*span_bounds(mask, cats), strict=True):
        cid = int(cats[s])
        name = names[cid] if cid < len(names) and names[cid] is not None else str(cid)
        spans.append({"target": bool(mask[s]), "category": name, "tokens": int(e - s),
                      "text": tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False)})
    return {"index": i, "tokens": int(len(ids)), "targets": int(np.count_nonzero(mask)), "spans": spans}


def render_sample(sample: dict, color: bool) -> list[str]:
    docs = sample["documents"]
    which = (f"the first {len(docs):,} of {sample['of']:,} documents" if sample["selection"] == "first" else
             f"{len(docs):,} of {sample['of']:,} documents drawn at random (--seed {sample['seed']})")
    legend = ("target tokens in green, {category} in magenta where the category changes" if color else
              "target tokens in [[double brackets]], {category} where the category changes")
    lines = [f"sample: {which}; {legend}"]
    for d in docs:
        lines += ["", f"--- document {d['index']:,}: {d['tokens']:,} tokens, {d['targets']:,} targets ---",
                  render_spans(d["spans"], color)]
    return lines


def render_spans(spans: list[dict], color: bool) -> str:
    out, category = [], None
    for s in spans:
        if s["category"] != category:
            category = s["category"]
            out.append(f"{ANSI_CATEGORY}{{{category}}}{ANSI_RESET}" if color else f"{{{category}}}")
        text = s["text"].translate(_VISIBLE)
        if s["target"]:
            text = f"{ANSI_TARGET}{text}{ANSI_RESET}" if color else f"[[{text}]]"
        out.append(text)
    return "".join(out)


def render_dataset(r: dict, color: bool = False) -> str:
    lines = [
        f"dataset {r['path']}  (fingerprint {r['fingerprint'][:16]})",
        f"  tokenizer     {r['tokenizer'].get('path')}  vocab {r['tokenizer'].get('vocab_size'):,}"
        f"  dtype {r['dtype']}",
    ]
    if r.get("chat_template"):
        lines.append(f"  chat template {r['chat_template'].get('name')}")
    share = r["loss_tokens"] / r["tokens"] if r["tokens"] else 0.0
    lines += [
        f"  documents     {r['documents']:,}   (from {r['sources']} sources, {r['rejects']['count']:,} rejected)",
        f"  tokens        {r['tokens']:,}",
        f"  target tokens {r['loss_tokens']:,}  ({share:.1%})",
    ]
    if r["lengths"]["count"]:
        p = r["lengths"]["percentiles"]
        lines.append("  length        mean {:,.1f}  " .format(r["lengths"]["mean"]) + "  ".join(
            f"{k} {p[k]:,}" for k in ("p0", "p10", "p50", "p90", "p99", "p100")))
        lines.append("")
        lines.append("length histogram (tokens per document)")
        lines += render_histogram(r["histogram"])
        lines += ["", *render_over(r["over"])]
    lines.append("")
    rows = [[name, c["tokens"], c["loss_tokens"],
             f"{c['tokens'] / r['tokens']:.1%}" if r["tokens"] else "-"]
            for name, c in r["categories"].items()]
    lines += table(["category", "tokens", "target tokens", "share"], rows)
    if r["rejects"]["count"]:
        lines.append("")
        lines.append(f"rejected records: {r['rejects']['count']:,} (see {r['path']}/rejects.jsonl)")
        lines += [f"  {k}: {v:,}" for k, v in r["rejects"]["by_reason"].items()]
    if "sample" in r:
        lines += ["", *render_sample(r["sample"], color)]
    return "\n".join(lines)
