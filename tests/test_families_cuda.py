"""GPU checks of the block / parallel drafters' FlexAttention path: flex has no backward on CPU
(torch 2.13), so its gradients are compared with the dense path's here, on the H200
(`pytest -m cuda tests/test_families_cuda.py` through the device tool). fp32, tiny random target;
the batches are built on the CPU exactly as the CPU tests build them, then moved."""

import pytest
import torch

from models.dflash import block_counts
from models.peagle import peagle_counts
from tests.test_dflash import setup as dflash_setup
from tests.test_domino import domino_setup
from tests.test_peagle import setup as peagle_setup
from tests.tiny import to_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def loss_and_grads(draft, run):
    draft.zero_grad(set_to_none=True)
    loss, stats = run()
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (la, sa, ga), (lb, sb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
    assert torch.equal(sa["correct"], sb["correct"])
    assert ga.keys() == gb.keys() and len(ga) > 0
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("objective", ["ce", "dpace"])
def test_dflash_flex_gradients_equal_dense(objective):
    draft, batch, *_ = dflash_setup(seed=3, K=3, hidden=64, heads=4, n_examples=4, max_len=150)
    draft, batch = draft.cuda(), to_device(batch)
    counts = block_counts(batch)
    runs = [
        loss_and_grads(draft, lambda a=a: draft(batch, counts, objective=objective, attention=a))
        for a in ("dense", "flex")
    ]
    assert_same(*runs)


def test_peagle_flex_gradients_equal_dense():
    draft, batch, *_ = peagle_setup(seed=3, K=4, hidden=64, heads=4, max_len=150)
    draft, batch = draft.cuda(), to_device(batch)
    counts = peagle_counts(batch, draft.K)
    runs = [loss_and_grads(draft, lambda a=a: draft(batch, counts, attention=a)) for a in ("dense", "flex")]
    assert_same(*runs)


@pytest.mark.parametrize("family", ["dflash", "peagle"])
def test_bucketed_counts_compile_once(family):
    """Two batches whose block (DFlash) or element (P-EAGLE) counts differ but share a bucket (data/packing.py's
    bucket, as train.py pads them on a GPU) run through compiled flex, forward and backward, with no new graph
    for the second (2026-12-07, H100: unbucketed, dflash at --num-anchors 512 made a graph every step, 5.8 s a
    step against 0.2 s for a count seen before)."""
    from core.runlog import compiled_graphs  # in-function: torch._dynamo is imported only by tests that compile

    made, sizes = [], []
    for i in range(2):
        if family == "dflash":  # the same rows (19 columns, padded to 20); 9 and 10 anchors: both 10 blocks
            draft, batch, *_ = dflash_setup(seed=5, n_anchors=9 + i, max_len=24, hidden=64, heads=4, bucketed=True)
            sizes.append(batch.anchors.shape[1])
        else:  # P-EAGLE's flex runs over the elements alone: other rows, the same bucketed count
            draft, batch, *_ = peagle_setup(seed=5 + i, hidden=64, heads=4, bucketed=True)  # 21 and 22: 24
            sizes.append(batch.pos.shape[1])
        draft, batch = draft.cuda(), to_device(batch)  # counts from the moved batch: on the GPU with the loss
        counts = block_counts(batch) if family == "dflash" else peagle_counts(batch, draft.K)
        loss_and_grads(draft, lambda d=draft, b=batch, c=counts: d(b, c, attention="flex"))
        made.append(compiled_graphs())
    assert sizes[0] == sizes[1], sizes
    assert made[1] == made[0], made


def test_domino_gru_weights_flat_after_moving():
    """Moved to the GPU and cast, Domino's GRU runs on one flat weight buffer: no per-call compaction (torch's RNNs
    stopped flattening themselves in _apply; the H100 runs of 2026-12-07 warned at every step)."""
    import warnings  # in-function: only this test turns the warning into an error

    draft, batch, *_ = domino_setup(seed=2)
    draft, batch = draft.cuda().to(torch.bfloat16).float(), to_device(batch)  # moved, then cast twice
    storages = {w.untyped_storage().data_ptr() for w in draft.prefix_gru._flat_weights}
    assert len(storages) == 1, "the GRU's weights are separate tensors"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not part of single contiguous chunk")
        loss, _, grads = loss_and_grads(draft, lambda: draft(batch, block_counts(batch), progress=1.0))
    assert torch.isfinite(loss) and "prefix_gru.weight_hh_l0" in grads
