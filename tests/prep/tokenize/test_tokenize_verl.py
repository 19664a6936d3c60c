"""Pre-tokenized records from VERL-style pipelines: ``--mask-convention`` reads ``loss_mask`` as its authors' trainer
did, checked where it matters (the trainer's labels), and ``--category-names`` names their numeric categories all
the way to the channel-loss table of ``xprep inspect RUN``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from prepkit import assert_same_files, tokenize, validate, write_jsonl
from xprep import cli
from xprep.prep.dataset import TokenDataset, merge_datasets
from xprep.prep.errors import XprepError
from xprep.prep.pack import PackConfig, pack
from xprep.train.data import PackedDataset

IGNORE = -100  # the labels of positions with no target (xprep.train.data)
VERL_EXAMPLE = {"input_ids": [100, 101, 102, 103, 104], "loss_mask": [0, 0, 1, 1, 1]}


def trained(packed) -> set[tuple[int, int, int, int]]:
    """What the trainer learns from a pack: (document, position in it, target token, category) for every position
    whose label is not IGNORE (each weighs one in the loss)."""
    data = PackedDataset(packed)
    out = set()
    for b in range(len(data)):
        _, docs, starts, _ = data.bins.items(b)
        assert not starts.any()  # whole documents: a position in the bin's item is a position in the document
        batch = {k: v[0].numpy() if v.dim() > 1 else v.numpy() for k, v in data[b].items()}
        at = np.flatnonzero(batch["labels"] != IGNORE)
        item = np.searchsorted(batch["cu_seqlens"], at, side="right") - 1
        out |= set(zip(docs[item].tolist(), batch["position_ids"][at].tolist(), batch["labels"][at].tolist(),
                       batch["category_ids"][at].tolist(), strict=True))
    return out


def tokenize_and_pack(records, tmp_path, tokenizer, name: str, **options):
    tokenize(write_jsonl(tmp_path / f"{name}.jsonl", records), tmp_path / name, tokenizer, **options)
    pack([tmp_path / name], tmp_path / f"{name}-packed", PackConfig(method="sequential", seq_len=64))
    return tmp_path / f"{name}-packed"


# -- the convention, at the trainer's labels ---------------------------------------------------------------------
@pytest.mark.parametrize("convention, tokens", [("target", [102, 103, 104]), ("prediction", [103, 104])])
def test_the_verl_example_trains_what_each_convention_says(tmp_path, tiny_tokenizer, convention, tokens):
    """input_ids [100..104], loss_mask [0,0,1,1,1]: this project's reading trains 102-104; VERL's (prediction)
    trains exactly 103 and 104."""
    packed = tokenize_and_pack([VERL_EXAMPLE], tmp_path, tiny_tokenizer, convention, mask_convention=convention)
    assert sorted(token for _, _, token, _ in trained(packed)) == tokens


def verl_records(rng, n: int) -> list[dict]:
    """Random ids, masks (first and last positions set too) and categories; some records without a mask or
    categories, some of one token."""
    out = []
    for i in range(n):
        length = 1 if i % 10 == 3 else int(rng.integers(2, 40))
        r = {"input_ids": rng.integers(0, 600, length).tolist()}
        if i % 5 != 1:
            r["loss_mask"] = rng.integers(0, 2, length).tolist()
        if i % 4 != 2:
            r["category_ids"] = rng.integers(0, 9, length).tolist()
        out.append(r)
    return out


def verl_trains(records, weights) -> set[tuple[int, int, int, int]]:
    """VERL's SFT loss restated: ``labels = input_ids[:, 1:]`` against the logits of positions ``:-1``, weighed by
    ``weights(loss_mask)`` (an absent mask: all ones); position t's category is the record's at t for its prediction
    (``[:, :-1]``), at t + 1 for its target (``[:, 1:]``), whichever the weights read."""
    out = set()
    for d, r in enumerate(records):
        ids = np.array(r["input_ids"])
        n = len(ids)
        mask = np.array(r.get("loss_mask", [1] * n))
        cats = np.array(r.get("category_ids", [0] * n))
        labels, w, c = ids[1:], weights(mask), weights(cats)
        out |= {(d, t, int(labels[t]), int(c[t])) for t in np.flatnonzero(w)}
    return out


@pytest.mark.parametrize("convention, weights", [
    ("prediction", lambda m: m[:-1]),  # VERL's fsdp_sft_trainer up to 0.5: loss_mask[:, :-1]
    ("target", lambda m: m[1:]),  # since 0.6: loss_mask[:, 1:] (its sft_loss rolls the mask by -1 the same way)
])
def test_the_trainer_learns_what_verl_learns_on_random_records(tmp_path, tiny_tokenizer, convention, weights):
    records = verl_records(np.random.default_rng(34), 30)
    packed = tokenize_and_pack(records, tmp_path, tiny_tokenizer, convention, mask_convention=convention)
    expected = verl_trains(records, weights)
    assert len(expected) > 100
    assert trained(packed) == expected


# -- the manifest ------------------------------------------------------------------------------------------------
def test_the_manifest_records_the_convention_and_merge_refuses_a_mix(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", [VERL_EXAMPLE, {"input_ids": [7, 8, 9], "loss_mask": [1, 1, 0]}])
    default = tokenize(p, tmp_path / "default", tiny_tokenizer)
    verl = tokenize(p, tmp_path / "verl", tiny_tokenizer, mask_convention="prediction")
    assert verl["options"]["mask_convention"] == "prediction"
    assert "mask_convention" not in default["options"]  # absent (every dataset made before the option): target
    assert verl["fingerprint"] != default["fingerprint"]
    assert TokenDataset(tmp_path / "verl").loss_mask.items.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert verl["counts"]["loss_tokens"] == 4 and default["counts"]["loss_tokens"] == 4  # (9's first token: never)
    validate(verl, "dataset")
    with pytest.raises(XprepError, match=r"default: its options differs from .*verl's \(at mask_convention: absent "
                                         r'\(the default\) here, "prediction" there\)'):
        merge_datasets([str(tmp_path / "verl"), str(tmp_path / "default")], str(tmp_path / "mixed"))
    assert not (tmp_path / "mixed").exists()


def test_the_convention_is_refused_where_no_record_is_pre_tokenized(tmp_path, tiny_tokenizer):
    p = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    for fmt in ("text", "chat"):
        with pytest.raises(XprepError, match=f"--mask-convention prediction is for pre-tokenized records, which "
                                             f"--format {fmt} never reads"):
            tokenize(p, tmp_path / fmt, tiny_tokenizer, format=fmt, mask_convention="prediction")


# -- category names ----------------------------------------------------------------------------------------------
def names_file(tmp_path, names: dict, name: str = "names.json"):
    path = tmp_path / name
    path.write_text(json.dumps(names))
    return path


def test_category_names_reach_the_channel_loss_table_of_inspect_run(tmp_path, tiny_tokenizer):
    """Ids 1 and 2 named by the file, 7 left out (it keeps its number); every bin holds all three."""
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(0, 600, 30).tolist(), "category_ids": [1] * 10 + [2] * 10 + [7] * 10}
               for _ in range(8)]
    packed = tokenize_and_pack(records, tmp_path, tiny_tokenizer, "named",
                               category_names=str(names_file(tmp_path, {"1": "math", 2: "code"})))
    m = TokenDataset(tmp_path / "named").manifest
    assert m["categories"][1:3] == ["math", "code"] and m["categories"][7] == "7"
    assert m["options"]["category_names"] == {"1": "math", "2": "code"}
    validate(m, "dataset")
    run = tmp_path / "run"
    result = CliRunner().invoke(cli.xtrain, ["run", str(packed), "--steps", "2", "--output", str(run)])
    assert result.exit_code == 0, (result.output, result.exception)
    shown = CliRunner().invoke(cli.xprep, ["inspect", str(run)])
    assert shown.exit_code == 0, shown.output
    table = shown.output.split("training loss", 1)[1]
    rows = {line.split()[0] for line in table.splitlines() if re.match(r"^\S+ +2 ", line)}  # name, 2 points, ...
    assert rows == {"all", "math", "code", "7"}, table


def test_named_numeric_categories_keep_their_ids_through_shards_and_merge(tmp_path, tiny_tokenizer):
    records = [{"input_ids": [5, 6, 7], "category_ids": [c, c, c]} for c in (7, 3, 1, 3, 7, 1) * 4]
    p = write_jsonl(tmp_path / "a.jsonl", records)
    names = str(names_file(tmp_path, {"3": "code", "1": "math"}))
    single = tokenize(p, tmp_path / "single", tiny_tokenizer, category_names=names)
    for i in range(2):
        tokenize(p, tmp_path / f"s{i}", tiny_tokenizer, category_names=names, num_shards=2, shard_index=i)
    merge_datasets([str(tmp_path / "s0"), str(tmp_path / "s1")], str(tmp_path / "merged"))
    assert_same_files(tmp_path / "merged", tmp_path / "single")
    assert single["categories"] == ["uncategorized", "math", None, "code", None, None, None, "7"]


BAD_NAMES = {
    "not JSON": ('{"1": "math",', "not valid JSON"),
    "not an object": ('["math", "code"]', "holds an array, expected one object of id → name"),
    "a non-integer id": ('{"math": "1"}', "key 'math' is not a category id"),
    "a negative id": ('{"-1": "math"}', "key '-1' is not a category id"),
    "id 0": ('{"0": "math"}', "id 0 is out of range 1..65,535 (0 is uncategorized"),
    "an id past uint16": ('{"65536": "math"}', "id 65536 is out of range 1..65,535"),
    "an id given twice": ('{"1": "math", "01": "code"}', "id 1 is named twice ('math' and 'code')"),
    "a duplicate name": ('{"1": "math", "2": "math"}', "ids 1 and 2 are both named 'math'"),
    "a name that is a number": ('{"1": "2"}', "id 1 cannot be named '2', the name of id 2"),
    "an empty name": ('{"1": " "}', "the name of id 1 is ' ', expected a non-empty string"),
    "a name that is no string": ('{"1": {"n": 1}}', "the name of id 1 is an object, expected a non-empty string"),
}


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_a_bad_category_names_file_is_one_line(tmp_path, tiny_tokenizer, case):
    text, message = BAD_NAMES[case]
    bad = tmp_path / "names.json"
    bad.write_text(text)
    p = write_jsonl(tmp_path / "a.jsonl", [VERL_EXAMPLE])
    result = CliRunner().invoke(cli.xprep, ["tokenize", str(p), "-o", str(tmp_path / "o"), "--tokenizer",
                                            str(tiny_tokenizer), "--category-names", str(bad)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: --category-names {bad}: {message}"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "o").exists()
