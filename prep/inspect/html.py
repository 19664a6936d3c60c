"""``xprep inspect PATH... --html OUT``: one self-contained page for any mix of datasets, packs and runs.

The page is built from the report dicts ``--json`` prints (``prep/inspect/dataset_report.py``,
``prep/inspect/pack_report.py``, ``train/report.py``) and from nothing else: every number shown is a value of a report,
tagged with where it comes from (``data-path``, a JSON pointer, and ``data-value``); histograms arrive binned. Charts
are inline SVG (``prep/inspect/charts.py``), the style and the small script that adds hover values and legend toggles
are inlined from ``prep/inspect/assets/``, and a Content-Security-Policy forbids every fetch: the file opens from disk
with no network, and its tables read without JavaScript. A section per dataset and per pack; the runs share one section
whose charts overlay them (a dash pattern per run). A name (category or source) has one colour on the whole page.

One module (over 500 lines) because a page is one thing: every section builder writes into the same page with the
same tagging of values (``data-path``/``data-value``) and the same colour per name; the charts, the largest
separable part, are already ``charts.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path

from xprep.prep.errors import XprepError, machine_error
from xprep.prep.inspect.charts import (
    ALL_COLOUR,
    NEUTRAL,
    Bar,
    Key,
    Marker,
    Series,
    Source,
    attrs,
    bar_chart,
    figure,
    histogram,
    line_chart,
    percent,
    short,
    times,
)
from xprep.prep.inspect.text import blend_unit_label
from xprep.prep.io import check_output_file, write_atomic

ASSETS = Path(__file__).parent / "assets"
# Tableau 10, then 6 more of its 20: distinct for the colour-blind and on paper; names beyond get hues below.
# Yellow and the light tints come last: thin lines in them read poorly on white.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#9c755f", "#ff9da7", "#499894",
           "#d37295", "#edc948", "#8cd17d", "#b6992d", "#a0cbe8", "#ffbe7d", "#86bcb6")
UNCATEGORIZED = "#a3abb6"
DASHES = ("", "7 4", "2 3", "10 3 2 3", "4 2 1 2")  # one per run, in the order given
RANK_COLOURS = ("#08306b", "#2171b5", "#4292c6", "#6baed6", "#9ecae1", "#c6dbef")
OVERALL = "*"  # series id of the loss over all targets (no category can be named so in a legend)
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


# ------------------------------------------------------------------------------------------- page
def write_page(reports: Sequence[dict], out: str | Path) -> None:
    """The page for ``reports`` (as ``--json`` gives them), written atomically to ``out``."""
    check_drawable(reports)
    try:
        write_atomic(out, page(reports))
    except OSError as e:
        raise machine_error(e, str(out), "--html") or XprepError(
            f"--html {out}: cannot write it ({e.strerror}); choose another --html") from None


def check_target(out: str | Path) -> Path:
    """Fail before any work unless ``out`` names a file that can be written (not a directory, in an
    existing directory this process can create files in)."""
    return check_output_file(out, "--html", "page", "report.html")


def check_drawable(reports: Sequence[dict]) -> None:
    """Only datasets, packs and runs that logged a step can be drawn."""
    for r in reports:
        if r.get("kind") == "run" and "curves" not in r:
            raise XprepError(f"{r['path']}: no metrics yet (metrics.jsonl has no step), nothing to draw; "
                             "let the run log a step, or leave it out of --html")
        if r.get("kind") not in ("dataset", "packed", "run"):
            raise XprepError(f"--html draws datasets, packs and runs, not a {r.get('kind')} report")


def page(reports: Sequence[dict]) -> str:
    """The whole HTML document: a section per dataset and pack, one for all the runs."""
    colours = Colours(names_in(reports))
    sections, runs = [], [(i, r) for i, r in enumerate(reports) if r["kind"] == "run"]
    for i, r in enumerate(reports):
        if r["kind"] == "dataset":
            sections.append(dataset_section(i, r, colours))
        elif r["kind"] == "packed":
            sections.append(blend_section(i, r, colours) if r.get("blend") else pack_section(i, r, colours))
        elif runs and i == runs[0][0]:
            sections.append(runs_section(runs, colours))
    nav = "".join(f'<a href="#{sid}">{escape(title)}</a>' for _, sid, title in sections)
    css = (ASSETS / "report.css").read_text(encoding="utf-8")
    js = (ASSETS / "report.js").read_text(encoding="utf-8")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>xprep report</title><style>{css}</style></head><body>'
            f'<header class="top"><div class="brand">xprep <span>inspect</span></div><nav>{nav}</nav></header>'
            f'<main>{"".join(html for html, _, _ in sections)}</main>'
            f'<div id="tip" role="tooltip" hidden></div><script>{js}</script></body></html>\n')


def section(sid: str, kind: str, title: str, path: str | None, facts: Iterable[str], body: str,
            report: int | None) -> tuple[str, str, str]:
    """A section of the page, with the id and title the navigation links to."""
    where = f' <code>{escape(path)}</code>' if path else ""
    facts_html = "".join(f"<li>{escape(f)}</li>" for f in facts if f)
    html = (f'<section class="report {kind}" id="{sid}"{_report_attr(report)}>'
            f'<h2><span class="kind">{escape(title)}</span>{where}</h2>'
            f'<ul class="facts">{facts_html}</ul>{body}</section>')
    return html, sid, f"{title} {Path(path).name if path else ''}".strip()


def _report_attr(report: int | None) -> str:
    return "" if report is None else f' data-report="{report}"'


# ---------------------------------------------------------------------------------------- colours
class Colours:
    """One colour per name (category or source), the same in every section of the page: names take the
    palette in the order they first appear; ``uncategorized`` is grey."""

    def __init__(self, names: Iterable[str]):
        self._of: dict[str, str] = {}
        for name in names:
            if name not in self._of and name != "uncategorized":
                self._of[name] = _nth_colour(len(self._of))

    def __call__(self, name: str) -> str:
        if name == "uncategorized":
            return UNCATEGORIZED
        if name not in self._of:  # a name the first pass did not see still gets a colour of its own
            self._of[name] = _nth_colour(len(self._of))
        return self._of[name]


def _nth_colour(k: int) -> str:
    if k < len(PALETTE):
        return PALETTE[k]
    return f"hsl({(k * 137.508) % 360:.0f} 55% 45%)"  # golden-angle hues: far apart, never repeating


def names_in(reports: Sequence[dict]) -> list[str]:
    """Category and source names in the order the page shows them."""
    out: list[str] = []
    for r in reports:
        if r["kind"] == "dataset":
            out += list(r["categories"])
        elif r["kind"] == "packed":
            out += list(r.get("categories") or {})
            for s, sub in zip((r.get("blend") or {}).get("sources", []), r.get("source_reports") or [], strict=False):
                out += [s["name"], *(sub.get("categories") or {})]
        elif r["kind"] == "run":
            curves = r.get("curves") or {}
            out += list(curves.get("category_loss") or {}) + list(curves.get("source_loss") or {})
    return out


# ---------------------------------------------------------------------------------------- helpers
def ptr(*parts) -> str:
    """A JSON pointer (RFC 6901) into a report."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def dig(report: dict, *parts):
    value = report
    for p in parts:
        value = value[p]
    return value


