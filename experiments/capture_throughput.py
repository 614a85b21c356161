"""Feature-capture throughput on one GPU (written for an H200; torch >= 2.11).

    python experiments/capture_throughput.py --smollm2 /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
    python experiments/capture_throughput.py --smoke        # tiny shapes on CPU: checks the script runs

Targets: SmolLM2-135M-Instruct (the packaged GGUF, dequantised to bf16) and a random-weight
model shaped like Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, ffn 14336, vocab 128256),
built on the meta device, then to_empty() on the GPU and initialised there (normal(0, 0.02)
matrices, unit norms, rotary tables rebuilt). Inputs: random token ids, full sequences of
--max-len tokens (no padding), --batch-tokens tokens per forward.

Per (target, seq) it reports
  fwd_tok_s      target forward with the aux-layer hooks (capture.Target), features left on
                 the GPU: CUDA-event time, median of --iters after --warmup
  capture_tok_s  what `capture.py features` does per shard: forward + copy to the host +
                 packing (features.capture_examples) + FeatureStore.put (safetensors, fsync,
                 rename) on --store-dir; wall time, median of --iters shards, shards deleted after
  bytes_per_token  shard bytes / tokens (input_ids int32 + loss_mask u8 + (n_aux + 1) * H bf16)
  write_gb_s     shard bytes / put() time
  peak_gib       torch.cuda.max_memory_allocated() during the forward
Correctness, inline: on one short sequence the captured aux/final hidden states equal HF's
output_hidden_states[i + 1] and lm_head(final) equals HF's logits (max rel. error printed).
Every measurement prints a row and appends one JSON line (hardware, versions, commit) to --out.
"""

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.chat import Example  # noqa: E402
from experiments.common import short_commit  # noqa: E402

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)
LLAMA_8B_SMOKE = {
    **LLAMA_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "num_hidden_layers": 8,
}


@dataclasses.dataclass
class Args:
    target: tuple[Literal["smollm2", "llama8b"], ...] = ("smollm2", "llama8b")
    """which targets: SmolLM2 (--smollm2) and a random-weight Llama-3.1-8B shape"""
    smollm2: str = "smollm2"
    """the SmolLM2 target: a .gguf path, an HF dir, or 'smollm2' (packaged)"""
    max_len: tuple[int, ...] = ()
    """tokens per sequence (default 4096; --smoke: 128)"""
    batch_tokens: int = 0
    """tokens per forward (0 = 32768; --smoke: 512)"""
    iters: int = 0
    """timed repetitions (0 = 5; --smoke: 2)"""
    warmup: int = 2
    """untimed repetitions first"""
    store_dir: Path | None = None
    """where shards are written (default: a temp dir)"""
    out: Path | None = None
    """JSONL to append to (default experiments/results/capture_h200.jsonl; --smoke: $TMPDIR/capture_smoke.jsonl)"""
    smoke: bool = False
    """tiny shapes on CPU (fp32) to test the script"""


def random_llama(shape: dict, device, dtype):
    """Llama-shaped model with random weights: meta init, to_empty on the device, init there."""
    import torch  # lazy: --help runs without torch (seconds)
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: transformers (~1.5 s), as torch

    cfg = LlamaConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)  # allocated once, in the target dtype
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)  # RMSNorm weights
    # non-persistent buffers (the rotary inv_freq) are garbage after to_empty: rebuild them
    rot = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rot)(cfg)
    assert (
        torch.isfinite(model.model.rotary_emb.inv_freq).all()
        and model.model.rotary_emb.inv_freq.device.type == device.type
    )
    return model.eval()


