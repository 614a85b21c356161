"""TTT attention: the log-sum-exp and flex implementations against the eager reference."""

import pytest
import torch
from torch.nn.attention.flex_attention import _ordered_to_dense, create_block_mask

from kernels.masks import dense_attention, ttt_document_mask, ttt_mask
from kernels.ttt_attention import (
    ttt_attention_eager,
    ttt_attention_flex,
    ttt_attention_lse,
    ttt_block_mask,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

B, HKV, D = 2, 2, 16


def _inputs(T, k, groups, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, T, D, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(HKV * groups), [mk(HKV) for _ in range(k + 1)], [mk(HKV) for _ in range(k + 1)]


def _fwd_bwd(fn, q, ks, vs, seed=1):
    out = fn(q, ks, vs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad(out, [q, *ks, *vs], dout)
    return [out, *grads]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("T", [1, 7, 33, 129])
def test_lse_matches_eager_fp32(T, k, groups):
    q, ks, vs = _inputs(T, k, groups)
    for got, want in zip(_fwd_bwd(ttt_attention_lse, q, ks, vs), _fwd_bwd(ttt_attention_eager, q, ks, vs)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("k,T", [(0, 33), (3, 7), (3, 129)])
def test_lse_matches_eager_bf16(T, k, groups):
    """bf16: both implementations are compared with the fp32 result on the same (bf16-rounded)
    inputs; the lse path must be about as accurate as the eager bf16 path."""
    q, ks, vs = _inputs(T, k, groups, torch.bfloat16)
    up = lambda x: x.detach().float().requires_grad_()  # noqa: E731
    truth = _fwd_bwd(ttt_attention_eager, up(q), [up(x) for x in ks], [up(x) for x in vs])
    lse = _fwd_bwd(ttt_attention_lse, q, ks, vs)
    eager = _fwd_bwd(ttt_attention_eager, q, ks, vs)
    for got, ref, want in zip(lse, eager, truth):
        assert got.dtype == torch.bfloat16
        err = (got.float() - want).abs().max().item()
        ref_err = (ref.float() - want).abs().max().item()
        assert err <= 2 * ref_err + 2e-2 * want.abs().max().item(), (err, ref_err)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("T", [1, 7, 33, 129])
def test_flex_matches_eager(T, k, groups):
    q, ks, vs = _inputs(T, k, groups)
    with torch.no_grad():
        want = ttt_attention_eager(q, ks, vs)
        torch.testing.assert_close(ttt_attention_flex(q, ks, vs, compiled=False), want, atol=1e-5, rtol=1e-5)
        # right padding: valid rows unchanged, padded query rows are exactly 0
        L = (T + 1) // 2
        out = ttt_attention_flex(q, ks, vs, lengths=torch.tensor([T, L]), compiled=False)
        torch.testing.assert_close(out[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, :, :L], want[1, :, :L], atol=1e-5, rtol=1e-5)
        assert (out[1, :, L:] == 0).all()


def test_flex_compiled_matches_eager():
    q, ks, vs = _inputs(129, 2, 3)
    with torch.no_grad():
        out = ttt_attention_flex(q, ks, vs, lengths=torch.tensor([129, 70]))
        want = ttt_attention_eager(q, ks, vs)
    torch.testing.assert_close(out[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :, :70], want[1, :, :70], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_steps", [None, 4])
@pytest.mark.parametrize("lengths", [None, [256, 130, 1, 128]])
def test_ttt_block_mask_layout(lengths, kv_steps):
    """The hand-built block structure equals what create_block_mask derives from the mask_mod
    (partial and full blocks separately); with kv_steps over the whole buffer of later steps' keys."""
    Tp, k = 256, 2
    L = None if lengths is None else torch.tensor(lengths)
    nB = 1 if L is None else len(lengths)
    ours = ttt_block_mask(Tp, k, L, "cpu", kv_steps=kv_steps)
    ref = create_block_mask(ttt_mask(k, Tp, L), nB, None, Tp, (kv_steps or k + 1) * Tp, device="cpu")
    dense = lambda n, i: _ordered_to_dense(n, i, i.shape[-1]).bool()  # noqa: E731
    assert torch.equal(dense(ours.kv_num_blocks, ours.kv_indices), dense(ref.kv_num_blocks, ref.kv_indices))
    assert torch.equal(
        dense(ours.full_kv_num_blocks, ours.full_kv_indices), dense(ref.full_kv_num_blocks, ref.full_kv_indices)
    )
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_lse_strided_inputs_and_expanded_grad():
    """Heads-last layouts ([B, T, H, D].transpose(1, 2), as a model produces them) and the
    stride-0 gradient of out.sum() go through the custom backward unchanged."""
    T, k, groups = 33, 2, 3
    q, ks, vs = _inputs(T, k, groups)
    strided = lambda x: x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # noqa: E731
    q2, ks2, vs2 = strided(q), [strided(x) for x in ks], [strided(x) for x in vs]
    assert not q2.is_contiguous()
    ttt_attention_lse(q2, ks2, vs2).sum().backward()
    ttt_attention_eager(q, ks, vs).sum().backward()
    for a, b in zip([q2, *ks2, *vs2], [q, *ks, *vs]):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-5)


def test_lse_under_compile_fullgraph():
    """The draft step is compiled whole (fullgraph=True): the custom Function must trace."""
    q, ks, vs = _inputs(33, 2, 3)
    loss = torch.compile(lambda q, ks, vs: ttt_attention_lse(q, ks, vs).square().sum(), fullgraph=True)
    got = torch.autograd.grad(loss(q, ks, vs), [q, *ks, *vs])
    want = torch.autograd.grad(ttt_attention_eager(q, ks, vs).square().sum(), [q, *ks, *vs])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- packed rows (document ids)
def _doc_ids(T, seed=0):
    """Two packed rows (data/packing.py labels): row 0 three documents, row 1 two and padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        cuts = sorted(torch.randint(1, T + 1, (2,), generator=g).tolist())
        doc = [sum(i >= c for c in cuts) for i in range(T)]
        rows.append([d if b == 0 or i < (T + 2) // 2 else -1 for i, d in enumerate(doc)])
    return torch.tensor(rows, dtype=torch.int32)


def _brute_packed(q, ks, vs, doc):
    """dense_attention over [step 0 | step 1 | ...] keys with a mask from explicit loops."""
    T, n = q.shape[2], len(ks)
    allowed = torch.zeros(B, 1, T, n * T, dtype=torch.bool)
    for b in range(B):
        d = doc[b].tolist()
        for i in range(T):
            for j in range(i + 1):
                allowed[b, 0, i, j] = d[i] == d[j]
            for s in range(1, n):
                allowed[b, 0, i, s * T + i] = True
    return dense_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), allowed)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("T", [7, 33, 129])
def test_packed_paths_match_brute_force(T, k, groups):
    """eager (forward) against loops; lse and eager flex (forward) and lse's gradients against eager."""
    q, ks, vs = _inputs(T, k, groups)
    doc = _doc_ids(T, seed=T + k)
    fn = lambda impl: lambda q, ks, vs: impl(q, ks, vs, doc_ids=doc)  # noqa: E731
    with torch.no_grad():
        want = _brute_packed(q, ks, vs, doc)
        torch.testing.assert_close(ttt_attention_eager(q, ks, vs, doc_ids=doc), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ttt_attention_flex(q, ks, vs, doc_ids=doc, compiled=False), want, atol=1e-5, rtol=1e-5
        )
    for got, ref in zip(_fwd_bwd(fn(ttt_attention_lse), q, ks, vs), _fwd_bwd(fn(ttt_attention_eager), q, ks, vs)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_packed_row_equals_separate_documents():
    """A packed row's outputs on a document are those of that document alone (eager and lse),
    and perturbing one document changes nothing in its row-mates."""
    T, k = 40, 2
    q, ks, vs = _inputs(T, k, 2)
    doc = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 25 + [-1] * 15], dtype=torch.int32)
    for impl in (ttt_attention_eager, ttt_attention_lse):
        with torch.no_grad():
            out = impl(q, ks, vs, doc_ids=doc)
            for b, a, e in [(0, 0, 13), (0, 13, 33), (0, 33, 40), (1, 0, 25)]:
                cut = lambda x: x[b : b + 1, :, a:e]  # noqa: E731
                alone = impl(cut(q), [cut(x) for x in ks], [cut(x) for x in vs])
                torch.testing.assert_close(out[b : b + 1, :, a:e], alone, atol=1e-5, rtol=1e-5)
            ks2 = [x.clone() for x in ks]
            ks2[0][0, :, 13:33] += 1.0  # document 1 of row 0 only
            out2 = impl(q, ks2, vs, doc_ids=doc)
            assert torch.equal(out2[0, :, :13], out[0, :, :13]) and torch.equal(out2[0, :, 33:], out[0, :, 33:])
            assert not torch.allclose(out2[0, :, 14:33], out[0, :, 14:33])


@pytest.mark.parametrize("k,kv_steps", [(0, None), (2, None), (0, 3), (2, 3)])
def test_ttt_block_mask_layout_packed(k, kv_steps):
    """The block structure built from per-block document ranges equals create_block_mask's from ttt_document_mask
    (with kv_steps: over the whole buffer)."""
    Tp = 384
    doc = torch.full((3, Tp), -1, dtype=torch.int32)
    doc[0] = torch.tensor([0] * 100 + [1] * 200 + [2] * 84)  # boundaries inside blocks
    doc[1, :300] = torch.tensor([0] * 128 + [1] * 128 + [2] * 44)  # boundaries on blocks, then padding
    doc[2, :5] = 0  # one short document
    ours = ttt_block_mask(Tp, k, None, "cpu", doc_ids=doc, kv_steps=kv_steps)
    ref = create_block_mask(ttt_document_mask(k, Tp, doc), 3, None, Tp, (kv_steps or k + 1) * Tp, device="cpu")
    dense = lambda n, i: _ordered_to_dense(n, i, i.shape[-1]).bool()  # noqa: E731
    assert torch.equal(dense(ours.kv_num_blocks, ours.kv_indices), dense(ref.kv_num_blocks, ref.kv_indices))
    assert torch.equal(
        dense(ours.full_kv_num_blocks, ours.full_kv_indices), dense(ref.full_kv_num_blocks, ref.full_kv_indices)
    )
