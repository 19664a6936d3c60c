"""bench/gpu.py, the GPU proof, on the CPU: every part runs at small sizes and passes, and a wrong kernel fails it.

The subprocess run is the command a GPU machine runs (`python -m bench.gpu`), pinned to the CPU; the in-process
run swaps in a varlen kernel that aligns its causal mask top-left (SDPA's own `is_causal`, flash-attn < 2.1):
right for whole documents, wrong for context parallelism's pieces, so the bench cannot pass vacuously.
The resilience part runs apart, in this process (its four `xtrain run`s are child processes: 25-45 s on two
shared cores), with the subprocess run beside it; its checks are shown to fail on a broken resume and a bad step
left unskipped.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import xprep.train.attention as attention
import xprep.train.cp as cp

from bench import gpu, tinyrun

ROOT = Path(__file__).resolve().parents[2]
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
IN_ONE_RUN = [part for part in gpu.PARTS if part != "resilience"]
RESILIENCE_PASS = [
    "uninterrupted run: exit status",
    "SIGTERM: exit status",
    "SIGTERM: latest = the step reached",
    "SIGTERM: last stderr line names it",
    "--save-hf (device) = export (CPU)",
    "resumed: exit status",
    "resumed: each step once",
    "resumed: same batches, lr",
    "resumed = uninterrupted: losses",
    "init-from run: exit status",
    "non-finite gradient at step 3: skipped",
    "--init-from: run.json init, step 1",
    "--init-from: step-1 loss = checkpoint's",
]


def verdicts(output: str) -> dict[tuple[str, str], str]:
    """(part, check) -> PASS / FAIL / SKIP of every check line (columns as gpu.Report prints them)."""
    found = {}
    for line in output.splitlines():
        words = line.split()
        if words and words[-1] in VERDICTS:
            found[(line[:10].strip(), line[11:57].strip())] = words[-1]
    return found


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


def run_parts(parts: list[str]) -> tuple[int, dict[tuple[str, str], str], str]:
    out = io.StringIO()
    failures = gpu.run(parts, torch.device("cpu"), stream=out)
    return failures, verdicts(out.getvalue()), out.getvalue()


@pytest.mark.usefixtures("cpu_run")  # started now: the command below runs beside this part (see cpu_run)
def test_the_resilience_part_passes_on_the_cpu(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # its runs, two side by side
    failures, found, output = run_parts(["resilience"])
    assert failures == 0 and not failed(found), output
    for check in RESILIENCE_PASS:
        assert found.get(("resilience", check)) == "PASS", (check, output)
    transformers = found.get(("resilience", "transformers: RUN/hf/latest logits"))
    assert transformers == "PASS" or (transformers is None and "transformers is not installed" in output), output


def test_a_part_that_raises_fails_once_leaves_no_run_behind_and_the_next_part_runs(monkeypatch):
    children = []
    start = tinyrun.Xtrain.start

    def recorded(self, *args):
        children.append(start(self, *args))
        return children[-1]

    monkeypatch.setattr(tinyrun.Xtrain, "start", recorded)

    def breaks(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tinyrun, "signal_after_rows", breaks)  # the two first runs are started by then
    failures, found, output = run_parts(["resilience", "env"])
    assert failures == 1 and found[("resilience", "ran to the end")] == "FAIL", output
    assert "raised OSError: [Errno 28] No space left on device" in output
    assert len(children) == 2 and all(child.returncode is not None for child in children)  # killed and reaped
    assert any(line.startswith("env") and " time " in line for line in output.splitlines()), output


def write_run(run_dir: Path, rows: list[dict], stderr: str) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Path(f"{run_dir}.err").write_text(stderr)
    return run_dir


def test_the_resilience_checks_fail_on_a_broken_resume_and_an_unskipped_bad_step(tmp_path):
    steps = gpu.CPU_SIZES.run_steps
    rows = [{"step": i, "loss": 5.0 - i / 100, "tokens": 100 + i, "target_tokens": 90, "consumed_samples": 2 * i,
             "lr": 1e-3, "skipped": False} for i in range(1, steps + 1)]
    ref = write_run(tmp_path / "ref", rows, "")
    replayed = rows[:6] + [{**rows[5], "loss": 4.9}] + rows[6:-1]  # step 6 logged twice, the batches one late
    cut = write_run(tmp_path / "cut", replayed, "resuming at step 6 from ...\n")
    bad = write_run(tmp_path / "bad", rows[:4], "")  # step 3 trained on
    out = io.StringIO()
    report = gpu.Report(out)
    bench = gpu.Bench(torch.device("cpu"), gpu.CPU_SIZES, report, "aot_eager", tmp_path)
    gpu.check_resumed(bench, ref, cut, 0, 6)
    gpu.check_bad_step(report, bad, 0)
    found = verdicts(out.getvalue())
    assert failed(found) == sorted(["resumed: each step once", "resumed: same batches, lr",
                                    "resumed = uninterrupted: losses", "non-finite gradient at step 3: skipped"]
                                   ), out.getvalue()
    assert report.failures == 4


# ---------------------------------------------------------------------------------- the command a GPU machine runs
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """`python -m bench.gpu --device cpu` with every part but resilience, started when a test first asks and left
    running (one thread, its output in files): the resilience test asks for it, so that it runs beside that part,
    on the core its runs leave idle; the test below waits for it. Killed if still running when the module ends."""
    out = tmp_path_factory.mktemp("cpu_run")
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--device", "cpu", *IN_ONE_RUN], cwd=ROOT,
                                stdout=stdout, stderr=stderr, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_every_part_runs_and_passes_on_the_cpu(cpu_run):
    proc, out = cpu_run
    returncode = proc.wait(timeout=600)
    stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
    assert returncode == 0, stdout + stderr[-4000:]
    found = verdicts(stdout)
    assert not [check for check, verdict in found.items() if verdict == "FAIL"], stdout
    for check in EXPECTED_PASS:
        assert found.get(check) == "PASS", (check, stdout)
    for check in EXPECTED_SKIP:
        assert found.get(check) == "SKIP", (check, stdout)
    lines = stdout.splitlines()
    for part in IN_ONE_RUN:  # every part ran to its end
        assert any(line.startswith(part) and " time " in line for line in lines), part
    for variant in ("eager", "compiled", "eager, AC", "compiled, AC"):  # the four throughput runs
        assert any(line.startswith("throughput") and line[11:57].strip() == variant and "tokens/s" in line
                   for line in lines), variant
    assert lines[-1].split() == ["total", "failures", "0"]
