"""The sweeps' CSVs -> PNG figures under experiments/figures/ (matplotlib, Agg).

    python experiments/plot.py                      # every study whose CSV exists
    python experiments/plot.py --results DIR --figures DIR

ttt_scaling.csv -> ttt_tau.png (τ vs TTT per benchmark: seed mean, min-max band, every seed as a
dot) and ttt_cost.png (draft step time and peak memory vs TTT from ttt_cost_h200.jsonl, each step
alone on the GPU, else the CSV's training time and peak memory); moe_drafts.csv -> moe_tau.png;
data_regen.csv -> regen_tau.png (bars: seed mean, min-max error bars, dots: seeds);
throughput_h200.jsonl -> backends_h200.png (experiments/throughput.py's figure: HF vs compiled);
families_h200.csv -> families_h200.png (τ and expected speed-up τ / (1 + c) per family at each K: mean
of the benchmarks, bars: seed mean, error bars: min-max over seeds, dots: seeds); the same figure of the rows made
on an H100, families_h100/families.csv -> families_h100.png (each named by the card its rows ran on).
A CSV holding rows of several scales is plotted at the scale of its last row (the others are
counted in the title).
"""

import csv
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.families import SETTINGS as FAMILY_SETTINGS  # noqa: E402
from experiments.moe_drafts import SETTINGS as MOE_SETTINGS  # noqa: E402
from experiments.sweep import BENCHMARKS, RESULTS  # noqa: E402

FIGURES = RESULTS.parent / "figures"
COLORS = {"mtbench": "#1f77b4", "humaneval": "#2ca02c", "gsm8k": "#d62728", "mean": "#444444"}


def read_rows(path: Path) -> tuple[list[dict], int]:
    """Rows of the CSV at its last row's scale, and how many rows of other scales were left out."""
    rows = list(csv.DictReader(open(path, newline="")))
    if not rows:
        return [], 0
    scale = rows[-1]["scale"]
    keep = [r for r in rows if r["scale"] == scale]
    return keep, len(rows) - len(keep)


def by_setting(rows: list[dict], col: str) -> dict[str, list[float]]:
    out = defaultdict(list)
    for r in rows:
        if r.get(col) not in (None, ""):
            out[r["setting"]].append(float(r[col]))
    return out


def subtitle(rows: list[dict], others: int) -> str:
    r = rows[-1]
    hw = json.loads(r["hardware"])
    s = json.loads(r["scale"])
    v = json.loads(r["versions"])
    return (
        f"{hw.get('gpu', hw.get('cpu', '?'))}, torch {v.get('torch', '?')}; "
        + (
            f"{s['steps']} steps x {s['batch_tokens']} tok (packed rows of {s['max_len']}), "
            if s.get("batch_tokens")
            else f"{s['steps']} steps x {s['batch_size']} seqs of <= {s['max_len']} tok, "
        )
        + f"K={s['eval_k'] if 'eval_k' in s else ' and '.join(map(str, s['eval_ks']))}, "
        # num_prompts caps each set (MT-Bench has 80, HumanEval 164); seeds: the most any setting has
        + (f"<= {s['num_prompts']} prompts/benchmark, " if s["num_prompts"] else "every prompt, ")
        + f"up to {len({x['seed'] for x in rows})} seeds; {r['date'][:10]}"
        + (f" ({others} rows of other scales not shown)" if others else "")
    )


def spread_line(ax, xs, per_x: list[list[float]], color, label):
    mean = [sum(v) / len(v) for v in per_x]
    ax.plot(xs, mean, "-o", color=color, label=label, markersize=4)
    ax.fill_between(xs, [min(v) for v in per_x], [max(v) for v in per_x], color=color, alpha=0.15)
    for x, v in zip(xs, per_x):
        ax.scatter([x] * len(v), v, color=color, s=8, alpha=0.6)


