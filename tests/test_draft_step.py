"""The draft step at full speed gives the reference's numbers: rows chosen on the host (no
nonzero() sync) equal rows chosen on the device, the step compiled as a unit equals eager, the
prefetcher hands over the right batches, train.py with the compiled target backend and the
compiled step follows the HF-backend run, and the compiled step on two ranks (FSDP2) follows one."""

from types import SimpleNamespace

import pytest
import torch

from core.trainer import torch_older_than
from data.prefetch import Prefetcher
from models.eagle3 import _step, local_counts, select_rows
from tests.test_eagle3_ttt import setup
from tests.test_train_e2e import final_params, run_train, train_rows
from tests.tiny import to_device


def loss_and_grads(draft, batch, ttt, attention, loss, rows=None, step=None, objective="kl"):
    counts = local_counts(batch, draft.t2d, ttt)
    total, stats = (draft if step is None else step)(
        batch, ttt, counts, attention, loss, rows=rows, objective=objective
    )
    return total, stats, torch.autograd.grad(total, list(draft.parameters()))


def assert_same(a, b, rtol=1e-5):
    (ta, sa, ga), (tb, sb, gb) = a, b
    torch.testing.assert_close(ta, tb, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(sa["loss_sum"], sb["loss_sum"], rtol=rtol, atol=1e-5)
    assert torch.equal(sa["correct"], sb["correct"])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_select_rows():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
    rows = select_rows(mask, 3, multiple=4)
    # step k trains row (b, t) iff mask[b, t + 2 + k]; rows are b * 6 + t, then -1 padding
    assert rows.tolist() == [[0, 2, 3, 7, 8, -1, -1, -1], [1, 2, 6, 7, -1, -1, -1, -1], [0, 1, 6, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("attention,loss", [("lse", "torch"), ("eager", "triton"), ("eager", "fused")])
def test_host_rows_equal_device_rows(attention, loss):
    draft, batch, _, ttt = setup(seed=2)
    rows = select_rows(batch.loss_mask, ttt, multiple=16)  # with padding rows
    assert (rows < 0).any()
    assert_same(
        loss_and_grads(draft, batch, ttt, attention, loss, rows), loss_and_grads(draft, batch, ttt, attention, loss)
    )


def test_compiled_step_equals_eager():
    """torch.compile of the whole TTT forward (inductor on CPU; lse attention, Triton-CE contract
    on its plain-torch path, which stays out of the graph): same loss, stats, gradients."""
    torch._dynamo.reset()
    draft, batch, _, _ = setup(seed=3)
    ttt = 2
    rows = select_rows(batch.loss_mask, ttt, multiple=8)
    step = torch.compile(draft)  # (loss "torch", one graph without breaks, runs in the train.py test below)
    assert_same(
        loss_and_grads(draft, batch, ttt, "lse", "triton", rows, step),
        loss_and_grads(draft, batch, ttt, "lse", "triton"),
    )


@pytest.mark.parametrize("attention", ["lse", "flex"])
def test_compiled_unroll_is_one_graph_with_the_triton_loss(attention):
    """The Triton CE stays out of compiled graphs (kernels/ce.py). Called once after the TTT unroll it splits the
    forward in two; called inside the loop (before 2026-12-06) it made dynamo skip the whole forward and compile
    its pieces, each step's attention a graph of its own (17 graphs at TTT 7 on the H100:
    experiments/results/scale_h100/run_g_1894). Dynamo alone (backend eager): the graphs, not their code."""
    from torch._dynamo.utils import counters  # dynamo's own bookkeeping, read by this test only

    graphs = {}
    for ttt in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        draft, batch, _, _ = setup(seed=3)
        rows = select_rows(batch.loss_mask, ttt, multiple=8)
        with torch.set_grad_enabled(attention == "lse"):  # flex: forward only on CPU
            torch.compile(draft, backend="eager")(
                batch, ttt, local_counts(batch, draft.t2d, ttt), attention, "triton", rows=rows
            )
        graphs[ttt] = counters["stats"]["unique_graphs"]
    assert graphs[2] == graphs[4] <= 4, graphs


@pytest.mark.parametrize("objective", ["tv", "rkl", "jsd"])
def test_divergences_host_rows_and_compiled(objective):
    """The divergence objectives on the fast path: host-chosen rows (with padding rows) and, for jsd
    (the one with the most ops; each compile costs ~40 s of CI), the compiled step give the
    device-rows eager numbers."""
    torch._dynamo.reset()
    draft, batch, _, _ = setup(seed=4)
    ttt = 2
    rows = select_rows(batch.loss_mask, ttt, multiple=16)
    assert (rows < 0).any()
    eager = loss_and_grads(draft, batch, ttt, "lse", "torch", objective=objective)
    assert_same(loss_and_grads(draft, batch, ttt, "lse", "torch", rows, objective=objective), eager)
    if objective == "jsd":
        if torch_older_than(2, 13):  # the H100 machines' torch 2.11: experiments/results/cuda_tests_h100_run3.txt
            pytest.xfail("torch 2.11's inductor compiles the jsd step with wrong gradients (train.py refuses it)")
        assert_same(loss_and_grads(draft, batch, ttt, "lse", "torch", rows, torch.compile(draft), objective), eager)


def test_prefetcher_order_passthrough_and_errors():
    def make(i):
        if i == 3:
            raise ValueError("bad batch 3")
        return {"x": torch.full((2,), i), "tag": f"b{i}"}

    p = Prefetcher(make, range(3), "cpu")
    got = [(int(b["x"][0]), b["tag"]) for b in p]
    assert got == [(0, "b0"), (1, "b1"), (2, "b2")]
    p = Prefetcher(make, range(5), "cpu")
    assert [int(next(p)["x"][0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad batch 3"):
        next(p)
    p.close()


@pytest.mark.slow
def test_train_compiled_backend_and_step_follow_hf(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    run_train(tmp_path / "hf", target, data, 0, ["--steps", "3"])
    run_train(tmp_path / "fast", target, data, 0, ["--steps", "3", "--backend", "compiled", "--compile"])
    hf, fast = train_rows(tmp_path / "hf"), train_rows(tmp_path / "fast")
    assert len(hf) == len(fast) == 3
    # every log row counts torch.compile's graphs: none eager; compiled, none new after the first steps
    assert all(r["compiled_graphs"] == 0 for r in hf)
    assert fast[0]["compiled_graphs"] > 0 and fast[1]["compiled_graphs"] == fast[2]["compiled_graphs"]
    for a, b in zip(hf, fast):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "acc_2"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)


@pytest.mark.slow
def test_train_compiled_two_ranks_match_one_rank(tmp_path, tiny_run_inputs):
    """--compile with two gloo ranks (the FSDP2-wrapped draft compiled) trains like one compiled rank on
    the same global batch: loss, per-step metrics, gradient norm and the final weights (~5 min on 2 cores)."""
    target, data = tiny_run_inputs
    run_train(tmp_path / "one", target, data, 1, ["--steps", "3", "--compile"])
    run_train(tmp_path / "two", target, data, 2, ["--steps", "3", "--compile"])
    one, two = train_rows(tmp_path / "one"), train_rows(tmp_path / "two")
    assert len(one) == len(two) == 3 and all(r["loss"] > 0 for r in one) and one[-1]["loss"] != one[0]["loss"]
    for a, b in zip(one, two):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    p1, p2 = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward and Triton need a GPU")
def test_cuda_compiled_step_equals_eager():
    """The GPU training step: flex attention + Triton CE, compiled with host rows, vs eager with
    device rows (fp32 so the comparison is tight)."""
    torch._dynamo.reset()
    draft, batch, _, ttt = setup(seed=2, hidden=64, heads=4)  # flex needs head dim >= 16
    draft = draft.cuda()
    rows = select_rows(batch.loss_mask, ttt).cuda()
    batch = to_device(batch)  # its doc_ids / position_ids are None (unpacked)
    ref = loss_and_grads(draft, batch, ttt, "flex", "triton")
    got = loss_and_grads(draft, batch, ttt, "flex", "triton", rows, torch.compile(draft))
    (ta, sa, ga), (tb, sb, gb) = got, ref
    torch.testing.assert_close(ta, tb, rtol=1e-4, atol=1e-5)
    assert torch.equal(sa["correct"], sb["correct"])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)


def test_compiled_unroll_is_traced_once_for_every_row_count():
    """The family step marks the row count R dynamic: a batch with another R re-traces only the small frames
    after the Triton loss's graph break, not the unroll (on the H100 that re-trace cost ~43 s of the cold start)."""
    from torch._dynamo.utils import counters  # dynamo's own bookkeeping, read by this test only

    torch._dynamo.reset()
    counters.clear()
    draft, batch, _, _ = setup(seed=3)
    cfg = SimpleNamespace(ttt_length=2, attention="lse", loss="triton", objective="kl")
    step, rows = torch.compile(draft, backend="eager"), select_rows(batch.loss_mask, 2, multiple=8)
    captured = []
    for extra in (0, 8, 16):  # three row counts, as three batches have
        b = {"rows": torch.cat([rows, torch.full((2, extra), -1, dtype=rows.dtype)], 1)}
        _step(step, batch, local_counts(batch, draft.t2d, 2), cfg, b, None)
        captured.append(counters["stats"]["calls_captured"])
    # the unroll is most of the first trace; the second R re-traces under a fifth of it, the third nothing
    assert captured[1] - captured[0] < 0.3 * captured[0] and captured[2] == captured[1], captured
