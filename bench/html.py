"""Benchmark of ``xprep inspect --html``: the page of a 10M-document dataset and a 10M-bin pack.

    python -m bench.html            # 10M documents, packed into ~10M bins
    python -m bench.html --quick    # 1M

Target (issue 14): the page renders in Chromium in < 2 s and weighs < 5 MB, whatever the size of the data
(histograms are binned on the Python side, in the report). The dataset is written in its on-disk format
straight from numpy (lengths drawn log-normal, ``.idx`` by ``prep.dataset.indexed.write_index``, the ``.bin`` a sparse
file of the right size: the reports never read token ids), then packed by the real ``xprep pack``
(sequential, ``--seq-len 256 --overlong split``, about one bin a document). The reports are the real ones.
Render time: Chromium's navigation to the load event and two animation frames after it (laid out and
painted), best of 3; baseline in the same run: an empty page. Also timed: building the reports and the page.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:] = [str(ROOT), str(ROOT / "tests")] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from browserkit import Chromium, file_url, find_chromium  # noqa: E402  (tests/browserkit.py: DevTools, stdlib)
from xprep.prep.dataset.indexed import bin_path, idx_path, write_index  # noqa: E402
from xprep.prep.dataset.token_dataset import FORMAT_VERSION, fingerprint  # noqa: E402
from xprep.prep.formats import DATASET_FORMAT, MANIFEST, TOKENS_STREAM  # noqa: E402
from xprep.prep.inspect.dataset_report import dataset_report  # noqa: E402
from xprep.prep.inspect.html import page  # noqa: E402
from xprep.prep.inspect.pack_report import pack_report  # noqa: E402
from xprep.prep.pack.cache import PackConfig, pack  # noqa: E402

CATEGORIES = ("web", "code", "math", "chat", "books", "papers")
TARGET_SECONDS, TARGET_BYTES = 2.0, 5 * 2**20


def synthetic_dataset(out: Path, n_docs: int) -> Path:
    """A token dataset of ``n_docs`` documents: real ``.idx`` and manifest, a sparse ``.bin`` (all zeros)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.1, n_docs), 1, 65_000).astype(np.int32)
    out.mkdir(parents=True)
    prefix = out / TOKENS_STREAM
    idx_digest = write_index(idx_path(prefix), np.uint16, lengths)
    tokens = int(lengths.sum(dtype=np.int64))
    with open(bin_path(prefix), "wb") as f:
        f.truncate(2 * tokens)  # sparse: nothing written, nothing read
    shares = rng.dirichlet(np.ones(len(CATEGORIES)))
    per_category = np.floor(shares * tokens).astype(np.int64)
    per_category[0] += tokens - per_category.sum()
    manifest = {"format": DATASET_FORMAT, "version": FORMAT_VERSION,
                "tokenizer": {"path": "synthetic", "vocab_size": 32000, "eod_id": 0, "pad_id": 0},
                "categories": ["uncategorized", *CATEGORIES],
                "streams": {TOKENS_STREAM: {"dtype": "uint16", "idx_sha256": idx_digest.hex(), "bin_sha256": ""}},
                "counts": {"documents": n_docs, "tokens": tokens, "loss_tokens": tokens,
                           "categories": {name: {"tokens": int(n), "loss_tokens": int(n)}
                                          for name, n in zip(CATEGORIES, per_category, strict=True)}},
                "rejects": {"count": 0, "by_reason": {}, "file": None},
                "sources": [{"path": f"synthetic/shard-{k:05d}.jsonl", "size": 1 << 30} for k in range(4)]}
    manifest["fingerprint"] = fingerprint(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def render_seconds(browser: Chromium, html: Path, repeats: int = 3) -> float:
    """Best of ``repeats`` loads (Chromium's own caches warm after the first)."""
    return min(browser.open(file_url(html), width=1280, height=900) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M documents instead of 10M")
    args = parser.parse_args()
    n = 1_000_000 if args.quick else 10_000_000
    chromium = find_chromium()
    if chromium is None:  # `make bench` goes on with the other benchmarks
        print("bench.html skipped: no Chromium to render the page in (apt-get install -y chromium, or set $CHROMIUM)")
        return
    print(f"--html page of a {n:,}-document dataset and its pack (target < {TARGET_SECONDS:g} s to render, "
          f"< {TARGET_BYTES / 2**20:g} MB)")
    with tempfile.TemporaryDirectory(prefix="bench-html-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        ds = synthetic_dataset(tmp / "ds", n)
        t1 = time.perf_counter()
        outcome = pack([ds], tmp / "packed", PackConfig(method="sequential", seq_len=256, overlong="split"))
        t2 = time.perf_counter()
        reports = [dataset_report(ds), pack_report(tmp / "packed")]
        t3 = time.perf_counter()
        html = tmp / "report.html"
        html.write_text(page(reports), encoding="utf-8")
        t4 = time.perf_counter()
        empty = tmp / "empty.html"
        empty.write_text("<!doctype html><html><head><meta charset='utf-8'><title>empty</title></head>"
                         "<body></body></html>", encoding="utf-8")
        bins, size = outcome.entry.num_bins, os.path.getsize(html)
        print(f"  data          {n:,} documents, {reports[0]['tokens']:,} tokens, {bins:,} bins "
              f"(written in {t1 - t0:.1f} s, packed in {t2 - t1:.1f} s)")
        print(f"  reports       {t3 - t2:6.2f} s  (dataset + pack, the same objects --json prints)")
        print(f"  page          {t4 - t3:6.2f} s to build, {size / 2**20:.3f} MB  "
              f"({'ok' if size < TARGET_BYTES else 'OVER'}: < {TARGET_BYTES / 2**20:g} MB)")
        with Chromium(chromium, timeout=120) as browser:
            base = render_seconds(browser, empty)
            seconds = render_seconds(browser, html)
            problems = browser.problems()
        verdict = "ok" if seconds < TARGET_SECONDS else "OVER"
        print(f"  render        {seconds:6.3f} s  ({verdict}: < {TARGET_SECONDS:g} s)  = {seconds / base:.1f}× the "
              f"baseline")
        print(f"  baseline      {base:6.3f} s  an empty page in the same Chromium")
        if problems:
            print(f"  browser problems: {problems}")


if __name__ == "__main__":
    main()
