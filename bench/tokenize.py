"""Benchmark ``xprep tokenize`` against Megatron-LM's two preprocessing structures, in one run.

Each contender runs as its own process (start-up and imports included) on the same JSONL
corpus of real text (../shared/data corpora, repeated to the target size), Qwen3 tokenizer:

- fast baseline: the structure of Megatron's ``tools/preprocess_data_fast.py``: gigatoken
  ``encode_files`` over the whole file in memory, then megatron-core's ``IndexedDatasetBuilder``
  (``add_document`` per document: the megatron-core on Python 3.11 has no ``add_documents``);
- classic baseline: ``tools/preprocess_data.py``'s structure: ``multiprocessing.Pool(2).imap(
  encode, lines, 32)`` with HF tokenizers feeding ``IndexedDatasetBuilder``;
- xprep: ``xprep tokenize corpus.jsonl``.

Also: chat throughput (Qwen3 template over chitchat repeated to 50 MB, whole process, auto workers)
against, in the same run: ``xprep tokenize`` as it was when issue 15 was filed (commit ``BEFORE_ISSUE_15``
of this repository, unpacked from git and run as it is, its output checked byte-identical: the issue's
"today's conversations/s"); the general Jinja path of this checkout (``--chat-render jinja``: what
the fast path must equal, with everything else of today: batched encoding, forked workers); and a
transformers ``apply_chat_template(tokenize=True)`` loop on a subsample. Also the share of the remaining
per-conversation time spent rendering, and peak RSS at two corpus sizes (streaming ⇒ flat) for text and chat.
Targets: (issue 2) ≥ 1.5× the fast baseline, ≥ 10× the classic one, peak RSS < 1 GB and flat;
(issue 15) chat ≥ 4× the command of the day the issue was filed and ≥ 60× the transformers loop.
``--chat-template llama3.1`` measures chat with Meta's Llama 3.1 template instead (the issue's own example),
over a Llama 3 shaped tokenizer: Qwen3's vocabulary under Llama 3's split pattern, Llama 3's markers added;
``--chat-template mistral`` Mistral-7B-Instruct's template over Mistral's own tokenizer (SentencePiece-style:
no clean cut, every conversation's mask from its token starts).

    python bench/tokenize.py [--quick] [--mb 107] [--skip-classic] [--chat-only] [--chat-mb 50]
                             [--chat-template qwen3|llama3.1|mistral] [--sharegpt] [--repeat 2]
"""

from __future__ import annotations

import sys  # noqa: I001  (first: this file's name shadows the stdlib `tokenize` module)

if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import itertools
import json
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
QWEN3 = DATA / "tokenizers" / "qwen3"
XPREP = [sys.executable, "-c", "import sys, cli; sys.argv[0] = 'xprep'; cli.xprep()"]
sys.path.insert(0, str(ROOT))

from bench.procs import TreeRss  # noqa: E402

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


def build_chat_corpus(path: Path, megabytes: float, sharegpt: bool = False) -> int:
    """chitchat repeated to ``megabytes``; ``sharegpt``: written as ShareGPT does (``conversations`` of
    ``from``/``value``, human/gpt)."""
    lines = (DATA / "chat" / "chitchat.jsonl").read_text().splitlines(keepends=True)
    if sharegpt:
        names = {"user": "human", "assistant": "gpt"}
        lines = [json.dumps({"id": r["id"], "conversations": [{"from": names.get(m["role"], m["role"]),
                                                               "value": m["content"]} for m in r["messages"]]}) + "\n"
                 for r in map(json.loads, lines)]
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
    os.sync()  # its write-back would otherwise run beside the first command timed
    return written


class Timed(NamedTuple):
    seconds: float  # wall
    rss: float  # peak RSS of the command's processes together, MB: worker processes included, sampled every 0.25 s,
    # never below the kernel's peak of its largest process; pages forked workers share are counted in each
    pss: float  # peak of their summed PSS, MB: shared pages counted once in all (0 where the kernel cannot say)


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> Timed:
    """Run a command to completion: its wall time and peak memory (``Timed``)."""
    # from bytecode, as an installed package runs: where PYTHONDONTWRITEBYTECODE is set, every process (each worker
    # too) would compile the project's modules again, ~0.06 s each
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**base, **(env or {})})
    tree = TreeRss(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    sampled = tree.stop()
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"command failed ({code}): {' '.join(map(str, cmd))}\n{stderr}")
    return Timed(elapsed, max(sampled, usage.ru_maxrss / 1024), tree.peak_pss)


