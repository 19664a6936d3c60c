"""Loss normalization over the whole step, and channel (per-category) loss."""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainkit import category_pack, grads, make_trainer, max_rel_diff
from xprep.cli import xtrain
from xprep.train import loss as loss_module
from xprep.train.data import IGNORE, collate
from xprep.train.loss import (
    AUTO_CHUNK_ABOVE,
    LossSums,
    auto_loss_chunk,
    chunked_token_ce,
    logits_bytes,
    step_losses,
    token_ce,
)


def test_gradient_same_for_any_accumulation_split(tmp_path):
    packed = category_pack(tmp_path)
    ref = make_trainer(packed, micro=4, accum=1)
    ref.accumulate_gradients()
    for micro, accum in ((1, 4), (2, 2)):
        t = make_trainer(packed, micro=micro, accum=accum)
        t.accumulate_gradients()
        assert max_rel_diff(grads(t.model), grads(ref.model)) <= 1e-6


def test_per_micro_batch_mean_would_differ(tmp_path):
    """Guard: the bins really hold different target counts, so the test above can fail."""
    packed = category_pack(tmp_path)
    t = make_trainer(packed, micro=1, accum=4)
    counts = [int((collate([t.dataset[b]])["labels"] != IGNORE).sum()) for b in range(4)]
    assert len(set(counts)) > 1


def test_channel_loss_equals_direct_computation(tmp_path):
    packed = category_pack(tmp_path)
    t = make_trainer(packed, micro=2, accum=2)
    before = copy.deepcopy(t.model)
    bins = [t.sampler.bins_at(torch.arange(4).numpy()).tolist()]
    metrics = t.train_step()
    batch = collate([t.dataset[b] for b in bins[0]])
    with torch.no_grad():
        logits = before(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])[0]
    labels, cats = batch["labels"][0], batch["category_ids"][0]
    names = t.dataset.category_names
    expected = {}
    for cid in range(1, len(names)):
        sel = (labels != IGNORE) & (cats == cid)
        if sel.any():
            expected[names[cid]] = float(F.cross_entropy(logits[sel].double(), labels[sel]))
    assert metrics.category_loss.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert abs(metrics.category_loss[name] - value) <= 1e-6 * abs(value)
    overall = float(F.cross_entropy(logits.double(), labels, ignore_index=IGNORE))
    assert abs(metrics.loss - overall) <= 1e-6 * overall


def test_category_zero_and_empty_categories_left_out():
    sums = LossSums.zeros(4)
    ce = torch.tensor([1.0, 2.0, 3.0, 0.0])
    sums.add(ce, torch.tensor([5, 6, 7, IGNORE]), torch.tensor([0, 2, 2, 0]))
    loss, per_cat = step_losses(sums, ["uncategorized", "a", "b", "c"])
    assert per_cat == {"b": 2.5}
    assert loss == 2.0


