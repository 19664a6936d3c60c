"""`xprep inspect` of a blend with phases: the text report lists each phase's first bin (the consumed
samples at which a sequential run enters it), size and requested vs delivered shares; the HTML page draws them
(stacked, per phase) with every number equal to the --json report's."""

from __future__ import annotations

import html
import json
import re

from prepkit import random_dataset, xprep_invoke
from xprep.prep.pack.cache import PackConfig, pack

PHASES = [{"bins": 30, "weights": {"a": 0.75, "b": 0.25}}, {"bins": 20, "weights": {"a": 0.5, "b": 0.5}}]


def test_the_reports_show_each_phase(tmp_path):
    sources = [{"dataset": str(random_dataset(tmp_path / n, 80, i)), "name": n} for i, n in enumerate("ab")]
    (tmp_path / "mix.json").write_text(json.dumps({"sources": sources, "phases": PHASES}))
    pack([], tmp_path / "P", PackConfig(method="multipack", seq_len=64), mix=str(tmp_path / "mix.json"))

    report = json.loads(xprep_invoke("inspect", tmp_path / "P", "--json").output)
    phases = report["blend"]["phases"]
    assert [(p["start_bin"], p["bins"]) for p in phases] == [(0, 30), (30, 20)]
    text = xprep_invoke("inspect", tmp_path / "P").output
    for p, start, asked in zip(phases, (0, 30), PHASES, strict=True):
        a = p["sources"][0]
        row = (rf"\n +{p['phase']} +{start} +{asked['bins']} +bins: {asked['bins']} +a +"
               rf"{asked['weights']['a']:.2%} +{a['delivered_share']:.2%} ").replace(".", r"\.")
        assert re.search(row, text), (row, text)
        assert abs(a["delivered_share"] - asked["weights"]["a"]) <= 1 / asked["bins"]  # within a bin (Megatron)

    xprep_invoke("inspect", tmp_path / "P", "--html", tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "Phases: requested vs delivered shares" in page and "Phases of the mix" in page
    drawn = re.findall(r'data-path="(/blend/phases/[^"]+)" data-value="([^"]*)"', page)
    bars = {path for path, _ in drawn if path.endswith("_share")}
    assert bars == {f"/blend/phases/{p}/sources/{k}/{kind}_share" for p in range(2) for k in range(2)
                    for kind in ("requested", "delivered")}
    for path, value in drawn:  # each number drawn or tabled is the report's
        at = report
        for part in path.strip("/").split("/"):
            at = at[int(part)] if isinstance(at, list) else at[part]
        assert json.loads(html.unescape(value)) == at, path