def plot_ttt(path: Path, figures: Path) -> list[Path]:
    rows, others = read_rows(path)
    if not rows:
        return []
    ttt = lambda s: int(s.removeprefix("ttt"))  # noqa: E731
    settings = sorted({r["setting"] for r in rows}, key=ttt)
    xs = [ttt(s) for s in settings]
    fig, axes = plt.subplots(1, len(BENCHMARKS) + 1, figsize=(4.2 * (len(BENCHMARKS) + 1), 3.8), squeeze=False)
    for ax, b in zip(axes[0], (*BENCHMARKS, "mean")):
        vals = by_setting(rows, f"tau_{b}")
        spread_line(ax, xs, [vals[s] for s in settings], COLORS[b], b)
        ax.set_title(f"{b}" if b != "mean" else "mean of the benchmarks")
        ax.set_xlabel("TTT length")
        ax.set_ylabel("τ (tokens / target forward)")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    fig.suptitle("EAGLE-3 τ vs training-time-test length\n" + subtitle(rows, others), fontsize=9)
    fig.tight_layout()
    out = [figures / "ttt_tau.png"]
    fig.savefig(out[0], dpi=130)
    plt.close(fig)

    cost = path.parent / "ttt_cost_h200.jsonl"
    if cost.exists():  # each draft step alone on the GPU (bench_draft_step.py): the sweep's runs shared it
        recs = [json.loads(line) for line in open(cost)]
        pts = sorted((r["ttt"], r["ms"], r["peak_gib"]) for r in recs if r.get("ms"))
        cxs = [p[0] for p in pts]
        panels = (
            ([[p[1]] for p in pts], "draft step fwd+bwd+AdamW (ms)"),
            ([[p[2]] for p in pts], "draft step peak memory (GiB)"),
        )
        r0 = recs[0]
        title = (
            f"Training cost vs TTT length: SmolLM2's EAGLE-3 draft, {r0['batch']} x {r0['seq']} tokens, "
            f"draft vocab {r0['vocab']}, "
            f"{r0['impl']}, {r0['dtype']}\n{r0['device']}, torch {r0['torch']}, one step alone (median); {r0['date']}"
        )
    else:
        cxs = xs
        panels = tuple(
            ([by_setting(rows, col)[s] for s in settings], label)
            for col, label in (
                ("train_seconds", "training time (s)"),
                ("peak_memory_gib", f"peak memory (GiB, {rows[-1]['peak_memory_kind']})"),
            )
        )
        title = "Training cost vs TTT length\n" + subtitle(rows, others)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, (per_x, label) in zip(axes, panels):
        spread_line(ax, cxs, per_x, "#444444", label)
        ax.set_xlabel("TTT length")
        ax.set_ylabel(label)
        ax.set_xticks(cxs)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.append(figures / "ttt_cost.png")
    fig.savefig(out[1], dpi=130)
    plt.close(fig)
    return out


def plot_bars(path: Path, figures: Path, name: str, title: str, order: list[str] | None = None) -> list[Path]:
    rows, others = read_rows(path)
    if not rows:
        return []
    seen = list(dict.fromkeys(r["setting"] for r in rows))
    settings = [s for s in (order or []) if s in seen] + [s for s in seen if s not in (order or [])]
    groups = (*BENCHMARKS, "mean")
    width = 0.8 / len(settings)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * len(settings) * 0.35 + 2), 4))
    cmap = plt.get_cmap("tab10")
    for i, s in enumerate(settings):
        for j, b in enumerate(groups):
            v = by_setting(rows, f"tau_{b}")[s]
            if not v:
                continue
            x = j + (i - (len(settings) - 1) / 2) * width
            m = sum(v) / len(v)
            ax.bar(
                x,
                m,
                width,
                color=cmap(i % 10),
                label=s if j == 0 else None,
                yerr=[[m - min(v)], [max(v) - m]],
                capsize=2,
                edgecolor="black",
                linewidth=0.4,
            )
            ax.scatter([x] * len(v), v, color="black", s=6, zorder=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("τ (tokens / target forward)")
    lo = min(float(r["tau_mean"]) for r in rows)
    ax.set_ylim(max(0.0, lo - 0.3), None)
    ax.legend(fontsize=7, ncol=min(4, len(settings)))
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title + "\n" + subtitle(rows, others), fontsize=9)
    fig.tight_layout()
    out = figures / name
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return [out]


