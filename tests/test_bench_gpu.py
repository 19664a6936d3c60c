"""bench/gpu.py, the GPU proof, on the CPU: every part runs at small sizes and passes, and a wrong kernel fails it.

The subprocess run is the command a GPU machine runs (`python -m bench.gpu`), pinned to the CPU; the in-process
run swaps in a varlen kernel that aligns its causal mask top-left (SDPA's own `is_causal`, flash-attn < 2.1):
right for whole documents, wrong for context parallelism's pieces, so the bench cannot pass vacuously.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import train.attention as attention
import train.cp as cp
from bench import gpu

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = ("PASS", "FAIL", "SKIP")

# (part, check) lines the CPU run must PASS; the kernel checks also SKIP what needs CUDA.
EXPECTED_PASS = [
    ("kernels", f"{kernel} {direction}")
    for kernel in ("varlen_attention bf16", "varlen_attention fp32", "cp2 bf16", "cp2 fp32", "cp4 bf16", "cp4 fp32")
    for direction in ("forward", "backward")
] + [
    ("kernels", "flex bf16 forward"),
    ("kernels", "flex fp32 forward"),
    ("kernels", "block mask T=8k: its tensors"),
    ("kernels", "block mask T=8k: largest made building it"),
    ("model", "bf16 = fp32: loss"),
    ("model", "bf16 = fp32: gradients"),
    ("model", "loss_chunk 86 = whole logits: loss"),
    ("model", "loss_chunk 86 = whole logits: gradients"),
    ("model", "compiled = eager (aot_eager): loss"),
    ("model", "compiled = eager (aot_eager): gradients"),
    ("model", "compiled: no recompiles"),
    ("fsdp1", "DCP load = save: model state"),
    ("fsdp1", "DCP load = save: optimizer state"),
]
EXPECTED_SKIP = [("model", "cuda fp32 = cpu fp32"), ("kernels", "flex bf16 backward"), ("kernels", "flash-attn bf16")]


def verdicts(output: str) -> dict[tuple[str, str], str]:
    """(part, check) -> PASS / FAIL / SKIP of every check line (columns as gpu.Report prints them)."""
    found = {}
    for line in output.splitlines():
        words = line.split()
        if words and words[-1] in VERDICTS:
            found[(line[:10].strip(), line[11:57].strip())] = words[-1]
    return found


def test_every_part_runs_and_passes_on_the_cpu():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    found = verdicts(proc.stdout)
    assert not [check for check, verdict in found.items() if verdict == "FAIL"], proc.stdout
    for check in EXPECTED_PASS:
        assert found.get(check) == "PASS", (check, proc.stdout)
    for check in EXPECTED_SKIP:
        assert found.get(check) == "SKIP", (check, proc.stdout)
    lines = proc.stdout.splitlines()
    for part in gpu.PARTS:  # every part ran to its end
        assert any(line.startswith(part) and " time " in line for line in lines), part
    for variant in ("eager", "compiled", "eager, AC", "compiled, AC"):  # the four throughput runs
        assert any(line.startswith("throughput") and line[11:57].strip() == variant and "tokens/s" in line
                   for line in lines), variant
    assert lines[-1].split() == ["total", "failures", "0"]


def top_left_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The varlen contract but with SDPA's own causal mask, aligned top-left: a query sequence shorter than its
    keys (a context-parallel piece) sees the first keys instead of the last."""
    outs = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True):
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:d], v[c:d]))  # (1, H, L, D)
        outs.append(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)[0]
                    .transpose(0, 1))
    return torch.cat(outs)


def run_kernels() -> tuple[int, dict[tuple[str, str], str], str]:
    """The kernels part in this process, on one thread: (failures returned, verdicts, output)."""
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: more threads only contend on a shared machine
    try:
        failures = gpu.run(["kernels"], torch.device("cpu"), stream=out)
    finally:
        torch.set_num_threads(threads)
    return failures, verdicts(out.getvalue()), out.getvalue()


def failed(found: dict[tuple[str, str], str]) -> list[str]:
    return sorted(check for (_, check), verdict in found.items() if verdict == "FAIL")


def test_a_wrong_kernel_fails_the_kernel_checks(monkeypatch):
    monkeypatch.setattr(attention, "varlen_kernel", lambda q: top_left_kernel)
    monkeypatch.setattr(cp, "varlen_kernel", lambda q: top_left_kernel)
    failures, found, output = run_kernels()
    assert failed(found) == sorted(f"cp{size} {dtype} {direction}" for size in (2, 4) for dtype in ("bf16", "fp32")
                                   for direction in ("forward", "backward")), output
    assert failures == len(failed(found))  # the exit status counts them
    for dtype in ("bf16", "fp32"):  # whole documents are square: the same kernel is right there
        assert found[("kernels", f"varlen_attention {dtype} forward")] == "PASS"
        assert found[("kernels", f"varlen_attention {dtype} backward")] == "PASS"


def test_a_check_that_raises_fails_and_the_others_still_run(monkeypatch):
    def refuses(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(attention, "flex_document_attention", refuses)
    failures, found, output = run_kernels()
    assert failed(found) == ["flex bf16", "flex fp32"] and failures == 2, output
    assert "raised RuntimeError: no kernel image" in output
    assert found[("kernels", "cp4 fp32 backward")] == "PASS"  # the checks after it ran
