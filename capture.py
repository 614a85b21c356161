"""Run the frozen target over a dataset, offline.

    torchrun --nproc_per_node=N capture.py features --target T --data D --out DIR
    python capture.py regenerate --target T --data D --out FILE.jsonl [--temperature 0.8]
    python capture.py prompts --target T --out FILE.jsonl --num-prompts N

features    Tokenizes D exactly as train.py does (same --num-records / --max-len, so sample id i
            is train.py's example i; train.py applies --holdout to the ids), runs the target and
            stores per sample input_ids, loss_mask, the aux-layer hidden states and the final
            (normed) hidden state in a FeatureStore (data/feature_store.py) in --dtype, from our
            target (--backend hf, the default, or compiled) or from vLLM (--backend vllm: one
            engine in its own venv, core/vllm_features.py; the same store, keys and schema). Logits
            are not stored: train.py recomputes them with the frozen lm_head. Samples are packed
            into shards of ~--shard-mb by a plan that depends only on the sample lengths; rank r
            of W captures shards r, r+W, ...; a rerun skips shards already in the store.
            Train from it with `train.py --features DIR` (no target forward).
regenerate  The target writes new assistant turns: every assistant turn is regenerated from the
            conversation so far, whose earlier assistant turns are the regenerated ones. Greedy
            (--temperature 0) or sampled with --seed. Output: one JSON line per conversation
            {id, messages, ...} appended as batches finish (rerun to resume: done ids are
            skipped), FILE.dropped.jsonl for conversations the target could not continue, and
            FILE.provenance.json (model, settings, source, counts, dates, versions).
prompts     The target writes user prompts (Magpie-style self-instruct, data/selfinstruct.py): kept
            ones go to FILE.jsonl as conversations to answer with `regenerate --data FILE.jsonl`.

Exit status (each subcommand): 0 finished (regenerate: also stopped by --max-output-mb, as asked); 75 stopped
unfinished by --time-limit (sysexits.h's EX_TEMPFAIL, as train.py: rerun the same command to resume); 1 failed
(one `error:` line); 130 interrupted by Ctrl-C (rerun to resume). The provenance or capture_runs.jsonl says the same.
"""

import json
import math
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from core.capture_io import check_context, check_inputs, check_out
from core.cli_options import DataOption, DeviceOption, DtypeOption, MaxLenOption, NumRecordsOption, TargetOption
from core.distributed import all_sum, barrier, destroy, init_distributed, pick_device
from core.features import BACKENDS, capture_examples, load_target, target_identity
from core.prompts import PromptsConfig, write_prompts
from core.regenerate import RegenConfig, regenerate
from core.runlog import output_kind, run_metadata
from core.vllm_features import vllm_target
from data.chat import DataError
from data.datasets import build_examples, load_records
from data.feature_store import FeatureStore, StoreError, feature_schema, plan_shards, tokens_digest
from models.target import load_tokenizer, resolve_target

EXIT_STOPPED = 75  # stopped unfinished by --time-limit: rerun to resume (train.py's code for the same)
EXIT_INTERRUPTED = 130


# ====================================================================== features
@dataclass
class FeaturesConfig(DeviceOption, DtypeOption, MaxLenOption, NumRecordsOption, DataOption, TargetOption):
    """The target's features of --data into a FeatureStore for `train.py --features`. Exit 0 when the store is
    complete, 75 when --time-limit stopped it first (rerun to resume), 1 on an error. --target, --data,
    --num-records, --max-len, --dtype and --device mean what they mean to train.py (--dtype: the target runs and
    the features are stored in it)."""

    num_records: int = 1200  # train.py's default: a store for a default run holds its records
    aux_layers: tuple[int, ...] = ()
    """as train.py --aux-layers (default [1, L//2-1, L-4])"""
    out: str = "runs/features"
    """FeatureStore directory (local or shared by several nodes)"""
    shard_mb: int = 256
    """approximate shard size"""
    batch_tokens: int = 32768
    """padded tokens per target forward"""
    time_limit: float = 0
    """seconds; stop cleanly (after a shard) before exceeding it; rerun to resume (0 = none); exit 75 when it
    stops so, 0 when the store is complete"""
    backend: str = "hf"
    """target forward: hf (transformers; the reference) | compiled (models/fast_target.py) | vllm (a vLLM engine in
    its own venv, NANOSPEC_VLLM_VENV or .venv-vllm, created when missing; core/vllm_features.py)"""


