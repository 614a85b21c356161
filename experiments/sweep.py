"""Shared machinery of the paper-reproduction sweeps (ttt_scaling.py, moe_drafts.py, data_regen.py).

For each (seed, setting) a sweep runs `train.py` then `evaluate.py` as subprocesses and appends
ONE row per finished run to a CSV under experiments/results/: the setting, the seed, τ per
benchmark (chain drafting with --eval-k tokens), held-out acc_0, training time, peak memory
(CUDA max allocated on GPU, max RSS on CPU; recorded by core/runlog.py), draft parameters, the
scale, the training config, git commit, hardware, versions, date and both commands. A run whose
(setting, seed, scale) is already in the CSV is skipped, so a sweep can be stopped and started
again; a run whose training finished but whose evaluation did not is evaluated again without
retraining. Seeds are the outer loop: when --budget-minutes stops the sweep early, every setting
has its first seed.

Scheduling (Sweep.run): up to --parallel trainings at once; evaluations (evaluate.py, --eval-batch
conversations per batch) start once no training runs, at most --eval-parallel at once, on the CPU
(--eval-device cpu) or the GPU. One exception: with --parallel 1, a GPU training and CPU evaluation
(--overlap-eval), run i is evaluated while run i+1 trains, so a run costs max(train, eval).

A study that measures more per run (families.py: several K, the draft cost) subclasses Sweep:
`columns`, `ks` (the K of the evaluation), `metrics` (a run's evaluation -> its CSV fields) and
`seeds_of` (the seeds of a setting). A setting whose flags hold `--strategy NAME` trains that family
(--draft-vocab-size is passed only to the families that read it).

--smoke: the tiny version for CI (2 steps, 1 setting, 1 seed, 1 prompt of 8 tokens, a CSV in a
temporary directory unless --csv says otherwise).
"""

import csv
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from core.cli_options import DataOption, DeviceOption, MaxLenOption, NumRecordsOption, TargetOption
from core.config import to_flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
BENCHMARKS = ("mtbench", "humaneval", "gsm8k")
COLUMNS = [
    "study",
    "setting",
    "seed",
    *(f"tau_{b}" for b in BENCHMARKS),
    "tau_mean",
    "eval_k",
    "acc_0_heldout",
    "train_seconds",
    "parallel",
    "eval_seconds",
    "peak_memory_gib",
    "peak_memory_kind",
    "draft_params_m",
    "scale",
    "config",
    "git_commit",
    "hardware",
    "versions",
    "date",
    "train_cmd",
    "eval_cmd",
    "run_dir",
]


