"""TTTFlexAttention: flex over one TTT unroll with each step's keys/values written once into
shared buffers instead of concatenated anew. On CPU: the forward equals ttt_attention_flex step by
step (eager flex; no CPU flex backward), the buffer writes route gradients exactly as the
concatenation does (checked with a differentiable stand-in consumer), and calls out of order fail.
The flex gradients themselves are checked on CUDA (tests/test_kernels_cuda.py)."""

import importlib.util
from pathlib import Path

import pytest
import torch

import kernels.ttt_attention as ta
from kernels.ttt_attention import FLEX_BLOCK, TTTFlexAttention, _WriteStep, ttt_attention_eager, ttt_attention_flex
from models.eagle3 import local_counts
from tests.test_eagle3_ttt import setup


def _inputs(T, n, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(2, h, T, D, generator=g)  # noqa: E731
    return [mk(Hq) for _ in range(n)], [mk(Hkv) for _ in range(n)], [mk(Hkv) for _ in range(n)]


@pytest.mark.parametrize("T,n", [(1, 2), (7, 3), (129, 4), (232, 2)])
def test_forward_equals_concatenating_flex(T, n):
    """Every step against the whole buffers (later steps' slots masked) equals the concatenation of the
    steps so far, to rounding: eager flex's softmax runs over the masked columns too."""
    qs, ks, vs = _inputs(T, n)
    attend = TTTFlexAttention(n, compiled=False)
    for s in range(n):
        got = attend(qs[s], ks[: s + 1], vs[: s + 1])
        want = ttt_attention_flex(qs[s], ks[: s + 1], vs[: s + 1], compiled=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, ttt_attention_eager(qs[s], ks[: s + 1], vs[: s + 1]), rtol=1e-5, atol=1e-5)


def test_write_steps_route_gradients_like_concatenation():
    """The buffer chain with a consumer that saves views of the buffer (pow) for its backward:
    gradients equal those through torch.cat of padded steps, and no version-counter error."""
    n, T = 3, 5
    Tp = FLEX_BLOCK
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 2, T, 4, generator=g, requires_grad=True) for _ in range(n)]
    ws = [torch.randn(1, 2, (s + 1) * Tp, 4, generator=g) for s in range(n)]
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, Tp - T))  # noqa: E731
    ref = sum((torch.cat([pad(x) for x in xs[: s + 1]], 2).pow(3) * ws[s]).sum() for s in range(n))
    node, got = torch.zeros(1, 2, n * Tp, 4), 0.0
    for s in range(n):
        node = _WriteStep.apply(node, xs[s], s * Tp)
        got = got + (node[:, :, : (s + 1) * Tp].pow(3) * ws[s]).sum()
    torch.testing.assert_close(got, ref)
    for a, b in zip(torch.autograd.grad(got, xs), torch.autograd.grad(ref, xs)):
        torch.testing.assert_close(a, b)


def test_steps_out_of_order_fail():
    qs, ks, vs = _inputs(8, 3)
    attend = TTTFlexAttention(2, compiled=False)
    with pytest.raises(ValueError, match="step 1 after 0"):
        attend(qs[1], ks[:2], vs[:2])
    attend(qs[0], ks[:1], vs[:1])
    attend(qs[1], ks[:2], vs[:2])
    with pytest.raises(ValueError, match="step 2 after 2 written steps of 2"):
        attend(qs[2], ks[:3], vs[:3])


@pytest.mark.parametrize("attention", ["flex", "flex_buf"])
def test_draft_forward_with_flex_equals_eager(attention):
    """The EAGLE-3 draft's TTT forward (no grad: CPU) gives the eager loss and statistics through
    compiled flex (on CPU through inductor), concatenating (flex) or buffered (flex_buf)."""
    draft, batch, _, ttt = setup(seed=2, hidden=64, heads=4)  # flex needs head dim >= 16
    counts = local_counts(batch, draft.t2d, ttt)
    with torch.no_grad():
        want, ws = draft(batch, ttt, counts, attention="eager")
        got, gs = draft(batch, ttt, counts, attention=attention)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gs["loss_sum"], ws["loss_sum"], rtol=1e-5, atol=1e-5)
    assert torch.equal(gs["correct"], ws["correct"])


def test_buffers_peak_lower_around_a_stand_in_flex(monkeypatch):
    """experiments/flex_buf_memory_cpu.py: with flex replaced by a stand-in that saves its inputs,
    the buffered unroll (write chain and its gradients included) peaks below the concatenating one (less
    than it did before every step took the whole buffers, whose gradients the stand-in returns whole)."""
    spec = importlib.util.spec_from_file_location(
        "flex_buf_memory_cpu", Path(__file__).resolve().parents[1] / "experiments/flex_buf_memory_cpu.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, fn in mod.stand_in_patches().items():
        monkeypatch.setattr(ta, name, fn)
    # in step-sized K tensors; the 0.01 allows for scalars (the loss sums) alive at the peak
    assert mod.peak_in_steps("cat") == pytest.approx(72.0, abs=0.01) and mod.peak_in_steps("buf") == pytest.approx(
        68.0, abs=0.01
    )


@pytest.mark.parametrize("packed", [False, True])  # lengths: the same mask code as plain
def test_one_compile_for_the_whole_unroll(packed):
    """Compiled flex (forward, through inductor on CPU) compiles once for TTTFlexAttention's whole unroll, where
    the concatenating path compiles once per step: every step has the same shapes and the same mask_mod
    constants (the step is a tensor), the fewer compiles a cold start pays on a GPU (forward and backward)."""
    from torch._dynamo.utils import counters  # lazy: torch._dynamo takes seconds to import

    n, T = 3, 70
    qs, ks, vs = _inputs(T, n)
    kw = {"doc_ids": torch.tensor([[0] * 30 + [1] * 40, [0] * 50 + [-1] * 20])} if packed else {}

    def graphs(attend) -> tuple[int, list]:
        """Compiled graphs made by one unroll through attend, and its outputs."""
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            outs = [attend(qs[s], ks[: s + 1], vs[: s + 1], **kw) for s in range(n)]
        return int(counters["stats"]["unique_graphs"]), outs

    buf, got = graphs(TTTFlexAttention(n))
    cat, want = graphs(ttt_attention_flex)
    assert (buf, cat) == (1, n)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