def xprep_tokenize(corpus: Path, out: Path, *extra: str, cache: Path | None = None, env: dict | None = None,
                   tokenizer: Path = QWEN3, root: Path = ROOT) -> Timed:
    """``xprep tokenize`` of the checkout at ``root`` (this one unless told)."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**(env or {}), **({"XPREP_CACHE_DIR": str(cache)} if cache else {})}
    return run([*XPREP, "tokenize", str(corpus), "-o", str(out), "--tokenizer", str(tokenizer), *extra], root, env)


# main when issue 15 was filed: the parent of its first commit (7b4b6bb, the fast renderers); its chat path renders
# twice a conversation in jinja2's sandbox and encodes conversation by conversation
BEFORE_ISSUE_15 = "c1b76ef"


def checkout(work: Path, rev: str) -> Path | None:
    """The tree of ``rev`` of this repository, unpacked under ``work`` (None without git or that commit)."""
    tree = work / f"xprep-{rev}"
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    tree.mkdir()
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


LLAMA3_MARKERS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
MISTRAL = DATA / "tokenizers" / "mistral"


def mistral_tokenizer(work: Path) -> Path:
    """Mistral's tokenizer.json beside a tokenizer_config.json holding Mistral-7B-Instruct-v0.2's template (the
    shared material's has none)."""
    from xprep.prep.chat.fast import MISTRAL as TEMPLATE  # deferred, as chat_breakdown's imports of prep

    out = work / "mistral-tokenizer"
    out.mkdir(exist_ok=True)
    shutil.copyfile(MISTRAL / "tokenizer.json", out / "tokenizer.json")
    config = {**json.loads((MISTRAL / "tokenizer_config.json").read_text()), "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def llama31_tokenizer(work: Path) -> Path:
    """A directory with a Llama 3 shaped tokenizer.json (Qwen3's vocabulary, Llama 3's split pattern and markers)
    and Meta's Llama 3.1 template in its tokenizer_config.json: no Llama tokenizer is in the shared material."""
    from xprep.prep.tokenizer.cuts import NEWLINE_SAFE_PATTERNS  # deferred, as chat_breakdown's imports of prep

    spec = json.loads((QWEN3 / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = next(
        p for p in NEWLINE_SAFE_PATTERNS if r"\p{N}{1,3}" in p)  # Llama 3's: digits in threes
    base = max(t["id"] for t in spec["added_tokens"]) + 1
    spec["added_tokens"] += [{**spec["added_tokens"][0], "id": base + i, "content": c}
                             for i, c in enumerate(LLAMA3_MARKERS)]
    out = work / "llama31-tokenizer"
    out.mkdir(exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    template = (ROOT / "tests" / "templates" / "llama-3.1-instruct.jinja").read_text(encoding="utf-8")
    config = {"chat_template": template, "bos_token": LLAMA3_MARKERS[0], "eos_token": LLAMA3_MARKERS[-1],
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


TRANSFORMERS_LOOP = r'''
import json, sys, time
from transformers import AutoTokenizer
corpus, tok_dir, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(tok_dir)
convs = []
with open(corpus) as f:
    for line in f:
        record = json.loads(line)
        messages = record.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
                                               "content": m["value"]} for m in record["conversations"]]
        if any(m["role"] == "assistant" for m in messages):
            convs.append(messages)
        if len(convs) >= limit:
            break
start = time.perf_counter()
for messages in convs:
    tok.apply_chat_template(messages, tokenize=True)
print(json.dumps({"conversations": len(convs), "seconds": time.perf_counter() - start}))
'''


def transformers_loop(corpus: Path, limit: int, tokenizer: Path = QWEN3) -> float:
    """Conversations/s of a transformers ``apply_chat_template(tokenize=True)`` loop (the loop only: loading the
    tokenizer is not counted), in its own process."""
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOOP, str(corpus), str(tokenizer), str(limit)],
                         capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if out.returncode != 0:
        raise SystemExit(f"transformers loop failed:\n{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["conversations"] / result["seconds"]


def chat_breakdown(corpus: Path, limit: int, tokenizer: Path = QWEN3) -> dict:
    """Per-conversation time of one worker (parse, render, encode, mask) on the first ``limit`` records, in the
    calling process (run it in a worker process: see chat_bench), and the share of it spent rendering (with
    spans; column-wise, parsing too): for the fast path (column-wise), the same per record
    (``--chat-render records``) and the general Jinja path."""
    from xprep.prep.chat.templates import resolve_template
    from xprep.prep.formats import CHAT
    from xprep.prep.sources import LINES, RawBatch
    from xprep.prep.tokenize.config import Options
    from xprep.prep.tokenize.encode import Processor
    from xprep.prep.tokenizer import choose_backend, load_tokenizer_info

    info = load_tokenizer_info(str(tokenizer))
    spec = resolve_template("auto", info.chat_template, info.bos_token, info.eos_token)
    backend, _ = choose_backend(info, "auto")
    options = Options(CHAT, "text", "assistant", None, None, None, info.eod_id, info.vocab_size)
    with open(corpus, "rb") as f:
        lines = [line.rstrip(b"\n") for line in itertools.islice(f, limit)]  # as read_batches gives them
    batches = [RawBatch(0, lines[i : i + 1024], list(range(i + 1, i + 1 + len(lines[i : i + 1024]))), LINES)
               for i in range(0, len(lines), 1024)]
    out = {}
    for path in ("auto", "records", "jinja"):
        processor = Processor(info, backend, spec, options, path)
        processor(batches[0])  # warm: imports, first encoder call
        render_s = [0.0]

        def timed(render, render_s=render_s):
            def call(*args):
                t = time.perf_counter()
                try:
                    return render(*args)
                finally:
                    render_s[0] += time.perf_counter() - t
            return call

        processor.template.render_with_spans = timed(processor.template.render_with_spans)
        if processor.columns is not None:  # parsing too: the column-wise path does both at once
            processor.columns.render = timed(processor.columns.render)
        t0 = time.perf_counter()
        n = sum(len(processor(b).lengths) for b in batches)
        how = "column-wise" if processor.columns is not None else "per record"
        out[path] = {"conversations": n, "render_s": render_s[0], "total_s": time.perf_counter() - t0,
                     "path": f"{processor.template.path}, {how}"}
    return out


def chat_bench(work: Path, chat_mb: float, quick: bool, template: str = "qwen3", sharegpt: bool = False,
               repeat: int = 2) -> None:
    """Chat: the fast path against xprep as it was when issue 15 was filed, the general Jinja path and a
    transformers loop, all in this run; each command timed ``repeat`` times, in turn, and its best time kept."""
    chat = work / "chat.jsonl"
    chat_size = build_chat_corpus(chat, chat_mb, sharegpt)
    tok = {"qwen3": lambda: QWEN3, "llama3.1": lambda: llama31_tokenizer(work),
           "mistral": lambda: mistral_tokenizer(work)}[template]()
    before, baseline = checkout(work, BEFORE_ISSUE_15), f"xprep at {BEFORE_ISSUE_15}"
    missing = "no git history here"
    commands = {"fast path": ("chat", ROOT, ()), "general Jinja path": ("chat-jinja", ROOT, ("--chat-render", "jinja"))}
    if before is not None:
        commands[baseline] = ("chat-before", before, ())
    for name, (out, root, extra) in list(commands.items()):  # once untimed: tokenizer facts cached, as on a second run
        try:
            xprep_tokenize(chat, work / out, "--on-error", "skip", *extra, tokenizer=tok, root=root)
        except SystemExit as failed:
            if root == ROOT:
                raise
            # an old checkout may not run against today's dependencies: said, and the rest measured
            lines = str(failed).splitlines()
            print(f"  {name} could not run here: {lines[0].partition(':')[0]}"
                  + (f": {lines[-1]}" if len(lines) > 1 else ""))
            del commands[name]
            missing = "it could not run here (above)"
    runs: dict[str, list[Timed]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, (out, root, extra) in commands.items():
            runs[name].append(xprep_tokenize(chat, work / out, "--on-error", "skip", *extra, tokenizer=tok, root=root))
    best = {name: min(times, key=lambda t: t.seconds) for name, times in runs.items()}
    n_conv = json.loads((work / "chat" / "manifest.json").read_text())["counts"]["documents"]

    def same_as_fast(out: str, files) -> bool:
        return all((work / "chat" / f).read_bytes() == (work / out / f).read_bytes() for f in files)

    same = same_as_fast("chat-jinja", ("tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx"))
    hf_rate = transformers_loop(chat, 300 if quick else 2000, tok)
    new, old = best["fast path"], best["general Jinja path"]
    new_rate, old_rate = n_conv / new.seconds, n_conv / old.seconds
    what = {"qwen3": "Qwen3 template", "llama3.1": "Meta's Llama 3.1 template, Llama 3 shaped tokenizer",
            "mistral": "Mistral-Instruct's template and tokenizer"}[template]
    what += ", as ShareGPT's conversations" if sharegpt else ""
    print(f"chat: {chat_size / 1e6:.1f} MB chitchat ({what}), {n_conv:,} conversations kept, "
          f"{os.cpu_count()} cores, whole process, auto workers, best of {repeat} (each command in turn)")
    for name, timed in best.items():
        print(f"  {name:18s} {timed.seconds:7.2f} s  {n_conv / timed.seconds:8,.0f} conversations/s  peak RSS "
              f"{timed.rss:5.0f} MB (all processes; PSS {timed.pss:.0f} MB); all runs: "
              + ", ".join(f"{t.seconds:.2f}" for t in runs[name]))
    print(f"  transformers apply_chat_template(tokenize=True) loop: {hf_rate:,.0f} conversations/s (loop only)")
    print(f"  speed-up: {new_rate / old_rate:.2f}x the Jinja path, {new_rate / hf_rate:.0f}x the transformers loop "
          f"(target >= 60x); outputs byte-identical: {same}")
    if baseline in best:  # "today's conversations/s" of the issue: the command as it was when the issue was filed
        print(f"  speed-up: {best[baseline].seconds / new.seconds:.2f}x xprep as it was when issue 15 was filed "
              f"({BEFORE_ISSUE_15}; target >= 4x); every file byte-identical, manifest included: "
              f"{same_as_fast('chat-before', os.listdir(work / 'chat'))}")
    else:
        print(f"  ({missing}: {baseline}, the issue's own baseline, not measured)")
    big = work / "chat2.jsonl"
    build_chat_corpus(big, 2 * chat_mb, sharegpt)
    big_run = xprep_tokenize(big, work / "chat2", "--on-error", "skip", tokenizer=tok)
    print(f"  peak RSS: {chat_size / 1e6:.0f} MB {new.rss:.0f} MB, {2 * chat_size / 1e6:.0f} MB {big_run.rss:.0f} MB "
          f"(ratio {big_run.rss / new.rss:.2f}; target < 1024 MB and flat; PSS {new.pss:.0f} and "
          f"{big_run.pss:.0f} MB), {2 * chat_size / 1e6 / big_run.seconds:.1f} MB/s")
    # in a worker process, as tokenize runs it: gigatoken encodes on the calling thread there (in a main process it
    # would fan out over every core, and the encoder's share would look smaller than it is)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        parts = pool.apply(chat_breakdown, (chat, 2000 if quick else 8000, tok))
    for p in parts.values():
        per_conv = p["total_s"] / p["conversations"] * 1e6
        print(f"  one worker process, {p['conversations']:,} conversations, {p['path']}: {per_conv:.0f} us per "
              f"conversation, {p['render_s'] / p['total_s']:.0%} of it rendering with spans (column-wise: and "
              "parsing)")


def text_bench(work: Path, text_mb: float, skip_classic: bool) -> None:
    corpus = work / "corpus.jsonl"
    size = build_text_corpus(corpus, text_mb)
    print(f"text corpus: {size / 1e6:.1f} MB JSONL of real documents; Qwen3 tokenizer; {os.cpu_count()} cores")
    # Cold: an empty cache of tokenizer facts, so this run loads the HF tokenizer and self-checks
    # gigatoken against it. Warm: the verdict is memoized per tokenizer content (the usual case).
    cold = xprep_tokenize(corpus, work / "xprep", cache=work / "cache").seconds
    ours, ours_rss, _ = xprep_tokenize(corpus, work / "xprep", cache=work / "cache")
    fast, fast_rss, _ = run([sys.executable, "-c", FAST_BASELINE, str(corpus), str(QWEN3), str(work / "fast")])
    for name, t, rss in (("xprep tokenize", ours, ours_rss), ("fast baseline (gigatoken+mcore)", fast, fast_rss)):
        print(f"  {name:32s} {t:7.2f} s  {size / 1e6 / t:7.1f} MB/s  peak RSS {rss:6.0f} MB")
    print(f"  xprep tokenize, first run with this tokenizer (HF load + self-check): {cold:.2f} s")
    print(f"  speed-up vs fast baseline: {fast / ours:.2f}x, first run {fast / cold:.2f}x  (target >= 1.5x)")
    # much of the baseline is importing megatron-core (torch with it): the same ratio without that, for scale
    mcore = run([sys.executable, "-c", "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder"
                 ]).seconds
    print(f"  (of the fast baseline, {mcore:.2f} s is starting Python and importing megatron-core: without it "
          f"{(fast - mcore) / ours:.2f}x, ours still whole, or {size / 1e6 / (fast - mcore):.1f} MB/s against the "
          "rate of the 4x corpus below)")
    if not skip_classic:
        classic = run([sys.executable, "-c", CLASSIC_BASELINE, str(corpus), str(QWEN3), str(work / "classic")]).seconds
        print(f"  classic baseline (Pool(2)+HF)  {classic:7.2f} s  {size / 1e6 / classic:7.1f} MB/s")
        print(f"  speed-up vs classic baseline: {classic / ours:.2f}x, "
              f"first run {classic / cold:.2f}x  (target >= 10x)")

    big = work / "corpus4.jsonl"
    with open(big, "wb") as out:
        for _ in range(4):
            with open(corpus, "rb") as f:
                shutil.copyfileobj(f, out)
    big_t, big_rss, _ = xprep_tokenize(big, work / "xprep4")
    print(f"peak RSS: {size / 1e6:.0f} MB corpus {ours_rss:.0f} MB, "
          f"{4 * size / 1e6:.0f} MB corpus {big_rss:.0f} MB (ratio {big_rss / ours_rss:.2f}; "
          f"target < 1024 MB and flat), {4 * size / 1e6 / big_t:.1f} MB/s")


def chat_workers(work: Path) -> None:
    """What --workers 0 (auto) picks for chat, against one worker and every core, in the same run."""
    chat = work / "chat.jsonl"
    auto = xprep_tokenize(chat, work / "chat-auto", "--on-error", "skip").seconds
    by_workers = {n: xprep_tokenize(chat, work / f"chat-{n}", "--on-error", "skip", "--workers", str(n)).seconds
                  for n in (1, os.cpu_count() or 1)}
    print("chat workers: " + ", ".join(f"{n} → {t:.2f} s" for n, t in by_workers.items())
          + f"; auto ({auto:.2f} s) is {by_workers[1] / auto:.2f}x one worker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small corpora, for a smoke run")
    parser.add_argument("--mb", type=float, default=107.0, help="text corpus size in MB")
    parser.add_argument("--skip-classic", action="store_true", help="skip the slow classic baseline")
    parser.add_argument("--chat-only", action="store_true", help="only the chat measurements")
    parser.add_argument("--chat-mb", type=float, default=50.0, help="chat corpus size in MB (≥ 50 for the targets)")
    parser.add_argument("--chat-template", choices=("qwen3", "llama3.1", "mistral"), default="qwen3",
                        help="qwen3: the Qwen3 tokenizer's own template (the targets); llama3.1: Meta's Llama 3.1 "
                        "template over a Llama 3 shaped tokenizer; mistral: Mistral-Instruct's over Mistral's")
    parser.add_argument("--repeat", type=int, default=2,
                        help="chat: times each command is timed (in turn; the best kept)")
    parser.add_argument("--sharegpt", action="store_true",
                        help="the chat corpus written as ShareGPT's conversations (from/value, human/gpt)")
    args = parser.parse_args()
    if not QWEN3.is_dir():
        raise SystemExit(f"needs the real test material in {DATA}")
    work = Path(tempfile.mkdtemp(prefix="xprep-bench-"))
    try:
        if not args.chat_only:
            text_bench(work, 10.0 if args.quick else args.mb, args.skip_classic)
        chat_bench(work, 5.0 if args.quick else args.chat_mb, args.quick, args.chat_template, args.sharegpt,
                   args.repeat)
        if not args.chat_only:
            chat_workers(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
