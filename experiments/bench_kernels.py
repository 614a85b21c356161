"""Kernel benchmarks for one GPU (written for an H200; torch >= 2.11, triton >= 3.6).

    python experiments/bench_kernels.py                  # all benches, H200 shapes
    python experiments/bench_kernels.py --only ce --max-len 4096
    python experiments/bench_kernels.py --smoke          # tiny shapes on CPU: checks the script runs

What is measured (bf16, batch 1, EAGLE-3 draft of a Llama-8B-like target: hidden 4096,
32 query / 8 kv heads, head dim 128):
  ttt_attention  the whole TTT unroll, fwd + bwd: step s = 0..n-1 attends over s+1 key sets
                 (n = --ttt-length), impls eager (materialised logits) / lse (fused causal SDPA +
                 log-sum-exp merge) / flex (compiled flex_attention with the TTT block mask, K/V of
                 the steps so far concatenated anew every step; what training uses) / flex_buf
                 (the same, each step's K/V written once into shared buffers). The rows of
                 commit de9b61e name them flex (buffers) and flex_cat (concatenated).
  ttt_call       one attention call, fwd + bwd: the last TTT step's queries against the keys of all
                 n steps, the protocol of SpecForge's flex-vs-eager figures; impls eager_dense
                 (their eager: keys concatenated, [T, nT] logits under a dense mask) / eager / lse /
                 flex (ours)
  ce             soft-target cross-entropy fwd + bwd on [seq, vocab] bf16 logits:
                 eager torch (fp32 log-softmax) vs the Triton kernel (in-place backward)
  head_ce        draft head (hidden @ W^T, W [vocab, 4096]) + soft CE, fwd + bwd:
                 eager vs matmul + Triton CE vs fused linear-CE (row chunks)

Time: median of triton.testing.do_bench (warm-up included, compile excluded by a first call).
Memory: peak_gib = torch.cuda.max_memory_allocated() during one fwd + bwd minus what was
allocated before it (inputs); peak_abs_gib includes the inputs. OOM is caught and recorded.
Correctness: each impl is compared with eager once per shape family at a small size
(--check-seq); check_err = max |impl - eager| / max |eager| over outputs and gradients.
Every measurement prints a table row and appends one JSON line to --out.
The end-to-end draft-step benchmark lives elsewhere.
"""

import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.common import short_commit  # noqa: E402


@dataclasses.dataclass
class Args:
    only: tuple[Literal["attn", "call", "ce", "head"], ...] = ("attn", "call", "ce", "head")
    """which benches"""
    max_len: tuple[int, ...] = ()
    """sequence lengths (default 2048 4096 8192; --smoke: 64 130)"""
    ttt_length: tuple[int, ...] = ()
    """TTT steps (default 1 3 7; --smoke: 1 3)"""
    draft_vocab_size: tuple[int, ...] = ()
    """CE vocabularies (default 32000 64000; --smoke: 300); the head bench takes the first"""
    attention: tuple[str, ...] = ("eager", "lse", "flex", "flex_buf")
    """TTT attention paths (train.py --attention)"""
    flex_kernel_options: str = "{}"
    """JSON kernel_options for every flex call, e.g. '{"BLOCK_M": 128, "BLOCK_N": 64}' (recorded per row)"""
    check_seq: int = 0
    """length of the correctness check (0 = 1024; --smoke: 48)"""
    out: Path | None = None
    """JSONL to append to (default experiments/results/kernels_h200.jsonl; --smoke: /tmp/kernels_smoke.jsonl)"""
    smoke: bool = False
    """tiny shapes on CPU (Triton interpreter) to test the script"""


