"""How full train.py's rows are on the packaged chats: real tokens / row tokens over one epoch of
GlobalBatches, one conversation per row (padded to the batch's longest, or to --max-len as
--pad-to-max-len / --compile do) against packed rows (data/packing.py), and --batch-tokens' rows
(TokenBatches, 8 rows a step, each padded to --max-len). Data only: no model runs,
so the numbers hold on any hardware. One JSON line per (max_len, batch) appended to
experiments/results/packing_efficiency.jsonl and printed.

    ./dev python experiments/packing_efficiency.py [--data sharegpt-greedy] [--num-records 0] [--max-len 1024 2048 4096]
"""

import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, NumRecordsOption  # noqa: E402
from data.datasets import GlobalBatches, build_examples, load_records  # noqa: E402
from data.packing import TokenBatches, first_fit_decreasing  # noqa: E402
from models.target import load_tokenizer, resolve_target  # noqa: E402


def epoch_efficiency(lengths: list[int], max_len: int, batch: int, seed: int = 0) -> dict:
    batches = GlobalBatches(len(lengths), batch, seed)
    real = rows_longest = rows_max = rows_packed = n_rows = 0
    for step in range(batches.per_epoch):
        ls = [lengths[i] for i in batches.indices(step)]
        real += sum(ls)
        rows_longest += len(ls) * max(ls)
        rows_max += len(ls) * -(-max_len // 128) * 128  # --pad-to-max-len rounds up to the flex block
        where = first_fit_decreasing(ls, max_len)
        R = 1 + max(r for r, _ in where)
        n_rows += R
        rows_packed += R * max(s + n for (_, s), n in zip(where, ls))
    return {
        "unpacked_longest": real / rows_longest,
        "unpacked_max_len": real / rows_max,
        "packed": real / rows_packed,
        "rows_per_batch_packed": n_rows / batches.per_epoch,
    }


def token_budget_efficiency(lengths: list[int], max_len: int, rows: int = 8, seed: int = 0) -> dict:
    """--batch-tokens rows * max_len: one epoch of TokenBatches, every row padded to --max-len (rounded up to
    the flex block, as train.py does); also the share of the epoch's conversations it trains."""
    tb = TokenBatches(lengths, rows, max_len, seed)
    real = sum(lengths[i] for s in range(tb.per_epoch) for i in tb.indices(s))
    trained = sum(len(tb.indices(s)) for s in range(tb.per_epoch))
    return {
        "token_budget_rows": rows,
        "token_budget": real / (tb.per_epoch * rows * -(-max_len // 128) * 128),
        "token_budget_conversations_per_step": trained / tb.per_epoch,
        "token_budget_epoch_share": trained / len(lengths),
    }


@dataclasses.dataclass
class Args(NumRecordsOption, DataOption):
    max_len: tuple[int, ...] = (1024, 2048, 4096)
    """row lengths, one set of rows each"""
    batch_size: tuple[int, ...] = (8, 32, 64)
    """global batches in conversations, one row each"""
    out: str = str(ROOT / "experiments" / "results" / "packing_efficiency.jsonl")


def main(a: Args):
    tok = load_tokenizer(resolve_target("smollm2"))
    records = load_records(a.data, a.num_records or None)
    for max_len in a.max_len:
        stats = Counter()
        lengths = [len(e.input_ids) for e in build_examples(records, tok, max_len, stats)]
        budget = token_budget_efficiency(lengths, max_len)
        for batch in a.batch_size:
            row = {
                "data": a.data,
                "conversations": len(lengths),
                "mean_tokens": sum(lengths) / len(lengths),
                "max_len": max_len,
                "batch": batch,
                **epoch_efficiency(lengths, max_len, batch),
                **budget,
                "date": time.strftime("%Y-%m-%d"),
            }
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