def check_store_out(out: Path):
    """features --out: a new or empty directory, or a feature store to resume or add to; nothing else (a store
    written into a training run, an export or a target model's directory mixed their files)."""
    if not out.is_dir() or (out / "store.json").exists():
        return
    if kind := output_kind(out):
        raise SystemExit(f"error: --out {out} is {kind}, not a feature store: give a new or empty directory")
    # (what a store's first write leaves before its store.json: shards/ and hidden temporary files)
    found = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "shards")
    if found:
        shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
        raise SystemExit(
            f"error: --out {out} holds files that are not a feature store's ({shown}): give a new or empty directory"
        )


def check_features(cfg: FeaturesConfig):
    """features: option values that cannot work, one `error:` line each, before anything loads or is written
    (--num-records -1 said the data file was empty; --shard-mb 0 wrote a shard per sample; --batch-tokens 0 and
    --max-len -5 ran; --aux-layers 1 1, which train.py refuses, was captured)."""
    if cfg.backend not in BACKENDS:
        raise SystemExit(f"error: --backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    for name, low, hint in (
        ("num_records", 0, " (0 = all)"),
        ("max_len", 2, ""),
        ("shard_mb", 1, ""),
        ("batch_tokens", max(cfg.max_len, 1), f" (one sample of --max-len {cfg.max_len})"),
    ):
        if (v := getattr(cfg, name)) < low:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}{hint}, got {v}")
    if not (math.isfinite(cfg.time_limit) and cfg.time_limit >= 0):
        raise SystemExit(f"error: --time-limit must be a finite number at least 0 (0 = none), got {cfg.time_limit}")
    if len(set(cfg.aux_layers)) != len(cfg.aux_layers) or any(i < 0 for i in cfg.aux_layers):
        raise SystemExit(f"error: --aux-layers {' '.join(map(str, cfg.aux_layers))}: distinct layer indices, 0 or more")
    check_inputs(cfg.target, cfg.data)
    check_store_out(Path(cfg.out))


