"""Why does the buffered flex path (--attention flex_buf) peak higher than the concatenating one on
the H200? A CPU check of the autograd side alone: flex is replaced by a stand-in that saves its
inputs as given (views included) and returns fresh gradients, and a dispatch-level tracker counts
the bytes alive at the peak of one TTT unroll, forward + backward, in step-sized K tensors.

    ./dev python experiments/flex_buf_memory_cpu.py

Result on 2026-11-29 (torch 2.13.0 CPU, TTT 7): cat 72.0, buf 62.0: with the write chain's
gradients included, the buffers save memory around flex, so the H200 excess (1.37 vs 0.83 GiB,
BENCHMARKS.md) most likely comes from the real compiled flex with strided K/V views.
Since 2026-12-05 every step's flex takes the whole buffers (one shape for the unroll: one compile), and
the stand-in's gradients are buffer-sized: cat 72.0, buf 68.0.
"""

import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.ttt_attention as ta  # noqa: E402


class PeakBytes(TorchDispatchMode):
    """Bytes of every storage an op creates, until the storage dies; the peak of their sum."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, n) in list(self.live.items()):
            if ref.expired():
                self.cur -= n
                del self.live[ptr]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                st = t.untyped_storage()
                self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                self.cur += st.nbytes()
        self.peak = max(self.peak, self.cur)
        return out


class StandInFlex(torch.autograd.Function):
    """Saves q, k, v as flex does (views stay views) and returns gradients shaped like them."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q * 1.0

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return (
            g * 1.0,
            torch.ones_like(k, memory_format=torch.contiguous_format),
            torch.ones_like(v, memory_format=torch.contiguous_format),
        )


def peak_in_steps(kind: str, B=1, H=2, T=256, D=16, S=7) -> float:
    qs, ks, vs = ([torch.randn(B, H, T, D, requires_grad=True) for _ in range(S)] for _ in range(3))
    attend = (
        ta.TTTFlexAttention(S, compiled=False)
        if kind == "buf"
        else (lambda q, k, v: ta.ttt_attention_flex(q, k, v, compiled=False))
    )
    with PeakBytes() as m:
        sum(attend(qs[s], ks[: s + 1], vs[: s + 1]).sum() for s in range(S)).backward()
    return m.peak / (B * H * T * D * 4)


def stand_in_patches() -> dict:
    """kernels.ttt_attention attributes to replace: eager flex by the stand-in (which ignores the mask)."""
    return {
        "flex_attention_eager": lambda q, k, v, block_mask=None, enable_gqa=False, **kw: StandInFlex.apply(q, k, v),
        "_cached_ttt_block_mask": lambda *a, **kw: None,
    }


if __name__ == "__main__":
    for name, fn in stand_in_patches().items():
        setattr(ta, name, fn)
    for kind in ("cat", "buf"):
        print(f"{kind}: peak {peak_in_steps(kind):.1f} step-sized K tensors")
