"""Report objects → text (and JSON), for every kind ``xprep inspect`` and ``xprep pack`` show.

The modules that own the data build the reports as plain JSON-able dicts (``prep/inspect/dataset_report.py``,
``prep/inspect/pack_report.py``, ``train/report.py``); this module only renders them, so ``--json`` and the text
show the same numbers, computed once. It imports nothing of the project: every report module may use it,
and it depends on none of them.

It is one module (over 500 lines) on purpose: the renderers of the five report kinds (dataset, pack, blend, run,
lineage) share the primitives above them (tables, fields, counts, histograms, wrapping) and one wording, which a
reader checks in one place. Its seam, when it grows, is one renderer module per report kind over those primitives.
"""

from __future__ import annotations

import json
import re
import textwrap
from datetime import datetime, timezone
from pathlib import Path

LOUD_TOKEN_SHARE = 0.01  # removing more than this share of a pack's tokens earns a warning
WIDTH = 100  # characters a line of text keeps within where it can be wrapped (a terminal's usual width)
HANG = 16  # where the value of a "  label         value" line starts: its continuation lines start there too


def render(report: dict, color: bool = False) -> str:
    """The text of a report, by its ``kind``; ``color``: ANSI colours for a terminal."""
    kind = report.get("kind")
    if kind == "dataset":
        return render_dataset(report, color)
    if kind == "packed":
        return render_pack(report)
    if kind == "lineage":
        return render_lineage(report)
    if kind == "run":
        return render_run(report)
    raise ValueError(f"no renderer for a report of kind {kind!r}")


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)


# ------------------------------------------------------------------------------------------ tables
def render_histogram(hist: list[dict], width: int = 40) -> list[str]:
    """Rows from the first to the last that count something (the empty ends say nothing)."""
    full = [k for k, h in enumerate(hist) if h["count"]]
    hist = hist[full[0]:full[-1] + 1] if full else []
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


