"""Every draft family side by side (issue 20): the same target, data, held-out split, recipe and
token budget for each; τ per benchmark at K = 3 and K = 7, per-position acceptance, the draft cost
per verification step and the expected speed-up.

    eagle3        EAGLE-3, chain drafting (K draft forwards per step)
    eagle3.1      EAGLE-3.1: + fc_norm and norm_output
    eagle3-lk     EAGLE-3 trained with the LK objective lk-lambda (the KL / α mix; lk-alpha is one --only away)
    peagle        P-EAGLE: K tokens from one parallel draft forward
    dflash        DFlash: one block of K masked slots per draft forward, hard CE
    dflash-specforge  DFlash with the recipe of SpecForge's published DFlash configs: --num-anchors 512 (up to
                  512 blocks a conversation: one at most reply tokens of a 1,024-token row; train.py's
                  default is 32) and --loss-decay 7 (slot k weighted exp(-(k-1)/7)); 2026-12-07's dflash run at
                  train.py's defaults reached held-out acc_0 0.43 against eagle3's 0.81
                  (experiments/results/families_h100/README.md)
    dflash-dpace  DFlash with D-PACE slot weights
    dflash-dpace-3l  the same with 3 draft layers, not 1: every other setting has one, DFlash's published drafts
                  several; whether depth is what keeps the block drafters' first slot at 38-43% acceptance
                  against EAGLE-3's 53-62% (2026-12-07, experiments/results/families_h100/README.md)
    domino        Domino: DFlash blocks + a GRU correction head
    dspark        DSpark: blocks whose anchor predicts, Markov + confidence heads (all K verified)

Every family is trained for K = --ttt-length (7) and evaluated at each K of --eval-ks: EAGLE-3 chains
draft K deep; the fixed-K families draft their 7 per forward and the first K are verified
(evaluate.py -k), so at K = 3 a block drafter still pays for its whole block. Per (benchmark, K), τ and the
per-position acceptance come from --num-prompts conversations decoded --eval-batch at once (the whole sets on a
GPU; core/batched_chain.py, per conversation equal to batch 1), and the draft cost from --cost-prompts of them
decoded again one at a time, where evaluate.py times drafting (propose + catch-up) and verification forwards
(core/speculative.py); then

    c        = draft seconds per verification step / target seconds per verification step
    speed-up = τ / (1 + c)     (a step costs one target forward plus its drafting and emits τ tokens;
                                plain decoding emits one token per target forward)

Rows: experiments/results/families_h200.csv (default; --smoke: a temporary dir), columns `columns()`
below: per K, tau_{benchmark}_k{K}, tau_mean_k{K}, speedup_{benchmark}_k{K}, speedup_mean_k{K} (mean
of the benchmarks' speed-ups), draft_cost_k{K}, draft_ms_k{K} and target_ms_k{K} (per verification
step, pooled over the benchmarks), accept_pos_k{K} (JSON: benchmark -> acceptance rate per position);
then sweep.py's shared columns. Figure: experiments/plot.py -> figures/families_h200.png.

    python experiments/families.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --eval-device cuda  # H200
    python experiments/families.py --smoke --only eagle3 dflash                                          # CPU

experiments/README.md ("Families side by side") has the H200 command and its budget.
"""

import dataclasses
import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.sweep import BENCHMARKS, COLUMNS, RESULTS, Sweep, SweepArgs, main  # noqa: E402

SETTINGS = [
    ("eagle3", []),
    ("eagle3.1", ["--fc-norm", "--norm-output"]),
    ("eagle3-lk", ["--objective", "lk-lambda"]),
    ("peagle", ["--strategy", "peagle"]),
    ("dflash", ["--strategy", "dflash"]),
    ("dflash-specforge", ["--strategy", "dflash", "--num-anchors", "512", "--loss-decay", "7"]),
    ("dflash-dpace", ["--strategy", "dflash", "--objective", "dpace"]),
    ("dflash-dpace-3l", ["--strategy", "dflash", "--objective", "dpace", "--draft-layers", "3"]),
    ("domino", ["--strategy", "domino"]),
    ("dspark", ["--strategy", "dspark"]),
]
KS = (3, 7)


