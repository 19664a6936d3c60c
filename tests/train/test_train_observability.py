"""Observability: model FLOPs and MFU (train/flops.py), peak memory (train/memory.py), the metrics.jsonl and console
fields (train/metrics.py), TensorBoard and W&B (train/loggers.py), and the run report's throughput."""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from xprep.prep.errors import XprepError
from xprep.prep.inspect.text import render_run
from xprep.train.flops import (
    ModelFlops,
    Throughput,
    bin_attention_pairs,
    causal_pairs,
    check_peak_tflops,
    mfu,
    resolve_peak_tflops,
    table_peak_tflops,
)
from xprep.train.loggers import (
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    check_backends,
    parse_backends,
    scalars,
)
from xprep.train.memory import peak_memory, peak_rss_bytes, reset_peak_memory
from xprep.train.metrics import EvalMetrics, MetricsLog, StepMetrics
from xprep.train.model import ModelConfig, Transformer
from xprep.train.report import perf_summary, run_report

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("shape", [
    dict(n_kv_heads=2),  # GQA, untied output head
    dict(n_kv_heads=4, tie_embeddings=True, qkv_bias=True),  # tied head (F.linear), biased q/k/v
])
def test_training_flops_match_an_independent_count(shape):
    """torch's FlopCounterMode over a real forward + backward of a packed row (3 documents) gives exactly
    6·(matmul weights)·T + 12·L·H·D per attended pair. The counter (math SDPA: plain bmm) computes every
    document's full square, so its pairs are Σd²; the causal kernels' are Σd(d+1)/2."""
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, ffn_dim=80, **shape)
    model = Transformer(cfg)
    model.init_weights(0)
    lens = [5, 11, 16]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)))
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(ids, positions, cu)
        forward = counter.get_total_flops()
        logits.logsumexp(-1).sum().backward()
    flops = ModelFlops.of(cfg)
    assert counter.get_total_flops() == flops.step(sum(lens), sum(n * n for n in lens)) == 3 * forward
    kv = cfg.n_kv_heads * cfg.head_dim
    assert flops.matmul_weights == 2 * (2 * 32 * 32 + 2 * 32 * kv + 3 * 32 * 80) + 32 * 96
    assert causal_pairs(lens) == sum(n * (n + 1) // 2 for n in lens) == 15 + 66 + 136


def test_flops_per_token_and_from_the_recorded_config():
    cfg = ModelConfig(vocab_size=1000, dim=64, n_layers=3, n_heads=4)
    flops = ModelFlops.of(cfg)
    assert flops.attention_per_pair == 12 * 3 * 64  # 12 · L · H · D (H · D = dim)
    assert flops.per_token(127) == 6 * flops.matmul_weights + 12 * 3 * 64 * 64  # 64 pairs per token on average
    assert flops.step(10, 0) == 10 * flops.dense_per_token
    recorded = {**cfg.to_dict(), "hf": "/models/llama"}  # what ModelSection.check records for hf:DIR weights
    assert ModelFlops.from_dict(recorded) == flops
    assert ModelFlops.from_dict(None) is None  # a transformers module: no FLOPs, so no MFU


def test_attention_pairs_of_bins_count_real_items_only(tmp_path):
    from trainkit import make_dataset, random_docs, sequential_bins, write_pack
    from xprep.train.data import PackedDataset

    docs = random_docs(12, 3, 20, vocab=64, seed=1)
    make_dataset(tmp_path / "ds", docs, vocab_size=64)
    bins = sequential_bins([len(d) for d in docs], 32)
    ds = PackedDataset(write_pack(tmp_path / "p", [tmp_path / "ds"], bins, 32))
    for b, items in enumerate(bins):
        assert bin_attention_pairs(ds, [b]) == sum(n * (n + 1) // 2 for _, _, n in items)
    assert bin_attention_pairs(ds, [0, 1]) == bin_attention_pairs(ds, [0]) + bin_attention_pairs(ds, [1])


# ---------------------------------------------------------------------------------------------- peak and MFU
@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10G", 70.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.2), ("AMD Instinct MI300X", 1307.4),
    ("NVIDIA RTX A1000", None), ("Tesla T4", None), ("Tesla V100-SXM2-16GB", None),
])
def test_peak_table_by_device_name(name, peak):
    assert table_peak_tflops(name) == peak