@dataclass
class SweepArgs(DeviceOption, MaxLenOption, NumRecordsOption, DataOption, TargetOption):
    data: str = "sharegpt-regen"  # the sweeps' committed rows were trained on v1
    """training data of every setting (data_regen.py sets its own per setting)"""
    max_len: int = 512  # the committed rows' too (experiments/README.md)
    seeds: tuple[int, ...] = (0, 1)
    only: tuple[str, ...] = ()
    """run only these settings (names as the script lists them)"""
    steps: int = 200
    batch_size: int = 32
    batch_tokens: int = 0
    """a token budget per step (train.py --batch-tokens: packed rows of --max-len) instead of --batch-size
    conversations; 0 = conversations, as the committed rows were trained. Always passed: train.py's own default on a
    GPU sizes a budget from the whole card's memory, which neither matches the row's labels nor leaves room for
    --parallel runs beside it (2026-12-06, H100: three families' runs each took 65,536 tokens a step, 78 GB by
    nvidia-smi)"""
    ttt_length: int = 7
    """TTT steps of every setting that does not set its own"""
    lr: float = 3e-3
    holdout: int = 32
    draft_vocab_size: int = 8192
    num_prompts: int = 10
    """evaluation conversations per benchmark"""
    max_new_tokens: int = 128
    eval_k: int = 7
    """chain drafting depth K of the evaluation (the same for every setting)"""
    eval_batch: int = 10
    """conversations decoded at once per benchmark (evaluate.py --batch; chains only): one batched step costs
    about one batch-1 step on a GPU (launch-bound) and a CPU (weight-bandwidth-bound)"""
    eval_threads: int = 0
    """torch threads of each evaluate.py (0 = cores / --eval-parallel when several run, else torch's default)"""
    eval_parallel: int = 0
    """evaluations at once (0 = one on a GPU, where processes time-slice; with --parallel > 1 and CPU
    evaluation, one per core, each on one thread)"""
    parallel: int = 1
    """trainings at once on the one GPU (a SmolLM2-sized run leaves most of an H200 idle); each gets
    OMP_NUM_THREADS = cores / (2 x parallel) unless set, and train_seconds then counts the sharing
    (the row's `parallel` column says how many ran at once)"""
    eval_device: str = "cpu"
    """where evaluate.py decodes: cpu (fp32, the CPU machine's numbers) | cuda (fp32 on the GPU, beside the
    trainings: a GPU sweep's evaluations then cost seconds, not CPU-minutes each)"""
    overlap_eval: bool = True
    """evaluate run i (CPU) while run i+1 trains (only when training is on a GPU)"""
    budget_minutes: float = 60.0
    """start no new run once elapsed + the mean run time so far would pass this (0 = no limit)"""
    time_limit: float = 0.0
    """seconds from the sweep's start: trainings then stop with a checkpoint (train.py --time-limit, exit 75) and
    resume when the sweep runs again with the same arguments (a GPU call's limit; 0 = none)"""
    csv: str = ""
    """results CSV (default experiments/results/<study>.csv; --smoke: a temporary dir)"""
    runs_dir: str = "runs/experiments"
    train_args: str = "--pad-to-max-len"
    """extra train.py flags for every run, one string (shell-split), e.g.
    --train-args="--pad-to-max-len --attention lse" (padding every batch to --max-len gives flex one
    shape per TTT step: ~2 s of compiling each, once)"""
    smoke: bool = False
    dry_run: bool = False
    """print the commands and exit"""

    def scale(self) -> dict:
        """What makes two rows comparable (part of the skip key). batch_tokens only when set, so that rows trained
        on conversations before it existed keep their keys."""
        keys = (
            "target",
            "num_records",
            "steps",
            "batch_size",
            "max_len",
            "lr",
            "holdout",
            "draft_vocab_size",
            "num_prompts",
            "max_new_tokens",
            "eval_k",
            "eval_device",
            "eval_batch",
            "train_args",
        )
        return {k: getattr(self, k) for k in keys} | ({"batch_tokens": self.batch_tokens} if self.batch_tokens else {})


def smoke_args(a: SweepArgs, study: str) -> SweepArgs:
    tmp = Path(tempfile.mkdtemp(prefix=f"nanospec-{study}-smoke-"))
    return dataclasses.replace(
        a,
        seeds=a.seeds[:1],
        num_records=a.num_records or 40,
        steps=2,
        batch_size=2,
        max_len=64,
        batch_tokens=2 * 64 if a.batch_tokens else 0,  # two packed rows: the budget's path, at the smoke's size
        holdout=4,
        draft_vocab_size=512,
        num_prompts=1,
        max_new_tokens=8,
        eval_k=min(a.eval_k, 3),
        overlap_eval=False,
        budget_minutes=0,
        csv=a.csv or str(tmp / f"{study}.csv"),
        runs_dir=a.runs_dir if a.runs_dir != SweepArgs.runs_dir else str(tmp / "runs"),
    )


def done_keys(path: Path) -> set:
    if not path.exists():
        return set()
    with open(path, newline="") as f:
        return {(r["setting"], int(r["seed"]), r["scale"]) for r in csv.DictReader(f)}


def append_row(path: Path, row: dict, columns: list[str] = COLUMNS):
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def train_finished(run: Path) -> bool:
    p = run / "run.json"
    return p.exists() and "eval_end" in json.loads(p.read_text()).get("results", {})


