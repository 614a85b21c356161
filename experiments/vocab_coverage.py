"""How much of what the target writes a draft vocabulary of size N can propose at all.

A token outside the draft vocabulary (data/vocab.py: the N most frequent trained tokens) is never
drafted, so its share bounds acceptance from above. For each prompt set this decodes the target
greedily exactly as evaluate.py does (same prompts, chat template, turns and --max-new-tokens),
ranks the target's tokens by their count in the training data (train.py's own count_tokens over
the same examples), and reports for every size N:

    coverage    share of the output tokens inside the top N
    window_k    share of output positions whose next k tokens are all inside (a chain of k drafts
                can be accepted whole only there: an upper bound on full acceptance at K = k)

    ./dev python experiments/vocab_coverage.py --sizes 8192 16384 32768 49152     # SmolLM2, ~5 CPU minutes

One JSON row per (set, size) goes to --out (default experiments/results/useful_draft/vocab_coverage.jsonl).
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, MaxLenOption, NumRecordsOption, TargetOption  # noqa: E402
from core.runlog import git_commit, hardware, versions  # noqa: E402
from data.benchmarks import load_prompts  # noqa: E402
from data.chat import render  # noqa: E402
from data.datasets import build_examples, load_records, split_holdout  # noqa: E402
from data.vocab import build_vocab_mapping, count_tokens, coverage_rows  # noqa: E402
from models.target import eos_ids, load_tokenizer, resolve_target  # noqa: E402


@dataclasses.dataclass
class Args(MaxLenOption, NumRecordsOption, DataOption, TargetOption):
    max_len: int = 1024  # the shipped draft's training (drafts/smollm2-135m-eagle3/provenance.json)
    holdout: int = 256
    """the last examples train.py holds out (not counted, as in train.py)"""
    sets: tuple[str, ...] = (
        "mtbench",
        "humaneval",
        "gsm8k",
        str(ROOT / "experiments/results/useful_draft/unseen_sharegpt.jsonl"),
    )
    num_prompts: int = 8
    max_new_tokens: int = 128
    sizes: tuple[int, ...] = (8192, 16384, 32768)
    windows: tuple[int, ...] = (3, 7)
    threads: int = 0
    out: Path = ROOT / "experiments/results/useful_draft/vocab_coverage.jsonl"


def greedy_outputs(model, tok, convs: list[list[str]], max_new: int, eos) -> list[list[int]]:
    """The target's greedy replies, turn by turn as evaluate.run_dataset feeds them."""
    outs = []
    for turns in convs:
        msgs = []
        for user in turns:
            msgs.append({"role": "user", "content": user})
            prompt = torch.tensor([render(tok, msgs)])
            with torch.no_grad():
                ids = model.generate(prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=eos)[0]
            out = ids[prompt.shape[1] :].tolist()
            outs.append(out)
            msgs.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
    return outs


def main(a: Args) -> list[dict]:
    from transformers import AutoModelForCausalLM  # lazy: transformers (~1.5 s) stays out of --help

    if a.threads:
        torch.set_num_threads(a.threads)
    target_dir = resolve_target(a.target)
    tok = load_tokenizer(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    V = model.config.vocab_size
    t0 = time.time()
    examples = build_examples(load_records(a.data, a.num_records or None), tok, a.max_len)
    train, _ = split_holdout(examples, a.holdout)
    counts = count_tokens(train, V)
    print(f"[counts] {len(train)} training examples, {int(counts.sum())} trained tokens, {time.time() - t0:.0f}s")
    masks = {n: build_vocab_mapping(counts, min(n, V))[1] for n in a.sizes}
    meta = {
        "target": a.target,
        "data": a.data,
        "max_new_tokens": a.max_new_tokens,
        "num_prompts": a.num_prompts,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware("cpu"),
    }
    rows, eos = [], eos_ids(model, tok)
    for name in a.sets:
        ds = Path(name).stem if Path(name).suffix else name
        outs = greedy_outputs(model, tok, load_prompts(name, a.num_prompts), a.max_new_tokens, eos)
        for n, m in masks.items():
            row = {"set": ds, "draft_vocab_size": n, **coverage_rows(outs, m, a.windows), **meta}
            rows.append(row)
            print(
                f"[{ds}] N={n:<6} coverage {row['coverage']:.3f}  "
                + "  ".join(f"all of next {k} inside {row[f'window_{k}']:.3f}" for k in a.windows),
                flush=True,
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