def columns(ks) -> list[str]:
    """sweep.py's columns with its chain-K τ block replaced by this study's measurements."""
    per_k = lambda k: [  # noqa: E731
        *(f"tau_{b}_k{k}" for b in BENCHMARKS),
        f"tau_mean_k{k}",
        *(f"speedup_{b}_k{k}" for b in BENCHMARKS),
        f"speedup_mean_k{k}",
        f"draft_cost_k{k}",
        f"draft_ms_k{k}",
        f"target_ms_k{k}",
        f"accept_pos_k{k}",
    ]
    measured = ["eval_ks", *(c for k in ks for c in per_k(k))]
    return [*COLUMNS[:3], *measured, *COLUMNS[COLUMNS.index("eval_k") + 1 :]]


@dataclass
class FamiliesArgs(SweepArgs):
    data: str = "sharegpt-greedy"  # the shipped draft's recipe, not the sweeps' v1 (experiments/README.md)
    """v3, the regenerated ShareGPT (train.py's default); on the GPU the mix of the draft shipped on 2026-12-04
    (experiments/h200_scale.sh builds it with SHIPPED_MIX=1: --data /tmp/scale/mix_data)"""
    max_len: int = 1024  # the shipped draft's recipe too
    holdout: int = 256
    batch_tokens: int = 32768
    """32 packed rows of 1,024 a step: the one step shape of every family, half the tokens of a step at which three
    runs at once peaked at 20 + 13 + 38 GiB (78 GB by nvidia-smi) on an H100 on 2026-12-06, so three should sit
    beside each other on an 80 GB GPU with room (estimated from that probe, not yet run at this budget)"""
    steps: int = 1200
    """the token budget: 1,200 x 32,768 = 39.3M tokens (packed, ~99% real), above the ~35M real tokens of 2,000 x 32
    padded conversations, where the shipped recipe (warm-up 200) had held-out acc_0 0.777 (issue 33 asks for eagle3
    >= 0.765; experiments/results/scale_h200/warmup200_5600/)"""
    train_args: str = "--warmup 120"
    """the shipped recipe's flags beyond the columns: its warm-up, a tenth of the steps as there"""
    eval_ks: tuple[int, ...] = KS
    """verified draft tokens per step of the evaluation (replaces --eval-k); each at most --ttt-length"""
    all_seeds: tuple[str, ...] = ("eagle3", "dflash")
    """the settings run at every seed of --seeds; the others at the first only"""
    num_prompts: int = 250
    """conversations per benchmark for τ (MT-Bench: 80 with 2 turns each, HumanEval 164, GSM8K the first 250)"""
    eval_batch: int = 64
    """conversations decoded at once for τ (evaluate.py --batch: every family here but EAGLE-3 trees batches)"""
    cost_prompts: int = 2
    """conversations per benchmark decoded again one at a time, whose timed steps give the draft cost c (batched
    steps are not timed); 0 = none: the τ pass must then run at --eval-batch 1 and is timed itself"""

    def scale(self) -> dict:
        s = super().scale()
        del s["eval_k"]
        return {**s, "eval_ks": list(self.eval_ks), "cost_prompts": self.cost_prompts}


def pick(by_proposer: dict, k: int) -> dict:
    """The one draft proposer result of a benchmark that verified k tokens per step (no tree)."""
    hits = [r for r in by_proposer.values() if r.get("k") == k and r.get("topk", 1) == 1]
    if len(hits) != 1:
        raise ValueError(f"expected one proposer with k = {k}, found {sorted(by_proposer)}")
    return hits[0]


