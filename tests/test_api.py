"""The Python API (docs/api.md): the names the page documents are exactly ``xprep.__all__``, each with a docstring;
``import xprep`` loads neither torch nor numba; and the page's worked example runs as written (through the documented
names only) and yields the very micro-batches that ``xtrain run``'s own data path feeds its model on that rank.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import torch
import xprep
from conftest import REPO_ROOT
from xprep.train.config import TrainConfig
from xprep.train.dist import ParallelDims
from xprep.train.trainer import Trainer, prepare_run

API_DOC = REPO_ROOT / "docs" / "api.md"


def section(title: str) -> str:
    """The text of the page's ``## title`` section."""
    return API_DOC.read_text(encoding="utf-8").split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def documented_names() -> list[str]:
    """The names the page's table documents (its first column), in its order."""
    return re.findall(r"^\| `(\w+)` \|", section("Names"), re.M)


def example() -> str:
    """The worked example's Python code, as the page shows it."""
    [code] = re.findall(r"^```python\n(.*?)^```", section("A worked example"), re.M | re.S)
    return code


def test_the_documented_names_are_the_api():
    names = documented_names()
    assert len(names) >= 10 and xprep.__all__ == names
    missing = [name for name in names if not (getattr(xprep, name).__doc__ or "").strip()]
    assert not missing, f"API names without a docstring: {missing}"
    assert set(xprep.__all__) <= set(dir(xprep))


def test_import_xprep_is_cheap():
    """No torch nor numba at import, nor for the names of prep/ (tokenize and pack from a script load no torch)."""
    script = ("import sys, xprep\n"
              "heavy = lambda: sorted(m for m in ('torch', 'numba') if m in sys.modules)\n"
              "print(heavy())\n"
              "xprep.TokenizeConfig, xprep.TokenDataset, xprep.XprepError\n"
              "print(heavy())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout


def test_the_worked_example_yields_what_xtrain_run_feeds(tmp_path, tiny_tokenizer, monkeypatch):
    shutil.copytree(tiny_tokenizer, tmp_path / "tokenizer")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(example(), str(API_DOC), "exec"), scope)
    batches = scope["batches"]

    # The trainer's own data path on the same pack: rank 1 of dp 1 × cp 2, two micro-batches of 2 bins in its step
    cfg = TrainConfig.from_dict({"packed": "packed", "cp": 2, "micro_batch_size": 2, "global_batch_size": 4,
                                 "steps": 1, "output": str(tmp_path / "run")})
    dims = ParallelDims(dp=1, cp=2, world_size=2, rank=1)
    setup = prepare_run(cfg, dims)
    model, model_config = cfg.model.build(setup.dataset.vocab_size, cfg.seed)
    optimizer, scheduler = cfg.optimizer.build(model, setup.plan.steps)
    trainer = Trainer(model, optimizer, scheduler, setup.dataset, setup.sampler, dims, setup.plan.grad_accum,
                      torch.device("cpu"), model_config=model_config)
    fed, _, _ = trainer.next_micro_batches()

    assert len(batches) == len(fed) == 2
    for mine, theirs in zip(batches, fed, strict=True):
        assert mine.keys() == theirs.keys() and {"cp_inverse", "global_index"} <= mine.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
        assert mine["input_ids"].shape == (1, 256)  # this rank's half of 2 bins of 256 tokens
