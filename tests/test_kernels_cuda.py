"""GPU-only kernel checks (skipped without CUDA): flex and LSE TTT attention gradients (with packed rows'
document masks too), the real (compiled) Triton cross-entropy and the fused linear-CE against plain torch.

bf16 results are judged against an fp32 computation on the same bf16-rounded inputs: a
kernel must be about as accurate as the eager bf16 reference (error <= 2x eager's + slack).
"""

import pytest
import torch

import kernels.ce
from kernels.fused_ce import fused_linear_soft_ce
from kernels.ttt_attention import TTTFlexAttention, ttt_attention_eager, ttt_attention_flex, ttt_attention_lse

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _assert_as_accurate(got, eager, truth, slack=1e-2):
    for i, (g, e, t) in enumerate(zip(got, eager, truth)):
        err, ref_err = _max_err(g, t), _max_err(e, t)
        assert err <= 2 * ref_err + slack * t.abs().max().item(), f"tensor {i}: err {err:.3g} vs eager {ref_err:.3g}"


# --------------------------------------------------------------------------- TTT attention
def _ttt_inputs(T, k, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, h, T, D, device="cuda", generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(Hq), [mk(Hkv) for _ in range(k + 1)], [mk(Hkv) for _ in range(k + 1)]


def _fwd_bwd(fn, q, ks, vs, **kw):
    out = fn(q, ks, vs, **kw)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    return [out, *torch.autograd.grad(out, [q, *ks, *vs], dout.to(out.dtype))]


def _upcast(q, ks, vs):
    up = lambda x: x.detach().float().requires_grad_()  # noqa: E731
    return up(q), [up(x) for x in ks], [up(x) for x in vs]


@pytest.mark.parametrize("impl", ["flex", "lse"])
@pytest.mark.parametrize("T,k", [(256, 0), (256, 3), (1000, 1), (1000, 6)])
def test_ttt_attention_grads_bf16(impl, T, k):
    fn = ttt_attention_flex if impl == "flex" else ttt_attention_lse
    q, ks, vs = _ttt_inputs(T, k)
    truth = _fwd_bwd(ttt_attention_eager, *_upcast(q, ks, vs))
    eager = _fwd_bwd(ttt_attention_eager, q, ks, vs)
    got = _fwd_bwd(fn, q, ks, vs)
    assert got[0].dtype == torch.bfloat16
    _assert_as_accurate(got, eager, truth)


def test_ttt_attention_lse_fp32_efficient_path():
    q, ks, vs = _ttt_inputs(333, 3, dtype=torch.float32)
    for a, b in zip(_fwd_bwd(ttt_attention_lse, q, ks, vs), _fwd_bwd(ttt_attention_eager, q, ks, vs)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)  # TF32-free kernels, fp32 softmax


def test_ttt_attention_flex_lengths_grads():
    """Right padding: padded query rows are 0 and pass no gradient; valid rows and all
    gradients match eager run on the valid prefix only."""
    T, k, L = 300, 2, 211
    q, ks, vs = _ttt_inputs(T, k)
    out = ttt_attention_flex(q, ks, vs, lengths=torch.tensor([L], device="cuda"))
    assert (out[:, :, L:] == 0).all()
    dout = torch.randn(out[:, :, :L].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    got = [out[:, :, :L], *torch.autograd.grad(out[:, :, :L], [q, *ks, *vs], dout.to(out.dtype))]
    for g in got[1:]:
        assert (g[:, :, L:] == 0).all()
    got = [got[0]] + [g[:, :, :L] for g in got[1:]]

    def prefix(dtype):
        sl = lambda x: x.detach()[:, :, :L].to(dtype).requires_grad_()  # noqa: E731
        q2, ks2, vs2 = sl(q), [sl(x) for x in ks], [sl(x) for x in vs]
        out2 = ttt_attention_eager(q2, ks2, vs2)
        return [out2, *torch.autograd.grad(out2, [q2, *ks2, *vs2], dout.to(dtype))]

    _assert_as_accurate(got, prefix(torch.bfloat16), prefix(torch.float32))


def _packed_doc_ids(T, B=2):
    """Packed rows (data/packing.py labels): boundaries inside and on flex blocks; row 1 ends in padding (-1)."""
    doc = torch.full((B, T), -1, dtype=torch.int32)
    cuts = [[0, 100, 128, 417, T], [0, 256, 333, T - 57]]
    for b in range(B):
        for j, (a, e) in enumerate(zip(cuts[b][:-1], cuts[b][1:])):
            doc[b, a:e] = j
    return doc.cuda()


@pytest.mark.parametrize("impl", ["flex", "flex_buf"])
@pytest.mark.parametrize("T,k", [(600, 0), (600, 3), (1000, 6)])
def test_ttt_attention_flex_document_grads(impl, T, k):
    """Packed rows: flex (concatenated K/V, and the buffered TTTFlexAttention) with the document block mask,
    forward and every gradient, against the dense eager reference with the same document mask."""
    doc = _packed_doc_ids(T)
    g = torch.Generator(device="cuda").manual_seed(2)

    def mk(h):
        return torch.randn(2, h, T, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()

    q, ks, vs = mk(8), [mk(2) for _ in range(k + 1)], [mk(2) for _ in range(k + 1)]

    def flex(q, ks, vs, doc_ids):
        if impl == "flex":
            return ttt_attention_flex(q, ks, vs, doc_ids=doc_ids)
        att = TTTFlexAttention(len(ks))
        out = None
        for s in range(len(ks)):  # one unroll: every step's call, the last one's output checked
            out = att(q, ks[: s + 1], vs[: s + 1], doc_ids=doc_ids)
        return out

    truth = _fwd_bwd(ttt_attention_eager, *_upcast(q, ks, vs), doc_ids=doc)
    eager = _fwd_bwd(ttt_attention_eager, q, ks, vs, doc_ids=doc)
    got = _fwd_bwd(flex, q, ks, vs, doc_ids=doc)
    _assert_as_accurate(got, eager, truth)


# --------------------------------------------------------------------------- cross-entropy
def _ce_module():
    if type(kernels.ce._ce_fwd_kernel).__name__ != "JITFunction":
        pytest.skip("kernels.ce was built by the Triton interpreter in this process")
    return kernels.ce


def _ce_data(N, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(N, V, device="cuda", generator=g) * 3).to(dtype)
    p = torch.softmax(torch.randn(N, V, device="cuda", generator=g) * 2, -1)
    p[: N // 3] *= 0.5
    mask = (torch.rand(N, device="cuda", generator=g) > 0.3).float()
    return logits, p.to(dtype), mask


def _ref_soft(logits, p, mask):
    return (mask * -(p.float() * torch.log_softmax(logits.float(), -1)).sum(-1)).sum()


def _check_argmax(argmax, logits, live, atol=0.0):
    # GEMM rounding may break near-ties differently: the chosen logit must be the max (± atol)
    chosen = logits.float()[live].gather(1, argmax[live][:, None])[:, 0]
    torch.testing.assert_close(chosen, logits.float()[live].max(-1).values, atol=atol, rtol=0)
    assert (argmax[~live] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(47, 31), (123, 1000), (1024, 32000), (257, 64000)])
def test_soft_ce_gpu(N, V, dtype):
    ce = _ce_module()
    logits, p, mask = _ce_data(N, V, dtype)
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, argmax = ce.soft_cross_entropy(leaf * 1, p, mask, return_argmax=True)
    loss.backward()
    want = _ref_soft(ref_leaf, p, mask)
    want.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, want, atol=tol * want.abs().item(), rtol=tol)
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), atol=tol, rtol=tol)
    _check_argmax(argmax, logits, mask != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hard_ce_gpu(dtype):
    ce = _ce_module()
    N, V = 517, 32000
    logits, _, mask = _ce_data(N, V, dtype)
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::7] = -100
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = ce.hard_cross_entropy(leaf * 1, labels, mask)
    loss.backward()
    w = mask * (labels >= 0)
    want = (w * torch.nn.functional.cross_entropy(ref_leaf.float(), labels.clamp_min(0), reduction="none")).sum()
    want.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss, want, atol=tol * want.abs().item(), rtol=tol)
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), atol=tol, rtol=tol)