def env_info(device) -> dict:
    import torch  # lazy: --help runs without torch (seconds)
    import transformers  # lazy: transformers (~1.5 s), as torch

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": short_commit() or "unknown",
        "host": platform.node(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu_count"] = os.cpu_count()
    return info


def main(args: Args):
    import torch  # lazy: --help runs without torch (seconds)

    from core.features import capture_examples  # lazy: imports torch
    from data.feature_store import FeatureStore, feature_schema  # lazy: imports torch
    from models.target import Target  # lazy: imports torch

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    seqs = args.max_len or ([128] if args.smoke else [4096])
    batch_tokens = args.batch_tokens or (512 if args.smoke else 32768)
    reps = args.iters or (2 if args.smoke else 5)
    out = args.out or (
        Path(tempfile.gettempdir()) / "capture_smoke.jsonl"
        if args.smoke
        else ROOT / "experiments" / "results" / "capture_h200.jsonl"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    info = env_info(device)
    print(f"# {info}", flush=True)
    if args.store_dir:
        args.store_dir.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(dir=args.store_dir)  # None: the system temp dir

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for name in args.target:
        t0 = time.time()
        if name == "smollm2":
            target = Target.load(args.smollm2, None, dtype, device)
        else:
            target = Target(random_llama(LLAMA_8B_SMOKE if args.smoke else LLAMA_8B, device, dtype))
        load_s = time.time() - t0
        c = target.config
        H, V = c.hidden_size, c.vocab_size
        # correctness: hooks capture HF's hidden_states[i + 1]; final (normed) -> HF logits
        ids = torch.randint(0, V, (1, 64), device=device)
        f = target(ids)
        with torch.no_grad():
            ref = target.model(ids, output_hidden_states=True)
        want = torch.cat([ref.hidden_states[i + 1] for i in target.aux_layers], -1)
        rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        err = max(rel(f.aux_hidden, want), rel(target.lm_head(f.final_hidden), ref.logits))
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"{name}: capture differs from HF by {err}"
        print(
            f"# {name}: {c.num_hidden_layers} layers, H={H}, V={V}, aux {target.aux_layers}, {dtype}, "
            f"loaded in {load_s:.1f} s; check vs HF: max rel err {err:.1e}",
            flush=True,
        )

        for seq in seqs:
            B = max(1, batch_tokens // seq)
            ntok = B * seq
            gen = torch.Generator().manual_seed(seq)
            batch = [Example(torch.randint(0, V, (seq,), generator=gen).tolist(), [1] * seq) for _ in range(B)]
            x = torch.tensor([e.input_ids for e in batch], device=device)
            row = {
                "bench": "capture",
                "target": name,
                "seq": seq,
                "batch": B,
                "dtype": str(dtype).removeprefix("torch."),
                "hidden": H,
                "layers": c.num_hidden_layers,
                "n_aux": len(target.aux_layers),
                **info,
            }
            try:
                # forward only
                times = []
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                for i in range(args.warmup + reps):
                    sync()
                    t = time.perf_counter()
                    target(x)
                    sync()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t)
                row["fwd_ms"] = 1e3 * statistics.median(times)
                row["fwd_tok_s"] = ntok / statistics.median(times)
                if device.type == "cuda":
                    row["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                    # 2 * params * tokens (+ attention 4 * L * T^2 * H / 2 causal) FLOPs
                    n_params = sum(
                        p.numel() for n, p in target.model.named_parameters() if "embed" not in n and "lm_head" not in n
                    )
                    flops = 2 * n_params * ntok + 2 * c.num_hidden_layers * B * seq * seq * H
                    row["fwd_tflops"] = flops / statistics.median(times) / 1e12
                # capture: forward + host copy + pack + atomic shard write, as capture.py does
                store = FeatureStore(
                    Path(tmp.name) / f"{name}-{seq}",
                    feature_schema({"fingerprint": name}, target.aux_layers, H, dtype, {"num_examples": B}),
                )
                cap, put, nbytes = [], [], 0
                for i in range(args.warmup + reps):
                    t = time.perf_counter()
                    tensors = capture_examples(target, batch, ntok, device)
                    t1 = time.perf_counter()
                    path = store.put(f"s{i}", tensors, samples=[(j, seq) for j in range(B)])
                    t2 = time.perf_counter()
                    nbytes = path.stat().st_size
                    store.delete(f"s{i}")
                    if i >= args.warmup:
                        cap.append(t2 - t)
                        put.append(t2 - t1)
                row["capture_ms"] = 1e3 * statistics.median(cap)
                row["capture_tok_s"] = ntok / statistics.median(cap)
                row["put_ms"] = 1e3 * statistics.median(put)
                row["write_gb_s"] = nbytes / statistics.median(put) / 1e9
                row["bytes_per_token"] = nbytes / ntok
                row["shard_mb"] = nbytes / 2**20
            except torch.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e)[:200]}"
                torch.cuda.empty_cache()
            row["date"] = datetime.datetime.now().isoformat(timespec="seconds")
            print(
                f"{name:8s} seq {seq:5d} x{B:<3d} fwd {row.get('fwd_tok_s', 0):10.0f} tok/s "
                f"({row.get('fwd_tflops', 0):.0f} TFLOP/s)  capture {row.get('capture_tok_s', 0):10.0f} tok/s  "
                f"{row.get('bytes_per_token', 0):7.0f} B/tok  write {row.get('write_gb_s', 0):.2f} GB/s  "
                f"peak {row.get('peak_gib', 0):.1f} GiB {row.get('error', '')}",
                flush=True,
            )
            with open(out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tmp.cleanup()
    print(f"# appended to {out}", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
