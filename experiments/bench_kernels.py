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


def main(args: Args):
    if args.smoke:  # before triton is imported anywhere: CE kernels run in the interpreter on CPU
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    import triton.testing

    import kernels.ttt_attention
    from kernels.ce import soft_cross_entropy
    from kernels.fused_ce import fused_linear_soft_ce
    from kernels.ttt_attention import TTTFlexAttention, ttt_attention_eager, ttt_attention_flex, ttt_attention_lse

    flex_kernel_options = json.loads(args.flex_kernel_options)
    kernels.ttt_attention.FLEX_KERNEL_OPTIONS.update(flex_kernel_options)

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for a CPU dry run")
    dev = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16  # bf16 matmuls are emulated on CPU
    H, HQ, HKV, D = (64, 4, 2, 16) if smoke else (4096, 32, 8, 128)
    seqs = args.max_len or ([64, 130] if smoke else [2048, 4096, 8192])
    ttts = args.ttt_length or ([1, 3] if smoke else [1, 3, 7])
    vocabs = args.draft_vocab_size or ([300] if smoke else [32000, 64000])
    head_vocab = vocabs[0]
    check_seq = args.check_seq or (48 if smoke else 1024)
    out_path = args.out or (
        Path("/tmp/kernels_smoke.jsonl") if smoke else ROOT / "experiments/results/kernels_h200.jsonl"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)

    meta = dict(
        gpu=torch.cuda.get_device_name() if dev == "cuda" else f"cpu:{platform.processor() or platform.machine()}",
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=short_commit(),
        smoke=smoke,
        flex_kernel_options=flex_kernel_options,
        dtype=str(dtype).removeprefix("torch."),
    )
    rows = []

    def record(**r):
        r = {**r, **meta}
        rows.append(r)
        with out_path.open("a") as f:
            f.write(json.dumps(r) + "\n")
        ms = "OOM" if r.get("oom") else f"{r['ms']:.3f}"
        pk = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        chk = "-" if r.get("check_err") is None else f"{r['check_err']:.1e}" + (" !!" if r["check_err"] > 0.05 else "")
        print(
            f"{r['name']:<14} {r['impl']:<14} seq={r['seq']:<6} ttt={str(r['ttt']):<4} vocab={str(r['vocab']):<6} "
            f"{ms:>10} ms  peak {pk:>7} GiB  check {chk}",
            flush=True,
        )

    def measure(fn):
        """(median ms, peak GiB above the inputs, absolute peak GiB); fn is called once first
        so that compilation and autotuning stay out of both numbers."""
        fn()
        if dev == "cpu":
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

    def rel_err(got, want):
        num = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
        den = max(w.float().abs().max().item() for w in want)
        return num / max(den, 1e-12)

    def run_case(name, impl, make_fn, check, **fields):
        """make_fn() -> fn (allocates inputs); check() -> relative error vs eager (or None)."""
        fn = None
        try:
            err = check() if check is not None else None
            fn = make_fn()
            ms, peak, peak_abs = measure(fn)
            record(
                name=name, impl=impl, ms=ms, peak_gib=peak, peak_abs_gib=peak_abs, check_err=err, oom=False, **fields
            )
        except torch.OutOfMemoryError:
            record(name=name, impl=impl, ms=None, peak_gib=None, peak_abs_gib=None, check_err=None, oom=True, **fields)
        finally:
            del fn
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()

    def randn(*shape, seed, scale=1.0, grad=False):
        g = torch.Generator(device=dev).manual_seed(seed)
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype).requires_grad_(grad)

    # ----------------------------------------------------------------------- TTT attention
    attn_impls = {
        "eager": ttt_attention_eager,
        "lse": ttt_attention_lse,
        # flex has no backward on CPU: the smoke run times eager flex forward only
        # flex (what training uses): keys/values concatenated anew every step; flex_buf: written
        # once into shared buffers (TTTFlexAttention, one instance per unroll)
        "flex": ttt_attention_flex if not smoke else (lambda q, ks, vs: ttt_attention_flex(q, ks, vs, compiled=False)),
    }
    fwd_only = {"flex": smoke, "flex_buf": smoke}

    def attn_fn(impl, steps):
        return TTTFlexAttention(steps, compiled=not smoke) if impl == "flex_buf" else attn_impls[impl]

    def attn_inputs(seq, n):
        qs = [randn(1, HQ, seq, D, seed=100 + s, grad=True) for s in range(n)]
        ks = [randn(1, HKV, seq, D, seed=200 + s, grad=True) for s in range(n)]
        vs = [randn(1, HKV, seq, D, seed=300 + s, grad=True) for s in range(n)]
        douts = [randn(1, HQ, seq, D, seed=400 + s) for s in range(n)]
        return qs, ks, vs, douts

    def attn_step(impl, inputs, backward=True):
        """The TTT unroll: step s attends over key/value sets 0..s; returns outputs (+ grads)."""
        qs, ks, vs, douts = inputs
        fn = attn_fn(impl, len(qs))
        with torch.set_grad_enabled(backward):
            outs = [fn(qs[s], ks[: s + 1], vs[: s + 1]) for s in range(len(qs))]
        if not backward:
            return outs
        return outs + list(torch.autograd.grad(outs, qs + ks + vs, douts))

    def bench_attention(name, step, impls, ref):
        """Every impl at every TTT length and seq; each (impl, TTT) is checked once against ref."""
        for n in ttts:
            for impl in impls:
                bwd = not fwd_only.get(impl, False)

                def check(impl=impl, n=n, bwd=bwd):
                    inputs = attn_inputs(check_seq, n)
                    return rel_err(step(impl, inputs, bwd), step(ref, inputs, bwd))

                for i, seq in enumerate(seqs):

                    def make(impl=impl, seq=seq, n=n, bwd=bwd):
                        inputs = attn_inputs(seq, n)
                        return lambda: step(impl, inputs, bwd)

                    run_case(
                        name,
                        impl,
                        make,
                        check if i == 0 and impl != ref else None,
                        seq=seq,
                        ttt=n,
                        vocab=None,
                        fwd_only=not bwd,
                    )

    if "attn" in args.only:
        bench_attention("ttt_attention", attn_step, args.attention, "eager")

    # ----------------------------------------------------------------------- one TTT step's call
    # The protocol of SpecForge's flex-vs-eager figures (BENCHMARKS.md, "TTT attention, one call"): one attention
    # call, the last TTT step's (queries of one step against the keys of all n steps). eager_dense
    # is their eager: keys concatenated, [T, n T] logits materialised under the dense TTT mask.
    def ttt_attention_dense(q, ks, vs):
        T, n, g = q.shape[2], len(ks), q.shape[1] // ks[0].shape[1]
        k_cat = torch.cat(ks, 2).repeat_interleave(g, dim=1)
        v_cat = torch.cat(vs, 2).repeat_interleave(g, dim=1)
        i, j = torch.arange(T, device=q.device)[:, None], torch.arange(n * T, device=q.device)[None, :]
        mask = torch.where(j < T, j <= i, j % T == i)  # [T, nT]: causal over step 0, diagonal of the rest
        scores = (q @ k_cat.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(q.dtype)
        return probs @ v_cat

    call_impls = {"eager_dense": ttt_attention_dense, **attn_impls}

    def call_step(impl, inputs, backward=True):
        qs, ks, vs, douts = inputs
        with torch.set_grad_enabled(backward):
            out = call_impls[impl](qs[-1], ks, vs)
        return [out] + (list(torch.autograd.grad(out, [qs[-1], *ks, *vs], douts[-1])) if backward else [])

    if "call" in args.only:
        bench_attention("ttt_call", call_step, list(call_impls), "eager_dense")

    # ----------------------------------------------------------------------- cross-entropy
    def eager_soft_ce(z, p, mask):
        return (mask * -(p.float() * torch.log_softmax(z.float(), -1)).sum(-1)).sum()

    ce_impls = {"eager": eager_soft_ce, "triton": soft_cross_entropy}

    def targets(N, V):
        """soft targets p [N, V] and a mask with ~10% of rows off (prompt tokens, padding)."""
        p = torch.softmax(randn(N, V, seed=2, scale=2.0).float(), -1).to(dtype)
        mask = (torch.rand(N, device=dev, generator=torch.Generator(device=dev).manual_seed(3)) > 0.1).float()
        return p, mask

    def ce_inputs(N, V):
        return randn(N, V, seed=1, scale=3.0, grad=True), *targets(N, V)

    def ce_step(impl, z, p, mask):
        # autograd.grad, not backward: a leaf's AccumulateGrad would clone the in-place gradient
        loss = ce_impls[impl](z, p, mask)
        return [loss, *torch.autograd.grad(loss, [z])]

    if "ce" in args.only:
        for V in vocabs:
            for impl in ce_impls:

                def check(impl=impl, V=V):
                    if impl == "eager":
                        return None
                    z, p, mask = ce_inputs(check_seq, V)
                    want = ce_step("eager", z, p, mask)
                    return rel_err(ce_step(impl, z.detach().clone().requires_grad_(), p, mask), want)

                for i, seq in enumerate(seqs):

                    def make(impl=impl, seq=seq, V=V):
                        z, p, mask = ce_inputs(seq, V)
                        return lambda: ce_step(impl, z, p, mask)

                    run_case("ce", impl, make, check if i == 0 else None, seq=seq, ttt=None, vocab=V, fwd_only=False)

    # ----------------------------------------------------------------------- head + CE
    def head_step(impl, h, W, p, mask):
        if impl == "fused":
            loss, _ = fused_linear_soft_ce(h, W, p, mask)
        else:
            logits = h @ W.T
            loss = eager_soft_ce(logits, p, mask) if impl == "eager" else soft_cross_entropy(logits, p, mask)
        return [loss, *torch.autograd.grad(loss, [h, W])]

    def head_inputs(N, V):
        h = randn(N, H, seed=4, grad=True)
        W = randn(V, H, seed=5, scale=1 / math.sqrt(H), grad=True)
        return h, W, *targets(N, V)

    if "head" in args.only:
        V = head_vocab
        for impl in ["eager", "matmul+triton", "fused"]:

            def check(impl=impl):
                if impl == "eager":
                    return None
                inputs = head_inputs(check_seq, V)
                return rel_err(head_step(impl, *inputs), head_step("eager", *inputs))

            for i, seq in enumerate(seqs):

                def make(impl=impl, seq=seq):
                    inputs = head_inputs(seq, V)
                    return lambda: head_step(impl, *inputs)

                run_case("head_ce", impl, make, check if i == 0 else None, seq=seq, ttt=None, vocab=V, fwd_only=False)

    # ----------------------------------------------------------------------- summary
    print(f"\n{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}  -> {out_path}")
    print(f"{'name':<14} {'impl':<14} {'seq':>6} {'ttt':>4} {'vocab':>6} {'ms':>10} {'peak GiB':>9} {'check':>8}")
    for r in rows:
        ms = "OOM" if r["oom"] else f"{r['ms']:.3f}"
        pk = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        chk = "-" if r["check_err"] is None else f"{r['check_err']:.1e}"
        print(
            f"{r['name']:<14} {r['impl']:<14} {r['seq']:>6} {str(r['ttt'] or '-'):>4} {str(r['vocab'] or '-'):>6} "
            f"{ms:>10} {pk:>9} {chk:>8}"
        )


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