def _last_json(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{log}: no JSON result line")


def _tail(log: Path, n=3000) -> str:
    return log.read_text()[-n:] if log.exists() else ""


class Sweep:
    """settings: [(name, extra train.py args)]; the study's name names the CSV and the runs."""

    columns = COLUMNS

    def __init__(self, study: str, settings: list[tuple[str, list[str]]], args: SweepArgs):
        if args.smoke and not args.only:
            settings = settings[-1:]  # the last: the MoE and longest-TTT code paths
        if args.only:
            unknown = set(args.only) - {s for s, _ in settings}
            if unknown:
                raise SystemExit(f"unknown settings {sorted(unknown)}: choose from {[s for s, _ in settings]}")
            settings = [s for s in settings if s[0] in args.only]
        self.study, self.settings, self.a = study, settings, args
        self.csv = Path(args.csv) if args.csv else RESULTS / f"{study}.csv"
        self.scale = json.dumps(args.scale(), sort_keys=True)
        cores = os.cpu_count() or 1
        self.eval_parallel = args.eval_parallel or (1 if args.eval_device != "cpu" or args.parallel == 1 else cores)
        self.eval_threads = args.eval_threads or (max(1, cores // self.eval_parallel) if self.eval_parallel > 1 else 0)
        self.ks = (args.eval_k,)  # evaluate.py -k

    def seeds_of(self, setting: str) -> tuple[int, ...]:
        return self.a.seeds

    def train_cmd(self, setting_args: list[str], seed: int, run: Path, time_limit: float = 0.0) -> list[str]:
        from core.train_config import TrainConfig  # lazy: imports torch (seconds), only when a run is built
        from models.families import family_of  # these import torch: only when a run is built

        a, strategy = self.a, "eagle3"
        if "--strategy" in setting_args:
            i = setting_args.index("--strategy")
            strategy, setting_args = setting_args[i + 1], setting_args[:i] + setting_args[i + 2 :]
        vocab = {"draft_vocab_size": a.draft_vocab_size} if "draft_vocab_size" in family_of(strategy).options else {}
        # a run stopped with a checkpoint (--time-limit) continues from it; any other unfinished run starts again
        again = (run / "ckpt" / "latest").exists() and not train_finished(run)
        cfg = TrainConfig(
            strategy=strategy,
            target=a.target,
            data=a.data,
            num_records=a.num_records,
            max_len=a.max_len,
            batch_size=a.batch_size,
            batch_tokens=a.batch_tokens,
            steps=a.steps,
            lr=a.lr,
            holdout=a.holdout,
            **vocab,
            ttt_length=a.ttt_length,
            seed=seed,
            device=a.device,
            out=str(run),
            progress=False,
            time_limit=time_limit,
            resume=again,
            overwrite=not again,
        )
        cmd = [sys.executable, "train.py", *to_flags(cfg), *shlex.split(a.train_args), *setting_args]
        return cmd  # later flags win (tyro), so a setting's --ttt-length / --data override the defaults

    def eval_cmd(self, run: Path, num_prompts: int = 0, batch: int = 0, name: str = "eval") -> list[str]:
        """evaluate.py on a run (num_prompts / batch: 0 = the study's); its result line goes to run/<name>.jsonl."""
        a = self.a
        return [
            sys.executable,
            "evaluate.py",
            str(run),
            "--target",
            a.target,
            "--num-prompts",
            str(num_prompts or a.num_prompts),
            "--max-new-tokens",
            str(a.max_new_tokens),
            "-k",
            *map(str, self.ks),
            "--threads",
            str(self.eval_threads),
            "--device",
            a.eval_device,
            "--batch",
            str(batch or a.eval_batch),
            "--resume-file",
            str(run / f"{name}_partial.json"),  # a cut-off evaluation keeps its finished benchmarks
            "--out",
            str(run / f"{name}.jsonl"),
        ]

    def eval_results(self, run: Path, name: str = "eval") -> dict:
        """{benchmark: {proposer: summary}} of a run's finished evaluation (eval_cmd's `name`)."""
        return _last_json(run / f"{name}.jsonl")["results"]

    def run(self) -> int:
        """An event loop over the runs (the scheduling in the module docstring). Returns 1 if a run failed."""
        a, t_start = self.a, time.time()
        done = done_keys(self.csv)
        runs = [(s, args, seed) for seed in a.seeds for s, args in self.settings if seed in self.seeds_of(s)]
        todo = [(s, args, seed) for s, args, seed in runs if (s, seed, self.scale) not in done]
        print(f"[{self.study}] {len(todo)} runs to do, {len(runs) - len(todo)} already in {self.csv}", flush=True)
        if a.dry_run:
            for s, args, seed in todo:
                run = Path(a.runs_dir) / self.study / f"{s}-s{seed}"
                print(" ".join(self.train_cmd(args, seed, run)) + "\n  " + " ".join(self.eval_cmd(run)))
            return 0
        overlap = a.overlap_eval and a.parallel == 1 and a.eval_device == "cpu" and self._gpu_training()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (2 * a.parallel)))
            ),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        }  # less fragmentation among many
        training, trained, evaluating, durations, failed = [], [], [], [], 0
        while todo or training or trained or evaluating:
            elapsed = time.time() - t_start
            mean = sum(durations) / len(durations) if durations else 0.0
            if todo and a.budget_minutes and elapsed + mean > 60 * a.budget_minutes:
                print(
                    f"[{self.study}] budget: {elapsed / 60:.1f} min spent, a run takes ~{mean / 60:.1f}: "
                    f"not starting {len(todo)} runs ({', '.join(f'{s} seed {seed}' for s, _, seed in todo)})",
                    flush=True,
                )
                todo = []
            left = a.time_limit - elapsed if a.time_limit else 0.0
            if todo and a.time_limit and left < 60:
                print(f"[{self.study}] time limit: not starting {len(todo)} runs (the next call does)", flush=True)
                todo = []
            while todo and len(training) < a.parallel and (overlap or not evaluating):
                s, args, seed = todo.pop(0)
                run = Path(a.runs_dir) / self.study / f"{s}-s{seed}"
                cmd = self.train_cmd(args, seed, run, time_limit=round(left))
                job = {"setting": s, "seed": seed, "run": run, "cmd": cmd, "t0": time.time(), "proc": None}
                if not train_finished(run):
                    run.mkdir(parents=True, exist_ok=True)
                    print(f"[{self.study}] train {s} seed {seed}: {run}", flush=True)
                    job["log"] = open(run / "train.log", "w")
                    job["proc"] = subprocess.Popen(cmd, cwd=ROOT, stdout=job["log"], stderr=subprocess.STDOUT, env=env)
                training.append(job)
            for job in [j for j in training if j["proc"] is None or j["proc"].poll() is not None]:
                training.remove(job)
                if job["proc"] is not None:
                    job["log"].close()
                    if job["proc"].returncode == 75:  # --time-limit: a checkpoint; the next call resumes it
                        print(
                            f"[{self.study}] train {job['setting']} seed {job['seed']}: stopped by the time limit, "
                            "resumes when the sweep runs again",
                            flush=True,
                        )
                        continue
                    if job["proc"].returncode != 0:
                        print(
                            f"[{self.study}] train {job['setting']} seed {job['seed']} "
                            f"FAILED (exit {job['proc'].returncode}):\n"
                            f"{_tail(job['run'] / 'train.log')}",
                            flush=True,
                        )
                        failed += 1
                        continue
                    durations.append(time.time() - job["t0"])
                    # how many shared the GPU (written once train.py is done: it refuses an --out of other files)
                    (job["run"] / "sweep.json").write_text(json.dumps({"parallel": a.parallel}))
                trained.append(job)
            # evaluations wait until no training runs (unless --overlap-eval of one GPU training with CPU
            # evaluation): seen on the H200, batch-1 decoding beside 12 trainings finished no evaluation in 7
            # minutes, and 16 GPU evaluations at once none in 4.5 (time-slicing among processes); alone, one
            # took 126 s. At most --eval-parallel at once.
            while trained and (overlap or not training) and len(evaluating) < self.eval_parallel:
                job = trained.pop(0)
                job["eval"] = self.start_eval(job["run"])
                evaluating.append(job)
            for job in [j for j in evaluating if j["eval"][0].poll() is not None]:
                evaluating.remove(job)
                failed += self.finish(job["setting"], job["seed"], job["run"], job["cmd"], job["eval"])
            time.sleep(0.5)
        print(
            f"[{self.study}] done in {(time.time() - t_start) / 60:.1f} min; {failed} failed; rows in {self.csv}",
            flush=True,
        )
        return 1 if failed else 0

    def _gpu_training(self) -> bool:
        if self.a.device != "auto" and not self.a.device.startswith("cuda"):
            return False
        import torch  # lazy: the studies' --help and resume check start without torch

        return torch.cuda.is_available()

    def start_eval(self, run: Path):
        log = open(run / "eval.log", "w")
        print(f"[{self.study}] evaluate {run}", flush=True)
        return subprocess.Popen(self.eval_cmd(run), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log, time.time()

    def finish(self, setting: str, seed: int, run: Path, train_cmd: list[str], ev) -> int:
        """Wait for a run's evaluation and append its row; returns 1 on failure."""
        proc, log, t0 = ev
        rc = proc.wait()
        log.close()
        if rc != 0:
            print(
                f"[{self.study}] evaluate {setting} seed {seed} FAILED (exit {rc}):\n{_tail(run / 'eval.log')}",
                flush=True,
            )
            return 1
        results = self.eval_results(run)
        meta = json.loads((run / "run.json").read_text())
        mem = meta.get("peak_memory", {})
        kind = "cuda_max_allocated" if "cuda_max_allocated_bytes" in mem else "max_rss"
        from models.families import family_of  # lazy: imports torch, as in train_cmd
        from models.layers import param_count  # lazy: imports torch, as in train_cmd

        f = family_of(meta["config"]["strategy"])
        row = {
            "study": self.study,
            "setting": setting,
            "seed": seed,
            **self.metrics(results),
            "acc_0_heldout": round(meta["results"]["eval_end"].get("acc_0", float("nan")), 4),
            "train_seconds": round(meta["results"]["train_seconds"], 1),
            "parallel": json.loads((run / "sweep.json").read_text())["parallel"]
            if (run / "sweep.json").exists()
            else "",
            "eval_seconds": round(time.time() - t0, 1),
            "peak_memory_gib": round(mem.get(f"{kind}_bytes", 0) / 2**30, 3),
            "peak_memory_kind": kind,
            "draft_params_m": round(param_count(f.draft_cls(f.config_cls(**meta["draft"]))) / 1e6, 3),
            "scale": self.scale,
            "config": json.dumps(meta["config"], sort_keys=True, default=str),
            "git_commit": meta["git_commit"],
            "hardware": json.dumps(meta["hardware"]),
            "versions": json.dumps(meta["versions"]),
            "date": meta["date"],
            "train_cmd": " ".join(train_cmd),
            "eval_cmd": " ".join(self.eval_cmd(run)),
            "run_dir": str(run),
        }
        append_row(self.csv, row, self.columns)
        taus = {c.removeprefix("tau_"): v for c, v in row.items() if c.startswith("tau_") and c != "tau_mean"}
        print(
            f"[{self.study}] {setting} seed {seed}: tau {json.dumps(taus)}, "
            f"train {row['train_seconds']:.0f}s, peak {row['peak_memory_gib']:.2f} GiB",
            flush=True,
        )
        return 0

    def metrics(self, results: dict) -> dict:
        """evaluate.py's results {benchmark: {proposer: summary}} -> this study's measured CSV fields:
        τ of the chain of --eval-k per benchmark and their mean."""
        k = f"eagle3-chain{self.a.eval_k}"
        taus = {b: results[b][k]["tau"] for b in BENCHMARKS if b in results}
        return {
            **{f"tau_{b}": round(t, 4) for b, t in taus.items()},
            "tau_mean": round(sum(taus.values()) / len(taus), 4),
            "eval_k": self.a.eval_k,
        }


def main(study: str, settings: list[tuple[str, list[str]]], args: SweepArgs, prepare=None, sweep=Sweep) -> int:
    """prepare(args) -> args: a study's one-time setup (e.g. data files) before the runs; sweep: Sweep or a
    subclass of it."""
    if args.smoke:
        args = smoke_args(args, study)
    if prepare is not None:
        args = prepare(args)
    return sweep(study, settings, args).run()
