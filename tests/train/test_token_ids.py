"""Token ids beyond the vocabulary (issue 31): ``xprep tokenize`` sets such pre-tokenized records aside as bad, every
dataset records its largest id (``counts.max_token_id``), and ``xtrain run`` refuses data whose ids its model's
embedding cannot look up, with one line, before any process group, instead of an IndexError mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from prepkit import one_line_error, tokenize, write_jsonl
from test_train_run import user_error
from trainkit import make_dataset
from xprep import cli
from xprep.prep.dataset.token_dataset import TokenDataset

PACK = ["--method", "sequential", "--seq-len", "64"]


def _records(top: int) -> list[dict]:
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(5, 500, int(n)).tolist()} for n in rng.integers(8, 40, 30)]
    records[7]["input_ids"][3] = top
    return records


def test_pre_tokenized_ids_beyond_the_vocabulary(tmp_path, tiny_tokenizer):
    """Through ``xprep tokenize`` → ``xprep pack`` → ``xtrain run``: an id ≥ the tokenizer's 600 is a bad record
    (fail: one line; skip: set aside, the dataset's largest id stays inside); a dataset made without that check (by
    another tool, or by hand) is refused by ``xtrain run``, its largest id read from the manifest or, for a manifest
    that predates the field, from the stream."""
    src = write_jsonl(tmp_path / "pre.jsonl", _records(700))
    line = one_line_error(CliRunner().invoke(cli.xprep, ["tokenize", str(src), "-o", str(tmp_path / "bad"),
                                                         "--tokenizer", str(tiny_tokenizer)]))
    assert f"{src}:8: input_ids outside [0, 600)" in line, line
    kept = tokenize(src, tmp_path / "ds", tiny_tokenizer, on_error="skip")
    assert kept["rejects"]["count"] == 1 and kept["counts"]["max_token_id"] < 600
    assert kept["counts"]["max_token_id"] == int(TokenDataset(tmp_path / "ds").tokens.items.max())

    docs = [np.asarray(r["input_ids"]) for r in _records(700)]  # a dataset whose writer did not check the ids
    assert make_dataset(tmp_path / "other", docs, vocab_size=600)["counts"]["max_token_id"] == 700
    packed = tmp_path / "p"
    assert CliRunner().invoke(cli.xprep, ["pack", str(tmp_path / "other"), "-o", str(packed), *PACK]).exit_code == 0
    line = user_error(str(packed), "--steps", "1", "-o", str(tmp_path / "run"))
    assert f"{tmp_path / 'other'}: holds token id 700, but --model tiny has a vocabulary of 600 ids" in line, line
    assert "re-tokenize" in line, line

    manifest_path = tmp_path / "other" / "manifest.json"  # as an xprep before max_token_id wrote it
    manifest = json.loads(manifest_path.read_text())
    del manifest["counts"]["max_token_id"]
    manifest_path.write_text(json.dumps(manifest))
    assert TokenDataset(tmp_path / "other").max_token_id == 700
    line = user_error(str(packed), "--steps", "1", "-o", str(tmp_path / "run"))
    assert "holds token id 700, but --model tiny has a vocabulary of 600 ids" in line, line


def test_a_model_with_a_larger_vocabulary_takes_the_ids(tmp_path):
    """The bound is the model's vocabulary, not the tokenizer's: a JSON model config with a larger vocab_size
    (padded, as Megatron pads) trains on the same data."""
    docs = [np.asarray(r["input_ids"]) for r in _records(700)]
    make_dataset(tmp_path / "other", docs, vocab_size=600)
    assert CliRunner().invoke(cli.xprep, ["pack", str(tmp_path / "other"), "-o", str(tmp_path / "p"),
                                          *PACK]).exit_code == 0
    model = Path(tmp_path / "model.json")
    model.write_text(json.dumps({"vocab_size": 768, "dim": 32, "n_layers": 1, "n_heads": 2}))
    result = CliRunner().invoke(cli.xtrain, ["run", str(tmp_path / "p"), "--model", str(model), "--steps", "1",
                                             "-o", str(tmp_path / "run"), "--log-every", "100"])
    assert result.exit_code == 0, (result.output, result.exception)