class Bench:
    """What every benchmark shares: the device, dtype and shapes of this run (--smoke: tiny, CPU), timing and
    memory of one case, its correctness check, and the rows (printed, appended to --out)."""

    def __init__(self, args: Args):
        import torch  # lazy: after main() sets TRITON_INTERPRET (--smoke); --help runs without torch
        import triton  # after main() sets TRITON_INTERPRET

        self.smoke = smoke = args.smoke
        if not smoke and not torch.cuda.is_available():
            sys.exit("no CUDA device: use --smoke for a CPU dry run")
        self.dev = "cpu" if smoke else "cuda"
        self.dtype = torch.float32 if smoke else torch.bfloat16  # bf16 matmuls are emulated on CPU
        self.H, self.HQ, self.HKV, self.D = (64, 4, 2, 16) if smoke else (4096, 32, 8, 128)
        self.seqs = args.max_len or ([64, 130] if smoke else [2048, 4096, 8192])
        self.ttts = args.ttt_length or ([1, 3] if smoke else [1, 3, 7])
        self.vocabs = args.draft_vocab_size or ([300] if smoke else [32000, 64000])
        self.check_seq = args.check_seq or (48 if smoke else 1024)
        self.out_path = args.out or (
            Path("/tmp/kernels_smoke.jsonl") if smoke else ROOT / "experiments/results/kernels_h200.jsonl"
        )
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self.meta = dict(
            gpu=torch.cuda.get_device_name()
            if self.dev == "cuda"
            else f"cpu:{platform.processor() or platform.machine()}",
            torch=torch.__version__,
            triton=triton.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            commit=short_commit(),
            smoke=smoke,
            flex_kernel_options=json.loads(args.flex_kernel_options),
            dtype=str(self.dtype).removeprefix("torch."),
        )
        self.rows = []

    def record(self, **r):
        r = {**r, **self.meta}
        self.rows.append(r)
        with self.out_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        ms = "OOM" if r.get("oom") else f"{r['ms']:.3f}"
        pk = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        chk = "-" if r.get("check_err") is None else f"{r['check_err']:.1e}" + (" !!" if r["check_err"] > 0.05 else "")
        print(
            f"{r['name']:<14} {r['impl']:<14} seq={r['seq']:<6} ttt={str(r['ttt']):<4} vocab={str(r['vocab']):<6} "
            f"{ms:>10} ms  peak {pk:>7} GiB  check {chk}",
            flush=True,
        )

    def measure(self, fn):
        """(median ms, peak GiB above the inputs, absolute peak GiB); fn is called once first
        so that compilation and autotuning stay out of both numbers."""
        import torch  # lazy, as in Bench.__init__
        import triton.testing  # after main() sets TRITON_INTERPRET

        fn()
        if self.dev == "cpu":
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times), None, None
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return ms, (peak - base) / 2**30, peak / 2**30

    @staticmethod
    def rel_err(got, want):
        num = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        den = max(w.float().abs().max().item() for w in want)
        return num / max(den, 1e-12)

    def run_case(self, name, impl, make_fn, check, **fields):
        """make_fn() -> fn (allocates inputs); check() -> relative error vs eager (or None)."""
        import torch  # lazy, as in Bench.__init__

        fn = None
        try:
            err = check() if check is not None else None
            fn = make_fn()
            ms, peak, peak_abs = self.measure(fn)
            self.record(
                name=name, impl=impl, ms=ms, peak_gib=peak, peak_abs_gib=peak_abs, check_err=err, oom=False, **fields
            )
        except torch.OutOfMemoryError:
            self.record(
                name=name, impl=impl, ms=None, peak_gib=None, peak_abs_gib=None, check_err=None, oom=True, **fields
            )
        finally:
            del fn
            gc.collect()
            if self.dev == "cuda":
                torch.cuda.empty_cache()

    def randn(self, *shape, seed, scale=1.0, grad=False):
        import torch  # lazy, as in Bench.__init__

        g = torch.Generator(device=self.dev).manual_seed(seed)
        return (torch.randn(*shape, device=self.dev, generator=g) * scale).to(self.dtype).requires_grad_(grad)

    def cases(self, name, impls, step, inputs, ref, **fields):
        """Every impl at every seq: step(impl, *inputs(seq)) timed; each impl but ref checked once against ref at
        --check-seq."""
        for impl in impls:

            def check(impl=impl):
                x = inputs(self.check_seq)
                want = step(ref, *x)
                return self.rel_err(step(impl, *_fresh(x)), want)  # fresh leaves: Triton's CE writes its grad in place

            for i, seq in enumerate(self.seqs):

                def make(impl=impl, seq=seq):
                    x = inputs(seq)
                    return lambda: step(impl, *x)

                self.run_case(name, impl, make, check if i == 0 and impl != ref else None, seq=seq, **fields)

    def summary(self):
        m = self.meta
        print(f"\n{m['gpu']}  torch {m['torch']}  triton {m['triton']}  {m['date']}  -> {self.out_path}")
        print(f"{'name':<14} {'impl':<14} {'seq':>6} {'ttt':>4} {'vocab':>6} {'ms':>10} {'peak GiB':>9} {'check':>8}")
        for r in self.rows:
            ms = "OOM" if r["oom"] else f"{r['ms']:.3f}"
            pk = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            chk = "-" if r["check_err"] is None else f"{r['check_err']:.1e}"
            print(
                f"{r['name']:<14} {r['impl']:<14} {r['seq']:>6} {str(r['ttt'] or '-'):>4} {str(r['vocab'] or '-'):>6} "
                f"{ms:>10} {pk:>9} {chk:>8}"
            )


