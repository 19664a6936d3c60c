"""Benchmark of training from object storage: steps/s of ``xtrain run`` on a pack whose dataset is at an
S3 endpoint with a latency injected on every request, against the same pack on local disk, and the bytes fetched
against the bytes the bins need.

    python bench/stream.py                    # both cases, 300 steps of the tiny model, 20 ms a request
    python bench/stream.py --quick            # 60 steps
    python bench/stream.py --latency-ms 50 --cache-size 16KB
    python bench/stream.py --sampler random --method sequential    # one case of your own

Two cases by default: *in order* (``--sampler sequential`` over a ``--method sequential`` pack: each step reads
the bytes after the last step's) and *random* (``--sampler random`` over a ``--method multipack`` pack: each step
reads a few documents scattered over the whole dataset). The endpoint is moto's server on 127.0.0.1; the latency
comes from a small HTTP proxy in front of it (``Delay``) that holds every request for ``--latency-ms`` before
passing it on, and keeps its clients' connections alive as S3 does (moto's server does not). Both run in processes
of their own at the lowest priority (``nice`` 19): they stand for a remote service, which costs the trainer's
machine no CPU, so they take the shared cores only when the trainer leaves them idle, and never the trainer's GIL
(on a machine loaded by other work they may then starve: the steps wait for the ranges the prefetcher is still
fetching, which the report says).

Both runs are ``xprep.train.trainer.run`` in this process, alternating, best of ``--repeats`` each; steps/s are
counted from the step after ``WARMUP_STEPS`` to the last, so the start (the pack's files and indexes fetched once,
the model built) is not in them; nor in the CPU time of the trainer's process a step (all its threads; the
prefetcher's requests are made by a process of their own, train/prefetch.py) and the time the steps waited on the
network. Goals: stream / local ≥ 0.9 (the prefetcher hides the latency), and bytes fetched ≤ 1.2 × the bytes of the
bins trained on. The prefetcher fetches the exact byte ranges of the next steps' documents (tokens and loss mask),
neighbours a small gap apart as one request (prep/dataset/stream.py ``coalesce_ranges``), and reads steps that read
in order ahead in one request a stream, so both cases fetch about what they read, down to a ``--cache-size`` of
about the window (``--prefetch-steps`` + 1 steps: ~16 KB here; the steps/s want some room beyond it, as a step's
bytes vary).
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

WARMUP_STEPS = 5
CAPACITY = 512
VOCAB = 4096


# ----------------------------------------------------------------------------------------- endpoint
class Delay:
    """An HTTP proxy on 127.0.0.1 in front of the server at ``upstream`` port, holding each request ``latency``
    seconds before passing it on (a request's round trip is that much longer).

    It keeps its clients' connections open from one request to the next, as S3 does (``_relay``): moto's server
    closes each connection after its response, and every request would cost the client a TCP connection of its own
    (about a third of s3fs's CPU a request here), which no client of S3 pays. It runs in a process of its own at the
    lowest priority (``_serve_delay``), as moto's server does: both stand for the network and a service on other
    machines, which cost the trainer no CPU. As threads of the bench's process they would take the trainer's GIL,
    and at normal priority its cores, and the bench would measure the stand-ins."""

    def __init__(self, upstream: int, latency: float):
        spawn = multiprocessing.get_context("spawn")  # (not a fork of this process and its threads)
        ours, theirs = spawn.Pipe()
        self.proc = spawn.Process(target=_serve_delay, args=(upstream, latency, theirs), daemon=True)
        self.proc.start()
        self.port = ours.recv()

    def close(self) -> None:
        self.proc.kill()
        self.proc.join()


def _serve_delay(upstream: int, latency: float, conn) -> None:
    """``Delay``'s process: a thread per client connection."""
    os.nice(19)
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    while True:
        client, _ = server.accept()
        threading.Thread(target=_relay, args=(client, upstream, latency), daemon=True).start()


def _relay(client: socket.socket, upstream: int, latency: float) -> None:
    """The requests of one client connection, in turn: each read whole (head, then a body of its Content-Length),
    held ``latency`` seconds, sent to the server on a connection of its own, and the response (all the server sends
    before it closes) passed back, saying keep-alive instead of close."""
    reader = client.makefile("rb")
    try:
        while head := _read_head(reader):
            length = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
            request = head + (reader.read(int(length[1])) if length else b"")
            time.sleep(latency)
            with socket.create_connection(("127.0.0.1", upstream)) as up:
                up.sendall(request)
                response = b"".join(iter(lambda: up.recv(1 << 16), b""))
            end = response.find(b"\r\n\r\n")
            client.sendall(response[:end].replace(b"\r\nConnection: close", b"\r\nConnection: keep-alive")
                           + response[end:])
    except OSError:
        pass
    finally:
        client.close()


def _read_head(reader) -> bytes:
    """A request's line and headers, through the blank line; empty when the client has closed."""
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b"\n", b""):
        lines.append(line)
    return b"".join(lines) + b"\r\n" if lines else b""


def start_moto(log: Path) -> tuple[subprocess.Popen, int]:
    """moto's S3 server on a free port, at the lowest priority (``nice`` execs it: the process is moto's), as
    ``Delay``: the service it stands for runs on other machines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen(["nice", "-n", "19", str(Path(sys.executable).parent / "moto_server"), "-H",
                                 "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("moto_server did not start") from None
            time.sleep(0.1)


def use_endpoint(port: int) -> None:
    """s3:// URLs in this process go to 127.0.0.1:``port`` from now on."""
    import fsspec
    import s3fs

    fsspec.config.conf["s3"] = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
    s3fs.S3FileSystem.clear_instance_cache()


# ------------------------------------------------------------------------------------------- data
def build(root: Path, tokens: int, methods: list[str], seed: int = 0) -> dict[str, Path]:
    """A dataset of random documents (16..CAPACITY tokens) with a loss mask, packed by each of ``methods`` into
    ``root/p-METHOD``."""
    from xprep.prep.dataset.token_dataset import CategoryTable, DatasetWriter
    from xprep.prep.pack.cache import PackConfig, pack

    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, CAPACITY + 1, max(1, tokens // (CAPACITY // 2)))
    ids = rng.integers(2, VOCAB, int(lengths.sum()), dtype=np.int64)
    mask = (rng.random(len(ids)) < 0.8).astype(np.uint8)
    with DatasetWriter(root / "ds", VOCAB) as w:
        w.append(ids, lengths, loss_mask=mask)
        w.finish({"tokenizer": {"path": "none (random ids)", "vocab_size": VOCAB, "pad_id": 0, "eod_id": 1}},
                 CategoryTable())
    for method in methods:
        pack([root / "ds"], root / f"p-{method}", PackConfig(method=method, seq_len=CAPACITY))
    return {method: root / f"p-{method}" for method in methods}


def upload(root: Path, local_packs: dict[str, Path]) -> None:
    """s3://bench/ds (the dataset) and s3://bench/packed-METHOD (each pack, its dataset named by that URL)."""
    import json

    import s3fs
    from xprep.prep.dataset import upload_dataset

    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    upload_dataset(root / "ds", "s3://bench/ds")
    for method, local_pack in local_packs.items():
        remote = root / f"remote-{method}"
        shutil.copytree(local_pack, remote)
        for entry in (p for p in remote.iterdir() if p.is_dir()):
            meta = json.loads((entry / "pack.json").read_text())
            meta["datasets"] = [{**d, "path": "s3://bench/ds"} for d in meta["datasets"]]
            (entry / "pack.json").write_text(json.dumps(meta))
        fs.put(str(remote), f"bench/packed-{method}", recursive=True)


# ------------------------------------------------------------------------------------------- runs
def train(packed: str, run_dir: Path, steps: int, sampler: str, extra: dict) -> dict:
    """One ``xtrain run`` in this process: steps/s after the warm-up, and the block cache's figures."""
    from xprep.train import trainer as trainer_module
    from xprep.train.config import resolve_config

    shutil.rmtree(run_dir, ignore_errors=True)
    times, cpu, out = [], [], {}

    def on_step(t) -> None:
        times.append(time.perf_counter())
        cpu.append(time.process_time())
        if t.step == steps:
            s = t.sampler
            bins = s.bins_at(np.arange(s.consumed_samples, dtype=np.int64))
            lens = t.dataset.bins.items_of(bins)[3]
            out["needed"] = int(lens.sum()) * sum(st.dtype.itemsize for st in _streams(t.dataset))
        cache = t.dataset.cache
        if cache is not None:
            out["peak"] = max(out.get("peak", 0), cache.used)
            if len(times) == WARMUP_STEPS + 1:  # (the first step timed: what the start cost is not counted)
                out.update(demand=-cache.demand_reads, demand_s=-cache.demand_s, waited_s=-cache.waited_s)
            if t.step == steps:
                out.update(fetched=cache.fetched_bytes, requests=cache.requests,
                           demand=out["demand"] + cache.demand_reads, demand_s=out["demand_s"] + cache.demand_s,
                           waited_s=out["waited_s"] + cache.waited_s)

    trainer_module.STEP_END_CALLBACKS.append(on_step)
    try:
        cfg = resolve_config(None, {"packed": packed, "steps": steps, "sampler": sampler, "micro_batch_size": 2,
                                    "output": str(run_dir), "no_save": True, "log_every": 10**6, **extra})
        with open(os.devnull, "w") as quiet:
            trainer_module.run(cfg, stream=quiet)
    finally:
        trainer_module.STEP_END_CALLBACKS.remove(on_step)
    out["rate"] = (len(times) - WARMUP_STEPS - 1) / (times[-1] - times[WARMUP_STEPS])
    out["cpu"] = (cpu[-1] - cpu[WARMUP_STEPS]) / (len(cpu) - WARMUP_STEPS - 1)
    return out


def _streams(dataset) -> list:
    ds = dataset.datasets[0]
    return [s for s in (ds.tokens, ds.loss_mask, ds.category_ids) if s is not None]


CASES = {"in order": ("sequential", "sequential"), "random": ("random", "multipack")}  # (--sampler, --method)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 steps instead of 300")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added to every request [default: 20]")
    ap.add_argument("--sampler", choices=["sequential", "random"], help="one case of your own, with --method")
    ap.add_argument("--method", help="xprep pack --method of that case [default: sequential]")
    ap.add_argument("--cache-size", default="1MB", help="xtrain run --cache-size [default: 1MB]")
    ap.add_argument("--prefetch-steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cases = CASES if args.sampler is None and args.method is None else \
        {"your own": (args.sampler or "sequential", args.method or "sequential")}
    torch_threads()
    steps = 60 if args.quick else 300
    root = Path(tempfile.mkdtemp(prefix="xprep-bench-stream-"))
    os.environ["XPREP_CACHE_DIR"] = str(root / "cache")
    proc, port = start_moto(root / "moto.log")
    delay = None
    try:
        local = build(root, tokens=steps * 2 * CAPACITY * 2, methods=sorted({m for _, m in cases.values()}))
        use_endpoint(port)
        upload(root, local)
        delay = Delay(port, args.latency_ms / 1000)
        use_endpoint(delay.port)
        stream_opts = {"cache_size": args.cache_size, "prefetch_steps": args.prefetch_steps}
        print(f"xtrain run, tiny model, {steps} steps of 2 bins × {CAPACITY} tokens, endpoint latency "
              f"{args.latency_ms:g} ms a request, --cache-size {args.cache_size}, --prefetch-steps "
              f"{args.prefetch_steps} (best of {args.repeats})")
        for case, (sampler, method) in cases.items():
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for name, packed, extra in (("local", str(local[method]), {}),
                                            ("stream", f"s3://bench/packed-{method}", stream_opts)):
                    got = train(packed, root / f"run-{name}", steps, sampler, extra)
                    if name not in best or got["rate"] > best[name]["rate"]:
                        best[name] = got
            report(f"{case}: --sampler {sampler}, pack --method {method}", steps, best)
    finally:
        if delay is not None:
            delay.close()
        proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)  # the two shared cores: one computes, one serves the endpoint and the prefetcher


def report(case: str, steps: int, best: dict) -> None:
    local, stream = best["local"], best["stream"]
    print(case)
    print(f"  steps/s:  local disk {local['rate']:.1f}   object store {stream['rate']:.1f}   "
          f"ratio {stream['rate'] / local['rate']:.3f} (goal ≥ 0.9)")
    print(f"  CPU of the trainer's process a step: local disk {1000 * local['cpu']:.1f} ms   object store "
          f"{1000 * stream['cpu']:.1f} ms")
    print(f"  bytes:    the bins need {stream['needed']:,}   fetched {stream['fetched']:,} in {stream['requests']:,} "
          f"requests   ratio {stream['fetched'] / stream['needed']:.3f} (goal ≤ 1.2); the cache held at most "
          f"{stream['peak']:,}")
    print(f"  the steps timed fetched {stream['demand']} ranges themselves ({stream['demand_s']:.2f} s waiting on "
          f"the network), and waited {stream['waited_s']:.2f} s for ranges the prefetcher was still fetching")


if __name__ == "__main__":
    main()