def test_peak_resolution_and_its_option():
    assert resolve_peak_tflops(CPU) == (None, "MFU not reported: no peak FLOPS known for cpu; give --peak-tflops to "
                                              "measure against one")  # never a guess
    assert resolve_peak_tflops(CPU, 2.5) == (2.5, "MFU against --peak-tflops 2.5 per GPU")
    check_peak_tflops(None)
    check_peak_tflops(989)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(XprepError, match="--peak-tflops .* must be a number > 0"):
            check_peak_tflops(bad)


def test_mfu_arithmetic():
    flops = ModelFlops(matmul_weights=1_000_000, attention_per_pair=1_000)
    step = 6e6 * 4096 + 1e3 * 50_000  # 4,096 tokens, 50,000 attended pairs
    assert flops.step(4096, 50_000) == step
    tp = Throughput(flops, peak_tflops=100.0, world_size=4)
    tflops, utilization, _ = tp.measure(4096, 50_000, 0.5)
    assert tflops == pytest.approx(step / 0.5 / 4 / 1e12)
    assert utilization == pytest.approx(step / 0.5 / 4 / 100e12) == pytest.approx(tflops / 100)
    assert mfu(step, 0.5, 4, 100.0) == utilization
    assert Throughput(flops, None, 4).measure(4096, 50_000, 0.5) == (tflops, None, None)  # no peak: TFLOPS, no MFU
    assert Throughput(None, 100.0).measure(4096, 0, 0.5) == (None, None, None)  # no model FLOPs
    assert mfu(None, 0.5, 1, 100.0) is None and mfu(step, 0.0, 1, 100.0) is None


# ---------------------------------------------------------------------------------------------- memory
def test_peak_memory_on_cpu():
    reset_peak_memory(CPU)  # nothing to reset off CUDA
    before = peak_rss_bytes()
    block = np.ones(64 << 20, np.uint8)  # 64 MiB touched
    status = Path("/proc/self/status")
    resident = next((int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                     if line.startswith("VmRSS:")), 0) if status.is_file() else 0
    cuda, rss = peak_memory(CPU)
    assert cuda is None and rss >= before and rss >= block.nbytes
    # bytes, not Linux's KiB: about what was resident just before (the kernel syncs its counters lazily)
    assert rss >= 0.9 * resident


# ---------------------------------------------------------------------------------------------- metrics
def steps(n: int = 3, cuda: bool = False, eval_at: int | None = None) -> list[StepMetrics]:
    out = []
    for i in range(1, n + 1):
        e = EvalMetrics(2.0 / i, {"code": 2.1 / i}, {}, 100, 2, 0.1) if i == eval_at else None
        out.append(StepMetrics(i, 3.0 / i, {"code": 3.1 / i, "chat": 2.9 / i}, 0.5 + i, 1e-3 * i, 1000, 400, 0.25,
                               4 * i, {"web": 3.05 / i}, e, tflops=40.0 + i if cuda else 0.01,
                               mfu=0.4 + i / 100 if cuda else None,
                               peak_mem_bytes=(3 << 30) + i if cuda else None, peak_rss_bytes=(1 << 30) + i,
                               mfu_6n=0.5 + i / 100 if cuda else None))
    return out


def test_metrics_jsonl_and_console_carry_throughput_and_memory(tmp_path):
    out = io.StringIO()
    log = MetricsLog(tmp_path, 3, 3, True, out)
    log.open(0)
    for m in steps(cuda=True):
        log.write(m)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_per_s"] for r in rows] == [4000.0] * 3
    assert [r["mfu"] for r in rows] == pytest.approx([0.41, 0.42, 0.43]) and rows[0]["tflops"] == 41.0
    assert [r["mfu_6n"] for r in rows] == pytest.approx([0.51, 0.52, 0.53])
    assert rows[2]["peak_mem_bytes"] == (3 << 30) + 3 and rows[2]["peak_rss_bytes"] == (1 << 30) + 3
    line = out.getvalue().strip()
    assert line.startswith("step 3/3  loss 1.0000  lr 3.00e-03  grad 3.500  4,000 tok/s  ")  # as before
    assert "  MFU 42.0% (6N 52.0%)  mem 3.0 GiB  ETA " in line  # time-weighted MFUs of the interval, its peak memory


def test_cpu_console_shows_rss_and_no_mfu(tmp_path):
    out = io.StringIO()
    log = MetricsLog(tmp_path, 2, 1, True, out)
    log.open(0)
    for m in steps(2):
        log.write(m)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["mfu"] is None and rows[0]["mfu_6n"] is None and rows[0]["peak_mem_bytes"] is None
    assert rows[0]["peak_rss_bytes"] > 0
    assert all("MFU" not in line and "  rss 1.0 GiB  ETA" in line for line in out.getvalue().splitlines())


