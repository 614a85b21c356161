"""Golden numbers for a refactor: every family's per-step training metrics on a tiny random target
(and a short SmolLM2 run), CPU fp32, plus a digest of each final draft. Run it before and after a
change that must not move a number, then compare the two files bitwise:

    ./dev python tools/golden.py --out /tmp/before.json        # on the old commit
    ./dev python tools/golden.py --out /tmp/after.json --compare /tmp/before.json

The runs are train.py itself (subprocesses, OMP_NUM_THREADS=1 so the summation order is fixed).
"""

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.datasets import load_records  # noqa: E402
from models.target import load_tokenizer, resolve_target  # noqa: E402
from models.tiny import TINY_TRAIN, tiny_llama  # noqa: E402

TINY = [*TINY_TRAIN, "--steps", "4", "--eval-every", "4"]  # the tests' tiny run, 4 steps, one evaluation
RUNS = {  # name -> extra train.py flags (on the tiny target unless the name starts with smollm2)
    "eagle3": ["--strategy", "eagle3"],
    "eagle3-packed": ["--strategy", "eagle3", "--pack", "on", "--max-len", "256"],
    "eagle3-moe": ["--strategy", "eagle3", "--moe-experts", "4", "--moe-top-k", "2"],
    "eagle3-lk": ["--strategy", "eagle3", "--objective", "lk-lambda"],
    "peagle": ["--strategy", "peagle"],
    "dflash": ["--strategy", "dflash", "--num-anchors", "4"],
    "domino": ["--strategy", "domino", "--num-anchors", "4"],
    "dspark": ["--strategy", "dspark", "--num-anchors", "4"],
    "smollm2-eagle3": [
        "--strategy",
        "eagle3",
        "--num-records",
        "40",
        "--holdout",
        "4",
        "--max-len",
        "128",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--no-progress",
    ],
}


@dataclass
class Args:
    out: str
    compare: str = ""  # a file written before: the runs must match it bitwise
    only: tuple[str, ...] = ()  # a subset of the runs
    work: str = "/tmp/nanospec-golden"


def tiny_inputs(work: Path) -> tuple[Path, Path]:
    """The tests' tiny Llama (tests/conftest.py tiny_run_inputs) and its chats, built once."""
    target, chats = work / "target", work / "chats.jsonl"
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        tok = load_tokenizer(resolve_target("smollm2"))
        tiny_llama(vocab=len(tok), hidden=64, layers=4, heads=4, kv_heads=2).save_pretrained(target)
        tok.save_pretrained(target)
        with open(chats, "w") as f:
            for rec in load_records("sharegpt", limit=60):
                msgs = [
                    {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"][:200]}
                    for t in rec["conversations"][:4]
                ]
                f.write(json.dumps({"messages": msgs}) + "\n")
    return target, chats


def numbers(row: dict) -> dict:
    """The metrics of one metrics.jsonl row that must not move (not step_seconds: wall clock)."""
    return {k: v for k, v in row.items() if k in ("step", "split") or k.startswith(("loss", "acc", "grad_norm", "moe"))}


def run(name: str, extra: list[str], work: Path) -> dict:
    out = work / "runs" / name
    base = ["--out", str(out), "--overwrite"]
    if not name.startswith("smollm2"):
        target, chats = tiny_inputs(work)
        base += ["--target", str(target), "--data", str(chats), *TINY]
    cmd = [sys.executable, "train.py", *base, *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rows = [numbers(r) for r in map(json.loads, open(out / "metrics.jsonl"))]
    ck = out / "ckpt"
    final = ck / (ck / "latest").read_text().strip() / "draft.safetensors"
    return {"rows": rows, "draft_sha256": hashlib.sha256(final.read_bytes()).hexdigest()}


def main(a: Args):
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    got = {}
    for name, extra in RUNS.items():
        if a.only and name not in a.only:
            continue
        got[name] = run(name, extra, work)
        print(f"{name}: {len(got[name]['rows'])} rows, last {got[name]['rows'][-1]}", flush=True)
    Path(a.out).write_text(json.dumps(got, indent=1))
    if a.compare:
        want = json.loads(Path(a.compare).read_text())
        for w in want.values():  # files written before numbers() kept step_seconds
            w["rows"] = [numbers(r) for r in w["rows"]]
        bad = [n for n in got if got[n] != want.get(n)]
        print("identical" if not bad else f"DIFFERENT: {bad}")
        raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main(tyro.cli(Args))
