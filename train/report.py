"""The report on a run directory (``xprep inspect runs/NAME``): loss by category and by source over the
run (first, last, best, trend), and the same of the validation loss when the run evaluated (and of every named
set of ``--eval``, from its ``eval/NAME/...`` keys; the test pass from run.json's ``test``); throughput
(median tokens/s, TFLOPS and both MFUs, peak memory); the parallel layout it ran on; no torch;
``xprep.prep.inspect.text`` makes the text.

A weighted run (train/loss_weights.py) has ``loss_weights`` (from run.json: every category's and source's weight)
and, beside its weighted ``loss``, the summary of the plain token mean as ``token_loss``; steps whose targets all
weighed 0 are counted as ``weightless_steps``.

A step without target tokens has a null loss (train/metrics.py): it is left out of the loss summary
(first, last, best, trend), a gap in the curves, and counted as ``steps_without_targets`` (evaluations
without targets as ``evaluations_without_targets``). A bad step (skipped: non-finite loss or gradient
norm) is counted as ``skipped_steps`` instead, and its loss, when finite, stays in the figures.

Only the live metrics.jsonl is summed up; the ``metrics.jsonl.replayed-N`` files (lines of steps trained
again after a resume) are listed under ``replayed``, with their steps, and otherwise left out.

Reads ``config.json``, ``run.json`` and ``metrics.jsonl``, and writes nothing: the loss curves are
drawn (with matplotlib) only into the file ``--plot FILE`` names.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from xprep.prep.errors import XprepError
from xprep.prep.io import check_output_file
from xprep.train.ckpt_files import TRAINER_JSON, latest_name, step_numbers
from xprep.train.metrics import best_step, line_step, replayed_files

PLOT = "loss_by_category.png"  # the name suggested when --plot names a directory
PLOT_FORMATS = {"": "png", ".png": "png", ".pdf": "pdf", ".svg": "svg"}
HYBRID = "hybrid"  # xprep.train.cp.HYBRID, named here without importing torch: the CP mode whose U is not implied
OLD_CP_MODE = "allgather"  # of a run.json from before --cp-mode, when all-gather was how every CP run attended


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl records in step order; a torn last line (killed run) is skipped."""
    records = []
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return records
    for line in metrics.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(records, key=lambda r: r.get("step", 0))


def replayed(path: Path) -> list[dict]:
    """The run's ``metrics.jsonl.replayed-N`` files, oldest first: name, lines, and the steps they hold."""
    out = []
    for file in replayed_files(path / "metrics.jsonl"):
        with open(file) as lines:
            steps = [line_step(line) for line in lines]
        known = [s for s in steps if s is not None]
        out.append({"file": file.name, "lines": len(steps), "first_step": min(known, default=None),
                    "last_step": max(known, default=None)})
    return out