class FamiliesSweep(Sweep):
    def __init__(self, study, settings, args: FamiliesArgs):
        super().__init__(study, settings, args)
        self.ks = args.eval_ks
        self.columns = columns(self.ks)
        if self.shares_gpu and not (args.cost_prompts and shutil.which("flock")):
            # eval_cmd locks the timed pass against the others; without a separate timed pass or flock(1), it can't
            why = "no flock(1) here" if args.cost_prompts else "--cost-prompts 0 times the τ pass"
            print(f"[families] timed passes need the GPU to themselves ({why}): one evaluation at a time")
            self.eval_parallel = 1

    @property
    def shares_gpu(self) -> bool:
        """Several evaluations at once on the GPU, where they time-slice."""
        return self.eval_parallel > 1 and self.a.eval_device != "cpu"

    def seeds_of(self, setting: str) -> tuple[int, ...]:
        return self.a.seeds if setting in self.a.all_seeds else self.a.seeds[:1]

    def eval_cmd(self, run: Path) -> list[str]:
        """τ on --num-prompts at --eval-batch, then (--cost-prompts) the draft cost from batch-1 conversations."""
        tau = super().eval_cmd(run)
        if not self.a.cost_prompts:
            return tau
        cost = super().eval_cmd(run, num_prompts=self.a.cost_prompts, batch=1, name="eval_cost")
        if self.shares_gpu:
            # the timed pass needs the GPU to itself: evaluations sharing it time-slice, and the draft's small
            # kernels wait the most (2026-12-07, three at once on an H100: eagle3's c at K = 7 read 1.36, 0.44
            # alone, its τ equal to the digit). The τ passes hold the lock shared, a timed pass exclusively.
            lock = str(run.parent / ".timed_pass.lock")
            tau, cost = ["flock", "-s", lock, *tau], ["flock", "-x", lock, *cost]
        return ["bash", "-c", f"{shlex.join(tau)} && {shlex.join(cost)}"]

    def eval_results(self, run: Path, name: str = "eval") -> dict:
        """The τ pass's summaries with the cost pass's timings: its draft and target seconds per verification step
        give c, and the expected speed-up is the τ pass's τ / (1 + c)."""
        results = super().eval_results(run, name)
        if not self.a.cost_prompts:
            return results
        cost = super().eval_results(run, "eval_cost")
        for b, by_proposer in results.items():
            for name, s in by_proposer.items():
                c = cost[b][name]
                s.update({f: c[f] for f in ("drafts", "draft_seconds", "target_seconds", "draft_cost")})
                s["expected_speedup"] = s["tau"] / (1 + c["draft_cost"])
        return results

    def metrics(self, results: dict) -> dict:
        row = {"eval_ks": " ".join(map(str, self.ks))}
        for k in self.ks:
            r = {b: pick(results[b], k) for b in BENCHMARKS if b in results}
            drafts = sum(x["drafts"] for x in r.values())
            draft_s, target_s = (sum(x[f] for x in r.values()) for f in ("draft_seconds", "target_seconds"))
            row.update(
                {
                    **{f"tau_{b}_k{k}": round(x["tau"], 4) for b, x in r.items()},
                    f"tau_mean_k{k}": round(sum(x["tau"] for x in r.values()) / len(r), 4),
                    **{f"speedup_{b}_k{k}": round(x["expected_speedup"], 4) for b, x in r.items()},
                    f"speedup_mean_k{k}": round(sum(x["expected_speedup"] for x in r.values()) / len(r), 4),
                    f"draft_cost_k{k}": round(draft_s / target_s, 4),
                    f"draft_ms_k{k}": round(1e3 * draft_s / drafts, 3),
                    f"target_ms_k{k}": round(1e3 * target_s / drafts, 3),
                    f"accept_pos_k{k}": json.dumps(
                        {b: [round(a, 4) for a in x["acceptance_per_pos"]] for b, x in r.items()}
                    ),
                }
            )
        return row


def prepare(a: FamiliesArgs) -> FamiliesArgs:
    if max(a.eval_ks) > a.ttt_length:
        raise SystemExit(f"--eval-ks {a.eval_ks}: the fixed-K families draft --ttt-length {a.ttt_length} per step")
    if a.smoke:  # smoke_args' one prompt a set: one timed conversation too
        a = dataclasses.replace(a, cost_prompts=min(a.cost_prompts, 1))
    if not a.cost_prompts and a.eval_batch > 1:
        raise SystemExit("--cost-prompts 0 times the τ pass itself: give --eval-batch 1 (batched steps are not timed)")
    return a if a.csv else dataclasses.replace(a, csv=str(RESULTS / "families_h200.csv"))


if __name__ == "__main__":
    args = tyro.cli(FamiliesArgs)
    if args.eval_k != SweepArgs.eval_k:
        raise SystemExit("families.py evaluates at every K of --eval-ks (default 3 7); --eval-k is not used here")
    sys.exit(main("families", SETTINGS, args, prepare=prepare, sweep=FamiliesSweep))
