"""Fused draft head + soft cross-entropy: loss = Σ_n mask_n · H(p_n, softmax(h_n W^T)),
computed chunk by chunk over rows so the [N, Vd] logits never exist at once
(the Liger-Kernel FusedLinearCrossEntropy idea).

The gradients are produced during the forward: for each chunk of live rows we form the
logits, run the cross-entropy kernel of kernels/ce.py, let its backward overwrite the chunk's
logits with dL/dz, and immediately fold them into grad_hidden = dz W and grad_weight += dz^T h.
The autograd backward then only scales the two stored gradients by the upstream scalar.

Memory (N rows, H hidden, Vd draft vocab, C = chunk_size, bf16; e.g. N = 16k positions x
TTT steps, H = 4096, Vd = 32000, C = 1024):
  eager head + loss:  logits N·Vd·2 B (1 GiB) + fp32 log-softmax N·Vd·4 B (2 GiB) + its grad
                      N·Vd·4 B (2 GiB) alive at the peak of backward
  fused:              one logits chunk C·Vd·2 B (62.5 MiB; the kernel reads p's rows in place)
                      + grad_hidden N·H·2 B (128 MiB)
                      + grad_weight Vd·H·2 B (250 MiB); the last two are the gradients the
                      optimizer needs anyway, they are just produced early.
grad_weight accumulates across chunks in the weight's dtype (addmm_, fp32 inside the GEMM):
one rounding per chunk, as Liger does by default.

The forward compacts the live rows (mask != 0) first: one host sync (nonzero) per call, so
call it outside a fullgraph-compiled region, or accept a graph break there.
"""

import torch

from kernels import ce as _ce  # looked up at call time: tests reload kernels.ce under the interpreter


class _FusedLinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_p, mask, chunk_size: int):
        N = hidden.shape[0]
        w = mask.to(torch.float32)
        live = (w != 0).nonzero().squeeze(1)  # compact: masked rows cost nothing below
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        argmax = torch.full((N,), -1, device=hidden.device, dtype=torch.int64)
        one = torch.ones((), device=hidden.device, dtype=torch.float32)
        for start in range(0, live.numel(), chunk_size):
            idx = live[start : start + chunk_size]
            h_CH = hidden.index_select(0, idx)
            z_CV = h_CH @ weight.T  # the only [chunk, Vd] tensor
            w_C = w.index_select(0, idx).contiguous()
            # target rows are read through idx inside the kernel: no [chunk, Vd] copy of p
            loss_C, lse, psum, am = _ce.ce_forward(z_CV, target_p, w_C, hard=False, t_rows=idx)
            loss += loss_C.sum()
            argmax.index_copy_(0, idx, am)
            if need_h or need_w:
                dz_CV = _ce.ce_backward_(z_CV, target_p, w_C, lse, psum, one, hard=False, t_rows=idx)  # in place
                if need_h:
                    grad_hidden.index_copy_(0, idx, dz_CV @ weight)
                if need_w:
                    grad_weight.addmm_(dz_CV.T, h_CH)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        grad_hidden, grad_weight = ctx.saved_tensors
        g = grad_loss.to(torch.float32)
        gh = grad_hidden.mul_(g.to(grad_hidden.dtype)) if grad_hidden is not None else None
        gw = grad_weight.mul_(g.to(grad_weight.dtype)) if grad_weight is not None else None
        return gh, gw, None, None, None


def fused_linear_soft_ce(hidden, weight, target_p, mask, chunk_size: int = 1024):
    """hidden [N, H], weight [Vd, H] (no bias), target_p [N, Vd] (constant), mask [N] (bool or
    float weights) -> (loss_sum fp32 scalar, argmax [N] int64 of h W^T, -1 on masked rows)."""
    assert hidden.dim() == 2 and weight.dim() == 2 and target_p.shape == (hidden.shape[0], weight.shape[0])
    if target_p.stride(-1) != 1:  # the kernel reads p's rows in place
        target_p = target_p.contiguous()
    return _FusedLinearSoftCE.apply(hidden, weight, target_p, mask, chunk_size)
