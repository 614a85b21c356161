"""Mask factories vs brute-force boolean masks built with explicit Python loops.

For every mask and odd length: (1) the mask_mod evaluated on index grids equals the brute
force element by element; (2) create_block_mask's block layout covers exactly the blocks
where the brute force has any True, and marks as full only blocks that are all True;
(3) flex attention (eager, and compiled for one length) equals dense masked attention.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import _ordered_to_dense  # block lists -> [.., nq, nkv]

from kernels.masks import (
    causal_mask,
    create_block_mask,
    dense_attention,
    dflash_mask,
    document_mask,
    flex_attention_compiled,
    flex_attention_eager,
    mask_grid,
    peagle_mask,
    ttt_document_mask,
    ttt_mask,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

LENGTHS = [1, 7, 129, 232]
B = 2


# ---------------------------------------------------------------- brute force, one case each
# Each case returns (mask_mod, brute [B, Q, KV] bool, Q_LEN, KV_LEN).


def case_causal(T):
    lengths = [T, (T + 1) // 2]  # row 1 right-padded
    brute = [[[i >= j and i < L and j < L for j in range(T)] for i in range(T)] for L in lengths]
    return causal_mask(torch.tensor(lengths)), brute, T, T


def case_document(T, shared=False):
    g = torch.Generator().manual_seed(T)
    rows = []
    for b in range(1 if shared else B):
        cuts = sorted(torch.randint(0, T + 1, (3,), generator=g).tolist())
        doc = [sum(i >= c for c in cuts) for i in range(T)]
        if b == 1:  # trailing padding
            doc = [d if i < (T + 1) // 2 else -1 for i, d in enumerate(doc)]
        rows.append(doc)
    brute = [[[d[i] == d[j] and d[i] >= 0 and i >= j for j in range(T)] for i in range(T)] for d in rows]
    doc_ids = torch.tensor(rows[0] if shared else rows)
    return document_mask(doc_ids), brute * (B if shared else 1), T, T


def case_ttt(T, k=2):
    lengths = [T, (T + 1) // 2]

    def allowed(L, i, kv):
        s, j = divmod(kv, T)
        return i < L and ((s == 0 and j <= i) or (s > 0 and j == i))

    brute = [[[allowed(L, i, kv) for kv in range((k + 1) * T)] for i in range(T)] for L in lengths]
    return ttt_mask(k, T, torch.tensor(lengths)), brute, T, (k + 1) * T


def packed_doc_ids(T, seed):
    """Labels of a packed row (data/packing.py): 0, 1, ... growing along the row; row 1 ends in padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        cuts = sorted(torch.randint(0, T + 1, (3,), generator=g).tolist())
        doc = [sum(i >= c for c in cuts) for i in range(T)]
        rows.append([d if b == 0 or i < (T + 1) // 2 else -1 for i, d in enumerate(doc)])
    return rows


def case_ttt_document(T, k=2):
    """TTT over packed rows: step-0 keys causal and in the query's document; padding is a document of its own."""
    rows = packed_doc_ids(T, T + 1)

    def allowed(d, i, kv):
        s, j = divmod(kv, T)
        return (s == 0 and j <= i and d[i] == d[j]) or (0 < s <= k and j == i)

    brute = [[[allowed(d, i, kv) for kv in range((k + 1) * T)] for i in range(T)] for d in rows]
    return ttt_document_mask(k, T, torch.tensor(rows)), brute, T, (k + 1) * T


def case_dflash(T, window=None, n=3, bs=5):
    g = torch.Generator().manual_seed(T)
    anchors = torch.randint(0, T + 1, (B, n), generator=g)
    anchors[1, -1] = 0  # an unused block: sees only itself

    def allowed(a_row, q, kv):
        blk = q // bs
        a = a_row[blk]
        if kv < T:
            return kv < a and (window is None or kv >= a - window)
        return (kv - T) // bs == blk

    brute = [[[allowed(a_row, q, kv) for kv in range(T + n * bs)] for q in range(n * bs)] for a_row in anchors.tolist()]
    return dflash_mask(T, bs, anchors, window), brute, n * bs, T + n * bs


def case_dflash_packed(T, n=3, bs=5):
    """Packed rows: each block sees context only from its own document's start (starts) up to its anchor."""
    g = torch.Generator().manual_seed(T + 2)
    anchors = torch.randint(0, T + 1, (B, n), generator=g)
    starts = torch.minimum(torch.randint(0, T + 1, (B, n), generator=g), anchors)
    anchors[1, -1], starts[1, -1] = 0, 0  # an unused block

    def allowed(a_row, s_row, q, kv):
        blk = q // bs
        if kv < T:
            return s_row[blk] <= kv < a_row[blk]
        return (kv - T) // bs == blk

    brute = [
        [[allowed(a_row, s_row, q, kv) for kv in range(T + n * bs)] for q in range(n * bs)]
        for a_row, s_row in zip(anchors.tolist(), starts.tolist())
    ]
    return dflash_mask(T, bs, anchors, starts=starts), brute, n * bs, T + n * bs


def case_peagle(T, D=3):
    """T base tokens in two documents, then rollouts of depth 1..D-1 from every third
    position, then 5 padding slots (doc -1); row 1 has its elements shuffled."""
    g = torch.Generator().manual_seed(T)
    doc_base = [0 if i < (T + 1) // 2 else 1 for i in range(T)]
    pos_base = [i if d == 0 else i - (T + 1) // 2 for i, d in zip(range(T), doc_base)]  # restart per doc
    pos, depth, doc = list(pos_base), [0] * T, list(doc_base)
    for a in range(0, T, 3):
        for d in range(1, D):
            pos.append(pos_base[a]), depth.append(d), doc.append(doc_base[a])
    pos, depth, doc = pos + [0] * 5, depth + [0] * 5, doc + [-1] * 5
    rows = [(pos, depth, doc)]
    perm = torch.randperm(len(pos), generator=g).tolist()
    rows.append(tuple([r[p] for p in perm] for r in rows[0]))
    L = len(pos)

    def allowed(p, d, c, a, b):
        if c[a] < 0 or c[a] != c[b]:
            return False
        to_base = d[b] == 0 and p[b] <= p[a]
        own = d[a] > 0 and d[b] > 0 and p[b] == p[a] and d[b] <= d[a]
        return to_base or own

    brute = [[[allowed(p, d, c, a, b) for b in range(L)] for a in range(L)] for p, d, c in rows]
    t = lambda i: torch.tensor([r[i] for r in rows])  # noqa: E731
    return peagle_mask(t(0), t(1), t(2)), brute, L, L


CASES = {
    "causal": case_causal,
    "document": case_document,
    "document_shared": lambda T: case_document(T, shared=True),
    "ttt_k0": lambda T: case_ttt(T, k=0),
    "ttt_k2": case_ttt,
    "ttt_document_k0": lambda T: case_ttt_document(T, k=0),
    "ttt_document_k2": case_ttt_document,
    "dflash": case_dflash,
    "dflash_window": lambda T: case_dflash(T, window=3),
    "dflash_packed": case_dflash_packed,
    "peagle": case_peagle,
}


def _blocks(brute_BQK: torch.Tensor, bs: int, reduce):
    """Block-level any/all of an element mask; padding counts as False (never full)."""
    Bn, Q, K = brute_BQK.shape
    nq, nk = -(-Q // bs), -(-K // bs)
    padded = torch.zeros(Bn, nq * bs, nk * bs, dtype=torch.bool)
    padded[:, :Q, :K] = brute_BQK
    return reduce(padded.view(Bn, nq, bs, nk, bs).transpose(2, 3).flatten(-2), -1)


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("name", list(CASES))
def test_mask_matches_brute_force(name, T):
    mask_mod, brute, Q, KV = CASES[name](T)
    brute = torch.tensor(brute, dtype=torch.bool)  # [B, Q, KV]
    assert brute.shape == (B, Q, KV)
    grid = mask_grid(mask_mod, B, 1, Q, KV)[:, 0]
    assert torch.equal(grid, brute)
    bs = 32  # small blocks so that the layout check sees many blocks
    bm = create_block_mask(mask_mod, B, None, Q, KV, device="cpu", BLOCK_SIZE=bs)
    assert torch.equal(bm.to_dense()[:, 0].bool(), _blocks(brute, bs, torch.any))
    full_dense = _ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
    assert torch.equal(full_dense[:, 0].bool(), _blocks(brute, bs, torch.all))


def _qkv(Q, KV, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Q, D, generator=g)
    k, v = torch.randn(2, B, Hkv, KV, D, generator=g)
    return q, k, v


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("name", list(CASES))
def test_flex_eager_equals_dense(name, T):
    mask_mod, brute, Q, KV = CASES[name](T)
    mask = torch.tensor(brute, dtype=torch.bool)[:, None]
    q, k, v = _qkv(Q, KV)
    bm = create_block_mask(mask_mod, B, None, Q, KV, device="cpu")
    out = flex_attention_eager(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(out, dense_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["causal", "document", "ttt_k2", "ttt_document_k2", "dflash_window", "peagle"])
def test_flex_compiled_equals_dense(name):
    # one odd, padded length per mask: every compile costs seconds on this CPU
    mask_mod, brute, Q, KV = CASES[name](129)
    mask = torch.tensor(brute, dtype=torch.bool)[:, None]
    q, k, v = _qkv(Q, KV, seed=1)
    bm = create_block_mask(mask_mod, B, None, Q, KV, device="cpu")
    out = flex_attention_compiled(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(out, dense_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
