"""What a user gets from train.py against what the harness measures, back to back on one GPU.

For a random-weight preset target (models/fast_target.py PRESETS) it runs, in this order and on the
same machine: `experiments/throughput.py` (the compiled backend at --harness-batch full rows of
--max-len, every token real) and then train.py on the packaged chats (--backend compiled --modes:
packed rows with the eager draft step, and/or one conversation per row with the compiled step). For a real target
directory (e.g. SmolLM2) only train.py runs. One JSON line per measurement is appended to --out with
model, path (harness | train.py), seq, batch, real_tokens_per_s, padded_tokens_per_s,
packing_efficiency, peak_gib, command, date, plus versions and the train.py/harness ratio.

train.py's throughput is the median over its log windows after --skip-windows (its own metrics.jsonl:
real tokens of the conversations, and row tokens padding included; warm-up and compile steps are
outside the windows, runlog.Throughput), so recompiles for a new packed row count stay out too.

    python experiments/train_throughput.py --target llama-3.1-8b --tokenizer /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
    python experiments/train_throughput.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --max-len 2048 \\
        --batch-size 128 --draft-vocab-size 8192
    python experiments/train_throughput.py --smoke      # CPU, tiny random target: checks the script

Each row is appended to --out as soon as it is measured. A comparison longer than one device call
(the 8B harness alone takes ~5 minutes with its compile) is split over calls on the same warm machine:
`--modes` (nothing) for the harness, then `--no-harness --modes pack`, then `--no-harness --modes compile`,
all with one --out under /tmp; train.py rows then take their ratio from the latest harness row there.
"""

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, MaxLenOption, NumRecordsOption, TargetOption  # noqa: E402
from core.config import to_flags  # noqa: E402
from core.runlog import git_commit, hardware, versions  # noqa: E402
from core.train_config import TrainConfig  # noqa: E402
from models.fast_target import PRESETS  # noqa: E402
from models.target import load_tokenizer, resolve_target  # noqa: E402
from models.tiny import tiny_llama  # noqa: E402


@dataclasses.dataclass
class Args(MaxLenOption, NumRecordsOption, DataOption, TargetOption):
    target: str = "llama-3.1-8b"  # a preset: the harness (throughput.py) runs on presets only
    """a preset of models/fast_target.py PRESETS (random weights, written to --work first) or a target dir/.gguf"""
    num_records: int = 4000  # more conversations than --steps x --batch-size take
    max_len: int = 4096  # the 8B recipe's rows (the harness's too)
    tokenizer: str = "smollm2"
    """presets: the tokenizer copied into the random target (tools/random_target.py)"""
    batch_size: int = 32
    """train.py: conversations per step (packed into rows of --max-len)"""
    harness_batch: int = 8
    """throughput.py: full rows per step"""
    ttt_length: int = 7
    draft_vocab_size: int = 32000
    mask_density: float = 0.754
    """throughput.py's loss-mask share (its default: the packaged chats' assistant share)"""
    steps: int = 40
    log_every: int = 5
    skip_windows: int = 2
    """train.py log windows left out of the median (a recompile for a new packed row count lands there)"""
    harness: bool = True
    modes: tuple[str, ...] = ("pack", "compile")
    """train.py runs, one row each: pack = --pack on (eager draft step), compile = --compile --pack off (one
    conversation per row, padded to --max-len), pack-compile = both,
    tokens / tokens-compile = pack / pack-compile with --batch-tokens --harness-batch x --max-len (the harness's
    row count, rows filled first-fit: one shape, no rows of padding)"""
    extra: tuple[str, ...] = ()
    """more train.py flags"""
    work: Path = Path("/tmp/train_throughput")
    out: Path = ROOT / "experiments/results/train_throughput_h200.jsonl"
    smoke: bool = False
    """CPU: a tiny random target, 6 steps, no harness, rows to /tmp"""


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """cmd as a subprocess in the repo root, its output to `log`; a failure exits with the log's tail.
    A `python -c SCRIPT` command is echoed without its script."""
    shown = cmd if cmd[1:2] != ["-c"] else [cmd[0], "-c", "SCRIPT", *cmd[3:]]
    print("+", " ".join(shown), flush=True)
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    print(f"  ({time.time() - t:.0f} s, log {log})", flush=True)
    if p.returncode:
        raise SystemExit(f"{shown[1]} failed ({p.returncode}); last lines of {log}:\n" + log.read_text()[-4000:])