def plot_families(path: Path, figures: Path, order: list[str], name: str = "families_h200.png") -> list[Path]:
    """Two panels, τ and expected speed-up (mean of the benchmarks), a bar per (family, K)."""
    rows, others = read_rows(path)
    if not rows:
        return []
    ks = json.loads(rows[-1]["scale"])["eval_ks"]
    seen = list(dict.fromkeys(r["setting"] for r in rows))
    settings = [s for s in order if s in seen] + [s for s in seen if s not in order]
    width = 0.8 / len(ks)
    fig, axes = plt.subplots(1, 2, figsize=(max(11, 1.1 * len(settings) * 2), 4))  # 11: the subtitle fits
    cmap = plt.get_cmap("tab10")
    for ax, (col, label) in zip(
        axes, (("tau_mean", "τ (tokens / target forward)"), ("speedup_mean", "expected speed-up τ / (1 + c)"))
    ):
        drawn = set()
        for i, k in enumerate(ks):
            vals = by_setting(rows, f"{col}_k{k}")
            for j, s in enumerate(settings):
                v = vals[s]
                if not v:
                    continue
                drawn.add(s)
                x, m = j + (i - (len(ks) - 1) / 2) * width, sum(v) / len(v)
                ax.bar(
                    x,
                    m,
                    width,
                    color=cmap(i),
                    label=f"K = {k}" if j == 0 else None,
                    yerr=[[m - min(v)], [max(v) - m]],
                    capsize=2,
                    edgecolor="black",
                    linewidth=0.4,
                )
                ax.scatter([x] * len(v), v, color="black", s=6, zorder=3)
        for j, s in enumerate(settings):  # an empty column (e.g. a draft cost not timed) must not read as zero
            if s not in drawn:
                ax.text(j, 0.05, "not measured", rotation=90, ha="center", va="bottom", fontsize=7, color="#555555")
        ax.axhline(1.0, color="#888888", linewidth=0.8)  # plain decoding
        ax.set_xticks(range(len(settings)), settings, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "Draft families at one budget: mean of MT-Bench, HumanEval, GSM8K (c: draft cost per step in target forwards)\n"
        + subtitle(rows, others),
        fontsize=9,
    )
    fig.tight_layout()
    out = figures / name
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return [out]


@dataclass
class PlotArgs:
    results: str = str(RESULTS)
    figures: str = str(FIGURES)


def moe_settings() -> list[str]:
    return [s for s, _ in MOE_SETTINGS]


def regen_settings() -> list[str]:
    return ["original", "regenerated"]


def main(a: PlotArgs) -> list[Path]:
    results, figures = Path(a.results), Path(a.figures)
    figures.mkdir(parents=True, exist_ok=True)
    made = []
    if (results / "ttt_scaling.csv").exists():
        made += plot_ttt(results / "ttt_scaling.csv", figures)
    for study, png, title, settings in (
        ("moe_drafts", "moe_tau.png", "MoE draft MLPs vs the dense EAGLE-3 draft", moe_settings),
        ("data_regen", "regen_tau.png", "Training data: ShareGPT's answers vs the target's own", regen_settings),
    ):
        if (results / f"{study}.csv").exists():
            made += plot_bars(results / f"{study}.csv", figures, png, title, settings())
    for rows, png in (("families_h200.csv", "families_h200.png"), ("families_h100/families.csv", "families_h100.png")):
        if (results / rows).exists():
            made += plot_families(results / rows, figures, [s for s, _ in FAMILY_SETTINGS], png)
    if (results / "throughput_h200.jsonl").exists():
        from experiments.throughput import plot as plot_backends  # lazy: imports torch and triton (seconds)

        plot_backends(results / "throughput_h200.jsonl", figures / "backends_h200.png")
        made.append(figures / "backends_h200.png")
    for p in made:
        print(f"[plot] {p}")
    if not made:
        print(f"[plot] nothing to plot in {results}")
    return made


if __name__ == "__main__":
    main(tyro.cli(PlotArgs))
