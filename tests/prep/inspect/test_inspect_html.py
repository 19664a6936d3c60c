"""``xprep inspect PATH... --html OUT`` (issue 14): one self-contained page for the demo's datasets, packs and
runs, loaded in headless Chromium.

The page loads with no console error and no request but its own file, its screenshot is not blank, every
number it tags (``data-path`` + ``data-value``) equals the ``--json`` report at that path, the static file holds
the same numbers (the tables read without JavaScript), every chart has a title and axis labels with units, a
category has one colour on the whole page, and the legend and hover work. Bad input is one line, exit 2.
The browser tests skip, saying so, only where no Chromium is found (``.ci/run`` installs Debian's).
"""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from browserkit import Chromium, file_url, find_chromium, pixel_summary
from click.testing import CliRunner
from prepkit import one_line_error, tokenize, xprep_invoke
from trainkit import make_dataset
from xprep.cli import xtrain
from xprep.prep.demo import build

BROWSER_TIMEOUT = 60  # seconds any one exchange with Chromium may take


# -------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The demo pipeline, small (33 modules: two chat categories): code and chat datasets, their 70/30 blend
    (CP 2) with an 80/20 split (the demo's 95/5 could draw no code document), a token-aware pack of the chat
    balanced over 2 DP ranks,
    a 4-step run evaluating every 2 steps, and a copy of that run with other losses (two runs to overlay);
    then the page and the --json reports."""
    root = tmp_path_factory.mktemp("html")
    build(root, limit_bytes=600_000)  # prep/demo.py: standard-library code, docstring chats, a BPE tokenizer
    for name in ("code", "chat"):
        tokenize(root / "corpus" / f"{name}.jsonl", root / name, root / "tokenizer")
    packed, balanced, run = root / "packed", root / "balanced", root / "runs" / "demo"
    for args in ([f"{root / 'code'}@0.7", f"{root / 'chat'}@0.3", "-o", packed, "--method", "multipack",
                  "--seq-len", 1024, "--cp-size", 2, "--overlong", "split", "--split", "80,20"],
                 [root / "chat", "-o", balanced, "--method", "token-aware", "--max-tokens", 2048, "--balance-dp", 2,
                  "--dp-micro-batches", 2]):
        result = xprep_invoke("pack", *args)
        assert result.exit_code == 0, result.output
    train(["run", packed, "--model", "tiny", "--steps", 4, "--micro-batch-size", 1, "--global-batch-size", 2,
           "--lr", 3e-3, "--warmup", 1, "--sampler", "random", "--eval-every", 2, "--eval-bins", 2, "--save-every", 2,
           "--output", run])
    other = other_run(run, root / "runs" / "other")
    paths = [root / "code", root / "chat", packed, balanced, run, other]
    page = root / "report.html"
    result = xprep_invoke("inspect", *paths, "--json", "--html", page)
    assert result.exit_code == 0, result.output
    return {"root": root, "paths": paths, "page": page, "reports": json.loads(result.stdout)}


def train(args: list) -> None:
    """``xtrain ARGS`` in this process, on one thread: a tiny model gains nothing from more, and on a busy
    machine they only wait for each other (the thread count is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = CliRunner().invoke(xtrain, list(map(str, args)))
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output


def other_run(run: Path, out: Path) -> Path:
    """A copy of ``run`` whose losses are 5 % higher and which logs MFU (as a GPU run would)."""
    shutil.copytree(run, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for key in ("loss", "eval_loss"):
            if key in r:
                r[key] *= 1.05
        r["category_loss"] = {k: v * 1.05 for k, v in r["category_loss"].items()}
        r["mfu"] = 0.3 + r["step"] / 1000
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


READ_PAGE = """(() => {
  const painted = (el) => {
    const s = getComputedStyle(el.matches("g.series") ? el.querySelector("path") : el.matches("button") ?
                                el.querySelector("line") : el);
    return el.matches("i") ? s.backgroundColor : el.matches("rect") ? s.fill : s.stroke;
  };
  const css = (colour) => { const probe = document.createElement("i"); probe.style.color = colour;
    document.body.append(probe); const out = getComputedStyle(probe).color; probe.remove(); return out; };
  return {
    values: [...document.querySelectorAll("[data-path]")].map((e) => [
      e.closest("[data-report]")?.dataset.report ?? null, e.dataset.path, e.dataset.value, e.dataset.xPath ?? null,
      e.dataset.x ?? null]),
    texts: [...document.querySelectorAll("[data-path]")].filter((e) => e instanceof HTMLElement)
      .map((e) => [e.dataset.value, e.textContent]),
    charts: [...document.querySelectorAll("svg.chart")].map((svg) => ({kind: svg.dataset.kind,
      title: svg.querySelector(".chart-title")?.textContent, x: svg.querySelector(".axis-label.x")?.textContent,
      y: svg.querySelector(".axis-label.y")?.textContent, section: svg.closest("section").id})),
    colours: [...document.querySelectorAll("[data-category]")].map((e) => [e.dataset.category, painted(e),
      css(e.dataset.colour), e.closest("section").id]),
    sections: [...document.querySelectorAll("section.report")].map((s) => s.id),
  };
})()"""

TRY_LEGEND_AND_HOVER = """(async () => {
  const figure = [...document.querySelectorAll("figure")].find((f) =>
    f.querySelector(".chart-title")?.textContent === "Training loss by category");
  const key = figure.querySelector(".legend .key[data-series]");
  const hidden = () => [...figure.querySelectorAll(`svg [data-series="${key.dataset.series}"]`)]
    .every((e) => e.classList.contains("off"));
  key.click();
  const afterClick = hidden();
  key.click();
  const afterSecond = hidden();
  const svg = figure.querySelector("svg");
  svg.scrollIntoView();
  await new Promise((done) => requestAnimationFrame(done));
  const box = svg.getBoundingClientRect();
  svg.dispatchEvent(new MouseEvent("mousemove", {clientX: box.left + box.width * 0.6, clientY: box.top + box.height / 2,
                                                 bubbles: true}));
  const tip = document.getElementById("tip");
  return {afterClick, afterSecond, tipShown: !tip.hidden, tip: tip.textContent};
})()"""


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.skip("Chromium not found (chromium on PATH, /usr/bin/chromium or $CHROMIUM): the page is not "
                    "loaded in a browser here; `apt-get install -y chromium` (.ci/run does it) runs these tests")
    return found


@pytest.fixture(scope="module")
def browser(chromium) -> Chromium:
    """One headless Chromium for the module's tests: each loads its pages in its tab, what the tab saw before
    forgotten (``events`` cleared), so that a browser starts once."""
    with Chromium(chromium, timeout=BROWSER_TIMEOUT) as started:
        yield started


@pytest.fixture(scope="module")
def browsed(demo, browser) -> dict:
    """What Chromium saw of the page: problems, requests, pixels, the tagged values, charts and colours, and the
    outcome of clicking a legend key and hovering a chart (every wait bounded)."""
    browser.events.clear()
    seconds = browser.open(file_url(demo["page"]), width=1280, height=900)
    page = browser.evaluate(READ_PAGE)
    interaction = browser.evaluate(TRY_LEGEND_AND_HOVER, await_promise=True)
    png = browser.screenshot(full_page=True)
    problems, requests = browser.problems(), browser.requests()
    pixels = pixel_summary(browser, png)
    (demo["root"] / "report.png").write_bytes(png)  # kept beside the page for a look by eye
    return {"seconds": seconds, "problems": problems, "requests": requests, "pixels": pixels,
            "interaction": interaction, **page}


def resolve(report: dict, pointer: str):
    """The value at a JSON pointer (RFC 6901) of a report."""
    value = report
    for raw in pointer.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


# ----------------------------------------------------------------------------------------- in Chromium
def test_page_loads_without_errors_or_network(browsed, demo):
    assert browsed["problems"] == []
    assert browsed["requests"] == [file_url(demo["page"])]  # the page itself, nothing else
    assert browsed["seconds"] < 10


def test_screenshot_is_not_blank(browsed):
    px = browsed["pixels"]
    assert px["width"] == 1280 and px["height"] > 2000, px
    assert px["colours"] > 50 and px["share"] > 0.05, px


def test_values_on_the_page_equal_the_json_report(browsed, demo):
    reports = demo["reports"]
    assert [r["kind"] for r in reports] == ["dataset", "dataset", "packed", "packed", "run", "run"]
    seen = set()
    for report, path, value, x_path, x in browsed["values"]:
        assert report is not None, path
        k = int(report)
        assert json.loads(value) == resolve(reports[k], path), (k, path)
        if x_path:
            assert json.loads(x) == resolve(reports[k], x_path), (k, x_path)
        seen.add((k, path))
    assert seen >= expected_on_page(reports), sorted(expected_on_page(reports) - seen)


def test_the_text_a_person_reads_is_that_value(browsed):
    """Cards and table cells show their tagged value, rounded as printed (1,234 · 12.34% · 8.5750 · +5.0%)."""
    assert len(browsed["texts"]) > 100
    for value, text in browsed["texts"]:
        assert shown(text, json.loads(value)), (text, value)


def shown(text: str, value) -> bool:
    if value is None or isinstance(value, str):
        return text == ("–" if value is None else value)
    number, scale = text.strip().lstrip("+").rstrip("×").replace(",", ""), 1.0
    if number.endswith("%"):
        number, scale = number[:-1], 100.0
    digits = number.split(".")[1] if "." in number and "e" not in number else ""
    tolerance = abs(float(number)) * 1e-3 if "e" in number else 0.5 * 10.0 ** -len(digits)
    return abs(float(number) - value * scale) <= tolerance * (1 + 1e-9)


def expected_on_page(reports: list[dict]) -> set[tuple[int, str]]:
    """What each section must show: the figures the issue lists, by their place in the report."""
    code, chat, blend, balanced, run, other = reports
    want = {(k, p) for k in (0, 1) for p in ("/documents", "/tokens", "/loss_tokens", "/target_share",
                                             "/lengths/percentiles/p50", "/rejects/count", "/source_files/0/size")}
    want |= {(1, f"/categories/{name}/{key}") for name in chat["categories"] for key in ("tokens", "loss_tokens")}
    want |= {(1, f"/histogram/{k}/count") for k, h in enumerate(chat["histogram"]) if h["count"]}
    want |= {(2, f"/blend/sources/{k}/{key}") for k in range(2) for key in ("requested_share", "delivered_share")}
    want |= {(2, f"/source_reports/1/categories/{name}") for name in blend["source_reports"][1]["categories"]}
    want |= {(2, f"/fill_histogram/{k}/count") for k in range(len(blend["fill_histogram"]))}
    want |= {(3, p) for p in ("/fill", "/gap_to_lower_bound", "/padding_tokens", "/cp_padding_tokens",
                              "/dp_balance/imbalance_before/mean", "/dp_balance/imbalance_after/mean",
                              "/dp_steps/rank_loads/0", "/dp_steps/rank_loads/1")}
    want |= {(3, f"/categories/{name}") for name in balanced["categories"]}
    for k, r in ((4, run), (5, other)):
        want |= {(k, p) for p in ("/curves/loss", "/curves/lr", "/curves/grad_norm", "/curves/tokens_per_s",
                                  "/curves/eval/loss", "/loss/last", "/checkpoints/steps/0")}
        want |= {(k, f"/curves/category_loss/{name}") for name in r["curves"]["category_loss"]}
        if len(r["curves"]["source_loss"]) > 1:  # one source: no chart of them
            want |= {(k, f"/curves/source_loss/{name}") for name in r["curves"]["source_loss"]}
    return want | {(5, "/curves/mfu")}


def test_every_chart_has_a_title_and_axis_labels_with_units(browsed):
    assert len(browsed["charts"]) >= 20
    for chart in browsed["charts"]:
        assert chart["title"] and chart["x"] and chart["y"], chart
        assert "(" in chart["x"] and chart["x"].endswith(")"), chart  # e.g. "step (optimizer steps)"
        if chart["kind"] != "bars":  # a bar chart's other axis names its rows (category, source)
            assert "(" in chart["y"] and chart["y"].endswith(")"), chart


def test_a_category_has_one_colour_across_sections(browsed, demo):
    colours, sections = {}, {}
    for name, painted, declared, section in browsed["colours"]:
        assert painted == declared, (name, section)
        colours.setdefault(name, set()).add(painted)
        sections.setdefault(name, set()).add(section)
    assert all(len(c) == 1 for c in colours.values()), colours
    categories = set(demo["reports"][0]["categories"]) | set(demo["reports"][1]["categories"])
    assert len(categories) >= 3, categories
    for name in categories:  # its dataset, the blend's source of it, (the balanced pack,) the runs
        assert len(sections[name]) >= 3, (name, sections[name])
    assert len({c.pop() for name, c in colours.items() if name in categories}) == len(categories)  # all differ


def test_legend_toggles_and_hover_shows_values(browsed):
    i = browsed["interaction"]
    assert i["afterClick"] and not i["afterSecond"], i
    assert i["tipShown"] and i["tip"].startswith("step ") and "all targets" in i["tip"], i


CARD_NUMBERS = """[...document.querySelectorAll(".card .value")].map((e) => {
  const range = document.createRange();
  range.selectNodeContents(e.firstChild);
  const card = e.closest(".card").getBoundingClientRect(), text = range.getBoundingClientRect();
  return {text: e.textContent, lines: range.getClientRects().length,
          inside: text.left >= card.left - 0.5 && text.right <= card.right + 0.5};
})"""


def scaled_up(value):
    """Every count of a report ten million times larger (a corpus of 10^11 tokens rather than the demo's)."""
    if isinstance(value, dict):
        return {k: scaled_up(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scaled_up(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value * 10**7 + 1_234_567
    return value


def test_a_stat_card_shows_its_number_on_one_line(demo, browser, tmp_path):
    """Cards hold the key figures; a number is never broken over two lines nor wider than its card, however many
    digits it has (98,765,432,109 tokens), on a wide window or a phone's."""
    from xprep.prep.inspect.html import write_page

    page = tmp_path / "big.html"
    write_page([scaled_up(r) for r in demo["reports"]], page)
    browser.events.clear()
    for width in (1280, 390):
        browser.open(file_url(page), width=width, height=900)
        cards = browser.evaluate(CARD_NUMBERS)
        assert len(cards) > 30 and max(len(c["text"]) for c in cards) >= 14, cards
        assert [c for c in cards if c["lines"] != 1 or not c["inside"]] == [], width
        assert browser.problems() == []


# ------------------------------------------------------------------------------------- without a browser
class Tagged(HTMLParser):
    """The tagged values of a static HTML file, with the report of their nearest ``data-report`` ancestor."""

    VOID = {"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr", "area", "base", "embed"}

    def __init__(self):
        super().__init__()
        self.stack: list[str | None] = []
        self.values: list[tuple] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        report = a.get("data-report", self.stack[-1] if self.stack else None)
        if "data-path" in a:
            self.values.append((report, a["data-path"], a["data-value"], a.get("data-x-path"), a.get("data-x")))
        if tag not in self.VOID:
            self.stack.append(report)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag not in self.VOID:
            self.stack.pop()


def test_the_file_holds_every_value_without_javascript(demo, browsed):
    """The numbers are in the markup itself (tables and charts read with scripts off), as the browser shows."""
    parser = Tagged()
    parser.feed(demo["page"].read_text(encoding="utf-8"))
    assert sorted(map(tuple, browsed["values"])) == sorted(parser.values)


def test_untrusted_names_and_empty_data(tmp_path):
    """A category name is untrusted text (escaped in the markup, escaped in its JSON pointer); a dataset with no
    document and a pack of 0 bins still make a page, every value on it from the reports."""
    hostile = "a/b~c <script>alert(1)</script>"
    docs = [np.arange(1, n + 1) % 200 for n in (5, 40, 300)]
    make_dataset(tmp_path / "ds", docs, cats=[np.full(len(d), 1) for d in docs], categories=[hostile])
    make_dataset(tmp_path / "empty", [])
    assert xprep_invoke("pack", tmp_path / "ds", "-o", tmp_path / "P", "--method", "multipack", "--seq-len", 4,
                        "--overlong", "drop", "--allow-empty").exit_code == 0
    page = tmp_path / "page.html"
    result = xprep_invoke("inspect", tmp_path / "ds", tmp_path / "empty", tmp_path / "P", "--json", "--html", page)
    assert result.exit_code == 0, result.output
    reports, html = json.loads(result.stdout), page.read_text(encoding="utf-8")
    assert "<script>alert" not in html and html.count("<script>") == 1
    parser = Tagged()
    parser.feed(html)
    for report, path, value, _, _ in parser.values:
        assert json.loads(value) == resolve(reports[int(report)], path), path
    escaped = hostile.replace("~", "~0").replace("/", "~1")
    assert ("0", f"/categories/{escaped}/tokens") in {v[:2] for v in parser.values}


def test_the_file_fetches_nothing(demo):
    html = demo["page"].read_text(encoding="utf-8")
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    for needle in (" src=", "<link", "url(", "@import"):
        assert needle not in html, needle
    assert all(ref.startswith("#") for ref in _hrefs(html))


def _hrefs(html: str) -> list[str]:
    return [part.split('"', 1)[0] for part in html.split(' href="')[1:]]


def test_text_stays_the_default_and_json_one_object_per_path(demo):
    code, chat = demo["paths"][:2]
    text = xprep_invoke("inspect", code, chat)
    assert text.exit_code == 0 and text.stdout.count("dataset ") >= 2 and not text.stdout.startswith("{")
    one = json.loads(xprep_invoke("inspect", code, "--json").stdout)
    assert one["kind"] == "dataset" and one == demo["reports"][0] | {"path": one["path"]}


def test_bad_input_is_one_line(demo, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("hello")
    empty_run = tmp_path / "runs" / "new"
    empty_run.mkdir(parents=True)
    (empty_run / "config.json").write_text("{}")
    out = tmp_path / "page.html"
    cases = [([demo["paths"][0], tmp_path / "notes"], "neither a token dataset, a pack cache nor a run directory"),
             ([demo["paths"][4], empty_run], "no metrics yet")]
    for paths, needle in cases:
        line = one_line_error(xprep_invoke("inspect", *paths, "--html", out))
        assert needle in line and not out.exists(), line


@pytest.mark.parametrize("target, needle", [("dir", "is a directory"), ("missing/page.html", "does not exist"),
                                            ("afile/page.html", "not a directory"),
                                            ("/proc/xprep-page.html", "cannot write in")])
def test_an_unwritable_page_is_one_line_before_any_work(demo, tmp_path, target, needle):
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    if target.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    out = target if target.startswith("/") else tmp_path / target
    line = one_line_error(xprep_invoke("inspect", demo["paths"][0], "--html", out))
    assert f"--html {out}" in line and needle in line, line


def test_axes_of_counts_have_whole_ticks_only():
    """Documents, records and tokens come in whole numbers: a count axis of small counts ticks 0, 1, 2, never 0.5,
    while an axis of values (a loss, a share) keeps fractional ticks."""
    from xprep.prep.inspect.charts import linear_ticks, nice_range, y_value_axis

    _, ticks = y_value_axis([0, 1, 3, 2], counts=True)
    assert [t for t, _ in ticks] == [0, 1, 2, 3]
    _, ticks = y_value_axis([0, 0], counts=True)  # nothing counted: still whole
    assert all(float(t).is_integer() for t, _ in ticks)
    _, ticks = y_value_axis([0.0, 0.3, 0.7])
    assert any(not float(t).is_integer() for t, _ in ticks)
    lo, hi = nice_range(0, 2, zero=True, least=1.0)
    assert (lo, hi) == (0, 2) and linear_ticks(0, 2, least=1.0) == [0, 1, 2]
    assert linear_ticks(0, 4000, least=1.0) == linear_ticks(0, 4000)  # large counts: the usual round steps


def test_tick_labels_tell_close_ticks_apart():
    """A loss that moves little (11.80 to 11.84 over a short run) gets round steps whose labels all differ and
    show the step's decimals alike (11.80, not 11.8); the same for shares, ratios and large counts."""
    from xprep.prep.inspect.charts import labelled, linear_ticks, nice_range, percent, short, y_value_axis

    _, ticks = y_value_axis([11.8012, 11.8233, 11.8391], zero=False)
    values, labels = zip(*ticks, strict=True)
    assert labels == ("11.80", "11.81", "11.82", "11.83", "11.84")
    assert [float(label) for label in labels] == list(values)
    for lo, hi, fmt, expect in [(0.70, 0.701, percent, ["70.00%", "70.02%", "70.04%", "70.06%", "70.08%", "70.10%"]),
                                (1.0, 1.004, short, ["1.000", "1.001", "1.002", "1.003", "1.004"]),
                                (152_300, 152_400, short, ["152.30k", "152.32k", "152.34k", "152.36k", "152.38k",
                                                           "152.40k"]),
                                (0, 4000, short, ["0", "1k", "2k", "3k", "4k"]),
                                (0, 1, percent, ["0%", "20%", "40%", "60%", "80%", "100%"])]:
        assert [label for _, label in labelled(linear_ticks(lo, hi), fmt)] == expect, (lo, hi)
    for lo, hi in [(11.8, 11.80001), (0.0, 3e-5), (2.5e-5, 2.6e-5), (0.1, 0.35), (1e9, 1.0000001e9)]:
        a, b = nice_range(lo, hi)
        labels = [label for _, label in labelled(linear_ticks(a, b))]
        assert len(labels) >= 3 and len(set(labels)) == len(labels), (lo, hi, labels)
    assert short(11.8) == "11.8" and short(2.5e-4) == "2.5e-4" and short(1500) == "1.5k"  # a lone value: 3 digits


def test_a_line_chart_of_steps_ticks_whole_steps():
    """Optimizer steps are whole: a run of 4 steps has x ticks 1 2 3 4, not 1.5."""
    import re

    from xprep.prep.inspect.charts import Series, Source, line_chart

    steps = Source(None, [1, 2, 3, 4])
    svg = line_chart("t", "step (optimizer steps)", "loss (nats)", [Series("all", Source(None, [3.0, 2.9, 2.8, 2.7]),
                                                                           steps)])
    assert re.findall(r'class="tick x"[^>]*>([^<]*)<', svg) == ["1", "2", "3", "4"]
