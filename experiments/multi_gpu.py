"""Two GPUs for real (issue 21): NCCL correctness, data-parallel scaling, tensor parallelism and the
producer/consumer split, each as train.py runs on random-weight targets, timed back to back.

    python experiments/multi_gpu.py stage                       # on the CPU machine: .stage/tok (carry it)
    bash .device/run_on_device.sh python3 experiments/multi_gpu.py tests parity dp --out $OUT
    bash .device/run_on_device.sh python3 experiments/multi_gpu.py disagg tp --out $OUT
    python experiments/multi_gpu.py all --cpu-smoke --out /tmp/mg   # tiny models, 2 gloo ranks: checks the script

Phases (any subset, run in this order; `all` = every one):
  tests   pytest -m cuda tests/test_tensor_parallel.py under NCCL (TP=2 hidden states vs one rank, bf16)
  parity  train.py --compile in bf16 on 2 GPUs vs 1 GPU, same global batch: loss curves within bf16 tolerance
          (the tests and both parity runs share the GPUs at the same time: none of them is timed)
  dp      Llama-3.1-8B shape, seq 4096, TTT 7, compiled target + compiled draft step: 2 GPUs (FSDP2) then 1 GPU;
          it starts beside tests/parity once its target is written: its first steps compile for minutes, its
          timed steps come after those are done (`concurrent_with` in a row names any work that overlapped them)
  disagg  8B shape: 1 producer GPU (HF target) + 1 consumer GPU (compiled draft step) vs colocated DP on both
  tp      Qwen3-30B-A3B shape (--qwen-layers of its 48 layers): --tp 2 vs data parallel over the same 2 GPUs
          (after disagg, so that its target is written while disagg runs)
The random targets are written by tools/random_target.py in a background process from the start (so the
8B one is on disk when `dp` begins), into /tmp/multi_gpu/targets, and reused while the machine stays up.

Timing: --steps optimizer steps (log every step, so each row of metrics.jsonl is written after the GPU
finished that step), the first --warmup ones (compilation) dropped. Per run: step_s (median step time),
tokens_per_s (real, unpadded tokens over the timed steps, train.py's own count summed over ranks),
row_tokens_per_s (the rows the GPUs compute, padding included),
peak_gib (rank 0's torch.cuda.max_memory_allocated, from run.json) and per GPU the largest memory.used
and the mean utilization.gpu that nvidia-smi saw (sampled every second). Every phase has a timeout and
writes its rows to --out/multi_gpu_h200x2.jsonl as soon as a run ends; a killed run still gives a
row from the steps it logged. The run logs, run.json and metrics.jsonl files go to --out/PHASE/.
"""

import dataclasses
import datetime
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, MaxLenOption  # noqa: E402
from core.config import to_flags  # noqa: E402
from core.runlog import git_commit, hardware  # noqa: E402
from core.train_config import TrainConfig  # noqa: E402
from models.fast_target import PRESETS  # noqa: E402
from models.target import resolve_target  # noqa: E402

PHASES = ("tests", "parity", "dp", "disagg", "tp")
WORK = Path(os.environ.get("MULTI_GPU_WORK", "/tmp/multi_gpu"))  # targets, train.py runs, pipeline store
TOK = ROOT / ".stage" / "tok"  # SmolLM2's tokenizer and chat template (the random targets' tokenizer)
ROWS = "multi_gpu_h200x2.jsonl"
# seconds per phase on the GPU (tests and parity share one window); a phase also stops at --budget-s
TIMEOUT = {"tests": 240, "parity": 300, "dp": 530, "tp": 420, "disagg": 330}
BF16_RTOL = 2e-2  # parity: bf16 keeps 8 mantissa bits (eps 7.8e-3); one rank also keeps bf16 master weights


def tiny(preset: dict, hidden: int, heads: int, **kw) -> dict:
    """A small model of a preset's family; vocab 49,152 so SmolLM2's tokenizer fits."""
    return {
        **preset,
        "vocab_size": 49152,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads,
        **kw,
    }


def target_configs(args) -> dict:
    """name -> (HF config of the random target, what the rows call it)."""
    llama, qwen = PRESETS["llama-3.1-8b"], PRESETS["qwen3-30b-a3b"]
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if args.cpu_smoke:
        return {
            "parity": (tiny(llama, 64, 4), "tiny-llama"),
            "llama8b": (tiny(llama, 64, 4), "tiny-llama"),
            "qwen30b": (tiny(qwen, 64, 4, **moe), "tiny-qwen3-moe"),
        }
    layers = args.qwen_layers or qwen["num_hidden_layers"]
    return {
        "parity": (tiny(llama, 256, 4), "tiny-llama (h256, 4 layers)"),
        "llama8b": (dict(llama), "llama-3.1-8b (random)"),
        "qwen30b": ({**qwen, "num_hidden_layers": layers}, f"qwen3-30b-a3b (random, {layers} of 48 layers)"),
    }