def environment() -> dict:
    """What a row records about where it was measured (runlog's commit, versions and hardware)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "git_commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "hardware": hardware(device),
    }


def train_py_figures(out: Path, skip_windows: int) -> dict:
    """train.py's own throughput of the run in `out`: medians over its metrics.jsonl log windows after
    the first `skip_windows` (real tokens of the conversations, row tokens padding included), packing
    from run.json, peak CUDA memory."""
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "real_tokens_per_s" in r]
    kept = rows[skip_windows:] or rows
    meta = json.loads((out / "run.json").read_text())
    pk = meta["results"]["packing"]
    steps = meta["config"]["steps"]
    peak = meta.get("peak_memory", {}).get("cuda_max_allocated_bytes")
    bt = meta["config"].get("batch_tokens", 0)
    return {
        "batch": bt or meta["config"]["batch_size"],
        "batch_unit": "tokens per step (--batch-tokens), packed"
        if bt
        else "conversations per step" + (", packed" if pk["packed"] else ", one per row"),
        "rows_per_step": pk["row_tokens"] / pk["row_len"] / steps if steps else None,
        "tokens_per_step": statistics.median(r["real_tokens_per_s"] * r["step_seconds"] for r in kept),
        "real_tokens_per_s": statistics.median(r["real_tokens_per_s"] for r in kept),
        "padded_tokens_per_s": statistics.median(r["row_tokens_per_s"] for r in kept),
        "packing_efficiency": pk["efficiency"],
        "peak_gib": peak / 2**30 if peak else None,
        "step_s": statistics.median(r["step_seconds"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept) if all("mfu" in r for r in kept) else None,
        "windows": len(kept),
        "steps": steps,
    }


def harness_row(a: Args, log: Path) -> dict:
    rows = a.work / "harness.jsonl"
    rows.unlink(missing_ok=True)
    cmd = [sys.executable, "experiments/throughput.py", "--target", a.target, "--backends", "compiled"]
    cmd += ["--batch-size", str(a.harness_batch), "--no-search", "--no-attn-bench", "--max-len", str(a.max_len)]
    cmd += ["--ttt-length", str(a.ttt_length), "--draft-vocab-size", str(a.draft_vocab_size)]
    cmd += ["--mask-density", str(a.mask_density), "--out", str(rows), "--figure", str(a.work / "harness.png")]
    t = time.time()
    run(cmd, log)
    r = next(r for r in map(json.loads, rows.read_text().splitlines()) if r.get("backend") == "compiled")
    return {
        "path": "harness",
        "batch": a.harness_batch,
        "real_tokens_per_s": r["tokens_per_s"],
        "padded_tokens_per_s": r["tokens_per_s"],
        "packing_efficiency": 1.0,
        "peak_gib": r.get("peak_gib"),
        "step_s": r["step_s"],
        "mask_density": a.mask_density,
        "wall_s": time.time() - t,
        "command": " ".join(["python", *cmd[1:]]).replace(str(a.work), "WORK"),
    }


# train.py's options per mode (TrainConfig fields). The conversation modes say --batch-tokens 0: train.py's GPU
# default is a token budget sized from the card (issue 32), which their rows' --batch-size would not describe
MODES = {
    "pack": {"pack": "on", "batch_tokens": 0},
    "compile": {"compile": True, "pack": "off", "batch_tokens": 0},
    "pack-compile": {"compile": True, "pack": "on", "batch_tokens": 0},
    # the harness's own shape: --batch-tokens = --harness-batch rows of --max-len, filled first-fit (TokenBatches)
    "tokens": {"pack": "on"},
    "tokens-compile": {"compile": True, "pack": "on"},
}


def train_row(a: Args, target: str, mode: str, log: Path) -> dict:
    out = a.work / f"run_{mode}"
    cfg = TrainConfig(
        target=target,
        data=a.data,
        num_records=a.num_records,
        max_len=a.max_len,
        batch_size=a.batch_size,
        steps=a.steps,
        ttt_length=a.ttt_length,
        draft_vocab_size=a.draft_vocab_size,
        holdout=8,
        log_every=a.log_every,
        out=str(out),
        overwrite=True,
        backend="auto" if a.smoke else "compiled",
        **MODES[mode],
    )
    if mode.startswith("tokens"):
        cfg = dataclasses.replace(cfg, batch_tokens=a.harness_batch * a.max_len)
    cmd = [sys.executable, "train.py", *to_flags(cfg), *a.extra]
    t = time.time()
    run(cmd, log)
    return {
        "path": "train.py",
        "mode": mode,
        **train_py_figures(out, a.skip_windows),
        "data": a.data,
        "wall_s": time.time() - t,
        "command": " ".join(["python", *cmd[1:]]).replace(str(a.work), "WORK"),
    }


def main(a: Args):
    if a.smoke:
        a.target, a.max_len, a.steps, a.log_every, a.skip_windows, a.harness = "tiny", 256, 6, 2, 0, False
        a.batch_size, a.draft_vocab_size, a.num_records, a.ttt_length, a.modes = 4, 64, 40, 2, ("pack", "tokens")
        a.harness_batch = 4  # tokens: 4 rows of 256 a step
        a.out, a.work = Path("/tmp/train_throughput_smoke.jsonl"), Path("/tmp/train_throughput_smoke")
        a.out.unlink(missing_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    common = {"model": a.target, "seq": a.max_len, "ttt": a.ttt_length, **environment()}
    target = a.target
    if a.smoke:
        tok, target = load_tokenizer(resolve_target("smollm2")), str(a.work / "tiny")
        tiny_llama(vocab=len(tok), hidden=64, layers=4, heads=4, kv_heads=2).save_pretrained(target)
        tok.save_pretrained(target)
    elif a.target in PRESETS:  # a random-weight directory of the preset (~1 min for 16 GB)
        target = str(a.work / a.target)
        if not (Path(target) / "config.json").exists():
            cmd = [sys.executable, "tools/random_target.py", a.target, target, "--tokenizer", a.tokenizer]
            run(cmd, a.work / "random_target.log")
    else:
        common["model"] = Path(a.target).name
    a.out.parent.mkdir(parents=True, exist_ok=True)
    harness = None
    if a.harness and a.target in PRESETS:
        harness = write_row(a.out, {**common, **harness_row(a, a.work / "harness.log")})
    else:  # measured by an earlier invocation (e.g. the previous device call) into the same --out
        harness = earlier_harness(a.out, common)
    for mode in a.modes:
        r = {**common, **train_row(a, target, mode, a.work / f"train_{mode}.log")}
        if harness:
            r["vs_harness"] = r["real_tokens_per_s"] / harness["real_tokens_per_s"]
            r["harness_date"] = harness["date"]
        write_row(a.out, r)


def write_row(out: Path, r: dict) -> dict:
    """Append one measurement as soon as it is made (a call cut short keeps the rows before it)."""
    print(json.dumps(r), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(r) + "\n")
    os.sync()
    return r


def earlier_harness(out: Path, common: dict) -> dict | None:
    """The latest harness row in `out` for the same model, length and GPU (a run split over calls)."""
    if not out.exists():
        return None

    def same(r: dict) -> bool:
        keys_equal = all(r.get(k) == common.get(k) for k in ("model", "seq", "ttt"))
        return keys_equal and r.get("hardware", {}).get("gpu") == common["hardware"].get("gpu")

    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r.get("path") == "harness" and same(r)]
    return rows[-1] if rows else None


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
