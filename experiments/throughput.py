"""End-to-end EAGLE-3 training throughput on one GPU (the paper's backend comparison, our version):
target forward + draft TTT forward/backward + optimizer step, three target/step backends side by
side in one run, random weights, full rows of --max-len tokens.

    python experiments/throughput.py --target llama-3.1-8b     # one H200: ~8 min
    python experiments/throughput.py --target qwen3-30b-a3b
    python experiments/throughput.py --plot-only               # redraw the figure from the JSONL
    python experiments/throughput.py --smoke                   # tiny shapes on CPU: checks the script

Backends (the draft is the same EAGLE-3 draft, flex attention + Triton CE, TTT 7):
  hf           transformers model (sdpa attention; transformers 5 runs MoE experts with grouped_mm),
               eager; the draft step as train.py runs it without --compile: eager module (its flex
               kernel compiled), trained rows picked with nonzero() (a host sync per TTT step),
               foreach AdamW, synchronous host-to-device copies. The naive baseline.
  compiled     models/fast_target.py, decoder layer compiled (inductor, no CUDA graphs), make_batch
               compiled, the draft step (TTT forward + loss + backward) compiled as a unit with rows
               chosen on the host (no syncs), fused AdamW, batches prefetched on a side stream.
  compiled-cg  the same with the target's layers in mode="reduce-overhead" (CUDA graphs).

All three run on one set of weights: the compiled target shares the HF model's tensors, and its
hidden states are checked against HF's at the start (parity_rel_err).

Per backend: the comparison batch first (--batch-size[0]: SpecForge's batch), then the largest batch
that fits: predicted from the first trial's peak memory (linear in the batch), verified by running
it (OOM caught, one smaller on failure). Time: median over --iters steps after warm-up (CUDA events,
also between the phases). MFU: analytic model FLOPs (target forward incl. lm_head, draft forward
x3 for backward) over a bf16 matmul peak measured here. One JSON line per trial is appended to
experiments/results/throughput_h200.jsonl as soon as it is measured; the figure is redrawn at the end.
"""

import dataclasses
import datetime
import gc
import importlib.metadata as md
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.runlog import git_commit  # noqa: E402
from data.datasets import build_examples, load_records  # noqa: E402
from data.prefetch import Prefetcher  # noqa: E402
from kernels.masks import causal_mask, create_block_mask, flex_attention_compiled  # noqa: E402
from models.eagle3 import Eagle3Config, Eagle3Draft, local_counts, make_batch, select_rows  # noqa: E402
from models.fast_target import PRESETS, FastTarget, TargetConfig  # noqa: E402
from models.target import Target, default_aux_layers, load_tokenizer, resolve_target  # noqa: E402