def integer(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def number(v) -> str:
    if isinstance(v, bool) or v is None:
        return "–" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def share(v: float) -> str:
    return f"{v:.2%}"


def value(report: dict, *parts, fmt=number, tag: str = "span", cls: str | None = None) -> str:
    """The value at ``parts`` of ``report``, shown with ``fmt`` and tagged with where it comes from (class
    ``num`` for a number, ``text`` otherwise, unless ``cls`` says)."""
    v = dig(report, *parts)
    cls = cls or ("num" if isinstance(v, int | float) and not isinstance(v, bool) else "text")
    return f'<{tag} class="{cls}"{attrs(**Source(ptr(*parts), v).attrs())}>{escape(fmt(v))}</{tag}>'


def cards(report: dict, items: Sequence[tuple[str, tuple, object]]) -> str:
    """Key figures: (label, path in the report, formatter); paths missing from the report are left out."""
    out = []
    for label, parts, fmt in items:
        try:
            dig(report, *parts)
        except (KeyError, IndexError, TypeError):
            continue
        out.append(f'<div class="card"><div class="label">{escape(label)}</div>'
                   f'{value(report, *parts, fmt=fmt, tag="div", cls="value")}</div>')
    return f'<div class="cards">{"".join(out)}</div>'


def table(caption: str, headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """A table of cells already rendered (``td`` elements): headers, then the rows; a header stands over its
    column as the first row's cell does (right over numbers, left over names and text)."""
    if not rows:
        return ""
    left = [not cell.startswith('<td class="num"') for cell in rows[0]] + [False] * len(headers)
    head = "".join(f'<th{attrs(class_="left" if left[k] else None)}>{escape(h)}</th>' for k, h in enumerate(headers))
    body = "".join(f"<tr>{''.join(row)}</tr>" for row in rows)
    return (f'<div class="table-wrap"><table class="{cls}"><caption>{escape(caption)}</caption>'
            f'<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')


def td(report: dict, *parts, fmt=number, cls: str | None = None) -> str:
    return value(report, *parts, fmt=fmt, tag="td", cls=cls)


def text_td(text: str, colour: str | None = None, category: str | None = None) -> str:
    swatch = "" if colour is None else f'<i class="dot"{_colour_attrs(colour, category)}></i>'
    return f'<td class="name">{swatch}{escape(text)}</td>'


def _colour_attrs(colour: str, category: str | None) -> str:
    cat = "" if category is None else f' data-category="{escape(category)}" data-colour="{escape(colour)}"'
    return f' style="background:{escape(colour)}"{cat}'


def charts(*figures: str) -> str:
    return f'<div class="charts">{"".join(f for f in figures if f)}</div>'


def tables(*html: str) -> str:
    """Tables side by side where they fit."""
    return f'<div class="tables">{"".join(html)}</div>'


def note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def tokens_span(row: dict) -> tuple[float, float]:
    """A histogram row of whole numbers ``lo..hi`` spans ``[lo, hi + 1)``."""
    return row["lo"], row["hi"] + 1


# ---------------------------------------------------------------------------------------- dataset
def dataset_section(i: int, r: dict, colours: Colours) -> tuple[str, str, str]:
    tok = r["tokenizer"] or {}
    facts = [f"tokenizer {tok.get('path')} (vocab {integer(tok.get('vocab_size'))})", f"dtype {r['dtype']}",
             f"chat template {r['chat_template']['name']}" if r.get("chat_template") else "",
             f"fingerprint {r['fingerprint'][:16]}"]
    body = cards(r, [("documents", ("documents",), integer), ("tokens", ("tokens",), integer),
                     ("target tokens", ("loss_tokens",), integer), ("target share", ("target_share",), share),
                     ("mean length", ("lengths", "mean"), lambda v: f"{v:,.1f}"),
                     ("median length", ("lengths", "percentiles", "p50"), integer),
                     ("rejected records", ("rejects", "count"), integer), ("sources", ("sources",), integer),
                     ("conversations", ("conversations", "count"), integer),
                     ("begin with the assistant", ("conversations", "assistant_first"), integer),
                     ("end without an answer", ("conversations", "ends_without_answer"), integer),
                     ("blank answers", ("conversations", "empty_answers"), integer)])
    body += charts(length_chart(r), dataset_category_chart(r, colours), rejects_chart(r))
    body += percentile_table(r, ("lengths",), "document length (tokens)")
    body += tables(dataset_category_table(r, colours), over_table(r), rejects_table(r), sources_table(r))
    return section(f"s{i}", "dataset", "Token dataset", r["path"], facts, body, i)


def length_chart(r: dict) -> str:
    if not r["lengths"]["count"]:
        return note("No document: nothing to draw.")
    pct = r["lengths"]["percentiles"]
    markers = [Marker(pct[k] + 0.5, k, f"{k}: {pct[k]:,} tokens", Source(ptr("lengths", "percentiles", k), pct[k]))
               for k in ("p10", "p50", "p90", "p99")]
    svg = histogram("Document length", "document length (tokens, log scale)", "documents (count)", r["histogram"],
                    "/histogram", span=tokens_span, log_x=True, colour=NEUTRAL, markers=markers, trim=True,
                    tip=lambda h: f"{h['lo']:,}–{h['hi']:,} tokens: {h['count']:,} documents")
    return figure(svg, note="Dashed lines: length percentiles p10, p50, p90, p99.")


def dataset_category_chart(r: dict, colours: Colours) -> str:
    rows = []
    for name, c in r["categories"].items():
        colour = colours(name)
        rows.append((name, [
            Bar(Source(ptr("categories", name, "tokens"), c["tokens"]), colour, f"{name}: {c['tokens']:,} tokens",
                category=name, series="tokens"),
            Bar(Source(ptr("categories", name, "loss_tokens"), c["loss_tokens"]), colour,
                f"{name}: {c['loss_tokens']:,} target tokens", opacity=0.45, category=name, series="targets")]))
    if not rows:
        return ""
    keys = [Key("tokens", NEUTRAL, series="tokens"), Key("target tokens", NEUTRAL, series="targets", opacity=0.45)]
    return figure(bar_chart("Tokens per category", "tokens (count)", "category", rows, counts=True), keys)


def rejects_chart(r: dict) -> str:
    reasons = r["rejects"]["by_reason"]
    if not reasons:
        return ""
    rows = [(reason, [Bar(Source(ptr("rejects", "by_reason", reason), n), NEUTRAL, f"{reason}: {n:,} records")])
            for reason, n in reasons.items()]
    return figure(bar_chart("Rejected records by reason", "records (count)", "reason", rows, counts=True))


def percentile_table(r: dict, parts: tuple, label: str, caption: str = "Percentiles") -> str:
    stats = dig(r, *parts)
    if not stats.get("count"):
        return ""
    keys = list(stats["percentiles"])
    row = [text_td(label), td(r, *parts, "mean"), *(td(r, *parts, "percentiles", k) for k in keys)]
    return table(caption, ["", "mean", *keys], [row], "wide")


def dataset_category_table(r: dict, colours: Colours) -> str:
    rows = [[text_td(name, colours(name), name), td(r, "categories", name, "tokens"),
             td(r, "categories", name, "loss_tokens"), td(r, "category_shares", name, "tokens", fmt=share),
             td(r, "category_shares", name, "targets", fmt=share)] for name in r["categories"]]
    return table("Categories", ["category", "tokens", "target tokens", "share of tokens", "targets in it"], rows)


def over_table(r: dict) -> str:
    rows = [[text_td(f"> {o['length']:,}"), td(r, "over", k, "documents"), td(r, "over", k, "share", fmt=share),
             td(r, "over", k, "tokens"), td(r, "over", k, "token_share", fmt=share)] for k, o in enumerate(r["over"])]
    return table("Documents longer than N tokens (what packing at that capacity cuts)",
                 ["longer than", "documents", "share", "tokens", "token share"], rows)


SHOWN_ROWS = 12  # a longer table (a corpus of 233 files) is folded: open it to read it


def sources_table(r: dict) -> str:
    rows = [[td(r, "source_files", k, "path", fmt=str), td(r, "source_files", k, "size", fmt=number)]
            for k in range(len(r.get("source_files") or []))]
    html = table("Sources", ["path", "size (bytes)"], rows)
    if len(rows) <= SHOWN_ROWS:
        return html
    return f"<details><summary>Sources ({len(rows):,} files)</summary>{html}</details>"


def rejects_table(r: dict) -> str:
    rows = [[text_td(reason), td(r, "rejects", "by_reason", reason)] for reason in r["rejects"]["by_reason"]]
    return table("Rejected records", ["reason", "records"], rows)


# ------------------------------------------------------------------------------------------- pack
def pack_section(i: int, r: dict, colours: Colours) -> tuple[str, str, str]:
    c = r["config"]
    facts = [f"method {c['method']}", f"capacity {r['capacity']:,}",
             f"cp size {c['cp_size']}" if c.get("cp_size", 1) > 1 else "", f"key {r['key'][:16]}", r.get("layout")]
    body = cards(r, [("bins", ("bins",), integer), ("fill", ("fill",), share),
                     ("lower bound (bins)", ("lower_bound_bins",), integer),
                     ("gap to lower bound", ("gap_to_lower_bound",), lambda v: f"+{v:.3%}"),
                     ("tokens", ("tokens",), integer), ("documents in", ("documents_in",), integer),
                     ("pieces packed", ("items",), integer), ("padding", ("padding_tokens",), integer),
                     ("CP rounding", ("cp_padding_tokens",), integer)])
    body += charts(*bin_charts(r, "/", r["capacity"]), capacity_chart(r), pack_category_chart(r, (), colours),
                   *dp_charts(r))
    body += bins_table(r) + tables(pack_category_table(r, colours), overlong_table(r)) + entries_table(r)
    return section(f"s{i}", "pack", "Pack", r["path"], facts, body, i)


def bin_charts(r: dict, root: str, capacity: int) -> list[str]:
    """Fill per bin and documents per bin, from the report's histograms under ``root``."""
    fills, docs = r["fill_histogram"], r["documents_per_bin_histogram"]
    if not fills:
        return [note("No bin: nothing to draw.")]
    fill = histogram("Fill per bin", "fill (% of capacity)", "bins (count)", fills, f"{root}fill_histogram",
                     span=lambda h: (h["lo"] / capacity, (h["hi"] + 1) / capacity), x_fmt=percent,
                     tip=lambda h: f"{h['lo']:,}–{h['hi']:,} tokens of {capacity:,}: {h['count']:,} bins")
    per_bin = histogram("Documents per bin", "documents per bin (count)", "bins (count)", docs,
                        f"{root}documents_per_bin_histogram", span=tokens_span, trim=True,
                        tip=lambda h: (f"{h['lo']:,}" if h["lo"] == h["hi"] else f"{h['lo']:,}–{h['hi']:,}")
                        + f" documents: {h['count']:,} bins")
    return [figure(fill), figure(per_bin)]


def capacity_chart(r: dict) -> str:
    """Where the capacity of all bins went: tokens, CP rounding, left empty."""
    parts = [("tokens", "tokens", NEUTRAL), ("cp_padding_tokens", "CP rounding", "#e3a34b"),
             ("unused_tokens", "left empty", "#d5dae1")]
    bars = [Bar(Source(ptr(key), r[key]), colour, f"{label}: {r[key]:,} tokens", series=key)
            for key, label, colour in parts]
    keys = [Key(label, colour, series=key) for key, label, colour in parts]
    svg = bar_chart("Capacity of all bins", "tokens (count)", "bins × capacity", [("all bins", bars)], stacked=True,
                    counts=True)
    return figure(svg, keys)


def pack_category_chart(r: dict, root: tuple, colours: Colours, title: str = "Packed tokens per category") -> str:
    categories = r.get("categories")
    if categories is None:
        return note(f"Categories: {r.get('categories_note')}")
    rows = [(name, [Bar(Source(ptr(*root, "categories", name), n), colours(name), f"{name}: {n:,} tokens",
                        category=name)]) for name, n in categories.items()]
    return figure(bar_chart(title, "packed tokens (count)", "category", rows, counts=True)) if rows else ""


def dp_charts(r: dict) -> list[str]:
    """A --balance-dp pack: max/mean Σlen² before and after balancing, per-rank work of the first steps, and
    the imbalance of every step as stored."""
    b, steps = r.get("dp_balance"), r.get("dp_steps")
    if not b or not steps:
        return []
    rows = []
    for name, label in (("imbalance", "per step"), ("micro_step_imbalance", "per micro-step")):
        for stat in ("mean", "max"):
            rows.append((f"{label}, {'mean' if stat == 'mean' else 'worst'}", [
                Bar(Source(ptr("dp_balance", f"{name}_{when}", stat), b[f"{name}_{when}"][stat]), NEUTRAL,
                    f"{label} {stat}, {when} balancing: {b[f'{name}_{when}'][stat]:.4f}",
                    opacity=0.45 if when == "before" else 1.0, series=when) for when in ("before", "after")]))
    keys = [Key("before balancing", NEUTRAL, series="before", opacity=0.45), Key("after", NEUTRAL, series="after")]
    balance = figure(bar_chart("DP balance: max/mean Σlen² over ranks", "max/mean Σlen² (ratio)", "measure",
                               rows, fmt=short), keys)
    loads = steps["rank_loads"]  # per rank, over the first steps
    x = Source(None, list(range(len(loads[0]) if loads else 0)))
    series = [Series(f"rank {k}", Source(ptr("dp_steps", "rank_loads", k), work), x,
                     RANK_COLOURS[k % len(RANK_COLOURS)], series=f"rank{k}") for k, work in enumerate(loads)]
    per_rank = figure(line_chart(f"Σlen² per rank, first {len(x.value)} steps (balanced)", "step (index)",
                                 "Σlen² per rank (tokens²)", series, zero=True),
                      [Key(s.label, s.colour, series=s.series) for s in series])
    spread = histogram("Imbalance per step (balanced)", "max/mean Σlen² per step (ratio)", "steps (count)",
                       steps["imbalance_histogram"], "/dp_steps/imbalance_histogram",
                       span=lambda h: (h["lo"], h["hi"]), x_fmt=short,
                       tip=lambda h: f"{h['lo']:.4f}–{h['hi']:.4f}: {h['count']:,} steps")
    return [balance, per_rank, figure(spread, note="The steps before balancing are not stored, only their mean and "
                                                   "worst (the DP balance chart).")]


def bins_table(r: dict, root: tuple = ()) -> str:
    rows = []
    for key, label in (("documents_per_bin", "documents per bin"), ("tokens_per_bin", "tokens per bin")):
        stats = dig(r, *root, key)
        if stats.get("count"):
            rows.append([text_td(label), td(r, *root, key, "mean"),
                         *(td(r, *root, key, "percentiles", p) for p in stats["percentiles"])])
    keys = list(dig(r, *root, "tokens_per_bin").get("percentiles") or {})
    return table("Per bin", ["", "mean", *keys], rows, "wide")


def overlong_table(r: dict) -> str:
    if r["packing"]["fixed_length_samples"]:  # (chunk) the stream cuts every document: nothing is overlong
        return ""
    labels = {"overlong_documents": "overlong documents", "dropped_documents": "dropped documents",
              "dropped_tokens": "dropped tokens", "truncated_documents": "truncated documents",
              "truncated_tokens": "tokens cut by truncation", "split_documents": "split documents",
              "split_pieces": "pieces of split documents"}
    rows = [[text_td(label), td(r, "overlong", key)] for key, label in labels.items()]
    rows += [[text_td("empty documents (skipped)"), td(r, "empty_documents")]]
    return table(f"Documents longer than {r['capacity']:,} ({r['config']['overlong']})", ["", "count"], rows)


def pack_category_table(r: dict, colours: Colours, root: tuple = ()) -> str:
    categories = dig(r, *root).get("categories") or {}
    rows = [[text_td(name, colours(name), name), td(r, *root, "categories", name),
             td(r, *root, "category_shares", name, fmt=share)] for name in categories]
    return table("Packed tokens per category", ["category", "packed tokens", "share"], rows)


def entries_table(r: dict) -> str:
    """Every entry of the cache: ``*`` the current one, ``v`` its validation entry, ``t`` its test entry."""
    entries = r.get("entries") or []
    rows = []
    for k, e in enumerate(entries):
        mark = "*" if e["current"] else "v" if e.get("validation") else "t" if e.get("test") else ""
        if e["status"] != "ok":
            rows.append([text_td(mark), text_td(e["name"]), f'<td colspan="4">{escape(e["problem"])}</td>'])
            continue
        rows.append([text_td(mark), text_td(e["name"]), td(r, "entries", k, "bins"),
                     td(r, "entries", k, "fill", fmt=share), td(r, "entries", k, "created", fmt=str, cls="code"),
                     options_td(r, "entries", k, "options")])
    html = table("Entries of the cache (* current, v its validation entry, t its test entry)",
                 ["", "entry", "bins", "fill", "created", "options"], rows, "entries")
    return f'<details><summary>Entries of the cache ({len(entries)})</summary>{html}</details>' if html else ""


def options_td(report: dict, *parts) -> str:
    """Command-line options, the line broken between two options, never inside one (``--group-size 100000``)."""
    v = dig(report, *parts)
    inner = " ".join(f'<span class="option">{escape(piece)}</span>' for piece in re.split(r" (?=--)|(?<=;) ", v))
    return f'<td class="options"{attrs(**Source(ptr(*parts), v).attrs())}>{inner}</td>'


# ------------------------------------------------------------------------------------------ blend
def blend_section(i: int, r: dict, colours: Colours) -> tuple[str, str, str]:
    b = r["blend"]
    order = "every held-out bin once" if b["seed"] is None else f"seed {b['seed']}"  # None: a --split validation blend
    facts = [f"method {b['method']}", f"capacity {b['capacity']:,}", order, f"key {r['key'][:16]}",
             f"size {b['size']['option']}"]
    unit = blend_unit_label(b)
    body = cards(r, [("bins", ("blend", "bins"), integer), (unit + " delivered", ("blend", "tokens"), integer),
                     ("real tokens", ("blend", "real_tokens"), integer), ("fill", ("blend", "fill"), share),
                     ("padding", ("padding_tokens",), integer)])
    body += charts(share_chart(r, colours), *([phase_chart(r, colours)] if b.get("phases") else []),
                   repeat_chart(r, colours), *bin_charts(r, "/", b["capacity"]),
                   *(pack_category_chart(sub, ("source_reports", k), colours,
                                         f"Tokens per category in source {s['name']} (one pass)")
                     for k, (s, sub) in enumerate(zip(b["sources"], r["source_reports"], strict=True))))
    body += blend_table(r, colours) + (phase_table(r, colours) if b.get("phases") else "") + bins_table(r)
    body += entries_table(r)
    body += "".join(note(f"warning: {w}") for w in b.get("warnings") or [])  # e.g. a source cut to a small part
    drawn = [f"{s['name']}: {s['drawn']}" for s in b["sources"] if s.get("drawn")]
    body += note("How each source's bins were drawn: " + "; ".join(drawn) + ".") if drawn else ""
    return section(f"s{i}", "pack", "Pack (blend)", r["path"], facts, body, i)


def share_chart(r: dict, colours: Colours) -> str:
    rows = []
    for k, s in enumerate(r["blend"]["sources"]):
        colour = colours(s["name"])
        rows.append((s["name"], [
            Bar(Source(ptr("blend", "sources", k, "requested_share"), s["requested_share"]), colour,
                f"{s['name']}: {s['requested_share']:.2%} requested", opacity=0.45, series="requested"),
            Bar(Source(ptr("blend", "sources", k, "delivered_share"), s["delivered_share"]), colour,
                f"{s['name']}: {s['delivered_share']:.2%} delivered", series="delivered")]))
    keys = [Key("requested", NEUTRAL, series="requested", opacity=0.45), Key("delivered", NEUTRAL, series="delivered")]
    return figure(bar_chart("Blend shares: requested vs delivered", f"share of {blend_unit_label(r['blend'])} (%)",
                            "source", rows, fmt=percent), keys)



def phase_chart(r: dict, colours: Colours) -> str:
    """A mix with phases: per phase, the requested and the delivered shares stacked source by source."""
    rows = []
    for p, phase in enumerate(r["blend"]["phases"]):
        for kind, opacity in (("requested", 0.45), ("delivered", 1.0)):
            rows.append((f"phase {phase['phase']} {kind}", [
                Bar(Source(ptr("blend", "phases", p, "sources", k, f"{kind}_share"), s[f"{kind}_share"]),
                    colours(s["name"]), f"phase {phase['phase']}, {s['name']}: {s[f'{kind}_share']:.2%} {kind}",
                    opacity=opacity, series=kind)
                for k, s in enumerate(phase["sources"])]))
    keys = [Key("requested", NEUTRAL, series="requested", opacity=0.45), Key("delivered", NEUTRAL, series="delivered")]
    starts = "; ".join(f"phase {p['phase']} from bin {p['start_bin']:,}" for p in r["blend"]["phases"])
    return figure(bar_chart("Phases: requested vs delivered shares", f"share of {blend_unit_label(r['blend'])} (%)",
                            "phase", rows, fmt=percent, stacked=True), keys,
                  note=f"Each phase starts at a bin = the samples a sequential run has consumed then: {starts}.")


def phase_table(r: dict, colours: Colours) -> str:
    rows = []
    for p, phase in enumerate(r["blend"]["phases"]):
        for k, s in enumerate(phase["sources"]):
            at = ("blend", "phases", p, "sources", k)
            rows.append([td(r, "blend", "phases", p, "phase"), td(r, "blend", "phases", p, "start_bin"),
                         text_td(s["name"], colours(s["name"])), td(r, *at, "requested_share", fmt=share),
                         td(r, *at, "delivered_share", fmt=share), td(r, *at, "bins")])
    return table("Phases of the mix", ["phase", "from bin", "source", "requested", "delivered", "bins"], rows)


def repeat_chart(r: dict, colours: Colours) -> str:
    rows = [(s["name"], [Bar(Source(ptr("blend", "sources", k, "epochs"), s["epochs"]), colours(s["name"]),
                             f"{s['name']}: {s['bins']:,} of {s['bins_available']:,} bins, {s['epochs']:.3g}×")])
            for k, s in enumerate(r["blend"]["sources"])]
    return figure(bar_chart("Passes over each source", "bins taken / bins it has (×)", "source", rows,
                            fmt=times), note="Above 1: the source repeats; below 1: it is cut.")


def blend_table(r: dict, colours: Colours) -> str:
    rows = []
    for k, s in enumerate(r["blend"]["sources"]):
        at = ("blend", "sources", k)
        rows.append([text_td(s["name"], colours(s["name"])), td(r, *at, "weight"),
                     td(r, *at, "requested_share", fmt=share), td(r, *at, "delivered_share", fmt=share),
                     td(r, *at, "bins"), td(r, *at, "bins_available"), td(r, *at, "epochs", fmt=lambda v: f"{v:.3g}×"),
                     td(r, *at, "entry", fmt=str, cls="code")])
    return table("Sources of the blend", ["source", "weight", "requested", "delivered", "bins", "of", "repeat",
                                          "entry"], rows)


# ------------------------------------------------------------------------------------------- runs
def runs_section(runs: Sequence[tuple[int, dict]], colours: Colours) -> tuple[str, str, str]:
    """All runs in one section: charts overlay them (a dash pattern each), then each run's figures."""
    dash = {i: DASHES[k % len(DASHES)] for k, (i, _) in enumerate(runs)}
    run_keys = [Key(Path(r["path"]).name, ALL_COLOUR, run=i, dash=dash[i]) for i, r in runs] if len(runs) > 1 else []
    figures = [loss_chart(runs, dash, colours, "category_loss", False, run_keys),
               loss_chart(runs, dash, colours, "category_loss", True, run_keys)]
    if any(len(r["curves"]["source_loss"]) > 1 for _, r in runs):
        figures += [loss_chart(runs, dash, colours, "source_loss", False, run_keys),
                    loss_chart(runs, dash, colours, "source_loss", True, run_keys)]
    for key, title, label, fmt in RUN_SERIES:
        if any(key in r["curves"] for _, r in runs):
            figures.append(run_series_chart(runs, dash, key, title, label, fmt, run_keys))
    body = charts(*figures) + "".join(run_block(i, r, colours) for i, r in runs)
    title, path = ("Run", runs[0][1]["path"]) if len(runs) == 1 else (f"Runs ({len(runs)}, overlaid)", None)
    return section(f"s{runs[0][0]}", "runs", title, path, [], body, None)


RUN_SERIES = (("lr", "Learning rate", "learning rate (per step)", short),
              ("grad_norm", "Gradient norm", "gradient norm (L2, before clipping)", short),
              ("tokens_per_s", "Throughput", "throughput (tokens/s)", short),
              ("mfu", "Model FLOPs utilization", "MFU (fraction of peak)", percent),
              ("mfu_6n", "MFU, 6N convention (PaLM, torchtitan)", "MFU 6N (fraction of peak)", percent))


def loss_chart(runs, dash, colours: Colours, channel: str, validation: bool, run_keys: list[Key]) -> str:
    """Loss over steps, all targets and per category (or per source), of every run; checkpoints marked."""
    series, seen = [], {}
    for i, r in runs:
        root = ("curves", "eval") if validation else ("curves",)
        curves = dig(r, *root)
        if not curves["step"]:
            continue
        x = Source(ptr(*root, "step"), curves["step"], i)
        run = f"{Path(r['path']).name}: " if len(runs) > 1 else ""  # hovering names the run of each value
        if channel == "category_loss" and "loss" in curves:  # absent: no step of the run had a target token
            series.append(Series(f"{run}all targets", Source(ptr(*root, "loss"), curves["loss"], i), x, ALL_COLOUR,
                                 dash[i], OVERALL, i, dots=validation))
            seen[OVERALL] = Key("all targets", ALL_COLOUR, series=OVERALL)
        for name, values in curves[channel].items():
            colour = colours(name)
            category = name if channel == "category_loss" else None
            series.append(Series(f"{run}{name}", Source(ptr(*root, channel, name), values, i), x, colour, dash[i],
                                 name, i, dots=validation, category=category))
            seen.setdefault(name, Key(name, colour, series=name, category=category))
    what = "validation" if validation else "training"
    by = "by category" if channel == "category_loss" else "by source"
    if not series:
        return "" if validation else note(f"No {what} loss logged.")
    svg = line_chart(f"{what.capitalize()} loss {by}", "step (optimizer steps)", "loss (nats per target token)",
                     series, markers=checkpoint_markers(runs))
    return figure(svg, [*seen.values(), *run_keys],
                  "Vertical lines: checkpoints (the best one darker)." if channel == "category_loss" else None)


def checkpoint_markers(runs) -> list[Marker]:
    out = []
    for i, r in runs:
        ck = r["checkpoints"]
        for k, step in enumerate(ck["steps"]):
            best = ck.get("best") == f"step-{step}"
            out.append(Marker(step, "best" if best else "", f"{Path(r['path']).name}: checkpoint step-{step}"
                              + (" (best)" if best else ""), Source(ptr("checkpoints", "steps", k), step, i), i, best))
    return out


def run_series_chart(runs, dash, key: str, title: str, label: str, fmt, run_keys: list[Key]) -> str:
    series = [Series(Path(r["path"]).name, Source(ptr("curves", key), r["curves"][key], i),
                     Source(ptr("curves", "step"), r["curves"]["step"], i), ALL_COLOUR, dash[i], None, i)
              for i, r in runs if key in r["curves"]]
    return figure(line_chart(title, "step (optimizer steps)", label, series, y_fmt=fmt, zero=True), run_keys)


def run_block(i: int, r: dict, colours: Colours) -> str:
    """One run's figures: settings, key numbers and its loss tables."""
    s = r.get("settings") or {}
    facts = [f"model {s.get('model')}", f"sampler {s.get('sampler')}", f"lr {s.get('lr')} ({s.get('schedule')}, "
             f"warm-up {s.get('warmup')})", f"layout {r['layout']}" if r.get("layout") else "",
             f"pack {r['pack']['path']}" if r.get("pack") else ""]
    items = [("steps logged", ("steps",), integer), ("steps planned", ("plan", "steps"), integer),
             ("tokens", ("tokens",), integer), ("last loss", ("loss", "last"), lambda v: f"{v:.4f}"),
             ("best loss", ("loss", "best"), lambda v: f"{v:.4f}"), ("at step", ("loss", "best_step"), integer),
             ("last validation loss", ("eval", "loss", "last"), lambda v: f"{v:.4f}"),
             ("best checkpoint", ("checkpoints", "best"), str)]
    untrained = (("steps_without_targets", "steps without targets"),  # no loss: left out of the figures
                 ("evaluations_without_targets", "evaluations without targets"))
    items += [(label, (key,), integer) for key, label in untrained if r.get(key)]
    losses = [loss_table(r, ("loss",), ("categories",), ("sources",), "Training loss", colours)] if "loss" in r else []
    if r.get("eval"):
        losses.append(loss_table(r, ("eval", "loss"), ("eval", "categories"), ("eval", "sources"), "Validation loss",
                                 colours))
    for name in r.get("eval_sets") or {}:  # --eval's named sets (the validation entry is the set named valid)
        at = ("eval_sets", name)
        losses.append(loss_table(r, (*at, "loss"), (*at, "categories"), (*at, "sources"), f"eval/{name} loss",
                                 colours))
    losses += [test_table(r, name, colours) for name in r.get("test") or {}]
    facts_html = "".join(f"<li>{escape(f)}</li>" for f in facts if f)
    return (f'<div class="run" data-report="{i}"><h3><code>{escape(r["path"])}</code></h3>'
            f'<ul class="facts">{facts_html}</ul>{cards(r, items)}{tables(*losses)}</div>')


def test_table(r: dict, name: str, colours: Colours) -> str:
    """The test pass of set ``name`` (once, after the last step): its loss, per category and per source."""
    at = ("test", name)
    loss = lambda v: "none" if v is None else f"{v:.4f}"  # None: no target tokens
    rows = [[text_td("all targets"), td(r, *at, "loss", fmt=loss)]]
    rows += [[text_td(c, colours(c), c), td(r, *at, "category_loss", c, fmt=loss)]
             for c in dig(r, *at, "category_loss")]
    if len(dig(r, *at, "source_loss")) > 1:
        rows += [[text_td(f"source {c}"), td(r, *at, "source_loss", c, fmt=loss)] for c in dig(r, *at, "source_loss")]
    return table(f"test/{name} loss (once, after step {dig(r, *at, 'step'):,})", ["", "loss"], rows)


def loss_table(r: dict, overall: tuple, categories: tuple, sources: tuple, caption: str, colours: Colours) -> str:
    """First, last, best and trend of the loss: over all targets, per category, per source (when several)."""
    rows = [_loss_row(r, overall, "all targets", None)]
    rows += [_loss_row(r, (*categories, name), name, colours(name)) for name in dig(r, *categories)]
    if len(dig(r, *sources)) > 1:
        rows += [_loss_row(r, (*sources, name), f"source {name}", colours(name)) for name in dig(r, *sources)]
    return table(caption, ["", "points", "first", "last", "best", "best step", "trend"], rows)


def _loss_row(r: dict, at: tuple, label: str, colour: str | None) -> list[str]:
    four = lambda v: f"{v:.4f}"
    return [text_td(label, colour, label if colour and not label.startswith("source ") else None),
            td(r, *at, "points"), td(r, *at, "first", fmt=four), td(r, *at, "last", fmt=four),
            td(r, *at, "best", fmt=four), td(r, *at, "best_step"), td(r, *at, "trend", fmt=lambda v: f"{v:+.1%}")]