def rows_mfu(i: int) -> float:
    return 0.4 + i / 100  # as ``steps`` makes it


def test_scalars_are_the_jsonl_record_flattened():
    m = steps(2, cuda=True, eval_at=2)[1]
    flat = scalars({**m.record(), "time": 1.7e9})
    assert flat["loss"] == 1.5 and flat["category_loss/code"] == 3.1 / 2 and flat["source_loss/web"] == 3.05 / 2
    assert flat["eval_loss"] == 1.0 and flat["eval_category_loss/code"] == 2.1 / 2 and flat["mfu"] == rows_mfu(2)
    assert flat["peak_mem_bytes"] == (3 << 30) + 2 and flat["tokens_per_s"] == 4000.0 and flat["mfu_6n"] == 0.52
    assert "step" not in flat and "time" not in flat
    assert "mfu" not in scalars(steps(1)[0].record()) and "mfu_6n" not in scalars(steps(1)[0].record())  # nulls


# ---------------------------------------------------------------------------------------------- backends
def test_backend_names():
    assert parse_backends(None) == () and parse_backends("") == ()
    assert parse_backends("wandb, tensorboard,wandb") == ("wandb", "tensorboard")
    with pytest.raises(XprepError, match="unknown backend 'mlflow'; choose from tensorboard, wandb"):
        parse_backends("tensorboard,mlflow")


def test_a_missing_package_names_its_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(XprepError, match=r"--log wandb needs the wandb package.*pip install 'xprep\[wandb\]'"):
        check_backends("wandb")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(XprepError, match=r"pip install 'xprep\[wandb\]'"):
        WandbLogger(tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(XprepError, match=r"--log tensorboard needs .* pip install 'xprep\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)


def logged_run(run: Path, spec: str, n: int = 4, resumed: int = 0, scale: float = 1.0) -> list[dict]:
    """Write steps resumed+1..n through MetricsLog with the ``spec`` backends; the metrics.jsonl records."""
    log = MetricsLog(run, n, 2, True, io.StringIO(), loggers=build_loggers(spec, run, {"lr": 1e-3}, resumed))
    log.open(resumed)
    for m in steps(n, cuda=True, eval_at=2)[resumed:]:
        m.loss *= scale
        log.write(m)
    log.close()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_read_back_as_the_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = logged_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in scalars(rows[0]) | scalars(rows[1]):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(r["step"], v) for r in rows if (v := scalars(r).get(key)) is not None]
        assert [s for s, _ in logged] == [s for s, _ in want], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in want], rel=1e-6), key  # float32
    assert {"loss", "category_loss/chat", "source_loss/web", "eval_loss", "eval_category_loss/code", "lr",
            "grad_norm", "tokens_per_s", "tflops", "mfu", "mfu_6n", "peak_mem_bytes", "peak_rss_bytes"} <= set(
        events.Tags()["scalars"])
    logged_run(tmp_path, "tensorboard", resumed=2, scale=10.0)  # resumed at step 2: steps 3, 4 written again
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("loss")] == [(1, 3.0), (2, 1.5), (3, 10.0),
                                                                            (4, 7.5)]