def features(cfg: FeaturesConfig) -> dict:
    check_features(cfg)
    check_out(Path(cfg.out), is_dir=True)
    kind, dtype = pick_device(cfg.device, cfg.dtype)
    t_start = time.time()
    rank, world, local = init_distributed(kind)
    device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    target = None
    try:
        if rank == 0:
            resolve_target(cfg.target)  # a GGUF is converted once, by rank 0
        barrier()
        target_dir = resolve_target(cfg.target)
        check_context(target_dir, cfg.max_len, "--max-len")  # a stored row is one target forward
        tokenizer = load_tokenizer(target_dir)
        stats = Counter()
        records = load_records(cfg.data, cfg.num_records or None)
        if not records:  # an empty store would otherwise be marked complete
            raise DataError(f"{cfg.data}: no records to capture (the file is empty)")
        examples = build_examples(records, tokenizer, cfg.max_len, stats)
        target = load_target(
            cfg.backend, target_dir, list(cfg.aux_layers) or None, dtype, device, cfg.max_len, vllm_target
        )
        H = target.config.hidden_size
        bytes_per_token = (len(target.aux_layers) + 1) * H * dtype.itemsize + 4 + 1
        data = {
            "data": cfg.data,
            "num_records": cfg.num_records,
            "records": len(records),
            "max_len": cfg.max_len,
            "num_examples": len(examples),
            "tokens_sha": tokens_digest(examples),
            "stats": dict(stats),
        }
        schema = feature_schema(target_identity(target), target.aux_layers, H, dtype, data)
        schema["shard_tokens"] = max(1, cfg.shard_mb * 2**20 // bytes_per_token)
        store = FeatureStore(cfg.out, schema, writer=f"{socket.gethostname()}-rank{rank}")
        store.clean_temps()
        plan = plan_shards([len(e.input_ids) for e in examples], schema["shard_tokens"])
        mine = plan[rank::world]
        todo = [s for s in mine if s[0] not in store]
        say(
            f"[capture] {len(examples)} samples ({sum(len(e.input_ids) for e in examples)} tokens) in "
            f"{len(plan)} shards; {world} rank(s); rank 0 has {len(todo)}/{len(mine)} shards to do; "
            f"{dtype}, target {target_dir} ({cfg.backend})"
        )
        t0, tokens, nbytes, done, last = time.time(), 0, 0, 0, 0.0
        stopped = False
        for key, first, count in todo:
            if cfg.time_limit and time.time() - t_start + last > cfg.time_limit:
                stopped = True
                break
            ts = time.time()
            part = examples[first : first + count]
            tensors = capture_examples(target, part, cfg.batch_tokens, device)
            path = store.put(
                key,
                tensors,
                meta={"target_path": str(target_dir), "backend": cfg.backend},
                samples=[(first + j, len(e.input_ids)) for j, e in enumerate(part)],
            )
            n = int(tensors["input_ids"].numel())
            tokens, nbytes, done, last = tokens + n, nbytes + path.stat().st_size, done + 1, time.time() - ts
            say(f"[capture] rank 0: shard {done}/{len(todo)} {key}: {n} tokens, {n / last:.0f} tok/s")
        secs = time.time() - t0
        tot = all_sum(torch.tensor([tokens, nbytes, done, int(stopped)], dtype=torch.float64))
        rate = all_sum(torch.tensor([tokens / max(secs, 1e-9)], dtype=torch.float64))
        res = {
            "tokens": int(tot[0]),
            "bytes": int(tot[1]),
            "shards_written": int(tot[2]),
            "tokens_per_s": float(rate[0]),
            "bytes_per_token": float(tot[1] / max(tot[0], 1)),
            "seconds": secs,
            "complete": len(store.keys()) == len(plan),
            "stopped_by_time_limit": bool(tot[3]),
        }
        say(
            f"[capture] {res['tokens']} tokens in {secs:.1f} s: {res['tokens_per_s']:.0f} tok/s over {world} "
            f"rank(s), {res['bytes_per_token']:.0f} bytes/token; "
            f"store {cfg.out}: {len(store.keys())}/{len(plan)} shards"
            + ("" if res["complete"] else " (incomplete: rerun the same command to resume)")
        )
        if rank == 0:
            meta = run_metadata(cfg, world=world, device=device, extra={"results": res})
            with open(Path(cfg.out) / "capture_runs.jsonl", "a") as f:
                f.write(json.dumps(meta, default=str) + "\n")
            print(json.dumps({"capture": res}), flush=True)
        return res
    finally:
        if hasattr(target, "close"):  # --backend vllm: the engine process
            target.close()
        destroy()


def exit_status(res: dict) -> int:
    """0: finished; EXIT_STOPPED: --time-limit stopped it unfinished (features: the store is incomplete; regenerate,
    prompts: their provenance's last run), so a script tells it from a finished run (both exited 0)."""
    if "complete" in res:  # features
        return 0 if res["complete"] else EXIT_STOPPED
    return EXIT_STOPPED if res["runs"][-1]["status"] == "stopped_by_time_limit" else 0


def main():
    cfg = tyro.extras.subcommand_cli_from_dict(
        {"features": FeaturesConfig, "regenerate": RegenConfig, "prompts": PromptsConfig}, description=__doc__
    )
    try:
        if isinstance(cfg, FeaturesConfig):
            res = features(cfg)
        elif isinstance(cfg, PromptsConfig):
            res = write_prompts(cfg)
        else:
            res = regenerate(cfg)
    except (DataError, FileNotFoundError, StoreError) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # what was written is whole: appended lines and shards are committed one by one
        print("\ninterrupted (SIGINT): rerun the same command to resume", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    if code := exit_status(res):
        raise SystemExit(code)


if __name__ == "__main__":
    main()
