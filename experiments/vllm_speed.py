"""Wall-clock decoding speed in vLLM's CPU build, batch 1, greedy: plain decoding, vLLM's
draft-free n-gram lookup and a draft (default: the shipped EAGLE-3 draft drafts/smollm2-135m-eagle3;
--strategy peagle|dflash: an exported draft of that family, served with its vLLM method), on the same
prompts, one engine process each, back to back.

    ./dev python experiments/vllm_speed.py                      # ~10 minutes on a 2-core CPU
    ./dev python experiments/vllm_speed.py --k 3 5 --num-prompts 6 --out experiments/results/vllm_speed_cpu.jsonl
    ./dev python experiments/vllm_speed.py --strategy dflash --draft RUN/export-vllm --k 7   # issue 33's families

Prompts: the first --num-prompts of MT-Bench (first turn), HumanEval and GSM8K each, rendered with
the target's chat template. Each prompt is decoded alone (batch 1) to --max-new-tokens (EOS ends it
earlier). tokens/s = generated tokens / the engine's generate time (model loading excluded); the
speed-ups are against plain decoding and n-gram lookup in the same run. Also checks that every
speculative run's output equals plain greedy decoding token for token.
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli_options import StrategyOption, TargetOption  # noqa: E402
from core.vllm_spec import run_job  # noqa: E402
from data.chat import render  # noqa: E402


@dataclass
class Args(StrategyOption, TargetOption):
    draft: str = "drafts/smollm2-135m-eagle3"
    k: tuple[int, ...] = (3,)
    """draft tokens per step for the draft (one run each; --strategy: its family, served with the vLLM method
    export.vllm_method names); n-gram lookup uses the first"""
    ngram_max: int = 4
    """vLLM prompt_lookup_max (longest n-gram matched)"""
    num_prompts: int = 6
    """per dataset (MT-Bench, HumanEval, GSM8K)"""
    max_new_tokens: int = 128
    eager: bool = True
    """vLLM without torch.compile (enforce_eager, as the rows before 2026-12-05); --no-eager: compiled, minutes
    more to start on a CPU"""
    out: str = ""
    """append one JSON line per run here"""


def prompts(tok, n: int) -> list[list[int]]:
    from data.benchmarks import load_prompts  # lazy: imports torch (seconds); --help runs without it

    return [
        render(tok, [{"role": "user", "content": turns[0]}])
        for ds in ("mtbench", "humaneval", "gsm8k")
        for turns in load_prompts(ds, n)
    ]


def jobs(a: Args) -> list[tuple[str, dict]]:
    """(name, run_job settings) of each engine run: plain, n-gram lookup at the first K, the draft at each K with
    its family's vLLM method (a family vLLM cannot serve is refused here, before any engine starts)."""
    from export import vllm_method  # lazy: imports torch (seconds); --help runs without it

    method, extra = vllm_method(a.strategy)
    return [
        ("plain", {"draft": None}),
        (
            f"ngram-k{a.k[0]}",
            {
                "method": "ngram",
                "k": a.k[0],
                "speculative_extra": {"prompt_lookup_max": a.ngram_max, "prompt_lookup_min": 1},
            },
        ),
        *(
            (f"{a.strategy}-k{k}", {"draft": a.draft, "k": k, "method": method, "speculative_extra": extra})
            for k in a.k
        ),
    ]


def main(a: Args) -> list[dict]:
    from core.runlog import git_commit, hardware, versions  # lazy: imports torch (seconds); --help runs without it
    from models.target import load_tokenizer, resolve_target  # lazy: imports torch, as core.runlog

    runs = jobs(a)
    target = resolve_target(a.target)
    ps = prompts(load_tokenizer(target), a.num_prompts)
    rows, ref = [], None
    common = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": git_commit(),
        "hardware": hardware("cpu"),
        "versions": versions(),
        "prompts": len(ps),
        "max_new_tokens": a.max_new_tokens,
        "draft": a.draft,
        "strategy": a.strategy,
        "eager": a.eager,
    }
    for name, job in runs:
        res = run_job(
            {
                "target": str(target),
                "prompts": ps,
                "max_tokens": a.max_new_tokens,
                "dtype": "float32",
                "max_model_len": 4096,
                "batch": False,
                "k": 1,
                "eager": a.eager,
                **job,
            },
            timeout=3600,
        )
        n = sum(map(len, res["outputs"]))
        m = res["metrics"]
        row = {
            "what": "vllm_speed",
            "run": name,
            "generated_tokens": n,
            "seconds": round(res["seconds"], 2),
            "tokens_per_s": round(n / res["seconds"], 2),
            "vllm_version": res["vllm_version"],
            **common,
        }
        if m["num_drafts"]:
            row["tau_proposed_steps"] = round(1 + m["num_accepted_tokens"] / m["num_drafts"], 3)
        if ref is None:
            ref = res["outputs"]
        else:
            row["same_output_as_plain"] = sum(x == y for x, y in zip(res["outputs"], ref))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("hardware", "versions")}), flush=True)
    plain, ngram = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_plain"], r["speedup_vs_ngram"] = (
            round(r["tokens_per_s"] / plain, 3),
            round(r["tokens_per_s"] / ngram, 3),
        )
    print(f"{'run':<12} {'tokens/s':>9} {'vs plain':>9} {'vs n-gram':>10}")
    for r in rows:
        print(f"{r['run']:<12} {r['tokens_per_s']:>9.2f} {r['speedup_vs_plain']:>8.2f}x {r['speedup_vs_ngram']:>9.2f}x")
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