def test_document_bounds_are_read_once_per_forward(tmp_path):
    """No host read of cu_seqlens per layer (on a GPU each one waits for the device): one per forward,
    and the trainer keeps cu_seqlens on the CPU, so even that one does not wait."""
    reads = []

    class Counting(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("tolist", "item", "__int__"):
                reads.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    trainer = make_trainer(category_pack(tmp_path), micro=2, accum=1)
    batches, _, targets = trainer.next_micro_batches()
    batch = batches[0]
    assert batch["cu_seqlens"].device.type == "cpu" and targets == int((batch["labels"] != IGNORE).sum())
    assert len(trainer.model.layers) > 1
    cu = batch["cu_seqlens"].as_subclass(Counting)
    with torch.no_grad():
        counted = trainer.model(batch["input_ids"], batch["position_ids"], cu)
        plain = trainer.model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    assert reads == ["tolist"]
    torch.testing.assert_close(counted.as_subclass(torch.Tensor), plain, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ chunked loss
def largest_tensor_made(fn) -> int:
    """The most elements of any tensor an op makes while ``fn`` runs (forward and backward)."""
    largest = [0]

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest[0] = max([largest[0], *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
            return out

    with Sizes():
        fn()
    return largest[0]


def test_chunked_ce_equals_plain_without_whole_logits():
    g = torch.Generator().manual_seed(0)
    t, d, v, chunk = 100, 16, 300, 32
    hidden = torch.randn(t, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = IGNORE
    upstream = torch.rand(t, generator=g)  # any weighting of the tokens, not only a plain sum

    def run(n: int) -> tuple[torch.Tensor, ...]:
        hidden.grad = weight.grad = None
        ce = chunked_token_ce(hidden, weight, labels, n)
        (ce * upstream).sum().backward()
        return ce.detach(), hidden.grad.clone(), weight.grad.clone()

    plain = run(0)
    assert torch.equal(plain[0], token_ce(hidden.detach() @ weight.detach().T, labels))
    for n in (chunk, 1, t - 1):  # ragged last chunk, one token per chunk
        got = run(n)
        assert max_rel_diff(dict(enumerate(got)), dict(enumerate(plain))) <= 1e-6  # relative to each one's largest
    assert (plain[0][::7] == 0).all()
    whole = largest_tensor_made(lambda: run(0))
    chunked = largest_tensor_made(lambda: run(chunk))
    assert whole == t * v and chunked == chunk * v


def test_trainer_with_loss_chunk_gives_the_same_step(tmp_path):
    packed = category_pack(tmp_path)
    ref = make_trainer(packed, micro=2, accum=2)
    chunked = make_trainer(packed, micro=2, accum=2, loss_chunk=16)
    ref.accumulate_gradients()
    chunked.accumulate_gradients()
    assert max_rel_diff(grads(chunked.model), grads(ref.model)) <= 1e-6
    for t in (ref, chunked):
        t.optimizer.zero_grad()
        t.sampler.consumed_samples = 0  # replay the same bins
    a, b = ref.train_step(), chunked.train_step()  # the same step: loss and channel losses
    assert abs(a.loss - b.loss) <= 1e-6 * a.loss and a.category_loss.keys() == b.category_loss.keys()
    assert all(abs(a.category_loss[k] - b.category_loss[k]) <= 1e-6 * a.category_loss[k] for k in a.category_loss)
    # the model's labels path is the plain loss when not chunked, and evaluation chunks too
    batch = collate([ref.dataset[0], ref.dataset[1]])
    args = (batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    with torch.no_grad():
        plain = token_ce(ref.model(*args), batch["labels"])
        torch.testing.assert_close(ref.model(*args, labels=batch["labels"]), plain, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(chunked.token_losses(batch), plain, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ --loss-chunk auto
def test_auto_loss_chunk_rule():
    """Issue 29, point 10: whole logits up to 1 GiB of fp32 (tokens × vocab × 4 bytes), else chunks of the largest
    power of two of tokens whose logits take at most 256 MiB."""
    assert auto_loss_chunk(8192, 128_256) == 512  # 3.9 GiB of logits: Llama 3's vocabulary
    assert auto_loss_chunk(4096, 151_936) == 256  # Qwen3's
    assert auto_loss_chunk(16_384, 32_000) == 2048
    assert auto_loss_chunk(8192, 32_768) == 0  # exactly 1 GiB: whole
    assert auto_loss_chunk(8193, 32_768) == 2048
    assert auto_loss_chunk(2048, 128_256) == 0 and auto_loss_chunk(64, 128) == 0
    assert logits_bytes(8192, 32_768) == AUTO_CHUNK_ABOVE


def test_auto_loss_chunk_in_a_run_changes_nothing_but_memory(tmp_path, monkeypatch):
    """A run whose logits are 'large' (the threshold lowered to this tiny pack's 64 tokens × 128 vocabulary) chunks
    its loss by itself, says so, records it in run.json, and logs the same losses and gradient norms as the run
    that computes whole logits (--loss-chunk 0)."""
    monkeypatch.setattr(loss_module, "AUTO_CHUNK_ABOVE", 64 * 128 * 4 - 1)
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 16 * 128 * 4)
    packed = category_pack(tmp_path)
    runs = {}
    for name, flags in (("auto", []), ("whole", ["--loss-chunk", "0"])):
        result = CliRunner().invoke(xtrain, ["run", str(packed), "--steps", "3", "--lr", "1e-2", *flags,
                                             "--output", str(tmp_path / name)])
        assert result.exit_code == 0, (result.output, result.exception)
        info = json.loads((tmp_path / name / "run.json").read_text())
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (result.stderr, info["loss_chunk"], rows)
    said, chunk, auto = runs["auto"]
    assert chunk == 16 and "loss computed in chunks of 16 tokens (--loss-chunk auto)" in said, said
    assert "64 tokens × 128 vocabulary × 4 bytes" in said and "--loss-chunk 0 computes them whole" in said
    said, chunk, whole = runs["whole"]
    assert chunk == 0 and "loss computed in chunks" not in said
    for a, b in zip(auto, whole, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"] and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b[
            "grad_norm"], (a, b)
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert config["model"]["loss_chunk"] is None  # auto stays auto on resume: the chunk follows the layout
