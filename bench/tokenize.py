"""Benchmark ``xprep tokenize`` against Megatron-LM's two preprocessing structures, in one run.

Each contender runs as its own process (start-up and imports included) on the same JSONL
corpus of real text (../shared/data corpora, repeated to the target size), Qwen3 tokenizer:

- fast baseline: the structure of Megatron's ``tools/preprocess_data_fast.py``: gigatoken
  ``encode_files`` over the whole file in memory, then megatron-core's ``IndexedDatasetBuilder``
  (``add_document`` per document: the megatron-core on Python 3.11 has no ``add_documents``);
- classic baseline: ``tools/preprocess_data.py``'s structure: ``multiprocessing.Pool(2).imap(
  encode, lines, 32)`` with HF tokenizers feeding ``IndexedDatasetBuilder``;
- xprep: ``xprep tokenize corpus.jsonl``.

Also: chat throughput (Qwen3 template over chitchat repeated) with the share of time spent
rendering templates vs encoding, and peak RSS at two corpus sizes (streaming ⇒ flat).
Targets (issue 2): ≥ 1.5× the fast baseline, ≥ 10× the classic one, peak RSS < 1 GB and flat.

    python bench/tokenize.py [--quick] [--mb 107] [--skip-classic]
"""

from __future__ import annotations

import sys  # noqa: I001  (first: this file's name shadows the stdlib `tokenize` module)

if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
QWEN3 = DATA / "tokenizers" / "qwen3"
XPREP = [sys.executable, "-c", "import sys, cli; sys.argv[0] = 'xprep'; cli.xprep()"]

FAST_BASELINE = r'''
import sys, numpy as np
from gigatoken import Tokenizer, JsonlFileSource
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tokenizers import Tokenizer as HF
corpus, tok_dir, out = sys.argv[1:4]
eod = HF.from_file(tok_dir + "/tokenizer.json").token_to_id("<|im_end|>")
docs = Tokenizer(tok_dir).encode_files(JsonlFileSource([corpus], field="text"))
builder = IndexedDatasetBuilder(out + ".bin", dtype=np.int32)
for doc in docs:
    ids = np.append(np.asarray(doc, dtype=np.int32), eod)
    builder.add_document(ids, [len(ids)])
builder.finalize(out + ".idx")
'''

CLASSIC_BASELINE = r'''
import json, sys, multiprocessing, numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tokenizers import Tokenizer

class Encoder:
    def initializer(self):
        Encoder.tok = Tokenizer.from_file(TOK + "/tokenizer.json")
        Encoder.eod = Encoder.tok.token_to_id("<|im_end|>")
    def encode(self, line):
        text = json.loads(line)["text"]
        ids = Encoder.tok.encode(text).ids + [Encoder.eod]
        return ids, len(line)

corpus, TOK, out = sys.argv[1:4]
if __name__ == "__main__":
    enc = Encoder()
    with open(corpus, encoding="utf-8") as f, multiprocessing.Pool(2, initializer=enc.initializer) as pool:
        builder = IndexedDatasetBuilder(out + ".bin", dtype=np.int32)
        for ids, _ in pool.imap(enc.encode, f, 32):
            builder.add_document(np.array(ids, dtype=np.int32), [len(ids)])
        builder.finalize(out + ".idx")
'''


