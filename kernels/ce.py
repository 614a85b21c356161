"""Cross-entropy over a large vocabulary with an in-place backward (after Liger-Kernel).

    soft_cross_entropy(logits [N, V], target_p [N, V], mask [N]) = sum_n mask_n * H(p_n, softmax(z_n))
    hard_cross_entropy(logits [N, V], labels [N], mask [N])      = sum_n mask_n * -log softmax(z_n)[label_n]

Forward: one Triton program per row streams the vocabulary in BLOCK_V chunks with an online
softmax (running max m and sum s), so nothing of size [N, V] is written; it keeps per row
lse = m + log s, Σp and the argmax of z (callers need accuracy and will not keep the logits).
Loss of a row: Σ_v p_v (lse - z_v) = Σp · lse - Σ p·z; for a hard label, lse - z_label.
Rows with mask 0 (or label < 0) are skipped: loss 0, argmax -1, zero gradient.

Backward: dL/dz = g · mask · (softmax(z) · Σp - p) (hard: softmax(z) - onehot) is written into
the logits buffer itself and that buffer is returned as the gradient: no second [N, V]
tensor, no saved log-softmax; only lse and Σp ([N] fp32) are kept.
CONTRACT: after backward the logits tensor holds its gradient. Do not read the logits after
backward, do not backward twice, and do not feed the logits to another op that saves them
for its own backward (its version counter is bumped, so autograd would fail loudly there).

The target is a constant (no gradient flows to target_p). mask may be bool or float weights.
On CPU the Triton kernels run only under TRITON_INTERPRET=1 (tests); otherwise a plain-torch
path with the same contract is used, so CPU training needs no interpreter.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_fwd_kernel(
    z_ptr,
    z_stride,
    t_ptr,
    t_stride,
    t_rows_ptr,
    w_ptr,  # logits rows, target rows (or labels), their row ids, weights
    loss_ptr,
    lse_ptr,
    psum_ptr,
    argmax_ptr,  # outputs, one per row
    V,
    HARD: tl.constexpr,
    T_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    trow = row
    if T_ROWS:  # the target row of logits row `row` (fused linear-CE: no gathered copy of p)
        trow = tl.load(t_rows_ptr + row).to(tl.int64)
    w = tl.load(w_ptr + row)
    label = 0
    if HARD:
        label = tl.load(t_ptr + trow).to(tl.int64)
        w = tl.where(label < 0, 0.0, w)
    loss = 0.0
    lse = 0.0
    psum = 0.0
    best_idx = -1
    if w != 0:
        m = -float("inf")  # running max
        s = 0.0  # running sum of exp(z - m)
        pz = 0.0  # Σ p·z (soft) / z_label (hard)
        psum = 1.0 if HARD else 0.0
        best = -float("inf")
        best_idx = 0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = cols < V
            z = tl.load(z_ptr + row * z_stride + cols, mask=ok, other=-float("inf")).to(tl.float32)
            blk_max = tl.max(z, 0)
            blk_arg = tl.argmax(z, 0)
            best_idx = tl.where(blk_max > best, start + blk_arg, best_idx)  # strict: first max wins
            best = tl.maximum(best, blk_max)
            m_new = tl.maximum(m, blk_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
            if not HARD:
                p = tl.load(t_ptr + trow * t_stride + cols, mask=ok, other=0.0).to(tl.float32)
                psum += tl.sum(p, 0)
                pz += tl.sum(p * tl.where(ok, z, 0.0), 0)  # (not p * z: 0 * -inf past V)
        if HARD:
            pz = tl.load(z_ptr + row * z_stride + label).to(tl.float32)
        lse = m + tl.log(s)
        loss = w * (psum * lse - pz)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    tl.store(psum_ptr + row, psum)
    tl.store(argmax_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _ce_bwd_kernel(
    z_ptr,
    z_stride,
    t_ptr,
    t_stride,
    t_rows_ptr,
    w_ptr,
    lse_ptr,
    psum_ptr,
    g_ptr,
    V,
    HARD: tl.constexpr,
    T_ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Overwrite row z with g·w·(softmax(z)·Σp - p) (hard: p = onehot(label))."""
    row = tl.program_id(0).to(tl.int64)
    trow = row
    if T_ROWS:
        trow = tl.load(t_rows_ptr + row).to(tl.int64)
    w = tl.load(w_ptr + row) * tl.load(g_ptr).to(tl.float32)
    label = -1
    if HARD:
        label = tl.load(t_ptr + trow).to(tl.int64)
        w = tl.where(label < 0, 0.0, w)
    lse = tl.load(lse_ptr + row)
    psum = tl.load(psum_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < V
        z = tl.load(z_ptr + row * z_stride + cols, mask=ok, other=0.0).to(tl.float32)
        if HARD:
            p = tl.where(cols == label, 1.0, 0.0)
        else:
            p = tl.load(t_ptr + trow * t_stride + cols, mask=ok, other=0.0).to(tl.float32)
        grad = w * (tl.exp(tl.minimum(z - lse, 0.0)) * psum - p)  # skipped rows: w = 0, lse = 0
        tl.store(z_ptr + row * z_stride + cols, grad.to(z_ptr.dtype.element_ty), mask=ok)


def _use_triton(x: torch.Tensor) -> bool:
    """CUDA always; CPU only if the kernels were built by the interpreter (TRITON_INTERPRET=1
    set before this module was imported)."""
    return x.is_cuda or type(_ce_fwd_kernel).__name__ == "InterpretedFunction"


def _launch_cfg(V: int):
    block = min(triton.next_power_of_2(V), 8192)
    return dict(BLOCK_V=block, num_warps=16 if block >= 8192 else (8 if block >= 2048 else 4))


def _launch(kernel, z, target, w, hard: bool, t_rows, *per_row):
    """One program per row of z [N, V] (N > 0): the kernels' leading arguments (logits rows, target rows or
    labels, their row ids, weights), then `per_row` (kernel-specific), V and the constants."""
    N, V = z.shape
    t_stride = 0 if hard else target.stride(0)
    kernel[(N,)](
        z,
        z.stride(0),
        target,
        t_stride,
        t_rows if t_rows is not None else w,
        w,
        *per_row,
        V,
        HARD=hard,
        T_ROWS=t_rows is not None,
        **_launch_cfg(V),
    )


def _scored_rows(target, t_rows):
    """The torch path's target: row n of z is scored against target[t_rows[n]] (a gathered copy)."""
    return target if t_rows is None else target.index_select(0, t_rows)


def ce_forward(z: torch.Tensor, target: torch.Tensor, w: torch.Tensor, hard: bool, t_rows: torch.Tensor | None = None):
    """z [N, V] (unit column stride), target p [M, V] or labels [M], w [N] fp32 ->
    (loss_rows [N] fp32, lse [N] fp32, psum [N] fp32, argmax [N] int64). Row n of z is scored
    against target row t_rows[n] (int64 [N]; default n, with M = N)."""
    N, V = z.shape
    if not _use_triton(z):
        return _ce_forward_torch(z, _scored_rows(target, t_rows), w, hard)
    loss, lse, psum = (torch.empty(N, device=z.device, dtype=torch.float32) for _ in range(3))
    argmax = torch.empty(N, device=z.device, dtype=torch.int64)
    if N > 0:
        _launch(_ce_fwd_kernel, z, target, w, hard, t_rows, loss, lse, psum, argmax)
    return loss, lse, psum, argmax


def ce_backward_(
    z, target, w, lse, psum, grad_out: torch.Tensor, hard: bool, t_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Overwrite z with dL/dz for upstream grad_out (0-d tensor); returns z. t_rows as in ce_forward."""
    N, V = z.shape
    if not _use_triton(z):
        return _ce_backward_torch_(z, _scored_rows(target, t_rows), w, lse, psum, grad_out, hard)
    if N > 0:
        _launch(_ce_bwd_kernel, z, target, w, hard, t_rows, lse, psum, grad_out.reshape(1).to(torch.float32))
    if not torch.compiler.is_compiling():  # (under compile, functionalization tracks the mutation)
        torch.autograd.graph.increment_version(z)  # raw-pointer writes do not bump it themselves
    return z


# ------------------------------------------------------------------ plain torch, same contract
def _ce_forward_torch(z, target, w, hard):
    z32 = z.float()  # a copy for bf16: the CPU path trades memory for simplicity
    if hard:
        w = torch.where(target < 0, 0.0, w)
        psum = torch.ones_like(w)
        pz = z32.gather(1, target.clamp_min(0)[:, None])[:, 0]
    else:
        p = target.float()
        psum, pz = p.sum(-1), (p * z32).sum(-1)
    lse = z32.logsumexp(-1)
    live = w != 0
    loss = torch.where(live, w * (psum * lse - pz), 0.0)
    argmax = torch.where(live, z32.argmax(-1), -1)
    return loss, torch.where(live, lse, 0.0), torch.where(live, psum, 0.0), argmax


def _ce_backward_torch_(z, target, w, lse, psum, grad_out, hard):
    if hard:
        w = torch.where(target < 0, 0.0, w)
    scale = (w * grad_out.float())[:, None]  # [N, 1]
    grad = torch.exp(z.float() - lse[:, None]) * psum[:, None]
    if hard:
        rows = torch.arange(z.shape[0], device=z.device)
        grad[rows, target.clamp_min(0)] -= 1.0
    else:
        grad -= target.float()
    z.copy_(torch.where(scale != 0, grad * scale, 0.0))
    return z


# ------------------------------------------------------------------ autograd wrapper
class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, mask, hard: bool, t_rows=None):
        z = logits if logits.stride(-1) == 1 else logits.contiguous()
        if not hard and target.stride(-1) != 1:
            target = target.contiguous()
        w = mask.to(torch.float32).contiguous()
        loss_rows, lse, psum, argmax = ce_forward(z, target, w, hard, t_rows)
        ctx.hard = hard
        ctx.save_for_backward(z, target, w, lse, psum, t_rows)
        ctx.mark_non_differentiable(argmax, loss_rows)
        return loss_rows.sum(), argmax, loss_rows

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax, _grad_rows):
        z, target, w, lse, psum, t_rows = ctx.saved_tensors
        return ce_backward_(z, target, w, lse, psum, grad_loss, ctx.hard, t_rows), None, None, None, None


# Kept out of torch.compile graphs: traced by inductor (torch 2.11, H200) the functionalised
# in-place backward returned wrong gradients for ~0.2% of elements, while the same kernels run
# eagerly are exact. A compiled step therefore breaks its graph here and calls the kernels
# eagerly (they are one launch each way, so little is lost). Call it outside loops: a graph break
# inside a loop makes dynamo skip the whole frame (models/eagle3.py calls it once after its unroll).
@torch.compiler.disable
def soft_cross_entropy(logits, target_p, mask, return_argmax: bool = False, return_rows: bool = False, t_rows=None):
    """Σ_n mask_n · (-Σ_v p_nv log_softmax(z_n)_v) as an fp32 scalar (mask: bool or fp32 weights); with
    return_argmax also the per-row argmax of the logits ([N] int64, -1 on masked rows), with return_rows
    also the per-row terms ([N] fp32, no gradient: for logging). t_rows [N] int64 (optional): row n is
    scored against target_p[t_rows[n]] ([M, V], read in place on the GPU: no gathered copy of p).
    Backward overwrites `logits` with its gradient (see the module docstring)."""
    loss, argmax, rows = _CrossEntropy.apply(logits, target_p, mask, False, t_rows)
    out = (loss,) + ((argmax,) if return_argmax else ()) + ((rows,) if return_rows else ())
    return out if len(out) > 1 else loss


@torch.compiler.disable
def hard_cross_entropy(logits, labels, mask, return_argmax: bool = False, return_rows: bool = False):
    """Σ_n mask_n · (-log_softmax(z_n)[label_n]); labels < 0 count as masked. Same contract
    as soft_cross_entropy (in-place backward, optional argmax, optional per-row terms mask_n · nll_n)."""
    loss, argmax, rows = _CrossEntropy.apply(logits, labels, mask, True)
    out = (loss,) + ((argmax,) if return_argmax else ()) + ((rows,) if return_rows else ())
    return out if len(out) > 1 else loss


# ------------------------------------------------------------------ per-row NLL for logs and weights
NLL_CHUNK = 4096  # rows a chunk: a 4096 x 49152 fp32 copy is 0.8 GB


@torch.compiler.disable  # a Python loop over a data-dependent row count: eager, as the CE itself
@torch.no_grad()
def nll_rows(logits: torch.Tensor, labels: torch.Tensor, chunk: int = NLL_CHUNK) -> torch.Tensor:
    """-log_softmax(z_n)[label_n] per row of logits [N, V] (any float dtype) -> [N] fp32, no gradient: D-PACE's
    weights, needed before its loss (the block drafters' logs otherwise take the CE kernel's rows). Computed in fp32
    a chunk of rows at a time: the whole [N, V] fp32 copy it replaces was twice the bf16 logits themselves: ~25 GB
    for a DFlash batch of 32,768 tokens of the packaged greedy chats at 512 anchors a conversation (~128k trained
    slots over SmolLM2's 49,152 tokens, counted from the first 3,000 chats' reply lengths; ~10k at train.py's
    default 32)."""
    out = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    for i in range(0, logits.shape[0], chunk):
        z = logits[i : i + chunk].float()
        out[i : i + chunk] = z.logsumexp(-1) - z.gather(1, labels[i : i + chunk, None])[:, 0]
    return out
