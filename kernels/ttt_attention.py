"""EAGLE-3 training-time-test (TTT) attention.

At TTT step k the draft has keys/values from every earlier step. Query i of step k sees
  * step-0 keys j <= i (ordinary causal attention over the real prefix), and
  * the key at the same position i of each later step 1..k (the "diagonal suffix"),
because step s at position i stands for the token the draft itself proposed s places ahead
of position i; no other position's proposals are visible to it.

Shapes: q_BHTD [B, Hq, T, D] (rope applied); ks/vs: lists of k+1 tensors [B, Hkv, T, D],
step 0 first. GQA: Hq = g * Hkv. Right padding needs no extra mask: a valid query never
reaches a padded key through the causal part, and diagonal keys sit at its own position.
Packed rows (data/packing.py) pass doc_ids [B, T] (labels growing along a row, -1 = padding):
step-0 keys must then also be in the query's document (kernels/masks.py ttt_document_mask);
the diagonal keys are at the query's own position, so they never cross a boundary.

Three implementations, one contract (out [B, Hq, T, D]):
  ttt_attention_eager  reference; materialises [T, T + k] probabilities
  ttt_attention_lse    fused causal SDPA + k diagonal terms merged by log-sum-exp, custom
                       backward; O(T) extra memory, trains on CPU and GPU
  ttt_attention_flex   one flex_attention call over concatenated keys with the TTT block mask;
                       forward-only on CPU (flex has no CPU backward); --attention flex
  TTTFlexAttention     the same over one unroll, keys/values written once into shared buffers
                       (no per-step concatenation); --attention flex_buf. Measured on the H200
                       it peaks higher than ttt_attention_flex (see the note above the class)
"""

import math

import torch

from kernels.masks import BlockMask, flex_attention_compiled, flex_attention_eager, ttt_document_mask, ttt_mask