def build_text_corpus(path: Path, megabytes: float) -> int:
    """JSONL of real documents (sotu + the valid-UTF-8 spam-assassin mails), repeated to size."""
    texts = []
    for directory in ("sotu", "spam-assassin"):
        for f in sorted(p for p in (DATA / "corpora" / directory).rglob("*") if p.is_file()):
            try:
                texts.append(f.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
    return write_repeated(path, [json.dumps({"text": t}) + "\n" for t in texts if t.strip()], megabytes)


def build_chat_corpus(path: Path, megabytes: float) -> int:
    lines = (DATA / "chat" / "chitchat.jsonl").read_text().splitlines(keepends=True)
    return write_repeated(path, lines, megabytes)


def write_repeated(path: Path, lines: list[str], megabytes: float) -> int:
    """Write ``lines`` over and over until the file holds ``megabytes``; return the size."""
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as out:
        while written < target:
            for line in lines:
                out.write(line)
                written += len(line)
                if written >= target:
                    break
    return written


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> tuple[float, float]:
    """Run a command to completion; return (wall seconds, peak RSS in MB of the process itself)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"command failed ({code}): {' '.join(map(str, cmd))}\n{stderr}")
    return elapsed, usage.ru_maxrss / 1024


def xprep_tokenize(corpus: Path, out: Path, *extra: str, cache: Path | None = None) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = {"XPREP_CACHE_DIR": str(cache)} if cache else None
    return run([*XPREP, "tokenize", str(corpus), "-o", str(out), "--tokenizer", str(QWEN3), *extra], ROOT, env)


def chat_breakdown(corpus: Path, limit: int) -> dict:
    """Time template rendering vs encoding for the first ``limit`` conversations, in-process."""
    sys.path.insert(0, str(ROOT))
    from prep.encoder import Encoder, load_tokenizer_info
    from prep.templates import ChatTemplate, normalize_messages, resolve_template

    info = load_tokenizer_info(str(QWEN3))
    template = ChatTemplate(resolve_template("auto", info.chat_template, info.bos_token, info.eos_token))
    encoder = Encoder(info, "gigatoken")
    convs = []
    with open(corpus) as f:
        for line in f:
            record = json.loads(line)
            messages = normalize_messages(record)
            if any(m["role"] == "assistant" for m in messages):
                convs.append(messages)
            if len(convs) >= limit:
                break
    t0 = time.perf_counter()
    rendered = [template.render_with_spans(m) for m in convs]
    t1 = time.perf_counter()
    texts = [text for text, _ in rendered]
    segments = [text[a:b] for text, spans in rendered for a, b, _ in spans]
    encoder.encode(texts, add_special_tokens=False)
    encoder.encode(segments, add_special_tokens=False)
    t2 = time.perf_counter()
    return {"conversations": len(convs), "render_s": t1 - t0, "encode_s": t2 - t1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small corpora, for a smoke run")
    parser.add_argument("--mb", type=float, default=107.0, help="text corpus size in MB")
    parser.add_argument("--skip-classic", action="store_true", help="skip the slow classic baseline")
    args = parser.parse_args()
    if not QWEN3.is_dir():
        raise SystemExit(f"needs the real test material in {DATA}")
    text_mb = 10.0 if args.quick else args.mb
    chat_mb = 5.0 if args.quick else 50.0
    work = Path(tempfile.mkdtemp(prefix="xprep-bench-"))
    try:
        corpus = work / "corpus.jsonl"
        size = build_text_corpus(corpus, text_mb)
        print(f"text corpus: {size / 1e6:.1f} MB JSONL of real documents; Qwen3 tokenizer; {os.cpu_count()} cores")
        # Cold: an empty cache of tokenizer facts, so this run loads the HF tokenizer and self-checks
        # gigatoken against it. Warm: the verdict is memoized per tokenizer content (the usual case).
        cold, _ = xprep_tokenize(corpus, work / "xprep", cache=work / "cache")
        ours, ours_rss = xprep_tokenize(corpus, work / "xprep", cache=work / "cache")
        fast, fast_rss = run([sys.executable, "-c", FAST_BASELINE, str(corpus), str(QWEN3), str(work / "fast")])
        for name, t, rss in (("xprep tokenize", ours, ours_rss), ("fast baseline (gigatoken+mcore)", fast, fast_rss)):
            print(f"  {name:32s} {t:7.2f} s  {size / 1e6 / t:7.1f} MB/s  peak RSS {rss:6.0f} MB")
        print(f"  xprep tokenize, first run with this tokenizer (HF load + self-check): {cold:.2f} s")
        print(f"  speed-up vs fast baseline: {fast / ours:.2f}x, first run {fast / cold:.2f}x  (target >= 1.5x)")
        if not args.skip_classic:
            classic, _ = run([sys.executable, "-c", CLASSIC_BASELINE, str(corpus), str(QWEN3), str(work / "classic")])
            print(f"  classic baseline (Pool(2)+HF)  {classic:7.2f} s  {size / 1e6 / classic:7.1f} MB/s")
            print(f"  speed-up vs classic baseline: {classic / ours:.2f}x, "
                  f"first run {classic / cold:.2f}x  (target >= 10x)")

        big = work / "corpus4.jsonl"
        with open(big, "wb") as out:
            for _ in range(4):
                with open(corpus, "rb") as f:
                    shutil.copyfileobj(f, out)
        big_t, big_rss = xprep_tokenize(big, work / "xprep4")
        print(f"peak RSS: {size / 1e6:.0f} MB corpus {ours_rss:.0f} MB, "
              f"{4 * size / 1e6:.0f} MB corpus {big_rss:.0f} MB (ratio {big_rss / ours_rss:.2f}; "
              f"target < 1024 MB and flat), {4 * size / 1e6 / big_t:.1f} MB/s")

        chat = work / "chat.jsonl"
        chat_size = build_chat_corpus(chat, chat_mb)
        chat_t, chat_rss = xprep_tokenize(chat, work / "chat", "--on-error", "skip")
        manifest = json.loads((work / "chat" / "manifest.json").read_text())
        n_conv = manifest["counts"]["documents"]
        # What --workers 0 (auto) picks for chat, against one worker and every core, in the same run.
        by_workers = {n: xprep_tokenize(chat, work / f"chat-{n}", "--on-error", "skip", "--workers", str(n))[0]
                      for n in (1, os.cpu_count() or 1)}
        print("chat workers: " + ", ".join(f"{n} → {t:.2f} s" for n, t in by_workers.items())
              + f"; auto ({chat_t:.2f} s) is {by_workers[1] / chat_t:.2f}x one worker")
        parts = chat_breakdown(chat, 2000 if args.quick else 20000)
        share = parts["render_s"] / (parts["render_s"] + parts["encode_s"])
        print(f"chat: {chat_size / 1e6:.1f} MB chitchat (Qwen3 template), {n_conv:,} conversations kept "
              f"in {chat_t:.2f} s = {n_conv / chat_t:,.0f} conversations/s, peak RSS {chat_rss:.0f} MB (main)")
        print(f"  in-process over {parts['conversations']:,} conversations: rendering {parts['render_s']:.2f} s, "
              f"encoding {parts['encode_s']:.2f} s -> {share:.0%} of the time is template rendering")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
