"""Feature-producer throughput: our HF target vs vLLM (--backend hf / vllm), side by side on the
same conversations, in one run, as `capture.py features` produces them.

    ./dev python experiments/producer_throughput.py                 # ~8 minutes on a 2-core CPU
    ./dev python experiments/producer_throughput.py --out experiments/results/vllm_producer_cpu.jsonl

Conversations: the first --num-records of --data, tokenized as train.py / capture.py do (--max-len).
Per producer: load it (vLLM: start its engine, reported as startup_s, not timed), one untimed
warm-up batch, then features.capture_examples over every conversation (the target forward, the
copy to the host and the packing of a capture shard; no store write, which both share). tokens/s =
real tokens / that time. Correctness inline: every producer's tensors are compared with the first's
(max |diff| / max |value| per field). One JSON line per producer to --out.
"""

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, MaxLenOption, NumRecordsOption, TargetOption  # noqa: E402
from core.vllm_features import vllm_target  # noqa: E402


@dataclass
class Args(MaxLenOption, NumRecordsOption, DataOption, TargetOption):
    data: str = "sharegpt"
    """as train.py --data (the packaged ShareGPT: its order is not sorted by length, unlike sharegpt-greedy's head)"""
    num_records: int = 24  # a few batches: both producers in ~8 CPU minutes
    batch_tokens: int = 32768
    """padded tokens per target forward (capture.py --batch-tokens)"""
    producers: tuple[str, ...] = ("hf", "vllm")
    out: str = ""
    """append one JSON line per producer here"""


def main(args: Args):
    import torch  # lazy: --help runs without torch (seconds)

    from core.features import capture_examples, load_target  # lazy: imports torch
    from core.runlog import hardware, versions  # lazy: imports torch
    from data.datasets import build_examples, load_records  # lazy: imports torch
    from models.target import load_tokenizer, resolve_target  # lazy: imports torch

    target_dir = resolve_target(args.target)
    examples = build_examples(load_records(args.data, args.num_records), load_tokenizer(target_dir), args.max_len)
    tokens = sum(len(e.input_ids) for e in examples)
    print(f"[producers] {len(examples)} conversations, {tokens} tokens, torch threads {torch.get_num_threads()}")
    ref, rows = None, []
    for producer in args.producers:
        t0 = time.time()
        target = load_target(producer, target_dir, None, torch.float32, "cpu", args.max_len, vllm_target)
        startup = time.time() - t0
        try:
            capture_examples(target, examples[:4], args.batch_tokens, "cpu")  # warm-up
            t0 = time.time()
            got = capture_examples(target, examples, args.batch_tokens, "cpu")
            secs = time.time() - t0
            extra = {"vllm_version": target.worker.info["vllm_version"]} if producer == "vllm" else {}
        finally:
            if hasattr(target, "close"):
                target.close()
        ref = ref or (producer, got)
        diff = {
            k: float((got[k].float() - ref[1][k].float()).abs().max() / ref[1][k].float().abs().max())
            for k in ("aux_hidden", "final_hidden")
        }
        assert torch.equal(got["input_ids"], ref[1]["input_ids"])
        row = {
            "what": "producer_throughput",
            "producer": producer,
            "tokens": tokens,
            "conversations": len(examples),
            "seconds": round(secs, 2),
            "tokens_per_s": round(tokens / secs, 1),
            "startup_s": round(startup, 1),
            "rel_diff_vs": {"producer": ref[0], **diff},
            "batch_tokens": args.batch_tokens,
            "max_len": args.max_len,
            "dtype": "float32",
            "command": "python experiments/producer_throughput.py " + shlex.join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "versions": {**versions(), **extra},
            "hardware": {**hardware("cpu"), "load_avg_1m": round(os.getloadavg()[0], 2)},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(f"{r['producer']:>5}: {r['tokens_per_s']:8.1f} tokens/s  (startup {r['startup_s']} s)")


if __name__ == "__main__":
    main(tyro.cli(Args))