def wrap(text: str, indent: str = "", hang: str | None = None, width: int = WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` characters, the first after ``indent``, the others after ``hang``
    (``indent`` unless given). A line breaks after a comma or semicolon where it can (a short clause stays
    whole), an option stays with its value (``--seq-len 2048``), and a word longer than a line (a path) has a
    line of its own, whole."""
    short = width // 3
    clauses = [c if len(c) > short else _joined(c) for c in re.split(r"(?<=[,;]) ", text)]
    glued = " ".join(re.sub(r"(^|\s)(--[\w-]+) (?!--)", f"\\1\\2{_GLUE}",
                            re.sub(rf"\([^()]{{1,{short}}}\)", lambda m: _joined(m.group()), c)) for c in clauses)
    lines = textwrap.wrap(glued, width, initial_indent=indent, subsequent_indent=indent if hang is None else hang,
                          break_long_words=False, break_on_hyphens=False)
    return [line.replace(_GLUE, " ") for line in lines] or [indent.rstrip()]


_GLUE = "\x00"  # joins what must not be split (textwrap breaks at ASCII whitespace only; no path holds a NUL)


def _joined(text: str) -> str:
    return text.replace(" ", _GLUE)


def fit(line: str) -> list[str]:
    """A ``"  label         value"`` line wrapped to ``WIDTH``, its value continuing under itself."""
    return wrap(line, hang=" " * HANG) if len(line) > WIDTH else [line.replace(_GLUE, " ")]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 bin``, ``2 bins``, ``1,000 bins``; ``plural`` where adding an s is wrong (``entries``)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


# ----------------------------------------------------------------------------------------- dataset
def render_over(over: list[dict]) -> list[str]:
    rows = [[f"> {o['length']:,}", o["documents"], f"{o['share']:.1%}", o["tokens"], f"{o['token_share']:.1%}"]
            for o in over]
    return ["documents longer than N tokens (what `xprep pack` at that capacity drops, truncates or splits)",
            *table(["longer than", "documents", "share", "tokens", "token share"], rows)]


ANSI_TARGET, ANSI_CATEGORY, ANSI_RESET = "\x1b[1;32m", "\x1b[35m", "\x1b[0m"
# Decoded text is untrusted: control characters (other than newline and tab) are shown, not obeyed.
_VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), 127] if chr(c) not in "\n\t"}


def render_sample(sample: dict, color: bool) -> list[str]:
    docs = sample["documents"]
    which = (f"the first {len(docs):,} of {_docs(sample['of'])}" if sample["selection"] == "first" else
             f"{len(docs):,} of {_docs(sample['of'])} drawn at random (--seed {sample['seed']})")
    legend = ("target tokens in green, {category} in magenta where the category changes" if color else
              "target tokens in [[double brackets]], {category} where the category changes")
    lines = [f"sample: {which}; {legend}"]
    for d in docs:
        lines += ["", f"--- document {d['index']:,}: {count(d['tokens'], 'token')}, "
                      f"{count(d['targets'], 'target')} ---", render_spans(d["spans"], color)]
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
    lines += [
        f"  documents     {r['documents']:,}   (from {count(r['sources'], 'source')}, "
        f"{r['rejects']['count']:,} rejected)",
        f"  tokens        {r['tokens']:,}",
        f"  target tokens {r['loss_tokens']:,}  ({r['target_share']:.1%})",
    ]
    if r.get("shards"):  # a sharded dataset (its documents are its shards', in order)
        lines.append(f"  shards        {len(r['shards']):,}, read as one dataset (`xprep merge` copies them into one)")
    shape = r.get("conversations")
    if shape:
        lines += field("conversations", conversation_phrase(shape))
    if r["lengths"]["count"]:
        p = r["lengths"]["percentiles"]
        lines.append("  length        mean {:,.1f}  " .format(r["lengths"]["mean"]) + "  ".join(
            f"{k} {p[k]:,}" for k in ("p0", "p10", "p50", "p90", "p99", "p100")))
        lines.append("")
        lines.append("length histogram (tokens per document)")
        lines += render_histogram(r["histogram"])
        lines += ["", *render_over(r["over"])]
    lines.append("")
    rows = [[name, c["tokens"], c["loss_tokens"], f"{r['category_shares'][name]['tokens']:.1%}" if r["tokens"] else "-"]
            for name, c in r["categories"].items()]
    lines += table(["category", "tokens", "target tokens", "share"], rows)
    if r["rejects"]["count"]:
        lines.append("")
        where = f"the rejects.jsonl of each shard under {r['path']}" if r.get("shards") else \
            f"{r['path'].rstrip('/')}/rejects.jsonl"
        lines.append(f"rejected records: {r['rejects']['count']:,} (see {where})")
        lines += [f"  {k}: {v:,}" for k, v in r["rejects"]["by_reason"].items()]
    if "sample" in r:
        lines += ["", *render_sample(r["sample"], color)]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- pack
def render_entries(r: dict) -> list[str]:
    """The entries of the cache, oldest first, each with the ``xprep pack`` options that made it on the lines
    under it (wrapped to ``WIDTH``: they run to 200 characters for a blend)."""
    entries = r.get("entries")
    if not entries:
        return []
    rows = [[_mark(e), e["name"], "-", "-", "-", "-"] if e["status"] != "ok" else
            [_mark(e), e["name"], e["bins"], f"{e['fill']:.2%}", f"{e['documents_kept']:,}/{e['documents_in']:,}",
             _utc(e["created"])] for e in entries]
    legend = "* = current, the one `xtrain run` trains on" + (
        "; v = its --split validation entry" if any(e.get("validation") for e in entries) else "") + (
        "; t = its --split test entry" if any(e.get("test") for e in entries) else "")
    lines = [f"pack cache {parent(r['path'])}: {count(len(entries), 'entry', 'entries')}, oldest first",
             *wrap(f"{legend}; under each entry, the `xprep pack` options that made it: run them again to make it "
                   "current", "  "), ""]
    header, rule, *body = table(["", "entry", "bins", "fill", "documents kept", "created (UTC)"], rows,
                                align="llrrrl")
    lines += [header.rstrip(), rule]
    for e, row in zip(entries, body, strict=True):
        lines += [row.rstrip(), *wrap(e["options"] if e["status"] == "ok" else e["problem"], " " * 5)]
    return [*lines, ""]


def _utc(created: str | None) -> str:
    """``2026-11-26T16:20:57+00:00`` → ``2026-11-26 16:20:57`` (UTC, as the column says)."""
    if not created:
        return "-"
    try:
        when = datetime.fromisoformat(created)
    except ValueError:
        return created
    when = when.astimezone(timezone.utc) if when.tzinfo else when
    return when.strftime("%Y-%m-%d %H:%M:%S")


def _mark(e: dict) -> str:
    """``*`` the current entry, ``v`` its --split validation entry, ``t`` its test entry."""
    return "*" if e["current"] else "v" if e.get("validation") else "t" if e.get("test") else ""


# ------------------------------------------------------------------------------------------ render
def _attention_lines(r: dict) -> list[str]:
    """How a chunk pack's samples are trained (--attention, --eod-mask-loss); nothing for other methods."""
    if "attention" not in r["packing"]:
        return []
    p = r["packing"]
    how = ("causal: one attention span over each sample, positions 0..S-1, labels across documents (Megatron)"
           if p["attention"] == "causal" else "document: documents inside a sample kept apart")
    eod = f"; --eod-mask-loss: EOD (id {r.get('eod_id')}) is never a target" if p["eod_mask_loss"] else ""
    return field("attention", how + eod)


def render_pack(r: dict) -> str:
    if r.get("blend"):
        return "\n".join([*render_entries(r), *render_blend(r["path"], r["key"], r["blend"])])
    c = r["config"]
    lines = [*render_entries(r),
             *wrap(f"pack {r['path']}  ({_key(r['path'], r['key'])}{c['method']}, capacity {r['capacity']:,}"
                   + (f", cp {c['cp_size']}" if c.get("cp_size", 1) > 1 else "") + ")", hang="  "),
             *field("layout", r["layout"]),
             *_attention_lines(r),
             *field("input", f"{_docs(r['documents_in'])}, {r['tokens_in']:,} tokens "
                             f"from {count(len(r['datasets']), 'dataset')}"),
             *field("bins", f"{r['bins']:,}  holding {count(r['items'], 'document or piece', 'documents or pieces')}, "
                            f"{r['tokens']:,} tokens"),
             *field("fill", f"{r['fill']:.4%}   padding {r['padding_tokens']:,} tokens" + (
                 f" (of which CP rounding {r['cp_padding_tokens']:,})" if r["cp_padding_tokens"] else "")),
             *field("lower bound", f"{count(r['lower_bound_bins'], 'bin')} (⌈tokens/capacity⌉), "
                                   f"gap +{r['gap_to_lower_bound']:.3%}"),
             *fit("  " + overlong_line(r["overlong"], r["capacity"], c["overlong"]))]
    if r["empty_documents"]:
        lines += field("empty", f"{_docs(r['empty_documents'])} with no tokens (skipped)")
    if (r.get("no_target") or {}).get("pieces") or (r.get("no_target") or {}).get("samples"):
        lines += field("no target", f"{untrained_phrase(r['no_target'])} dropped: no token of them is a target")
    if r.get("target_tokens") is not None:
        lines += field("targets", f"{r['target_tokens']:,} tokens learned (the first token of every piece and, "
                                  "with a loss mask, the masked ones are not)")
    if r["dp_balance"]:
        lines += fit("  " + dp_line(r["dp_balance"]))
    lines += ["", *_percentile_table(r)]
    lines.append("")
    if r["categories"] is None:
        lines.append(f"categories: {r['categories_note']}")
    else:
        lines += table(["category", "packed tokens", "share"],
                       [[k, v, f"{r['category_shares'][k]:.1%}"] for k, v in r["categories"].items()])
    return "\n".join(lines)


def conversation_phrase(c: dict) -> str:
    """The conversations' shape (counted at tokenize time): what the template rendered and what was learned."""
    shares = c.get("shares") or {}
    return (f"{c['count']:,} ({count(c['answers'], 'assistant turn')}): {c['assistant_first']:,} begin with the "
            f"assistant ({shares.get('assistant_first', 0):.1%}), {c['ends_without_answer']:,} end without an answer "
            f"({shares.get('ends_without_answer', 0):.1%}), {c['empty_answers']:,} blank answers "
            f"({shares.get('empty_answers', 0):.1%} of the assistant turns, each trained as its end-of-turn token "
            "alone)")


def parent(path: str) -> str:
    """The directory holding ``path``, a local path or a URL (``Path`` would make ``s3://`` ``s3:/``)."""
    return path.rstrip("/").rsplit("/", 1)[0] if "://" in path else str(Path(path).parent)


def _key(path: str, key: str) -> str:
    """``key 3f9a…, `` unless the entry's name already ends with it (``multipack-3f9a…``)."""
    return "" if Path(path).name.endswith(key[:16]) else f"key {key[:16]}, "


def field(label: str, value: str) -> list[str]:
    """``"  label         value"``, wrapped to ``WIDTH`` with the value continuing under itself."""
    return fit(f"  {label:<{HANG - 3}} {value}")


def _percentile_table(r: dict) -> list[str]:
    keys = ("p0", "p10", "p50", "p90", "p99", "p100")
    rows = []
    for label, s in (("documents per bin", r["documents_per_bin"]), ("tokens per bin", r["tokens_per_bin"])):
        if s["count"]:
            rows.append([label, s["mean"], *(s["percentiles"][k] for k in keys)])
    return table(["", "mean", *keys], rows) if rows else []


def overlong_line(s: dict, capacity: int, policy: str) -> str:
    return (f"overlong      {_docs(s['overlong_documents'])} > {capacity:,} tokens ({policy}): "
            f"dropped {s['dropped_documents']:,} ({s['dropped_tokens']:,} tokens), "
            f"truncated {s['truncated_documents']:,} ({s['truncated_tokens']:,} tokens cut), "
            f"split {s['split_documents']:,} (into {s['split_pieces']:,} pieces)")


def dp_line(b: dict) -> str:
    def change(name: str) -> str:
        before, after = b[f"{name}_before"], b[f"{name}_after"]
        return f"{before['mean']:.3f} → {after['mean']:.3f} (worst {before['max']:.3f} → {after['max']:.3f})"

    return (f"dp balance    {count(b['ranks'], 'data-parallel rank')} × {count(b['micro_batches_per_rank'], 'bin')} "
            f"per step, {count(b['steps'], 'step')}; Σlen² max/mean per step {change('imbalance')}, per micro-step "
            f"{change('micro_step_imbalance')}; {count(b['empty_bins_added'], 'empty bin')} added")


BLEND_UNITS = {"tokens": "tokens", "capacity": "bins × capacity", "target tokens": "target tokens"}  # shares count


def blend_unit_label(b: dict) -> str:
    """What a blend's delivered size is in: target tokens (a source has a loss mask), else tokens (a bin's capacity,
    or a token-aware bin's tokens)."""
    return "target tokens" if b["size"].get("unit") == "target tokens" else "tokens"


def render_blend(path: str, key: str, b: dict) -> list[str]:
    """A blend: its size, then per source the requested vs delivered share, how often it repeats, how its bins were
    drawn and what it delivers."""
    unit = b["size"].get("unit", "capacity")
    units = blend_unit_label(b) + (" (bins × capacity)" if unit == "capacity" else "")
    if b["seed"] is None:  # a --split validation blend: every held-out bin once, whatever the weights
        size = f"every held-out bin once: {b['tokens']:,} {units} in {count(b['bins'], 'bin')}"
    else:
        size = (f"{b['size']['option']}: {b['size']['total_tokens']:,} {units} asked, {b['tokens']:,} delivered "
                f"in {count(b['bins'], 'bin')}; shares count {BLEND_UNITS.get(unit, unit)}")
    order = "every held-out bin once" if b["seed"] is None else f"seed {b['seed']}"
    lines = [*wrap(f"blend {path}  ({_key(path, key)}{count(len(b['sources']), 'source')}, {b['method']} bins of "
                   f"{b['capacity']:,}, {order})", hang="  "),
             *field("size", size),
             *field("fill", f"{b['fill']:.4%}   ({b['real_tokens']:,} real tokens)"), ""]
    lines += blend_table(b["sources"])
    if b.get("phases"):
        lines += ["", *phase_table(b["phases"])]
    drawn = [f"{s['name']}: {s['drawn']}" for s in b["sources"] if s.get("drawn")]
    return lines + ["", *(line for d in drawn for line in field("drawn", d))] + [
        line for w in b.get("warnings") or [] for line in wrap(f"warning: {w}", hang="  ")]


def blend_table(sources: list[dict]) -> list[str]:
    """Per source: shares, bins taken of those it has, repeats, and the documents (and pieces) it delivers."""
    rows = [[s["name"], f"{s['requested_share']:.2%}", f"{s['delivered_share']:.2%}", s["bins"],
             s["bins_available"], f"{s['epochs']:.3g}x", _delivered(s), s["entry"]] for s in sources]
    lines = table(["source", "requested", "delivered", "bins", "of", "repeat", "documents delivered", "entry"], rows,
                  align="lrrrrrrl")
    return [line.rstrip() for line in lines]


def phase_table(phases: list[dict]) -> list[str]:
    """Per phase and source: where the phase starts (its first bin = the samples a sequential run has consumed
    on entering it), its size, and the requested vs delivered share, of blend units and of real tokens."""
    rows = []
    for p in phases:
        for k, s in enumerate(p["sources"]):
            head = [p["phase"], f"{p['start_bin']:,}", f"{p['bins']:,}", p["size"]] if k == 0 else ["", "", "", ""]
            rows.append([*head, s["name"], f"{s['requested_share']:.2%}", f"{s['delivered_share']:.2%}",
                         f"{s['real_tokens'] / max(p['real_tokens'], 1):.2%}", f"{s['bins']:,}"])
    lines = table(["phase", "from bin", "bins", "size", "source", "requested", "delivered", "real tokens", "bins"],
                  rows, align="rrrllrrrr")
    return [line.rstrip() for line in lines]


def _delivered(s: dict) -> str:
    """'1,203 of 4,018' documents a source delivers (with a piece in a bin it gives), of those it packed."""
    if s.get("documents_delivered") is None:
        return "-"
    return f"{s['documents_delivered']:,} of {s['documents']:,}"


def summary_lines(o: dict) -> list[str]:
    """What ``xprep pack`` prints on stdout (``o``: pack_report.outcome_report): hit or build with documents
    kept vs removed, then the figures a user checks first. Warnings go to stderr: see ``warning_lines``."""
    if o.get("blend"):
        b = o["blend"]
        head = (f"cache hit: {o['path']} (no blending done, " if o["hit"] else f"blended → {o['path']} (")
        lines = [f"{head}{o['seconds']:.2f} s; {_sources_packed(o['sources'])}): {count(b['bins'], 'bin')} of "
                 f"{b['capacity']:,}, {b['tokens']:,} {blend_unit_label(b)} (the unit its shares count)",
                 *("  " + line for line in blend_table(b["sources"]))]
        return lines + _validation_lines(o)
    s, capacity = o["stats"], o["capacity"]
    kept = kept_phrase(s, capacity)
    if o["hit"]:
        head = (f"cache hit: {o['path']} (no packing done, {o['seconds']:.2f} s): {kept} in {count(s['bins'], 'bin')} "
                f"of {capacity:,}")
    else:
        head = (f"packed {kept} into {count(s['bins'], 'bin')} of {capacity:,} in {o['pack_seconds']:.2f} s "
                f"→ {o['path']}")
    lines = [head,
             f"  fill {s['fill']:.4%}, lower bound {s['lower_bound_bins']:,} bins "
             f"(gap +{s['gap_to_lower_bound']:.3%}), padding {s['padding_tokens']:,} tokens",
             "  " + (chunk_line(s) if "samples" in s else overlong_line(s, capacity, o["config"]["overlong"]))]
    if s.get("dp_balance"):
        lines.append("  " + dp_line(s["dp_balance"]))
    return lines + _validation_lines(o)


def _sources_packed(sources: list[dict]) -> str:
    """How many sources of a blend were packed now, how many found in the cache."""
    packed, n = sum(not s["hit"] for s in sources), len(sources)
    if packed in (0, n):
        return f"{'all ' if n > 1 else ''}{count(n, 'source')} {'found in the cache' if packed == 0 else 'packed now'}"
    return f"{packed:,} of {count(n, 'source')} packed now, {n - packed:,} found in the cache"


def _validation_lines(o: dict) -> list[str]:
    """The --split held-out entries: validation, and test with a third share."""
    return [f"  {part} (--split): {_docs(v['documents'])} held out, {count(v['bins'], 'bin')} → {v['path']}"
            for part, v in ((p, o.get(p)) for p in ("validation", "test")) if v]


def chunk_line(s: dict) -> str:
    """--method chunk: samples cut from the stream, how many epochs of it."""
    return (f"chunk         {s['samples']:,} samples from {s['epochs']:,} epoch(s) of a stream of "
            f"{s['epoch_tokens']:,} tokens")


def kept_phrase(s: dict, capacity: int) -> str:
    """'412 of 500 documents (54,004 of 78,448 tokens; dropped 88 documents (24,444 tokens) longer than 256)'."""
    n_in, tokens_in, tokens = s["documents_in"], s["tokens_in"], s["tokens"]
    kept = n_in - s["dropped_documents"] - s["empty_documents"] - (s.get("no_target") or {}).get("documents", 0)
    docs = f"all {_docs(n_in)}" if kept == n_in and n_in else f"{kept:,} of {_docs(n_in)}"
    toks = f"{tokens:,} tokens" if tokens == tokens_in else f"{tokens:,} of {tokens_in:,} tokens"
    if "samples" in s:  # --method chunk: samples cut from the stream, repeated or not
        docs, toks = f"{tokens:,} tokens", f"in samples cut from a stream of {tokens_in:,} tokens, {_docs(kept)}"
    notes = []
    if s["dropped_documents"]:
        notes.append(f"dropped {_docs(s['dropped_documents'])} ({s['dropped_tokens']:,} tokens) "
                     f"longer than {capacity:,}")
    if s["truncated_documents"]:
        notes.append(f"truncated {_docs(s['truncated_documents'])} ({s['truncated_tokens']:,} tokens cut)")
    if s["split_documents"]:
        notes.append(f"split {_docs(s['split_documents'])} longer than {capacity:,} "
                     f"into {s['split_pieces']:,} pieces")
    if s["empty_documents"]:
        notes.append(f"skipped {s['empty_documents']:,} empty")
    untrained = s.get("no_target") or {}
    if untrained.get("pieces") or untrained.get("samples"):
        notes.append(f"dropped {untrained_phrase(untrained)} with no target token")
    return f"{docs} ({'; '.join([toks, *notes])})"


def untrained_phrase(u: dict) -> str:
    """'312 pieces (180,231 tokens; 41 documents left with none)': what was dropped for holding no target."""
    if u.get("samples"):
        return f"{count(u['samples'], 'sample')} ({count(u['tokens'], 'token')})"
    gone = f"; {_docs(u['documents'])} left with none" if u.get("documents") else ""
    return f"{count(u['pieces'], 'piece')} ({count(u['tokens'], 'token')}{gone})"


def _docs(n: int) -> str:
    return count(n, "document")


def warning_lines(o: dict) -> list[str]:
    """What ``xprep pack`` prints on stderr: an empty pack, or more than 1 % of the tokens removed (for a
    blend: of each source, named)."""
    if o.get("blend"):
        names = [row["name"] for row in o["blend"]["sources"]]
        return [f"{line[:9]}blend source {name!r}: {line[9:]}"
                for name, source in zip(names, o["sources"], strict=True) for line in warning_lines(source)] + [
            f"warning: {w}" for w in o["blend"].get("warnings") or []]
    s, config = o["stats"], o["config"]
    if s["bins"] == 0:
        return ["warning: the pack has 0 bins (--allow-empty): there is nothing to train on"]
    out = []
    untrained = s.get("no_target") or {}
    if s["tokens_in"] and untrained.get("tokens", 0) / s["tokens_in"] > LOUD_TOKEN_SHARE:
        out.append(f"warning: {100 * untrained['tokens'] / s['tokens_in']:.1f} % of tokens dropped in "
                   f"{untrained_phrase(untrained)} with no target token (e.g. the pieces of a long prompt before its "
                   f"answer): nothing in them would be learned")
    removed = s["dropped_tokens"] + s["truncated_tokens"]
    if o["packing"]["fixed_length_samples"] or not s["tokens_in"] or removed / s["tokens_in"] <= LOUD_TOKEN_SHARE:
        return out  # chunk cuts no document: it leaves only the stream's tail short of one more sample
    option = o["packing"]["capacity_option"]
    if config["overlong"] == "drop":
        how, fix = "dropped as overlong", f"raise {option} or use --overlong split|truncate"
    else:
        how, fix = "cut by --overlong truncate", f"raise {option} or use --overlong split"
    return out + [f"warning: {100 * removed / s['tokens_in']:.1f} % of tokens ({removed:,} of {s['tokens_in']:,}) "
                  f"{how}: {fix}"]


# --------------------------------------------------------------------------------------------- run
def _loss_weights(weights: dict) -> str:
    """``--category-weight``/``--source-weight`` of a weighted run, as given (every other name weighs 1)."""
    given = [f"{kind} {name} {w:g}" for kind in ("category", "source")
             for name, w in (weights.get(kind) or {}).items() if w != 1]
    return (", ".join(given) or "all 1") + " (others 1): loss Σ w·CE / Σ w; validation loss unweighted"


def render_run(r: dict) -> str:
    cfg = r.get("settings") or {}
    lines = [f"run {r['path']}"]
    if r.get("pack"):
        p = r["pack"]
        lines += field("pack", f"{p['path']}  ({_key(p['path'], p['key'])}{count(p['bins'], 'bin')} of "
                               f"{p['capacity']:,})")
    for ph in (r.get("pack") or {}).get("phases") or []:  # a mix with phases: where each starts in this run
        start = f"step {ph['first_step']:,}" if ph.get("first_step") else "(random sampler: no step)"
        lines += field(f"phase {ph['phase']}", f"from {start} (consumed samples {ph['start_bin']:,}), "
                                               f"{count(ph['bins'], 'bin')}, " + ", ".join(
                                                   f"{n} {w:.0%}" for n, w in ph["weights"].items()))
    if r.get("validation"):
        v = r["validation"]
        when = f"every {count(v['every'], 'step')} and at the end" if v.get("every") else "at the end"
        lines += field("validation", f"{v['path']}  ({v['eval_bins']:,} of {count(v['bins'], 'bin')}, {when})")
    if cfg:
        lines += field("model", f"{cfg.get('model')}   sampler {cfg.get('sampler')}   lr {cfg.get('lr')} "
                                f"({cfg.get('schedule')}, warm-up {cfg.get('warmup')})")
    if r.get("layout"):
        lines += field("layout", r["layout"])
    if r.get("loss_weights"):
        lines += field("loss weights", _loss_weights(r["loss_weights"]))
    total = (r.get("plan") or {}).get("steps")
    lines.append(f"  steps logged  {r['steps']:,}" + (f" / {total:,}" if total else "")
                 + (f"   tokens {r['tokens']:,}" if "tokens" in r else ""))
    lines += _without_targets(r)
    if r.get("skipped_steps"):
        lines += field("skipped", f"{count(r['skipped_steps'], 'step')} with a non-finite loss or gradient norm: "
                                  "no update applied")
    if r.get("replayed"):
        lines += field("replayed", ", ".join(f"{f['file']} (steps {f['first_step']}–{f['last_step']})"
                                             for f in r["replayed"])
                       + ": logged, then trained again after a resume; not in the figures")
    if r.get("perf"):
        lines.append(_perf_line(r["perf"]))  # one line, wide as it may be: scripts find the figures on it
    ck = r["checkpoints"]
    lines += field("checkpoints", f"{', '.join(f'step-{s}' for s in ck['steps']) or 'none'}"
                   + (f"   (latest {ck['latest']})" if ck["latest"] else "")
                   + ("   " + _joined(f"best {ck['best']} ({_BEST_BY[ck['best_by']]} {ck['best_loss']:.4f})")
                      if ck.get("best") else ""))
    if "loss" not in r:
        lines.append("  no metrics yet" if not r["steps"] else "  no loss yet: no step logged had target tokens")
        return "\n".join(lines)
    lines.append("")
    lines += _loss_table("training loss", r["loss"], r["categories"], r.get("sources") or {})
    lines.append("")
    if r.get("eval"):
        e = r["eval"]
        lines += _loss_table(f"validation loss ({count(e['bins'], 'bin')}, {e['target_tokens']:,} targets)", e["loss"],
                             e["categories"], e["sources"])
        lines.append("")
    for name, e in (r.get("eval_sets") or {}).items():  # --eval's named sets (the validation entry is valid)
        lines += _loss_table(f"eval/{name} loss ({count(e['bins'], 'bin')}, {e['target_tokens']:,} targets)",
                             e["loss"], e["categories"], e["sources"])
        lines.append("")
    lines += _test_lines(r.get("test"))
    lines.append(f"loss curves: drawn into {r['plot']}" if r.get("plot") else
                 "loss curves: not drawn; add --plot FILE to draw them (needs matplotlib)")
    return "\n".join(lines)


_BEST_BY = {"eval_loss": "validation loss", "loss": "training loss"}


def _test_lines(test: dict | None) -> list[str]:
    """The test pass (once, after the last step: run.json's ``test``): the loss of each set, then by category and
    by source (more than one)."""
    lines = []
    for name, t in (test or {}).items():
        loss = "none (no target tokens)" if t.get("loss") is None else f"{t['loss']:.4f}"
        lines.append(f"test/{name} after step {t['step']:,}: loss {loss} ({count(t['bins'], 'bin')}, "
                     f"{t['target_tokens']:,} targets)")
        rows = [[k, f"{v:.4f}"] for k, v in (t.get("category_loss") or {}).items()]
        if len(t.get("source_loss") or {}) > 1:
            rows += [[f"source {k}", f"{v:.4f}"] for k, v in t["source_loss"].items()]
        lines += [*table(["", "loss"], rows), ""] if rows else [""]
    return lines


def _without_targets(r: dict) -> list[str]:
    """Steps and evaluations whose batch had no target token: they have no loss, and the figures leave them out."""
    steps, evaluations = r.get("steps_without_targets") or 0, r.get("evaluations_without_targets") or 0
    if not steps and not evaluations:
        return []
    what = " and ".join(part for part in (steps and count(steps, "step"), evaluations and count(evaluations,
                                                                                                "evaluation")) if part)
    return field("no targets", f"{what} without a target token: no loss, left out of the figures below")


def _perf_line(p: dict) -> str:
    """Median throughput (and MFU where the run knew its peak), then the peak memory."""
    parts = [f"{p['tokens_per_s']:,.0f} tok/s" if p.get("tokens_per_s") is not None else "tok/s not logged"]
    if p.get("tflops") is not None:
        parts.append(f"{p['tflops']:.3g} TFLOPS/GPU")
    if p.get("mfu") is not None:
        parts.append(f"MFU {100 * p['mfu']:.3g}%")
    if p.get("mfu_6n") is not None:
        parts.append(f"6N MFU {100 * p['mfu_6n']:.3g}%")
    line = f"  throughput    {', '.join(parts)} (median of {p['steps']:,} steps)"
    if p.get("peak_mem_bytes") is not None:
        line += f"   peak memory {p['peak_mem_bytes'] / 2**30:.1f} GiB (CUDA allocated)"
    if p.get("peak_rss_bytes") is not None:
        line += f"   peak RSS {p['peak_rss_bytes'] / 2**30:.1f} GiB"
    return line


def _loss_table(title: str, overall: dict, categories: dict, sources: dict) -> list[str]:
    """The loss over the run, all targets then by category and by source (the sources when more than one)."""
    rows = [_row("all", overall)] + [_row(name, s) for name, s in categories.items()]
    if len(sources) > 1:
        rows += [_row(f"source {name}", s) for name, s in sources.items()]
    return [title, *table(["", "points", "first", "last", "best", "best step", "trend"], rows)]


def _row(name: str, s: dict) -> list:
    return [name, s["points"], f"{s['first']:.4f}", f"{s['last']:.4f}", f"{s['best']:.4f}", s["best_step"],
            f"{100 * s['trend']:+.1f}%"]


# ----------------------------------------------------------------------------------------- lineage
def render_lineage(r: dict) -> str:
    """``xprep inspect runs/NAME --seen``: what the model has trained on up to a step."""
    lines = [f"run {r['run']}: trained on up to step {r['step']:,} ({r['step_from']})",
             f"  pack          {r['pack']}  (key {r['key'][:16]})",
             f"  sampler       {r['sampler']} (seed {r['seed']}), {count(r['consumed_samples'], 'bin')} consumed "
             f"({r['global_batch_size']} per step)",
             f"  documents     {len(r['documents']):,} distinct, {r['tokens']:,} tokens", ""]
    lines += table(["source", "tokens", "documents"], [[s["name"], s["tokens"], s["documents"]]
                                                     for s in r["sources"]])
    lines.append("")
    lines += table(["category", "tokens"], [[name, n] for name, n in r["categories"].items()])
    lines.append("")
    rows = [[d["dataset"], d["document"], d["source"], ",".join(d["categories"]), d["tokens"], d["pieces"]]
            for d in r["documents"]]
    lines += table(["dataset", "document", "source", "categories", "tokens", "pieces"], rows, align="lrllrr")
    return "\n".join(lines)
