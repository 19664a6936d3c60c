"""Benchmark of issue 5's parallelism: context-parallel activation memory, FSDP2 step time.

    python bench/parallel.py            # seq 16,384 for CP, 4,096 tokens per rank for FSDP2
    python bench/parallel.py --quick    # smaller sequences and fewer steps (smoke run, < 1 min)

Everything is measured in one run, and every ratio is against a baseline measured in the same run:

1. Context parallelism. One packed row of ``cp_docs`` equal documents (4 × 4096 = 16,384 tokens),
   model 4 layers × width 256, 4 heads / 2 K/V heads, vocab 8192, fp32, AdamW. cp=2 over two
   gloo processes (``shard_batch`` + ``CPContext``, gradients summed over the CP group) against one
   process with cp=1 on the same batches and weights. Per-rank peak activation memory = peak RSS
   during one forward + backward + optimizer step minus the RSS after set-up. "Set-up" is the steady
   state: model, gradient buffers and AdamW state allocated (by the warm-up steps; gradients are
   zeroed, not freed), then freed heap handed back to the kernel with ``malloc_trim``. The peak is
   the kernel's VmHWM, reset before each step by writing "5" to /proc/self/clear_refs (checked at
   start; a thread sampling RSS every 5 ms takes over where the reset does not work). Target: ≤ 0.6×.
2. FSDP2, dp=2 on two processes: the same model with ``fully_shard`` per block then the root
   (gradient divide factor 1.0 and forced sum reduction set on every FSDPModule: neither setting
   reaches a module's children) against
   the same model replicated with one flat gradient all-reduce (sum) after backward; FSDP2 both
   with ``reshard_after_forward=True`` (fully_shard's default, the target's figure) and False.
   The three models live in the same two processes, start from the same weights and take the
   same batches, one step each in turn, in an order that rotates every round, so drift in the
   machine's load hits all of them. A step is forward + backward + gradient reduction + AdamW;
   its time is the slowest rank's. Target: ≤ 1.2×.

Fairness: the machine has 2 cores and every configuration gets all of them: the single process
runs 2 intra-op threads, each of two processes runs 1. Workers are spawned here (one plain
process, or ``torch.distributed.run --standalone``), each with a timeout; rank 0 prints one
``RESULT {json}`` line on stdout that this script reads. A failed or timed-out worker makes the
benchmark exit 1. Step times are medians of the timed steps; minima and paired ratios are printed
next to them because the machine is shared and a 2-thread process suffers most from contention.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# bench/train.py and bench/tokenize.py would shadow the `train` package and the stdlib module.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, fields, replace  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from bench.procs import descendants  # noqa: E402

if TYPE_CHECKING:
    from xprep.train.model import ModelConfig

RESULT = "RESULT "  # prefix of the one line a worker's rank 0 prints on stdout
FAILED = "WORKER FAILED"  # prefix of a failed rank's traceback on stderr
MIB = 1024 * 1024


class BenchError(Exception):
    """A worker failed, timed out or printed no result."""


@dataclass
class BenchConfig:
    """Everything both workers and the summary need; built once from the command line."""

    vocab: int = 8192
    dim: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    cp_seq: int = 16_384  # tokens of the context-parallel row
    cp_docs: int = 4  # equal documents in that row
    dp_seq: int = 4096  # tokens per rank and step for the FSDP2 comparison
    dp_docs: int = 4
    warmup: int = 2  # untimed steps per configuration
    steps: int = 3  # timed CP steps
    rounds: int = 9  # FSDP2 / replicated rotations (each mode runs first, middle and last equally often)
    round_steps: int = 1  # timed steps per mode and round
    cores: int = 2  # total intra-op threads given to each configuration
    timeout: float = 900.0  # seconds per worker launch
    seed: int = 0

    def __post_init__(self) -> None:
        for seq, docs, name in ((self.cp_seq, self.cp_docs, "cp"), (self.dp_seq, self.dp_docs, "dp")):
            if docs < 1 or seq % docs or (seq // docs) % 4:
                raise BenchError(f"--{name}-seq {seq} --{name}-docs {docs}: the row must split into equal documents "
                                 "whose length is a multiple of 4 (2·cp with cp=2, so zigzag sharding adds no "
                                 f"padding); e.g. --{name}-seq {max(docs, 1) * 4 * max(1, seq // max(docs, 1) // 4)}")
        if self.cores % 2:
            raise BenchError(f"--cores {self.cores} must be even: two processes share them equally")
        if self.warmup < 1 or self.steps < 1 or self.rounds < 1 or self.round_steps < 1:
            raise BenchError(f"--warmup {self.warmup} --steps {self.steps} --rounds {self.rounds} --round-steps "
                             f"{self.round_steps}: each must be ≥ 1")

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(cp_seq=2048, dp_seq=1024, warmup=1, steps=2, rounds=3, round_steps=1, timeout=180.0)

    def model_config(self) -> ModelConfig:
        from xprep.train.model import ModelConfig

        return ModelConfig(vocab_size=self.vocab, dim=self.dim, n_layers=self.layers, n_heads=self.heads,
                           n_kv_heads=self.kv_heads)


# ------------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/self/status has no {field}")


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Return freed heap to the kernel, so RSS measures live memory (glibc keeps it otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def hwm_reset_works() -> bool:
    """Whether writing "5" to clear_refs resets VmHWM here: fault in and free 64 MiB, reset, compare."""
    import torch

    torch.ones(16 * MIB)  # 64 MiB of fp32, faulted in and freed at once (mmap'd: RSS drops back)
    trim_heap()
    return _reset_hwm() and _status_kib("VmHWM") <= _status_kib("VmRSS") + 8 * 1024


class PeakRSS:
    """Peak RSS (MiB) over a `with` block: VmHWM reset at entry, or a 5 ms sampling thread."""

    def __init__(self, use_hwm: bool):
        self.use_hwm = use_hwm
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        if self.use_hwm:
            _reset_hwm()
        else:
            self.peak = rss_mib()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc) -> None:
        if self.use_hwm:
            self.peak = _status_kib("VmHWM") / 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_mib())


# ------------------------------------------------------------------------------------- model, data, step
def build_model(cfg: BenchConfig):
    from xprep.train.model import Transformer

    model = Transformer(cfg.model_config())
    model.init_weights(cfg.seed)
    return model


def make_batch(seq: int, docs: int, vocab: int, seed: int) -> dict:
    """One packed row of `docs` equal documents; labels shifted inside each document (-100 at ends)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    length = seq // docs
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, length - 1 :: length] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(length).repeat(docs)[None],
        "cu_seqlens": torch.arange(0, seq + 1, length, dtype=torch.int32),
    }