# Assistant share of the packaged ShareGPT chats under SmolLM2's chat template, truncated at 4096
# tokens (token-weighted, 2,936 conversations of the first 3,000 records; `--measure-mask` redoes it
# where data/ and the model are available, e.g. on the CPU machine): 0.754. SpecForge's runs used 0.60.
MASK_DENSITY = 0.754
SPECFORGE = {  # same H200, transformers 5.17, flex, TTT 7, seq 4096, random weights, 60% mask
    "llama-3.1-8b": {
        "batch": 8,
        "tokens_per_s": 15491,
        "peak_gib": 119,
        "target_fwd_s": 1.02,
        "draft_fwd_s": 0.45,
        "draft_bwd_s": 0.64,
        "step_s": 2.12,
    },
    "qwen3-30b-a3b": {"batch": 4, "tokens_per_s": 18866},
}
DEFAULT_BATCHES = {"llama-3.1-8b": [8], "qwen3-30b-a3b": [4], "qwen3-8b": [8]}
SMOKE_SIZES = {  # both smoke models
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SMOKE = {  # tiny shapes with the families' features (llama3 rope + GQA; q/k norm + MoE)
    "tiny-llama": {**PRESETS["llama-3.1-8b"], **SMOKE_SIZES},
    "tiny-moe": {
        **PRESETS["qwen3-30b-a3b"],
        **SMOKE_SIZES,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
}
BACKENDS = ("hf", "compiled", "compiled-cg")


# ------------------------------------------------------------------------------------ helpers
class Timer:
    """Events between the phases of a step: CUDA events on GPU (no sync), wall clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def peak_matmul_tflops(device, dtype) -> float:
    """Best of a few large square GEMMs (CUDA events, median of 10 after warm-up)."""
    if device.type != "cuda":
        n = 512
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        return 2 * n**3 * 5 / (time.perf_counter() - t) / 1e12
    best = 0.0
    for n in (8192, 16384):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        best = max(best, 2 * n**3 / statistics.median(times) / 1e12)
        del a, b
    return best


def loss_mask(B: int, T: int, density: float, seed: int = 0) -> torch.Tensor:
    """Chat-like masks: alternating prompt / answer spans (geometric lengths, mean prompt 120
    tokens) whose answer share is `density`."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.long)
    mean_user = 120.0
    mean_asst = mean_user * density / (1 - density)
    for b in range(B):
        t, assistant = 0, False
        while t < T:
            mean = mean_asst if assistant else mean_user
            n = 1 + int(torch.empty(1).exponential_(1 / mean, generator=g))
            if assistant:
                mask[b, t : t + n] = 1
            t, assistant = t + n, not assistant
    return mask


def flops_per_step(
    tc: TargetConfig, dc: Eagle3Config, B: int, T: int, ttt: int, rows: torch.Tensor
) -> tuple[float, float]:
    """Model FLOPs of one step: (target forward incl. lm_head, draft forward + backward)."""
    H, D, Hq, Hkv, L = tc.hidden_size, tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads, tc.num_hidden_layers
    attn_proj = H * (Hq + 2 * Hkv) * D + Hq * D * H
    mlp = [
        (H * tc.num_experts + tc.num_experts_per_tok * 3 * H * tc.moe_intermediate_size)
        if tc.is_moe(i)
        else 3 * H * tc.intermediate_size
        for i in range(L)
    ]
    causal_pairs = T * (T + 1) / 2
    target = 2 * B * T * (L * attn_proj + sum(mlp) + H * tc.vocab_size) + L * B * 4 * causal_pairs * Hq * D
    h, I, dq, dkv = dc.hidden_size, dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads
    fwd = 2 * B * T * len(dc.aux_layers) * dc.target_hidden_size * h
    for k in range(ttt):
        fwd += 2 * B * T * (2 * h * (dq + 2 * dkv) * dc.head_dim + dq * dc.head_dim * h + 3 * h * I)
        fwd += B * 4 * (causal_pairs + k * T) * dq * dc.head_dim
        fwd += 2 * int((rows[k] >= 0).sum()) * h * dc.draft_vocab_size
    return float(target), float(3 * fwd)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def environment(device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    for pkg in ("triton", "transformers"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return env


# ------------------------------------------------------------------------------------ the runs
class Bench:
    def __init__(self, args, model: str, device, dtype):
        self.args, self.model, self.device, self.dtype = args, model, device, dtype
        cfg_dict = SMOKE[model] if args.smoke else PRESETS[model]
        self.tc = TargetConfig.from_dict(cfg_dict)
        from transformers import AutoModelForCausalLM  # lazy: transformers (~1.5 s), not for --help / --plot-only

        t0 = time.time()
        torch.manual_seed(0)
        with torch.device(device):
            self.hf = AutoModelForCausalLM.from_config(self.tc.to_hf(), dtype=dtype, attn_implementation="sdpa").eval()
        self.hf.requires_grad_(False)
        with torch.no_grad():  # random everywhere: an all-zero matrix (e.g. a router left at zeros) would skew routing
            for p in self.hf.parameters():
                if p.dim() >= 2 and not p.any():
                    p.normal_(0.0, 0.02)
        self.aux = default_aux_layers(self.tc.num_hidden_layers)
        self.hf_target = Target(self.hf, self.aux)
        self.fast = FastTarget.from_hf_model(self.hf, self.aux)  # the same tensors
        print(
            f"[{model}] random {self.tc.model_type} target built in {time.time() - t0:.0f} s; "
            f"{torch.cuda.memory_allocated(device) / 2**30 if device.type == 'cuda' else 0:.1f} GiB",
            flush=True,
        )
        self.parity = self.check_parity()
        dc = Eagle3Config.from_target(self.tc, args.draft_vocab_size, self.aux)
        self.dc = dc
        self.draft = Eagle3Draft(dc)
        g = torch.Generator().manual_seed(0)
        kept = torch.randperm(self.tc.vocab_size, generator=g)[: dc.draft_vocab_size].sort().values
        self.draft.d2t.copy_(kept - torch.arange(dc.draft_vocab_size))
        self.draft.t2d[kept] = True
        self.draft.to(device=device, dtype=dtype)
        self.compiled_draft, self.compiled_for = None, None
        self.attention, self.loss = ("flex", "triton") if device.type == "cuda" else ("lse", "triton")

    @torch.no_grad()
    def check_parity(self) -> float:
        """max |fast - hf| / max |hf| over aux and final hidden states, one random row."""
        ids = torch.randint(0, self.tc.vocab_size, (1, min(512, self.args.max_len)), device=self.device)
        a, b = self.hf_target(ids), self.fast(ids)
        err = max(
            ((x - y).abs().max() / y.abs().max()).item()
            for x, y in ((b.aux_hidden, a.aux_hidden), (b.final_hidden, a.final_hidden))
        )
        print(f"[{self.model}] compiled vs HF hidden states: max rel err {err:.2e}", flush=True)
        return err

    def host_batch(self, B: int) -> dict:
        T, V = self.args.max_len, self.tc.vocab_size
        g = torch.Generator().manual_seed(B)
        mask = loss_mask(B, T, self.args.mask_density, seed=B)
        return {
            "input_ids": torch.randint(0, V, (B, T), generator=g),
            "loss_mask": mask,
            "rows": select_rows(mask, self.args.ttt_length),
        }

    def setup_backend(self, backend: str):
        """Compile once per backend (a new torch.compile wrapper would recompile the same code)."""
        if backend == "hf" or backend == self.compiled_for:
            return
        self.fast.compile_layers(mode="reduce-overhead" if backend == "compiled-cg" else None, dynamic=False)
        if self.compiled_draft is None:  # shared by both compiled backends
            self.compiled_draft = self.draft if self.args.draft_eager else torch.compile(self.draft, dynamic=False)
            self.compiled_make_batch = torch.compile(make_batch, dynamic=False)
        self.compiled_for = backend

    def reset_compiled(self):
        """After a failure inside compiled code (e.g. OOM while recording CUDA graphs): start clean."""
        torch._dynamo.reset()
        self.compiled_draft, self.compiled_for = None, None

    def trial(self, backend: str, B: int) -> dict:
        """Warm-up then timed steps at batch B; raises on OOM (caller cleans up)."""
        args, dev, cuda = self.args, self.device, self.device.type == "cuda"
        K, T = args.ttt_length, args.max_len
        host = self.host_batch(B)
        naive = backend == "hf"
        target = self.hf_target if naive else self.fast
        mb = make_batch if naive else self.compiled_make_batch
        draft_fn = self.draft if naive else self.compiled_draft
        opt = torch.optim.AdamW(
            self.draft.parameters(),
            lr=1e-5,
            betas=(0.9, 0.95),
            **({"foreach": True} if naive or not cuda else {"fused": True}),
        )
        warmup = args.warmup + (1 if backend == "compiled-cg" else 0)  # cudagraph trees: warm-up, record, replay
        n_steps = warmup + args.iters
        prefetch = None if naive else Prefetcher(lambda _: host, range(n_steps), dev)
        spans, first_step_s = [], None
        draft_ids = self.draft.draft_ids
        if cuda:
            torch.cuda.synchronize()
        try:
            for i in range(n_steps):
                if i == warmup and cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(dev)
                t_wall = time.perf_counter()
                tm = Timer(cuda)
                tm.mark()
                b = {k: v.to(dev) for k, v in host.items()} if naive else next(prefetch)  # naive: blocking copies
                feats = target(b["input_ids"])
                tm.mark()
                batch = mb(feats, b["input_ids"], b["loss_mask"], target.embed_tokens, target.lm_head, draft_ids)
                counts = local_counts(batch, self.draft.t2d, K)
                tm.mark()
                loss, _ = draft_fn(
                    batch, K, counts, attention=self.attention, loss=self.loss, rows=None if naive else b["rows"]
                )
                tm.mark()
                loss.backward()
                tm.mark()
                torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                tm.mark()
                del feats, batch, loss
                s = tm.spans()
                if i == 0:
                    first_step_s = time.perf_counter() - t_wall
                if i >= warmup:
                    spans.append(s)
        finally:
            if prefetch is not None:
                prefetch.close()
            opt.zero_grad(set_to_none=True)
            del opt
        med = [statistics.median(x) for x in zip(*spans)]
        step_s = statistics.median(sum(s) for s in spans)
        f_target, f_draft = flops_per_step(self.tc, self.dc, B, T, K, host["rows"])
        peak = self.args.peak_tflops * 1e12
        row = dict(
            model=self.model,
            backend=backend,
            seq=T,
            batch=B,
            ttt=K,
            tokens_per_s=B * T / step_s,
            step_s=step_s,
            target_fwd_s=med[0],
            make_batch_s=med[1],
            draft_fwd_s=med[2],
            draft_bwd_s=med[3],
            optim_s=med[4],
            mfu=(f_target + f_draft) / step_s / peak,
            mfu_target=f_target / (med[0] + med[1]) / peak,
            mfu_draft=f_draft / (med[2] + med[3]) / peak,
            model_tflop_per_step=(f_target + f_draft) / 1e12,
            first_step_s=first_step_s,
            iters=args.iters,
        )
        if cuda:
            row.update(
                peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
                reserved_gib=torch.cuda.max_memory_reserved(dev) / 2**30,
            )
        return row


def run_model(args, model: str, device, dtype, out: Path, env: dict):
    bench = Bench(args, model, device, dtype)
    common = dict(
        env,
        mask_density=args.mask_density,
        draft_vocab=args.draft_vocab_size,
        peak_tflops=args.peak_tflops,
        parity_rel_err=bench.parity,
        attention=bench.attention,
        loss=bench.loss,
        command=" ".join(["python", "experiments/throughput.py", *sys.argv[1:]]),
    )
    batches = args.batch_size or DEFAULT_BATCHES.get(model, [2])
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    t_start = time.time()

    def write(row):
        row = {**row, **common}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    for n, backend in enumerate(args.backends):
        deadline = t_start + args.budget_s * (n + 1) / len(args.backends)  # an equal share of the budget each
        base_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        fits, tried = {}, set()
        key = dict(model=model, backend=backend, seq=args.max_len)  # what names a row of this backend

        def attempt(B):
            tried.add(B)
            try:
                bench.setup_backend(backend)
                r = write(bench.trial(backend, B))
                fits[B] = r
                return True
            except Exception as e:  # OOM (expected at the edge) or a failure: recorded, the run goes on
                oom = is_oom(e)
                write(dict(key, batch=B, oom=oom, error=None if oom else repr(e)[:500]))
                if not oom:
                    traceback.print_exc()
                free_memory(device)
                if backend != "hf":
                    bench.reset_compiled()
                return False

        for B in batches:
            if time.time() < deadline or not fits:
                attempt(B)
        # largest batch: linear memory model from the largest fitting trial, then verify
        if args.search and fits and capacity and time.time() < deadline:
            B0 = max(fits)
            per_sample = (fits[B0]["peak_gib"] - base_gib) / B0
            guess = int((capacity * 0.97 - base_gib) / per_sample)
            for B in (guess, guess - 1, guess - 2):
                if B <= B0 or B in tried or time.time() > deadline:
                    continue
                if attempt(B):
                    if B + 1 not in tried and time.time() < deadline:
                        attempt(B + 1)  # confirm the edge
                    break
        if fits:
            best = max(fits)
            write(
                dict(
                    key,
                    summary=True,
                    max_batch=best,
                    max_batch_confirmed=(best + 1) in tried and (best + 1) not in fits,
                    tokens_per_s_at_max=fits[best]["tokens_per_s"],
                    peak_gib_at_max=fits[best].get("peak_gib"),
                )
            )
        free_memory(device)
    if device.type == "cuda" and args.attn_bench and time.time() < t_start + args.budget_s + 60:
        attention_microbench(bench, write)


def attention_microbench(bench, write):
    """The target's attention forward at one row of --max-len: SDPA (torch's pick), SDPA forced to
    cuDNN, FlexAttention causal (compiled). Documents the causal-path choice in fast_target."""
    tc, T, dev = bench.tc, bench.args.max_len, bench.device
    q = torch.randn(1, tc.num_attention_heads, T, tc.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, tc.num_key_value_heads, T, tc.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bm = create_block_mask(causal_mask(), 1, None, T, T, device=dev)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    res = {}
    cands = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa_cudnn": lambda: _with(
            sdpa_kernel([SDPBackend.CUDNN_ATTENTION]),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        ),
        "sdpa_flash": lambda: _with(
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        ),
        "flex": lambda: flex_attention_compiled(q, k, v, block_mask=bm, enable_gqa=True),
    }
    for name, fn in cands.items():
        try:
            err = ((fn() - ref).abs().max() / ref.abs().max()).item()
            res[name] = {"ms": do_bench(fn, warmup=10, rep=50), "rel_err": err}
        except Exception as e:  # a backend that cannot run this shape
            res[name] = {"error": repr(e)[:200]}
    write(
        dict(
            model=bench.model,
            kind="attention_fwd",
            seq=T,
            heads=tc.num_attention_heads,
            kv_heads=tc.num_key_value_heads,
            results=res,
        )
    )


def _with(ctx, fn):
    with ctx:
        return fn()


# ------------------------------------------------------------------------------------ figure
def plot(results: Path, fig_path: Path):
    """Two rows: tokens/s per backend (comparison batch, and largest batch), with SpecForge's
    number; the step split at the comparison batch."""
    import matplotlib  # lazy: matplotlib with pyplot (~1 s), only to draw the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"): headless backend

    rows = [json.loads(l) for l in open(results) if l.strip()] if results.exists() else []
    trials = {}
    for r in rows:  # the latest measurement of each (model, backend, batch) wins
        if "tokens_per_s" in r and not r.get("summary"):
            trials[(r["model"], r["backend"], r["batch"])] = r
    models = [
        m
        for m in ("llama-3.1-8b", "qwen3-30b-a3b", "qwen3-8b", "tiny-llama", "tiny-moe")
        if any(k[0] == m for k in trials)
    ]
    if not models:
        print(f"[plot] no measurements in {results}")
        return
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    colors = {"SpecForge": "#999999", "hf": "#d62728", "compiled": "#1f77b4", "compiled-cg": "#2ca02c"}
    env = {}
    for j, m in enumerate(models):
        ax, ax2 = axes[0, j], axes[1, j]
        ref = SPECFORGE.get(m)
        cmp_batch = ref["batch"] if ref else min(k[2] for k in trials if k[0] == m)
        names, vals, hatch, labels = [], [], [], []
        if ref:
            names.append("SpecForge")
            vals.append(ref["tokens_per_s"])
            hatch.append("")
            labels.append(f"b{ref['batch']}")
        splits = []
        for be in BACKENDS:
            mine = {k[2]: r for k, r in trials.items() if k[0] == m and k[1] == be}
            if not mine:
                continue
            env = next(iter(mine.values()))
            for B, h in ((cmp_batch, ""), (max(mine), "//")):
                if B in mine and (h == "" or B != cmp_batch):
                    names.append(be)
                    vals.append(mine[B]["tokens_per_s"])
                    hatch.append(h)
                    labels.append(f"b{B}\n{mine[B].get('peak_gib', 0):.0f}G")
            if cmp_batch in mine:
                r = mine[cmp_batch]
                splits.append(
                    (be, [r["target_fwd_s"] + r["make_batch_s"], r["draft_fwd_s"], r["draft_bwd_s"], r["optim_s"]])
                )
        x = range(len(vals))
        bars = ax.bar(x, vals, color=[colors[n] for n in names], hatch=hatch, edgecolor="black", linewidth=0.5)
        for bar_, lab, v in zip(bars, labels, vals):
            ax.annotate(
                f"{v:,.0f}\n{lab}", (bar_.get_x() + bar_.get_width() / 2, v), ha="center", va="bottom", fontsize=7
            )
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.set_ylabel(f"tokens / s (seq {env.get('seq', '?')}, TTT {env.get('ttt', '?')})")
        ax.set_title(f"{m}: throughput (hatched: largest batch)", fontsize=10)
        ax.set_ylim(0, max(vals) * 1.3)
        if ref and "step_s" in ref:
            splits.insert(
                0,
                (
                    "SpecForge",
                    [
                        ref["target_fwd_s"],
                        ref["draft_fwd_s"],
                        ref["draft_bwd_s"],
                        ref["step_s"] - ref["target_fwd_s"] - ref["draft_fwd_s"] - ref["draft_bwd_s"],
                    ],
                ),
            )
        bottom = [0.0] * len(splits)
        for p, (phase, c) in enumerate(
            zip(
                ("target fwd + targets", "draft fwd", "draft bwd", "optimizer / other"),
                ("#8c564b", "#ff7f0e", "#9467bd", "#7f7f7f"),
            )
        ):
            h_ = [s[1][p] for s in splits]
            ax2.bar(range(len(splits)), h_, bottom=bottom, color=c, label=phase, edgecolor="black", linewidth=0.5)
            bottom = [a + b for a, b in zip(bottom, h_)]
        ax2.set_xticks(range(len(splits)), [s[0] for s in splits], rotation=20, fontsize=8)
        ax2.set_ylabel(f"step time split at batch {cmp_batch} (s)")
        ax2.legend(fontsize=7)
    fig.suptitle(
        f"EAGLE-3 training step, one {env.get('device', '?')} - torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, random weights, mask {env.get('mask_density', 0):.0%}, "
        f"{env.get('date', '')[:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(fig_path, dpi=130)
    print(f"[plot] {fig_path}")


def measure_mask_density(max_len: int) -> float:
    tok = load_tokenizer(resolve_target("smollm2"))
    ex = build_examples(load_records("sharegpt", 3000), tok, max_len, Counter())
    return sum(sum(e.loss_mask) for e in ex) / sum(len(e.input_ids) for e in ex)


@dataclasses.dataclass
class Args:
    target: tuple[str, ...] = ()
    """random-weight targets shaped like these presets (models/fast_target.py PRESETS; default llama-3.1-8b,
    --smoke: tiny-llama tiny-moe)"""
    backends: tuple[Literal["hf", "compiled", "compiled-cg"], ...] = BACKENDS
    batch_size: tuple[int, ...] = ()
    """batches to time first (default: SpecForge's, DEFAULT_BATCHES; --smoke: 2)"""
    search: bool = True
    """then search the largest batch that fits"""
    max_len: int = 4096
    """tokens per row (every row full)"""
    ttt_length: int = 7
    draft_vocab_size: int = 32000
    mask_density: float = MASK_DENSITY
    """assistant share of the loss mask"""
    measure_mask: bool = False
    """measure --mask-density from the packaged chats first"""
    iters: int = 4
    """timed steps (median)"""
    warmup: int = 2
    """untimed steps first"""
    budget_s: float = 360
    """soft time budget per target (shared equally by the backends)"""
    out: Path = ROOT / "experiments/results/throughput_h200.jsonl"
    figure: Path = ROOT / "experiments/figures/backends_h200.png"
    draft_eager: bool = False
    """compiled backends: keep the draft step eager (diagnosis)"""
    attn_bench: bool = True
    """end with the attention microbenchmark"""
    plot_only: bool = False
    """only redraw the figure from --out"""
    smoke: bool = False
    """tiny models on CPU (fp32): checks the script end to end"""
    peak_tflops: tyro.conf.Suppress[float] = 0.0  # measured at the start


def main(args: Args):
    if args.plot_only:
        return plot(args.out, args.figure)
    if args.smoke:
        args.target = args.target or tuple(SMOKE)
        args.max_len, args.draft_vocab_size, args.iters, args.warmup, args.batch_size = (
            128,
            64,
            2,
            1,
            args.batch_size or (2,),
        )
        args.out, args.figure = Path("/tmp/throughput_smoke.jsonl"), Path("/tmp/backends_smoke.png")
        args.out.unlink(missing_ok=True)
        device, dtype = torch.device("cpu"), torch.float32
    else:
        args.target = args.target or ("llama-3.1-8b",)
        if not torch.cuda.is_available():
            raise SystemExit("needs a GPU (use --smoke on CPU)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    if args.measure_mask:
        args.mask_density = measure_mask_density(args.max_len)
        print(f"[mask] measured density {args.mask_density:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    args.peak_tflops = peak_matmul_tflops(device, dtype)
    print(f"[peak] {dtype} matmul: {args.peak_tflops:.1f} TFLOP/s on {env['device']}", flush=True)
    for model in args.target:
        run_model(args, model, device, dtype, args.out, env)
        free_memory(device)
    plot(args.out, args.figure)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