NEEDS = {"parity": ["parity"], "dp": ["llama8b"], "tp": ["qwen30b"], "disagg": ["llama8b"]}


# ------------------------------------------------------------------------------------ processes
class Runner:
    """Launches commands with a deadline, each in its own process group (a timeout kills the whole
    torchrun tree), logs them under --out, and appends result rows."""

    def __init__(self, args, env: dict):
        self.args, self.env, self.lock = args, env, threading.Lock()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.time() + args.budget_s
        self.gpu = GpuMonitor() if not args.cpu_smoke else None
        self.rows, self.env_row, self.configs, self.writer = [], {}, {}, None
        self.live = set()  # processes running now (stopped at the end: none outlives the command)
        self.activity = {}  # phase -> [start, end or None while it runs]

    def left(self) -> float:
        return self.deadline - time.time()

    def launch(self, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Start cmd in its own process group, its output in `log` after the command line."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            return subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )

    def run(self, cmd: list[str], log: Path, deadline: float, env: dict | None = None) -> tuple[int | None, float]:
        """(exit status or None if killed at the deadline, wall seconds)."""
        t0 = time.time()
        p = self.launch(cmd, log, env)
        self.live.add(p)
        try:
            rc = p.wait(timeout=max(1.0, min(deadline, self.deadline) - time.time()))
        except subprocess.TimeoutExpired:
            stop(p)
            rc = None
            with open(log, "a") as f:
                f.write(f"\n[multi_gpu] killed at the deadline after {time.time() - t0:.0f} s\n")
        self.live.discard(p)
        return rc, time.time() - t0

    def overlaps(self, phase: str, t0: float, t1: float) -> list[str]:
        """Other phases, and target writes, that ran during [t0, t1]."""
        now = time.time()
        other = [p for p, (a, b) in self.activity.items() if p != phase and a < t1 and (b or now) > t0]
        return other + [f"writing {n}" for n in (self.writer.overlaps(t0, t1) if self.writer else [])]

    def write(self, row: dict) -> dict:
        row = {
            **row,
            **self.env_row,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with self.lock:
            self.rows.append(row)
            with open(self.out / ROWS, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print("[row] " + short(row), flush=True)
        return row


def stop(p: subprocess.Popen):
    """SIGTERM to the process group, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class GpuMonitor(threading.Thread):
    """nvidia-smi every second: (time, [(utilization %, memory used MiB) per GPU])."""

    def __init__(self):
        super().__init__(daemon=True, name="nvidia-smi")
        self.samples, self.halt = [], threading.Event()
        self.ok = shutil.which("nvidia-smi") is not None
        if self.ok:
            self.start()

    def run(self):
        while not self.halt.wait(1.0):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                self.samples.append(
                    (time.time(), [tuple(float(x) for x in line.split(",")) for line in out.strip().splitlines()])
                )
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass

    def window(self, t0: float, t1: float) -> dict:
        s = [g for t, g in self.samples if t0 <= t <= t1]
        if not s:
            return {}
        n = min(len(g) for g in s)
        return {
            "gpu_util_mean": [round(statistics.mean(g[i][0] for g in s), 1) for i in range(n)],
            "gpu_mem_max_gib": [round(max(g[i][1] for g in s) / 1024, 2) for i in range(n)],
            "smi_samples": len(s),
        }


# ------------------------------------------------------------------------------------ targets
class TargetWriter(threading.Thread):
    """Writes the random targets the phases need, one after another, in a child process each
    (tools/random_target.py on GPU 0: its memory is freed when the process ends)."""

    def __init__(self, runner: Runner, names: list[str], configs: dict):
        super().__init__(daemon=True, name="targets")
        self.runner, self.names, self.configs = runner, names, configs
        self.done = {n: threading.Event() for n in names}
        self.info = {}  # name -> {"path", "write_s", "gib"} or {"error"}
        self.busy = {}  # name -> [start, end or None while writing]
        self.start()

    def run(self):
        for name in self.names:
            cfg, _ = self.configs[name]
            path = WORK / "targets" / name
            spec = WORK / "targets" / f"{name}.config.json"
            t0 = time.time()
            if (
                (path / "model.safetensors.index.json").exists()
                and spec.exists()
                and json.loads(spec.read_text()) == cfg
            ):  # written earlier here
                self.info[name] = {"path": path, "write_s": 0.0, "reused": True}
                self.done[name].set()
                continue
            self.busy[name] = [t0, None]
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.unlink(missing_ok=True)
            tmp = spec.with_suffix(".new")
            tmp.write_text(json.dumps(cfg))
            device = "cpu" if self.runner.args.cpu_smoke else "cuda"
            cmd = [
                sys.executable,
                "tools/random_target.py",
                str(tmp),
                str(path),
                "--device",
                device,
                "--tokenizer",
                str(self.runner.args.tokenizer),
            ]
            rc, wall = self.runner.run(
                cmd, self.runner.out / "targets" / f"{name}.log", time.time() + 600, {"CUDA_VISIBLE_DEVICES": "0"}
            )
            if rc == 0:
                tmp.rename(spec)
                gib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
                self.info[name] = {"path": path, "write_s": round(wall, 1), "gib": round(gib, 2)}
            else:
                self.info[name] = {"error": f"tools/random_target.py exited with {rc} (see targets/{name}.log)"}
            self.busy[name][1] = time.time()
            self.done[name].set()

    def get(self, name: str, deadline: float) -> dict:
        if not self.done[name].wait(timeout=max(0.0, deadline - time.time())):
            return {"error": f"target {name} not written before the phase's deadline"}
        return self.info[name]

    def overlaps(self, t0: float, t1: float) -> list[str]:
        """Targets being written during [t0, t1] (a GPU and host disk busy beside a timed run)."""
        return [n for n, (a, b) in self.busy.items() if a < t1 and (b or time.time()) > t0]


# ------------------------------------------------------------------------------------ train.py runs
def train_cmd(nproc: int, flags: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "train.py",
        *flags,
    ]


def train_flags(
    args,
    target: Path,
    out: Path,
    batch: int,
    *,
    seq: int,
    ttt: int,
    steps: int,
    lr: float = 1e-4,
    draft_vocab: int = 32000,
) -> list[str]:
    """The options every timed run shares: compiled target backend, (on GPU) the compiled draft step,
    the packaged chats (enough records for `steps` global batches), no held-out evaluation (--holdout 0:
    the eager evaluation's own compiles and forwards would only cost wall time)."""
    cfg = TrainConfig(
        target=str(target),
        backend="compiled",
        data=args.data,
        num_records=max(200, 2 * steps * batch),
        holdout=0,
        max_len=seq,
        ttt_length=ttt,
        batch_size=batch,
        batch_tokens=0,  # `batch` conversations a rank, as the rows say (the GPU default: a budget from memory)
        steps=steps,
        warmup=2,
        lr=lr,
        draft_vocab_size=draft_vocab,
        log_every=1,
        progress=False,
        out=str(out),
        overwrite=True,
        compile=args.compile,
        pad_to_max_len=not args.compile,  # the same row shapes as --compile
    )
    return to_flags(cfg) + args.train_args.split()


def read_run(out: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    meta = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    return rows, meta


def throughput(rows: list[dict], batch: int, seq: int, warmup: int) -> dict:
    """Timing of one train.py run from its metrics.jsonl. With --log-every 1 each train row carries
    its own step's global real_tokens_per_s, row_tokens_per_s and step_seconds (runlog.Throughput:
    summed over ranks, evaluation and checkpoints excluded; its first warm-up steps carry none).
    Steps 1..warmup are dropped; the rest are pooled: tokens over seconds."""
    train = [r for r in rows if r.get("split") == "train"]
    losses = {"steps_logged": len(train), "losses": [round(r["loss"], 5) for r in train]}
    timed = [r for r in train if r["step"] > warmup and "real_tokens_per_s" in r]
    if len(timed) < 2:
        return losses
    secs = [r["step_seconds"] for r in timed]
    real = sum(r["real_tokens_per_s"] * t for r, t in zip(timed, secs)) / sum(secs)
    row = sum(r["row_tokens_per_s"] * t for r, t in zip(timed, secs)) / sum(secs)
    start = [r["time"] for r in rows if r.get("split") == "eval" and r.get("step") == 0]
    first = {"first_step_s": round(train[0]["time"] - start[0], 1)} if start else {}
    return {
        "tokens_per_s": round(real, 1),
        "row_tokens_per_s": round(row, 1),
        "step_s": round(statistics.median(secs), 4),
        "step_s_min": round(min(secs), 4),
        "step_s_max": round(max(secs), 4),
        **first,
        "timed_steps": len(timed),
        "window": (timed[0]["time"] - secs[0], timed[-1]["time"]),
        **losses,
    }


def parse(rows, batch, seq, warmup) -> dict:
    """throughput(), or what went wrong (e.g. metrics.jsonl rows without the fields it reads)."""
    try:
        return throughput(rows, batch, seq, warmup)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return {"parse_error": repr(e)}


def timed_run(
    runner: Runner,
    phase: str,
    tag: str,
    nproc: int,
    flags: list[str],
    deadline: float,
    *,
    batch: int,
    seq: int,
    env: dict | None = None,
    extra: dict | None = None,
    cmd: list[str] | None = None,
) -> dict:
    """One train.py run (torchrun over nproc ranks, or `cmd`): launch, parse, copy its small files to
    --out/PHASE/TAG, write its row."""
    out = Path(flags[flags.index("--out") + 1])
    shutil.rmtree(
        out, ignore_errors=True
    )  # an earlier run's metrics must not pass for this one's (a killed run writes none)
    cmd = cmd or train_cmd(nproc, flags)
    t0 = time.time()
    rc, wall = runner.run(cmd, runner.out / phase / f"{tag}.log", deadline, env)
    rows, meta = read_run(out)
    keep = runner.out / phase / tag
    keep.mkdir(parents=True, exist_ok=True)
    for f in ("metrics.jsonl", "run.json"):
        if (out / f).exists():
            shutil.copy(out / f, keep / f)
    res = parse(rows, batch, seq, runner.args.warmup)
    window = res.pop("window", None)
    peak = meta.get("peak_memory", {}).get("cuda_max_allocated_bytes")
    row = {
        "what": phase,
        "run": tag,
        "gpus": nproc,
        "seq": seq,
        "batch": batch,
        "rc": rc,
        "wall_s": round(wall, 1),
        "timed_out": rc is None,
        **res,
        "peak_gib": round(peak / 2**30, 2) if peak else None,
        "command": " ".join(["python", *cmd[1:]]),
        **(extra or {}),
    }
    if env:
        row["command"] = " ".join(f"{k}={v}" for k, v in env.items()) + " " + row["command"]
    if runner.gpu is not None:
        row.update(runner.gpu.window(*(window or (t0, time.time()))))
        row["gpu_mem_max_gib_run"] = runner.gpu.window(t0, time.time()).get("gpu_mem_max_gib")
    if window and (busy := runner.overlaps(phase, *window)):
        row["concurrent_with"] = busy  # other work on the machine during the timed steps
    if rc not in (0, None):
        row["error"] = tail(runner.out / phase / f"{tag}.log")
    return runner.write(row)


def tail(log: Path, n: int = 6) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    return " | ".join(lines[-n:])[-1200:]


# ------------------------------------------------------------------------------------ phases
def phase_tests(runner: Runner, deadline: float):
    log = runner.out / "tests" / "pytest.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "tests/test_tensor_parallel.py",
        "-p",
        "no:cacheprovider",
        "-rs",
    ]
    rc, wall = runner.run(cmd, log, deadline)
    summary = next(
        (
            l
            for l in reversed(log.read_text().splitlines())
            if " in " in l and ("passed" in l or "failed" in l or "skipped" in l or "error" in l)
        ),
        "",
    )
    runner.write(
        {
            "what": "tests",
            "gpus": 2,
            "model": "tiny llama / qwen3 / qwen3-moe (test_tensor_parallel)",
            "rc": rc,
            "timed_out": rc is None,
            "summary": summary.strip("= "),
            "wall_s": round(wall, 1),
            "command": "pytest " + " ".join(cmd[3:]),
            "passed": rc == 0 and "skipped" not in summary,
        }
    )


def phase_parity(runner: Runner, deadline: float):
    """Same global batch on 2 ranks (FSDP2: fp32 master weights, bf16 compute) and on 1 rank (bf16 weights,
    fused AdamW): the loss curves agree within bf16 tolerance (fp32 on the CPU smoke: 1e-4)."""
    args = runner.args
    t = runner.writer.get("parity", deadline)
    if "error" in t:
        return runner.write({"what": "parity", "error": t["error"]})
    name = runner.configs["parity"][1]
    seq, batch, steps = (128, 4, 8) if args.cpu_smoke else (512, 8, 8)
    res = {}

    def run(n):  # both at once (1 rank on GPU 1, beside the 2 ranks): correctness only, nothing here is timed
        flags = train_flags(
            args, t["path"], WORK / "runs" / f"parity{n}", batch, seq=seq, ttt=3, steps=steps, lr=1e-3, draft_vocab=8192
        )
        res[n] = timed_run(
            runner,
            "parity",
            f"{n}gpu",
            n,
            flags,
            deadline,
            batch=batch,
            seq=seq,
            env={"CUDA_VISIBLE_DEVICES": "1"} if n == 1 else None,
            extra={"model": name, "ttt": 3, "concurrent": True},
        )

    threads = [threading.Thread(target=run, args=(n,)) for n in (2, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    a, b = res[2].get("losses"), res[1].get("losses")
    rtol = 1e-4 if args.cpu_smoke else BF16_RTOL
    if not (a and b and len(a) == len(b)):
        return runner.write(
            {"what": "parity_2v1", "model": name, "error": "a run did not log all its steps", "passed": False}
        )
    runner.write(
        {
            "what": "parity_2v1",
            "gpus": 2,
            "model": name,
            "dtype": "fp32" if args.cpu_smoke else "bf16",
            "global_batch": batch,
            "steps": len(a),
            "loss_2gpu": a,
            "loss_1gpu": b,
            **loss_parity(a, b, rtol),
            "compile": args.compile,
        }
    )


def loss_parity(two: list[float], one: list[float], rtol: float) -> dict:
    """Per-step relative loss difference of the 2-rank run against the 1-rank one; passes when every
    step is within rtol and the loss moved (a run that trains nothing would match vacuously)."""
    rel = [abs(x - y) / max(abs(y), 1e-8) for x, y in zip(two, one)]
    return {
        "max_rel_diff": max(rel, default=float("inf")),
        "first_step_rel_diff": rel[0] if rel else None,
        "rtol": rtol,
        "passed": len(two) == len(one) > 1 and max(rel) <= rtol and one[-1] != one[0],
    }


def dims(args) -> dict:
    if args.cpu_smoke:
        return {"seq": 128, "ttt": 3, "draft_vocab": 8192}
    return {"seq": args.max_len, "ttt": args.ttt_length, "draft_vocab": 32000}


def timed_flags(args, target: Path, out: Path, batch: int) -> list[str]:
    """train_flags of a timed phase: the dims() shapes, --steps steps."""
    d = dims(args)
    return train_flags(
        args, target, out, batch, seq=d["seq"], ttt=d["ttt"], steps=args.steps, draft_vocab=d["draft_vocab"]
    )


def phase_dp(runner: Runner, deadline: float) -> dict:
    """2 GPUs (FSDP2 draft, the target replicated) at --batch-per-gpu per GPU, then 1 GPU at --batch-per-gpu."""
    args, d = runner.args, dims(runner.args)
    t = runner.writer.get("llama8b", deadline)
    if "error" in t:
        return {"error": runner.write({"what": "dp", "error": t["error"]})}
    model = runner.configs["llama8b"][1]
    res = {}
    for n in (2, 1):
        B = args.batch_per_gpu * n
        flags = timed_flags(args, t["path"], WORK / "runs" / f"dp{n}", B)
        res[n] = timed_run(
            runner,
            "dp",
            f"{n}gpu",
            n,
            flags,
            deadline,
            batch=B,
            seq=d["seq"],
            env={"CUDA_VISIBLE_DEVICES": "0"} if n == 1 else None,
            extra={
                "model": model,
                "ttt": d["ttt"],
                "batch_per_gpu": args.batch_per_gpu,
                "target_write_s": t.get("write_s"),
            },
        )
    if res[1].get("tokens_per_s") and res[2].get("tokens_per_s"):
        runner.write(
            {
                "what": "dp_scaling",
                "gpus": 2,
                "model": model,
                "seq": d["seq"],
                "ttt": d["ttt"],
                "batch_per_gpu": args.batch_per_gpu,
                "speedup_real_tokens": round(res[2]["tokens_per_s"] / res[1]["tokens_per_s"], 3),
                "speedup_rows": round(res[2]["row_tokens_per_s"] / res[1]["row_tokens_per_s"], 3),
                "goal": 1.9,
                "tokens_per_s": res[2]["tokens_per_s"],
                "tokens_per_s_1gpu": res[1]["tokens_per_s"],
                "peak_gib": res[2]["peak_gib"],
                "peak_gib_1gpu": res[1]["peak_gib"],
            }
        )
    return res


def phase_tp(runner: Runner, deadline: float):
    """Two GPUs two ways, each GPU training the draft on --batch-per-gpu sequences per step: --tp 2 (one TP group
    runs the target on one global batch of --batch-per-gpu, half the weights per GPU; both ranks train the draft
    on the same batch, FSDP2) and data parallel (a full target copy per GPU, global batch 2 x --batch-per-gpu).
    The per-GPU draft shapes are the same, so the second run reuses the first's compiled draft step."""
    args, d = runner.args, dims(runner.args)
    t = runner.writer.get("qwen30b", deadline)
    if "error" in t:
        return runner.write({"what": "tp", "error": t["error"]})
    model = runner.configs["qwen30b"][1]
    res = {}
    for tag, tp, B in (("tp2", ["--tp", "2"], args.batch_per_gpu), ("dp2", [], 2 * args.batch_per_gpu)):
        flags = timed_flags(args, t["path"], WORK / "runs" / f"qwen_{tag}", B) + tp
        res[tag] = timed_run(
            runner,
            "tp",
            tag,
            2,
            flags,
            deadline,
            batch=B,
            seq=d["seq"],
            extra={
                "model": model,
                "ttt": d["ttt"],
                "tp": 2 if tp else 1,
                "target_write_s": t.get("write_s"),
                "target_gib": t.get("gib"),
            },
        )
    a, b = res["tp2"], res["dp2"]
    if a.get("tokens_per_s") and b.get("tokens_per_s"):
        runner.write(
            {
                "what": "tp_vs_dp",
                "gpus": 2,
                "model": model,
                "global_batch_tp": args.batch_per_gpu,
                "global_batch_dp": 2 * args.batch_per_gpu,
                "tokens_per_s": a["tokens_per_s"],
                "tokens_per_s_dp": b["tokens_per_s"],
                "tp_over_dp": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
                "peak_gib": a["peak_gib"],
                "peak_gib_dp": b["peak_gib"],
            }
        )


def phase_disagg(runner: Runner, deadline: float, colocated: dict | None):
    """Producer (train.py --role producer: HF target, bf16) on GPU 0, consumer (--role consumer: the draft
    step, compiled) on GPU 1, meeting in a control database and a feature store under /tmp. The consumer
    trains --batch-per-gpu sequences per step, the draft shapes of the colocated 2-GPU DP run's ranks (its row
    is taken from the dp phase, or it is run here), whose compiled step it reuses."""
    args, d = runner.args, dims(runner.args)
    t = runner.writer.get("llama8b", deadline)
    if "error" in t:
        return runner.write({"what": "disagg", "error": t["error"]})
    model, B = runner.configs["llama8b"][1], args.batch_per_gpu
    root = WORK / "runs" / "disagg"
    shutil.rmtree(root, ignore_errors=True)
    control, store = root / "control", root / "features"
    flags = timed_flags(args, t["path"], root / "consumer", B)
    flags += ["--control", str(control), "--store", str(store)] + args.disagg_args.split()
    plog = runner.out / "disagg" / "producer.log"
    pcmd = [sys.executable, "train.py", *flags, "--role", "producer", "--worker-name", "p0"]
    producer = runner.launch(pcmd, plog, {"CUDA_VISIBLE_DEVICES": "0"})
    try:  # the consumer is one plain process (no torchrun): rank 0 of 1 on GPU 1
        crow = timed_run(
            runner,
            "disagg",
            "consumer",
            1,
            flags,
            deadline,
            batch=B,
            seq=d["seq"],
            env={"CUDA_VISIBLE_DEVICES": "1"},
            cmd=[sys.executable, "train.py", *flags, "--role", "consumer"],
            extra={"model": model, "ttt": d["ttt"]},
        )
    finally:
        try:
            producer.wait(timeout=30)  # it leaves once the run is done
        except subprocess.TimeoutExpired:
            stop(producer)
    clog = (runner.out / "disagg" / "consumer.log").read_text(errors="replace")
    pl = plog.read_text(errors="replace")
    pipeline = next((l for l in clog.splitlines() if l.startswith("[pipeline] done")), "")
    produced = next((l for l in pl.splitlines() if "] done:" in l and l.startswith("[producer")), "")
    u = crow.get("gpu_util_mean") or []
    # back-pressure and the producer's rate, from the lines the consumer and producer print at the end
    pm = re.search(r"max in flight (\d+), producers paused (\d+) times", pipeline)
    prm = re.search(r"done: (\d+) samples in (\d+) leases, ([\d.]+) s", produced)
    row = {
        "what": "disagg_1p1c",
        "gpus": 2,
        "model": model,
        "consumer_batch": B,
        "tokens_per_s": crow.get("tokens_per_s"),
        "peak_gib": crow.get("peak_gib"),
        "producer_util": u[0] if len(u) > 0 else None,
        "consumer_util": u[1] if len(u) > 1 else None,
        "watermarks": {"high": 4 * B, "low": 2 * B, "lease": B}
        if "--high-watermark" not in args.disagg_args
        else args.disagg_args,
        "max_in_flight": int(pm[1]) if pm else None,
        "producer_pauses": int(pm[2]) if pm else None,
        # samples over the producer's whole loop (paused time included; its target load not)
        "producer_samples_per_s": round(int(prm[1]) / float(prm[3]), 2) if prm else None,
        "consumer_samples_per_s": round(B / crow["step_s"], 2) if crow.get("step_s") else None,
        "pipeline": pipeline,
        "producer": produced,
        "producer_rc": producer.returncode,
        "command": f"CUDA_VISIBLE_DEVICES=0 python {' '.join(pcmd[1:])} & {crow['command']}",
    }
    if colocated is None or not colocated.get("tokens_per_s"):
        cflags = timed_flags(args, t["path"], WORK / "runs" / "colocated2", 2 * B)
        colocated = timed_run(
            runner,
            "disagg",
            "colocated2",
            2,
            cflags,
            deadline,
            batch=2 * B,
            seq=d["seq"],
            extra={"model": model, "ttt": d["ttt"]},
        )
    if colocated.get("tokens_per_s") and row["tokens_per_s"]:
        row.update(
            tokens_per_s_colocated=colocated["tokens_per_s"],
            disagg_over_colocated=round(row["tokens_per_s"] / colocated["tokens_per_s"], 3),
        )
    runner.write(row)


RUN = {"tests": phase_tests, "parity": phase_parity, "dp": phase_dp, "disagg": phase_disagg, "tp": phase_tp}


# ------------------------------------------------------------------------------------ driver
def environment(args) -> dict:
    hw = hardware("cpu")  # host; the GPUs from nvidia-smi (no CUDA context in this process: it would hold GPU 0 memory)
    v = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not args.cpu_smoke and shutil.which("nvidia-smi"):
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout
        gpus = [l.split(", ") for l in q.strip().splitlines()]
        hw.update(
            gpu=gpus[0][0] if gpus else None,
            gpu_count=len(gpus),
            gpu_memory=gpus[0][1] if gpus else None,
            driver=gpus[0][2] if gpus else None,
        )
        try:
            n = torch.cuda.nccl.version()
            v["nccl"] = ".".join(map(str, n)) if isinstance(n, tuple) else str(n)
        except (RuntimeError, AttributeError):
            pass
    for pkg in ("triton", "transformers", "safetensors"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    commit = git_commit()
    return {
        "hardware": hw,
        "versions": v,
        "git_commit": os.environ.get("NANOSPEC_COMMIT", commit) if commit == "unknown" else commit,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)},
        "cpu_smoke": args.cpu_smoke,
    }


def short(r: dict) -> str:
    keys = (
        "what",
        "run",
        "gpus",
        "model",
        "tokens_per_s",
        "row_tokens_per_s",
        "step_s",
        "peak_gib",
        "speedup_real_tokens",
        "speedup_rows",
        "tp_over_dp",
        "disagg_over_colocated",
        "producer_util",
        "consumer_util",
        "max_in_flight",
        "producer_pauses",
        "max_rel_diff",
        "passed",
        "fsdp8_8b_tokens_per_s",
        "tp4x2_qwen_tokens_per_s",
        "dp8_qwen_tokens_per_s",
        "split3p5c_8b_tokens_per_s",
        "summary",
        "rc",
        "error",
        "skipped",
    )
    return " ".join(f"{k}={r[k]}" for k in keys if r.get(k) is not None)[:600]


def stage_tokenizer(dest: Path):
    """On the CPU machine: SmolLM2's tokenizer files (no weights) into .stage/tok, which git ignores;
    carry it to the GPU machine (tools/random_target.py copies it into each random target)."""
    src = resolve_target("smollm2")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    print(f"wrote {dest} ({sum(f.stat().st_size for f in dest.iterdir()) / 2**20:.1f} MiB): carry '.stage/tok'")


@dataclasses.dataclass(kw_only=True)  # a required field (phases) and a re-declared one (max_len): core/cli_options.py
class Args(DataOption, MaxLenOption):
    phases: tyro.conf.Positional[tuple[Literal["tests", "parity", "dp", "disagg", "tp", "all", "stage"], ...]]
    """phases to run (in the order above whatever the order given), 'all', or 'stage' (CPU machine: write .stage/tok)"""
    out: Path | None = None
    """rows, logs and copies of each run's metrics (the device's $OUT); required but for stage"""
    budget_s: float = 0
    """stop everything after this many seconds (0 = 540: a device call of 570 s, less the launcher's wheel install
    and the kill; --cpu-smoke: 1800)"""
    steps: int = 12
    """optimizer steps per timed run"""
    warmup: int = 4
    """first steps dropped from the timing (compilation); train.py's LR warm-up is 2 steps"""
    batch_per_gpu: int = 4
    """sequences per GPU (8B: ~50 GiB per GPU at --max-len 4096, TTT 7); train.py --batch-size is this times the
    data-parallel ranks"""
    max_len: int = 4096  # the 8B shape's rows (dp, disagg)
    ttt_length: int = 7
    qwen_layers: int = 24
    """layers of the Qwen3-30B-A3B-shaped target (48 = all; per-layer shapes exact)"""
    compile: bool = True
    """train.py --compile in every run (never on --cpu-smoke, where compiling takes minutes per run)"""
    train_args: str = ""
    """extra train.py flags for every run, one string (shell-split), e.g. --train-args='--attention flex_buf'"""
    disagg_args: str = ""
    """extra flags of the producer and consumer, e.g. --disagg-args='--high-watermark 16 --low-watermark 8'"""
    tokenizer: Path = TOK
    """tokenizer dir for the random targets"""
    cpu_smoke: bool = False
    """tiny models, 2 gloo ranks on CPU, fp32: checks the script end to end"""


def main(argv=None):
    args = tyro.cli(Args, args=argv, description=__doc__)
    if args.phases == ("stage",):
        return stage_tokenizer(TOK)
    if not args.phases or "stage" in args.phases:
        raise SystemExit("name the phases to run, all, or stage alone")
    if args.out is None:
        raise SystemExit("--out is required")
    phases = [p for p in PHASES if p in args.phases or "all" in args.phases]
    args.compile = args.compile and not args.cpu_smoke
    args.budget_s = args.budget_s or (1800 if args.cpu_smoke else 540)
    if not args.tokenizer.is_dir() and not args.cpu_smoke:
        raise SystemExit(
            f"no tokenizer at {args.tokenizer}: run `python experiments/multi_gpu.py stage` on the CPU machine "
            "and carry '.stage/tok'"
        )
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1" if args.cpu_smoke else "8"}
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if args.cpu_smoke and not args.tokenizer.is_dir():
        args.tokenizer = "smollm2"  # the packaged model's (converted on first use)
    runner = Runner(args, env)
    runner.env_row = environment(args)
    runner.configs = target_configs(args)
    needed = list(dict.fromkeys(n for p in phases for n in NEEDS.get(p, [])))
    runner.writer = TargetWriter(runner, needed, runner.configs)
    t_start = time.time()
    scale = 3 if args.cpu_smoke else 1  # CPU: 2 shared cores
    print(f"[multi_gpu] phases {phases}, budget {args.budget_s:.0f} s, targets {needed}", flush=True)

    def deadline(p):
        return min(time.time() + scale * TIMEOUT[p], runner.deadline - 5)

    results = {}

    def guarded(p, *a):  # a phase that raises leaves a row saying so; the others still run
        runner.activity[p] = [time.time(), None]
        try:
            results[p] = RUN[p](runner, deadline(p), *a)
        except Exception as e:  # noqa: BLE001 (any failure of the runner itself, not of train.py)
            traceback.print_exc()
            runner.write({"what": p, "error": f"multi_gpu.py: {type(e).__name__}: {e}"[:1000]})
        finally:
            runner.activity[p][1] = time.time()

    # tests and parity (untimed) share the GPUs; dp starts beside them as soon as the 8B target is on
    # disk: its first steps compile for minutes, and its timed steps come after the two are done (a
    # row whose timed window overlapped other work says so in concurrent_with)
    first = [threading.Thread(target=guarded, args=(p,), name=p) for p in ("tests", "parity", "dp") if p in phases]
    for th in first:
        th.start()
    for th in first:
        th.join()
    for p in ("disagg", "tp"):  # disagg before tp: the 30B target is written meanwhile
        if p not in phases:
            continue
        if runner.left() < 60:
            runner.write({"what": p, "skipped": f"budget: {runner.left():.0f} s left"})
            continue
        guarded(p, *(((results.get("dp") or {}).get(2) or previous_colocated(runner, args),) if p == "disagg" else ()))
    earlier = ROOT / "experiments" / "results" / ROWS  # rows of an earlier call, if committed or copied there
    old = [json.loads(l) for l in open(earlier) if l.strip()] if earlier.exists() and not args.cpu_smoke else []
    if pred := predict_8gpu(old + runner.rows):
        runner.write(
            {"what": "predict_8gpu", "predicted": True, **pred, "method": predict_8gpu.__doc__.split("\n", 1)[1]}
        )
    print(f"\n[multi_gpu] done in {time.time() - t_start:.0f} s; rows in {runner.out / ROWS}:")
    for r in runner.rows:
        print("  " + short(r))
    for p in list(runner.live):  # a target still being written for a phase that did not run
        stop(p)
    if runner.gpu is not None:
        runner.gpu.halt.set()


def predict_8gpu(rows: list[dict]) -> dict:
    """Extrapolations to one 8-GPU host from the latest 2-GPU rows (predictions, not measurements):
    e = 2-GPU DP efficiency (speedup / 2), assumed to hold (optimistic) or to compound per doubling
    (e^3, pessimistic) up to 8 GPUs.
      FSDP2 over 8, 8B:          [8 t1 e^3, 8 t1 e], t1 = the 1-GPU tokens/s
      Qwen3-30B-A3B --tp 4 (x2): 2 TP groups; a group of 4 runs the target up to 2x faster than one
                                 of 2 but trains the same (duplicated) draft: [2, 4] x the TP2 group's rate
      3 producers + 5 consumers: min(3 x producer capacity, 5 x consumer rate x e); producer capacity =
                                 its delivered rate / its GPU utilisation (it idles while paused)"""
    last = {}
    for r in rows:
        if not r.get("predicted"):
            last[(r.get("what"), r.get("run"))] = r
    out = {}
    dp, tp, dis = last.get(("dp_scaling", None)), last.get(("tp_vs_dp", None)), last.get(("disagg_1p1c", None))
    e = min(dp["speedup_real_tokens"] / 2, 1.0) if dp else 1.0  # a 2-GPU speedup above 2 (noise) counts as 2
    if dp:
        t1 = dp["tokens_per_s_1gpu"]
        out["fsdp8_8b_tokens_per_s"] = [round(8 * t1 * e**3), round(8 * t1 * e)]
    if tp:
        out["tp4x2_qwen_tokens_per_s"] = [round(2 * tp["tokens_per_s"]), round(4 * tp["tokens_per_s"])]
        out["dp8_qwen_tokens_per_s"] = round(4 * tp["tokens_per_s_dp"] * e)
    if dis and dis.get("tokens_per_s") and dis.get("producer_util"):
        cap = dis["tokens_per_s"] / (dis["producer_util"] / 100)
        out["split3p5c_8b_tokens_per_s"] = round(min(3 * cap, 5 * dis["tokens_per_s"] * e))
    return out


def previous_colocated(runner: Runner, args) -> dict | None:
    """The 2-GPU dp row of an earlier call with these shapes (experiments/results/multi_gpu_h200x2.jsonl,
    which travels with the working tree), so disagg need not rerun it."""
    f = ROOT / "experiments" / "results" / ROWS
    if args.cpu_smoke or not f.exists():
        return None
    d = dims(args)
    for r in reversed([json.loads(l) for l in open(f) if l.strip()]):
        if (
            r.get("what") == "dp"
            and r.get("gpus") == 2
            and r.get("tokens_per_s")
            and r.get("seq") == d["seq"]
            and r.get("ttt") == d["ttt"]
            and r.get("batch") == 2 * args.batch_per_gpu
            and r.get("steps_logged") == args.steps
        ):
            return r
    return None


if __name__ == "__main__":
    main()
