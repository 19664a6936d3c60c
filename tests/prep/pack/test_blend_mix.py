"""The path a user takes to build an SFT + continued-pretraining mix (issue 29), on real data: a chat set with long
pasted user turns (chitchat conversations, some prefixed with a State of the Union address) and a text corpus (State of
the Union addresses), Qwen3's tokenizer, blended 70/30 with a held-out split.

What must hold: a cut source gives a seeded random subset of its bins (its piece lengths distributed as the source's,
by a two-sample test), never the head of its packing; no bin, and so no step, lacks a target token; shares are counted
and reported in target tokens; each source can choose its own method and overlong policy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED, requires_shared_data
from prepkit import one_line_error, tokenize, write_jsonl, xprep_invoke
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.mixture import BlendEntry
from xprep.train.data import IGNORE, PackedDataset

pytestmark = requires_shared_data
SEQ = 2048
TEXT_FILES = 60  # of the 233 addresses: a text source small enough that the chat source is cut
LONG_TURNS = 0.15  # conversations whose first user turn is a pasted address (thousands of tokens)


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> dict[str, Path]:
    """Two token datasets of Qwen3: ``text`` (addresses, no loss mask) and ``chat`` (conversations, some long)."""
    root = tmp_path_factory.mktemp("mix")
    qwen = SHARED / "tokenizers" / "qwen3"
    addresses = sorted((SHARED / "corpora" / "sotu").glob("*.txt"))
    read = [p.read_text(encoding="utf-8", errors="replace") for p in addresses[:TEXT_FILES]]
    # Whole addresses (longer than a bin: split by default) and the paragraphs of others (short documents).
    sentences = [a.split(". ") for a in read[TEXT_FILES // 4:]]  # each address is one line: cut every 4 sentences
    texts = read[:TEXT_FILES // 4] + [". ".join(s[i:i + 4]) for s in sentences for i in range(0, len(s), 4)
                                      if "".join(s[i:i + 4]).strip()]
    write_jsonl(root / "text.jsonl", [{"text": t} for t in texts])
    rng = random.Random(0)
    pasted = [p.read_text(encoding="utf-8", errors="replace") for p in addresses[TEXT_FILES:TEXT_FILES + 60]]
    records = []
    for line in (SHARED / "chat" / "chitchat.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        messages = record["messages"]
        if rng.random() < LONG_TURNS and messages and messages[0]["role"] == "user":
            document = rng.choice(pasted)
            start = rng.randrange(max(1, len(document) - 30_000))
            messages[0] = {"role": "user", "content": "Summarize this:\n" + document[start:start + rng.randrange(
                10_000, 30_000)] + "\n" + messages[0]["content"]}
        records.append({"messages": messages})
    write_jsonl(root / "chat.jsonl", records)
    tokenize(root / "text.jsonl", root / "text", qwen, eod_token="<|endoftext|>")
    tokenize(root / "chat.jsonl", root / "chat", qwen, on_error="skip")
    return {"text": root / "text", "chat": root / "chat", "root": root}


def blend(mix: dict[str, Path], out: Path, seed: int = 0, options: list[dict] | None = None, **config):
    config = PackConfig(method="multipack", seq_len=SEQ, seed=seed, split=(95, 5), **config)
    return pack([mix["text"], mix["chat"]], out, config, weights=[0.7, 0.3],
                source_options=options or [{}, {"overlong": "split"}])


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical distributions."""
    grid = np.unique(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def ks_critical(n: int, m: int, c_alpha: float = 1.95) -> float:
    """The statistic's bound at α = 0.001 (c(α) = sqrt(-ln(α/2)/2) ≈ 1.95) for samples of n and m."""
    return c_alpha * np.sqrt((n + m) / (n * m))


def per_bin(entry) -> tuple[np.ndarray, np.ndarray]:
    """The longest piece and the number of pieces of each bin of a pack entry."""
    offsets, lengths = np.asarray(entry.bin_offsets), np.asarray(entry.item_len)
    return np.maximum.reduceat(lengths, offsets[:-1]), np.diff(offsets)


def test_a_cut_source_gives_a_seeded_random_subset_of_its_bins(mix, tmp_path):
    out = blend(mix, tmp_path / "P")
    entry = out.entry
    chat = entry.meta["sources"][1]
    assert chat["bins"] < chat["bins_available"]  # the chat source is cut ...
    assert "random subset" in chat["drawn"] and "--seed 0" in chat["drawn"]  # ... and the report says how
    source = out.sources[1].entry
    taken = np.flatnonzero(np.asarray(entry.bin_source) == 1)
    chosen = np.asarray(entry.bin_index)[taken]
    assert len(np.unique(chosen)) == len(chosen)  # each bin once
    assert not np.array_equal(np.sort(chosen), np.arange(len(chosen)))  # not the head of the packing
    # The chosen bins against all the source's, bin by bin (bins are drawn, so bins are the independent samples):
    # the longest piece of each bin (first-fit-decreasing puts the longest first) and the pieces it holds.
    longest, pieces = per_bin(source)
    for values in (longest, pieces):
        assert ks_statistic(values[chosen], values) < ks_critical(len(chosen), source.num_bins)
    assert abs(longest[chosen].mean() / longest.mean() - 1) < 0.15
    # The old rule, the first bins of the packing, fails the same test: it has the power to see the difference.
    head = np.arange(len(chosen))
    assert ks_statistic(longest[head], longest) > ks_critical(len(chosen), source.num_bins)
    # Same seed, same subset; another seed, another subset.
    again = blend(mix, tmp_path / "again").entry
    assert np.array_equal(again.bin_index, entry.bin_index) and np.array_equal(again.bin_source, entry.bin_source)
    other = blend(mix, tmp_path / "other", seed=1).entry
    assert not np.array_equal(np.sort(np.asarray(other.bin_index)[np.asarray(other.bin_source) == 1]),
                              np.sort(chosen))


def test_no_bin_and_so_no_step_lacks_a_target_and_untrained_pieces_are_counted(mix, tmp_path):
    out = blend(mix, tmp_path / "P")
    chat = out.sources[1].entry
    dropped = chat.meta["stats"]["no_target"]
    assert dropped["pieces"] > 0 and dropped["tokens"] > 0  # the pasted turns' pieces before the answer
    for entry in (out.entry, out.validation):
        data = PackedDataset(entry.path)
        for b in range(len(data)):
            assert int((data[b]["labels"] != IGNORE).sum()) > 0, f"bin {b} of {entry.path} has no target"
    for part in out.sources:
        assert (np.asarray(part.entry.bin_targets) > 0).all()


def test_shares_are_counted_and_reported_in_target_tokens(mix, tmp_path):
    out = blend(mix, tmp_path / "P")
    meta = out.entry.meta
    assert meta["size"]["unit"] == "target tokens"
    data = PackedDataset(out.entry.path)
    targets = np.zeros(2)
    for b in range(len(data)):
        batch = data[b]
        learned = batch["labels"] != IGNORE
        targets[int(batch["source_ids"][0, 0])] += int(learned.sum())
    delivered = targets / targets.sum()
    for row, want, got in zip(meta["sources"], (0.7, 0.3), delivered, strict=True):
        assert row["delivered_share"] == pytest.approx(got, abs=1e-9)  # what it says is what the trainer learns
        assert abs(got - want) < 2 * SEQ / targets.sum()  # within a bin or two of the weight
        assert row["target_tokens"] == row["delivered_tokens"]
    assert meta["sources"][1]["documents_delivered"] < meta["sources"][1]["documents"]


def test_text_defaults_to_split_and_each_source_sets_its_own_options(mix, tmp_path):
    out = blend(mix, tmp_path / "P", options=[{}, {}])  # multipack without --overlong: text split, chat dropped
    text, chat = (s.entry for s in out.sources)
    assert text.config["overlong"] == "split" and text.meta["stats"]["dropped_tokens"] == 0
    assert chat.config["overlong"] == "drop" and chat.meta["stats"]["dropped_documents"] > 0
    out = blend(mix, tmp_path / "Q", options=[{"method": "sequential"}, {"overlong": "truncate"}])
    text, chat = (s.entry for s in out.sources)
    assert (text.config["method"], text.config["overlong"]) == ("sequential", "split")
    assert (chat.config["method"], chat.config["overlong"]) == ("multipack", "truncate")
    assert out.entry.config["method"] == "sequential+multipack"
    out = blend(mix, tmp_path / "R", options=[{}, {}], overlong="drop")  # the command's choice holds for all
    assert [s.entry.config["overlong"] for s in out.sources] == ["drop", "drop"]


def test_the_command_line_takes_per_source_options_and_warns_about_a_cut(mix, tmp_path):
    text, chat, root = mix["text"], mix["chat"], mix["root"]
    result = xprep_invoke("pack", f"{text}@0.7", f"{chat}@0.3:overlong=split", "-o", tmp_path / "P",
                          "--method", "multipack", "--seq-len", SEQ, "--split", "95,5")
    assert result.exit_code == 0, result.output
    entry = BlendEntry.open(tmp_path / "P" / json.loads((tmp_path / "P" / "manifest.json").read_text())["current"])
    fraction = entry.meta["sources"][1]["bins"] / entry.meta["sources"][1]["bins_available"]
    assert fraction < 0.5
    assert f"source 'chat' is cut to {100 * fraction:.1f} % of its bins" in result.output
    assert "--total-tokens or --epochs to use more" in result.output
    shown = xprep_invoke("inspect", tmp_path / "P", "--html", tmp_path / "page.html")  # inspect says it too
    assert shown.exit_code == 0 and "source 'chat' is cut to" in shown.stdout, shown.output
    assert "a seeded random subset" in shown.stdout and "shares count target tokens" in shown.stdout
    assert "source &#x27;chat&#x27; is cut to" in (tmp_path / "page.html").read_text() or \
        "source 'chat' is cut to" in (tmp_path / "page.html").read_text()
    mix_file = root / "mix.json"
    mix_file.write_text(json.dumps({"sources": [{"dataset": str(text), "weight": 0.7, "method": "sequential"},
                                                {"dataset": str(chat), "weight": 0.3, "overlong": "split"}]}))
    result = xprep_invoke("pack", "--mix", mix_file, "-o", tmp_path / "M", "--method", "multipack", "--seq-len", SEQ)
    assert result.exit_code == 0, result.output
    for args, want in [
        ((f"{text}@abc",), "'abc' is not a number"),
        ((f"{text}@0.7:overlong=sometimes", f"{chat}@0.3"), "overlong 'sometimes' is unknown"),
        ((f"{text}@0.7:size=3", f"{chat}@0.3"), "unknown option 'size'"),
        ((f"{text}@0.7:method=chunk", f"{chat}@0.3"), "cannot mix --method chunk with multipack"),
    ]:
        result = xprep_invoke("pack", *args, "-o", tmp_path / "E", "--method", "multipack", "--seq-len", SEQ)
        assert result.exit_code == 2 and want in one_line_error(result), result.output
