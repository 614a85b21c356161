"""Cross-entropy kernels (Triton under TRITON_INTERPRET=1, and the plain-torch CPU path) and
the fused linear + soft CE, against plain-torch references defined here.

The interpreter has to be on before triton itself is first imported (triton.language's own
helpers such as tl.max are decorated at import), and in a shared pytest session torch.compile
may import triton first. So the Triton-path tests run in a child pytest started with
TRITON_INTERPRET=1 (test_triton_path_under_interpreter); this process runs the plain-torch
path, which is what CPU training uses.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.ce
from kernels.fused_ce import fused_linear_soft_ce

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_triton_path_under_interpreter():
    if INTERPRETED:
        pytest.skip("already the interpreter child")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", __file__]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 20, tail


@pytest.fixture(scope="module")
def ce():
    return kernels.ce


@pytest.fixture(params=["triton", "torch"])
def impl(request, ce, monkeypatch):
    if request.param == "triton":
        if not INTERPRETED:
            pytest.skip("runs in the TRITON_INTERPRET=1 child (test_triton_path_under_interpreter)")
        assert type(ce._ce_fwd_kernel).__name__ == "InterpretedFunction"
    else:
        monkeypatch.setattr(ce, "_use_triton", lambda x: False)
    return request.param


# --------------------------------------------------------------------------- references
def ref_soft(logits, p, mask):
    return (mask.float() * -(p.float() * torch.log_softmax(logits.float(), -1)).sum(-1)).sum()


def ref_hard(logits, labels, mask):
    w = mask.float() * (labels >= 0)
    nll = -torch.log_softmax(logits.float(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    return (w * nll).sum()


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _data(N, V, dtype, seed=0, masked="some"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
    p = torch.softmax(torch.randn(N, V, generator=g) * 2, -1)
    p[: N // 3] *= 0.5  # rows whose target mass is < 1 (draft vocab misses part of the target's)
    p = p.to(dtype)
    if masked == "all":
        mask = torch.zeros(N)
    else:
        mask = (torch.rand(N, generator=g) > 0.3).float() * torch.rand(N, generator=g).add(0.5)
    return logits, p, mask


def _check(got_loss, got_grad, want_loss, want_grad, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(
        got_loss.float(), want_loss.float(), atol=tol["atol"] * max(1.0, want_loss.abs().item()), rtol=tol["rtol"]
    )
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad.float(), want_grad.float(), **tol)


@pytest.mark.parametrize("masked", ["some", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(47, 31), (123, 1000)])
def test_soft_ce(ce, impl, N, V, dtype, masked):
    logits, p, mask = _data(N, V, dtype, masked=masked)
    leaf = logits.clone().requires_grad_()
    ref_leaf = logits.clone().requires_grad_()
    z = leaf * 1  # a non-leaf buffer: the backward overwrites it in place
    loss, argmax = ce.soft_cross_entropy(z, p, mask, return_argmax=True)
    g = torch.tensor(0.7)
    loss.backward(g)
    want = ref_soft(ref_leaf, p, mask)
    want.backward(g)
    _check(loss, leaf.grad, want, ref_leaf.grad, dtype)
    live = mask != 0
    assert torch.equal(argmax[live], logits[live].float().argmax(-1))
    assert (argmax[~live] == -1).all()
    assert (leaf.grad[~live] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(47, 31), (123, 1000)])
def test_hard_ce(ce, impl, N, V, dtype):
    logits, _, mask = _data(N, V, dtype)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    labels[::5] = -100  # ignored rows
    leaf = logits.clone().requires_grad_()
    ref_leaf = logits.clone().requires_grad_()
    loss, argmax, rows = ce.hard_cross_entropy(leaf * 1, labels, mask, return_argmax=True, return_rows=True)
    loss.backward()
    want = ref_hard(ref_leaf, labels, mask)
    want.backward()
    _check(loss, leaf.grad, want, ref_leaf.grad, dtype)
    live = (mask != 0) & (labels >= 0)
    # the per-row terms mask_n · nll_n (the block drafters' logs divide them by their weights)
    nll = -torch.log_softmax(logits.float(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    torch.testing.assert_close(rows, torch.where(live, mask.float() * nll, 0.0), atol=1e-5, rtol=1e-5)
    assert torch.equal(argmax[live], logits[live].float().argmax(-1))
    assert (argmax[~live] == -1).all()


def test_backward_is_in_place(ce, impl):
    """The gradient handed upstream is the logits buffer itself (no second [N, V] tensor)."""
    logits, p, mask = _data(9, 40, torch.float32)
    seen = {}
    z = logits.clone().requires_grad_()
    y = z * 1
    y.register_hook(lambda grad: seen.update(ptr=grad.data_ptr()))
    ce.soft_cross_entropy(y, p, mask).backward()
    assert seen["ptr"] == y.data_ptr()


@pytest.mark.parametrize("layout", ["row_strided", "col_strided"])
def test_noncontiguous_inputs(ce, impl, layout):
    """Row-strided logits are used in place; a non-unit column stride is copied first."""
    N, V = 33, 70
    g = torch.Generator().manual_seed(3)
    big = torch.randn(N, 2 * V, generator=g)
    p = torch.softmax(torch.randn(N, 2 * V, generator=g), -1)
    sl = (slice(None), slice(0, V)) if layout == "row_strided" else (slice(None), slice(0, 2 * V, 2))
    mask = torch.ones(N)
    leaf = big.clone().requires_grad_()
    loss = ce.soft_cross_entropy((leaf * 1)[sl], p[sl], mask)
    loss.backward()
    ref_leaf = big.clone().requires_grad_()
    ref_soft(ref_leaf[sl], p[sl], mask).backward()
    _check(loss, leaf.grad, ref_soft(big[sl], p[sl], mask), ref_leaf.grad, torch.float32)


# --------------------------------------------------------------------------- fused linear + CE
@pytest.mark.parametrize("masked", ["some", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V,chunk", [(47, 24, 31, 16), (123, 40, 1000, 32)])
def test_fused_linear_soft_ce(ce, impl, N, H, V, chunk, dtype, masked):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    _, p, mask = _data(N, V, dtype, seed=6, masked=masked)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, argmax = fused_linear_soft_ce(h1, w1, p, mask, chunk_size=chunk)
    up = torch.tensor(1.3)
    loss.backward(up)
    logits = h2 @ w2.T
    want = ref_soft(logits, p, mask)
    want.backward(up)
    tol = TOL[dtype]
    torch.testing.assert_close(loss, want.float(), atol=tol["atol"] * max(1.0, want.abs().item()), rtol=tol["rtol"])
    for got, ref in [(h1.grad, h2.grad), (w1.grad, w2.grad)]:
        assert got.dtype == dtype
        scale = max(ref.abs().max().item(), 1e-6)
        torch.testing.assert_close(got.float() / scale, ref.float() / scale, **tol)
    live = mask != 0
    assert torch.equal(argmax[live], logits.detach()[live].float().argmax(-1))
    assert (argmax[~live] == -1).all()
    assert (h1.grad[~live] == 0).all()


@pytest.mark.parametrize("hard", [False, True])
def test_target_rows_indirection(ce, impl, hard):
    """t_rows: logits row n is scored against target row t_rows[n] (the fused CE's live rows),
    the same as handing the kernel a gathered copy of those target rows."""
    logits, p, _ = _data(40, 67, torch.float32, seed=9)
    g = torch.Generator().manual_seed(10)
    rows = torch.randperm(90, generator=g)[:40]
    target = torch.randint(-1, 67, (90,), generator=g) if hard else torch.cat([p, p.flip(0), p[:10]])
    w = torch.rand(40, generator=g).add(0.1)
    want = ce.ce_forward(logits, target[rows].contiguous(), w, hard)
    got = ce.ce_forward(logits, target, w, hard, t_rows=rows)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    gz, wz = logits.clone(), logits.clone()
    ce.ce_backward_(gz, target, w, got[1], got[2], torch.tensor(0.7), hard, t_rows=rows)
    ce.ce_backward_(wz, target[rows].contiguous(), w, want[1], want[2], torch.tensor(0.7), hard)
    torch.testing.assert_close(gz, wz)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_ce_weights_rows_and_target_rows(ce, impl, dtype):
    """The draft's deferred head (models/eagle3.py): fp32 weights, the per-row terms for logging and targets
    read through t_rows from a larger fp32 p, against the reference on the gathered copy."""
    logits, p, _ = _data(45, 300, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    big_p = torch.cat([p.float(), torch.softmax(torch.randn(20, 300, generator=g), -1)])  # [65, V] fp32
    rows = torch.randperm(65, generator=g)[:45]
    w = torch.rand(45, generator=g) * (torch.rand(45, generator=g) > 0.3)  # weights, some rows off
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, argmax, per_row = ce.soft_cross_entropy(leaf * 1, big_p, w, return_argmax=True, return_rows=True, t_rows=rows)
    assert not per_row.requires_grad and per_row.shape == (45,)
    loss.backward(torch.tensor(0.7))
    want = ref_soft(ref_leaf, big_p[rows], w)
    want.backward(torch.tensor(0.7))
    _check(loss, leaf.grad, want, ref_leaf.grad, dtype)
    torch.testing.assert_close(per_row.sum(), loss.detach())
    assert (per_row[w == 0] == 0).all() and (argmax[w == 0] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,chunk", [(0, 4), (1, 4), (37, 8), (37, 37), (37, 4096)])
def test_nll_rows_in_chunks_equal_the_whole_fp32_copy(N, chunk, dtype):
    """nll_rows (the block drafters' per-slot logs and D-PACE weights) equals the fp32 formula it replaced,
    whatever the chunk against N (none, one, a ragged last chunk, exact, more than N), with no gradient."""
    V = 301
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    got = kernels.ce.nll_rows(logits, labels, chunk=chunk)
    z = logits.detach().float()
    want = z.logsumexp(-1) - z.gather(1, labels[:, None])[:, 0]
    assert got.dtype == torch.float32 and got.shape == (N,) and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=0)
