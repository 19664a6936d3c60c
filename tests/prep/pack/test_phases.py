"""Phased mix files: a mix file's ``phases:`` make one blend whose bins run phase after phase, each
phase following its own weights by Megatron's greedy rule, each source continuing its own order of bins where the
previous phase left it. On real data (State of the Union paragraphs and raw e-mails, Mistral's tokenizer), and the
kernel against a slow obvious reference."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import SHARED, requires_shared_data
from prepkit import web_and_mail
from xprep.prep.errors import XprepError
from xprep.prep.pack import blend
from xprep.prep.pack.blend import blend_bins, epoch_seed, phased_blend
from xprep.prep.pack.cache import PackConfig, pack
from xprep.prep.pack.mixture import bin_tokens
from xprep.prep.pack.shuffle import shuffled_order

SEQ = 256
TWO_PHASES = [{"bins": 400, "weights": {"web": 0.8, "mail": 0.2}},
              {"tokens": 600 * SEQ, "weights": {"web": 0.3, "mail": 0.7}}]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return web_and_mail(SHARED, tmp_path_factory.mktemp("phases"))


def write_mix(path: Path, data: dict[str, Path], phases: list[dict], weights: dict | None = None) -> Path:
    sources = [{"dataset": str(data[n]), "name": n, **({"weight": weights[n]} if weights else {})}
               for n in ("web", "mail")]
    path.write_text(json.dumps({"sources": sources, **({"phases": phases} if phases else {})}))
    return path


def phased_pack(data, out: Path, phases: list[dict], **config):
    mix = write_mix(out.parent / f"{out.name}.json", data, phases)
    return pack([], out, PackConfig(method="multipack", seq_len=SEQ, **config), mix=str(mix)).entry


@requires_shared_data
def test_a_two_phase_mix_delivers_each_phases_shares_in_order(data, tmp_path):
    entry = phased_pack(data, tmp_path / "P", TWO_PHASES)
    phases = entry.meta["phases"]
    assert [(p["start_bin"], p["bins"]) for p in phases] == [(0, 400), (400, 600)]
    assert entry.num_bins == 1000
    real = [bin_tokens(s) for s in entry.sources]  # the real (non-padding) tokens of every bin, read from the arrays
    for p, asked in zip(phases, TWO_PHASES, strict=True):
        part = slice(p["start_bin"], p["start_bin"] + p["bins"])
        source, index = entry.bin_source[part], entry.bin_index[part]
        tokens = np.array([real[s][i] for s, i in zip(source, index, strict=True)], np.int64)
        for i, name in enumerate(entry.source_names):
            want = asked["weights"][name]
            assert abs(tokens[source == i].sum() / tokens.sum() - want) < 0.01, (p["phase"], name)  # real tokens
            assert abs(np.mean(source == i) - want) < 0.01  # and bins (each worth its capacity)
            row = next(r for r in p["sources"] if r["name"] == name)
            assert row["requested_share"] == want and row["delivered_share"] == pytest.approx(np.mean(source == i))
            assert row["real_tokens"] == tokens[source == i].sum()


@requires_shared_data
def test_each_phase_follows_megatrons_rule_and_each_source_goes_on_where_it_stopped(data, tmp_path):
    entry = phased_pack(data, tmp_path / "P", TWO_PHASES, seed=3)
    counts = [s.num_bins for s in entry.sources]
    first = blend_bins(counts, np.array([0.8, 0.2]), SEQ, 400 * SEQ, seed=3)
    assert np.array_equal(entry.bin_source[:400], first.bin_source)  # phase 1: the blend of its weights, bin for bin
    second = blend_bins(counts, np.array([0.3, 0.7]), SEQ, 600 * SEQ, seed=3)
    assert np.array_equal(entry.bin_source[400:], second.bin_source)  # phase 2 starts the rule afresh
    for i, n in enumerate(counts):
        taken = entry.bin_index[entry.bin_source == i]
        assert len(taken) < n  # the whole mix takes less than an epoch of each source: a seeded random subset ...
        assert len(np.unique(taken)) == len(taken)  # ... and phase 2 serves none of phase 1's bins again
        stream = shuffled_order(n, epoch_seed(3, i, 0))  # the source's own order of bins, phase after phase
        assert np.array_equal(taken, stream[:len(taken)])
        row = [next(r for r in p["sources"] if r["name"] == entry.source_names[i]) for p in entry.meta["phases"]]
        assert row[0]["to_position"] == row[1]["from_position"] == np.sum(entry.bin_source[:400] == i)


@requires_shared_data
def test_a_phase_sized_in_epochs_of_a_source_and_a_source_left_out(data, tmp_path):
    phases = [{"epochs": 1, "source": "mail", "weights": {"mail": 1}},
              {"bins": 50, "weights": {"web": 1, "mail": 0}}]
    entry = phased_pack(data, tmp_path / "P", phases)
    mail = entry.source_names.index("mail")
    n_mail = entry.sources[mail].num_bins
    assert entry.meta["phases"][0]["bins"] == n_mail and entry.meta["phases"][1]["start_bin"] == n_mail
    assert np.array_equal(np.sort(entry.bin_index[:n_mail]), np.arange(n_mail))  # one epoch: every bin once
    assert np.all(entry.bin_source[n_mail:] != mail) and entry.num_bins == n_mail + 50


@requires_shared_data
def test_a_mix_without_phases_is_the_blend_it_was(data, tmp_path):
    weights = {"web": 0.6, "mail": 0.4}
    mix = write_mix(tmp_path / "mix.json", data, [], weights)
    config = PackConfig(method="multipack", seq_len=SEQ)
    by_file = pack([], tmp_path / "P", config, mix=str(mix)).entry
    by_args = pack([data["web"], data["mail"]], tmp_path / "Q", config, weights=[0.6, 0.4]).entry
    assert by_file.key == by_args.key and "phases" not in by_file.meta


@pytest.mark.parametrize(("phase", "says"), [
    ({"tokens": 10, "bins": 3, "weights": {"web": 1}}, "give exactly one size"),
    ({"epochs": 1, "weights": {"web": 1}}, "`source:` names the source whose `epochs:`"),
    ({"tokens": 10, "weights": {"blog": 1}}, "weights name 'blog', which is no source of the mix"),
    ({"tokens": 10, "weights": {"web": 0}}, "every weight is 0"),
    ({"tokens": 0, "weights": {"web": 1}}, "must be a positive number"),
    ({"epochs": 1, "source": "mail", "weights": {"web": 1}}, "which has no weight in this phase"),
])
def test_a_wrong_phase_is_one_error_naming_it(tmp_path, phase, says):
    from prepkit import random_dataset
    data = {n: random_dataset(tmp_path / n, 5, i) for i, n in enumerate(("web", "mail"))}
    mix = write_mix(tmp_path / "mix.json", data, [{"tokens": 100, "weights": {"web": 1}}, phase])
    with pytest.raises(XprepError, match="phase #2: ") as e:
        pack([], tmp_path / "P", PackConfig(method="multipack", seq_len=64), mix=str(mix))
    assert says in str(e.value)


def test_a_source_without_weight_needs_phases(tmp_path):
    from prepkit import random_dataset
    data = {n: random_dataset(tmp_path / n, 5, i) for i, n in enumerate(("web", "mail"))}
    mix = write_mix(tmp_path / "mix.json", data, [])
    with pytest.raises(XprepError, match=r"source #1 \(.*web\): the weight None must be a positive number"):
        pack([], tmp_path / "P", PackConfig(method="multipack", seq_len=64), mix=str(mix))


# ------------------------------------------------------------------------------------------------ kernel
def reference_phases(sizes: list[np.ndarray | int], weights: np.ndarray, totals: list[int], unit: int, seed: int,
                     max_bins: list[int | None] | None = None, orders: list[np.ndarray | None] | None = None):
    """The slow obvious phased blend: per phase, Megatron's rule from a fresh start over the phase's sources
    (argmax w·max(T, unit) − t, in float64, ties to the lowest index), until the phase's total is delivered or its
    ``max_bins`` bins are taken; each source's next bin is the next of its stream (its pack order or ``orders[i]``,
    then seeded permutations), wherever the previous phase left it. Sources given as bin counts (every one of
    them) run the rule on counts: each bin counts 1, unit 1, a phase ends at ⌈total / unit⌉ bins. A phase's
    weights are normalized twice, as the blend does (the phase's shares, then once more as any blend's weights):
    an ulp can decide a tie."""
    counted = all(isinstance(s, int) for s in sizes)
    sizes = [np.full(s, unit) if isinstance(s, int) else s for s in sizes]
    firsts = orders or [None] * len(sizes)
    streams = [list(np.arange(len(s)) if first is None else first) for s, first in zip(sizes, firsts, strict=True)]
    at, out = [0] * len(sizes), []
    for p, (w, total) in enumerate(zip(weights, totals, strict=True)):
        cap = (max_bins or [None] * len(totals))[p]
        end = -(-total // unit) if counted else total
        active = [i for i in range(len(sizes)) if w[i] > 0]
        share = np.array([w[i] for i in active]) / w[active].sum()
        share = share / share.sum()
        delivered, scale, taken = np.zeros(len(active)), 0.0, 0
        while taken < cap if cap is not None else scale < end:
            best, best_lag = 0, None
            for j in range(len(active)):
                lag = share[j] * max(scale, 1 if counted else unit) - delivered[j]
                if best_lag is None or lag > best_lag:
                    best, best_lag = j, lag
            i = active[best]
            if at[i] == len(streams[i]):  # the stream's next epoch: a fresh permutation
                streams[i].extend(shuffled_order(len(sizes[i]), epoch_seed(seed, i, at[i] // len(sizes[i]))))
            b = int(streams[i][at[i]])
            at[i] += 1
            out.append((i, b))
            size = 1 if counted else sizes[i][b]
            delivered[best] += size
            scale += size
            taken += 1
    return out


def test_phased_blend_matches_the_slow_reference():
    rng = np.random.default_rng(7)
    sizes = [rng.integers(3, 9, n).astype(np.int32) for n in (40, 15, 25)]
    weights = np.array([[0.6, 0.4, 0.0], [0.1, 0.2, 0.7], [0.0, 0.9, 0.1]])
    totals = [300, 250, 400]  # source 1 runs through more than two epochs
    got = phased_blend(sizes, weights, totals, 8, seed=5)
    pairs = list(zip(got.blend.bin_source.tolist(), got.blend.bin_index.tolist(), strict=True))
    assert pairs == reference_phases(sizes, weights, totals, 8, seed=5)
    assert got.starts.tolist()[1:] == np.cumsum(got.bins.sum(axis=1)).tolist()
    assert got.blend.epochs.tolist() == np.maximum(1, -(-got.positions[-1] // [40, 15, 25])).tolist()


def random_phases(rng: np.random.Generator, counted: bool) -> tuple:
    """A few sources of 5-30 bins (sizes, or counts), 2-4 phases sized in tokens, in bins or in epochs of a source,
    with zero weights, and some sources' first epochs in a random order: the phases run sources through several
    epochs, mid-phase."""
    k, unit, phases = int(rng.integers(2, 5)), 8, int(rng.integers(2, 5))
    counts = rng.integers(5, 30, k)
    sizes = [int(n) if counted else rng.integers(1, unit + 1, n).astype(np.int32) for n in counts]
    weights = np.round(rng.random((phases, k)) * (rng.random((phases, k)) < 0.7), 2)
    weights[weights.sum(axis=1) == 0, 0] = 0.5
    totals, max_bins = [], []
    for row in weights:
        size = rng.integers(3)  # tokens, bins, epochs of the phase's first source
        i = int(np.flatnonzero(row)[0])
        units = int(counts[i]) * unit if counted else int(np.sum(sizes[i]))
        totals.append(int(rng.integers(1, 120)) * unit if size < 2 else round(units * row.sum() / row[i]))
        max_bins.append(totals[-1] // unit if size == 1 else None)
    orders = [shuffled_order(int(n), 11 + i) if rng.random() < 0.3 else None for i, n in enumerate(counts)]
    return sizes, weights, totals, unit, max_bins, orders


@pytest.fixture(params=["as is", "in two parts", "epochs permuted late", "too few epochs planned"])
def path(request, monkeypatch) -> list | None:
    """Each way a phase runs, forced on blends of a few hundred bins; yields what was seen on that path (the parts
    that met, the waits for a later epoch, the streams laid out again), None on the plain one."""
    return {"as is": lambda m: None, "in two parts": in_two_parts, "epochs permuted late": permuted_late,
            "too few epochs planned": too_few_epochs}[request.param](monkeypatch)


def in_two_parts(monkeypatch) -> list[bool]:
    """Every phase of 20 bins or more runs in two parts (as one of 4M bins does once every epoch is permuted)."""
    monkeypatch.setattr(blend, "SPLIT_MIN_BINS", 20)
    monkeypatch.setattr(blend, "CHECK_EVERY", 3)
    met, join, start = [], blend.PhaseAhead.join, blend.LaterEpochs.__init__

    def permuted_first(self, *args):  # a phase splits only once every later epoch is in; on a busy machine the
        start(self, *args)  # permutations may still run when a blend this small ends
        self.finish()

    def joined(self, n, *args):
        reached = n == self.split
        n = join(self, n, *args)
        if reached:
            met.append(self.met)
        return n

    monkeypatch.setattr(blend.PhaseAhead, "join", joined)
    monkeypatch.setattr(blend.LaterEpochs, "__init__", permuted_first)
    return met


def permuted_late(monkeypatch) -> list[bool]:
    """No later epoch is permuted before the greedy waits for one: it runs in stretches of 7 bins until a source
    reaches the end of its filled-in stream, then waits there."""
    gate, fill, wait_for, finish = threading.Event(), blend.SourceStreams.fill, blend.LaterEpochs.wait_for, \
        blend.LaterEpochs.finish
    waited = []

    def late_fill(self, source, epoch, threads=None):
        if epoch > 0:
            gate.wait(60)  # (a failing test must not hang)
        fill(self, source, epoch, threads)

    def opened(self, source):
        gate.set()
        waited.append(wait_for(self, source))
        gate.clear()
        return waited[-1]

    monkeypatch.setattr(blend, "RUN_WHILE_PERMUTING", 7)
    monkeypatch.setattr(blend.SourceStreams, "fill", late_fill)
    monkeypatch.setattr(blend.LaterEpochs, "wait_for", opened)
    monkeypatch.setattr(blend.LaterEpochs, "finish", lambda self: gate.set() or finish(self))
    return waited


def too_few_epochs(monkeypatch) -> list[int]:
    """Fewer epochs planned than the phases read: the streams are laid out again, longer, where a source needs more."""
    monkeypatch.setattr(blend, "MARGIN_BINS", -8)
    longer, relaid = blend.SourceStreams.longer, []
    monkeypatch.setattr(blend.SourceStreams, "longer", lambda self, i: relaid.append(True) or longer(self, i))
    return relaid


@pytest.fixture
def one_numba_thread():
    """The reference's permutations on one thread: thousands of tiny calls to a parallel kernel each wait for
    numba's other thread, which a busy machine schedules late (a permutation is the same on any thread count)."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(threads)