def _expand_kv(x_BHTD: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BHTD if groups == 1 else x_BHTD.repeat_interleave(groups, dim=1)


def step0_mask(T: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor:
    """Which step-0 keys a query sees: causal [T, T], or with doc_ids [B, T] causal and same
    document [B, 1, T, T] (padding is a document of its own: no empty row)."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if doc_ids is None:
        return causal
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


def ttt_attention_eager(q, ks, vs, doc_ids: torch.Tensor | None = None):
    """Reference: materialise [T, T] causal logits plus k diagonal columns, one softmax."""
    B, Hq, T, D = q.shape
    g = Hq // ks[0].shape[1]
    scale = 1.0 / math.sqrt(D)
    k0, v0 = _expand_kv(ks[0], g), _expand_kv(vs[0], g)
    scores_BHTT = (q @ k0.transpose(-1, -2)) * scale
    causal = step0_mask(T, doc_ids, q.device)
    scores_BHTT = scores_BHTT.masked_fill(~causal, float("-inf"))
    # diag_BHTk[..., s-1] = q_i . k_s,i for the later steps s = 1..k
    diag = [(q * _expand_kv(k, g)).sum(-1, keepdim=True) * scale for k in ks[1:]]
    probs = torch.cat([scores_BHTT, *diag], dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :T] @ v0
    for s, v in enumerate(vs[1:]):
        out = out + probs[..., T + s : T + s + 1] * _expand_kv(v, g)
    return out


# ---------------------------------------------------------------------------------------------
# Memory-lean version: fused causal attention over step 0 (never a [T, T] tensor of ours) and
# the k diagonal terms, merged by log-sum-exp (the split-softmax merge of flash-decoding).
#
# Backward trick: for the full softmax over [causal keys, diagonal keys] with output O and
# log-sum-exp L, the causal block's gradient is exactly what a flash backward computes when it
# is handed the *merged* O and L instead of its own: it rebuilds P_ij = exp(s_ij - L_i) and
# dS_ij = P_ij (dO_i . v_j - dO_i . O_i). So no gradient through the kernel's lse is needed;
# the k diagonal columns get the same formula elementwise. Memory saved for backward:
# q, ks, vs, O (inputs/outputs that exist anyway) plus L [B, Hq, T] and P_diag [B, Hq, T, k].
# ---------------------------------------------------------------------------------------------


def _causal_fwd(q, k, v, scale, mask=None):
    """(out [B,H,T,D] q.dtype, lse [B,H,T] fp32, aux for backward); k, v already have Hq heads.
    mask: additive [B, 1, T, T] (0 / -inf) replacing the causal one (packed rows; CPU only)."""
    T = q.shape[2]
    if q.device.type == "cpu":
        if mask is not None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask, scale=scale
            )
            return out, lse, (mask,)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if mask is not None:  # the CUDA flash kernel takes no mask; train.py refuses lse + packing on GPU
        raise NotImplementedError(
            "ttt_attention_lse with document masks (packed rows) runs on CPU only; use flex on the GPU"
        )
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = r[:8]
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    # fp32 (or odd head dims) on CUDA: memory-efficient attention; its lse is padded to 32 rows
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale
    )
    return out, lse[..., :T], ("efficient", lse.shape[-1], seed, offset)


def _causal_bwd(dout, q, k, v, out, lse, aux, scale):
    if q.device.type == "cpu":
        if aux:  # the packed rows' mask
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, False, attn_mask=aux[0], scale=scale
            )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    if aux[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
        )
    _, padded_T, seed, offset = aux
    lse = torch.nn.functional.pad(lse, (0, padded_T - lse.shape[-1]))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale
    )
    return dq, dk, dv


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """q-side tensor [B, Hq, T, ...] -> [B, Hkv, g, T, ...] so that a kv tensor [B, Hkv, T, ...]
    broadcasts against it as kv[:, :, None]: GQA without materialising repeated kv heads."""
    B, Hq = x.shape[:2]
    return x.view(B, Hq // groups, groups, *x.shape[2:])


def _group_sum(x_BHTD: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, T, D]: gradient of _expand_kv (repeat_interleave)."""
    return x_BHTD if groups == 1 else _grouped(x_BHTD, groups).sum(2)


class _TTTAttentionLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, mask, *kvs):
        n = len(kvs) // 2  # k + 1 steps
        ks, vs = kvs[:n], kvs[n:]
        B, Hq, T, D = q.shape
        g = Hq // ks[0].shape[1]
        scale = 1.0 / math.sqrt(D)
        out0, lse0, aux = _causal_fwd(q, _expand_kv(ks[0], g), _expand_kv(vs[0], g), scale, mask)
        lse = lse0.float()  # [B,Hq,T]; becomes the lse over all T + k logits of each row
        p_diag = None
        if n > 1:
            qg = _grouped(q, g).float()
            # diag_BHTk[..., s-1] = q_i . k_s,i * scale: the k extra logits of row i
            diag = torch.stack([(qg * k.float()[:, :, None]).sum(-1).view(B, Hq, T) for k in ks[1:]], -1) * scale
            lse = torch.cat([lse[..., None], diag], -1).logsumexp(-1)
            p_diag = torch.exp(diag - lse[..., None])  # [B,Hq,T,k] their softmax weights
        out = torch.exp(lse0.float() - lse)[..., None] * out0.float()
        for s, v in enumerate(vs[1:]):
            _grouped(out, g).add_(_grouped(p_diag[..., s, None], g) * v.float()[:, :, None])
        out = out.to(q.dtype)
        ctx.aux, ctx.scale, ctx.n = aux, scale, n
        ctx.save_for_backward(q, *kvs, out, lse, p_diag)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, *rest = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs, (out, lse, p_diag) = rest[:n], rest[n : 2 * n], rest[2 * n :]
        g = q.shape[1] // ks[0].shape[1]
        dout = dout.to(q.dtype).contiguous()  # autograd may hand us an expanded (stride-0) grad
        # causal block: the kernel's backward with the merged out/lse (see the comment above)
        dq, dk0, dv0 = _causal_bwd(dout, q, _expand_kv(ks[0], g), _expand_kv(vs[0], g), out, lse, ctx.aux, scale)
        dks, dvs = [_group_sum(dk0, g)], [_group_sum(dv0, g)]
        if n > 1:
            do32, q32 = _grouped(dout.float(), g), _grouped(q.float(), g)  # [B,Hkv,g,T,D]
            dq = dq.float()
            delta = (do32 * _grouped(out.float(), g)).sum(-1, keepdim=True)  # dO_i . O_i
            for s in range(n - 1):
                k, v = ks[s + 1].float()[:, :, None], vs[s + 1].float()[:, :, None]
                p = _grouped(p_diag[..., s, None], g)  # [B,Hkv,g,T,1]
                ds = p * ((do32 * v).sum(-1, keepdim=True) - delta) * scale  # d loss / d q_i.k_i
                _grouped(dq, g).add_(ds * k)
                dks.append((ds * q32).sum(2).to(ks[s + 1].dtype))
                dvs.append((p * do32).sum(2).to(vs[s + 1].dtype))
        return (dq.to(q.dtype), None, *dks, *dvs)


def ttt_attention_lse(q, ks, vs, doc_ids: torch.Tensor | None = None):
    """Same contract as ttt_attention_eager, O(T) extra memory: fused causal kernel + k
    diagonal terms merged by log-sum-exp; custom backward (see the comment above). With doc_ids
    (packed rows, CPU only) the fused kernel takes the [B, 1, T, T] causal-and-same-document mask."""
    if q.device.type not in ("cpu", "cuda"):
        return ttt_attention_eager(q, ks, vs, doc_ids)
    mask = None
    if doc_ids is not None:  # the CPU kernel takes an additive mask of q's dtype ([B, 1, T, T]; no row is empty)
        allowed = step0_mask(q.shape[2], doc_ids, q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return _TTTAttentionLSE.apply(q, mask, *ks, *vs)


# ---------------------------------------------------------------------------------------------
# FlexAttention version: keys/values of all steps concatenated along the sequence, one flex
# call with the TTT mask (kernels/masks.py). Every step is padded to a multiple of the block
# size so steps never share a KV block: step 0 is block-causal and steps 1..k contribute one
# diagonal block per query block; queries are padded the same way, so the compiled kernel sees
# only (Tp, (k+1) Tp) shapes (one compile per 128-bucket of T and per k).
# The BlockMask is built from that known block structure (no dense [T, (k+1)T] mask is ever
# evaluated); without lengths it depends only on (Tp, k, device) and is cached.
# ---------------------------------------------------------------------------------------------
FLEX_BLOCK = 128
# kernel_options handed to every compiled flex call ({} = flex's defaults); a knob for kernel
# tuning experiments (experiments/bench_kernels.py --flex-kernel-options), part of the compile key
FLEX_KERNEL_OPTIONS: dict = {}


def _dense_to_kv_blocks(dense_BHqk: torch.Tensor):
    """Block-level bool [B, H, nq, nkv] -> (num_blocks [B,H,nq], indices [B,H,nq,nkv]) int32."""
    num = dense_BHqk.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense_BHqk.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def ttt_block_mask(
    Tp: int,
    k: int,
    lengths: torch.Tensor | None,
    device,
    block: int = FLEX_BLOCK,
    doc_ids: torch.Tensor | None = None,
    kv_steps: int | None = None,
) -> BlockMask:
    """BlockMask for ttt_mask(k, Tp, lengths) with Q_LEN = Tp, KV_LEN = (k+1) Tp, Tp % block == 0.
    kv_steps (>= k + 1): KV_LEN = kv_steps * Tp instead, the keys of steps k+1.. in no block and masked,
    and the mask_mod holds k as a tensor: every step of an unroll then has one shape and one mask_mod code
    with equal Python constants, which is what compiled flex guards on (a closure's tensors are inputs to
    it): TTTFlexAttention compiles once for the unroll instead of once per step.

    Block (qb, kb) with step s = kb // nb, key block jb = kb % nb is full when s == 0 and
    jb < qb (every key precedes every query) and partial (mask_mod evaluated) on the
    diagonal jb == qb of every step. With lengths [B], query blocks entirely past lengths[b]
    are dropped and a full block whose queries are only partly valid becomes partial.
    With doc_ids [B, Tp] (packed rows; labels never decrease along a row and padding, -1, sits
    at its end: data/packing.py) the mask is ttt_document_mask: a step-0 block below the
    diagonal is kept only if its keys' last document reaches the queries' first one, and is full
    only if keys and queries all lie in one document.
    """
    assert Tp % block == 0
    assert lengths is None or doc_ids is None, "packed rows mark padding by doc_ids, not lengths"
    nb = Tp // block
    n = k + 1 if kv_steps is None else kv_steps
    assert n > k
    qb = torch.arange(nb, device=device)[:, None]
    kb = torch.arange(n * nb, device=device)[None, :]
    s, jb = kb // nb, kb % nb
    full = ((s == 0) & (jb < qb))[None, None]  # [1, 1, nq, nkv]
    partial = ((jb == qb) & (s <= k))[None, None]
    step = k if kv_steps is None else torch.tensor(k, device=device)  # a tensor: no guard on its value
    mask_mod = ttt_mask(step, Tp, lengths)
    if lengths is not None:
        L = lengths.to(device).view(-1, 1, 1, 1)
        q_all_valid = (qb[None, None] + 1) * block <= L  # [B, 1, nq, 1]
        q_any_valid = qb[None, None] * block < L
        partial = (partial | (full & ~q_all_valid)) & q_any_valid
        full = full & q_all_valid
    if doc_ids is not None:
        B = doc_ids.shape[0]
        d = doc_ids.to(device).long()
        d = torch.where(d < 0, d.amax() + 1, d).view(B, nb, block)  # padding: one more, last, label
        lo, hi = d.amin(-1), d.amax(-1)  # [B, nb] first / last document of each block
        q_lo, q_hi = lo[:, None, :, None], hi[:, None, :, None]  # [B, 1, nq, 1]
        k_lo, k_hi = (
            lo[:, jb[0]][:, None, None],
            hi[:, jb[0]][:, None, None],
        )  # [B, 1, 1, nkv] (key block of each column)
        reach = k_hi >= q_lo  # keys precede queries (jb <= qb), so they share a document iff this
        one_doc = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        step0 = (s == 0)[None, None]
        partial = (partial & ~step0) | (step0 & (jb <= qb)[None, None] & reach & ~((jb < qb)[None, None] & one_doc))
        full = full & one_doc
        mask_mod = ttt_document_mask(step, Tp, doc_ids.to(device))
    return BlockMask.from_kv_blocks(
        *_dense_to_kv_blocks(partial),
        *_dense_to_kv_blocks(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(Tp, n * Tp),
    )


_BLOCK_MASKS: dict = {}  # (Tp, k, kv_steps, device) -> BlockMask, for calls without lengths


def _cached_ttt_block_mask(Tp: int, k: int, device: torch.device, kv_steps: int | None = None) -> BlockMask:
    if torch.compiler.is_compiling():  # inside a compiled step: built once, in the graph
        return ttt_block_mask(Tp, k, None, device, kv_steps=kv_steps)
    key = (Tp, k, kv_steps, str(device))
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = ttt_block_mask(Tp, k, None, device, kv_steps=kv_steps)
    return _BLOCK_MASKS[key]


def ttt_attention_flex(
    q, ks, vs, lengths: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None, *, compiled: bool = True
):
    """Same contract as ttt_attention_eager, through one flex_attention call.

    lengths [B] (optional): queries at i >= lengths[b] see nothing and return 0. doc_ids [B, T]
    (optional, packed rows): step-0 keys only in the query's document. compiled=False runs eager
    flex (materialises scores; CPU tests). Flex has no backward on CPU.
    """
    T = q.shape[2]
    Tp = -(-T // FLEX_BLOCK) * FLEX_BLOCK
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, Tp - T)) if Tp != T else x  # noqa: E731
    k_cat, v_cat = torch.cat([pad(x) for x in ks], 2), torch.cat([pad(x) for x in vs], 2)  # [B,Hkv,(k+1)Tp,D]
    return _flex_steps(q, k_cat, v_cat, Tp, len(ks) - 1, lengths, compiled, doc_ids)


def _flex_steps(q, k_all, v_all, Tp: int, k: int, lengths, compiled: bool, doc_ids=None, kv_steps=None):
    """The flex call of TTT step k: q [B, Hq, T, D] against k_all / v_all [B, Hkv, n Tp, D], steps 0..k at
    offsets s * Tp, each zero-padded to Tp; n = k + 1, or kv_steps (TTTFlexAttention's whole buffers: the
    later slots masked, ttt_block_mask's kv_steps). Returns [B, Hq, T, D]."""
    T = q.shape[2]
    assert k_all.shape[2] == (k + 1 if kv_steps is None else kv_steps) * Tp
    q_p = torch.nn.functional.pad(q, (0, 0, 0, Tp - T)) if Tp != T else q
    if doc_ids is not None:  # the Tp - T padded positions are padding (-1) too
        doc_ids = torch.nn.functional.pad(doc_ids, (0, Tp - T), value=-1) if Tp != T else doc_ids
        block_mask = ttt_block_mask(Tp, k, None, q.device, doc_ids=doc_ids, kv_steps=kv_steps)
    elif lengths is None:
        block_mask = _cached_ttt_block_mask(Tp, k, q.device, kv_steps)
    else:
        block_mask = ttt_block_mask(Tp, k, lengths, q.device, kv_steps=kv_steps)
    flex = flex_attention_compiled if compiled else flex_attention_eager
    opts = {"kernel_options": dict(FLEX_KERNEL_OPTIONS)} if FLEX_KERNEL_OPTIONS and compiled else {}
    out = flex(q_p, k_all, v_all, block_mask=block_mask, enable_gqa=q.shape[1] != k_all.shape[1], **opts)
    return out[:, :, :T]


# ---------------------------------------------------------------------------------------------
# Flex over one TTT unroll without re-concatenating. ttt_attention_flex builds k_cat / v_cat anew
# at every step, and each step's copies stay saved for backward: at TTT 7 that is 1+2+...+7 = 28
# step-sized K and V copies (at seq 4096, 8 KV heads of 128: 0.44 GiB, half of flex's peak).
# Here each step writes only its own keys/values into one buffer [B, Hkv, n * Tp, D] per tensor
# and attends over the whole buffer, the later steps' slots masked (since 2026-12-05; before, over its
# first (k+1) * Tp rows, a view, a new shape each step and so a compile of flex per step).
# The write goes through .data on purpose: earlier steps' flex calls saved the buffer for their
# backward, and a tracked in-place write would bump the version counter it shares and fail that
# backward, although what those calls read never changes: slots 0..k are never written again, and
# the later slots a step k saved (written after it) are masked, in no block of its mask, so neither
# its forward nor its backward kernel reads them. _WriteStep's backward routes the buffer's gradient:
# its slice to the step's k (or v), the whole to the earlier writes.
# Measured on the H200 with the views of the first (k+1) * Tp rows (2026-11-29, bench_kernels.py,
# seq 4096, TTT 7, bf16): 1.37 GiB peak and 15.5 ms against the concatenating path's 0.83 GiB and
# 15.0 ms, so it is not the default; with the whole buffers (H100, 2026-12-05, the main job's whole step:
# experiments/results/defaults_h100_run2/) 1.0 GiB less than flex at the step's peak and one compile
# instead of seven, but 6% slower a warm step, so still not the default. Not yet
# explained: on CPU, with a stand-in for flex that saves its inputs and returns fresh gradients, the
# buffers, write chain included, peak lower than the concatenation (62 vs 72 step-sized tensors at
# TTT 7 with the views, 68 with the whole buffers; experiments/flex_buf_memory_cpu.py), so the excess
# most likely sits in compiled flex's handling of the buffers; a CUDA memory snapshot would tell.
# ---------------------------------------------------------------------------------------------
class _WriteStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, x, start: int):
        buf.data[:, :, start : start + x.shape[2]].copy_(x)
        ctx.start, ctx.T = start, x.shape[2]
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, g):
        return g, g[:, :, ctx.start : ctx.start + ctx.T], None


