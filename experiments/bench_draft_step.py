"""End-to-end EAGLE-3 draft training step on one GPU, every attention path x loss path.

    python experiments/bench_draft_step.py                # Llama-3.1-8B-shaped draft, seq 4096, TTT 7
    python experiments/bench_draft_step.py --smoke        # tiny shapes on CPU: checks the script runs
    python experiments/bench_draft_step.py --target smollm2 --max-len 512 --batch-size 16 --draft-vocab-size 8192 \
        --ttt-length 1 2 3 5 7 9 13 --attention flex --loss triton --out experiments/results/ttt_cost_h200.jsonl
        # the cost per TTT of the ttt_scaling.py drafts, each step alone on the GPU

The step is the draft's part of training: TTT forward over the target features, backward,
AdamW step (bf16 parameters, batch 1). The target's features are random tensors of the right
shapes with a 60% loss mask (the packaged chats' assistant share), so this isolates the
draft: attention eager / lse / flex x loss torch / triton / fused.
Time: median over --iters steps after --warmup (CUDA events). Memory: peak allocated during
the step minus what the inputs and the model already held. One JSON line per combination is
appended to experiments/results/draft_step_h200.jsonl.
"""

import dataclasses
import datetime
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.eagle3 import ATTENTION, LOSSES, Eagle3Batch, Eagle3Config, Eagle3Draft, local_counts  # noqa: E402
from models.layers import param_count  # noqa: E402

# hidden, ffn, heads, kv heads, head dim, rope theta, max positions, vocab, aux layers
DRAFT_SHAPES = {
    "llama8b": (4096, 14336, 32, 8, 128, 500000.0, 131072, 128256, [1, 15, 28]),
    "smollm2": (576, 1536, 9, 3, 64, 100000.0, 8192, 49152, [1, 14, 26]),  # SmolLM2-135M-Instruct: 30 layers
    "tiny": (64, 128, 4, 2, 16, 10000.0, 4096, 1000, [0, 1, 2]),
}


def draft_config(shape: str, draft_vocab: int) -> Eagle3Config:
    """The EAGLE-3 draft of a DRAFT_SHAPES target (its hidden size, heads and rope; rms eps 1e-5)."""
    hidden, ffn, heads, kv_heads, head_dim, rope_theta, max_pos, vocab, aux = DRAFT_SHAPES[shape]
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=max_pos,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        aux_layers=list(aux),
    )


def random_batch(cfg: Eagle3Config, B: int, T: int, dtype, device, seed=0) -> Eagle3Batch:
    g = torch.Generator(device=device).manual_seed(seed)
    H, V, Vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    p = torch.randn(B, T, Vd, device=device, generator=g).mul_(3).softmax(-1)
    return Eagle3Batch(
        aux_hidden=torch.randn(B, T, 3 * cfg.target_hidden_size, device=device, dtype=dtype, generator=g),
        embeds=torch.randn(B, T, H, device=device, dtype=dtype, generator=g),
        target_p=p,
        target_top=torch.randint(0, V, (B, T), device=device, generator=g),
        loss_mask=(torch.rand(B, T, device=device, generator=g) < 0.6).long(),
    )


@dataclasses.dataclass
class Args:
    target: Literal["llama8b", "smollm2"] = "llama8b"
    """whose draft shapes: a Llama-3.1-8B target's or SmolLM2-135M's"""
    max_len: int = 4096
    """tokens per row (--smoke: 96)"""
    batch_size: int = 1
    ttt_length: tuple[int, ...] = (7,)
    """one measurement per TTT length"""
    draft_vocab_size: int = 32000
    attention: tuple[str, ...] = ("eager", "lse", "flex")
    """TTT attention paths (train.py --attention; --smoke drops flex: no flex backward on CPU)"""
    loss: tuple[str, ...] = tuple(LOSSES)
    """head + loss paths (train.py --loss)"""
    iters: int = 5
    """timed steps (median)"""
    warmup: int = 2
    """untimed steps first"""
    out: Path = ROOT / "experiments/results/draft_step_h200.jsonl"
    """JSONL to append to (--smoke: /tmp/draft_step_smoke.jsonl)"""
    smoke: bool = False
    """tiny shapes on CPU (fp32): checks the script runs"""


def main(args: Args):
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    cfg = draft_config("tiny", 300) if smoke else draft_config(args.target, args.draft_vocab_size)
    T = 96 if smoke else args.max_len
    if smoke:
        args.attention = [a for a in args.attention if a != "flex"]  # no flex backward on CPU
        args.out = Path("/tmp/draft_step_smoke.jsonl")

    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device=device, dtype=dtype)
    # every target token in the draft vocab, so all masked rows are trained
    draft.d2t.zero_()
    draft.t2d[: cfg.draft_vocab_size] = True
    batch = random_batch(cfg, args.batch_size, T, dtype, device)
    batch.target_top.remainder_(cfg.draft_vocab_size)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, foreach=True)
    n_params = param_count(draft)
    base = {
        "name": "draft_step",
        "seq": T,
        "batch": args.batch_size,
        "vocab": cfg.draft_vocab_size,
        "hidden": cfg.hidden_size,
        "params_m": round(n_params / 1e6, 1),
        "dtype": str(dtype).split(".")[-1],
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }

    def step(attention, loss, ttt, counts):
        total, _ = draft(batch, ttt, counts, attention=attention, loss=loss)
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.detach()

    def timed_step(attention, loss, ttt, counts) -> tuple[float, float, float]:
        """(ms, peak GiB above what was allocated before, loss) of one step."""
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            total = step(attention, loss, ttt, counts)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - before) / 2**30, float(total)
        t0 = time.perf_counter()
        total = step(attention, loss, ttt, counts)
        return (time.perf_counter() - t0) * 1e3, float("nan"), float(total)

    rows = []
    for ttt in args.ttt_length:
        counts = local_counts(batch, draft.t2d, ttt)
        ref_loss = None  # every combination's first step starts from the same parameters: same loss
        for attention, loss in itertools.product(args.attention, args.loss):
            assert attention in ATTENTION and loss in LOSSES
            row = dict(base, ttt=ttt, impl=f"{attention}+{loss}", attention=attention, loss=loss)
            state = {k: v.clone() for k, v in draft.state_dict().items()}
            try:
                runs = [timed_step(attention, loss, ttt, counts) for _ in range(args.warmup + args.iters)]
                loss0 = runs[0][2]
                ref_loss = loss0 if ref_loss is None else ref_loss
                ms = statistics.median(r[0] for r in runs[args.warmup :])
                row.update(
                    ms=ms,
                    peak_gib=round(runs[-1][1], 3),
                    tokens_per_s=args.batch_size * T / (ms / 1e3),
                    loss_first_step=loss0,
                    loss_rel_err_vs_first=abs(loss0 - ref_loss) / abs(ref_loss),
                )
            except torch.OutOfMemoryError:
                row.update(ms=None, peak_gib=None, oom=True)
                opt.zero_grad(set_to_none=True)
            draft.load_state_dict(state)
            opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, foreach=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{'ttt':>4s} {'impl':16s} {'ms':>9s} {'peak GiB':>9s} {'tok/s':>9s} loss_err")
    for r in rows:
        if r.get("oom"):
            print(f"{r['ttt']:4d} {r['impl']:16s}       OOM")
        else:
            print(
                f"{r['ttt']:4d} {r['impl']:16s} {r['ms']:9.1f} {r['peak_gib']:9.2f} {r['tokens_per_s']:9.0f} "
                f"{r['loss_rel_err_vs_first']:.1e}"
            )


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
