"""Benchmark of ``xprep tokenize --ray`` against the single-process run, whole commands, same run.

    python -m bench.distributed              # ≥ 100 MB of real text (the State of the Union corpus, repeated)
    python -m bench.distributed --mb 20      # a quicker look

Both commands tokenize the same JSON Lines file with the Qwen3 tokenizer of ../shared/data. The Ray run
joins a local cluster of --cpus CPUs started beforehand with ``ray start --head`` (as a cluster is up
before a job on it; its start-up is reported apart). Target (issue 12): the Ray run within 1.15× of the
single-process one. Also reported: the scheduling overhead per shard (a no-op task with the same
payload, on the same cluster) and the merge time (the command's own timing line). The outputs are
checked byte-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def make_corpus(path: Path, megabytes: int) -> int:
    """Paragraphs of the real corpus as {"text"} lines, repeated (with a counter) up to ``megabytes``."""
    paragraphs = [p for f in sorted((DATA / "corpora" / "sotu").glob("*.txt"))
                  for p in f.read_text(encoding="utf-8").split("\n") if p.strip()]
    written, round_ = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 1e6:
            for p in paragraphs:
                line = json.dumps({"text": f"[{round_}] {p}"}, ensure_ascii=False) + "\n"
                out.write(line)
                written += len(line.encode())
            round_ += 1
    return written


def timed(args: list, env=ENV) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "xprep"), *map(str, args)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"xprep {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return wall, proc.stderr


def task_overhead(address: str, payload_bytes: int, tasks: int = 200) -> float:
    """Seconds per no-op task carrying a payload of the job's size, on the running cluster (warm workers)."""
    code = f"""
import time, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
@ray.remote(num_cpus=1)
def noop(payload, shard):
    return len(shard)
payload = ray.put(b"x" * {payload_bytes})
ray.get([noop.remote(payload, b"s" * 200) for _ in range(20)])  # warm the workers
t0 = time.perf_counter()
ray.get([noop.remote(payload, b"s" * 200) for _ in range({tasks})])
print((time.perf_counter() - t0) / {tasks})
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    if proc.returncode:
        raise SystemExit(f"overhead probe failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="input size in MB (default 100)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    parser.add_argument("--shard-size", default=None, help="--shard-size (default: input / (4 × cpus))")
    args = parser.parse_args()
    tokenizer = DATA / "tokenizers" / "qwen3"
    if not tokenizer.is_dir():
        raise SystemExit(f"needs the real tokenizers at {DATA}")
    work = Path(tempfile.mkdtemp(prefix="xprep-bench-dist-"))
    corpus = work / "corpus.jsonl"
    size = make_corpus(corpus, args.mb)
    shard_size = args.shard_size or str(size // (4 * args.cpus) + 1)
    print(f"{size / 1e6:,.1f} MB of real text (State of the Union paragraphs, repeated), Qwen3 tokenizer, "
          f"{os.cpu_count()} cores here, Ray cluster of {args.cpus} CPUs, --shard-size {shard_size}")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    # --block, own session and temp dir: ending this one process stops this cluster and no other (``ray stop``
    # would stop every Ray cluster of the machine's user)
    log = work / "ray-start.log"
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={port}", f"--num-cpus={args.cpus}",
                             "--include-dashboard=false", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                             "--block", f"--temp-dir={work / 'ray-session'}"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    while "Ray runtime started" not in log.read_text():
        if head.poll() is not None:
            raise SystemExit(f"ray start failed:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    print(f"  ray start --head (not counted below)  {time.perf_counter() - t0:7.2f} s")
    address = f"127.0.0.1:{port}"
    try:
        common = [corpus, "--tokenizer", tokenizer, "--progress-every", "0"]
        t_one, _ = timed(["tokenize", *common, "-o", work / "one"])
        t_ray, err = timed(["tokenize", *common, "-o", work / "ray", "--ray", address, "--shard-size", shard_size])
        t_one2, _ = timed(["tokenize", *common, "-o", work / "one2"])  # again: the machine is shared and noisy
        t_one = min(t_one, t_one2)
        same = all((work / "one" / f.name).read_bytes() == f.read_bytes() for f in (work / "ray").iterdir())
        overhead = task_overhead(address, payload_bytes=300_000)
    finally:
        head.terminate()
        head.wait()
        shutil.rmtree(work, ignore_errors=True)  # the corpus and three datasets: GBs at --mb 1000
    shards = re.search(r"ray: (\d+) shards?", err)
    timing = re.search(r"shards ran in ([\d.]+) s; the merge copied ([\d.,]+) MB in ([\d.]+) s \(([\d,]+) MB/s\), "
                       r"([\d.]+) s of it after", err)
    print(f"  single process (1 worker, gigatoken on every core) {t_one:7.2f} s  ({size / 1e6 / t_one:,.1f} MB/s)")
    print(f"  --ray, {shards[1] if shards else '?'} shards                 {t_ray:7.2f} s  "
          f"({size / 1e6 / t_ray:,.1f} MB/s)")
    if timing:
        print(f"    of which shards {timing[1]} s (the merge overlapping them), then {timing[5]} s of merge; the merge "
              f"copied {timing[2]} MB in {timing[3]} s in all ({timing[4]} MB/s)")
        print(f"    fixed costs: joining the cluster, a worker and its tokenizer per CPU, planning: "
              f"{t_ray - float(timing[1]) - float(timing[5]):.2f} s outside the shards and the final merge")
    print(f"  scheduling overhead per shard (no-op task, same payload)  {overhead * 1e3:.1f} ms")
    print(f"  output byte-identical: {same}")
    ratio = t_ray / t_one
    print(f"ratio ray / single = {ratio:.2f}× (target ≤ 1.15×: {'met' if ratio <= 1.15 else 'NOT met'})")


if __name__ == "__main__":
    main()
