"""Loss normalization over the whole step, and channel (per-category) loss."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from trainkit import category_pack, grads, make_trainer, max_rel_diff

from train.data import IGNORE, collate
from train.loss import LossSums, step_losses


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