@pytest.mark.usefixtures("one_numba_thread")
@pytest.mark.parametrize("counted", [False, True], ids=["token-aware", "bin counts"])
def test_random_phased_blends_are_the_reference(counted, path):
    """Bin for bin, on every path a phase may take: straight, in two parts, waiting for later epochs, and with
    streams laid out again where a source needs more epochs than planned; and each phase's counts."""
    rng = np.random.default_rng(int(counted))
    for case in range(25):
        sizes, weights, totals, unit, max_bins, orders = random_phases(rng, counted)
        got = phased_blend(sizes, weights, totals, unit, case, max_bins, orders)
        pairs = list(zip(got.blend.bin_source.tolist(), got.blend.bin_index.tolist(), strict=True))
        assert pairs == reference_phases(sizes, weights, totals, unit, case, max_bins, orders), case
        size = [np.full(s, unit) if counted else s for s in sizes]
        for p in range(len(totals)):
            source, index = got.blend.bin_source[got.starts[p]:got.starts[p + 1]], \
                got.blend.bin_index[got.starts[p]:got.starts[p + 1]]
            assert got.bins[p].tolist() == np.bincount(source, minlength=len(sizes)).tolist()
            assert got.tokens[p].tolist() == [int(size[i][index[source == i]].sum()) for i in range(len(sizes))]
        assert got.positions.tolist() == [[0] * len(sizes), *np.cumsum(got.bins, axis=0).tolist()]
    assert path is None or any(path)  # the path was taken (two parts: and they met)


@requires_shared_data
def test_the_mix_file_and_blend_json_follow_their_schemas(data, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from prepkit import schema

    entry = phased_pack(data, tmp_path / "P", TWO_PHASES)
    jsonschema.Draft202012Validator(schema("mix")).validate(json.loads((tmp_path / "P.json").read_text()))
    s = schema("pack")
    jsonschema.Draft202012Validator({**s["$defs"]["blend"], "$defs": s["$defs"]}).validate(entry.meta)
    without_weight = {"sources": [{"dataset": "web"}]}  # a source's weight is required only without phases
    assert not jsonschema.Draft202012Validator(schema("mix")).is_valid(without_weight)
    two_sizes = {"sources": [{"dataset": "web"}], "phases": [{"tokens": 5, "bins": 1, "weights": {"web": 1}}]}
    assert not jsonschema.Draft202012Validator(schema("mix")).is_valid(two_sizes)
