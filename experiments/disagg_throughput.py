"""Training throughput: colocated online training vs disaggregated (P producers + 1 consumer).

    ./dev python experiments/disagg_throughput.py            # SmolLM2-135M target, default draft, CPU
    ./dev python experiments/disagg_throughput.py --plot     # only redraw the figure from the JSONL

Each mode runs train.py as a user would (the launcher for the disaggregated one) on the same data
order; the metric is trained samples per second over the steps after the first two (steady
state, from metrics.jsonl timestamps), plus the wall time of the whole command (start-up
included). Appends one JSON row per mode to experiments/results/disagg_throughput_cpu.jsonl
(skipping modes already there for this config) with hardware, versions, date and the command;
the figure is disagg_throughput_cpu.png. The loss curves of the modes are compared inline (the
disaggregated run must follow the colocated one).
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
JSONL = RESULTS / "disagg_throughput_cpu.jsonl"
FIG = RESULTS / "disagg_throughput_cpu.png"
BASE = [
    "--num-records",
    "300",
    "--holdout",
    "8",
    "--eval-batch-size",
    "8",
    "--max-len",
    "256",
    "--batch-size",
    "4",
    "--ttt-length",
    "3",
    "--steps",
    "14",
    "--no-progress",
]
MODES = {"colocated": [], "disagg 1P+1C": ["--producers", "1"], "disagg 2P+1C": ["--producers", "2"]}


def run(name, extra, out):
    cmd = [
        sys.executable,
        "train.py",
        *BASE,
        "--out",
        str(out),
        "--overwrite",
        *extra,
    ]  # a mode not in the JSONL yet starts again
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r["split"] == "train"]
    bs = int(BASE[BASE.index("--batch-size") + 1])
    steady = (len(rows) - 2) * bs / (rows[-1]["time"] - rows[1]["time"])
    return {
        "mode": name,
        "samples_per_s": steady,
        "tokens_per_s_logged": rows[-1]["tokens_per_s"],
        "wall_s": wall,
        "losses": [r["loss"] for r in rows],
        "command": " ".join(["python", "train.py", *BASE, *extra]),
    }


def plot():
    import matplotlib  # lazy: matplotlib with pyplot (~1 s), only to draw the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"): headless backend

    rows = [json.loads(l) for l in open(JSONL)]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [r["mode"] for r in rows]
    ax[0].bar(names, [r["samples_per_s"] for r in rows], color=["gray", "tab:blue", "tab:orange"][: len(rows)])
    ax[0].set_ylabel("trained samples / s (steady state)")
    ax[1].bar(names, [r["wall_s"] for r in rows], color=["gray", "tab:blue", "tab:orange"][: len(rows)])
    ax[1].set_ylabel("wall time of the command (s)")
    hw = rows[0]["hardware"]
    fig.suptitle(
        f"SmolLM2-135M target, EAGLE-3 draft (TTT 3), batch 4 x 256 tok, fp32 — {hw['cpu']} "
        f"({hw['cpu_count']} cores), torch {rows[0]['versions']['torch']}, {rows[0]['date'][:10]}",
        fontsize=8,
    )
    for a in ax:
        a.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(FIG, dpi=120)
    print(f"wrote {FIG}")


@dataclasses.dataclass
class Args:
    out: str = "runs/disagg_throughput"
    """run directories of the modes (one subdirectory each)"""
    plot: bool = False
    """only redraw the figure from the JSONL"""


def main(args: Args):
    if not args.plot:
        from core.runlog import git_commit, hardware, versions  # lazy: imports torch; --plot runs without it

        done = {json.loads(l)["mode"] for l in open(JSONL)} if JSONL.exists() else set()
        for name, extra in MODES.items():
            if name in done:
                continue
            load0 = os.getloadavg()[0]  # other work on the machine skews the comparison: recorded
            res = run(name, extra, Path(args.out) / name.replace(" ", "_").replace("+", ""))
            res.update(
                loadavg_1min_before=round(load0, 2),
                loadavg_1min_after=round(os.getloadavg()[0], 2),
                hardware=hardware("cpu"),
                versions=versions(),
                git_commit=git_commit(),
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            )
            RESULTS.mkdir(parents=True, exist_ok=True)
            with open(JSONL, "a") as f:
                f.write(json.dumps(res) + "\n")
            print(json.dumps({k: res[k] for k in ("mode", "samples_per_s", "wall_s")}), flush=True)
        rows = [json.loads(l) for l in open(JSONL)]
        ref = rows[0]["losses"]
        for r in rows[1:]:  # the disaggregated runs follow the colocated curve
            worst = max(abs(a - b) / abs(a) for a, b in zip(ref, r["losses"]))
            print(f"{r['mode']}: max relative loss difference to colocated {worst:.2e}")
            assert worst < 1e-3, r["mode"]
    plot()


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