def _fresh(x):
    """The tensors of x (a tuple of tensors and lists of tensors) as new leaves with the same values."""
    leaf = lambda t: t.detach().clone().requires_grad_(t.requires_grad)  # noqa: E731
    return tuple([leaf(t) for t in v] if isinstance(v, list) else leaf(v) for v in x)


def ttt_attention_dense(q, ks, vs):
    """SpecForge's eager TTT attention: keys concatenated, [T, n T] logits materialised under the dense TTT mask
    (causal over step 0, the diagonal of the others)."""
    import torch  # lazy, as in Bench.__init__

    T, n, g = q.shape[2], len(ks), q.shape[1] // ks[0].shape[1]
    k_cat = torch.cat(ks, 2).repeat_interleave(g, dim=1)
    v_cat = torch.cat(vs, 2).repeat_interleave(g, dim=1)
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(n * T, device=q.device)[None, :]
    mask = torch.where(j < T, j <= i, j % T == i)  # [T, nT]: causal over step 0, diagonal of the rest
    scores = (q @ k_cat.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(q.dtype)
    return probs @ v_cat


def bench_attention(b: Bench, args: Args):
    """ttt_attention (the whole TTT unroll) and ttt_call (one call: the last step's queries against the keys of
    all n steps, the protocol of SpecForge's flex-vs-eager figures; BENCHMARKS.md, "TTT attention, one call")."""
    import torch  # lazy, as in Bench.__init__

    from kernels.ttt_attention import (  # after main() sets TRITON_INTERPRET
        TTTFlexAttention,
        ttt_attention_eager,
        ttt_attention_flex,
        ttt_attention_lse,
    )

    impls = {
        "eager": ttt_attention_eager,
        "lse": ttt_attention_lse,
        # flex (what training uses): keys/values concatenated anew every step; flex has no backward on CPU:
        # the smoke run times eager flex forward only. flex_buf: written once into shared buffers
        # (TTTFlexAttention, one instance per unroll)
        "flex": ttt_attention_flex
        if not b.smoke
        else (lambda q, ks, vs: ttt_attention_flex(q, ks, vs, compiled=False)),
    }
    call_impls = {"eager_dense": ttt_attention_dense, **impls}
    fwd_only = {"flex": b.smoke, "flex_buf": b.smoke}

    def inputs(seq, n):
        qs = [b.randn(1, b.HQ, seq, b.D, seed=100 + s, grad=True) for s in range(n)]
        ks = [b.randn(1, b.HKV, seq, b.D, seed=200 + s, grad=True) for s in range(n)]
        vs = [b.randn(1, b.HKV, seq, b.D, seed=300 + s, grad=True) for s in range(n)]
        douts = [b.randn(1, b.HQ, seq, b.D, seed=400 + s) for s in range(n)]
        return qs, ks, vs, douts

    def unroll(impl, qs, ks, vs, douts, backward=True):
        """The TTT unroll: step s attends over key/value sets 0..s; returns outputs (+ grads)."""
        fn = TTTFlexAttention(len(qs), compiled=not b.smoke) if impl == "flex_buf" else impls[impl]
        with torch.set_grad_enabled(backward):
            outs = [fn(qs[s], ks[: s + 1], vs[: s + 1]) for s in range(len(qs))]
        return outs + list(torch.autograd.grad(outs, qs + ks + vs, douts)) if backward else outs

    def call(impl, qs, ks, vs, douts, backward=True):
        with torch.set_grad_enabled(backward):
            out = call_impls[impl](qs[-1], ks, vs)
        return [out] + (list(torch.autograd.grad(out, [qs[-1], *ks, *vs], douts[-1])) if backward else [])

    benches = {
        "attn": ("ttt_attention", unroll, args.attention, "eager"),
        "call": ("ttt_call", call, call_impls, "eager_dense"),
    }
    for key, (name, step, names, ref) in benches.items():
        if key not in args.only:
            continue
        for n in b.ttts:
            for impl in names:  # one impl at a time: fwd_only differs
                bwd = not fwd_only.get(impl, False)
                b.cases(
                    name,
                    [impl],
                    lambda impl, *x, bwd=bwd, step=step: step(impl, *x, backward=bwd),
                    lambda seq, n=n: inputs(seq, n),
                    ref,
                    ttt=n,
                    vocab=None,
                    fwd_only=not bwd,
                )


def bench_ce(b: Bench, args: Args):
    """ce (soft CE on [seq, vocab] logits) and head_ce (the draft head's matmul + soft CE, or fused)."""
    import torch  # lazy, as in Bench.__init__

    from kernels.ce import soft_cross_entropy  # after main() sets TRITON_INTERPRET
    from kernels.fused_ce import fused_linear_soft_ce  # after main() sets TRITON_INTERPRET

    def eager_soft_ce(z, p, mask):
        return (mask * -(p.float() * torch.log_softmax(z.float(), -1)).sum(-1)).sum()

    def targets(N, V):
        """soft targets p [N, V] and a mask with ~10% of rows off (prompt tokens, padding)."""
        p = torch.softmax(b.randn(N, V, seed=2, scale=2.0).float(), -1).to(b.dtype)
        mask = (torch.rand(N, device=b.dev, generator=torch.Generator(device=b.dev).manual_seed(3)) > 0.1).float()
        return p, mask

    ce_impls = {"eager": eager_soft_ce, "triton": soft_cross_entropy}

    def ce_step(impl, z, p, mask):
        # autograd.grad, not backward: a leaf's AccumulateGrad would clone the in-place gradient
        loss = ce_impls[impl](z, p, mask)
        return [loss, *torch.autograd.grad(loss, [z])]

    def head_step(impl, h, W, p, mask):
        if impl == "fused":
            loss, _ = fused_linear_soft_ce(h, W, p, mask)
        else:
            logits = h @ W.T
            loss = eager_soft_ce(logits, p, mask) if impl == "eager" else soft_cross_entropy(logits, p, mask)
        return [loss, *torch.autograd.grad(loss, [h, W])]

    if "ce" in args.only:
        for V in b.vocabs:
            b.cases(
                "ce",
                list(ce_impls),
                ce_step,
                lambda N, V=V: (b.randn(N, V, seed=1, scale=3.0, grad=True), *targets(N, V)),
                "eager",
                ttt=None,
                vocab=V,
                fwd_only=False,
            )
    if "head" in args.only:
        V = b.vocabs[0]
        b.cases(
            "head_ce",
            ["eager", "matmul+triton", "fused"],
            head_step,
            lambda N: (
                b.randn(N, b.H, seed=4, grad=True),
                b.randn(V, b.H, seed=5, scale=1 / math.sqrt(b.H), grad=True),
                *targets(N, V),
            ),
            "eager",
            ttt=None,
            vocab=V,
            fwd_only=False,
        )


def main(args: Args):
    if args.smoke:  # before triton is imported anywhere: CE kernels run in the interpreter on CPU
        os.environ["TRITON_INTERPRET"] = "1"
    import kernels.ttt_attention  # after main() sets TRITON_INTERPRET

    kernels.ttt_attention.FLEX_KERNEL_OPTIONS.update(json.loads(args.flex_kernel_options))
    b = Bench(args)
    bench_attention(b, args)
    bench_ce(b, args)
    b.summary()


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