def test_soft_ce_under_compile():
    """Inside a compiled function the CE op is excluded from the graph (inductor's functionalised
    in-place backward was wrong on torch 2.11) and stays exact."""
    ce = _ce_module()
    logits, p, mask = _ce_data(300, 5000, torch.bfloat16)
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    f = torch.compile(lambda z, p, m: ce.soft_cross_entropy(z * 1, p, m))
    loss = f(leaf, p, mask)
    loss.backward()
    want = _ref_soft(ref_leaf, p, mask)
    want.backward()
    torch.testing.assert_close(loss, want, atol=2e-2 * want.abs().item(), rtol=2e-2)
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V,chunk", [(123, 64, 1000, 32), (4096, 1024, 32000, 1024)])
def test_fused_linear_soft_ce_gpu(N, H, V, chunk, dtype):
    _ce_module()
    g = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dtype)
    _, p, mask = _ce_data(N, V, dtype, seed=4)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = (
        hidden.float().clone().requires_grad_(),
        weight.float().clone().requires_grad_(),
    )  # fp32 truth (clone: .float() aliases fp32 inputs)
    h3, w3 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()  # eager, same dtype
    loss, argmax = fused_linear_soft_ce(h1, w1, p, mask, chunk_size=chunk)
    loss.backward()
    truth = _ref_soft(h2 @ w2.T, p, mask)
    truth.backward()
    eager = _ref_soft(h3 @ w3.T, p, mask)
    eager.backward()
    _assert_as_accurate([loss, h1.grad, w1.grad], [eager, h3.grad, w3.grad], [truth, h2.grad, w2.grad], slack=1e-3)
    _check_argmax(argmax, hidden @ weight.T, mask != 0, atol=1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("T,n", [(256, 4), (1000, 7)])
def test_ttt_flex_buffer_unroll_grads(T, n):
    """TTTFlexAttention over a whole unroll (each step's K/V written once into shared buffers):
    outputs and all gradients equal the concatenating flex path's, bf16."""
    g = torch.Generator(device="cuda").manual_seed(2)

    def mk(h):
        return torch.randn(1, h, T, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()

    qs, ks, vs = [mk(8) for _ in range(n)], [mk(2) for _ in range(n)], [mk(2) for _ in range(n)]
    douts = [torch.randn(1, 8, T, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n)]

    def unroll(attend):
        outs = [attend(qs[s], ks[: s + 1], vs[: s + 1]) for s in range(n)]
        return outs + list(torch.autograd.grad(outs, qs + ks + vs, douts))

    got, want = unroll(TTTFlexAttention(n)), unroll(ttt_attention_flex)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