def curve_summary(steps: list[int], values: list[float]) -> dict:
    """First, last, best (lowest) value and trend = mean of the last quarter vs the first quarter."""
    q = max(1, len(values) // 4)
    head, tail = sum(values[:q]) / q, sum(values[-q:]) / q
    best = min(range(len(values)), key=values.__getitem__)
    return {"points": len(values), "first": values[0], "last": values[-1], "best": values[best],
            "best_step": steps[best], "trend": (tail - head) / head if head else 0.0}


def run_report(path: str | Path, plot: str | Path | None = None) -> dict:
    """JSON-able report on a run directory; with ``plot``, the loss curves are drawn into that file."""
    path = Path(path)
    target = check_plot_target(plot) if plot is not None else None  # before any work
    config = _read_json(path / "config.json")
    info = _read_json(path / "run.json")
    records = read_metrics(path)
    report = {"kind": "run", "path": str(path), "config": config, "settings": settings(config),
              "layout": run_layout(info), "pack": info.get("pack"), "validation": info.get("validation"),
              "loss_weights": info.get("loss_weights"),
              "plan": info.get("plan"), "steps": len(records),
              "last_step": records[-1]["step"] if records else 0,
              "checkpoints": _checkpoints(path), "replayed": replayed(path), "plot": None}
    if target is not None and not records:
        raise XprepError(f"--plot {plot}: {path} has no metrics yet (no metrics.jsonl records); nothing to draw")
    if records:
        losses = [r for r in records if _number(r.get("loss"))]
        report["skipped_steps"] = sum(1 for r in records if r.get("skipped"))
        report["steps_without_targets"] = sum(1 for r in records if r.get("loss") is None and not r.get("skipped")
                                              and not r.get("weightless"))
        if any("weightless" in r for r in records):  # a weighted run: its plain token mean beside its loss
            report["weightless_steps"] = sum(1 for r in records if r.get("weightless"))
            tokens = [r for r in records if _number(r.get("token_loss"))]
            if tokens:
                report["token_loss"] = curve_summary([r["step"] for r in tokens], [r["token_loss"] for r in tokens])
        if losses:
            report["loss"] = curve_summary([r["step"] for r in losses], [r["loss"] for r in losses])
        report["tokens"] = sum(r.get("tokens", 0) for r in records)
        report["categories"] = channel_summaries(records, "category_loss")
        report["sources"] = channel_summaries(records, "source_loss")
        names = list(report["categories"])
        evals = [r for r in records if _number(r.get("eval_loss"))]
        evaluated = [r for r in records if "eval_bins" in r]
        if evaluated:
            report["evaluations_without_targets"] = len(evaluated) - len(evals)
        if evals:
            report["eval"] = {"loss": curve_summary([r["step"] for r in evals], [r["eval_loss"] for r in evals]),
                              "categories": channel_summaries(evals, "eval_category_loss"),
                              "sources": channel_summaries(evals, "eval_source_loss"),
                              "bins": evals[-1].get("eval_bins"), "target_tokens": evals[-1].get("eval_target_tokens")}
        report["eval_sets"] = named_sets(records)
        report["test"] = info.get("test") or None
        report["perf"] = perf_summary(records)
        report["curves"] = curves(records)
        if target is not None:
            report["plot"] = draw_plot(target, records, names)
    return report


def named_sets(records: list[dict]) -> dict:
    """Each ``--eval`` set but ``valid`` (which is ``eval``, from the keys runs have always logged): its loss
    over the run (``curve_summary``), per category and per source, and its last evaluation's size."""
    names = sorted({k[len("eval/"):-len("/loss")] for r in records for k in r
                    if k.startswith("eval/") and k.endswith("/loss")} - {"valid"})
    out = {}
    for name in names:
        key = f"eval/{name}"
        rows = [r for r in records if _number(r.get(f"{key}/loss"))]
        if rows:
            out[name] = {"loss": curve_summary([r["step"] for r in rows], [r[f"{key}/loss"] for r in rows]),
                         "categories": channel_summaries(rows, f"{key}/category_loss"),
                         "sources": channel_summaries(rows, f"{key}/source_loss"),
                         "bins": rows[-1].get(f"{key}/bins"), "target_tokens": rows[-1].get(f"{key}/target_tokens")}
    return out


CURVE_POINTS = 2000  # points per series at most in ``curves``: enough for a page, small for any run length
CURVE_SERIES = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mfu_6n")  # MFUs: where the run knew its peak


def curves(records: list[dict]) -> dict:
    """The metrics.jsonl series over steps, as drawn by ``xprep inspect --html``: the training series of
    ``CURVE_SERIES`` that some record has a value of (a CPU run logs ``mfu`` as null), the channel losses
    (``None`` where a step has no such target), and the same of the evaluations under ``eval``. A long run
    keeps ``CURVE_POINTS`` evenly spaced steps (its first and last among them); evaluations are few and kept
    whole."""
    kept = thin(records, CURVE_POINTS)
    out = {"step": [r["step"] for r in kept]}
    out |= {key: [r.get(key) for r in kept] for key in CURVE_SERIES if any(r.get(key) is not None for r in records)}
    out["category_loss"] = channel_series(kept, "category_loss")
    out["source_loss"] = channel_series(kept, "source_loss")
    evals = [r for r in records if r.get("eval_loss") is not None]
    out["eval"] = {"step": [r["step"] for r in evals], "loss": [r["eval_loss"] for r in evals],
                   "category_loss": channel_series(evals, "eval_category_loss"),
                   "source_loss": channel_series(evals, "eval_source_loss")}
    return out


# per step, the first step (warm-up) left out of a longer run; mfu_6n: PaLM's and torchtitan's MFU (train/flops.py)
PERF_MEDIANS = ("tokens_per_s", "tflops", "mfu", "mfu_6n")
PERF_PEAKS = ("peak_mem_bytes", "peak_rss_bytes")  # the largest of any step


def perf_summary(records: list[dict]) -> dict:
    """Throughput over the run: the median of each of ``PERF_MEDIANS`` over the steps that have it (not the first
    of several: it includes warm-up and compilation), the largest of ``PERF_PEAKS``; None where no step has it."""
    steady = records[1:] if len(records) > 1 else records
    out: dict = {"steps": len(steady)}
    for key in PERF_MEDIANS:
        values = sorted(r[key] for r in steady if isinstance(r.get(key), int | float))
        out[key] = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2 if values else None
    for key in PERF_PEAKS:
        values = [r[key] for r in records if isinstance(r.get(key), int | float)]
        out[key] = max(values) if values else None
    return out


def thin(records: list[dict], points: int) -> list[dict]:
    """At most ``points`` records, evenly spaced, the first and the last included."""
    if len(records) <= points:
        return records
    step = (len(records) - 1) / (points - 1)
    return [records[round(i * step)] for i in range(points)]


def channel_series(records: list[dict], key: str) -> dict[str, list]:
    """Each name of the channel loss ``key``: its value at every record, ``None`` where it has none."""
    names = sorted({n for r in records for n in r.get(key) or {}})
    return {name: [(r.get(key) or {}).get(name) for r in records] for name in names}


def channel_summaries(records: list[dict], key: str) -> dict:
    """``curve_summary`` of each name of the channel loss ``key`` (``category_loss``, ...), over the records
    that have it."""
    out = {}
    for name in sorted({n for r in records for n in r.get(key) or {}}):
        pts = [(r["step"], r[key][name]) for r in records if name in (r.get(key) or {})]
        out[name] = curve_summary([s for s, _ in pts], [v for _, v in pts])
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise XprepError(f"{path}: not valid JSON ({e})") from None


def _checkpoints(path: Path) -> dict:
    root = path / "checkpoints"
    if not root.is_dir():
        return {"latest": None, "steps": []}
    steps = step_numbers(root)
    return {"latest": latest_name(root), "steps": steps, **_best(root, steps)}


def _best(root: Path, steps: list[int]) -> dict:
    """The checkpoint ``--keep`` keeps as the best, and by which loss (``best_step``, as train/checkpoint.py)."""
    states = {}
    for n in steps:
        with contextlib.suppress(OSError, json.JSONDecodeError):
            states[n] = json.loads((root / f"step-{n}" / TRAINER_JSON).read_text())
    best = best_step(states)
    if best is None:
        return {}
    step, key = best
    return {"best": f"step-{step}", "best_by": key, "best_loss": float(states[step][key])}


def check_plot_target(plot: str | Path) -> Path:
    """Fail before any work unless matplotlib imports and ``plot`` names a file that can be written."""
    out, shown = Path(plot), f"--plot {plot}"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise XprepError(f"{shown}: drawing needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install 'xprep[plot]')") from None
    if not out.is_dir() and out.suffix.lower() not in PLOT_FORMATS:  # a directory: said as such just below
        raise XprepError(f"{shown}: unknown image type {out.suffix!r}; name a .png, .pdf or .svg file")
    return check_output_file(out, "--plot", "image", PLOT)


def draw_plot(out: Path, records: list[dict], names: list[str]) -> str:
    """Loss over steps, overall and per category (and the validation loss), written atomically to ``out``."""
    import matplotlib  # optional (the plot extra): only --plot needs it

    matplotlib.use("Agg")  # no display: draw into files
    import matplotlib.pyplot as plt  # after use("Agg"), as matplotlib requires

    fig, ax = plt.subplots(figsize=(8, 4.5))
    losses = [(r["step"], r["loss"]) for r in records if _number(r.get("loss"))]  # steps without targets: no point
    ax.plot([s for s, _ in losses], [v for _, v in losses], label="all", color="black", lw=1.5)
    for name in names:
        pts = [(r["step"], r["category_loss"][name]) for r in records if name in r.get("category_loss", {})]
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=name, lw=1)
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], label="validation", color="black", lw=1.5, ls="--",
                marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    try:
        fig.savefig(tmp, dpi=100, format=PLOT_FORMATS[out.suffix.lower()])
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise XprepError(f"--plot {out}: cannot write it ({e.strerror}); choose another --plot") from None
    finally:
        plt.close(fig)
    return str(out)


