"""How much of a draft's held-out accuracy comes from the target's loops: acc_k of a trained draft
on the same held-out chats, counted over all assistant tokens, over the tokens past a loop's first
repeat (data/loops.py) and over the rest.

    ./dev python experiments/loop_acc.py drafts/smollm2-135m-eagle3 --data CHATS.jsonl.xz --first 6752 --holdout 48

The chats are taken evenly spaced from --data after skipping the first --first records (for the shipped draft:
the 6,752 it trained on come first in data/sharegpt_smollm2_greedy), so none was seen in
training. The held-out evaluation is train.py's own (Trainer.evaluate, same masks and
counts), run once per token subset with the loss mask narrowed to it. One JSON row goes to
--out (default experiments/results/useful_draft/loop_acc.jsonl).
"""

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import MaxLenOption  # noqa: E402
from core.runlog import run_metadata  # noqa: E402
from core.train_config import TrainConfig  # noqa: E402
from core.trainer import Trainer  # noqa: E402
from data.datasets import text_lines  # noqa: E402
from data.loops import loop_cut  # noqa: E402
from export import open_draft  # noqa: E402


def loop_positions(ids: list[int], mask: list[int]) -> list[int]:
    """1 where a trained (mask 1) token lies past its reply's loop's first repeat, else 0. A reply
    is a maximal run of mask-1 positions."""
    out, t = [0] * len(ids), 0
    while t < len(ids):
        if not mask[t]:
            t += 1
            continue
        end = t
        while end < len(ids) and mask[end]:
            end += 1
        cut = loop_cut(ids[t:end])
        if cut is not None:
            out[t + cut : end] = [1] * (end - t - cut)
        t = end
    return out


@dataclasses.dataclass(kw_only=True)  # a required field (draft) and a re-declared one (max_len): core/cli_options.py
class Args(MaxLenOption):
    draft: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="DRAFT")]
    """a serving dir, run dir or checkpoint (EAGLE-3)"""
    data: str = str(ROOT / "data/sharegpt_smollm2_greedy/regen.jsonl.xz")
    """chats (.jsonl, .jsonl.gz or .jsonl.xz)"""
    first: int = 6752
    """records to skip (the draft's training data)"""
    holdout: int = 48
    """held-out chats to evaluate"""
    max_len: int = 1024  # the shipped draft's training (drafts/smollm2-135m-eagle3/provenance.json)
    out: str = str(ROOT / "experiments/results/useful_draft/loop_acc.jsonl")


def main(a: Args):
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp())
    rest = [line for i, line in text_lines(Path(a.data)) if i > a.first]  # numbered from 1
    # evenly spaced: regenerated files are in finishing order, short replies first within each window
    # (a third more than --holdout: some chats have nothing trainable within --max-len)
    m = a.holdout * 4 // 3 + 1
    rows = [rest[i * len(rest) // m] for i in range(m)]
    (tmp / "chats.jsonl").write_text("".join(rows))
    # train.py builds the target, tokenizes and holds the chats out exactly as in training; the rest
    # form the "training" split (it only sets the draft vocabulary, which the loaded draft replaces)
    cfg = TrainConfig(
        data=str(tmp / "chats.jsonl"),
        num_records=0,
        holdout=a.holdout,
        max_len=a.max_len,
        out=str(tmp / "run"),
        device="cpu",
        batch_size=1,
        eval_batch_size=4,
        progress=False,
    )
    tr = Trainer(cfg)
    draft, _ = open_draft(a.draft)
    tr.draft = tr.draft_step = draft.to(tr.device).eval()
    full = tr.eval_set
    loops = [loop_positions(e.input_ids, e.loss_mask) for e in full]
    subsets = {
        "all": full,
        "loop": [dataclasses.replace(e, loss_mask=lp) for e, lp in zip(full, loops)],
        "no_loop": [
            dataclasses.replace(e, loss_mask=[m * (1 - x) for m, x in zip(e.loss_mask, lp)])
            for e, lp in zip(full, loops)
        ],
    }
    row = {
        "what": "loop_acc",
        "draft": a.draft,
        "data": a.data,
        "records": f"{len(rows)} evenly spaced after the first {a.first}",
        "held_out_chats": len(full),
        "max_len": a.max_len,
    }
    n_all = sum(sum(e.loss_mask) for e in full)
    row["tokens"] = n_all
    row["loop_token_share"] = round(sum(map(sum, loops)) / max(n_all, 1), 4)
    for name, ex in subsets.items():
        tr.eval_set = [e for e in ex if sum(e.loss_mask)]
        with torch.no_grad():
            m = tr.evaluate()
        row[name] = {k: round(v, 4) for k, v in m.items() if k.startswith("acc_")}
        print(f"[{name}] " + " ".join(f"{k}={v:.3f}" for k, v in row[name].items()), flush=True)
    meta = run_metadata(cfg, world=1, device=tr.device)
    row.update(
        seconds=round(time.time() - t0),
        date=time.strftime("%Y-%m-%d"),
        command="python experiments/loop_acc.py " + " ".join(sys.argv[1:]),
        **{k: meta[k] for k in ("versions", "hardware", "git_commit") if k in meta},
    )
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in ("versions", "hardware")}), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