def wandb_history(run_file: str) -> list[dict]:
    """The history rows of an offline run's .wandb file (a LevelDB-style log of Record protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending, rows = Path(run_file).read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (size == 0 and kind == 0):  # a block's zero-filled tail
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_logged_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "xprep-tests")
    # closing waits for wandb's service to write the run (wandb.teardown): without that wait, about 1 read in 3
    # found the file still empty
    rows = logged_run(tmp_path, "wandb", n=3)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert len(files) == 1 and files[0].endswith(f"run-{run_id}.wandb")
    history = wandb_history(files[0])
    assert [h["_step"] for h in history] == [1, 2, 3]
    for h, r in zip(history, rows, strict=True):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == pytest.approx(scalars(r))
    logged_run(tmp_path, "wandb", n=3, resumed=2)  # a resumed run continues the same W&B run
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id


# ---------------------------------------------------------------------------------------------- report
def test_run_report_shows_throughput_and_memory(tmp_path):
    logged_run(tmp_path, "")
    report = run_report(tmp_path)
    p = report["perf"]
    assert p["steps"] == 3 and p["tokens_per_s"] == 4000.0  # the first step (warm-up) left out
    assert p["mfu"] == pytest.approx(0.43) and p["tflops"] == pytest.approx(43.0) and p["mfu_6n"] == pytest.approx(0.53)
    assert p["peak_mem_bytes"] == (3 << 30) + 4 and p["peak_rss_bytes"] == (1 << 30) + 4
    line = next(x for x in render_run(report).splitlines() if x.strip().startswith("throughput"))
    assert "4,000 tok/s, 43 TFLOPS/GPU, MFU 43%, 6N MFU 53% (median of 3 steps)" in line
    assert "peak memory 3.0 GiB (CUDA allocated)" in line and "peak RSS 1.0 GiB" in line
    assert perf_summary([{"step": 1, "tokens_per_s": 10.0}])["mfu"] is None  # a CPU run without a peak


def test_html_report_charts_both_mfus(tmp_path):
    from xprep.prep.inspect.html import write_page

    logged_run(tmp_path, "")
    write_page([run_report(tmp_path)], tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "Model FLOPs utilization" in page and "MFU, 6N convention (PaLM, torchtitan)" in page


def test_html_curves_leave_out_a_series_no_step_has():
    from xprep.train.report import curves

    rows = [{"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "mfu": None}, {"step": 2, "loss": 1.0, "mfu": None}]
    assert "mfu" not in curves(rows) and curves(rows)["tokens_per_s"] == [10.0, None]  # a CPU run: no MFU chart
    assert curves([{**rows[0], "mfu": 0.4}])["mfu"] == [0.4] and "mfu_6n" not in curves(rows)
    assert curves([{**rows[0], "mfu": 0.4, "mfu_6n": 0.5}])["mfu_6n"] == [0.5]

# ---------------------------------------------------------------------------------------------- xtrain run
def wired() -> bool:
    from xprep.train.config import TrainConfig

    return {"log", "peak_tflops"} <= set(TrainConfig.__dataclass_fields__)


@pytest.mark.skipif(not wired(), reason="--log / --peak-tflops are not options of xtrain run yet")
def test_xtrain_run_logs_mfu_memory_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from click.testing import CliRunner
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trainkit import category_pack
    from xprep.cli import xtrain

    run = tmp_path / "run"
    result = CliRunner().invoke(xtrain, ["run", str(category_pack(tmp_path / "data")), "--steps", "3", "--output",
                                         str(run), "--log", "tensorboard", "--peak-tflops", "0.5",
                                         "--log-every", "3"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] > 0 and r["tflops"] > 0 and r["peak_rss_bytes"] > 0 for r in rows)
    assert all(r["peak_mem_bytes"] is None for r in rows)  # CPU
    assert all(r["mfu"] == pytest.approx(r["tflops"] / 0.5) for r in rows)
    info = json.loads((run / "run.json").read_text())  # 6N: every real token at the bins' capacity T
    per_token = ModelFlops.from_dict(info["model"]).per_token_6n(info["pack"]["capacity"])
    assert all(r["mfu_6n"] == pytest.approx(per_token * r["tokens"] / r["step_seconds"] / 0.5e12) for r in rows)
    assert all(r["mfu_6n"] > r["mfu"] for r in rows)  # it counts the masked half of causal attention too
    assert "  MFU " in result.stderr and "% (6N " in result.stderr and "  rss " in result.stderr
    assert "step 3/3  loss" in result.stderr
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("mfu")] == pytest.approx([r["mfu"] for r in rows], rel=1e-6)
    assert json.loads((run / "config.json").read_text())["peak_tflops"] == 0.5


@pytest.mark.skipif(not wired(), reason="--log / --peak-tflops are not options of xtrain run yet")
def test_xtrain_run_refuses_a_missing_backend_and_a_bad_peak(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from trainkit import category_pack
    from xprep.cli import xtrain

    packed = str(category_pack(tmp_path / "data"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    for args, message in ((["--log", "wandb"], "pip install 'xprep[wandb]'"), (["--log", "mlflow"], "unknown backend"),
                          (["--peak-tflops", "0"], "--peak-tflops 0.0 must be a number > 0")):
        result = CliRunner().invoke(xtrain, ["run", packed, "--steps", "1", "--output", str(tmp_path / "r"), *args])
        assert result.exit_code == 2 and message in result.stderr, result.stderr
        assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before any work