class TTTFlexAttention:
    """ttt_attention_flex for one TTT unroll of `steps` steps (one instance per forward), with the
    keys/values written once into shared buffers. Same contract per call: (q, ks, vs) with ks/vs
    the steps so far, of which only the newest is new. Inside a compiled region (train.py
    --compile) it defers to ttt_attention_flex, whose concatenation the compiler plans itself."""

    def __init__(self, steps: int, compiled: bool = True):
        self.steps, self.compiled, self.kb, self.vb, self.written = steps, compiled, None, None, 0

    def __call__(self, q, ks, vs, lengths: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None):
        if torch.compiler.is_compiling():
            return ttt_attention_flex(q, ks, vs, lengths, doc_ids, compiled=self.compiled)
        B, _, T, D = q.shape
        k = len(ks) - 1
        if k != self.written or k >= self.steps:
            raise ValueError(f"TTTFlexAttention: step {k} after {self.written} written steps of {self.steps}")
        Tp = -(-T // FLEX_BLOCK) * FLEX_BLOCK
        if self.kb is None:  # zeros: the padding rows of every step, as ttt_attention_flex pads
            self.kb, self.vb = (x.new_zeros(B, x.shape[1], self.steps * Tp, D) for x in (ks[0], vs[0]))
        self.kb = _WriteStep.apply(self.kb, ks[-1], k * Tp)
        self.vb = _WriteStep.apply(self.vb, vs[-1], k * Tp)
        self.written += 1
        # the whole buffers at every step (the slots of later steps visited by no block): one shape and one
        # mask_mod for the unroll, so compiled flex compiles once forward and once backward instead of per step
        return _flex_steps(q, self.kb, self.vb, Tp, k, lengths, self.compiled, doc_ids, kv_steps=self.steps)