def all_reduce_grads(model) -> None:
    """The replicated baseline's reduction: every gradient summed over the world in one flat all-reduce."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step(model, opt, batch: dict, n_targets: int, cp=None, all_reduce: bool = False,
               keep_grads: bool = False):
    """forward → Σ CE / global targets → backward → (gradient all-reduce) → AdamW. Returns the local loss."""
    from xprep.train.loss import token_ce

    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], cp=cp)  # (1, T, V)
    loss = token_ce(logits, batch["labels"]).sum() / n_targets
    del logits
    loss.backward()
    if all_reduce:
        all_reduce_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=not keep_grads)
    return loss.detach()


def global_sum(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def slowest(times: list[float]) -> list[float]:
    """Per-step maximum over ranks: a synchronous step lasts as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ------------------------------------------------------------------------------------- workers
def cp_worker(cfg: BenchConfig) -> dict:
    """cp = world size (1: one plain process, no process group). Returns rank 0's result."""
    import torch
    import torch.distributed as dist
    from xprep.train.cp import CPContext, shard_batch

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    torch.set_num_threads(cfg.cores // size)
    use_hwm = hwm_reset_works()
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    build_rss = rss_mib()
    batches = [make_batch(cfg.cp_seq, cfg.cp_docs, cfg.vocab, cfg.seed + i) for i in range(cfg.warmup + cfg.steps)]
    targets = [int((b["labels"] != -100).sum()) for b in batches]
    local = [shard_batch(b, rank, size) if size > 1 else b for b in batches]
    del batches
    losses: list[float] = []

    def step(i: int) -> float:
        if size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        cp = CPContext.from_shard(local[i], dist.group.WORLD, rank, size) if size > 1 else None
        loss = train_step(model, opt, local[i], targets[i], cp=cp, all_reduce=size > 1, keep_grads=True)
        seconds = time.perf_counter() - t0
        losses.append(global_sum(float(loss)) if size > 1 else float(loss))
        return seconds

    for i in range(cfg.warmup):
        step(i)
    trim_heap()
    setup_rss = rss_mib()
    times, peaks = [], []
    for i in range(cfg.warmup, cfg.warmup + cfg.steps):
        trim_heap()
        with PeakRSS(use_hwm) as meter:
            times.append(step(i))
        peaks.append(meter.peak)
    mine = {"build_rss": build_rss, "setup_rss": setup_rss, "peak_rss": max(peaks),
            "activation": max(peaks) - setup_rss}
    ranks = [None] * size
    if size > 1:
        dist.all_gather_object(ranks, mine)
        times = slowest(times)
    else:
        ranks = [mine]
    return {"cp": size, "threads": torch.get_num_threads(), "tokens_per_rank": int(local[0]["input_ids"].shape[1]),
            "hwm": use_hwm, "times": times, "losses": losses, "ranks": ranks}


def shard(model, mesh, reshard_after_forward: bool):
    """FSDP2 as issue 5 lays it out: `fully_shard` per block then the root; sum reduction, no division."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # sum, not mean: the loss is normalized by the global target count
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo rejects the PREMUL_SUM the factor becomes
    return model


FSDP_MODES = ("replicated", "fsdp", "fsdp_keep")  # keep = reshard_after_forward=False


def fsdp_worker(cfg: BenchConfig) -> dict:
    """dp = world size: the replicated model and two FSDP2 variants, in rotating order on the same batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.cores // world)
    mesh = init_device_mesh("cpu", (world,))
    models = {
        "replicated": build_model(cfg),
        "fsdp": shard(build_model(cfg), mesh, reshard_after_forward=True),  # fully_shard's default
        "fsdp_keep": shard(build_model(cfg), mesh, reshard_after_forward=False),
    }
    opts = {m: torch.optim.AdamW(model.parameters(), lr=1e-4) for m, model in models.items()}
    n_steps = cfg.warmup + cfg.rounds * cfg.round_steps
    batches = [make_batch(cfg.dp_seq, cfg.dp_docs, cfg.vocab, 10_000 + cfg.seed + i * world + rank)
               for i in range(n_steps)]
    targets = [int(global_sum(float((b["labels"] != -100).sum()))) for b in batches]
    times: dict[str, list[float]] = {m: [] for m in FSDP_MODES}
    losses: dict[str, list[float]] = {m: [] for m in FSDP_MODES}

    def run(mode: str, i: int, timed: bool) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(models[mode], opts[mode], batches[i], targets[i], all_reduce=mode == "replicated")
        if timed:
            times[mode].append(time.perf_counter() - t0)
        losses[mode].append(global_sum(float(loss)))

    for mode in FSDP_MODES:
        for i in range(cfg.warmup):
            run(mode, i, timed=False)
    for r in range(cfg.rounds):  # rotate the order so each mode runs first, second and last equally often
        for mode in FSDP_MODES[r % 3 :] + FSDP_MODES[: r % 3]:
            for k in range(cfg.round_steps):
                run(mode, cfg.warmup + r * cfg.round_steps + k, timed=True)
    return {"dp": world, "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in models["replicated"].parameters()),
            "times": {m: slowest(t) for m, t in times.items()}, "losses": losses}


def worker_main(kind: str, cfg: BenchConfig) -> None:
    """Run one worker; rank 0 prints the result line. Clean gloo shutdown, then a hard exit (gloo + DeviceMesh
    aborts at interpreter exit in about one run of seven)."""
    import torch.distributed as dist

    code = 0
    try:
        result = {"cp": cp_worker, "fsdp": fsdp_worker}[kind](cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT + json.dumps(result), flush=True)
    except BaseException:
        # one write, so the two ranks' tracebacks do not interleave in the shared pipe
        sys.stderr.write(f"{FAILED} (rank {os.environ.get('RANK', '0')}):\n{traceback.format_exc()}")
        code = 1
    if dist.is_initialized() and code == 0:  # after a failure peers may hang in a collective: just exit
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------- launcher
def stop(proc: subprocess.Popen) -> None:
    """Stop a worker launch we started: SIGTERM (torchrun passes it on to its ranks), then SIGKILL by pid."""
    pids = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def excerpt(err: str, limit: int = 3000) -> str:
    """The traceback of a worker's first failed rank (torchrun's own summary says little), else the
    end of its stderr; at most `limit` characters, keeping the end where the error message is."""
    start = err.find(FAILED)
    if start < 0:
        return err[-limit:]
    end = err.find(FAILED, start + 1)
    text = err[start : end if end > 0 else len(err)]
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def launch(cfg: BenchConfig, kind: str, nproc: int) -> dict:
    """Spawn a worker (plain process, or torchrun --standalone for nproc > 1) and read its result line."""
    script = str(Path(__file__).resolve())
    args = [script, "--worker", kind, "--config", json.dumps(asdict(cfg))]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.cores // nproc), "PYTHONPATH": str(ROOT)}
    what = f"{kind} worker ({nproc} process{'es' if nproc > 1 else ''})"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise BenchError(f"{what} timed out after {cfg.timeout:.0f} s; its stderr ends with:\n{excerpt(err)}") from None
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"{what} exited with status {proc.returncode}"
                         f"{'' if lines else ' and printed no result'}; its stderr:\n{excerpt(err)}")
    print(f"  {what}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(lines[-1][len(RESULT) :])


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report_cp(cfg: BenchConfig, one: dict, two: dict) -> tuple[float, float]:
    """Print the context-parallel section; return (activation memory ratio, median step-time ratio)."""
    t1, t2 = statistics.median(one["times"]), statistics.median(two["times"])
    act1 = one["ranks"][0]["activation"]
    act2 = max(r["activation"] for r in two["ranks"])
    how = "VmHWM reset before each step" if one["hwm"] and two["hwm"] else "RSS sampled every 5 ms"
    print(f"\n1. Context parallelism: seq {cfg.cp_seq:,} = {cfg.cp_docs} documents × {cfg.cp_seq // cfg.cp_docs:,} "
          f"tokens; peak = {how}; {len(one['times'])} timed steps after {cfg.warmup} warm-up")
    print(f"   {'layout':<28}{'tokens':>7}{'set-up RSS':>12}{'peak RSS':>10}{'activation':>12}"
          f"{'step median':>13}{'min':>8}")
    rows = [(f"cp=1: 1 process × {one['threads']} threads", one, one["ranks"][0])]
    rows += [(f"cp=2 rank {i}: {two['threads']} thread", two, r) for i, r in enumerate(two["ranks"])]
    for name, res, r in rows:
        print(f"   {name:<28}{res['tokens_per_rank']:>7,}{r['setup_rss']:>8.0f} MiB{r['peak_rss']:>6.0f} MiB"
              f"{r['activation']:>8.0f} MiB{statistics.median(res['times']):>11.2f} s{min(res['times']):>6.2f} s")
    build = max(r["peak_rss"] - r["build_rss"] for r in two["ranks"]) / (one["ranks"][0]["peak_rss"]
                                                                         - one["ranks"][0]["build_rss"])
    print(f"   measured instead from the RSS right after building model and AdamW (before gradients and AdamW "
          f"state exist): {build:.3f}×")
    print(f"   check: cp=2 losses equal cp=1's to {max_rel_diff(two['losses'], one['losses']):.1e} (relative), "
          f"{len(one['losses'])} steps")
    return act2 / act1, t2 / t1


FSDP_LABELS = {
    "replicated": "replicated + flat all-reduce",
    "fsdp": "FSDP2 (reshard after forward)",
    "fsdp_keep": "FSDP2 (no reshard after fwd)",
}


def report_fsdp(cfg: BenchConfig, res: dict) -> dict[str, float]:
    """Print the FSDP2 section; return each FSDP2 variant's median step-time ratio to the replicated one."""
    med = {m: statistics.median(t) for m, t in res["times"].items()}
    n = len(res["times"]["fsdp"])
    print(f"\n2. FSDP2, dp={res['dp']}, 1 process × {res['threads']} thread per rank: {res['params'] / 1e6:.2f}M "
          f"parameters, {cfg.dp_seq:,} tokens per rank and step ({cfg.dp_docs} documents); {n} timed steps per mode "
          f"in {cfg.rounds} rotating rounds after {cfg.warmup} warm-up")
    print(f"   {'mode':<32}{'median':>9}{'min':>9}{'max':>9}{'ratio of medians':>18}{'of mins':>9}{'paired':>8}")
    base = res["times"]["replicated"]
    for mode in FSDP_MODES:
        t = res["times"][mode]
        paired = statistics.median(a / b for a, b in zip(t, base, strict=True))
        print(f"   {FSDP_LABELS[mode]:<32}{med[mode]:>7.3f} s{min(t):>7.3f} s{max(t):>7.3f} s"
              f"{med[mode] / med['replicated']:>17.3f}×{min(t) / min(base):>8.3f}×{paired:>7.3f}×")
    print("   (paired = median over steps of the ratio to the replicated step run on the same batch in the same round)")
    worst = max(max_rel_diff(res["losses"][m], res["losses"]["replicated"]) for m in ("fsdp", "fsdp_keep"))
    print(f"   check: FSDP2 losses equal the replicated model's to {worst:.1e} (relative), "
          f"{len(res['losses']['fsdp'])} steps")
    return {m: med[m] / med["replicated"] for m in ("fsdp", "fsdp_keep")}


def parse_args() -> tuple[argparse.Namespace, BenchConfig]:
    """Command line → BenchConfig: `--quick` picks the smoke-run defaults; one option per field overrides."""
    full, quick = BenchConfig(), BenchConfig.quick()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sequences and fewer steps (smoke run)")
    for f in fields(BenchConfig):
        default, small = getattr(full, f.name), getattr(quick, f.name)
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(default), dest=f.name,
                        help=f"default {default}" + (f", quick {small}" if small != default else ""))
    ap.add_argument("--worker", choices=["cp", "fsdp"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return args, BenchConfig(**json.loads(args.config))
    chosen = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if getattr(args, f.name) is not None}
    return args, replace(quick if args.quick else full, **chosen)


def main() -> int:
    from xprep.prep.errors import XprepError

    try:
        args, cfg = parse_args()
        if args.worker:
            worker_main(args.worker, cfg)
        model = cfg.model_config()
    except (BenchError, XprepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cores; each configuration gets {cfg.cores} cores in total "
          f"(1 process × {cfg.cores} threads, or 2 processes × {cfg.cores // 2} thread{'s' if cfg.cores > 2 else ''})")
    print(f"model: {model.n_layers} layers, width {model.dim}, {model.n_heads} heads / {model.n_kv_heads} K/V heads, "
          f"ffn {model.ffn_dim}, vocab {model.vocab_size}, {'tied' if model.tie_embeddings else 'untied'}, fp32, "
          f"AdamW; {model.num_params() / 1e6:.2f}M parameters")
    t0 = time.perf_counter()
    try:
        one = launch(cfg, "cp", 1)
        two = launch(cfg, "cp", 2)
        fsdp = launch(cfg, "fsdp", 2)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    act, cp_step = report_cp(cfg, one, two)
    fsdp_ratio = report_fsdp(cfg, fsdp)
    print(f"\nsummary ({'quick' if args.quick else 'full'} run, {time.perf_counter() - t0:.0f} s; "
          f"every configuration on {cfg.cores} cores in total):")
    print(f"   {'measure':<52}{'value':>8}{'target':>9}   verdict")
    rows = [
        ("CP peak activation memory per rank, cp=2 / cp=1", act, 0.6),
        ("CP step time (median), cp=2 / cp=1", cp_step, None),
        ("CP step time (min), cp=2 / cp=1", min(two["times"]) / min(one["times"]), None),
        ("step time (median), FSDP2 / replicated, dp=2", fsdp_ratio["fsdp"], 1.2),
        ("  same, FSDP2 without reshard after forward", fsdp_ratio["fsdp_keep"], 1.2),
    ]
    for name, value, target in rows:
        goal = f"≤ {target}×" if target else "—"
        print(f"   {name:<52}{value:>7.3f}×{goal:>9}   {verdict(value <= target) if target else ''}".rstrip())
    full = BenchConfig()
    if (cfg.cp_seq, cfg.dp_seq) != (full.cp_seq, full.dp_seq):
        print(f"   note: the targets are set for seq {full.cp_seq:,} (CP) and {full.dp_seq:,} tokens per rank (FSDP2); "
              "at smaller sizes the fixed costs (gradients, AdamW state, FSDP2's collectives) weigh more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