def layout_text(dp: int, cp: int, cp_mode: str, ulysses: int, fsdp: bool) -> str:
    """A layout as a run's start line and its report say it, e.g. "1 DP × 4 CP (hybrid: 2 Ulysses × 2 ring),
    FSDP2": the CP mode only with CP; ``ulysses`` is the head-parallel factor U (``xprep.train.cp.ulysses_degree``)."""
    text = f"{dp} DP"
    if cp > 1:
        mode = f"{cp_mode}: {ulysses} Ulysses × {cp // ulysses} ring" if cp_mode == HYBRID else cp_mode
        text += f" × {cp} CP ({mode})"
    return text + (", FSDP2" if fsdp else "")


def run_layout(info: dict) -> str | None:
    """The layout and precision a run recorded in run.json; None when it has none (no run.json yet)."""
    if "dp" not in info:
        return None
    text = layout_text(info["dp"], info.get("cp", 1), info.get("cp_mode", OLD_CP_MODE), info.get("ulysses", 1),
                       bool(info.get("fsdp")))
    return text + (f", {info['precision']}" if info.get("precision") else "")


SETTINGS = ("model", "sampler", "lr", "schedule", "warmup")


def settings(config: dict) -> dict:
    """The settings a run summary shows, from its config.json whether flat or in sections."""
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for section, values in config.items():
        if isinstance(values, dict):
            flat.update(values)
            if "name" in values:  # the model section names the model
                flat[section] = values["name"]
    return {k: flat.get(k) for k in SETTINGS}
