"""``xprep inspect``: what is in a token dataset, a pack cache or a run directory.

Each kind has a ``report(path) -> dict`` (JSON-able) and a ``render(report) -> str`` (tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prep.errors import XprepError

PERCENTILES = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100)


def inspect_path(path: str | Path) -> tuple[dict, str]:
    """Dispatch on what ``path`` is; return (report, rendered text)."""
    path = Path(path)
    if not path.exists():
        raise XprepError(f"{path}: no such file or directory")
    kind = _kind(path)
    if kind == "dataset":
        report = dataset_report(path)
        return report, render_dataset(report)
    if kind == "packed":
        from prep.pack_report import pack_report, render_pack

        report = pack_report(path)
        return report, render_pack(report)
    from train.report import render_run, run_report

    report = run_report(path)
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


def dataset_report(path: Path) -> dict:
    from prep.dataset import TokenDataset

    ds = TokenDataset(path)
    m = ds.manifest
    counts = m["counts"]
    return {
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
    }


def render_dataset(r: dict) -> str:
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
    lines.append("")
    rows = [[name, c["tokens"], c["loss_tokens"],
             f"{c['tokens'] / r['tokens']:.1%}" if r["tokens"] else "-"]
            for name, c in r["categories"].items()]
    lines += table(["category", "tokens", "target tokens", "share"], rows)
    if r["rejects"]["count"]:
        lines.append("")
        lines.append(f"rejected records: {r['rejects']['count']:,} (see {r['path']}/rejects.jsonl)")
        lines += [f"  {k}: {v:,}" for k, v in r["rejects"]["by_reason"].items()]
    return "\n".join(lines)
